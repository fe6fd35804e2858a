//! Every kind of damage is found before any value is handed out, and the error names the file
//! and says what is wrong. Reference: an intact checkpoint of the same run, which loads.

mod checkpoint_support;

use checkpoint_support::*;
use std::path::{Path, PathBuf};
use zero_core::checkpoint::{self, Checkpoint, CheckpointError, TensorParallelCheckpoint};

/// A world-3 stage-2 checkpoint in a fresh directory; returns (dir, tag dir).
fn fresh(name: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    save_reference(&dir, "t", 3, 2, 2, "");
    let tag_dir = dir.join("t");
    (dir, tag_dir)
}

/// Loads at world 2 (between them the ranks read every old shard): every rank must fail; returns
/// the error of a rank that met the damage (the others report that a peer failed).
fn load_error(dir: &Path) -> CheckpointError {
    let dir = dir.to_path_buf();
    let errors = on_ranks(2, move |_, comm| {
        let new = layout(specs(""), 2, 1);
        checkpoint::load(comm.as_ref(), &dir, None, &new).err()
    });
    assert!(errors.iter().all(Option::is_some), "every rank must fail: {errors:?}");
    errors
        .into_iter()
        .flatten()
        .find(|e| !matches!(e, CheckpointError::PeerFailed { .. }))
        .expect("some rank must report the damage itself")
}

fn assert_names(err: &CheckpointError, file: &str, what: &str) {
    let text = err.to_string();
    assert!(text.contains(file), "the error must name `{file}`: {text}");
    assert!(text.contains(what), "the error must say `{what}`: {text}");
}

#[test]
fn intact_checkpoint_loads() {
    let (dir, _) = fresh("intact");
    let dir2 = dir.clone();
    let ok = on_ranks(2, move |_, comm| {
        checkpoint::load(comm.as_ref(), &dir2, None, &layout(specs(""), 2, 1)).is_ok()
    });
    assert_eq!(ok, vec![true, true]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_shard() {
    let (dir, tag) = fresh("missing");
    std::fs::remove_file(tag.join("rank_00001.safetensors")).unwrap();
    let e = load_error(&dir);
    assert!(matches!(e, CheckpointError::Missing { .. }), "{e}");
    assert_names(&e, "rank_00001.safetensors", "missing");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn truncated_shard() {
    let (dir, tag) = fresh("truncated");
    let path = tag.join("rank_00002.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let e = load_error(&dir);
    assert!(matches!(e, CheckpointError::Length { .. }), "{e}");
    assert_names(&e, "rank_00002.safetensors", "truncated");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn flipped_byte_in_values_and_in_header() {
    for at_end in [true, false] {
        let (dir, tag) = fresh(if at_end { "flip-values" } else { "flip-header" });
        let path = tag.join("rank_00000.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let i = if at_end { bytes.len() - 3 } else { 20 };
        bytes[i] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let e = load_error(&dir);
        assert!(matches!(e, CheckpointError::Checksum { .. }), "{e}");
        assert_names(&e, "rank_00000.safetensors", "checksum mismatch");
        // The converter checks the same sums.
        let c = Checkpoint::open(&dir, None).unwrap();
        assert!(c.verify().is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn shard_from_another_save_does_not_match_the_metadata() {
    // Same shapes, other values: lengths agree, the checksums do not.
    let (dir, tag) = fresh("swapped");
    let other = scratch("swapped-other");
    save_reference(&other, "t", 3, 2, 9, "");
    std::fs::copy(
        other.join("t/rank_00001.safetensors"),
        tag.join("rank_00001.safetensors"),
    )
    .unwrap();
    let e = load_error(&dir);
    assert_names(&e, "rank_00001.safetensors", "checksum");
    // A shard of a run at another world size: other tensors, other length.
    save_reference(&other, "w2", 2, 2, 2, "");
    std::fs::copy(
        other.join("w2/rank_00001.safetensors"),
        tag.join("rank_00001.safetensors"),
    )
    .unwrap();
    let e = load_error(&dir);
    assert_names(&e, "rank_00001.safetensors", "metadata");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&other).ok();
}

#[test]
fn edited_metadata() {
    let (dir, tag) = fresh("meta");
    let path = tag.join("zero_meta.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replacen("\"global_step\": 2", "\"global_step\": 3", 1)).unwrap();
    let e = load_error(&dir);
    assert!(matches!(e, CheckpointError::Metadata { .. }), "{e}");
    assert_names(&e, "zero_meta.json", "checksum mismatch");
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    assert_names(&load_error(&dir), "zero_meta.json", "not readable JSON");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn checkpoint_of_another_model() {
    let (dir, _) = fresh("other-model");
    let dir2 = dir.clone();
    let errors = on_ranks(2, move |_, comm| {
        let mut specs = specs("");
        specs[3].shape = vec![10, 11];
        checkpoint::load(comm.as_ref(), &dir2, None, &layout(specs, 2, 1)).err()
    });
    let e = errors.into_iter().next().flatten().expect("must not load");
    assert!(matches!(e, CheckpointError::OtherModel { .. }), "{e}");
    assert_names(&e, "zero_meta.json", "layer3.weight");
    let dir3 = dir.clone();
    let errors = on_ranks(1, move |_, comm| {
        checkpoint::load(comm.as_ref(), &dir3, None, &layout(specs("encoder."), 1, 1)).err()
    });
    let e = errors.into_iter().next().flatten().expect("must not load");
    assert_names(&e, "zero_meta.json", "encoder.layer0.weight");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn no_latest_and_unknown_tag() {
    let dir = scratch("empty");
    let e = Checkpoint::open(&dir, None).unwrap_err();
    assert_names(&e, "latest", "missing");
    let e = Checkpoint::open(&dir, Some("nope")).unwrap_err();
    assert_names(&e, "nope", "no such checkpoint tag");
    // A `latest` longer than any directory name is refused without being echoed.
    std::fs::write(dir.join("latest"), "x".repeat(100_000)).unwrap();
    let e = Checkpoint::open(&dir, None).unwrap_err();
    assert_names(&e, "latest", "100000 bytes");
    assert!(e.to_string().len() < 1000, "{} bytes of error", e.to_string().len());
    std::fs::remove_dir_all(&dir).ok();
}

/// A tag that leads out of the checkpoint directory is refused, given or named by `latest`,
/// though where it leads holds a complete checkpoint that would load: `base/ckpt` is the
/// directory, `base/escape` the checkpoint beside it.
#[test]
fn a_tag_leading_out_of_the_directory_is_refused() {
    let base = scratch("traversal");
    let dir = base.join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    save_reference(&base, "escape", 3, 2, 2, "");
    let outside = base.join("escape");
    Checkpoint::open(&base, Some("escape")).expect("the checkpoint outside opens by its own name");
    assert!(
        dir.join("../escape/zero_meta.json").is_file(),
        "the traversal would reach it"
    );
    for tag in ["../escape".to_string(), outside.display().to_string()] {
        let e = Checkpoint::open(&dir, Some(&tag)).expect_err("a tag leading out of the directory");
        assert!(matches!(e, CheckpointError::Tag { .. }), "{tag}: {e}");
        assert_names(&e, &format!("`{tag}` cannot be a tag"), "plain directory name");
        let dir2 = dir.clone();
        let tag2 = tag.clone();
        let errors = on_ranks(2, move |_, comm| {
            checkpoint::load(comm.as_ref(), &dir2, Some(&tag2), &layout(specs(""), 2, 1)).err()
        });
        assert!(
            errors.iter().all(Option::is_some),
            "{tag}: every rank must refuse: {errors:?}"
        );
        let e = errors
            .into_iter()
            .flatten()
            .find(|e| !matches!(e, CheckpointError::PeerFailed { .. }))
            .expect("some rank must report the tag itself");
        assert_names(&e, &format!("`{tag}` cannot be a tag"), "plain directory name");
        std::fs::write(dir.join("latest"), &tag).unwrap();
        let e = Checkpoint::open(&dir, None).expect_err("`latest` naming a place outside");
        assert_names(&e, "latest", &format!("names `{tag}`, which is not a tag"));
    }
    std::fs::remove_dir_all(&base).ok();
}

/// Without `latest`: a save that never finished names the tags that are there; a tag's own
/// directory, opened as the checkpoint directory, says to give the one above it.
#[test]
fn without_latest_the_tags_there_are_named() {
    let (dir, tag) = fresh("no-latest");
    std::fs::remove_file(dir.join("latest")).unwrap();
    let e = Checkpoint::open(&dir, None).unwrap_err();
    assert_names(&e, "latest", "the tags here are t");
    let e = Checkpoint::open(&tag, None).unwrap_err();
    assert_names(
        &e,
        "the directory of one checkpoint, tag `t`",
        &dir.display().to_string(),
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A directory that does not exist, and a tag whose metadata file is gone, are said to be what
/// they are (not "no checkpoint was completed", not a file the metadata lists).
#[test]
fn a_missing_directory_and_missing_metadata_say_so() {
    let e = Checkpoint::open(Path::new("/nonexistent/zero/ckpt"), None).unwrap_err();
    assert_names(&e, "/nonexistent/zero/ckpt", "no such directory");
    assert!(!e.to_string().contains("latest"), "{e}");
    // A file where the directory should be is said to be one.
    let (dir, _) = fresh("a-file");
    let file = dir.join("plain");
    std::fs::write(&file, "x").unwrap();
    let e = Checkpoint::open(&file, None).unwrap_err();
    assert_names(&e, "plain", "is not a directory");
    std::fs::remove_dir_all(&dir).ok();
    let (dir, tag) = fresh("no-meta");
    std::fs::remove_file(tag.join("zero_meta.json")).unwrap();
    let e = Checkpoint::open(&dir, None).unwrap_err();
    assert!(matches!(e, CheckpointError::Metadata { .. }), "{e}");
    assert_names(&e, "zero_meta.json", "holds no metadata");
    std::fs::remove_dir_all(&dir).ok();
}

/// A tensor-parallel checkpoint (one complete checkpoint per `tensor_rank_{t}`) opened whole
/// by something that is not split the same way: the error names the tensor ranks' directories
/// and what opens them, instead of saying that no checkpoint was completed.
#[test]
fn a_tensor_parallel_checkpoint_opened_whole_names_its_tensor_ranks() {
    let dir = scratch("tensor-ranks");
    for t in [1, 0] {
        save_reference(&dir.join(format!("tensor_rank_{t}")), "t", 2, 1, 2, "");
    }
    let e = Checkpoint::open(&dir, None).unwrap_err().to_string();
    for want in [
        "tensor-parallel checkpoint",
        "tensor_rank_0, tensor_rank_1",
        "autotp_size (2)",
        "zero to-fp32",
    ] {
        assert!(e.contains(want), "{want:?} missing from: {e}");
    }
    // Each tensor rank's directory is a checkpoint of its own; opened together they must each
    // record their split, which these (saved without one) do not.
    let one = Checkpoint::open(&dir.join("tensor_rank_1"), None).expect("a tensor rank's checkpoint opens");
    assert_eq!(one.meta.world_size, 2);
    let e = TensorParallelCheckpoint::open(&dir, None).unwrap_err().to_string();
    assert!(e.contains("records no tensor-parallel split"), "{e}");
    // A missing tensor rank is named.
    std::fs::remove_dir_all(dir.join("tensor_rank_0")).unwrap();
    let e = TensorParallelCheckpoint::open(&dir, None).unwrap_err().to_string();
    assert!(e.contains("tensor_rank_{1}, expected 0 to 0"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
