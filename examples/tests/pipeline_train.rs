//! `gpt2 train` with pipeline parallelism against PyTorch.
//!
//! Reference: the same PyTorch run as tests/train_against_pytorch.rs (tools/gpt2_train_reference.py:
//! the HuggingFace checkpoint models/tests/fixtures/gpt2-tiny, torch.optim.AdamW, clip_grad_norm_
//! at 1.0, global batch of 8 sequences), recorded in tests/fixtures/train_reference.json. The
//! pipelined runs cut the same model into stages (and tensor slices) and must report the same
//! per-step loss (the full model's) and gradient norm (the global one, over every stage and
//! tensor rank).

mod support;

use support::*;

use std::path::PathBuf;
use zero_examples::gpt2::train;

/// The reference's config with a pipeline: `stages` stages, ZeRO `zero_stage`, and the
/// accumulation that keeps the global batch at 8 on `nproc` ranks.
fn pipelined_config(dir: &std::path::Path, stages: usize, tensor: usize, nproc: usize, zero_stage: u64) -> PathBuf {
    let text = std::fs::read_to_string(fixture("train_config.json")).expect("fixture");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("json");
    let data = nproc / (stages * tensor);
    config["gradient_accumulation_steps"] = serde_json::json!(8 / data);
    config["zero_optimization"] = serde_json::json!({ "stage": zero_stage });
    config["pipeline"] = serde_json::json!({ "stages": stages, "partition": "uniform" });
    config["tensor_parallel"] = serde_json::json!({ "autotp_size": tensor });
    let path = dir.join(format!("pp{stages}_tp{tensor}_dp{data}.json"));
    std::fs::write(&path, config.to_string()).expect("write config");
    path
}

fn run_against_pytorch(stages: usize, nproc: usize, zero_stage: u64) {
    run_against_pytorch_with(stages, 1, nproc, zero_stage);
}

fn run_against_pytorch_with(stages: usize, tensor: usize, nproc: usize, zero_stage: u64) {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_reference.json")).expect("fixture"))
            .expect("json");
    let losses: Vec<f64> = serde_json::from_value(reference["losses"].clone()).expect("losses");
    let norms: Vec<f64> = serde_json::from_value(reference["grad_norms"].clone()).expect("norms");
    let dir = tempfile::tempdir().expect("temp dir");
    let config = pipelined_config(dir.path(), stages, tensor, nproc, zero_stage);
    let args = fixture_args(&config, losses.len() as u64, nproc);
    let summary = train(&args).expect("training runs");
    assert_eq!(summary.world_size, nproc);
    assert_eq!(summary.steps.len(), losses.len());
    // Every rank reports its memory, and each holds only part of the model's parameters.
    let parameters: Vec<usize> = summary.steps[0].memory.iter().map(|m| m.parameters.current).collect();
    assert_eq!(parameters.len(), nproc);
    // (fp32: 4 bytes per parameter; the whole model would be `summary.parameters * 4`.)
    assert!(
        parameters.iter().all(|&p| p > 0 && p < summary.parameters * 4),
        "{parameters:?} bytes per rank of a {}-parameter model",
        summary.parameters
    );
    for (record, (&want_loss, &want_norm)) in summary.steps.iter().zip(losses.iter().zip(&norms)) {
        let loss_err = (record.loss - want_loss).abs() / want_loss.abs();
        let norm_err = (record.grad_norm - want_norm).abs() / want_norm.abs();
        assert!(
            loss_err < 1e-5,
            "PP {stages} × TP {tensor} on {nproc} ranks, step {}: loss {} vs PyTorch {want_loss} ({loss_err:e})",
            record.step,
            record.loss
        );
        assert!(
            norm_err < 1e-4,
            "PP {stages} × TP {tensor} on {nproc} ranks, step {}: grad norm {} vs PyTorch {want_norm} ({norm_err:e})",
            record.step,
            record.grad_norm
        );
    }
}

#[test]
fn two_stages_times_two_data_ranks_follow_pytorch() {
    run_against_pytorch(2, 4, 1);
}

/// ZeRO stage 2 over the data ranks of each stage.
#[test]
fn two_stages_times_two_data_ranks_under_zero_2_follow_pytorch() {
    run_against_pytorch(2, 4, 2);
}

#[test]
fn four_stages_follow_pytorch() {
    run_against_pytorch(4, 4, 0);
}

#[test]
fn tensor_2_times_pipeline_2_follow_pytorch() {
    run_against_pytorch_with(2, 2, 4, 0);
}

#[test]
fn tensor_2_times_data_2_without_a_pipeline_follow_pytorch() {
    run_against_pytorch_with(1, 2, 4, 1);
}

#[test]
fn tensor_parallelism_at_stage_3_is_refused_naming_the_keys_and_what_works() {
    // Not the pipeline's message: this config asks for no pipeline.
    let dir = tempfile::tempdir().expect("temp dir");
    let config = pipelined_config(dir.path(), 1, 2, 2, 3);
    let err = train(&fixture_args(&config, 1, 2)).expect_err("refused").to_string();
    for want in [
        "zero_optimization.stage 3",
        "tensor_parallel.autotp_size 2",
        "stages 0-2",
        "with_tensor_parallel",
    ] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
    assert!(!err.contains("pipeline parallelism"), "{err}");
}
