//! Checkpoints of a `gpt2 train` run, as a user meets them through the binary: every tag a run
//! writes loads back (the shipped config's WarmupDecayLR gives learning rates whose decimal form
//! used to parse back an ulp off, which made tags 6 and 7 of a 12-step run unreadable), and a
//! damaged shard of any rank stops `--load` with one line naming that rank's file.

mod support;

use support::train_shipped as train;

use std::path::Path;
use std::process::Output;
use zero_core::checkpoint::{self, Checkpoint};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The tag directories under `dir`, in step order.
fn tags(dir: &Path) -> Vec<String> {
    let mut tags: Vec<(u64, String)> = std::fs::read_dir(dir)
        .expect("checkpoint dir")
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .map(|t| (t.trim_start_matches("global_step").parse().unwrap_or(u64::MAX), t))
        .collect();
    tags.sort();
    tags.into_iter().map(|(_, t)| t).collect()
}

/// Whether `tag` reads back whole: metadata verified, every shard byte checked against its
/// checksum, and the weights consolidated (the path `zero to-fp32` takes); the error otherwise.
fn readable(dir: &Path, tag: &str) -> Result<usize, String> {
    let c = Checkpoint::open(dir, Some(tag)).map_err(|e| e.to_string())?;
    c.verify().map_err(|e| e.to_string())?;
    let out = tempfile::tempdir().map_err(|e| e.to_string())?;
    let report = checkpoint::to_fp32(&c, out.path(), None, &|n| Some(n.to_string())).map_err(|e| e.to_string())?;
    Ok(report.tensors)
}

#[test]
fn every_tag_of_a_12_step_run_with_the_shipped_schedule_loads_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("ckpt");
    let run = train(12, &["--save", save.to_str().unwrap(), "--save-every", "1"]);
    assert!(run.status.success(), "training must succeed: {}", stderr(&run));

    let tags = tags(&save);
    assert_eq!(tags.len(), 12, "one tag per step: {tags:?}");
    let unreadable: Vec<(String, String)> = tags
        .iter()
        .filter_map(|t| readable(&save, t).err().map(|e| (t.clone(), e)))
        .collect();
    println!(
        "checkpoints written: {}, verified readable: {}, unreadable: {}",
        tags.len(),
        tags.len() - unreadable.len(),
        unreadable.len()
    );
    assert!(unreadable.is_empty(), "unreadable tags: {unreadable:#?}");

    // And the trainer itself resumes from the newest one, taking step 13 only.
    let resumed = train(13, &["--load", save.to_str().unwrap()]);
    assert!(resumed.status.success(), "resume must succeed: {}", stderr(&resumed));
}

#[test]
fn a_damaged_shard_of_each_rank_is_named_when_loading() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("ckpt");
    let run = train(1, &["--save", save.to_str().unwrap()]);
    assert!(run.status.success(), "training must succeed: {}", stderr(&run));

    for rank in 0..2 {
        // A copy of the checkpoint with a few bytes of this rank's shard flipped, mid-file.
        let copy = dir.path().join(format!("damaged-{rank}"));
        std::fs::create_dir_all(copy.join("global_step1")).expect("mkdir");
        std::fs::copy(save.join("latest"), copy.join("latest")).expect("copy latest");
        for entry in std::fs::read_dir(save.join("global_step1")).expect("tag dir").flatten() {
            std::fs::copy(entry.path(), copy.join("global_step1").join(entry.file_name())).expect("copy");
        }
        let file = format!("rank_{rank:05}.safetensors");
        let shard = copy.join("global_step1").join(&file);
        let mut bytes = std::fs::read(&shard).expect("shard");
        let mid = bytes.len() / 2;
        for b in &mut bytes[mid..mid + 4] {
            *b ^= 0xa5;
        }
        std::fs::write(&shard, bytes).expect("damage");

        let out = train(2, &["--load", copy.to_str().unwrap()]);
        let err = stderr(&out);
        assert_eq!(
            out.status.code(),
            Some(1),
            "rank {rank}'s damaged shard must stop the load: {err}"
        );
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one line: {err}");
        assert!(lines[0].starts_with("gpt2: "), "{err}");
        for want in [file.as_str(), "checksum mismatch", "corrupt"] {
            assert!(err.contains(want), "rank {rank}: `{want}` missing from: {err}");
        }
        if rank != 0 {
            assert!(err.contains(&format!("rank {rank} failed to load")), "{err}");
        }
        println!("damaged {file}: {}", lines[0]);
    }
}
