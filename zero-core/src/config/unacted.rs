//! Settings DeepSpeed acts on that this project reads and does not: each one a file sets (to
//! anything but DeepSpeed's default) becomes a warning that says what happens instead, so that a
//! config written for DeepSpeed never trains without a feature it asked for and without a word.
//!
//! Two kinds. A feature (ZeRO++ quantization, MiCS, Apex AMP, progressive layer drop, ...)
//! changes what is computed, stored or written: each gets a warning of its own. A tuning knob of
//! DeepSpeed's own engine (bucket sizes, pinned buffers, aio queue depths, ...) changes no result:
//! those are named together in one warning. Keys this project honours, or whose purpose it meets
//! another way (checkpoints load at any world size, so `load_universal` asks for nothing more),
//! are not listed.

use super::error::ConfigWarning;
use super::resolved::ResolvedConfig;
use super::scheduler::SchedulerConfig;
use crate::lr_schedule::CYCLED_BETA2;
use serde_json::Value;

/// A feature of DeepSpeed's that this project does not have: the dotted key (in the resolved
/// config's printed form), DeepSpeed's default as JSON, and what happens here instead.
const FEATURES: &[(&str, &str, &str)] = &[
    (
        "zero_optimization.zero_quantized_weights",
        "false",
        "ZeRO++ quantized weight gathers are not available: parameters are all-gathered in their own dtype \
         (exact, twice the traffic of int8)",
    ),
    (
        "zero_optimization.zero_quantized_nontrainable_weights",
        "false",
        "ZeRO++ quantized frozen weights are not available: they are kept in their own dtype",
    ),
    (
        "zero_optimization.zero_quantized_gradients",
        "false",
        "ZeRO++ quantized gradient reduction is not available: gradients are reduced in their own dtype, or in \
         communication_data_type",
    ),
    (
        "zero_optimization.zeropp_loco_param",
        "null",
        "LoCo error feedback belongs to ZeRO++ quantized gradients, which are not available",
    ),
    (
        "zero_optimization.zero_hpz_partition_size",
        "1",
        "ZeRO++ hierarchical partitioning (hpZ) is not available: every gather spans all data-parallel ranks \
         and no secondary copy of the parameters is kept (less memory, more traffic between nodes)",
    ),
    (
        "zero_optimization.mics_shard_size",
        "-1",
        "MiCS is not available: parameters, gradients and optimizer state are sharded over all data-parallel \
         ranks, not over groups of this size (less memory per rank, more traffic)",
    ),
    (
        "zero_optimization.mics_hierarchical_params_gather",
        "false",
        "belongs to MiCS, which is not available",
    ),
    (
        "zero_optimization.stage3_model_persistence_threshold",
        "9223372036854775807",
        "no cap on the elements kept whole is applied: every unit below stage3_param_persistence_threshold stays \
         whole, however many there are",
    ),
    (
        "zero_optimization.load_from_fp32_weights",
        "true",
        "a checkpoint always restores the fp32 master weights it saved; they are never rebuilt from the 16-bit \
         weights",
    ),
    (
        "zero_optimization.ignore_unused_parameters",
        "true",
        "a parameter that gets no gradient is not an error here",
    ),
    (
        "zero_optimization.leaf_module",
        "null",
        "the units gathered as one are the model's ZeroModule fields; this list is not read",
    ),
    (
        "zero_optimization.zenflow",
        "null",
        "ZenFlow's deferred updates are not available: every step updates every parameter",
    ),
    (
        "zero_optimization.offload_optimizer.super_offload",
        "false",
        "SuperOffload is not available: the optimizer state is offloaded as offload_optimizer.device says",
    ),
    (
        "amp.enabled",
        "false",
        "Apex AMP is not available: the run computes in fp32; the fp16 or bf16 section gives mixed precision",
    ),
    (
        "memory_breakdown",
        "false",
        "the memory breakdown is not printed each step; the optimizer's per-rank memory report (which `gpt2 \
         train` prints at its end) and `zero estimate` before the launch give the model states",
    ),
    ("dump_state", "false", "the engine's state is not printed at the start"),
    (
        "comms_logger.enabled",
        "false",
        "collectives are not logged one by one; wall_clock_breakdown times the step's parts",
    ),
    (
        "flops_profiler.enabled",
        "false",
        "FLOPs are not profiled; the step's wall-clock breakdown is printed instead",
    ),
    (
        "wandb.enabled",
        "false",
        "Weights & Biases is not reached from here (it needs its service): csv_monitor or tensorboard write the \
         same values",
    ),
    (
        "dataloader_drop_last",
        "false",
        "there is no DeepSpeed data loader here: the training loop batches its own data",
    ),
    (
        "checkpoint.use_node_local_storage",
        "false",
        "every rank writes its files under the checkpoint directory given; node-local storage is not used",
    ),
    (
        "pipeline.activation_checkpoint_interval",
        "0",
        "pipeline stages checkpoint activations as the activation_checkpointing section says, not every N layers",
    ),
    (
        "pipeline.seed_layers",
        "false",
        "layers are initialised from the run's one seed, not each from a seed of its own",
    ),
];

/// When a section kept as written turns its feature on.
#[derive(Clone, Copy)]
enum On {
    /// `"enabled": true` in the section.
    Enabled,
    /// `"enabled": true` anywhere inside it (its parts are switched one by one).
    AnyPart,
    /// Being there at all.
    Present,
}

/// Sections kept as written that turn a DeepSpeed feature on, and what happens here instead.
const PASSTHROUGH_FEATURES: &[(&str, On, &str)] = &[
    (
        "elasticity",
        On::Enabled,
        "elastic training is not available: the batch sizes are the config's, for the world size launched",
    ),
    (
        "progressive_layer_drop",
        On::Enabled,
        "progressive layer drop is not available: every layer runs at every step",
    ),
    (
        "curriculum_learning",
        On::Enabled,
        "curriculum learning is not available: every batch is as the data gives it",
    ),
    (
        "data_efficiency",
        On::Enabled,
        "data efficiency (curriculum sampling, random layer-token drop) is not available: every batch is as the \
         data gives it",
    ),
    (
        "compression_training",
        On::AnyPart,
        "compression training is not available: weights and activations are trained uncompressed",
    ),
    (
        "sparse_attention",
        On::Present,
        "sparse attention is not available: attention is the model's own",
    ),
    (
        "quantize_training",
        On::Enabled,
        "quantization-aware training is not available: weights are trained unquantized",
    ),
    ("eigenvalue", On::Enabled, "eigenvalue computation is not available"),
    (
        "hybrid_engine",
        On::Enabled,
        "the hybrid (RLHF generation) engine is not available",
    ),
    (
        "torch_autocast",
        On::Enabled,
        "autocast is not available: the run computes in fp32; the fp16 or bf16 section gives mixed precision",
    ),
    (
        "autotuning",
        On::Enabled,
        "autotuning is not available: the run uses the config's values",
    ),
    (
        "nebula",
        On::Enabled,
        "the Nebula checkpoint service is not available: checkpoints are written in this project's own format",
    ),
    (
        "compile",
        On::Present,
        "DeepSpeed's compilation (torch.compile, DeepCompile) is not available: the model runs on Burn's backend \
         as written (its fusion and autotuning, on CUDA, are Burn's own)",
    ),
    (
        "timers",
        On::AnyPart,
        "DeepSpeed's throughput timers are not kept: wall_clock_breakdown times the step's parts, and gpt2 train \
         prints tokens/s",
    ),
    (
        "data_types",
        On::Present,
        "data_types.grad_accum_dtype is not acted on: gradients accumulate in the dtype Burn's backward gives them \
         (the compute dtype; Burn's GradientsAccumulator sums them), and the optimizer steps in fp32",
    ),
    (
        "datastates",
        On::Present,
        "the DataStates checkpoint engine is not available: checkpoints are written in this project's own format",
    ),
];

/// DeepSpeed's own performance knobs with no counterpart here: the dotted key and DeepSpeed's
/// default as JSON. Setting them changes no result.
const TUNING: &[(&str, &str)] = &[
    ("zero_optimization.contiguous_gradients", "true"),
    ("zero_optimization.use_multi_rank_bucket_allreduce", "true"),
    ("zero_optimization.allgather_partitions", "true"),
    ("zero_optimization.allgather_bucket_size", "500000000"),
    ("zero_optimization.round_robin_gradients", "false"),
    ("zero_optimization.legacy_stage1", "false"),
    // Units stay gathered between uses only within the prefetch window here.
    ("zero_optimization.stage3_max_reuse_distance", "1000000000"),
    ("zero_optimization.stage3_module_granularity_threshold", "0"),
    ("zero_optimization.stage3_use_all_reduce_for_fetch_params", "false"),
    ("zero_optimization.stage3_allgather_sequential", "false"),
    ("zero_optimization.memory_efficient_linear", "true"),
    ("zero_optimization.pipeline_loading_checkpoint", "false"),
    ("zero_optimization.override_module_apply", "true"),
    ("zero_optimization.log_trace_cache_warnings", "false"),
    ("zero_optimization.enable_sanity_checks", "false"),
    ("zero_optimization.offload_optimizer.pin_memory", "false"),
    ("zero_optimization.offload_optimizer.pipeline_read", "false"),
    ("zero_optimization.offload_optimizer.pipeline_write", "false"),
    ("zero_optimization.offload_optimizer.fast_init", "false"),
    ("zero_optimization.offload_optimizer.cpuadam_cores_perc", "0.8"),
    ("zero_optimization.offload_param.pin_memory", "false"),
    ("zero_optimization.offload_param.buffer_count", "5"),
    ("zero_optimization.offload_param.buffer_size", "100000000"),
    ("disable_allgather", "false"),
    ("sparse_gradients", "false"),
    ("aio.block_size", "1048576"),
    ("aio.queue_depth", "8"),
    ("aio.intra_op_parallelism", "1"),
    ("aio.single_submit", "false"),
    ("aio.overlap_events", "true"),
    ("aio.use_gds", "false"),
    ("activation_checkpointing.contiguous_memory_optimization", "false"),
    ("activation_checkpointing.profile", "false"),
    ("pipeline.pipe_partitioned", "true"),
    ("pipeline.grad_partitioned", "true"),
    ("tensor_parallel.tp_overlap_comm", "false"),
];

/// The warnings for `config` (a file's settings, as read): one per feature set that is not
/// available here, and one naming every tuning knob set.
pub(crate) fn notices(config: &ResolvedConfig) -> Vec<ConfigWarning> {
    let Ok(printed) = serde_json::to_value(config) else {
        return Vec::new();
    };
    let set = |key: &str, default: &str| -> bool {
        let default: Value = serde_json::from_str(default).unwrap_or(Value::Null);
        at(&printed, key).is_some_and(|value| !same(value, &default))
    };
    let mut out: Vec<ConfigWarning> = FEATURES
        .iter()
        .filter(|(key, default, _)| set(key, default))
        .map(|(key, _, says)| ConfigWarning::new(*key, *says))
        .collect();
    for (section, rule, says) in PASSTHROUGH_FEATURES {
        let on = config.passthrough.get(*section).is_some_and(|value| match rule {
            On::Enabled => enabled(value),
            On::AnyPart => any_part_enabled(value),
            On::Present => !value.is_null(),
        });
        if on {
            out.push(ConfigWarning::new(*section, *says));
        }
    }
    if let Some(size) = config.passthrough.get("sequence_parallel_size").and_then(Value::as_u64) {
        if size > 1 {
            out.push(ConfigWarning::new(
                "sequence_parallel_size",
                format!(
                    "sequence parallelism is not available: every rank sees whole sequences, and the data-parallel \
                     world size is the whole world, not the world over {size}"
                ),
            ));
        }
    }
    if config.monitors.comet.as_ref().is_some_and(enabled) {
        out.push(ConfigWarning::new(
            "comet.enabled",
            "the Comet monitor is not reached from here (it needs its service): csv_monitor or tensorboard write \
             the same values",
        ));
    }
    if let Some(SchedulerConfig::OneCycle(p)) = &config.scheduler {
        let betas = config
            .optimizer
            .as_ref()
            .and_then(|o| o.shard_spec())
            .map(|s| s.betas());
        match betas {
            Some(None) if p.cycle_momentum => out.push(ConfigWarning::new(
                "scheduler.params.cycle_momentum",
                "SGD has no betas, so its momentum is not cycled (DeepSpeed turns cycle_momentum off for it too): \
                 the learning rate cycles, the momentum keeps its configured value",
            )),
            Some(Some((_, beta2))) if p.cycle_momentum && beta2 != CYCLED_BETA2 => out.push(ConfigWarning::new(
                "scheduler.params.cycle_momentum",
                format!(
                    "OneCycle sets the optimizer's betas to (momentum, {CYCLED_BETA2}) at every step, as DeepSpeed's \
                     does: betas[1] = {beta2} from optimizer.params is not used (cycle_momentum false keeps the \
                     optimizer's betas)"
                ),
            )),
            _ => {}
        }
    }
    let tuned: Vec<&str> = TUNING
        .iter()
        .filter(|(key, default)| set(key, default))
        .map(|(key, _)| *key)
        .collect();
    if !tuned.is_empty() {
        out.push(ConfigWarning::new(
            "",
            format!(
                "tuning for DeepSpeed's own engine, with no counterpart here (it changes no result): {}",
                tuned.join(", ")
            ),
        ));
    }
    out
}

fn enabled(section: &Value) -> bool {
    section.get("enabled") == Some(&Value::Bool(true))
}

fn any_part_enabled(value: &Value) -> bool {
    match value {
        Value::Object(m) => enabled(value) || m.values().any(any_part_enabled),
        Value::Array(items) => items.iter().any(any_part_enabled),
        _ => false,
    }
}

/// The value at a dotted key; `None` where a section on the way is absent (`null`).
fn at<'a>(root: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.').try_fold(root, |v, part| v.get(part))
}

/// JSON equality with numbers compared as numbers (`1` and `1.0` are the same setting; two
/// integers exactly, however large).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if !x.is_f64() && !y.is_f64() => {
            x.as_u64() == y.as_u64() && x.as_i64() == y.as_i64()
        }
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DeepSpeedConfig;
    use serde_json::json;

    /// A ZeRO-3 config with both offload sections (so their keys exist), and `key` set to `value`.
    fn config_with(entries: &[(&str, Value)]) -> Value {
        let mut root = json!({
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"}
            }
        });
        for (key, value) in entries {
            let mut at = &mut root;
            let parts: Vec<&str> = key.split('.').collect();
            for part in &parts[..parts.len() - 1] {
                at = at
                    .as_object_mut()
                    .unwrap()
                    .entry(part.to_string())
                    .or_insert_with(|| json!({}));
            }
            at[parts[parts.len() - 1]] = value.clone();
        }
        root
    }

    fn warnings(root: Value) -> Vec<ConfigWarning> {
        DeepSpeedConfig::from_value(root, "test.json").unwrap().warnings
    }

    /// Another value than DeepSpeed's default, of the same kind.
    fn other_than(default: &Value) -> Value {
        match default {
            Value::Bool(b) => Value::Bool(!b),
            Value::Null => json!({"x": 1}),
            Value::Number(n) if n.is_f64() => json!(n.as_f64().unwrap() / 2.0),
            Value::Number(n) if n.as_i64() == Some(-1) => json!(4),
            Value::Number(n) => json!(n.as_u64().unwrap().saturating_sub(1).max(2)),
            other => panic!("no other value for {other}"),
        }
    }

    /// Writing every listed key at DeepSpeed's default says nothing: the defaults in the tables
    /// are the parser's, in the printed form's types (reference: DeepSpeed's documented defaults,
    /// which the parser follows).
    #[test]
    fn every_key_at_its_default_says_nothing() {
        let entries: Vec<(&str, Value)> = FEATURES
            .iter()
            .map(|(k, d, _)| (*k, serde_json::from_str(d).unwrap()))
            .chain(TUNING.iter().map(|(k, d)| (*k, serde_json::from_str(d).unwrap())))
            .collect();
        let said = warnings(config_with(&entries));
        assert!(said.is_empty(), "{said:?}");
    }

    /// Each feature key set otherwise gets its own warning, naming it.
    #[test]
    fn each_feature_set_is_named() {
        for (key, default, says) in FEATURES {
            let value = other_than(&serde_json::from_str(default).unwrap());
            let said = warnings(config_with(&[(key, value.clone())]));
            assert!(
                said.iter().any(|w| w.key == *key && w.message == *says),
                "{key} = {value}: {said:?}"
            );
        }
    }

    /// The tuning knobs set otherwise are named together, in one warning.
    #[test]
    fn tuning_knobs_are_named_together() {
        let entries: Vec<(&str, Value)> = TUNING
            .iter()
            .map(|(k, d)| (*k, other_than(&serde_json::from_str(d).unwrap())))
            .collect();
        let said = warnings(config_with(&entries));
        let tuning: Vec<_> = said.iter().filter(|w| w.message.starts_with("tuning")).collect();
        assert_eq!(tuning.len(), 1, "{said:?}");
        for (key, _) in TUNING {
            assert!(
                tuning[0].message.contains(key),
                "{key} missing from {}",
                tuning[0].message
            );
        }
    }

    /// Sections DeepSpeed turns on: by `enabled`, by any part's `enabled`, or by being there.
    #[test]
    fn passthrough_features_warn_only_when_on() {
        let off = json!({"train_batch_size": 8,
            "elasticity": {"enabled": false},
            "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": false}}},
            "sequence_parallel_size": 1,
            "timers": {"throughput": {"enabled": false}},
            "comet": {"enabled": false}});
        assert!(warnings(off).is_empty());
        let on = json!({"train_batch_size": 8,
            "elasticity": {"enabled": true},
            "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": true}}},
            "sparse_attention": {"mode": "fixed"},
            "compile": {"deepcompile": true},
            "timers": {"throughput": {"enabled": true}},
            "data_types": {"grad_accum_dtype": "bf16"},
            "sequence_parallel_size": 4,
            "comet": {"enabled": true}});
        let keys: Vec<String> = warnings(on).into_iter().map(|w| w.key).collect();
        assert_eq!(
            keys,
            [
                "elasticity",
                "compression_training",
                "sparse_attention",
                "compile",
                "timers",
                "data_types",
                "sequence_parallel_size",
                "comet.enabled"
            ]
        );
    }
}
