//! zero-burn: ZeRO (the Zero Redundancy Optimizer) for Burn.
//!
//! Wrap a Burn module in an engine and train it data-parallel with optimizer state (stage 1),
//! gradients (stage 2) and parameters (stage 3) partitioned across ranks. The engine owns what
//! happens between `backward` and the new weights: gradient averaging and accumulation, bucketed
//! reductions, clipping by the global norm, the optimizer on each rank's fp32 shard, and the
//! gathers that give the model its weights back.
//!
//! - [`ZeroEngine`]: stages 0-2 around any Burn module.
//! - [`ChainEngine`]: every stage, for models that say how they chain their blocks
//!   ([`ChainModel`]); stage 3 needs it.
//! - [`PipelineEngine`]: one pipeline stage of a model cut into layers ([`PipelineModule`]),
//!   trained on the 1F1B schedule, with ZeRO stage 0/1 over its data-parallel group.
//! - [`ZeroOptimizer`]: a `burn::optim::Optimizer`, for code written against Burn's optimizers.
//!
//! # Mixed precision
//!
//! With `"bf16": {"enabled": true}` or `"fp16": {"enabled": true}` the model's parameters and
//! gradients are 16-bit while each rank keeps fp32 master weights and optimizer state for its
//! shard ([`PrecisionSettings`]). Stage 3 keeps the 16-bit copy of its shard and gathers that
//! (half the bytes of fp32); gradients are reduced in `communication_data_type` (default: the
//! compute dtype). The model follows its parameters' dtype: float inputs must be cast by the
//! caller to `engine.compute_dtype().burn()`; integer inputs (token ids) need nothing. The loss
//! may be 16-bit: the engine casts it to fp32 before scaling it for backward.
//!
//! fp16 scales the loss with DeepSpeed's dynamic loss scaler (`zero_core::loss_scaler`); a step
//! whose gradients overflow on any rank is skipped on every rank ([`StepReport::skipped`]).
//! bf16 has no scaler: a non-finite loss or gradient fails the step with
//! [`ZeroError::NonFinite`], or skips it with [`NonFinitePolicy::Skip`]
//! (`InitOptions::non_finite`, or `settings.precision.non_finite`).
//!
//! It is not a communication library (that is `zero_core::comm`) nor a model zoo (`zero-models`).

mod chain;
mod chain_engine;
mod checkpoint;
mod core;
mod engine;
mod error;
mod flat_state;
mod half_buffer;
mod initialize;
mod memory;
mod optimizer;
mod optimizer_bridge;
pub mod params;
pub mod pipeline;
mod settings;

pub use chain::{ChainModel, Hidden};
pub use chain_engine::{ChainEngine, ChainLoss};
pub use core::StepReport;
pub use engine::ZeroEngine;
pub use error::ZeroError;
pub use initialize::{
    engine_settings, initialize, initialize_chain, initialize_with, lr_schedule, optimizer_offload, optimizer_spec,
    precision_settings, resolve, InitOptions,
};
pub use memory::{Bytes, LocationSplit, Locations, MemoryReport};
pub use optimizer::ZeroOptimizer;
pub use pipeline::{LayerSpec, PartitionMethod, PipeLayer, PipelineEngine, PipelineModule};
pub use settings::{ComputeDtype, EngineSettings, LrFn, NonFinitePolicy, OptimizerOffload, PrecisionSettings, Stage};
