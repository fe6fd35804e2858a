//! `gpt2 train --save` for 3 steps, then `--load` to step 5, against one uninterrupted 5-step
//! run, under ZeRO stage 3 on 2 ranks.
//!
//! Reference: the uninterrupted run. The resumed run must reproduce its steps 4 and 5 (loss and
//! gradient norm, bit for bit: same data, same weights, same optimizer state, same arithmetic)
//! and end with the same checkpoint: every shard (fp32 masters and Adam moments) byte for byte.

use crate::support;
use support::*;

use std::path::{Path, PathBuf};
use zero_examples::gpt2::{train, TrainArgs};

fn args(config: &Path, steps: u64, save: &Path, load: Option<&Path>) -> TrainArgs {
    TrainArgs {
        save: Some(save.to_path_buf()),
        load: load.map(Path::to_path_buf),
        ..fixture_args(config, steps, 2)
    }
}

/// Every file under `dir`, relative path → bytes.
fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("readable dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).expect("readable file");
                out.push((path.strip_prefix(dir).unwrap().to_path_buf(), bytes));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn stage_3_resume_after_3_steps_matches_an_uninterrupted_5_step_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Stage 3 with a persistence threshold below most tensors, so that the weights live only in
    // the shards; a warmup from a non-zero LR makes the schedule's position part of what must survive.
    let config = serde_json::json!({
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0002, "warmup_max_lr": 0.001, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}
    });
    let config_path = dir.path().join("config.json");
    std::fs::write(&config_path, config.to_string()).expect("config written");
    let whole_dir = dir.path().join("whole");
    let split_dir = dir.path().join("split");

    let whole = train(&args(&config_path, 5, &whole_dir, None)).expect("5-step run");
    let first = train(&args(&config_path, 3, &split_dir, None)).expect("3-step run");
    let resumed = train(&args(&config_path, 5, &split_dir, Some(&split_dir))).expect("resumed run");

    assert_eq!(whole.steps.len(), 5);
    for r in &whole.steps {
        println!("step {}: loss {} lr {} grad norm {}", r.step, r.loss, r.lr, r.grad_norm);
    }
    assert_eq!(first.steps.len(), 3);
    let resumed_steps: Vec<u64> = resumed.steps.iter().map(|r| r.step).collect();
    assert_eq!(resumed_steps, [4, 5], "the resumed run takes steps 4 and 5 only");
    for (a, b) in first.steps.iter().zip(&whole.steps) {
        assert_eq!(a.loss, b.loss, "step {} before the save", a.step);
    }
    for (r, w) in resumed.steps.iter().zip(&whole.steps[3..]) {
        assert_eq!(r.step, w.step);
        assert_eq!(r.loss, w.loss, "step {}: resumed loss vs uninterrupted", r.step);
        assert_eq!(r.grad_norm, w.grad_norm, "step {}: grad norm", r.step);
        assert_eq!(r.lr, w.lr, "step {}: LR schedule position", r.step);
    }
    // The run trained: a resumed run that silently restarted from the initial weights would
    // have step 4's loss near step 1's.
    assert!(whole.steps[4].loss < whole.steps[0].loss);

    // The final weights and optimizer state: the step-5 checkpoints agree byte for byte.
    let tag = "global_step5";
    let a = files(&whole_dir.join(tag));
    let b = files(&split_dir.join(tag));
    assert!(!a.is_empty(), "the 5-step run saved {tag}");
    let names = |v: &[(PathBuf, Vec<u8>)]| v.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b));
    for ((path, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{}: differs between the runs", path.display());
    }

    // One tag named by its own directory (`--load DIR/TAG`, here the step-3 save, no longer
    // `latest`) resumes the same way.
    let by_tag = train(&args(
        &config_path,
        5,
        &dir.path().join("by_tag"),
        Some(&split_dir.join("global_step3")),
    ))
    .expect("resumed from the tag's directory");
    let losses = |s: &[zero_examples::gpt2::StepRecord]| s.iter().map(|r| (r.step, r.loss)).collect::<Vec<_>>();
    assert_eq!(losses(&by_tag.steps), losses(&resumed.steps));
}
