//! `gpt2 train` under ZeRO stage 3, 4 ranks, accumulation 2, against PyTorch.
//!
//! Reference: tools/gpt2_train_reference.py trains the same HuggingFace checkpoint
//! (models/tests/fixtures/gpt2-tiny) with torch.optim.AdamW and clip_grad_norm_ on the same global
//! batch and records each step's loss and gradient norm (examples/tests/fixtures/).

use crate::support;
use support::*;

use zero_examples::gpt2::train;

#[test]
fn stage_3_on_4_ranks_with_accumulation_follows_pytorch_step_by_step() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_reference.json")).expect("fixture"))
            .expect("json");
    let losses: Vec<f64> = serde_json::from_value(reference["losses"].clone()).expect("losses");
    let norms: Vec<f64> = serde_json::from_value(reference["grad_norms"].clone()).expect("norms");

    let args = fixture_args(&fixture("train_config.json"), losses.len() as u64, 4);
    let summary = train(&args).expect("training runs");
    assert_eq!(summary.world_size, 4);
    assert_eq!(summary.steps.len(), losses.len());
    for (record, (&want_loss, &want_norm)) in summary.steps.iter().zip(losses.iter().zip(&norms)) {
        let loss_err = (record.loss - want_loss).abs() / want_loss.abs();
        let norm_err = (record.grad_norm - want_norm).abs() / want_norm.abs();
        assert!(
            loss_err < 1e-5,
            "step {}: loss {} vs PyTorch {want_loss} ({loss_err:e})",
            record.step,
            record.loss
        );
        assert!(
            norm_err < 1e-4,
            "step {}: grad norm {} vs PyTorch {want_norm} ({norm_err:e})",
            record.step,
            record.grad_norm
        );
    }
    // The run trained: the loss fell by more than a tenth.
    assert!(summary.steps[4].loss < 0.9 * summary.steps[0].loss);
}
