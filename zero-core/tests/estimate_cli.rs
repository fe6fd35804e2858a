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
    assert_eq!(bytes_on(&out, "per device"), 0, "{out}");
    // One host serves 4 devices: their fp16 parameter shards and fp32 gradient shards.
    assert_eq!(bytes_on(&out, "per host"), 4 * (2 * psi / 8 + 4 * psi / 8), "{out}");
    assert_eq!(bytes_on(&out, "per node on NVMe"), 4 * (12 * psi / 8), "{out}");
    // fp32 without offload at stage 0: 4 + 4 + 8.
    let (ok, out, _) = estimate(&["--params", "1000", "--stage", "0", "--dtype", "fp32"]);
    assert!(ok);
    assert_eq!(bytes_on(&out, "per device"), 16_000);
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
