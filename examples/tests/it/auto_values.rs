//! A DeepSpeed config that leaves values "auto" (as the configs written for HuggingFace's
//! Trainer do) trains under `gpt2 train` once `--set` supplies them, the schedule's length
//! filled from `--steps`; without them the run is refused before it starts, naming the key
//! and `--set`. Reference: the same run from a config with those values written in.

use crate::support;
use zero_examples::gpt2::{train, TrainArgs};

/// The fixture's config, with `edit` applied, under `dir`.
fn config(dir: &std::path::Path, name: &str, edit: impl Fn(&mut serde_json::Value)) -> std::path::PathBuf {
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(support::fixture("train_config.json")).unwrap()).unwrap();
    config["scheduler"] = serde_json::json!({
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 1, "warmup_max_lr": 0.001, "total_num_steps": 3}
    });
    edit(&mut config);
    let path = dir.join(name);
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

#[test]
fn auto_values_come_from_set_and_the_step_count() {
    let dir = tempfile::tempdir().unwrap();
    let written = config(dir.path(), "written.json", |_| {});
    let auto = config(dir.path(), "auto.json", |c| {
        c["train_batch_size"] = "auto".into();
        c["train_micro_batch_size_per_gpu"] = "auto".into();
        c["gradient_accumulation_steps"] = "auto".into();
        c["optimizer"]["params"]["lr"] = "auto".into();
        c["scheduler"]["params"]["total_num_steps"] = "auto".into();
    });
    let want = train(&support::fixture_args(&written, 3, 4)).expect("the written config trains");

    let refused = train(&support::fixture_args(&auto, 3, 4)).expect_err("auto values with nothing to fill them");
    let message = refused.to_string();
    assert!(message.contains("--set"), "{message}");

    let set = |items: &[&str]| TrainArgs {
        set: items.iter().map(|s| s.to_string()).collect(),
        ..support::fixture_args(&auto, 3, 4)
    };
    let got = train(&set(&[
        "train_micro_batch_size_per_gpu=1",
        "gradient_accumulation_steps=2",
        "optimizer.params.lr=0.001",
    ]))
    .expect("the auto config trains with --set");
    let losses = |s: &zero_examples::gpt2::TrainSummary| s.steps.iter().map(|r| r.loss).collect::<Vec<_>>();
    assert_eq!(losses(&got), losses(&want), "the same run as the written config");
    assert_eq!(
        got.steps.iter().map(|r| r.lr).collect::<Vec<_>>(),
        want.steps.iter().map(|r| r.lr).collect::<Vec<_>>(),
        "the schedule's length from --steps"
    );

    // A key the file writes as a number is not the script's to set.
    let e = train(&set(&["gradient_clipping=0.5"]))
        .expect_err("not auto in the file")
        .to_string();
    assert!(e.contains("--set") && e.contains("gradient_clipping"), "{e}");
}
