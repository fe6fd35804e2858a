//! What the engine needs to know from the configuration, as plain values.

use zero_core::loss_scaler::LossScalerConfig;
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
        [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3]
            .get(n as usize)
            .copied()
    }

    /// The stage's number.
    pub fn number(self) -> u8 {
        self as u8
    }
}

/// A learning rate as a function of the optimizer step (0-based).
pub type LrFn = std::sync::Arc<dyn Fn(u64) -> f64 + Send + Sync>;

/// The optimizer's (β1, β2) as a function of the optimizer step (0-based).
pub type BetasFn = std::sync::Arc<dyn Fn(u64) -> (f64, f64) + Send + Sync>;

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
    /// The optimizer's betas by step, for a schedule that cycles the momentum (OneCycle with
    /// `cycle_momentum`); `None` keeps the optimizer's own. SGD, which has no betas, keeps its
    /// momentum either way.
    pub betas_schedule: Option<BetasFn>,
    /// Flat shards are multiples of this many elements (per rank).
    pub alignment: usize,
    /// The dtype the model computes in, loss scaling, and the gradients' communication dtype.
    pub precision: PrecisionSettings,
    /// Where the optimizer step runs and the fp32 masters and optimizer state live.
    pub offload_optimizer: OptimizerOffload,
    /// With the state in host memory (`offload_optimizer` cpu or nvme): ZeRO-Offload's one-step
    /// delayed parameter update (`offload_optimizer.delayed_update`, off by default). A step
    /// does what communicates (reductions, overflow check, gradient norm, clipping), starts the
    /// update on the optimizer's threads and returns at once, the model holding the previous
    /// step's update; the update runs beside the next forward and backward, and the next step
    /// writes it into the model before its own. Not exact: step t's gradient is computed on the
    /// weights of update t-2, not t-1 (the first two steps both on the initial weights), as in
    /// ZeRO-Offload. `ZeroOptimizer::flush` gives the model the last update.
    pub delayed_update: bool,
    /// Stage 3: where the rank's parameter shards live between gathers.
    pub offload_param: ParamOffload,
    /// Every rank thread of this process whose model runs collectives inside `backward()`
    /// (tensor parallelism) must name the group of all of them here. On burn 0.21 the cleanup at
    /// the end of one thread's `backward()` locks every thread's autodiff graph; a thread still
    /// inside its own `backward()`, waiting in a collective for the first one's next part, would
    /// wait forever. With a fence, every rank passes a barrier of this group before each part's
    /// `backward()`, so no rank starts a part while another is still finishing the last one.
    /// Not needed (None) for one rank per process, or when no collective runs inside backward.
    pub backward_fence: Option<zero_core::comm::SharedGroup>,
    /// Checkpoint the blocks' activations (the config's `activation_checkpointing` section): keep
    /// a few block inputs from forward and recompute the rest in backward
    /// ([`crate::checkpointed_grads`]; the pipeline engine's stages). `None`: keep every graph.
    pub activation_checkpointing: Option<crate::ActivationCheckpointing>,
    /// The tensor-parallel group of a model whose parameters are split over several ranks
    /// (the rule given to `ZeroOptimizer::with_tensor_parallel`, which sets this group, says
    /// which): the global gradient
    /// norm, and so clipping, then covers the whole model, not this rank's slices. `None`: the
    /// model is whole on every rank of the data-parallel group.
    pub tensor_parallel_group: Option<zero_core::comm::SharedGroup>,
    /// Stage 3: the most parameter elements gathered at once (`stage3_max_live_parameters`):
    /// the prefetch budget is cut to it. (A unit is released after each use and gathered again
    /// for the next, whatever `stage3_max_reuse_distance` allows: the least memory.)
    pub max_live_parameters: usize,
    /// The model, recorded in every checkpoint the engine saves so that `zero to-fp32` exports
    /// it under the names its users load, with its configuration beside (a model zoo gives it:
    /// `Gpt2Config::model_record`). `None`: the checkpoint records no model and exports keep
    /// the engine's names.
    pub model: Option<zero_core::checkpoint::ModelRecord>,
}

/// Where the optimizer step runs and where the fp32 masters and optimizer state live
/// (DeepSpeed's `zero_optimization.offload_optimizer`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub enum OptimizerOffload {
    /// Beside the model, stepped on the process-wide thread pool.
    #[default]
    None,
    /// In host memory, stepped on a dedicated pool of `threads` CPU threads (0: one per core).
    Cpu {
        /// Optimizer threads (0: one per core).
        threads: usize,
    },
    /// In one scratch file per rank under `path`, streamed through `buffer_count` host buffers
    /// of `chunk_elements` elements per state buffer; only the parameter shard in the compute
    /// dtype stays in memory. Stepped on a dedicated pool like `Cpu`.
    Nvme {
        /// Directory of the swap files.
        path: std::path::PathBuf,
        /// Host buffers in flight (read ahead, computing, writing back).
        buffer_count: usize,
        /// Elements of each state buffer per chunk.
        chunk_elements: usize,
        /// Optimizer threads (0: one per core).
        threads: usize,
    },
}

/// Where a stage-3 rank keeps its parameter shards (in the compute dtype) between gathers
/// (DeepSpeed's `zero_optimization.offload_param`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub enum ParamOffload {
    /// Beside the model, on its device.
    #[default]
    None,
    /// In host memory; each gather takes the shard from there.
    Cpu,
    /// In one file per rank under `path`: a gather reads the shard in and drops it after,
    /// the optimizer step writes the new shard out. The first groups whose shards fit in
    /// `max_in_cpu` elements stay in host memory instead.
    Nvme {
        /// Directory of the parameter files.
        path: std::path::PathBuf,
        /// Parameter elements kept in host memory rather than in the file.
        max_in_cpu: usize,
    },
}

/// The dtype of the model's parameters, activations and gradients. The master weights and the
/// optimizer state are fp32 whatever this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ComputeDtype {
    /// IEEE single precision.
    F32,
    /// bfloat16: fp32's range with 8 bits of mantissa; no loss scaling needed.
    Bf16,
    /// IEEE half precision: 5 exponent bits, so gradients need a loss scale.
    F16,
}

impl ComputeDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ComputeDtype::F32 => 4,
            ComputeDtype::Bf16 | ComputeDtype::F16 => 2,
        }
    }

    /// The Burn tensor dtype: cast the model's float inputs to it (`x.cast(dtype.burn())`).
    pub fn burn(self) -> burn::tensor::DType {
        match self {
            ComputeDtype::F32 => burn::tensor::DType::F32,
            ComputeDtype::Bf16 => burn::tensor::DType::BF16,
            ComputeDtype::F16 => burn::tensor::DType::F16,
        }
    }

    /// The flat-buffer dtype collectives move.
    pub fn flat(self) -> zero_core::comm::DType {
        match self {
            ComputeDtype::F32 => zero_core::comm::DType::F32,
            ComputeDtype::Bf16 => zero_core::comm::DType::BF16,
            ComputeDtype::F16 => zero_core::comm::DType::F16,
        }
    }

    /// Whether this is a 16-bit dtype.
    pub fn is_half(self) -> bool {
        self != ComputeDtype::F32
    }
}

/// What a step does when a loss or a gradient is infinite or NaN (bf16 and fp32; fp16 leaves
/// it to the loss scaler, which always skips).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum NonFinitePolicy {
    /// The step fails with [`crate::ZeroError::NonFinite`] naming it and the rank, on every
    /// rank. The default for fp32 and bf16: without a loss scale a non-finite loss or gradient
    /// means training has diverged (or the weights were broken from the start), and every later
    /// step would only carry NaN on. Costs one scalar all-reduce per step.
    Error,
    /// The step is skipped on every rank, counted in [`crate::StepReport::skipped`], and
    /// training goes on (the LR schedule does not advance).
    Skip,
    /// No check: non-finite values reach the weights. bf16 with `"check_grad_overflow": false`.
    Ignore,
}

/// Mixed-precision settings (DeepSpeed's `fp16`, `bf16` and `communication_data_type`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PrecisionSettings {
    /// The dtype of the model's parameters and gradients.
    pub dtype: ComputeDtype,
    /// fp16's loss scaler (dynamic or static); `None` otherwise.
    pub loss_scaler: Option<LossScalerConfig>,
    /// What a non-finite loss or gradient does when no loss scaler is in use.
    pub non_finite: NonFinitePolicy,
    /// The dtype gradients are reduced in; `None`: the compute dtype (DeepSpeed's default).
    pub communication_dtype: Option<ComputeDtype>,
}

impl Default for PrecisionSettings {
    fn default() -> Self {
        PrecisionSettings::fp32()
    }
}

impl PrecisionSettings {
    /// fp32 everywhere; a non-finite loss or gradient is an error.
    pub fn fp32() -> Self {
        PrecisionSettings {
            dtype: ComputeDtype::F32,
            loss_scaler: None,
            non_finite: NonFinitePolicy::Error,
            communication_dtype: None,
        }
    }

    /// bf16 compute, fp32 masters; a non-finite loss or gradient is an error.
    pub fn bf16() -> Self {
        PrecisionSettings {
            dtype: ComputeDtype::Bf16,
            non_finite: NonFinitePolicy::Error,
            ..Self::fp32()
        }
    }

    /// fp16 compute, fp32 masters, with the given loss scaler.
    pub fn fp16(scaler: LossScalerConfig) -> Self {
        PrecisionSettings {
            dtype: ComputeDtype::F16,
            loss_scaler: Some(scaler),
            ..Self::fp32()
        }
    }

    /// The dtype gradients are reduced in.
    pub fn comm_dtype(&self) -> ComputeDtype {
        self.communication_dtype.unwrap_or(self.dtype)
    }
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
            .field("betas_schedule", &self.betas_schedule.is_some())
            .field("alignment", &self.alignment)
            .field("precision", &self.precision)
            .field("offload_optimizer", &self.offload_optimizer)
            .field("delayed_update", &self.delayed_update)
            .field("offload_param", &self.offload_param)
            .field("model", &self.model.as_ref().map(|m| &m.naming))
            .finish()
    }
}

impl EngineSettings {
    /// Stage 3 with `overlap_comm`: the elements of whole units that may be gathered ahead of
    /// their use, `prefetch_bucket_size` cut to `max_live_parameters`; 0 otherwise (no prefetch).
    pub fn prefetch_budget(&self) -> usize {
        if self.overlap_comm && self.stage == Stage::Zero3 {
            self.prefetch_bucket_size.min(self.max_live_parameters)
        } else {
            0
        }
    }

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
            betas_schedule: None,
            alignment: 16,
            precision: PrecisionSettings::fp32(),
            offload_optimizer: OptimizerOffload::None,
            delayed_update: false,
            offload_param: ParamOffload::None,
            backward_fence: None,
            activation_checkpointing: None,
            tensor_parallel_group: None,
            max_live_parameters: 1_000_000_000,
            model: None,
        }
    }

    /// The optimizer's betas for optimizer step `step`, where a schedule cycles them.
    pub fn betas_at(&self, step: u64) -> Option<(f64, f64)> {
        self.betas_schedule.as_ref().map(|f| f(step))
    }

    /// The learning rate of optimizer step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        match &self.lr_schedule {
            Some(f) => f(step),
            None => self.optimizer.lr(),
        }
    }
}

/// The refusal of `offload_optimizer.delayed_update` for an optimizer whose step communicates
/// (LAMB sums norms over the ranks): its collectives would run beside the next step's. Given
/// by the config's reading and, for settings built in code, by the delayed step itself.
pub(crate) fn delayed_update_communicates() -> crate::ZeroError {
    crate::ZeroError::Config(
        "zero_optimization.offload_optimizer.delayed_update: LAMB's step sums norms over the ranks and cannot run \
         beside the next step's collectives; turn delayed_update off, or choose Adam, AdamW, SGD or Lion"
            .into(),
    )
}
