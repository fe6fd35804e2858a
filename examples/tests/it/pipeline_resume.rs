//! `gpt2 train` with `pipeline.stages` 2: `--save` after 2 steps, then `--load` to step 4,
//! against one uninterrupted 4-step run (PP 2, PP 2 × DP 2 under ZeRO 1, and PP 2 × TP 2, whose
//! tensor ranks each save their slices under `tensor_rank_{t}`); and the
//! validation loss of a pipelined run against the same run without a pipeline.
//!
//! References: the uninterrupted pipelined run (resuming must reproduce its steps 3 and 4 bit
//! for bit and end with byte-identical shard files), and the non-pipelined trainer on the same
//! model and data for the validation loss (equal to fp32 rounding: the stages compute the same
//! forward in another grouping of operations).

use crate::support;
use support::*;

use std::path::{Path, PathBuf};
use zero_examples::gpt2::{train, TrainArgs};

fn config(dir: &Path, stages: usize, tensor: usize, nproc: usize, zero_stage: u64) -> PathBuf {
    let data = nproc / (stages * tensor);
    let config = serde_json::json!({
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4 / data,
        "gradient_clipping": 1.0,
        "steps_per_print": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0002, "warmup_max_lr": 0.001, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": zero_stage},
        "pipeline": {"stages": stages, "partition": "uniform"},
        "tensor_parallel": {"autotp_size": tensor}
    });
    let path = dir.join(format!("pp{stages}_tp{tensor}_dp{data}.json"));
    std::fs::write(&path, config.to_string()).expect("config written");
    path
}

fn args(config: &Path, nproc: usize, steps: u64, save: Option<&Path>, load: Option<&Path>) -> TrainArgs {
    TrainArgs {
        save: save.map(Path::to_path_buf),
        load: load.map(Path::to_path_buf),
        ..fixture_args(config, steps, nproc)
    }
}

/// The shard files of a tag, name → bytes.
fn shards(tag_dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(tag_dir)
        .expect("tag directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).expect("readable"),
            )
        })
        .collect();
    out.sort();
    out
}

/// Fails, naming `label` and what differs, unless both runs wrote the same shard files (as
/// many, by the same names) with the same bytes.
fn assert_same_shards(label: &str, a: &[(String, Vec<u8>)], b: &[(String, Vec<u8>)]) {
    let names = |s: &[(String, Vec<u8>)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "{label}: the shard files of the two runs");
    for ((name, x), (_, y)) in a.iter().zip(b) {
        assert!(x == y, "{label}: {name} differs between the runs");
    }
}

fn resume(stages: usize, tensor: usize, nproc: usize, zero_stage: u64) {
    let label = format!("PP {stages} × TP {tensor} on {nproc} ranks, ZeRO {zero_stage}");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path(), stages, tensor, nproc, zero_stage);
    let whole_dir = dir.path().join("whole");
    let split_dir = dir.path().join("split");
    let whole = train(&args(&config, nproc, 4, Some(&whole_dir), None)).expect("4-step run");
    train(&args(&config, nproc, 2, Some(&split_dir), None)).expect("2-step run");
    let resumed = train(&args(&config, nproc, 4, Some(&split_dir), Some(&split_dir))).expect("resumed run");
    let steps: Vec<u64> = resumed.steps.iter().map(|r| r.step).collect();
    assert_eq!(steps, [3, 4], "{label}: the resumed run takes steps 3 and 4 only");
    for (r, w) in resumed.steps.iter().zip(&whole.steps[2..]) {
        assert_eq!(
            r.loss, w.loss,
            "{label}, step {}: resumed loss vs uninterrupted",
            r.step
        );
        assert_eq!(r.grad_norm, w.grad_norm, "{label}, step {}: grad norm", r.step);
        assert_eq!(r.lr, w.lr, "{label}, step {}: LR schedule position", r.step);
    }
    assert!(whole.steps[3].loss < whole.steps[0].loss, "{label}: the run trained");
    // Each tensor index's stage-0 data ranks write its slices of every stage.
    let tensor_dirs: Vec<PathBuf> = match tensor {
        1 => vec![PathBuf::new()],
        _ => (0..tensor).map(|t| PathBuf::from(format!("tensor_rank_{t}"))).collect(),
    };
    for t in &tensor_dirs {
        let a = shards(&whole_dir.join(t).join("global_step4"));
        let b = shards(&split_dir.join(t).join("global_step4"));
        assert_eq!(
            a.len(),
            nproc / (stages * tensor),
            "{label}: one shard file per data rank in {}",
            t.display()
        );
        assert_same_shards(&format!("{label}, {}", t.display()), &a, &b);
    }
}

#[test]
fn two_stages_resume_bit_for_bit() {
    resume(2, 1, 2, 0);
}

#[test]
fn two_stages_times_two_data_ranks_resume_bit_for_bit() {
    resume(2, 1, 4, 1);
}

#[test]
fn two_stages_times_two_tensor_ranks_resume_bit_for_bit() {
    resume(2, 2, 4, 1);
}

/// Text data (which has a held-out part): the validation loss every steps_per_print steps.
#[test]
fn validation_loss_matches_the_run_without_a_pipeline() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Single letters between newlines: GPT-2's BPE keeps each a single byte (ids below the tiny
    // model's vocabulary of 512). A fixed pseudo-random order.
    let body: String = (0..20_000u64)
        .flat_map(|i| [(b'a' + (((i * 2_654_435_761) >> 7) % 26) as u8) as char, '\n'])
        .collect();
    let text = dir.path().join("corpus.txt");
    std::fs::write(&text, body).expect("corpus written");
    let run = |stages: usize| {
        let mut a = args(&config(dir.path(), stages, 1, 2, 0), 2, 4, None, None);
        a.tokens = None;
        a.data = Some(text.clone());
        a.seq_len = Some(16);
        train(&a).expect("training on the letters")
    };
    let piped = run(2);
    let plain = run(1);
    for (p, q) in piped.steps.iter().zip(&plain.steps) {
        eprintln!(
            "step {}: loss {} vs {}, valid {:?} vs {:?}",
            p.step, p.loss, q.loss, p.valid_loss, q.valid_loss
        );
        match (p.valid_loss, q.valid_loss) {
            (Some(a), Some(b)) => assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "step {}: pipelined validation loss {a} vs {b} without a pipeline",
                p.step
            ),
            (None, None) => assert!(p.step % 2 != 0, "step {}: a validation loss was due", p.step),
            (a, b) => panic!("step {}: validation {a:?} with a pipeline, {b:?} without", p.step),
        }
    }
    assert!(piped.steps.iter().any(|s| s.valid_loss.is_some()), "validation ran");
}

/// A checkpoint crosses between a pipeline and none, both ways: saved after 2 steps by PP 2
/// (its head holding a tied copy of `wte` as `lm_head.weight`), resumed to step 4 without a
/// pipeline at ZeRO 3 over 2 data ranks (whose `embed.wte.weight` is that tensor), and back.
/// Reference: the uninterrupted 4-step run of the resuming layout; equal to fp32 rounding (the
/// two layouts sum in other orders), and every resumed step's loss moves as that run's did.
#[test]
fn a_checkpoint_resumes_with_a_pipeline_or_without_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let piped = config(dir.path(), 2, 1, 2, 1);
    let plain = config(dir.path(), 1, 1, 2, 3);
    for (from, to, label) in [
        (&piped, &plain, "pipeline to none"),
        (&plain, &piped, "none to pipeline"),
    ] {
        let save = dir.path().join(label.replace(' ', "-"));
        train(&args(from, 2, 2, Some(&save), None)).expect("2-step run");
        let resumed = train(&args(to, 2, 4, None, Some(&save))).expect("resumed run");
        let whole = train(&args(to, 2, 4, None, None)).expect("uninterrupted run");
        let steps: Vec<u64> = resumed.steps.iter().map(|r| r.step).collect();
        assert_eq!(steps, [3, 4], "{label}: the resumed run takes steps 3 and 4 only");
        for (r, w) in resumed.steps.iter().zip(&whole.steps[2..]) {
            assert!(
                (r.loss - w.loss).abs() <= 1e-5 * w.loss.abs(),
                "{label}, step {}: resumed loss {} vs uninterrupted {}",
                r.step,
                r.loss,
                w.loss
            );
            assert_eq!(r.lr, w.lr, "{label}, step {}: LR schedule position", r.step);
        }
    }
}

/// The optimizer's state offloaded to NVMe saves and resumes through the pipeline's checkpoint
/// as it does in memory: read back from each stage's swap file at the save, written into the
/// new run's at the load. Reference: the uninterrupted offloaded run, bit for bit, with
/// byte-identical shard files.
#[test]
fn two_stages_with_nvme_offload_resume_bit_for_bit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(dir.path(), 2, 1, 2, 1);
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    c["zero_optimization"]["offload_optimizer"] =
        serde_json::json!({ "device": "nvme", "nvme_path": dir.path().join("nvme") });
    std::fs::write(&path, c.to_string()).expect("write config");
    let (whole_dir, split_dir) = (dir.path().join("whole"), dir.path().join("split"));
    let whole = train(&args(&path, 2, 4, Some(&whole_dir), None)).expect("4-step run");
    train(&args(&path, 2, 2, Some(&split_dir), None)).expect("2-step run");
    let resumed = train(&args(&path, 2, 4, Some(&split_dir), Some(&split_dir))).expect("resumed run");
    assert_eq!(resumed.steps.iter().map(|r| r.step).collect::<Vec<_>>(), [3, 4]);
    for (r, w) in resumed.steps.iter().zip(&whole.steps[2..]) {
        assert_eq!(r.loss, w.loss, "step {}: resumed loss vs uninterrupted", r.step);
        assert_eq!(r.grad_norm, w.grad_norm, "step {}: grad norm", r.step);
    }
    let (a, b) = (
        shards(&whole_dir.join("global_step4")),
        shards(&split_dir.join("global_step4")),
    );
    assert_eq!(a.len(), 1);
    assert_same_shards("NVMe offload", &a, &b);
}
