//! The SimpleModel example (`simple` binary: a Burn model of Linear 784→128, ReLU, Linear
//! 128→10, each layer a `ZeroModule`, trained in Burn's loop) trains under every ZeRO stage.
//!
//! Reference: chance. With 10 balanced classes an untrained classifier's cross-entropy is
//! ln 10 ≈ 2.30; the example's data are separable, so after its 100 steps both ranks' last
//! losses must sit well below that (runs so far ended between 0.03 and 0.9).

use std::process::Command;

#[test]
fn simple_example_learns_under_every_stage() {
    for stage in 0..=3 {
        let out = Command::new(env!("CARGO_BIN_EXE_simple"))
            .arg(stage.to_string())
            .output()
            .expect("the simple example starts");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "stage {stage}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let last = stdout
            .lines()
            .find_map(|l| l.strip_prefix("final losses by rank: "))
            .unwrap_or_else(|| panic!("stage {stage}: no final losses in\n{stdout}"));
        let losses: Vec<f32> = last
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .map(|v| v.trim().parse().expect("a loss"))
            .collect();
        assert_eq!(losses.len(), 2, "stage {stage}: one loss per rank");
        let mean = losses.iter().sum::<f32>() / 2.0;
        assert!(
            mean < 1.5,
            "stage {stage}: mean final loss {mean} is not below chance (2.30) by enough"
        );
    }
}
