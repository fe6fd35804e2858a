//! `zero estimate` from the command line: the numbers it prints are the ZeRO paper's formulas.

use std::process::Command;

fn estimate(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zero"))
        .arg("estimate")
        .args(args)
        .output()
        .expect("run zero");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The byte count printed on the line that starts with `label`.
fn bytes_on(stdout: &str, label: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` in:\n{stdout}"));
    let inner = line.rsplit('(').next().unwrap_or_default();
    inner
        .trim_end_matches(" bytes)")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no byte count in `{line}`"))
}

#[test]
fn gpt2_stage_2_on_8_devices_is_2psi_plus_14psi_over_n() {
    // Reference: Ψ = 124,439,808 (transformers' count for GPT-2 small); 2Ψ + 14Ψ/8 computed here.
    let psi: u64 = 124_439_808;
    let (ok, out, err) = estimate(&["--preset", "gpt2", "--stage", "2", "--gpus-per-node", "8"]);
    assert!(ok, "{err}");
    assert_eq!(bytes_on(&out, "per device"), 2 * psi + (14 * psi).div_ceil(8));
    assert!(out.contains("124439808 parameters"), "{out}");
    assert!(
        out.contains("params 2Ψ + grads 2Ψ/N + optimizer 12Ψ/N"),
        "the formula is printed: {out}"
    );
}

#[test]
fn offload_moves_bytes_to_the_host_and_nvme() {
    let psi: u64 = 1_000_000_000;
    // Stage 3, 2 nodes × 4 devices, optimizer to NVMe, parameters to the host.
    let (ok, out, err) = estimate(&[
        "--params",
        "1e9",
        "--stage",
        "3",
        "--gpus-per-node",
        "4",
        "--nodes",
        "2",
        "--offload-optimizer",
        "nvme",
        "--offload-param",
        "cpu",
        "--dtype",
        "fp16",
    ]);
    assert!(ok, "{err}");
    // The device keeps the fp16 gradient shard from backward until the step.
    assert_eq!(bytes_on(&out, "per device"), 2 * psi / 8, "{out}");
    // One host serves 4 devices: their fp16 parameter shards and fp32 gradient shards, and the
    // host buffers the NVMe state streams through: 4 buffers (the default buffer_count) of a
    // 4 Mi-element chunk of masters, momentum and variance, plus the step's scratch momentum
    // and variance for one chunk.
    let streaming = (4 * 3 + 2) * 4 * (1 << 22);
    assert_eq!(
        bytes_on(&out, "per host"),
        4 * (2 * psi / 8 + 4 * psi / 8 + streaming),
        "{out}"
    );
    assert_eq!(bytes_on(&out, "per node on NVMe"), 4 * (12 * psi / 8), "{out}");
    // fp32 without offload at stage 0: 4 + 4 + 12 (the optimizer's fp32 masters are a copy).
    let (ok, out, _) = estimate(&["--params", "1000", "--stage", "0", "--dtype", "fp32"]);
    assert!(ok);
    assert_eq!(bytes_on(&out, "per device"), 20_000);
}

#[test]
fn bad_arguments_are_refused_with_a_reason() {
    for (args, needle) in [
        (vec!["--preset", "gpt5", "--stage", "1"], "unknown"),
        (vec!["--params", "1e9", "--stage", "4"], "--stage 4"),
        (
            vec!["--params", "1e9", "--stage", "2", "--offload-param", "cpu"],
            "stage 3 only",
        ),
        (vec!["--params", "lots", "--stage", "1"], "--params lots"),
        (
            vec!["--params", "1e9", "--stage", "1", "--dtype", "int8"],
            "--dtype int8",
        ),
        // Flags that only mean something with another, given without it: refused, not ignored.
        (
            vec!["--params", "1e9", "--stage", "3", "--fit-device-memory", "1GiB"],
            "--fit-host-memory",
        ),
        (vec!["--params", "1e9", "--stage", "3", "--hidden", "64"], "--hidden 64"),
        (
            vec!["--params", "1e9", "--stage", "3", "--prefetch-bucket-size", "5"],
            "--prefetch-bucket-size",
        ),
        (vec!["--params", "1.5", "--stage", "1"], "whole count"),
    ] {
        let (ok, _, err) = estimate(&args);
        assert!(!ok, "{args:?} must fail");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn fit_host_memory_names_the_deepest_gpt2_and_its_estimate_fits() {
    // Reference: the printed model's own estimate (stage 3, optimizer and parameters offloaded,
    // so per host = 18Ψ bf16) fits 64 GiB, and the model one block deeper does not.
    let args = ["--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"];
    let limit: u64 = 64 << 30;
    let (ok, out, err) = estimate(&[&args[..], &["--fit-host-memory", "64GiB", "--hidden", "2048"]].concat());
    assert!(ok, "{err}");
    let name = out
        .split_whitespace()
        .find(|w| w.starts_with("gpt2-") && w.ends_with(':'))
        .unwrap_or_else(|| panic!("no model named in:\n{out}"))
        .trim_end_matches(':')
        .to_string();
    assert!(bytes_on(&out, "per host") <= limit, "{out}");
    let layers: u64 = name["gpt2-".len()..].split('x').next().unwrap().parse().unwrap();
    let deeper = format!("gpt2-{}x2048", layers + 1);
    let (ok, out_deeper, err) = estimate(&[&args[..], &["--preset", &deeper]].concat());
    assert!(ok, "{err}");
    assert!(
        bytes_on(&out_deeper, "per host") > limit,
        "{deeper} fits too:\n{out_deeper}"
    );
    // A unit the parser does not know is refused, naming the flag.
    let (ok, _, err) = estimate(&[&args[..], &["--fit-host-memory", "64 parsecs"]].concat());
    assert!(!ok && err.contains("--fit-host-memory"), "{err}");
}

#[test]
fn counts_past_2_pow_64_are_errors_naming_the_input_not_wrapped_numbers() {
    // 16 bytes × 2^60 parameters is 2^64: it printed `per device: 0 B`.
    for (args, flag) in [
        (
            vec!["--params", "1152921504606846976", "--stage", "0"],
            "--params 1152921504606846976",
        ),
        (
            vec!["--params", "18446744073709551615", "--stage", "3"],
            "--params 18446744073709551615",
        ),
        (
            vec![
                "--params",
                "1e9",
                "--stage",
                "3",
                "--gpus-per-node",
                "9223372036854775808",
                "--nodes",
                "2",
            ],
            "--nodes 2",
        ),
        (
            vec![
                "--params",
                "1e9",
                "--stage",
                "1",
                "--offload-optimizer",
                "cpu",
                "--gpus-per-node",
                "9223372036854775808",
            ],
            "--gpus-per-node 9223372036854775808",
        ),
    ] {
        let (ok, out, err) = estimate(&args);
        assert!(!ok, "{args:?} printed:\n{out}");
        assert!(err.contains(flag) && err.contains("64-bit"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // A shaped preset whose parameter count passes 2^64 is not a GPT-2.
    let (ok, _, err) = estimate(&["--preset", "gpt2-1x18446744073709551552", "--stage", "3"]);
    assert!(!ok && err.contains("--preset gpt2-1x18446744073709551552"), "{err}");
    let (ok, _, err) = estimate(&["--stage", "3", "--fit-host-memory", "1e30"]);
    assert!(!ok && err.contains("--fit-host-memory 1e30"), "{err}");
}

#[test]
fn a_host_limit_nothing_fits_or_that_bounds_nothing_is_said() {
    // Stage 3 without offload holds no model state in host memory: it claimed a GPT-2 of
    // 2·10^14 parameters (its search cap) fits 1 KiB.
    let (ok, out, err) = estimate(&["--stage", "3", "--fit-host-memory", "1KiB"]);
    assert!(!ok, "claimed a fit:\n{out}");
    assert!(
        err.contains("--fit-host-memory") && err.contains("does not limit") && err.contains("--fit-device-memory"),
        "{err}"
    );
    // With the optimizer offloaded one block needs GiBs of host memory.
    let (ok, out, err) = estimate(&[
        "--stage",
        "3",
        "--fit-host-memory",
        "1KiB",
        "--offload-optimizer",
        "cpu",
    ]);
    assert!(!ok, "claimed a fit:\n{out}");
    assert!(
        err.contains("no GPT-2 of hidden 4096 fits in 1.00 KiB of host memory")
            && err.contains("the smallest (1 layer) needs"),
        "{err}"
    );
    // A device limit bounds stage 3 without offload.
    let (ok, out, err) = estimate(&[
        "--stage",
        "3",
        "--fit-host-memory",
        "1KiB",
        "--fit-device-memory",
        "80GiB",
    ]);
    assert!(ok, "{err}");
    assert!(bytes_on(&out, "per device") <= 80 << 30, "{out}");
}

#[test]
fn a_closed_stdout_ends_the_estimate_quietly() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills both descriptors on success, and each is owned exactly once below.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    let out = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["estimate", "--preset", "gpt2", "--stage", "2"])
        .stdout(std::process::Stdio::from(write))
        .output()
        .expect("run zero");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.trim().is_empty(), "{err}");
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["estimate", "--preset", "gpt2", "--stage", "2"])
        .stdout(std::process::Stdio::from(full))
        .output()
        .expect("run zero");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn the_stage_3_gathered_term_follows_the_prefetch_budget() {
    // Reference: GPT-2 small's units by hand, the embeddings E = (50257 + 1024)·768 and a block
    // B = 7 087 872, in bf16 (2 bytes): DeepSpeed's default budget 5e7 prefetches blocks beside
    // the embeddings (E + 5e7 + B); `auto` (0.9·768² = 530 841, less than a block) only the
    // largest other unit (E + B); 0, the embeddings alone.
    let (e, b) = (39_383_808u64, 7_087_872u64);
    for (budget, want) in [("5e7", e + 50_000_000 + b), ("auto", e + b), ("0", e)] {
        let (ok, out, err) = estimate(&[
            "--preset",
            "gpt2",
            "--stage",
            "3",
            "--gpus-per-node",
            "8",
            "--prefetch-bucket-size",
            budget,
        ]);
        assert!(ok, "{budget}: {err}");
        assert_eq!(bytes_on(&out, "gathered"), 2 * want, "{budget}: {out}");
    }
    let (ok, _, err) = estimate(&["--preset", "gpt2", "--stage", "3", "--prefetch-bucket-size", "lots"]);
    assert!(
        !ok && err.contains("--prefetch-bucket-size lots") && err.contains("auto"),
        "{err}"
    );
}

/// `--tensor-parallel 2` on 8 devices: each device holds one tensor rank's slice of GPT-2
/// small, ZeRO-2 over the 4 data-parallel devices. Reference, computed here from the shape:
/// a block's q|k|v, projection and MLP weights (and the column-parallel biases) halved, its
/// layer norms and projection biases whole; the token embedding's 50257 rows halved rounded up
/// (25129, one row of padding); the position embedding and the final norm whole.
#[test]
fn tensor_parallelism_divides_the_split_parameters_and_zero_goes_over_the_rest() {
    let (d, inner) = (768u64, 3072u64);
    let split = 3 * d * d + 3 * d + d * d + d * inner + inner + inner * d;
    let block = split / 2 + 6 * d;
    let psi = 12 * block + (25129 + 1024) * d + 2 * d;
    assert_eq!(psi, 62_641_920);
    let (ok, out, err) = estimate(&[
        "--preset",
        "gpt2",
        "--stage",
        "2",
        "--gpus-per-node",
        "8",
        "--tensor-parallel",
        "2",
    ]);
    assert!(ok, "{err}");
    assert_eq!(bytes_on(&out, "per device"), 2 * psi + (14 * psi).div_ceil(4));
    assert!(out.contains("each of 2 tensor ranks holds 62641920"), "{out}");
    assert!(out.contains("N = 4 data-parallel, 2 tensor ranks each"), "{out}");

    // What cannot be split is refused, naming the flag.
    for (args, want) in [
        (
            vec!["--params", "1e9", "--stage", "1", "--tensor-parallel", "2"],
            "give --preset",
        ),
        (
            vec![
                "--preset",
                "gpt2",
                "--stage",
                "1",
                "--gpus-per-node",
                "3",
                "--tensor-parallel",
                "2",
            ],
            "--tensor-parallel 2",
        ),
        (
            vec![
                "--preset",
                "gpt2",
                "--stage",
                "1",
                "--gpus-per-node",
                "5",
                "--tensor-parallel",
                "5",
            ],
            "12 heads",
        ),
    ] {
        let (ok, _, err) = estimate(&args);
        assert!(!ok, "{args:?} must be refused");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn llama3_8b_stage_1_on_8_devices_is_4psi_plus_12psi_over_n() {
    // Reference: Ψ = 8,030,261,248 (transformers' `num_parameters()` for Llama 3 8B's published
    // config); 2Ψ parameters + 2Ψ gradients + 12Ψ/8 optimizer state computed here.
    let psi: u64 = 8_030_261_248;
    let (ok, out, err) = estimate(&["--preset", "llama3-8b", "--stage", "1", "--gpus-per-node", "8"]);
    assert!(ok, "{err}");
    assert!(out.contains("8030261248 parameters (32 layers, hidden 4096"), "{out}");
    assert_eq!(bytes_on(&out, "per device"), 4 * psi + (12 * psi).div_ceil(8));
}

#[test]
fn a_llama_family_config_json_is_estimated_and_another_model_type_refused() {
    // Reference: transformers' count for Qwen2.5 0.5B (494,032,768), whose config.json this is
    // in its published values; stage 0 holds 16 bytes a parameter on the one device.
    let dir = std::env::temp_dir().join(format!("zero-estimate-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let qwen = dir.join("config.json");
    std::fs::write(
        &qwen,
        r#"{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "tie_word_embeddings": true}"#,
    )
    .expect("write config");
    let (ok, out, err) = estimate(&["--model-config", qwen.to_str().unwrap(), "--stage", "0"]);
    assert!(ok, "{err}");
    assert!(out.contains("494032768 parameters"), "{out}");
    assert_eq!(bytes_on(&out, "per device"), 16 * 494_032_768);
    let gpt2 = dir.join("gpt2.json");
    std::fs::write(&gpt2, r#"{"model_type": "gpt2"}"#).expect("write config");
    let (ok, _, err) = estimate(&["--model-config", gpt2.to_str().unwrap(), "--stage", "0"]);
    assert!(!ok);
    assert!(
        err.contains("model_type") && err.contains("llama, qwen2, qwen3, mistral"),
        "{err}"
    );
    let (ok, _, err) = estimate(&[
        "--preset",
        "llama3-8b",
        "--stage",
        "3",
        "--gpus-per-node",
        "4",
        "--tensor-parallel",
        "2",
    ]);
    assert!(!ok);
    assert!(err.contains("no tensor-parallel plan for the Llama family"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
