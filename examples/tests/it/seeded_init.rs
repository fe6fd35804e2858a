//! `gpt2 train --preset` with ranks as threads starts from the same weights on every run: the
//! rank threads share the backend's one random generator, and the seeded initialisation must
//! not depend on how their draws interleave.
//!
//! Reference: the first of three identical runs; the others' per-step losses and gradient norms
//! must equal it bit for bit (same seed, same data, same arithmetic).

use crate::support;
use support::*;

use zero_examples::gpt2::{train, TrainArgs};

#[test]
fn preset_runs_with_one_seed_are_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = serde_json::json!({
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 1}
    });
    let config_path = dir.path().join("config.json");
    std::fs::write(&config_path, config.to_string()).expect("config written");
    let args = TrainArgs {
        model: None,
        preset: Some("tiny".into()),
        seed: Some(7),
        ..fixture_args(&config_path, 2, 2)
    };
    let runs: Vec<Vec<(f64, f64)>> = (0..3)
        .map(|_| {
            let summary = train(&args).expect("training run");
            summary.steps.iter().map(|s| (s.loss, s.grad_norm)).collect()
        })
        .collect();
    assert_eq!(runs[0].len(), 2);
    for run in &runs[1..] {
        assert_eq!(run, &runs[0], "another run from the same seed");
    }
}

/// A config's `seed` seeds the run when --seed is not given, and --seed wins over it.
/// Reference: the run with --seed 7 and no `seed` in the config.
#[test]
fn the_configs_seed_is_the_default_of_seed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = |seed: Option<u64>| {
        let mut c = serde_json::json!({
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}
        });
        if let Some(s) = seed {
            c["seed"] = s.into();
        }
        let path = dir.path().join(format!("config-{seed:?}.json"));
        std::fs::write(&path, c.to_string()).expect("config written");
        path
    };
    let run = |path: &std::path::Path, seed: Option<u64>| {
        let args = TrainArgs {
            model: None,
            preset: Some("tiny".into()),
            seed,
            ..fixture_args(path, 1, 2)
        };
        train(&args).expect("training run").steps[0].loss
    };
    let reference = run(&config(None), Some(7));
    assert_eq!(run(&config(Some(7)), None), reference, "the config's seed");
    assert_eq!(run(&config(Some(3)), Some(7)), reference, "--seed over the config's");
    assert_ne!(
        run(&config(Some(3)), None),
        reference,
        "another seed draws other weights"
    );
}
