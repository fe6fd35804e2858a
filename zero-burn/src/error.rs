//! Errors of the engine: each says what went wrong and what to change.

use zero_core::comm::CommError;
use zero_core::loss_scaler::LossScaleError;

/// What can go wrong while setting up or running the ZeRO engine.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// A collective failed (a peer died, timed out, or called another op).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The configuration cannot be used with this model or world size.
    #[error("configuration: {0}")]
    Config(String),
    /// The model does not fit what the configuration asks for.
    #[error("model: {0}")]
    Model(String),
    /// The training loop called the engine out of order.
    #[error("usage: {0}")]
    Usage(String),
    /// The optimizer rejected its state or inputs.
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// The optimizer state could not be swapped to or from its NVMe file (the error names it).
    #[error("optimizer offload: {0}")]
    Offload(#[from] zero_core::offload::OffloadError),
    /// A checkpoint could not be saved, read or verified (the error names the file).
    #[error(transparent)]
    Checkpoint(#[from] zero_core::checkpoint::CheckpointError),
    /// A loss or gradient was infinite or NaN in bf16 or fp32 training (on some rank).
    #[error(
        "step {step}: {what} is infinite or NaN on rank {rank} ({dtype} training); the step was not \
         applied. From the first step, the weights or the data hold NaN or Inf, or values the forward \
         overflows on; later, training diverged (lower the learning rate or clip gradients). To skip \
         such steps instead of failing: \
         PrecisionSettings::non_finite = NonFinitePolicy::Skip (InitOptions::non_finite)"
    )]
    NonFinite {
        /// The optimizer step (1-based, as [`crate::StepReport::step`]).
        step: u64,
        /// What was seen: "the loss" or "the averaged gradient" (this rank's shard of it); what
        /// this rank saw when it saw one, else what the lowest rank that saw one saw.
        what: String,
        /// The rank that saw it: this rank when it saw one, else the lowest that did.
        rank: usize,
        /// The compute dtype.
        dtype: &'static str,
    },
    /// fp16 loss scaling could not go on: the gradients overflow at the minimum scale.
    #[error(
        "step {step}: the fp16 gradients overflowed with the loss scale already at its minimum ({scale}); fp16 \
         training cannot go on. Train in bf16 instead (\"bf16\": {{\"enabled\": true}}, no loss scaling needed), \
         or lower the learning rate or fp16.min_loss_scale"
    )]
    LossScale {
        /// The optimizer step (1-based, as [`crate::StepReport::step`]).
        step: u64,
        /// The scale that overflowed.
        scale: f64,
        /// The scaler's error.
        #[source]
        source: LossScaleError,
    },
}
