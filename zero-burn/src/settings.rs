//! What the engine needs to know from the configuration, as plain values.

use zero_core::optim::OptimizerSpec;

/// Which model states are partitioned (DeepSpeed's `zero_optimization.stage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Stage {
    /// Plain data parallelism: gradients all-reduced, everything replicated.
    Zero0,
    /// Optimizer state and fp32 master weights partitioned.
    Zero1,
    /// Gradients partitioned too, reduce-scattered as they are produced.
    Zero2,
    /// Parameters partitioned too, gathered per block for its forward and backward.
    Zero3,
}

impl Stage {
    /// The stage from its number.
    pub fn from_number(n: u8) -> Option<Stage> {
        [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3].get(n as usize).copied()
    }

    /// The stage's number.
    pub fn number(self) -> u8 {
        self as u8
    }
}

/// A learning rate as a function of the optimizer step (0-based).
pub type LrFn = std::sync::Arc<dyn Fn(u64) -> f64 + Send + Sync>;

/// The engine's settings, resolved from a DeepSpeed config (see [`crate::initialize`]).
#[derive(Clone)]
pub struct EngineSettings {
    /// ZeRO stage.
    pub stage: Stage,
    /// Micro-batches per optimizer step on each rank.
    pub gradient_accumulation_steps: usize,
    /// Gradient elements per reduction bucket (stages 0-2).
    pub reduce_bucket_size: usize,
    /// Overlap gradient reductions with the rest of backward, and stage-3 gathers with compute.
    pub overlap_comm: bool,
    /// Stage 3: gather ahead up to this many parameter elements beyond the block in use.
    pub prefetch_bucket_size: usize,
    /// Stage 3: parameters with fewer elements stay replicated on every rank.
    pub param_persistence_threshold: usize,
    /// Clip the gradient's global L2 norm to this value (0: no clipping).
    pub gradient_clipping: f64,
    /// The optimizer.
    pub optimizer: OptimizerSpec,
    /// Learning rate by step; `None` keeps the optimizer's `lr`.
    pub lr_schedule: Option<LrFn>,
    /// Flat shards are multiples of this many elements (per rank).
    pub alignment: usize,
}

impl std::fmt::Debug for EngineSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSettings")
            .field("stage", &self.stage)
            .field("gradient_accumulation_steps", &self.gradient_accumulation_steps)
            .field("reduce_bucket_size", &self.reduce_bucket_size)
            .field("overlap_comm", &self.overlap_comm)
            .field("prefetch_bucket_size", &self.prefetch_bucket_size)
            .field("param_persistence_threshold", &self.param_persistence_threshold)
            .field("gradient_clipping", &self.gradient_clipping)
            .field("optimizer", &self.optimizer)
            .field("lr_schedule", &self.lr_schedule.is_some())
            .finish()
    }
}

impl EngineSettings {
    /// Settings for `stage` with DeepSpeed's defaults and the given optimizer.
    pub fn new(stage: Stage, optimizer: OptimizerSpec) -> Self {
        EngineSettings {
            stage,
            gradient_accumulation_steps: 1,
            reduce_bucket_size: 500_000_000,
            overlap_comm: stage == Stage::Zero3,
            prefetch_bucket_size: 50_000_000,
            param_persistence_threshold: 100_000,
            gradient_clipping: 0.0,
            optimizer,
            lr_schedule: None,
            alignment: 16,
        }
    }

    /// The learning rate of optimizer step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        match &self.lr_schedule {
            Some(f) => f(step),
            None => self.optimizer.lr(),
        }
    }
}
