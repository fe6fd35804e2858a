//! The resolved configuration: every value a plain number, flag or enum, DeepSpeed's defaults
//! filled in, nothing left "auto". This is what the engine consumes.

use super::auto::Overrides;
use super::batch::{read_batch, resolve_batch, BatchSpec};
use super::error::ConfigError;
use super::optimizer::{read_optimizer, OptimizerConfig};
use super::precision::{read_precision, AmpConfig, Precision};
use super::reader::{Cx, Deferred, Section, UnknownKeys};
use super::scheduler::{read_scheduler, SchedulerConfig};
use super::sections::*;
use super::zero::{read_zero, ZeroConfig, ZeroStage};
use serde::Serialize;
use serde_json::{Map, Value};

/// What resolution needs to know beyond the file.
#[derive(Debug, Clone, Default)]
pub struct ResolveContext {
    /// Data-parallel world size (ranks that split the batch).
    pub world_size: usize,
    /// The model's hidden size, for the bucket sizes written "auto"; `None` if not known.
    pub hidden_size: Option<usize>,
    /// Values for keys the file left "auto" (see [`Overrides`]).
    pub overrides: Overrides,
}

/// How gradients are combined across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AllreduceOp {
    /// Average (default).
    Mean,
    /// Sum.
    Sum,
}

/// The configuration with every value resolved. Field names (as serialised) are DeepSpeed's
/// keys, so the printed form reads like a complete config file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResolvedConfig {
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// Samples per forward/backward on one rank.
    #[serde(rename = "train_micro_batch_size_per_gpu")]
    pub micro_batch_size: u64,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: u64,
    /// ZeRO.
    #[serde(rename = "zero_optimization")]
    pub zero: ZeroConfig,
    /// Compute dtype and loss scaling (from `fp16`, `bf16`/`bfloat16`).
    pub precision: Precision,
    /// Apex AMP.
    pub amp: AmpConfig,
    /// The optimizer, if the config names one.
    pub optimizer: Option<OptimizerConfig>,
    /// The learning-rate schedule, if the config names one.
    pub scheduler: Option<SchedulerConfig>,
    /// Global gradient-norm clip; 0 turns it off (default 1.0, DeepSpeed's since 2026).
    pub gradient_clipping: f64,
    /// Dtype of gradient communication (default: the compute dtype).
    pub communication_data_type: Option<CommDataType>,
    /// Dtype of sequence-parallel communication (default fp32).
    pub seq_parallel_communication_data_type: CommDataType,
    /// Scale gradients before the all-reduce (default false).
    pub prescale_gradients: bool,
    /// Divide gradients by this before the all-reduce (default 1.0).
    pub gradient_predivide_factor: f64,
    /// Average or sum gradients (default mean; sum is not allowed at stage 3).
    pub gradient_allreduce_op: AllreduceOp,
    /// Log every this many steps (default 10).
    pub steps_per_print: u64,
    /// Time forward, backward and step (default false; on with the flops profiler).
    pub wall_clock_breakdown: bool,
    /// Report memory use (default false).
    pub memory_breakdown: bool,
    /// Print the engine state after initialisation (default false).
    pub dump_state: bool,
    /// Broadcast instead of all-gather for parameters (legacy; default false).
    pub disable_allgather: bool,
    /// Sparse gradients for embeddings (default false).
    pub sparse_gradients: bool,
    /// Let ZeRO wrap an optimizer it was not tested with (default false).
    pub zero_allow_untested_optimizer: bool,
    /// Replace a torch optimizer by DeepSpeed's CPU one under offload (default true).
    pub zero_force_ds_cpu_optimizer: bool,
    /// Drop the last incomplete batch of the data loader (default false).
    pub dataloader_drop_last: bool,
    /// Random seed, if the config gives one.
    pub seed: Option<u64>,
    /// `activation_checkpointing`.
    pub activation_checkpointing: ActivationCheckpointingConfig,
    /// `pipeline`.
    pub pipeline: PipelineConfig,
    /// `tensor_parallel`.
    pub tensor_parallel: TensorParallelConfig,
    /// `tensorboard`, `csv_monitor`, `wandb`, `comet`.
    #[serde(flatten)]
    pub monitors: MonitorConfig,
    /// `checkpoint`.
    pub checkpoint: CheckpointConfig,
    /// `aio`.
    pub aio: AioConfig,
    /// `comms_logger`.
    pub comms_logger: CommsLoggerConfig,
    /// `flops_profiler`.
    pub flops_profiler: FlopsProfilerConfig,
    /// Sections DeepSpeed knows that this crate does not act on, kept as written
    /// (`elasticity`, `data_efficiency`, `compression_training`, ...).
    pub passthrough: Map<String, Value>,
}

/// Top-level keys DeepSpeed knows that are kept as written (read by features this crate does
/// not implement); they do not warn.
const PASSTHROUGH: &[&str] = &[
    "allgather_size",
    "autotuning",
    "comet",
    "compile",
    "compression_training",
    "curriculum_learning",
    "data_efficiency",
    "data_types",
    "datastates",
    "eigenvalue",
    "elasticity",
    "expert_parallel",
    "graph_harvesting",
    "hybrid_engine",
    "log_level",
    "managed_gradient_accumulation",
    "nebula",
    "progressive_layer_drop",
    "quantize_training",
    "sequence_parallel_size",
    "sparse_attention",
    "timers",
    "torch_autocast",
    "use_data_before_expert_parallelism",
    "vocabulary_size",
    "weight_quantization",
];

/// Reads the whole config. `world` is the data-parallel size if known; `cx` says what "auto"
/// becomes and collects warnings and deferrals.
pub(crate) fn build(
    raw: &Value,
    cx: &mut Cx<'_>,
    world: Option<usize>,
) -> Result<(ResolvedConfig, BatchSpec), ConfigError> {
    let mut top = Section::new(Some(raw), "", cx)?;
    let batch_spec = read_batch(&mut top, cx)?;
    let (batch, batch_deferred) = resolve_batch(&batch_spec, world, cx.overrides, cx.source, cx.defer)?;
    cx.deferred.extend(batch_deferred);

    let zero = read_zero(&mut top, cx)?;
    let (precision, amp) = read_precision(&mut top, cx)?;
    let optimizer = read_optimizer(&mut top, cx)?;
    let scheduler = read_scheduler(&mut top, cx)?;
    let gradient_clipping: f64 = cx.get(&mut top, &["gradient_clipping"], 1.0)?;
    if gradient_clipping < 0.0 {
        return Err(cx.invalid(
            "gradient_clipping",
            &Value::from(gradient_clipping),
            "it must be >= 0 (0 turns clipping off)",
        ));
    }
    let communication_data_type = read_comm_dtype(&mut top, cx, "communication_data_type")?;
    let seq_parallel_communication_data_type =
        read_comm_dtype(&mut top, cx, "seq_parallel_communication_data_type")?.unwrap_or(CommDataType::Fp32);
    let op: String = cx.get(&mut top, &["gradient_allreduce_op"], "mean".to_string())?;
    let gradient_allreduce_op = match op.to_ascii_lowercase().as_str() {
        "mean" => AllreduceOp::Mean,
        "sum" => AllreduceOp::Sum,
        _ => {
            return Err(cx.invalid(
                "gradient_allreduce_op",
                &Value::String(op),
                "valid ops are \"mean\" and \"sum\"",
            ))
        }
    };
    if gradient_allreduce_op == AllreduceOp::Sum && zero.stage == ZeroStage::Parameters {
        return Err(ConfigError::Conflict {
            source_name: cx.source.to_string(),
            key: "gradient_allreduce_op".into(),
            other: "zero_optimization.stage".into(),
            reason: "\"sum\" is not supported at stage 3".into(),
        });
    }
    let flops_profiler = read_flops_profiler(&mut top, cx)?;
    let wall_clock_breakdown: bool = cx.get(&mut top, &["wall_clock_breakdown"], false)?;
    let config = ResolvedConfig {
        train_batch_size: batch.train_batch_size,
        micro_batch_size: batch.micro_batch_size,
        gradient_accumulation_steps: batch.gradient_accumulation_steps,
        zero,
        precision,
        amp,
        optimizer,
        scheduler,
        gradient_clipping,
        communication_data_type,
        seq_parallel_communication_data_type,
        prescale_gradients: cx.get(&mut top, &["prescale_gradients"], false)?,
        gradient_predivide_factor: cx.get(&mut top, &["gradient_predivide_factor"], 1.0)?,
        gradient_allreduce_op,
        steps_per_print: cx.get(&mut top, &["steps_per_print"], 10)?,
        wall_clock_breakdown: wall_clock_breakdown || flops_profiler.enabled,
        memory_breakdown: cx.get(&mut top, &["memory_breakdown"], false)?,
        dump_state: cx.get(&mut top, &["dump_state"], false)?,
        disable_allgather: cx.get(&mut top, &["disable_allgather"], false)?,
        sparse_gradients: cx.get(&mut top, &["sparse_gradients"], false)?,
        zero_allow_untested_optimizer: cx.get(&mut top, &["zero_allow_untested_optimizer"], false)?,
        zero_force_ds_cpu_optimizer: cx.get(&mut top, &["zero_force_ds_cpu_optimizer"], true)?,
        dataloader_drop_last: cx.get(&mut top, &["dataloader_drop_last"], false)?,
        seed: cx.get(&mut top, &["seed"], None)?,
        activation_checkpointing: read_activation_checkpointing(&mut top, cx)?,
        pipeline: read_pipeline(&mut top, cx)?,
        tensor_parallel: read_tensor_parallel(&mut top, cx)?,
        monitors: read_monitors(&mut top, cx)?,
        checkpoint: read_checkpoint(&mut top, cx)?,
        aio: read_aio(&mut top, cx)?,
        comms_logger: read_comms_logger(&mut top, cx)?,
        flops_profiler,
        passthrough: PASSTHROUGH
            .iter()
            .filter_map(|k| top.raw(k).map(|v| (k.to_string(), v.clone())))
            .collect(),
    };
    top.finish(cx, UnknownKeys::Warn)?;
    Ok((config, batch_spec))
}

/// The keys whose "auto" follows from the model's hidden size, in [`derived_from_hidden`]'s order.
pub(crate) const FROM_HIDDEN: [&str; 3] = [
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
];

/// Values for the "auto" keys that follow from the model's hidden size (HuggingFace's rules);
/// `None` for a size too large for them to fit 64 bits (no model has it).
pub(crate) fn derived_from_hidden(hidden: usize) -> Option<Vec<(String, Value)>> {
    let h = hidden as u64;
    let square = h.checked_mul(h)?;
    // 0.9·h², exactly, in integers.
    let values = [square, square.checked_mul(9)? / 10, h.checked_mul(10)?];
    Some(
        FROM_HIDDEN
            .iter()
            .zip(values)
            .map(|(k, v)| (k.to_string(), Value::from(v)))
            .collect(),
    )
}

/// A resolution that may have left values for later (used by `zero check-config`).
#[derive(Debug, Clone)]
pub struct PartialResolution {
    /// The config; values listed in `deferred` hold stand-ins (DeepSpeed's default, or 0).
    pub config: ResolvedConfig,
    /// What could not be resolved yet, and what will resolve it.
    pub deferred: Vec<Deferred>,
}
