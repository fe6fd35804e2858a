//! What `--metrics` leaves behind, read as a user reads it: a header naming the run, one line
//! per step whose memory report says where each kind of state lives (device, host, NVMe), and
//! a PNG loss curve with text, beside the file. References: the optimizer's own memory report
//! (`ZeroOptimizer::memory`) and the sizes the optimizer state must have (Adam: two fp32
//! moments per owned parameter).

use crate::support;
use serde_json::Value;
use std::path::Path;
use support::{fixture_args, fixture_shape};
use zero_examples::gpt2::train;

fn config(dir: &Path, extra_zero: &str) -> std::path::PathBuf {
    let path = dir.join("ds.json");
    let text = format!(
        r#"{{
  "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
  "optimizer": {{ "type": "AdamW", "params": {{ "lr": 1e-3 }} }},
  "zero_optimization": {{ "stage": 3, "stage3_param_persistence_threshold": 0 {extra_zero} }}
}}"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn read_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

const KINDS: [&str; 5] = [
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_state",
    "gathered",
];

fn at(v: &Value, kind: &str, place: &str) -> u64 {
    v["locations"][kind][place].as_u64().unwrap()
}

#[test]
fn the_metrics_file_names_the_run_and_says_where_every_byte_lives() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("run.jsonl");
    let mut args = fixture_args(&config(dir.path(), ""), 2, 2);
    args.metrics = Some(metrics.clone());
    train(&args).unwrap();

    let lines = read_lines(&metrics);
    let header = &lines[0]["run"];
    assert_eq!(header["stage"], 3, "{header}");
    assert_eq!(header["world_size"], 2, "{header}");
    assert_eq!(header["precision"], "fp32", "{header}");
    assert!(header["parameters"].as_u64().unwrap() > 0, "{header}");
    assert_eq!(lines.len(), 3, "a header and one line per step");
    for step in &lines[1..] {
        let memory = step["memory"].as_array().unwrap();
        assert_eq!(memory.len(), 2, "one report per rank");
        for report in memory {
            // Without offload everything is beside the model, exactly the kinds' current bytes.
            for kind in KINDS {
                let current = report[kind]["current"].as_u64().unwrap();
                assert_eq!(at(report, kind, "device"), current, "{kind}: {report}");
                assert_eq!(
                    at(report, kind, "host") + at(report, kind, "nvme"),
                    0,
                    "{kind}: {report}"
                );
            }
            assert!(at(report, "optimizer_state", "device") > 0, "{report}");
        }
    }

    // The loss curve beside the file has its title and axes: ink in the title band.
    let png = metrics.with_extension("png");
    let decoder = png::Decoder::new(std::fs::File::open(&png).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let width = info.width as usize;
    let title_ink = buf[..3 * width * 40]
        .chunks(3)
        .filter(|p| p.iter().all(|&c| c < 110))
        .count();
    assert!(
        title_ink > 300,
        "the PNG has no title ({title_ink} dark pixels in its top band)"
    );
}

#[test]
fn with_nvme_offload_the_report_separates_host_buffers_from_the_swap_file() {
    let dir = tempfile::tempdir().unwrap();
    let swap = dir.path().join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let extra = format!(
        r#", "offload_optimizer": {{ "device": "nvme", "nvme_path": "{}", "buffer_count": 3 }}"#,
        swap.display()
    );
    let metrics = dir.path().join("run.jsonl");
    let mut args = fixture_args(&config(dir.path(), &extra), 1, 2);
    args.metrics = Some(metrics.clone());
    train(&args).unwrap();

    let lines = read_lines(&metrics);
    let parameters = lines[0]["run"]["parameters"].as_u64().unwrap();
    for report in lines[1]["memory"].as_array().unwrap() {
        // On disk: the owned fp32 masters and Adam's two moments of each rank's half, padded
        // (nothing is kept whole: the persistence threshold is 0).
        let master_on_disk = at(report, "master_weights", "nvme");
        let state_on_disk = at(report, "optimizer_state", "nvme");
        assert!(master_on_disk >= parameters / 2 * 4, "{report}");
        assert!(master_on_disk < parameters / 2 * 4 + 4096 * 4, "{report}");
        assert_eq!(state_on_disk, 2 * master_on_disk, "Adam's two moments: {report}");
        // In memory: only the host buffers the state streams through, none of it on the device.
        assert_eq!(at(report, "optimizer_state", "device"), 0, "{report}");
        assert_eq!(
            at(report, "optimizer_state", "host"),
            report["optimizer_state"]["current"].as_u64().unwrap(),
            "{report}"
        );

        // `zero estimate` predicts the same split (per host of 2 devices, so halved).
        let estimate = fixture_estimate(2, 3);
        let within = |what: &str, engine: u64, predicted: u64| {
            let off = (engine as f64 - predicted as f64).abs() / predicted as f64;
            assert!(
                off < 0.05,
                "{what}: the run holds {engine} bytes, zero estimate says {predicted}"
            );
        };
        within(
            "host streaming buffers",
            at(report, "optimizer_state", "host"),
            estimate.per_host.optimizer_state / 2,
        );
        within(
            "on NVMe",
            master_on_disk + state_on_disk,
            estimate.per_node_nvme.optimizer_state / 2,
        );
    }
}

/// `zero estimate` for the tiny fixture GPT-2 (models/tests/fixtures/gpt2-tiny/config.json) at
/// stage 3, fp32, optimizer on NVMe with `buffer_count` buffers, on `devices` devices.
fn fixture_estimate(devices: u64, buffer_count: u64) -> zero_core::estimate::Estimate {
    use zero_core::estimate::{estimate, Dtype, EstimateInput, OffloadTarget};
    let shape = fixture_shape();
    let mut base = EstimateInput::new(0, 3, devices, Dtype::Fp32);
    base.offload_optimizer = Some(OffloadTarget::Nvme);
    base.nvme_streaming.buffer_count = buffer_count;
    estimate(&shape.input(&base)).unwrap()
}

/// A resumed run's metrics file holds the whole run: the steps up to the checkpoint it resumed
/// from (as the first run wrote them; a step the first run took past that checkpoint is written
/// again, by the resumed run) and then its own. Reference: the first run's lines.
#[test]
fn a_resumed_run_keeps_the_steps_before_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    let metrics = dir.path().join("m.jsonl");
    let ckpt = dir.path().join("ckpt");
    let first = zero_examples::gpt2::TrainArgs {
        metrics: Some(metrics.clone()),
        save: Some(ckpt.clone()),
        save_every: Some(2),
        ..fixture_args(&cfg, 3, 2)
    };
    train(&first).expect("first run");
    let before = read_lines(&metrics);
    let steps = |lines: &[Value]| lines.iter().filter_map(|l| l.get("step")?.as_u64()).collect::<Vec<_>>();
    assert_eq!(steps(&before), [1, 2, 3]);
    // Resume from the step-2 save, as after a crash in step 3's save.
    let resumed = zero_examples::gpt2::TrainArgs {
        metrics: Some(metrics.clone()),
        load: Some(ckpt.join("global_step2")),
        ..fixture_args(&cfg, 4, 2)
    };
    train(&resumed).expect("resumed run");
    let after = read_lines(&metrics);
    assert!(after[0].get("run").is_some(), "the header comes first");
    assert_eq!(steps(&after), [1, 2, 3, 4]);
    assert_eq!(after[1..3], before[1..3], "steps 1 and 2 as the first run wrote them");
    assert_eq!(after[3]["loss"], before[3]["loss"], "step 3 again, the same");
}
