//! Faults of a `gpt2 train` run, as a user meets them through the binary: what cannot work is
//! refused before the first step (an unwritable `--save`, a count that means nothing), in one
//! sentence naming the flag, never with a panic; a resumed run with nothing left says so; a
//! model whose loss is not finite fails at the first step, naming it, in fp32 and bf16.

use crate::support;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use support::{fixture, fixture_model, fixture_model_with_value};

/// `gpt2 train` on the tiny fixture model and (unless `extra` gives `--data`) token batch,
/// quietly, with `extra` arguments (the fixture config's batch sizes ask for `--nproc 4`).
fn train(extra: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpt2"));
    command.args(["train", "--quiet"]);
    if !extra.contains(&"--data") {
        command.arg("--tokens").arg(fixture("train_tokens.json"));
    }
    command
        .arg("--config")
        .arg(fixture("train_config.json"))
        .arg("--model")
        .arg(fixture_model())
        .args(extra)
        .env("ZERO_COMM_TIMEOUT_SECS", "30")
        .output()
        .expect("run gpt2")
}

/// What the user saw on stderr.
fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts a refusal: exit status 1 (not a panic's 101, not success) and one line on stderr,
/// from the program, holding every one of `want`.
fn assert_refused(out: &Output, want: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{want:?}: {out:?}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].starts_with("gpt2: "), "{err}");
    for w in want {
        assert!(err.contains(w), "{w:?} missing from: {err}");
    }
}

#[test]
fn an_unwritable_save_target_is_refused_before_step_1() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").expect("write");
    let mut targets = vec![file.clone(), file.join("below")];
    // A read-only directory stops writes only where permissions apply (not for root).
    let read_only = dir.path().join("read-only");
    std::fs::create_dir(&read_only).expect("mkdir");
    set_mode(&read_only, 0o555);
    if std::fs::write(read_only.join("try"), "").is_err() {
        targets.push(read_only.clone());
    }
    for target in &targets {
        let metrics = dir.path().join("metrics.jsonl");
        let out = train(&[
            "--nproc",
            "4",
            "--steps",
            "3",
            "--metrics",
            &metrics.to_string_lossy(),
            "--save",
            &target.to_string_lossy(),
        ]);
        assert_refused(&out, &["--save", &target.to_string_lossy()]);
        // Refused before the work: no step ran, so no step was recorded.
        assert!(!metrics.exists(), "{}: steps ran before the refusal", target.display());
    }
    set_mode(&read_only, 0o755);
}

/// One step of `gpt2 train` on the tiny fixture model, 4 rank threads, quietly, with `config`
/// and `tokens`, `extra` arguments and `vars` in its environment.
fn one_step(config: &Path, tokens: &Path, extra: &[&str], vars: &[(&str, &str)]) -> Output {
    train_steps(1, config, tokens, extra, vars)
}

/// [`one_step`], to step `steps`.
fn train_steps(steps: u64, config: &Path, tokens: &Path, extra: &[&str], vars: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpt2"))
        .args([
            "train",
            "--quiet",
            "--nproc",
            "4",
            "--steps",
            &steps.to_string(),
            "--model",
        ])
        .arg(fixture_model())
        .arg("--config")
        .arg(config)
        .arg("--tokens")
        .arg(tokens)
        .args(extra)
        .env("ZERO_COMM_TIMEOUT_SECS", "30")
        .envs(vars.iter().copied())
        .output()
        .expect("run gpt2")
}

/// A `--metrics` path that is one of the run's inputs is refused before anything is written:
/// the input is left as it was.
#[test]
fn metrics_onto_an_input_is_refused_and_the_input_kept() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.json");
    let tokens = dir.path().join("tokens.json");
    std::fs::copy(fixture("train_config.json"), &config).expect("copy the config");
    std::fs::copy(fixture("train_tokens.json"), &tokens).expect("copy the tokens");
    for (flag, input) in [("--config", &config), ("--tokens", &tokens)] {
        let before = std::fs::read(input).expect("read the input");
        // The same file by another name.
        let metrics = dir.path().join(".").join(input.file_name().expect("a name"));
        let out = one_step(&config, &tokens, &["--metrics", &metrics.to_string_lossy()], &[]);
        assert_refused(&out, &["--metrics", flag, "overwrite"]);
        assert_eq!(
            std::fs::read(input).expect("read the input"),
            before,
            "{flag}: the input changed"
        );
    }
}

/// A `--metrics` path whose writing would lose a file is refused, the file kept: model weights
/// or any file that is not a metrics file, and a `.png` path (the loss curve drawn beside it
/// would replace it). A file that is not an image where the curve would go is kept, and said so.
#[test]
fn metrics_that_would_lose_a_file_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let weights = dir.path().join("model.safetensors");
    std::fs::copy(fixture_model().join("model.safetensors"), &weights).expect("copy the weights");
    let before = std::fs::read(&weights).expect("read");
    let config = fixture("train_config.json");
    let tokens = fixture("train_tokens.json");
    let out = one_step(&config, &tokens, &["--metrics", &weights.to_string_lossy()], &[]);
    assert_refused(&out, &["--metrics", "not a metrics file"]);
    assert_eq!(std::fs::read(&weights).expect("read"), before, "the weights changed");

    let png = dir.path().join("m.png");
    let out = one_step(&config, &tokens, &["--metrics", &png.to_string_lossy()], &[]);
    assert_refused(&out, &["--metrics", ".png", ".jsonl"]);
    assert!(!png.exists());

    // A metrics file of before run headers (its first line a step) is a metrics file.
    let old = dir.path().join("old.jsonl");
    std::fs::write(&old, "{\"step\":1,\"loss\":7.5}\n").expect("write");
    let out = one_step(&config, &tokens, &["--metrics", &old.to_string_lossy()], &[]);
    assert!(out.status.success(), "{}", stderr(&out));

    // A run's own metrics file is replaced by a fresh run; a text where its curve goes is kept.
    let metrics = dir.path().join("run.jsonl");
    let beside = dir.path().join("run.png");
    std::fs::write(&beside, "notes, not an image").expect("write");
    for _ in 0..2 {
        let out = one_step(&config, &tokens, &["--metrics", &metrics.to_string_lossy()], &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stderr(&out).contains("the loss curve is not drawn"), "{}", stderr(&out));
    }
    assert_eq!(std::fs::read_to_string(&beside).expect("read"), "notes, not an image");
}

/// A run that does not resume from its --save directory, where another run's checkpoint is, is
/// refused before it trains (it would replace that run's tags and move its `latest`); resuming
/// in place is not.
#[test]
fn saving_over_another_runs_checkpoint_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("ckpt");
    let save_arg = save.to_string_lossy().into_owned();
    let (config, tokens) = (fixture("train_config.json"), fixture("train_tokens.json"));
    let first = train_steps(2, &config, &tokens, &["--save", &save_arg], &[]);
    assert!(first.status.success(), "{}", stderr(&first));
    let latest = std::fs::read_to_string(save.join("latest")).expect("latest");
    let out = one_step(&config, &tokens, &["--save", &save_arg], &[]);
    assert_refused(
        &out,
        &["--save", "another run's checkpoint", &format!("--load {save_arg}")],
    );
    assert_eq!(std::fs::read_to_string(save.join("latest")).expect("latest"), latest);
    // Resumed in place, the directory spelt two other ways: its tag's path through a link,
    // and a path with `.` in it.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&save, &link).expect("symlink");
    let tag = link.join(latest.trim()).to_string_lossy().into_owned();
    let dotted = dir.path().join(".").join("ckpt").to_string_lossy().into_owned();
    let resumed = train_steps(3, &config, &tokens, &["--load", &tag, "--save", &dotted], &[]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).expect("latest"),
        "global_step3"
    );
}

/// A token file whose sequences are not the global batch is refused before the model is built,
/// naming the file and the config.
#[test]
fn a_token_file_of_another_batch_size_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_tokens.json")).expect("tokens")).expect("json");
    let few = dir.path().join("few.json");
    std::fs::write(&few, serde_json::to_string(&tokens[..tokens.len() - 1]).expect("json")).expect("write");
    let out = one_step(&fixture("train_config.json"), &few, &[], &[]);
    let want = format!("{} sequences", tokens.len() - 1);
    assert_refused(&out, &[&few.to_string_lossy(), &want, "train_config.json"]);
}

/// The ranks' layout (tensor and pipeline degrees) is read from the config file: a --set of it,
/// where the file writes "auto", is refused instead of being left unused.
#[test]
fn a_set_of_the_rank_layout_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_config.json")).expect("config")).expect("json");
    config["tensor_parallel"] = serde_json::json!({ "autotp_size": "auto" });
    config["pipeline"] = serde_json::json!({ "stages": "auto" });
    let path = dir.path().join("auto.json");
    std::fs::write(&path, config.to_string()).expect("write");
    for key in ["tensor_parallel.autotp_size", "pipeline.stages"] {
        let out = one_step(
            &path,
            &fixture("train_tokens.json"),
            &["--set", &format!("{key}=2")],
            &[],
        );
        // The parser's warning about "auto" comes first; the refusal is the last line.
        assert_eq!(out.status.code(), Some(1), "{key}: {out:?}");
        let err = stderr(&out);
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("gpt2: --set: ")
                && last.contains("auto.json")
                && last.contains(&format!("`{key}`"))
                && last.contains("ranks' layout"),
            "{err}"
        );
    }
}

/// A launcher environment that cannot be used is refused, naming the variable, where it was
/// taken for no launcher and the ranks ran alone as threads.
#[test]
fn an_unusable_launcher_environment_is_refused() {
    let full = [
        ("RANK", "x"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    for (vars, want) in [(&full[..], "RANK"), (&[("RANK", "0")][..], "WORLD_SIZE")] {
        let out = one_step(&fixture("train_config.json"), &fixture("train_tokens.json"), &[], vars);
        assert_refused(&out, &["launcher's environment", want]);
    }
}

/// An NVMe offload directory that cannot be written (under a file) is refused before step 1,
/// naming the config key; one given for `device: cpu` (as many configs carry) is not touched.
#[test]
fn an_unwritable_nvme_path_is_refused_before_step_1_naming_its_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").expect("write");
    let below = file.join("swap");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_config.json")).expect("config")).expect("json");
    for (name, device) in [("nvme.json", "nvme"), ("cpu.json", "cpu")] {
        config["zero_optimization"]["offload_optimizer"] =
            serde_json::json!({ "device": device, "nvme_path": below.to_string_lossy() });
        let path = dir.path().join(name);
        std::fs::write(&path, config.to_string()).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
            .args(["train", "--quiet", "--nproc", "4", "--steps", "1"])
            .arg("--config")
            .arg(&path)
            .arg("--tokens")
            .arg(fixture("train_tokens.json"))
            .arg("--model")
            .arg(fixture_model())
            .output()
            .expect("run gpt2");
        if device == "nvme" {
            assert_refused(&out, &["zero_optimization.offload_optimizer.nvme_path", "swap"]);
        } else {
            assert!(out.status.success(), "cpu offload ignores nvme_path: {}", stderr(&out));
        }
    }
}

/// A monitor whose log directory cannot be made (its output_path is a file) is refused before
/// step 1, naming the monitor's keys and the directory.
#[test]
fn an_unwritable_monitor_directory_is_refused_before_step_1() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").expect("write");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_config.json")).expect("config")).expect("json");
    for name in ["tensorboard", "csv_monitor"] {
        config[name] = serde_json::json!({ "enabled": true, "output_path": file.to_string_lossy(), "job_name": "run" });
        let path = dir.path().join(format!("{name}.json"));
        std::fs::write(&path, config.to_string()).expect("write");
        let metrics = dir.path().join("metrics.jsonl");
        let out = one_step(
            &path,
            &fixture("train_tokens.json"),
            &["--metrics", &metrics.to_string_lossy()],
            &[],
        );
        assert_refused(
            &out,
            &[
                &format!("{name}.output_path/job_name"),
                &file.join("run").to_string_lossy(),
            ],
        );
        assert!(!metrics.exists(), "{name}: steps ran before the refusal");
        config[name]["enabled"] = serde_json::json!(false);
    }
}

/// A run whose weights diverge (a learning rate no float holds makes them infinite) is not
/// saved over the checkpoint before it: the save fails naming a parameter, the run exits 1,
/// and `latest` still names the earlier, finite checkpoint.
#[test]
fn diverged_weights_are_not_saved() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("ckpt");
    let save_arg = save.to_string_lossy().into_owned();
    let first = one_step(
        &fixture("train_config.json"),
        &fixture("train_tokens.json"),
        &["--save", &save_arg],
        &[],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    let latest = std::fs::read_to_string(save.join("latest")).expect("latest");

    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_config.json")).expect("config")).expect("json");
    config["optimizer"]["params"]["lr"] = serde_json::json!(1e300);
    let path = dir.path().join("huge-lr.json");
    std::fs::write(&path, config.to_string()).expect("write");
    // Resumed in place with a learning rate no float holds: its one step's update is infinite.
    let out = train_steps(
        2,
        &path,
        &fixture("train_tokens.json"),
        &["--load", &save_arg, "--save", &save_arg],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // Said once, for all 4 ranks (every weight is infinite or NaN after the step).
    assert!(
        err.contains("diverged") && err.contains("holds") && err.contains("3 more ranks"),
        "{err}"
    );
    assert_eq!(err.matches("not saved").count(), 1, "{err}");
    assert_eq!(std::fs::read_to_string(save.join("latest")).expect("latest"), latest);
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

#[test]
fn every_count_that_means_nothing_is_one_sentence_naming_its_flag() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A short text: the fixture model's n_positions (32) and the text's length both bound
    // --seq-len.
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "To be, or not to be, that is the question. ".repeat(8)).expect("write");
    let text = text.to_string_lossy().into_owned();
    let save = dir.path().join("ckpt").to_string_lossy().into_owned();
    // Each case gives --steps 1 (but the one about --steps), so that a flag let through costs
    // one step, not the default hundred.
    let cases: [(&[&str], &[&str]); 13] = [
        // The fixture's token file (given by `train`) holds sequences of 16.
        (&["--steps", "1", "--seq-len", "4"], &["--seq-len 4", "16 tokens long"]),
        (
            &["--steps", "1", "--data", &text, "--seq-len", "0"],
            &["--seq-len 0", "2..=32"],
        ),
        (
            &["--steps", "1", "--data", &text, "--seq-len", "1"],
            &["--seq-len 1", "2..=32"],
        ),
        (
            &["--steps", "1", "--data", &text, "--seq-len", "100000"],
            &["--seq-len 100000", "2..=32", "n_positions"],
        ),
        (
            &["--steps", "1", "--data", &text, "--seq-len", "30"],
            &["--seq-len 30", "2..=", "tokens"],
        ),
        (&["--steps", "0"], &["--steps 0", "nothing to train"]),
        (&["--steps", "1", "--nproc", "0"], &["--nproc 0"]),
        (
            &["--steps", "1", "--nproc", "1000000"],
            &["--nproc 1000000", "zero launch"],
        ),
        (
            &["--steps", "1", "--save", &save, "--save-every", "0"],
            &["--save-every 0"],
        ),
        (&["--steps", "1", "--save-every", "2"], &["--save-every 2", "--save"]),
        (
            &["--steps", "1", "--save", &save, "--save-total-limit", "0"],
            &["--save-total-limit 0", "at least 1"],
        ),
        (
            &["--steps", "1", "--save-total-limit", "2"],
            &["--save-total-limit 2 without --save"],
        ),
        (
            &["--steps", "1", "--discard-later-tags"],
            &["--discard-later-tags without --save"],
        ),
    ];
    for (args, want) in cases {
        assert_refused(&train(args), want);
    }
}

/// A model directory whose config.json gives other sizes than its weights is refused before
/// step 1 naming config.json, the field and what the weights say: a smaller n_positions was
/// blamed on --tokens and on --seq-len, a smaller vocab_size on the data.
#[test]
fn a_config_json_its_weights_contradict_is_named_not_the_data() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (field, value, says) in [
        ("n_positions", 8, "n_positions is 8, but the weights say 32"),
        ("vocab_size", 100, "vocab_size is 100, but the weights say 512"),
        ("n_embd", 32, "n_embd is 32, but the weights say 64"),
        ("n_layer", 1, "n_layer is 1, but the weights say 2"),
    ] {
        let model = dir.path().join(field);
        std::fs::create_dir_all(&model).expect("model dir");
        std::fs::copy(
            fixture_model().join("model.safetensors"),
            model.join("model.safetensors"),
        )
        .expect("copy the weights");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture_model().join("config.json")).expect("config"))
                .expect("json");
        config[field] = serde_json::json!(value);
        std::fs::write(model.join("config.json"), config.to_string()).expect("write config");
        for data in [
            vec![
                "--tokens".into(),
                fixture("train_tokens.json").to_string_lossy().into_owned(),
            ],
            vec!["--seq-len".into(), "16".into()],
        ] {
            let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
                .args(["train", "--quiet", "--nproc", "4", "--steps", "1", "--model"])
                .arg(&model)
                .arg("--config")
                .arg(fixture("train_config.json"))
                .args(&data)
                .output()
                .expect("run gpt2");
            let config_json = model.join("config.json").to_string_lossy().into_owned();
            assert_refused(&out, &[&config_json, says, "does not belong to these weights"]);
            let err = stderr(&out);
            assert!(
                !err.contains("--tokens") && !err.contains("--seq-len"),
                "{field}: {err}"
            );
        }
    }
}

#[test]
fn a_resumed_run_already_at_its_steps_says_there_is_nothing_to_train() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt").to_string_lossy().into_owned();
    let out = train(&["--nproc", "4", "--steps", "2", "--save", &ckpt]);
    assert!(out.status.success(), "{out:?}");
    for steps in ["2", "1"] {
        let out = train(&["--nproc", "4", "--steps", steps, "--load", &ckpt]);
        assert!(out.status.success(), "{out:?}");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            said.contains("nothing to train")
                && said.contains("at step 2")
                && said.contains(&format!("--steps is {steps}")),
            "{said}"
        );
    }
    // The checkpoint, or one of its tags, given where a model directory is wanted: the
    // conversion that makes one is named.
    let tag = std::fs::read_to_string(Path::new(&ckpt).join("latest")).expect("latest");
    let tag = tag.trim();
    for (model, want) in [
        (ckpt.clone(), format!("zero to-fp32 {ckpt} OUT")),
        (format!("{ckpt}/{tag}"), format!("zero to-fp32 {ckpt} --tag {tag} OUT")),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
            .args(["score", "--model", &model, "--tokens"])
            .arg(fixture("train_tokens.json"))
            .output()
            .expect("run gpt2");
        assert_refused(&out, &["a ZeRO training checkpoint", &want]);
    }
}

#[test]
fn a_non_finite_loss_fails_the_first_step_naming_it_in_fp32_and_bf16() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_config.json")).expect("config")).expect("json");
    let mut bf16 = config.clone();
    bf16["bf16"] = serde_json::json!({ "enabled": true });
    let bf16_config = dir.path().join("bf16.json");
    std::fs::write(&bf16_config, bf16.to_string()).expect("write");
    // A weight at f32's largest value loads (it is finite) and overflows in the first forward
    // (bf16 rounds it to infinity).
    for (dtype, config) in [("fp32", fixture("train_config.json")), ("bf16", bf16_config)] {
        let model = fixture_model_with_value(&dir.path().join(dtype), "h.0.attn.c_attn.weight", f32::MAX);
        let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
            .args(["train", "--quiet", "--nproc", "4", "--steps", "3"])
            .arg("--config")
            .arg(&config)
            .arg("--tokens")
            .arg(fixture("train_tokens.json"))
            .arg("--model")
            .arg(&model)
            .output()
            .expect("run gpt2");
        assert_eq!(out.status.code(), Some(1), "{dtype}: {out:?}");
        let err = stderr(&out);
        for want in ["step 1", "the loss", "infinite or NaN", "rank 0", dtype] {
            assert!(err.contains(want), "{dtype}: {want:?} missing from: {err}");
        }
    }
}

#[test]
fn a_closed_stdout_does_not_fail_a_finished_run() {
    // The reader goes away before the summary is printed (`gpt2 train | head -0`).
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpt2"))
        .args(["train", "--quiet", "--nproc", "4", "--steps", "1"])
        .arg("--config")
        .arg(fixture("train_config.json"))
        .arg("--tokens")
        .arg(fixture("train_tokens.json"))
        .arg("--model")
        .arg(fixture_model())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpt2");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn score_and_generate_refuse_ids_and_lengths_the_model_cannot_index() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The fixture model has a vocabulary of 512 and n_positions 32.
    let cases = [
        ("vocab.json", vec![vec![600u32; 16]; 2], "vocabulary of 512"),
        ("long.json", vec![vec![1u32; 40]; 2], "n_positions 32"),
    ];
    for (name, tokens, want) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, serde_json::to_string(&tokens).expect("json")).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
            .arg("score")
            .arg("--model")
            .arg(fixture_model())
            .arg("--tokens")
            .arg(&path)
            .output()
            .expect("run gpt2");
        assert_refused(&out, &[want]);
    }
    // A model whose weights hold an infinity (a damaged file: the format has no checksums) is
    // refused as it loads, naming the tensor; one whose finite weights overflow gives no score,
    // rather than "loss inf" and success.
    let score = |model: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_gpt2"))
            .arg("score")
            .arg("--model")
            .arg(model)
            .arg("--tokens")
            .arg(fixture("train_tokens.json"))
            .output()
            .expect("run gpt2")
    };
    let damaged = fixture_model_with_value(&dir.path().join("inf"), "ln_f.bias", f32::INFINITY);
    assert_refused(&score(&damaged), &["ln_f.bias", "holds inf"]);
    let overflowing = fixture_model_with_value(&dir.path().join("max"), "ln_f.bias", f32::MAX);
    assert_refused(&score(&overflowing), &["the loss is", "non-finite"]);
    // GPT-2's tokenizer gives "hello" an id far past 512.
    let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
        .args(["generate", "--prompt", "hello"])
        .arg("--model")
        .arg(fixture_model())
        .output()
        .expect("run gpt2");
    assert_refused(&out, &["vocabulary of 512"]);
}

/// Tokens whose bytes are not UTF-8 (a character split, or never completed; the tiny fixture
/// model makes them from "ab") are generated and shown as U+FFFD, as transformers' decode
/// shows them, not an error halfway through the output.
#[test]
fn generated_bytes_that_are_not_utf8_show_as_replacement_characters() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
        .args(["generate", "--prompt", "ab", "--max-new-tokens", "40", "--model"])
        .arg(fixture_model())
        .output()
        .expect("run gpt2");
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).expect("the output is UTF-8");
    assert!(text.starts_with("ab") && text.contains('\u{fffd}'), "{text:?}");
    assert!(text.chars().count() > 2 + 20, "{text:?}");
}

/// One step of `gpt2 train --preset PRESET` on one rank thread, sequences of 16, under the
/// config `text` (written to a file of its own).
fn train_preset(preset: &str, text: &str) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, text).unwrap();
    Command::new(env!("CARGO_BIN_EXE_gpt2"))
        .args(["train", "--quiet", "--preset", preset, "--nproc", "1", "--steps", "1"])
        .args(["--seq-len", "16", "--config"])
        .arg(&config)
        .output()
        .expect("run gpt2")
}

/// A micro-batch whose activations cannot fit this machine's memory is refused before any rank
/// starts, naming the key and what to do, instead of being killed by the kernel in step 1.
/// (The machine's memory is read from /proc/meminfo.)
#[cfg(target_os = "linux")]
#[test]
fn a_micro_batch_beyond_the_machines_memory_is_refused_before_step_1() {
    let out = train_preset(
        "tiny",
        r#"{"train_micro_batch_size_per_gpu": 1000000000, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 3}}"#,
    );
    assert_refused(
        &out,
        &[
            "train_micro_batch_size_per_gpu 1000000000",
            "more than this machine's",
            "gradient_accumulation_steps",
        ],
    );
}

/// A model whose states cannot fit this machine's memory is refused before any rank starts,
/// with `zero estimate`'s bytes (each rank's and the process's), instead of aborting in an
/// allocation (exit 134). Reference: the estimate, 20 bytes per parameter at stage 0 in fp32
/// (4 for the parameters, 4 for their gradients, 12 for the optimizer's fp32 masters and Adam's
/// two moments), for GPT-2 `1x1000000`, about 12 trillion parameters.
#[cfg(target_os = "linux")]
#[test]
fn a_model_beyond_the_machines_memory_is_refused_before_step_1() {
    let out = train_preset(
        "gpt2-1x1000000",
        r#"{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}"#,
    );
    assert_refused(
        &out,
        &[
            "ZeRO stage 0 over 1 data-parallel rank",
            "more than this machine's",
            "zero estimate",
        ],
    );
    let err = stderr(&out);
    let each: f64 = err
        .split(" GB each")
        .next()
        .and_then(|s| s.rsplit('(').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no per-rank bytes in {err}"));
    let params = 50257.0 * 1e6 + 1024.0 * 1e6 + 12.0 * 1e12 + 13.0 * 1e6;
    assert!((each / (20.0 * params / 1e9) - 1.0).abs() < 0.01, "{each} GB: {err}");
}

/// A resumed run whose schedule is not the saved run's length (`total_num_steps: "auto"` is
/// --steps, which a resume raises) is told that its learning rate follows the new length; with
/// the length written in the config, the resume is the same schedule and says nothing.
#[test]
fn a_resume_with_another_schedule_length_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let run = |total: &str, steps: &str, extra: &[&str]| {
        let config = dir.path().join(format!("config-{total}.json"));
        std::fs::write(
            &config,
            format!(
                r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
                "scheduler": {{"type": "WarmupDecayLR", "params": {{"warmup_max_lr": 0.001, "warmup_num_steps": 2,
                    "total_num_steps": {total}}}}}}}"#
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_gpt2"))
            .args([
                "train",
                "--quiet",
                "--preset",
                "tiny",
                "--nproc",
                "2",
                "--seq-len",
                "16",
                "--steps",
                steps,
            ])
            .arg("--config")
            .arg(&config)
            .args(extra)
            .output()
            .expect("run gpt2");
        assert!(out.status.success(), "{}", stderr(&out));
        stderr(&out)
    };
    for total in ["\"auto\"", "6"] {
        let ckpt = dir.path().join(format!("ckpt-{}", total.trim_matches('"')));
        let ckpt = ckpt.to_str().unwrap();
        run(total, "2", &["--save", ckpt]);
        let said = run(total, "3", &["--load", ckpt]);
        let warned = said.contains("the saved run's schedule was 2 steps long") && said.contains("is 3");
        assert_eq!(warned, total == "\"auto\"", "total_num_steps {total}: {said}");
    }
}
