//! A checkpoint split over tensor ranks, damaged or mixed with another, as `gpt2 train --load`
//! and `--save` meet it: every fault stops the run with an error that names the directory or
//! file at fault, before anything is read into a model, never a silent load of the wrong slices
//! and never only "a rank is gone". Reference: the intact checkpoint, which resumes.

use crate::support;
use std::path::{Path, PathBuf};
use zero_examples::gpt2::{train, TrainArgs};

/// The fixture's config at ZeRO 3 with `tensor` tensor ranks of 2, written under `dir`.
fn config(dir: &Path, tensor: usize) -> PathBuf {
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(support::fixture("train_config.json")).unwrap()).unwrap();
    config["gradient_accumulation_steps"] = serde_json::json!(8 / (2 / tensor));
    config["zero_optimization"] = serde_json::json!({ "stage": 3 });
    config["tensor_parallel"] = serde_json::json!({ "autotp_size": tensor });
    let path = dir.join(format!("tp{tensor}.json"));
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

fn args(config: &Path, steps: u64, save: Option<&Path>, load: Option<&Path>) -> TrainArgs {
    TrainArgs {
        save: save.map(Path::to_path_buf),
        load: load.map(Path::to_path_buf),
        ..support::fixture_args(config, steps, 2)
    }
}

/// `cp -r from to`.
fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Resuming `ckpt` for one more step fails; the error.
fn refused(config: &Path, ckpt: &Path) -> String {
    match train(&args(config, 3, None, Some(ckpt))) {
        Ok(_) => panic!("{} resumed", ckpt.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damaged_or_mixed_tensor_parallel_checkpoints_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let tp = config(dir.path(), 2);
    let ckpt = dir.path().join("ckpt");
    train(&args(&tp, 2, Some(&ckpt), None)).expect("training saves");
    train(&args(&tp, 3, None, Some(&ckpt))).expect("the intact checkpoint resumes");

    // The tensor ranks' directories swapped: each holds the other rank's slices.
    let swapped = dir.path().join("swapped");
    copy(&ckpt.join("tensor_rank_0"), &swapped.join("tensor_rank_1"));
    copy(&ckpt.join("tensor_rank_1"), &swapped.join("tensor_rank_0"));
    let e = refused(&tp, &swapped);
    assert!(
        e.contains("records tensor rank 1 of 2") && e.contains("tensor_rank_0"),
        "{e}"
    );

    // A third tensor rank's directory beside the two.
    let extra = dir.path().join("extra");
    copy(&ckpt, &extra);
    copy(&ckpt.join("tensor_rank_1"), &extra.join("tensor_rank_2"));
    let e = refused(&tp, &extra);
    assert!(e.contains("tensor rank"), "{e}");
    assert!(!e.contains("is gone"), "the cause, not its consequence: {e}");

    // One tensor rank's directory missing.
    let missing = dir.path().join("missing");
    copy(&ckpt, &missing);
    std::fs::remove_dir_all(missing.join("tensor_rank_1")).unwrap();
    let e = refused(&tp, &missing);
    assert!(!e.contains("is gone"), "the cause, not its consequence: {e}");

    // A shard of tensor rank 1 cut short.
    let truncated = dir.path().join("truncated");
    copy(&ckpt, &truncated);
    let shard = std::fs::read_dir(truncated.join("tensor_rank_1/global_step2"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a shard file");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let e = refused(&tp, &truncated);
    assert!(
        e.contains(&shard.file_name().unwrap().to_string_lossy().to_string()) && !e.contains("is gone"),
        "names the file: {e}"
    );

    // A run without tensor parallelism saving beside the split checkpoint: refused before it
    // trains, the split one left as it was.
    let whole = config(dir.path(), 1);
    let e = match train(&args(&whole, 1, Some(&ckpt), None)) {
        Ok(_) => panic!("saved beside a split checkpoint"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("--save") && e.contains("tensor_rank_*"), "{e}");
    assert!(!ckpt.join("latest").exists(), "nothing written");
    train(&args(&tp, 3, None, Some(&ckpt))).expect("the split checkpoint still resumes");
}
