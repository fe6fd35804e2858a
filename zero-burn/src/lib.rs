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
//! - [`ZeroOptimizer`]: a `burn::optim::Optimizer`, for code written against Burn's optimizers.
//!
//! It is not a communication library (that is `zero_core::comm`) nor a model zoo (`zero-models`).

mod chain;
mod checkpoint;
mod chain_engine;
mod core;
mod engine;
mod error;
mod flat_state;
mod initialize;
mod memory;
mod optimizer;
mod optimizer_bridge;
pub mod params;
mod settings;

pub use chain::{ChainModel, Hidden};
pub use chain_engine::{ChainEngine, ChainLoss};
pub use core::StepReport;
pub use engine::ZeroEngine;
pub use error::ZeroError;
pub use initialize::{
    engine_settings, initialize, initialize_chain, initialize_with, lr_schedule, optimizer_spec, resolve, InitOptions,
};
pub use memory::{Bytes, MemoryReport};
pub use optimizer::ZeroOptimizer;
pub use settings::{EngineSettings, LrFn, Stage};
