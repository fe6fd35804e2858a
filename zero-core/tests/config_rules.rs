//! The configuration rules, end to end through `DeepSpeedConfig::from_str` and `resolve`.
//! References: DeepSpeed's documented defaults and rules (runtime/zero/config.py,
//! runtime/config.py, lr_schedules.py), written down here as literal expectations.

use serde_json::json;
use zero_core::config::*;

fn parse(text: &str) -> Parsed {
    DeepSpeedConfig::from_str(text, "test.json").unwrap_or_else(|e| panic!("{e}"))
}

fn err(text: &str) -> String {
    DeepSpeedConfig::from_str(text, "test.json").unwrap_err().to_string()
}

fn resolve(text: &str, world: usize) -> ResolvedConfig {
    let ctx = ResolveContext {
        world_size: world,
        ..Default::default()
    };
    parse(text).config.resolve(&ctx).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn deepspeed_defaults_fill_absent_keys() {
    let c = resolve(r#"{"train_batch_size": 8}"#, 1);
    assert_eq!(c.zero.stage, ZeroStage::Disabled);
    assert_eq!(c.zero.reduce_bucket_size, 500_000_000);
    assert_eq!(c.zero.allgather_bucket_size, 500_000_000);
    assert!(!c.zero.overlap_comm, "overlap_comm defaults to false below stage 3");
    assert!(c.zero.contiguous_gradients && c.zero.reduce_scatter && c.zero.allgather_partitions);
    assert_eq!(c.zero.stage3_prefetch_bucket_size, 50_000_000);
    assert_eq!(c.zero.stage3_param_persistence_threshold, 100_000);
    assert_eq!(c.zero.stage3_max_live_parameters, 1_000_000_000);
    assert_eq!(c.zero.stage3_max_reuse_distance, 1_000_000_000);
    assert_eq!(c.zero.stage3_model_persistence_threshold, i64::MAX as u64);
    assert_eq!(c.zero.sub_group_size, 1_000_000_000);
    assert_eq!(c.zero.mics_shard_size, -1);
    assert!(c.zero.offload_optimizer.is_none() && c.zero.offload_param.is_none());
    assert_eq!(c.precision, Precision::Fp32);
    assert_eq!(c.gradient_clipping, 1.0);
    assert_eq!(c.steps_per_print, 10);
    assert!(c.optimizer.is_none() && c.scheduler.is_none());
    assert!(
        resolve(r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3}}"#, 1)
            .zero
            .overlap_comm
    );
}

#[test]
fn fp16_defaults_and_precision_choice() {
    let c = resolve(r#"{"train_batch_size": 8, "fp16": {"enabled": true}}"#, 1);
    let Precision::Fp16(l) = c.precision else {
        panic!("{:?}", c.precision)
    };
    assert_eq!(
        (l.loss_scale, l.initial_scale_power, l.loss_scale_window, l.hysteresis),
        (0.0, 16, 1000, 2)
    );
    assert_eq!((l.consecutive_hysteresis, l.min_loss_scale), (false, 1.0));
    assert!(l.is_dynamic() && l.initial_scale() == 65536.0);
    let c = resolve(r#"{"train_batch_size": 8, "bfloat16": {"enabled": true}}"#, 1);
    assert!(matches!(c.precision, Precision::Bf16(_)));
    let e = err(r#"{"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}}"#);
    assert!(e.contains("fp16.enabled") && e.contains("bf16.enabled"), "{e}");
}

#[test]
fn integers_written_as_floats_and_fractional_errors() {
    let c = resolve(
        r#"{"train_batch_size": 8.0, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}"#,
        1,
    );
    assert_eq!((c.train_batch_size, c.zero.reduce_bucket_size), (8, 50_000_000));
    let e = err(r#"{"train_batch_size": 8, "zero_optimization": {"allgather_bucket_size": 2.5}}"#);
    assert!(
        e.contains("test.json") && e.contains("`zero_optimization.allgather_bucket_size`") && e.contains("2.5"),
        "{e}"
    );
    let e = err(r#"{"train_batch_size": 8, "zero_optimization": {"overlap_comm": 1}}"#);
    assert!(e.contains("boolean"), "{e}");
}

#[test]
fn legacy_spellings() {
    let c = resolve(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload": true,
            "cpu_offload_param": true, "max_live_parameters": 3e8, "prefetch_bucket_size": 7,
            "param_persistence_threshold": 9, "stage3_gather_fp16_weights_on_model_save": true}}"#,
        1,
    );
    assert_eq!(
        c.zero.offload_optimizer.as_ref().map(|o| o.device),
        Some(OffloadDevice::Cpu)
    );
    assert_eq!(
        c.zero.offload_param.as_ref().map(|o| o.device),
        Some(OffloadDevice::Cpu)
    );
    assert_eq!(c.zero.stage3_max_live_parameters, 300_000_000);
    assert_eq!(
        (
            c.zero.stage3_prefetch_bucket_size,
            c.zero.stage3_param_persistence_threshold
        ),
        (7, 9)
    );
    assert!(c.zero.stage3_gather_16bit_weights_on_model_save);
    let c = resolve(
        r#"{"train_batch_size": 8, "zero_optimization": {"gather_16bit_weights_on_model_save": true}}"#,
        1,
    );
    assert!(c.zero.stage3_gather_16bit_weights_on_model_save);
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"cpu_offload": true, "offload_optimizer": {"device": "cpu"}}}"#,
    );
    assert!(e.contains("cpu_offload") && e.contains("offload_optimizer"), "{e}");
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"max_live_parameters": 1, "stage3_max_live_parameters": 2}}"#,
    );
    assert!(e.contains("conflicts"), "{e}");
    // The oldest form: a boolean.
    let c = resolve(
        r#"{"train_batch_size": 8, "zero_optimization": true, "allgather_size": 1000}"#,
        1,
    );
    assert_eq!(
        (c.zero.stage, c.zero.allgather_bucket_size),
        (ZeroStage::OptimizerStates, 1000)
    );
}

#[test]
fn offload_sections() {
    let c = resolve(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "ratio": 0.5, "buffer_count": 8},
            "offload_param": {"device": "cpu", "pin_memory": true}}}"#,
        1,
    );
    // Reference for the defaults: DeepSpeed's offload_config.py (pin_memory False, buffer_count
    // 4 and 5, buffer_size 1e8, max_in_cpu 1e9).
    let o = c.zero.offload_optimizer.unwrap();
    assert_eq!(
        (o.device, o.nvme_path.as_deref(), o.ratio, o.buffer_count, o.pin_memory),
        (OffloadDevice::Nvme, Some("/nvme"), 0.5, 8, false)
    );
    let p = c.zero.offload_param.unwrap();
    assert_eq!(
        (p.pin_memory, p.buffer_count, p.buffer_size, p.max_in_cpu),
        (true, 5, 100_000_000, 1_000_000_000)
    );
    let none = resolve(
        r#"{"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "none"}}}"#,
        1,
    );
    assert!(none.zero.offload_optimizer.is_none());
    let e = err(r#"{"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}}"#);
    assert!(
        e.contains("zero_optimization.offload_optimizer.device") && e.contains("\"cpu\", \"nvme\""),
        "{e}"
    );
    let e = err(r#"{"train_batch_size": 8, "zero_optimization": {"offload_param": {"device": "nvme"}}}"#);
    assert!(e.contains("nvme_path"), "{e}");
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}"#,
    );
    assert!(e.contains("stage 3"), "{e}");
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": true}}}"#,
    );
    assert!(e.contains("did you mean `pin_memory`?"), "{e}");
}

#[test]
fn unknown_keys_error_in_zero_and_warn_at_top_level() {
    let e = err(r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_prefetch_bucketsize": 5}}"#);
    assert!(
        e.contains("zero_optimization.stage3_prefetch_bucketsize")
            && e.contains("did you mean `stage3_prefetch_bucket_size`?"),
        "{e}"
    );
    let p = parse(
        r#"{"train_batch_size": 8, "gradient_clippping": 1.0, "cuda_visible_devices": "0", "elasticity": {"enabled": false}}"#,
    );
    let w: Vec<String> = p.warnings.iter().map(|w| w.to_string()).collect();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w.iter()
            .any(|w| w.contains("gradient_clippping") && w.contains("did you mean `gradient_clipping`?")),
        "{w:?}"
    );
    // A ZeRO setting at the top level: pointed to its section, whichever of the section's keys
    // it is (the section's reader says which it reads).
    for key in [
        "offload_optimizer",
        "zero_hpz_partition_size",
        "stage3_max_live_parameters",
    ] {
        let w: Vec<String> = parse(&format!(r#"{{"train_batch_size": 8, "{key}": {{"device": "cpu"}}}}"#))
            .warnings
            .iter()
            .map(|w| w.to_string())
            .collect();
        let hint = format!("did you mean `zero_optimization.{key}`?");
        assert!(w.iter().any(|w| w.contains(&hint)), "{key}: {w:?}");
    }
    // A known section we do not act on is kept, silently.
    let c = p
        .config
        .resolve(&ResolveContext {
            world_size: 1,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(c.passthrough["elasticity"], json!({"enabled": false}));
}

#[test]
fn optimizers() {
    let opt = |t: &str| {
        resolve(&format!(r#"{{"train_batch_size": 8, "optimizer": {t}}}"#), 1)
            .optimizer
            .unwrap()
    };
    let OptimizerConfig::Adam(a) = opt(r#"{"type": "adam", "params": {"lr": 1e-4}}"#) else {
        panic!()
    };
    assert!(a.adam_w_mode, "DeepSpeed's Adam is AdamW unless adam_w_mode is false");
    assert_eq!(
        (a.lr, a.betas, a.eps, a.weight_decay, a.bias_correction),
        (1e-4, [0.9, 0.999], 1e-8, 0.0, true)
    );
    let OptimizerConfig::Adam(a) = opt(r#"{"type": "Adam", "params": {"adam_w_mode": false}}"#) else {
        panic!()
    };
    assert!(!a.adam_w_mode);
    let OptimizerConfig::AdamW(a) = opt(r#"{"type": "ADAMW", "params": {"adam_w_mode": false}}"#) else {
        panic!()
    };
    assert!(a.adam_w_mode);
    let OptimizerConfig::Sgd(s) = opt(r#"{"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true}}"#)
    else {
        panic!()
    };
    assert_eq!((s.lr, s.momentum, s.nesterov, s.dampening), (0.1, 0.9, true, 0.0));
    let OptimizerConfig::Lamb(l) = opt(r#"{"type": "Lamb", "params": {}}"#) else {
        panic!()
    };
    assert_eq!((l.max_coeff, l.min_coeff, l.lr), (10.0, 0.01, 1e-3));
    let OptimizerConfig::Lion(l) = opt(r#"{"type": "lion", "params": {"betas": [0.9, 0.99]}}"#) else {
        panic!()
    };
    assert_eq!(l.betas, [0.9, 0.99]);
    let o = opt(r#"{"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400}}"#);
    assert_eq!((o.name(), o.lr()), ("OneBitAdam", Some(1e-3)));
    let e = err(r#"{"train_batch_size": 8, "optimizer": {"type": "Adamm"}}"#);
    assert!(
        e.contains("optimizer.type") && e.contains("did you mean \"Adam\""),
        "{e}"
    );
    let e = err(r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"weight_deacy": 0.1}}}"#);
    assert!(
        e.contains("optimizer.params.weight_deacy") && e.contains("weight_decay"),
        "{e}"
    );
}

#[test]
fn schedulers() {
    let s = |t: &str| {
        resolve(&format!(r#"{{"train_batch_size": 8, "scheduler": {t}}}"#), 1)
            .scheduler
            .unwrap()
    };
    let SchedulerConfig::WarmupLR(w) = s(r#"{"type": "WarmupLR", "params": {}}"#) else {
        panic!()
    };
    assert_eq!(
        (w.warmup_min_lr, w.warmup_max_lr, w.warmup_num_steps, w.warmup_type),
        (0.0, None, 1000, WarmupType::Log)
    );
    let SchedulerConfig::WarmupDecayLR(w) = s(r#"{"type": "WarmupDecayLR", "params": {"total_num_steps": 1e4}}"#)
    else {
        panic!()
    };
    assert_eq!((w.total_num_steps, w.warmup.warmup_max_lr), (10_000, Some(0.001)));
    let SchedulerConfig::WarmupCosineLR(w) =
        s(r#"{"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_type": "linear"}}"#)
    else {
        panic!()
    };
    assert_eq!((w.cos_min_ratio, w.warmup_type), (0.0001, WarmupType::Linear));
    let SchedulerConfig::OneCycle(o) =
        s(r#"{"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1}}"#)
    else {
        panic!()
    };
    assert_eq!(
        (
            o.cycle_first_step_size,
            o.cycle_min_mom,
            o.cycle_max_mom,
            o.cycle_momentum
        ),
        (2000, 0.8, 0.9, true)
    );
    let SchedulerConfig::LRRangeTest(l) = s(r#"{"type": "LRRangeTest", "params": {}}"#) else {
        panic!()
    };
    assert_eq!((l.lr_range_test_min_lr, l.lr_range_test_step_size), (1e-3, 2000));
    let e = err(r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {}}}"#);
    assert!(e.contains("scheduler.params.total_num_steps"), "{e}");
    let e = err(r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupLr2"}}"#);
    assert!(e.contains("did you mean \"WarmupLR\""), "{e}");
}

#[test]
fn auto_values_resolve_from_hidden_size_overrides_or_fail_naming_the_key() {
    let text = r#"{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": "auto"}}"#;
    let parsed = parse(text);
    // "auto" where nothing fills it in means DeepSpeed's default, with a warning.
    assert!(parsed
        .warnings
        .iter()
        .any(|w| w.key == "zero_optimization.stage3_max_live_parameters"));
    let keys: Vec<&str> = parsed.config.auto_keys().iter().map(|d| d.key.as_str()).collect();
    assert!(
        keys.contains(&"optimizer.params.lr") && keys.contains(&"zero_optimization.reduce_bucket_size"),
        "{keys:?}"
    );
    let overrides = Overrides::new()
        .with("train_micro_batch_size_per_gpu", 2)
        .with("gradient_clipping", 0.5)
        .with("optimizer.params.lr", 3e-4)
        .with("optimizer.params.betas", json!([0.9, 0.95]));
    let ctx = ResolveContext {
        world_size: 4,
        hidden_size: Some(1024),
        overrides: overrides.clone(),
    };
    let c = parsed.config.resolve(&ctx).unwrap();
    assert_eq!(
        (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps),
        (8, 2, 1)
    );
    assert_eq!(c.zero.reduce_bucket_size, 1024 * 1024);
    assert_eq!(c.zero.stage3_prefetch_bucket_size, 943_718, "floor(0.9 * 1024^2)");
    assert_eq!(c.zero.stage3_param_persistence_threshold, 10 * 1024);
    assert_eq!(c.zero.stage3_max_live_parameters, 1_000_000_000);
    assert_eq!(c.gradient_clipping, 0.5);
    let OptimizerConfig::AdamW(a) = c.optimizer.unwrap() else {
        panic!()
    };
    assert_eq!((a.lr, a.betas), (3e-4, [0.9, 0.95]));

    let no_hidden = ResolveContext {
        world_size: 4,
        hidden_size: None,
        overrides: overrides.clone(),
    };
    let e = parsed.config.resolve(&no_hidden).unwrap_err().to_string();
    assert!(
        e.contains("`zero_optimization.reduce_bucket_size`") && e.contains("hidden size"),
        "{e}"
    );
    let no_lr = ResolveContext {
        world_size: 4,
        hidden_size: Some(8),
        overrides: Overrides::new()
            .with("train_micro_batch_size_per_gpu", 2)
            .with("gradient_clipping", 1.0),
    };
    let e = parsed.config.resolve(&no_lr).unwrap_err().to_string();
    assert!(e.contains("`optimizer.params.lr`"), "{e}");
}

#[test]
fn relaxed_json_and_templates() {
    let p = parse("{\n // batch\n \"train_batch_size\": 8, # hash comment\n}\n");
    assert_eq!(p.warnings.len(), 2, "{:?}", p.warnings);
    let e = err("{\n \"train_batch_size\": 8,\n \"zero_optimization\": {\"stage\": ${zero_stage}}\n}");
    assert!(e.contains("test.json:3") && e.contains("${zero_stage}"), "{e}");
    let e = err(r#"{"train_batch_size": "${BATCH}"}"#);
    assert!(e.contains("placeholder `${BATCH}`"), "{e}");
}

#[test]
fn communication_dtype_spellings() {
    let p = parse(r#"{"train_batch_size": 8, "communication_data_type": "float32"}"#);
    assert_eq!(p.warnings.len(), 1);
    let c = p
        .config
        .resolve(&ResolveContext {
            world_size: 1,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(c.communication_data_type, Some(CommDataType::Fp32));
    let e = err(r#"{"train_batch_size": 8, "communication_data_type": "int8"}"#);
    assert!(
        e.contains("communication_data_type") && e.contains("\"fp32\", \"fp16\" and \"bf16\""),
        "{e}"
    );
}

#[test]
fn resolved_config_prints_with_deepspeed_keys() {
    let c = resolve(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}"#,
        2,
    );
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["zero_optimization"]["stage"], 2);
    assert_eq!(v["train_micro_batch_size_per_gpu"], 2);
    assert_eq!(v["train_batch_size"], 4);
    assert_eq!(v["optimizer"]["type"], "AdamW");
    assert_eq!(v["optimizer"]["params"]["lr"], 0.001);
    assert_eq!(v["precision"]["dtype"], "fp32");
}

#[test]
fn missing_file_names_the_path() {
    let e = DeepSpeedConfig::from_file("/nonexistent/ds_config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/ds_config.json"), "{e}");
}

/// `offload_param` below stage 3 (real configs carry one): ignored with a warning, as DeepSpeed
/// ignores it there, so the file trains; the resolved config has no parameter offload.
#[test]
fn offload_param_below_stage_3_is_ignored_with_a_warning() {
    let text = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}"#;
    let parsed = parse(text);
    assert!(
        parsed
            .warnings
            .iter()
            .any(|w| w.to_string().contains("stage 3 only") && w.to_string().contains("ignored")),
        "{:?}",
        parsed.warnings
    );
    assert!(resolve(text, 1).zero.offload_param.is_none());
    let legacy = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1, "cpu_offload_param": true}}"#;
    assert!(resolve(legacy, 1).zero.offload_param.is_none());
    let stage_3 = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}"#;
    assert!(resolve(stage_3, 1).zero.offload_param.is_some());
}

/// Counts a run cannot use are refused by the parser, so that `zero check-config` says what a
/// run would: no activation checkpoints, no pipeline stages.
#[test]
fn zero_checkpoints_and_zero_pipeline_stages_are_refused() {
    let e = err(r#"{"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": 0}}"#);
    assert!(
        e.contains("activation_checkpointing.number_checkpoints") && e.contains("positive"),
        "{e}"
    );
    let e = err(r#"{"train_batch_size": 8, "pipeline": {"stages": 0}}"#);
    assert!(e.contains("pipeline.stages") && e.contains("positive"), "{e}");
    parse(
        r#"{"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": null}, "pipeline": {"stages": "auto"}}"#,
    );
}

/// A usable value written as a string ("8", "true") is refused, and the message says to drop
/// the quotes (DeepSpeed fails on the first with a TypeError).
#[test]
fn quoted_numbers_and_booleans_are_named_as_strings() {
    let e = err(r#"{"train_batch_size": 8, "gradient_accumulation_steps": "8"}"#);
    assert!(
        e.contains("gradient_accumulation_steps") && e.contains("write 8 without the quotes"),
        "{e}"
    );
    let e = err(r#"{"train_batch_size": 8, "fp16": {"enabled": "true"}}"#);
    assert!(
        e.contains("fp16.enabled") && e.contains("write true without the quotes"),
        "{e}"
    );
    let e = err(r#"{"train_batch_size": 8, "gradient_accumulation_steps": "eight"}"#);
    assert!(!e.contains("without the quotes"), "{e}");
}

/// An integer too large for its key is named as out of range, not as a non-integer.
#[test]
fn an_integer_beyond_its_range_is_named_so() {
    for text in [
        r#"{"train_batch_size": 100000000000000000000}"#,
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1e20}}"#,
    ] {
        let e = err(text);
        assert!(e.contains("1e+20, out of range"), "{e}");
    }
    let e = err(r#"{"train_batch_size": 8.5}"#);
    assert!(e.contains("found 8.5") && !e.contains("out of range"), "{e}");
}

/// A supplied value for an "auto" key that is of the wrong kind is named as the supplied one,
/// not blamed on the file.
#[test]
fn a_wrong_supplied_value_is_named_as_supplied() {
    let parsed = parse(r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}"#);
    let overrides = zero_core::config::Overrides::from_assignments(&["optimizer.params.lr=abc".to_string()]).unwrap();
    let e = parsed
        .config
        .resolve(&ResolveContext {
            world_size: 1,
            overrides,
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("optimizer.params.lr (the value supplied for its \"auto\")") && e.contains("\"abc\""),
        "{e}"
    );
}

/// A misspelt key in `pipeline` or `tensor_parallel` (whose other keys are kept as written) is
/// a warning with the key meant: a run without the pipeline it asked for is said.
#[test]
fn misspelt_layout_keys_are_named() {
    let w: Vec<String> =
        parse(r#"{"train_batch_size": 8, "pipeline": {"stage": 2}, "tensor_parallel": {"autotp_sise": 2}}"#)
            .warnings
            .iter()
            .map(|w| w.to_string())
            .collect();
    assert!(
        w.iter().any(|w| w.contains("pipeline.stage") && w.contains("`stages`")),
        "{w:?}"
    );
    assert!(
        w.iter()
            .any(|w| w.contains("tensor_parallel.autotp_sise") && w.contains("`autotp_size`")),
        "{w:?}"
    );
}

/// OneCycle's `cycle_momentum` (default true) cycles β1 and sets β2 to 0.99, as DeepSpeed's
/// does: said when the optimizer's own β2 is another value (Adam's default 0.999), and when the
/// optimizer (SGD) has no betas to cycle; silent when it is off or changes nothing.
#[test]
fn one_cycle_momentum_says_what_it_replaces() {
    let warnings = |optimizer: &str, extra: &str| {
        parse(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {optimizer},
            "scheduler": {{"type": "OneCycle", "params": {{"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3{extra}}}}}}}"#
        ))
        .warnings
        .into_iter()
        .filter(|w| w.key == "scheduler.params.cycle_momentum")
        .map(|w| w.to_string())
        .collect::<Vec<_>>()
    };
    let adam = r#"{"type": "Adam", "params": {"lr": 1e-3}}"#;
    let said = warnings(adam, "");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("0.99") && said[0].contains("betas[1] = 0.999"),
        "{said:?}"
    );
    assert_eq!(warnings(adam, r#", "cycle_momentum": true"#).len(), 1);
    assert!(warnings(adam, r#", "cycle_momentum": false"#).is_empty());
    let adam_099 = r#"{"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}}"#;
    assert!(warnings(adam_099, "").is_empty());
    let sgd = r#"{"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}}"#;
    let said = warnings(sgd, "");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("SGD has no betas"), "{said:?}");
    assert!(warnings(sgd, r#", "cycle_momentum": false"#).is_empty());
}

/// A monitor's `job_name` is a directory under its `output_path`: one that climbs out or is
/// absolute (it would write elsewhere) is refused, naming the key and what is valid; a nested
/// name is kept, and so is DeepSpeed's default.
#[test]
fn a_monitor_job_name_must_stay_under_output_path() {
    for name in ["../../..", "a/../..", "/var/log", "", "..", "./x"] {
        for monitor in ["tensorboard", "csv_monitor"] {
            let text = json!({ "train_batch_size": 8, monitor: { "enabled": true, "job_name": name } }).to_string();
            let e = err(&text);
            assert!(
                e.contains("test.json")
                    && e.contains(&format!("{monitor}.job_name"))
                    && e.contains("under output_path"),
                "{name}: {e}"
            );
        }
    }
    let monitors = resolve(r#"{"train_batch_size": 8, "tensorboard": {"enabled": true}}"#, 1).monitors;
    assert_eq!(monitors.tensorboard.job_name, "DeepSpeedJobName");
    // A nested name stays under output_path, as DeepSpeed's os.path.join makes it.
    let nested = r#"{"train_batch_size": 8, "csv_monitor": {"enabled": true, "job_name": "runs/a"}}"#;
    assert_eq!(resolve(nested, 1).monitors.csv_monitor.job_name, "runs/a");
}
