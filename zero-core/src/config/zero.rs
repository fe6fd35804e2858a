//! The `zero_optimization` section: the ZeRO stage, bucket sizes, stage-3 tuning and offload.
//!
//! Every key DeepSpeed's ZeRO config model knows is read, under its current name and its legacy
//! spellings; any other key is an error, as in DeepSpeed.

use super::error::ConfigError;
use super::offload::{legacy_offload_flags, read_offload_optimizer, read_offload_param};
pub use super::offload::{OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig};
use super::reader::{Cx, Section, UnknownKeys};
use serde::Serialize;
use serde_json::Value;

/// Which ZeRO stage partitions what.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(into = "u8")]
pub enum ZeroStage {
    /// Stage 0: plain data parallelism, nothing partitioned.
    Disabled,
    /// Stage 1: optimizer states partitioned.
    OptimizerStates,
    /// Stage 2: optimizer states and gradients partitioned.
    Gradients,
    /// Stage 3: optimizer states, gradients and parameters partitioned.
    Parameters,
}

impl ZeroStage {
    /// The stage number, 0 to 3.
    pub fn number(self) -> u8 {
        self as u8
    }

    fn from_number(n: u64) -> Option<Self> {
        Some(match n {
            0 => Self::Disabled,
            1 => Self::OptimizerStates,
            2 => Self::Gradients,
            3 => Self::Parameters,
            _ => return None,
        })
    }
}

impl From<ZeroStage> for u8 {
    fn from(s: ZeroStage) -> u8 {
        s.number()
    }
}

/// The resolved `zero_optimization` section. Field names are DeepSpeed's keys (current
/// spellings), so the printed form reads like a config file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroConfig {
    /// The stage (default 0).
    pub stage: ZeroStage,
    /// Copy gradients into a contiguous buffer as they are produced (default true).
    pub contiguous_gradients: bool,
    /// Reduce-scatter instead of all-reduce for gradients (default true).
    pub reduce_scatter: bool,
    /// Elements reduced at a time (default 5e8; "auto" = hidden²).
    pub reduce_bucket_size: u64,
    /// Combine the ranks' reduce buckets into one all-reduce (default true).
    pub use_multi_rank_bucket_allreduce: bool,
    /// All-gather (rather than broadcasts) for updated parameters (default true).
    pub allgather_partitions: bool,
    /// Elements all-gathered at a time (default 5e8).
    pub allgather_bucket_size: u64,
    /// Overlap gradient reduction with the backward pass (default: true at stage 3, else false).
    pub overlap_comm: bool,
    /// Initialise fp32 master weights from the checkpoint's fp32 copy (default true).
    pub load_from_fp32_weights: bool,
    /// Legacy elastic checkpoints (default false).
    pub elastic_checkpoint: bool,
    /// Optimizer offload; `None` when absent or `device: "none"`.
    pub offload_optimizer: Option<OffloadOptimizerConfig>,
    /// Parameter offload; `None` when absent or `device: "none"`.
    pub offload_param: Option<OffloadParamConfig>,
    /// Elements per optimizer-step tile (default 1e9).
    pub sub_group_size: u64,
    /// Elements prefetched ahead of use at stage 3 (default 5e7; "auto" = 0.9·hidden²).
    pub stage3_prefetch_bucket_size: u64,
    /// Parameters smaller than this stay unpartitioned at stage 3 (default 1e5; "auto" = 10·hidden).
    pub stage3_param_persistence_threshold: u64,
    /// Upper bound on unpartitioned elements at stage 3 (default i64::MAX).
    pub stage3_model_persistence_threshold: u64,
    /// Gathered parameter elements resident per rank before release (default 1e9).
    pub stage3_max_live_parameters: u64,
    /// Keep a parameter gathered if reused within this many elements (default 1e9).
    pub stage3_max_reuse_distance: u64,
    /// Gather 16-bit weights when saving the model (default false).
    pub stage3_gather_16bit_weights_on_model_save: bool,
    /// Module granularity below which modules are fetched whole (default 0).
    pub stage3_module_granularity_threshold: u64,
    /// All-reduce rather than all-gather to fetch parameters (default false).
    pub stage3_use_all_reduce_for_fetch_params: bool,
    /// All-gather parameters one at a time, without buckets (default false).
    pub stage3_allgather_sequential: bool,
    /// Ignore parameters that get no gradient (default true).
    pub ignore_unused_parameters: bool,
    /// DeepSpeed's old stage-1 implementation (default false).
    pub legacy_stage1: bool,
    /// Spread gradient copies to the host over ranks (default false).
    pub round_robin_gradients: bool,
    /// Secondary partition group size for ZeRO++ hpZ (default 1 = off).
    pub zero_hpz_partition_size: u64,
    /// Quantised weight all-gather, ZeRO++ qwZ (default false).
    pub zero_quantized_weights: bool,
    /// Non-trainable weights stored quantised (default false).
    pub zero_quantized_nontrainable_weights: bool,
    /// Quantised gradient reduction, ZeRO++ qgZ (default false).
    pub zero_quantized_gradients: bool,
    /// LoCo-ZeRO++ settings, kept as written.
    pub zeropp_loco_param: Option<Value>,
    /// MiCS shard size (default -1 = off).
    pub mics_shard_size: i64,
    /// Hierarchical parameter gather in MiCS (default false).
    pub mics_hierarchical_params_gather: bool,
    /// Memory-efficient linear at stage 3 (default true).
    pub memory_efficient_linear: bool,
    /// Force checkpoint loading in pipeline mode at stage 3 (default false).
    pub pipeline_loading_checkpoint: bool,
    /// Override `Module.apply` at stage 3 (default true).
    pub override_module_apply: bool,
    /// Log trace-cache warnings (default false).
    pub log_trace_cache_warnings: bool,
    /// Internal sanity checks (default false).
    pub enable_sanity_checks: bool,
    /// Keep Muon momentum in memory with NVMe offload (default false).
    pub save_muon_momentum_buffer_in_memory: bool,
    /// Modules treated as stage-3 leaves, kept as written.
    pub leaf_module: Option<Value>,
    /// ZenFlow settings, kept as written.
    pub zenflow: Option<Value>,
}

const ELEMENTS_5E8: u64 = 500_000_000;
pub(super) const ELEMENTS_1E9: u64 = 1_000_000_000;

/// Reads `zero_optimization` from the top-level section.
pub(crate) fn read_zero(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<ZeroConfig, ConfigError> {
    let raw = top.lookup(&["zero_optimization"], cx)?.map(|(_, v)| v);
    if let Some(Value::Bool(enabled)) = raw {
        return legacy_bool_form(*enabled, top, cx);
    }
    let mut s = Section::new(raw, "zero_optimization", cx)?;
    let stage_value: u64 = cx.get(&mut s, &["stage"], 0)?;
    let stage = ZeroStage::from_number(stage_value).ok_or_else(|| {
        cx.invalid(
            "zero_optimization.stage",
            &Value::from(stage_value),
            "valid stages are 0, 1, 2 and 3",
        )
    })?;
    let is3 = stage == ZeroStage::Parameters;

    let offload_optimizer = read_offload_optimizer(&mut s, cx)?;
    let offload_param = read_offload_param(&mut s, cx)?;
    let (offload_optimizer, offload_param) = legacy_offload_flags(&mut s, cx, offload_optimizer, offload_param)?;

    if let Some(o) = &offload_optimizer {
        if o.ratio < 1.0 && !is3 {
            return Err(ConfigError::Conflict {
                source_name: cx.source.to_string(),
                key: "zero_optimization.offload_optimizer.ratio".into(),
                other: "zero_optimization.stage".into(),
                reason: format!(
                    "partial offload (ratio {}) needs stage 3, the stage is {}",
                    o.ratio, stage_value
                ),
            });
        }
    }
    // Stage 0 partitions nothing, and the engine honours the section all the same: each rank
    // offloads and steps the whole state. DeepSpeed documents offload for stages 1-3 only.
    if let (Some(o), ZeroStage::Disabled) = (&offload_optimizer, stage) {
        cx.warning(
            "zero_optimization.offload_optimizer",
            format!(
                "at stage 0 the optimizer state is not partitioned: every rank keeps all of it ({} fp32 master \
                 weights and optimizer moments of the whole model) and steps all of it, the same work on every rank; \
                 stage 1 offloads each rank's shard only (DeepSpeed offloads at stages 1-3)",
                match o.device {
                    OffloadDevice::Cpu => "in host memory: the",
                    OffloadDevice::Nvme => "in its swap file under nvme_path: the",
                }
            ),
        );
    }
    // DeepSpeed reads the section at stage 3 only, and configs written for it carry one at
    // stages 1-2 (RLHF recipes switch the stage and keep the rest): the same file trains here,
    // and the warning, the resolved config and the memory report say the parameters stay whole.
    let offload_param = if offload_param.is_some() && !is3 {
        cx.warning(
            "zero_optimization.offload_param",
            format!(
                "parameter offload applies to stage 3 only; at stage {stage_value} every rank holds the whole \
                 parameters, so the section is ignored (as DeepSpeed does): remove it, or use stage 3 to \
                 partition and offload them"
            ),
        );
        None
    } else {
        offload_param
    };

    let config = ZeroConfig {
        stage,
        contiguous_gradients: cx.get(&mut s, &["contiguous_gradients"], true)?,
        reduce_scatter: cx.get(&mut s, &["reduce_scatter"], true)?,
        reduce_bucket_size: cx.get(&mut s, &["reduce_bucket_size"], ELEMENTS_5E8)?,
        use_multi_rank_bucket_allreduce: cx.get(&mut s, &["use_multi_rank_bucket_allreduce"], true)?,
        allgather_partitions: cx.get(&mut s, &["allgather_partitions"], true)?,
        allgather_bucket_size: cx.get(&mut s, &["allgather_bucket_size"], ELEMENTS_5E8)?,
        overlap_comm: cx.get(&mut s, &["overlap_comm"], is3)?,
        load_from_fp32_weights: cx.get(&mut s, &["load_from_fp32_weights"], true)?,
        elastic_checkpoint: cx.get(&mut s, &["elastic_checkpoint"], false)?,
        offload_optimizer,
        offload_param,
        sub_group_size: cx.get(&mut s, &["sub_group_size"], ELEMENTS_1E9)?,
        stage3_prefetch_bucket_size: cx.get(
            &mut s,
            &["stage3_prefetch_bucket_size", "prefetch_bucket_size"],
            50_000_000,
        )?,
        stage3_param_persistence_threshold: cx.get(
            &mut s,
            &["stage3_param_persistence_threshold", "param_persistence_threshold"],
            100_000,
        )?,
        stage3_model_persistence_threshold: cx.get(
            &mut s,
            &["stage3_model_persistence_threshold", "model_persistence_threshold"],
            i64::MAX as u64,
        )?,
        stage3_max_live_parameters: cx.get(
            &mut s,
            &["stage3_max_live_parameters", "max_live_parameters"],
            ELEMENTS_1E9,
        )?,
        stage3_max_reuse_distance: cx.get(
            &mut s,
            &["stage3_max_reuse_distance", "max_reuse_distance"],
            ELEMENTS_1E9,
        )?,
        stage3_gather_16bit_weights_on_model_save: gather_16bit(&mut s, cx)?,
        stage3_module_granularity_threshold: cx.get(
            &mut s,
            &["stage3_module_granularity_threshold", "module_granularity_threshold"],
            0,
        )?,
        stage3_use_all_reduce_for_fetch_params: cx.get(
            &mut s,
            &[
                "stage3_use_all_reduce_for_fetch_params",
                "use_all_reduce_for_fetch_params",
            ],
            false,
        )?,
        stage3_allgather_sequential: cx.get(&mut s, &["stage3_allgather_sequential", "allgather_sequential"], false)?,
        ignore_unused_parameters: cx.get(&mut s, &["ignore_unused_parameters"], true)?,
        legacy_stage1: cx.get(&mut s, &["legacy_stage1"], false)?,
        round_robin_gradients: cx.get(&mut s, &["round_robin_gradients"], false)?,
        zero_hpz_partition_size: cx.get(&mut s, &["zero_hpz_partition_size"], 1)?,
        zero_quantized_weights: cx.get(&mut s, &["zero_quantized_weights"], false)?,
        zero_quantized_nontrainable_weights: cx.get(&mut s, &["zero_quantized_nontrainable_weights"], false)?,
        zero_quantized_gradients: cx.get(&mut s, &["zero_quantized_gradients"], false)?,
        zeropp_loco_param: cx.get(&mut s, &["zeropp_loco_param"], None)?,
        mics_shard_size: cx.get(&mut s, &["mics_shard_size"], -1)?,
        mics_hierarchical_params_gather: cx.get(&mut s, &["mics_hierarchical_params_gather"], false)?,
        memory_efficient_linear: cx.get(&mut s, &["memory_efficient_linear"], true)?,
        pipeline_loading_checkpoint: cx.get(&mut s, &["pipeline_loading_checkpoint"], false)?,
        override_module_apply: cx.get(&mut s, &["override_module_apply"], true)?,
        log_trace_cache_warnings: cx.get(&mut s, &["log_trace_cache_warnings"], false)?,
        enable_sanity_checks: cx.get(&mut s, &["enable_sanity_checks"], false)?,
        save_muon_momentum_buffer_in_memory: cx.get(&mut s, &["save_muon_momentum_buffer_in_memory"], false)?,
        leaf_module: object_or_none(&mut s, "leaf_module", cx)?,
        zenflow: object_or_none(&mut s, "zenflow", cx)?,
    };
    if config.elastic_checkpoint && is3 {
        cx.warning(
            "zero_optimization.elastic_checkpoint",
            "elastic checkpoints are not supported at stage 3; use universal checkpoints",
        );
    }
    cx.zero_keys = s.asked().to_vec();
    s.finish(cx, UnknownKeys::Error)?;
    Ok(config)
}

/// `"zero_optimization": true` (DeepSpeed's oldest form): stage 1, bucket from `allgather_size`.
fn legacy_bool_form(enabled: bool, top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<ZeroConfig, ConfigError> {
    cx.warning(
        "zero_optimization",
        "a boolean zero_optimization is deprecated; write {\"stage\": N}",
    );
    let bucket: u64 = cx.get(top, &["allgather_size"], ELEMENTS_5E8)?;
    let mut z = defaults(if enabled {
        ZeroStage::OptimizerStates
    } else {
        ZeroStage::Disabled
    });
    z.allgather_bucket_size = bucket;
    Ok(z)
}

/// A `ZeroConfig` with DeepSpeed's defaults for `stage`.
pub fn defaults(stage: ZeroStage) -> ZeroConfig {
    let value = serde_json::json!({ "stage": stage.number() });
    let overrides = super::auto::Overrides::new();
    let mut cx = Cx::new("defaults", &overrides);
    let mut top = serde_json::Map::new();
    top.insert("zero_optimization".into(), value);
    let top = Value::Object(top);
    let mut s = Section::new(Some(&top), "", &cx).expect("a literal object");
    read_zero(&mut s, &mut cx).expect("defaults are valid")
}

fn gather_16bit(s: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<bool, ConfigError> {
    const NAMES: [&str; 3] = [
        "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    ];
    if let Some((written, _)) = s.lookup(&NAMES[2..], cx)? {
        cx.warning(
            s.key(written),
            "deprecated spelling; use stage3_gather_16bit_weights_on_model_save",
        );
    }
    cx.get(s, &NAMES, false)
}

fn object_or_none(s: &mut Section<'_>, name: &'static str, cx: &mut Cx<'_>) -> Result<Option<Value>, ConfigError> {
    let v: Option<Value> = cx.get(s, &[name], None)?;
    match v {
        Some(v) if !v.is_object() => Err(ConfigError::InvalidType {
            source_name: cx.source.to_string(),
            key: s.key(name),
            expected: "an object".into(),
            found: v.to_string(),
        }),
        v => Ok(v),
    }
}
