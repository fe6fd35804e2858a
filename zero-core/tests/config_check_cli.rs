//! `zero check-config` as a user runs it: exit status, stdout JSON, stderr warnings.
//! Reference: the rules of DeepSpeed's batch triad and defaults, checked on the printed JSON.

use serde_json::json;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn check(json: &str, args: &[&str]) -> (i32, serde_json::Value, String) {
    let dir = std::env::temp_dir().join(format!(
        "zero-check-config-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ds_config.json");
    std::fs::write(&file, json).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zero"))
        .arg("check-config")
        .arg(&file)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let value = serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code().unwrap_or(-1),
        value,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn prints_resolved_config_with_defaults() {
    let (code, v, _) = check(
        r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}"#,
        &["--world-size", "4"],
    );
    assert_eq!(code, 0);
    assert_eq!(v["gradient_accumulation_steps"], 2);
    assert_eq!(v["zero_optimization"]["overlap_comm"], true);
    assert_eq!(v["zero_optimization"]["stage3_prefetch_bucket_size"], 50_000_000);
}

#[test]
fn batch_needing_world_size_says_so() {
    let (code, v, _) = check(r#"{"train_micro_batch_size_per_gpu": 4}"#, &[]);
    assert_eq!(code, 0);
    let marker = v["train_batch_size"].as_str().unwrap();
    assert!(marker.contains("--world-size"), "{marker}");
    let (_, v, _) = check(r#"{"train_micro_batch_size_per_gpu": 4}"#, &["--world-size", "3"]);
    assert_eq!(v["train_batch_size"], 12);
}

#[test]
fn model_dependent_auto_is_marked_or_resolved() {
    let cfg = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}"#;
    let (code, v, _) = check(cfg, &["--world-size", "1"]);
    assert_eq!(code, 0);
    assert!(v["zero_optimization"]["reduce_bucket_size"]
        .as_str()
        .unwrap()
        .contains("resolved at initialize"));
    let (_, v, _) = check(cfg, &["--world-size", "1", "--hidden-size", "64"]);
    assert_eq!(v["zero_optimization"]["reduce_bucket_size"], 4096);
}

#[test]
fn errors_exit_2_and_warnings_go_to_stderr() {
    let (code, v, err) = check("{\"train_batch_size\": CONFIG_BATCH_SIZE}", &[]);
    assert_eq!(code, 2);
    assert!(v.is_null());
    assert!(err.contains("CONFIG_BATCH_SIZE") && err.contains(":1:"), "{err}");
    let (code, _, err) = check(
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}"#,
        &["--world-size", "4"],
    );
    assert_eq!(code, 2);
    assert!(err.contains("world size (4)"), "{err}");
    let (code, _, err) = check(
        r#"{"train_batch_size": 8, "steps_per_prnt": 5}"#,
        &["--world-size", "1"],
    );
    assert_eq!(code, 0);
    assert!(
        err.contains("warning") && err.contains("did you mean `steps_per_print`?"),
        "{err}"
    );
    // A hidden size or world of 0 would resolve "auto" buckets to 0: refused.
    for flag in ["--hidden-size", "--world-size"] {
        let (code, _, err) = check(r#"{"train_batch_size": 8}"#, &[flag, "0"]);
        assert_eq!(code, 2, "{flag}: {err}");
        assert!(err.contains(&format!("{flag} 0")), "{err}");
    }
}

/// Runs `zero check-config FILE ARGS` with stdout on `stdout` (stderr captured).
fn check_to(file: &std::path::Path, args: &[&str], stdout: std::process::Stdio) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zero"))
        .arg("check-config")
        .arg(file)
        .args(args)
        .stdout(stdout)
        .output()
        .unwrap()
}

/// A stdout whose reader is already gone, as under `| head -1` once head has its line.
fn closed_pipe() -> std::process::Stdio {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills both descriptors on success, and each is owned exactly once below.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    std::process::Stdio::from(write)
}

fn write_config(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "zero-check-config-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(name);
    std::fs::write(&file, text).unwrap();
    file
}

#[test]
fn a_closed_or_full_stdout_ends_the_tool_without_a_panic() {
    let file = write_config(
        "ds_config.json",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}"#,
    );
    let out = check_to(&file, &["--world-size", "1"], closed_pipe());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "a closed pipe ends quietly: {err}");
    assert!(err.trim().is_empty(), "{err}");
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = check_to(&file, &["--world-size", "1"], full.into());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("cannot write the output"), "{err}");
}

#[test]
fn a_file_larger_than_any_config_is_refused_without_reading_it_whole() {
    // Without the cap the tool reads until memory runs out: stop it long before that.
    let mut child = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["check-config", "/dev/zero"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > std::time::Duration::from_secs(10) {
            child.kill().ok();
            child.wait().ok();
            panic!("check-config /dev/zero still reading after 10 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("/dev/zero") && err.contains("8 MiB"), "{err}");
    // A regular file one byte past the limit, all whitespace (valid JSON padding), too.
    let big = write_config("big.json", &" ".repeat((8 << 20) + 1));
    let (code, _, err) = check_path(&big, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("big.json") && err.contains("8388608 bytes"), "{err}");
}

fn check_path(file: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = check_to(file, args, std::process::Stdio::piped());
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn optimizer_values_the_trainer_refuses_are_refused_naming_file_key_and_range() {
    for (params, key, range) in [
        (r#"{"lr": -1}"#, "optimizer.params.lr", ">= 0"),
        (r#"{"eps": -1e-8}"#, "optimizer.params.eps", ">= 0"),
        (r#"{"betas": [1.5, 0.95]}"#, "optimizer.params.betas", "[0, 1)"),
        (r#"{"betas": [0.9, 1.0]}"#, "optimizer.params.betas", "[0, 1)"),
        (r#"{"weight_decay": -0.5}"#, "optimizer.params.weight_decay", ">= 0"),
    ] {
        for kind in ["AdamW", "Lamb"] {
            let cfg = format!(r#"{{"train_batch_size": 8, "optimizer": {{"type": "{kind}", "params": {params}}}}}"#);
            let (code, v, err) = check(&cfg, &["--world-size", "1"]);
            assert_eq!(code, 2, "{kind} {params}: {v}");
            assert!(
                err.contains("ds_config.json") && err.contains(&format!("`{key}`")) && err.contains(range),
                "{kind} {params}: {err}"
            );
        }
    }
}

/// Every learning rate a schedule takes is held to the optimizer's rule and refused in its
/// words: the file, the key, the value and the range, exit 2 (a negative one used to train,
/// the loss climbing, and exit 0). A value `--set` supplies for an "auto" one too.
#[test]
fn scheduler_learning_rates_are_refused_as_the_optimizers_is() {
    let (_, _, optimizer) = check(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": -0.01}}}"#,
        &["--world-size", "1"],
    );
    let said = |key: &str, name: &str| format!("`{key}` = -0.01 is not valid; {name} must be finite and >= 0");
    assert!(optimizer.contains(&said("optimizer.params.lr", "lr")), "{optimizer}");
    let schedules = [
        (
            "WarmupLR",
            json!({"warmup_num_steps": 10}),
            &["warmup_min_lr", "warmup_max_lr"][..],
        ),
        (
            "WarmupDecayLR",
            json!({"total_num_steps": 100}),
            &["warmup_min_lr", "warmup_max_lr"],
        ),
        (
            "WarmupCosineLR",
            json!({"total_num_steps": 100}),
            &["warmup_min_ratio", "cos_min_ratio"],
        ),
        (
            "OneCycle",
            json!({"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}),
            &["cycle_min_lr", "cycle_max_lr", "decay_lr_rate"],
        ),
        (
            "LRRangeTest",
            json!({"lr_range_test_step_size": 10}),
            &["lr_range_test_min_lr", "lr_range_test_step_rate"],
        ),
    ];
    for (kind, required, rates) in schedules {
        let with = |name: Option<(&str, f64)>| {
            let mut params = required.clone();
            if let Some((name, value)) = name {
                params[name] = json!(value);
            }
            json!({
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "scheduler": {"type": kind, "params": params}
            })
            .to_string()
        };
        let (code, _, err) = check(&with(None), &["--world-size", "1"]);
        assert_eq!(code, 0, "{kind} as written is valid: {err}");
        for name in rates {
            let (code, v, err) = check(&with(Some((name, -0.01))), &["--world-size", "1"]);
            assert_eq!(code, 2, "{kind} {name} -0.01: {v}");
            assert!(
                err.starts_with("error: ")
                    && err.contains("ds_config.json")
                    && err.contains(&said(&format!("scheduler.params.{name}"), name)),
                "{kind} {name}: {err}"
            );
            let (code, _, err) = check(&with(Some((name, 0.0))), &["--world-size", "1"]);
            assert_eq!(code, 0, "{kind} {name} 0 is a rate: {err}");
        }
    }
    // Supplied for an "auto": checked as if written.
    let auto = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}"#;
    let (code, _, err) = check(
        auto,
        &["--world-size", "1", "--set", "scheduler.params.warmup_max_lr=-0.01"],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&said("scheduler.params.warmup_max_lr", "warmup_max_lr")),
        "{err}"
    );
}

/// Offload settings the engine takes other than they read are said, each with what happens
/// instead (they used to pass silently): `offload_optimizer` at stage 0, where nothing is
/// partitioned and every rank offloads the whole state, and an NVMe swap of 0 buffers, which
/// streams through one.
#[test]
fn offload_settings_taken_otherwise_warn_what_happens_instead() {
    let warning = |err: &str, key: &str| -> Option<String> {
        err.lines()
            .find(|l| l.starts_with("warning:") && l.contains(&format!("`{key}`:")))
            .map(str::to_string)
    };
    let swap = std::env::temp_dir().join(format!("zero-check-config-swap-{}", std::process::id()));
    let cases = [
        (0, r#"{"device": "cpu"}"#.to_string(), "in host memory"),
        (
            0,
            format!(r#"{{"device": "nvme", "nvme_path": "{}"}}"#, swap.display()),
            "swap file",
        ),
    ];
    for (stage, section, place) in &cases {
        let cfg = format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": {stage}, "offload_optimizer": {section}}}}}"#
        );
        let (code, v, err) = check(&cfg, &["--world-size", "2"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            v["zero_optimization"]["offload_optimizer"].is_object(),
            "still honoured: {v}"
        );
        let said = warning(&err, "zero_optimization.offload_optimizer")
            .unwrap_or_else(|| panic!("no warning for offload at stage 0: {err}"));
        assert!(
            said.contains("ds_config.json")
                && said.contains("stage 0")
                && said.contains("every rank keeps all of it")
                && said.contains(place)
                && said.contains("stage 1"),
            "{said}"
        );
        // From stage 1 on the state is partitioned: nothing to say.
        let (_, _, err) = check(&cfg.replace("\"stage\": 0", "\"stage\": 1"), &["--world-size", "2"]);
        assert!(warning(&err, "zero_optimization.offload_optimizer").is_none(), "{err}");
    }
    let nvme = |count: u32| {
        format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": 2, "offload_optimizer":
                {{"device": "nvme", "nvme_path": "{}", "buffer_count": {count}}}}}}}"#,
            swap.display()
        )
    };
    let (code, v, err) = check(&nvme(0), &["--world-size", "1"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["zero_optimization"]["offload_optimizer"]["buffer_count"], 0);
    let said = warning(&err, "zero_optimization.offload_optimizer.buffer_count")
        .unwrap_or_else(|| panic!("no warning for 0 buffers: {err}"));
    assert!(
        said.contains("0 buffers") && said.contains("1 buffer instead"),
        "{said}"
    );
    for count in [1, 4] {
        let (_, _, err) = check(&nvme(count), &["--world-size", "1"]);
        assert!(
            warning(&err, "zero_optimization.offload_optimizer.buffer_count").is_none(),
            "{count}: {err}"
        );
    }
    // Host offload reads no swap file: its buffer count means nothing either way.
    let cpu = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}}"#;
    let (_, _, err) = check(cpu, &["--world-size", "1"]);
    assert!(
        warning(&err, "zero_optimization.offload_optimizer.buffer_count").is_none(),
        "{err}"
    );
}

#[test]
fn a_null_stage_warns_which_default_it_took() {
    let (code, v, err) = check(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": null}}"#,
        &["--world-size", "1"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["zero_optimization"]["stage"], 0);
    let warning = err
        .lines()
        .find(|l| l.contains("zero_optimization.stage"))
        .unwrap_or_else(|| panic!("no warning for the null stage: {err}"));
    assert!(
        warning.starts_with("warning:") && warning.contains("null") && warning.contains("default (0)"),
        "{warning}"
    );
}

#[test]
fn json_errors_are_not_reported_as_placeholders() {
    // A string where a number goes: a type error naming the key.
    let (code, _, err) = check(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "INF"}}}"#,
        &[],
    );
    assert_eq!(code, 2);
    assert!(!err.contains("placeholder"), "{err}");
    assert!(
        err.contains("`optimizer.params.lr`") && err.contains("a number"),
        "{err}"
    );
    // Text after the JSON: the JSON error, with its line and column.
    let (code, _, err) = check("{\"train_batch_size\": 8}\n\ngarbage here\n", &[]);
    assert_eq!(code, 2);
    assert!(!err.contains("placeholder"), "{err}");
    assert!(
        err.contains("ds_config.json:3:1") && err.contains("trailing characters"),
        "{err}"
    );
    // A file that is not JSON at all: one JSON error, not a placeholder per word.
    let text = "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models\n".repeat(50);
    let (code, _, err) = check(&text, &[]);
    assert_eq!(code, 2);
    assert!(!err.contains("placeholder"), "{err}");
    assert!(err.contains("ds_config.json:1:1: not valid JSON"), "{err}");
    // A bare word in capitals where a value goes is still a template placeholder.
    let (_, _, err) = check("{\"train_batch_size\": GB_SIZE}", &[]);
    assert!(err.contains("placeholder `GB_SIZE`"), "{err}");
}

#[test]
fn an_nvme_path_naming_a_file_is_refused_naming_the_key() {
    let regular = write_config("not_a_dir", "");
    for section in ["offload_optimizer", "offload_param"] {
        let cfg = format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": 3,
                "{section}": {{"device": "nvme", "nvme_path": "{}"}}}}}}"#,
            regular.display()
        );
        let (code, _, err) = check(&cfg, &["--world-size", "1"]);
        assert_eq!(code, 2, "{section}: {err}");
        assert!(
            err.contains(&format!("`zero_optimization.{section}.nvme_path`")) && err.contains("directory"),
            "{err}"
        );
        // A directory, or a path the run will create, is fine.
        let absent = regular.with_file_name("swap").join("later");
        for ok in [regular.parent().unwrap(), absent.as_path()] {
            let cfg = cfg.replace(&regular.display().to_string(), &ok.display().to_string());
            let (code, _, err) = check(&cfg, &["--world-size", "1"]);
            assert_eq!(code, 0, "{}: {err}", ok.display());
        }
    }
}

#[test]
fn set_fills_only_values_written_auto() {
    let cfg = r#"{"train_batch_size": 8, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": 1e-8}}}"#;
    let (code, v, err) = check(cfg, &["--world-size", "1", "--set", "optimizer.params.lr=3e-4"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["optimizer"]["params"]["lr"], 3e-4);
    // A key written with a value: the --set would change nothing.
    let (code, _, err) = check(cfg, &["--world-size", "1", "--set", "optimizer.params.eps=1e-6"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--set") && err.contains("`optimizer.params.eps`") && err.contains("writes it as 1e-8"),
        "{err}"
    );
    // A key the file does not write (here misspelt).
    let (code, _, err) = check(cfg, &["--world-size", "1", "--set", "gradient_cliping=0.5"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("`gradient_cliping`") && err.contains("does not write it"),
        "{err}"
    );
    // The ranks' layout is read from the file before any --set, "auto" or not: refused, said
    // so, without telling the user to write "auto" where the file already does.
    let layout =
        r#"{"train_batch_size": 8, "pipeline": {"stages": "auto"}, "tensor_parallel": {"autotp_size": "auto"}}"#;
    for key in ["pipeline.stages", "tensor_parallel.autotp_size"] {
        let (code, _, err) = check(layout, &["--world-size", "2", "--set", &format!("{key}=2")]);
        assert_eq!(code, 2, "{key}");
        assert!(
            err.contains(&format!("`{key}`")) && err.contains("ranks' layout") && !err.contains("only fills"),
            "{err}"
        );
    }
    // A value --set supplies is checked like one written in the file.
    let (code, _, err) = check(cfg, &["--world-size", "1", "--set", "optimizer.params.lr=-1"]);
    assert_eq!(code, 2);
    assert!(err.contains("`optimizer.params.lr`") && err.contains(">= 0"), "{err}");
}

/// What DeepSpeed would run but initialize refuses is said by check-config, every setting with
/// its key, exit 2; a config with no optimizer is valid (the program gives one), with a note.
/// Reference: the refusals of zero_burn::engine_settings (the same `ResolvedConfig::unsupported`).
#[test]
fn settings_initialize_refuses_are_said_every_one() {
    let cfg = r#"{"train_batch_size": 8,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}},
        "scheduler": {"type": "StepLR", "params": {"step_size": 10}},
        "bf16": {"enabled": true, "immediate_grad_update": true},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}"#;
    let (code, v, err) = check(cfg, &["--world-size", "2"]);
    assert_eq!(code, 2, "{v}");
    assert_eq!(v, serde_json::Value::Null, "no config printed: {v}");
    for key in [
        "`optimizer.type`: \"OneBitAdam\"",
        "`scheduler.type`: \"StepLR\"",
        "`bf16.immediate_grad_update`",
        "`zero_optimization.offload_optimizer.ratio`: 0.3",
    ] {
        assert!(err.contains(key), "{key} not said: {err}");
    }
    assert!(
        err.contains("ds_config.json") && err.contains("initialize refuses"),
        "{err}"
    );
    // Summed gradients: valid for DeepSpeed below stage 3, refused by the engine at any stage.
    let sum = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 1}}"#;
    let (code, _, err) = check(sum, &["--world-size", "2"]);
    assert_eq!(code, 2);
    assert!(err.contains("`gradient_allreduce_op`"), "{err}");
    // A schedule whose params cannot build is named by its param.
    let bad_schedule = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}"#;
    let (code, _, err) = check(bad_schedule, &["--world-size", "1"]);
    assert_eq!(code, 2);
    assert!(err.contains("`scheduler.params.warmup_num_steps`"), "{err}");
    // ... unless the value is left "auto" for the training script to give.
    let auto_schedule = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 10}}}"#;
    let (code, v, err) = check(auto_schedule, &["--world-size", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(v.is_object(), "{v}");
    // No optimizer: printed, with a note that the program gives it.
    let (code, v, err) = check(r#"{"train_batch_size": 8}"#, &["--world-size", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(v.is_object(), "{v}");
    assert!(err.contains("names no optimizer"), "{err}");
}

/// SGD's Nesterov rule names the setting that breaks it (momentum 0, or a dampening), with its
/// value as written.
#[test]
fn nesterov_names_the_setting_that_breaks_it() {
    for (params, key, shown) in [
        (
            r#"{"lr": 0.01, "momentum": 0.9, "nesterov": true, "dampening": 0.1}"#,
            "optimizer.params.dampening",
            "0.1",
        ),
        (r#"{"lr": 0.01, "nesterov": true}"#, "optimizer.params.momentum", "0"),
    ] {
        let cfg = format!(r#"{{"train_batch_size": 8, "optimizer": {{"type": "SGD", "params": {params}}}}}"#);
        let (code, _, err) = check(&cfg, &["--world-size", "1"]);
        assert_eq!(code, 2, "{params}");
        assert!(
            err.contains(&format!("`{key}` = {shown}")) && err.contains("nesterov"),
            "{params}: {err}"
        );
    }
}

/// `--world-size` counts every rank; the batch sizes are over the data-parallel ones, the world
/// divided by pipeline.stages × tensor_parallel.autotp_size, as `gpt2 train` lays them out.
/// Reference: DeepSpeed's batch rule, train_batch_size = micro × accumulation × data-parallel ranks.
#[test]
fn world_size_is_cut_by_pipeline_and_tensor_parallel_degrees() {
    let cfg = r#"{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "tensor_parallel": {"autotp_size": 2}}"#;
    // 4 ranks: 2 data-parallel, 4 = 2 × 1 × 2.
    let (code, v, err) = check(cfg, &["--world-size", "4"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["train_batch_size"], 4, "{v}");
    assert!(err.contains("2 data-parallel"), "{err}");
    // 2 ranks: 1 data-parallel, and 4 ≠ 2 × 1 × 1.
    let (code, _, err) = check(cfg, &["--world-size", "2"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("train_batch_size"), "{err}");
    // 3 ranks cannot be cut in tensor-parallel pairs.
    let (code, _, err) = check(cfg, &["--world-size", "3"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("tensor_parallel.autotp_size 2") && err.contains("multiple of 2"),
        "{err}"
    );
    let pipeline = cfg.replace(
        r#""tensor_parallel": {"autotp_size": 2}"#,
        r#""pipeline": {"stages": 2}"#,
    );
    let (code, _, err) = check(&pipeline, &["--world-size", "4"]);
    assert_eq!(code, 0, "{err}");
}

/// What `gpt2 train` would refuse after building the model, check-config refuses first: the loss
/// scaler's own range checks (a static scale an f32 cannot hold made every gradient NaN), and
/// `autotp_size: "auto"` reads as DeepSpeed's default in the layout as in the parser.
#[test]
fn settings_training_refuses_are_refused_here_and_auto_tensor_parallelism_is_none() {
    for (fp16, key) in [
        (r#"{"enabled": true, "hysteresis": 0}"#, "fp16.hysteresis"),
        (r#"{"enabled": true, "loss_scale_window": 0}"#, "fp16.loss_scale_window"),
        (r#"{"enabled": true, "loss_scale": 1e-320}"#, "fp16.loss_scale"),
        (r#"{"enabled": true, "loss_scale": 1e39}"#, "fp16.loss_scale"),
        (r#"{"enabled": true, "min_loss_scale": 1e-45}"#, "fp16.min_loss_scale"),
    ] {
        let cfg = format!(r#"{{"train_batch_size": 2, "fp16": {fp16}}}"#);
        let (code, _, err) = check(&cfg, &["--world-size", "2"]);
        assert_eq!(code, 2, "{fp16}: {err}");
        assert!(err.contains(key), "{fp16}: {key} missing from {err}");
    }
    let fine = r#"{"train_batch_size": 2, "fp16": {"enabled": true, "loss_scale": 1e-30}}"#;
    let (code, _, err) = check(fine, &["--world-size", "2"]);
    assert_eq!(code, 0, "{err}");
    let auto =
        r#"{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": "auto"}}"#;
    let (code, v, err) = check(auto, &["--world-size", "2"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["gradient_accumulation_steps"], 1, "2 data-parallel ranks: {v}");
    let config = zero_core::config::DeepSpeedConfig::from_str(auto, "ds_config.json")
        .expect("parses")
        .config;
    assert_eq!(config.model_parallel_degrees(), Ok((1, 1)));
}
