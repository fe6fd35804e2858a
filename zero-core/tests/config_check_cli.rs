//! `zero check-config` as a user runs it: exit status, stdout JSON, stderr warnings.
//! Reference: the rules of DeepSpeed's batch triad and defaults, checked on the printed JSON.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn check(json: &str, args: &[&str]) -> (i32, serde_json::Value, String) {
    let dir = std::env::temp_dir().join(format!(
        "zero-check-config-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ds_config.json");
    std::fs::write(&file, json).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zero"))
        .arg("check-config")
        .arg(&file)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let value = serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code().unwrap_or(-1),
        value,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn prints_resolved_config_with_defaults() {
    let (code, v, _) = check(
        r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}"#,
        &["--world-size", "4"],
    );
    assert_eq!(code, 0);
    assert_eq!(v["gradient_accumulation_steps"], 2);
    assert_eq!(v["zero_optimization"]["overlap_comm"], true);
    assert_eq!(v["zero_optimization"]["stage3_prefetch_bucket_size"], 50_000_000);
}

#[test]
fn batch_needing_world_size_says_so() {
    let (code, v, _) = check(r#"{"train_micro_batch_size_per_gpu": 4}"#, &[]);
    assert_eq!(code, 0);
    let marker = v["train_batch_size"].as_str().unwrap();
    assert!(marker.contains("--world-size"), "{marker}");
    let (_, v, _) = check(r#"{"train_micro_batch_size_per_gpu": 4}"#, &["--world-size", "3"]);
    assert_eq!(v["train_batch_size"], 12);
}

#[test]
fn model_dependent_auto_is_marked_or_resolved() {
    let cfg = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}"#;
    let (code, v, _) = check(cfg, &["--world-size", "1"]);
    assert_eq!(code, 0);
    assert!(v["zero_optimization"]["reduce_bucket_size"]
        .as_str()
        .unwrap()
        .contains("resolved at initialize"));
    let (_, v, _) = check(cfg, &["--world-size", "1", "--hidden-size", "64"]);
    assert_eq!(v["zero_optimization"]["reduce_bucket_size"], 4096);
}

#[test]
fn errors_exit_2_and_warnings_go_to_stderr() {
    let (code, v, err) = check("{\"train_batch_size\": CONFIG_BATCH_SIZE}", &[]);
    assert_eq!(code, 2);
    assert!(v.is_null());
    assert!(err.contains("CONFIG_BATCH_SIZE") && err.contains(":1:"), "{err}");
    let (code, _, err) = check(
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}"#,
        &["--world-size", "4"],
    );
    assert_eq!(code, 2);
    assert!(err.contains("world size (4)"), "{err}");
    let (code, _, err) = check(
        r#"{"train_batch_size": 8, "steps_per_prnt": 5}"#,
        &["--world-size", "1"],
    );
    assert_eq!(code, 0);
    assert!(
        err.contains("warning") && err.contains("did you mean `steps_per_print`?"),
        "{err}"
    );
}
