//! The smaller sections: activation checkpointing, pipeline, tensor parallelism, monitors,
//! checkpoint, aio, comms logger, flops profiler, and the communication dtype.

use super::auto::Auto;
use super::error::ConfigError;
use super::reader::{Cx, Section, UnknownKeys};
use serde::Serialize;
use serde_json::{Map, Value};

/// `activation_checkpointing`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActivationCheckpointingConfig {
    /// The section is in the config. DeepSpeed leaves enabling checkpointing to the model code;
    /// here a present section turns it on for a chain model's blocks.
    pub present: bool,
    /// Partition checkpointed activations over model-parallel ranks (default false).
    pub partition_activations: bool,
    /// Keep checkpoints on the host (default false).
    pub cpu_checkpointing: bool,
    /// Copy checkpoints into one contiguous buffer (default false).
    pub contiguous_memory_optimization: bool,
    /// Checkpoints in the model, for the contiguous buffer (default: unset).
    pub number_checkpoints: Option<u64>,
    /// Synchronise at each checkpoint boundary (default false).
    pub synchronize_checkpoint_boundary: bool,
    /// Time the checkpointing (default false).
    pub profile: bool,
}

/// `pipeline`: DeepSpeed's pipeline engine settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PipelineConfig {
    /// Pipeline stages: "auto" (from the topology) or a count (default "auto").
    pub stages: Auto<u64>,
    /// How layers are split: "parameters", "uniform", `"type:<regex>"` (default "best").
    pub partition: String,
    /// Seed each layer's initialisation separately (default false).
    pub seed_layers: bool,
    /// Layers between activation checkpoints (default 0 = off).
    pub activation_checkpoint_interval: u64,
    /// Partition activations sent between stages (default true).
    pub pipe_partitioned: bool,
    /// Partition gradients sent between stages (default true).
    pub grad_partitioned: bool,
    /// Other keys, kept as written (DeepSpeed passes them through).
    pub other: Map<String, Value>,
}

/// `tensor_parallel`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorParallelConfig {
    /// Tensor-parallel degree for automatic tensor parallelism (default 0 = off).
    pub autotp_size: u64,
    /// Overlap tensor-parallel communication (default false).
    pub tp_overlap_comm: bool,
    /// The other keys, kept as written.
    pub other: Map<String, Value>,
}

/// A file-writing monitor (`tensorboard`, `csv_monitor`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FileMonitorConfig {
    /// Whether it writes (default false).
    pub enabled: bool,
    /// Directory for the logs (default "": the working directory).
    pub output_path: String,
    /// Name of the run (default "DeepSpeedJobName").
    pub job_name: String,
}

/// `wandb`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WandbConfig {
    /// Whether it logs (default false).
    pub enabled: bool,
    /// Run group.
    pub group: Option<String>,
    /// Team (entity).
    pub team: Option<String>,
    /// Project (default "deepspeed").
    pub project: String,
}

/// The monitors: `tensorboard`, `csv_monitor`, `wandb`, and `comet` (kept as written).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MonitorConfig {
    /// `tensorboard`.
    pub tensorboard: FileMonitorConfig,
    /// `csv_monitor`.
    pub csv_monitor: FileMonitorConfig,
    /// `wandb`.
    pub wandb: WandbConfig,
    /// `comet`, as written.
    pub comet: Option<Value>,
}

/// What happens when ranks disagree on a checkpoint tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum TagValidation {
    /// Log a warning (default).
    Warn,
    /// Do not check.
    Ignore,
    /// Fail.
    Fail,
}

/// `checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointConfig {
    /// Tag check across ranks (default Warn).
    pub tag_validation: TagValidation,
    /// Load a universal (layout-independent) checkpoint (default false).
    pub load_universal: bool,
    /// Each node writes to its own storage (default false).
    pub use_node_local_storage: bool,
    /// Pipeline stages write in parallel (`parallel_write.pipeline_stage`, default false).
    pub parallel_write_pipeline_stage: bool,
    /// The other keys (writer, serialization), kept as written.
    pub other: Map<String, Value>,
}

/// `aio`: asynchronous I/O for NVMe offload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AioConfig {
    /// Bytes per I/O request (default 1 MiB).
    pub block_size: u64,
    /// Requests in flight (default 8).
    pub queue_depth: u64,
    /// I/O threads per operation (default 1; older spelling `thread_count`).
    pub intra_op_parallelism: u64,
    /// Submit requests one at a time (default false).
    pub single_submit: bool,
    /// Overlap submission and completion (default true).
    pub overlap_events: bool,
    /// GPUDirect Storage (default false).
    pub use_gds: bool,
}

/// `comms_logger`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommsLoggerConfig {
    /// Whether collectives are logged (default false).
    pub enabled: bool,
    /// Log every op (default true).
    pub prof_all: bool,
    /// Ops to log when not all (default none).
    pub prof_ops: Vec<String>,
    /// Log each op as it happens (default false).
    pub verbose: bool,
    /// Add the caller to each record (default false).
    pub debug: bool,
}

/// `flops_profiler`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlopsProfilerConfig {
    /// Whether the profiler runs (default false).
    pub enabled: bool,
    /// Extra forward passes recomputed in backward (default 0).
    pub recompute_fwd_factor: f64,
    /// Step profiled (default 1).
    pub profile_step: u64,
    /// Module depth reported (default -1 = all).
    pub module_depth: i64,
    /// Top modules listed (default 1).
    pub top_modules: u64,
    /// Detailed per-module report (default true).
    pub detailed: bool,
    /// File for the report (default: stdout).
    pub output_file: Option<String>,
}

/// The dtype gradients are communicated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CommDataType {
    /// 32-bit float.
    Fp32,
    /// 16-bit float.
    Fp16,
    /// bfloat16.
    Bf16,
}

pub(crate) fn read_activation_checkpointing(
    top: &mut Section<'_>,
    cx: &mut Cx<'_>,
) -> Result<ActivationCheckpointingConfig, ConfigError> {
    let mut s = top.child("activation_checkpointing", cx)?;
    let c = ActivationCheckpointingConfig {
        present: s.present(),
        partition_activations: cx.get(&mut s, &["partition_activations"], false)?,
        cpu_checkpointing: cx.get(&mut s, &["cpu_checkpointing"], false)?,
        contiguous_memory_optimization: cx.get(&mut s, &["contiguous_memory_optimization"], false)?,
        number_checkpoints: match cx.get::<Option<u64>>(&mut s, &["number_checkpoints"], None)? {
            Some(0) => {
                return Err(cx.invalid(
                    "activation_checkpointing.number_checkpoints",
                    &Value::from(0),
                    "a positive number of checkpoints, or null (one per block)",
                ))
            }
            n => n,
        },
        synchronize_checkpoint_boundary: cx.get(&mut s, &["synchronize_checkpoint_boundary"], false)?,
        profile: cx.get(&mut s, &["profile"], false)?,
    };
    s.finish(cx, UnknownKeys::Warn)?;
    Ok(c)
}

pub(crate) fn read_pipeline(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<PipelineConfig, ConfigError> {
    let mut s = top.child("pipeline", cx)?;
    let stages = match s.lookup(&["stages"], cx)? {
        Some((_, Value::String(v))) if v == "auto" => Auto::Auto,
        Some((_, v)) => match cx.convert::<u64>("pipeline.stages", v)? {
            0 => {
                return Err(cx.invalid(
                    "pipeline.stages",
                    &Value::from(0),
                    "\"auto\" or a positive number of stages",
                ))
            }
            n => Auto::Value(n),
        },
        None => Auto::Auto,
    };
    let mut c = PipelineConfig {
        stages,
        partition: cx.get(&mut s, &["partition"], "best".to_string())?,
        seed_layers: cx.get(&mut s, &["seed_layers"], false)?,
        activation_checkpoint_interval: cx.get(&mut s, &["activation_checkpoint_interval"], 0)?,
        pipe_partitioned: cx.get(&mut s, &["pipe_partitioned"], true)?,
        grad_partitioned: cx.get(&mut s, &["grad_partitioned"], true)?,
        other: Map::new(),
    };
    c.other = others(
        top.raw("pipeline"),
        &[
            "stages",
            "partition",
            "seed_layers",
            "activation_checkpoint_interval",
            "pipe_partitioned",
            "grad_partitioned",
        ],
    );
    // A misspelt key (`stage` for `stages`) would leave the run without a pipeline unsaid.
    s.finish(cx, UnknownKeys::Warn)?;
    Ok(c)
}

pub(crate) fn read_tensor_parallel(
    top: &mut Section<'_>,
    cx: &mut Cx<'_>,
) -> Result<TensorParallelConfig, ConfigError> {
    let mut s = top.child("tensor_parallel", cx)?;
    let autotp_size = cx.get(&mut s, &["autotp_size"], 0)?;
    let tp_overlap_comm = cx.get(&mut s, &["tp_overlap_comm"], false)?;
    s.finish(cx, UnknownKeys::Warn)?;
    Ok(TensorParallelConfig {
        autotp_size,
        tp_overlap_comm,
        other: others(top.raw("tensor_parallel"), &["autotp_size", "tp_overlap_comm"]),
    })
}

fn others(section: Option<&Value>, known: &[&str]) -> Map<String, Value> {
    section
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter(|(k, _)| !known.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn file_monitor(top: &mut Section<'_>, cx: &mut Cx<'_>, name: &'static str) -> Result<FileMonitorConfig, ConfigError> {
    let mut s = top.child(name, cx)?;
    let c = FileMonitorConfig {
        enabled: cx.get(&mut s, &["enabled"], false)?,
        output_path: cx.get(&mut s, &["output_path"], String::new())?,
        job_name: cx.get(&mut s, &["job_name"], "DeepSpeedJobName".to_string())?,
    };
    // The job's logs go to output_path/job_name: a name that climbs out (`..`) or starts over
    // (`/`) would put them elsewhere; a nested name (`runs/a`) stays under output_path.
    let path = std::path::Path::new(&c.job_name);
    let under = !c.job_name.is_empty()
        && !c.job_name.contains('\0')
        && path
            .components()
            .all(|part| matches!(part, std::path::Component::Normal(_)));
    if !under {
        return Err(cx.invalid(
            &s.key("job_name"),
            &Value::from(c.job_name.as_str()),
            "a name under output_path (not empty, not absolute, no `.` or `..` part): the logs go to \
             output_path/job_name",
        ));
    }
    s.finish(cx, UnknownKeys::Warn)?;
    Ok(c)
}

pub(crate) fn read_monitors(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<MonitorConfig, ConfigError> {
    let tensorboard = file_monitor(top, cx, "tensorboard")?;
    let csv_monitor = file_monitor(top, cx, "csv_monitor")?;
    let mut w = top.child("wandb", cx)?;
    let wandb = WandbConfig {
        enabled: cx.get(&mut w, &["enabled"], false)?,
        group: cx.get(&mut w, &["group"], None)?,
        team: cx.get(&mut w, &["team"], None)?,
        project: cx.get(&mut w, &["project"], "deepspeed".to_string())?,
    };
    w.finish(cx, UnknownKeys::Warn)?;
    let comet = top.raw("comet").cloned();
    Ok(MonitorConfig {
        tensorboard,
        csv_monitor,
        wandb,
        comet,
    })
}

pub(crate) fn read_checkpoint(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<CheckpointConfig, ConfigError> {
    let mut s = top.child("checkpoint", cx)?;
    let tag: String = cx.get(&mut s, &["tag_validation"], "WARN".to_string())?;
    let tag_validation = match tag.to_ascii_uppercase().as_str() {
        "WARN" => TagValidation::Warn,
        "IGNORE" => TagValidation::Ignore,
        "FAIL" => TagValidation::Fail,
        _ => {
            return Err(cx.invalid(
                "checkpoint.tag_validation",
                &Value::String(tag),
                "valid modes are \"Warn\", \"Ignore\" and \"Fail\"",
            ))
        }
    };
    let load_universal = cx.get(&mut s, &["load_universal"], false)?;
    let use_node_local_storage = cx.get(&mut s, &["use_node_local_storage"], false)?;
    let mut pw = s.child("parallel_write", cx)?;
    let parallel_write_pipeline_stage = cx.get(&mut pw, &["pipeline_stage"], false)?;
    pw.finish(cx, UnknownKeys::Warn)?;
    Ok(CheckpointConfig {
        tag_validation,
        load_universal,
        use_node_local_storage,
        parallel_write_pipeline_stage,
        other: others(
            top.raw("checkpoint"),
            &[
                "tag_validation",
                "load_universal",
                "use_node_local_storage",
                "parallel_write",
            ],
        ),
    })
}

pub(crate) fn read_aio(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<AioConfig, ConfigError> {
    let mut s = top.child("aio", cx)?;
    let c = AioConfig {
        block_size: cx.get(&mut s, &["block_size"], 1_048_576)?,
        queue_depth: cx.get(&mut s, &["queue_depth"], 8)?,
        intra_op_parallelism: cx.get(&mut s, &["intra_op_parallelism", "thread_count"], 1)?,
        single_submit: cx.get(&mut s, &["single_submit"], false)?,
        overlap_events: cx.get(&mut s, &["overlap_events"], true)?,
        use_gds: cx.get(&mut s, &["use_gds"], false)?,
    };
    s.finish(cx, UnknownKeys::Warn)?;
    Ok(c)
}

pub(crate) fn read_comms_logger(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<CommsLoggerConfig, ConfigError> {
    let mut s = top.child("comms_logger", cx)?;
    let c = CommsLoggerConfig {
        enabled: cx.get(&mut s, &["enabled"], false)?,
        prof_all: cx.get(&mut s, &["prof_all"], true)?,
        prof_ops: cx.get(&mut s, &["prof_ops"], Vec::new())?,
        verbose: cx.get(&mut s, &["verbose"], false)?,
        debug: cx.get(&mut s, &["debug"], false)?,
    };
    s.finish(cx, UnknownKeys::Warn)?;
    Ok(c)
}

pub(crate) fn read_flops_profiler(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<FlopsProfilerConfig, ConfigError> {
    let mut s = top.child("flops_profiler", cx)?;
    let c = FlopsProfilerConfig {
        enabled: cx.get(&mut s, &["enabled"], false)?,
        recompute_fwd_factor: cx.get(&mut s, &["recompute_fwd_factor"], 0.0)?,
        profile_step: cx.get(&mut s, &["profile_step"], 1)?,
        module_depth: cx.get(&mut s, &["module_depth"], -1)?,
        top_modules: cx.get(&mut s, &["top_modules"], 1)?,
        detailed: cx.get(&mut s, &["detailed"], true)?,
        output_file: cx.get(&mut s, &["output_file"], None)?,
    };
    s.finish(cx, UnknownKeys::Warn)?;
    Ok(c)
}

/// Reads a dtype key (`communication_data_type`, `seq_parallel_communication_data_type`).
pub(crate) fn read_comm_dtype(
    top: &mut Section<'_>,
    cx: &mut Cx<'_>,
    name: &'static str,
) -> Result<Option<CommDataType>, ConfigError> {
    let Some(written): Option<String> = cx.get(top, &[name], None)? else {
        return Ok(None);
    };
    let lower = written.to_ascii_lowercase();
    let dtype = match lower.as_str() {
        "fp32" => CommDataType::Fp32,
        "fp16" => CommDataType::Fp16,
        "bf16" => CommDataType::Bf16,
        // torch's spellings: DeepSpeed rejects them here, but they are unambiguous.
        "float32" | "float" | "torch.float32" => CommDataType::Fp32,
        "float16" | "half" | "torch.float16" => CommDataType::Fp16,
        "bfloat16" | "torch.bfloat16" => CommDataType::Bf16,
        _ => {
            return Err(cx.invalid(
                name,
                &Value::String(written),
                "valid types are \"fp32\", \"fp16\" and \"bf16\"",
            ));
        }
    };
    if !matches!(lower.as_str(), "fp32" | "fp16" | "bf16") {
        cx.warning(
            name,
            format!("\"{written}\" read as {dtype:?}; DeepSpeed itself accepts only fp32, fp16 or bf16"),
        );
    }
    Ok(Some(dtype))
}
