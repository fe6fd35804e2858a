//! Whichever rank's error is printed, it names every rank that failed, the file and what is
//! wrong with it: damage that only rank 1 reads must reach rank 0's error (the one a
//! multi-threaded trainer prints), and two ranks failing for different reasons are both told.

mod checkpoint_support;

use checkpoint_support::*;
use std::path::{Path, PathBuf};
use zero_core::checkpoint::{self, CheckpointError};

/// A world-2 stage-2 checkpoint: loaded at world 2 with the same layout, each rank reads only
/// its own shard file.
fn fresh(name: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    save_reference(&dir, "t", 2, 2, 3, "");
    let tag = dir.join("t");
    (dir, tag)
}

/// Every rank's load error, in rank order (every rank must fail).
fn load_errors(dir: &Path) -> Vec<CheckpointError> {
    let dir = dir.to_path_buf();
    let errors = on_ranks(2, move |_, comm| {
        checkpoint::load(comm.as_ref(), &dir, None, &layout(specs(""), 2, 2)).err()
    });
    errors
        .into_iter()
        .enumerate()
        .map(|(r, e)| e.unwrap_or_else(|| panic!("rank {r} must fail too")))
        .collect()
}

fn flip_last_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn rank_1s_damaged_shard_is_named_in_rank_0s_error() {
    let (dir, tag) = fresh("rank1-flip");
    flip_last_byte(&tag.join("rank_00001.safetensors"));
    let errors = load_errors(&dir);
    // Rank 1 met the damage itself.
    assert!(matches!(errors[1], CheckpointError::Checksum { .. }), "{}", errors[1]);
    // Rank 0 read only its own intact shard, and must still say which file of which rank is
    // damaged, and how.
    let e = &errors[0];
    assert!(
        matches!(e, CheckpointError::PeerFailed { failures, .. } if failures.len() == 1 && failures[0].rank == 1),
        "{e:?}"
    );
    let text = e.to_string();
    println!("rank 0: {text}");
    for part in ["rank 1", "rank_00001.safetensors", "checksum mismatch", "load"] {
        assert!(text.contains(part), "rank 0's error must say `{part}`: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn two_ranks_failing_differently_are_both_told() {
    let (dir, tag) = fresh("both-ranks");
    flip_last_byte(&tag.join("rank_00000.safetensors"));
    let shard1 = tag.join("rank_00001.safetensors");
    let bytes = std::fs::read(&shard1).unwrap();
    std::fs::write(&shard1, &bytes[..bytes.len() - 8]).unwrap();
    let errors = load_errors(&dir);
    for (rank, e) in errors.iter().enumerate() {
        let text = e.to_string();
        for part in [
            "rank_00000.safetensors",
            "checksum mismatch",
            "rank_00001.safetensors",
            "truncated",
        ] {
            assert!(text.contains(part), "rank {rank}'s error must say `{part}`: {text}");
        }
    }
    // Each rank's own error stays first and typed, the other's is added.
    match &errors[0] {
        CheckpointError::AlsoFailed { own, others, .. } => {
            assert!(matches!(**own, CheckpointError::Checksum { .. }), "{own}");
            assert_eq!(others.iter().map(|f| f.rank).collect::<Vec<_>>(), [1]);
        }
        other => panic!("rank 0: {other:?}"),
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_same_error_on_two_ranks_is_said_once() {
    // Loaded at world 1, a world-2 checkpoint's files are both read by rank 0 only; at world 2
    // from a world-3 save, both ranks read the middle file: a missing one fails both alike.
    let dir = scratch("same-error");
    save_reference(&dir, "t", 3, 2, 3, "");
    std::fs::remove_file(dir.join("t/rank_00001.safetensors")).unwrap();
    let errors = load_errors(&dir);
    for (rank, e) in errors.iter().enumerate() {
        assert!(matches!(e, CheckpointError::Missing { .. }), "rank {rank}: {e:?}");
        assert_eq!(e.to_string().matches("rank_00001.safetensors").count(), 1, "{e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
