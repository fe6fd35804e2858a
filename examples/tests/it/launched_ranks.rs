//! `gpt2 train` with one process per rank (torchrun-style environment: MASTER_ADDR, MASTER_PORT,
//! RANK, WORLD_SIZE, LOCAL_RANK) gives the same per-step losses as the ranks-as-threads run and
//! PyTorch (reference: tools/gpt2_train_reference.py's fixture), and only rank 0 writes metrics.

use crate::support;
use support::fixture;

use std::path::PathBuf;
use std::process::Command;

#[test]
fn four_processes_train_like_pytorch_and_only_rank_0_writes_metrics() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_reference.json")).expect("fixture"))
            .expect("json");
    let losses: Vec<f64> = serde_json::from_value(reference["losses"].clone()).expect("losses");
    let port = zero_core::launch::free_port().expect("a free port");
    let dir = tempfile::tempdir().expect("temp dir");
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/gpt2-tiny");
    let children: Vec<_> = (0..4)
        .map(|rank| {
            let metrics = dir.path().join(format!("metrics-{rank}.jsonl"));
            Command::new(env!("CARGO_BIN_EXE_gpt2"))
                .args([
                    "train",
                    "--quiet",
                    "--steps",
                    &losses.len().to_string(),
                    "--seq-len",
                    "16",
                ])
                .arg("--config")
                .arg(fixture("train_config.json"))
                .arg("--tokens")
                .arg(fixture("train_tokens.json"))
                .arg("--model")
                .arg(&model)
                .arg("--metrics")
                .arg(&metrics)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("LOCAL_RANK", rank.to_string())
                .env("ZERO_COMM_TIMEOUT_SECS", "60")
                .spawn()
                .expect("start a rank")
        })
        .collect();
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait().expect("wait");
        assert!(status.success(), "rank {rank} failed: {status}");
    }
    for rank in 1..4 {
        assert!(
            !dir.path().join(format!("metrics-{rank}.jsonl")).exists(),
            "rank {rank} wrote metrics"
        );
    }
    let text = std::fs::read_to_string(dir.path().join("metrics-0.jsonl")).expect("rank 0's metrics");
    let mut lines = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json line"));
    let header = lines.next().expect("the header line");
    assert_eq!(header["run"]["world_size"], 4, "{header}");
    let got: Vec<f64> = lines.map(|l| l["loss"].as_f64().expect("loss")).collect();
    assert_eq!(got.len(), losses.len());
    for (step, (g, w)) in got.iter().zip(&losses).enumerate() {
        let err = (g - w).abs() / w.abs();
        assert!(err < 1e-5, "step {}: loss {g} vs PyTorch {w} ({err:e})", step + 1);
    }
}
