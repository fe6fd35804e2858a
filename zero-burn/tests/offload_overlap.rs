//! The CPU-offloaded optimizer step overlapped with the next forward
//! (`EngineSettings::overlap_optimizer_step`) changes when the update runs, never what it
//! computes.
//!
//! Reference: the same training with the synchronous step (`overlap_optimizer_step = false`),
//! itself tested against single-process Burn elsewhere (exactness.rs, offload_nvme.rs). Losses,
//! step reports, the weights after every step, an evaluation, a checkpoint saved right after a
//! step (while the update would still be running) and the memory report must be the same in
//! every bit, at stages 1-3, one and two ranks, fp32 and bf16, with gradient clipping that
//! bites and gradient accumulation.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_burn::{
    ActivationCheckpointing, ChainEngine, EngineSettings, MemoryReport, OptimizerOffload, PrecisionSettings, Stage,
    StepReport,
};

const BLOCKS: usize = 3;
const STEPS: usize = 4;
const ACCUMULATION: usize = 2;
/// The checkpoint is saved right after this step (0-based) and an evaluation follows the next.
const SAVE_AFTER: usize = 1;
/// Small enough that every step is clipped (the gradient norms here are about 0.1-1).
const CLIP: f64 = 0.05;

fn settings(stage: Stage, precision: PrecisionSettings, overlap: bool) -> EngineSettings {
    let mut s = EngineSettings::new(stage, adamw_eps4(0.01));
    s.gradient_accumulation_steps = ACCUMULATION;
    s.gradient_clipping = CLIP;
    // Several groups per part, some sharded and some replicated at stage 3, and gathers
    // prefetched beyond the next part: the waits must come before every one of them.
    s.reduce_bucket_size = 100;
    s.param_persistence_threshold = 13;
    s.prefetch_bucket_size = 400;
    s.overlap_comm = true;
    s.lr_schedule = Some(Arc::new(|step| 0.01 / (1.0 + step as f64)));
    s.precision = precision;
    s.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
    s.overlap_optimizer_step = overlap;
    s
}

/// What one rank saw.
#[derive(Debug, PartialEq)]
struct RankRun {
    overlapped: bool,
    losses: Vec<u32>,
    reports: Vec<StepReport>,
    /// The weights after every step, read through `module()`.
    weights: Vec<Vec<Vec<u32>>>,
    eval: u32,
    /// The last block's weights, gathered right after the last step.
    gathered: Vec<Vec<u32>>,
    memory: MemoryReport,
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|p| p.iter().map(|x| x.to_bits()).collect()).collect()
}

fn train(world: usize, settings: EngineSettings, dir: PathBuf) -> Vec<RankRun> {
    on_ranks(world, move |rank, group| {
        let device = Default::default();
        let mut e = ChainEngine::new(settings.clone(), Net::<B>::new(&device, BLOCKS), group).expect("engine");
        let dtype = e.compute_dtype().burn();
        let per_rank = GLOBAL_BATCH / world;
        let rows = rank * per_rank..(rank + 1) * per_rank;
        let mut run = RankRun {
            overlapped: e.overlaps_optimizer_step(),
            losses: Vec::new(),
            reports: Vec::new(),
            weights: Vec::new(),
            eval: 0,
            gathered: Vec::new(),
            memory: MemoryReport::default(),
        };
        for step in 0..STEPS {
            for micro in 0..ACCUMULATION {
                let (x, y) = batch::<B>(step * ACCUMULATION + micro, rows.clone(), &device);
                let loss = e.forward((x.cast(dtype), y.cast(dtype))).expect("forward");
                run.losses.push(e.backward(loss).expect("backward").to_bits());
            }
            run.reports.push(e.step().expect("step").expect("boundary"));
            if step == SAVE_AFTER {
                // Right after the step: the update may still be running.
                e.save_checkpoint(&dir, Some("mid"), &serde_json::Value::Null)
                    .expect("save");
            }
            if step == SAVE_AFTER + 1 {
                let (x, y) = batch::<B>(1000, rows.clone(), &device);
                run.eval = e.eval_loss((x.cast(dtype), y.cast(dtype))).expect("eval").to_bits();
            }
            if step + 1 == STEPS {
                // Right after the last step, before anything else waited for its update.
                let (_, blocks) = zero_burn::ChainModel::into_parts(e.module().expect("gather"));
                zero_burn::params::read_values::<B, _>(&blocks[BLOCKS - 1], |_, v| {
                    run.gathered.push(v.iter().map(|x| x.to_bits()).collect())
                });
            }
            if step + 1 < STEPS && step != SAVE_AFTER + 1 {
                // Most steps go straight on to the next forward, which overlaps the update.
                continue;
            }
            run.weights.push(bits(&values::<B, _>(&e.module().expect("module"))));
        }
        run.memory = e.memory();
        run
    })
}

/// Every file under `dir`, by relative path.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read checkpoint dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path.strip_prefix(dir).expect("under dir").display().to_string();
                out.insert(name, std::fs::read(&path).expect("read checkpoint file"));
            }
        }
    }
    out
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-overlap-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Trains `settings` both ways and asserts that every observation is the same.
fn compare(label: &str, world: usize, settings: EngineSettings) {
    let sync_dir = scratch(&format!("sync-{}", label.replace(' ', "-")));
    let overlap_dir = scratch(&format!("overlap-{}", label.replace(' ', "-")));
    let mut sync = settings.clone();
    sync.overlap_optimizer_step = false;
    let mut overlap = settings;
    overlap.overlap_optimizer_step = true;
    let want = train(world, sync, sync_dir.clone());
    let got = train(world, overlap, overlap_dir.clone());
    assert!(
        want.iter().all(|r| !r.overlapped),
        "{label}: the reference must step synchronously"
    );
    assert!(
        got.iter().all(|r| r.overlapped),
        "{label}: the update must run in the background"
    );
    for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.losses, w.losses, "{label} rank {rank}: losses");
        assert_eq!(g.reports, w.reports, "{label} rank {rank}: step reports");
        assert!(g.weights == w.weights, "{label} rank {rank}: weights");
        assert_eq!(g.eval, w.eval, "{label} rank {rank}: evaluation loss");
        assert!(g.gathered == w.gathered, "{label} rank {rank}: gathered weights");
        assert_eq!(g.memory, w.memory, "{label} rank {rank}: memory report");
    }
    let (got_files, want_files) = (files(&overlap_dir), files(&sync_dir));
    assert!(!want_files.is_empty(), "{label}: the checkpoint was written");
    assert_eq!(
        got_files.keys().collect::<Vec<_>>(),
        want_files.keys().collect::<Vec<_>>(),
        "{label}: checkpoint files"
    );
    for (name, bytes) in &want_files {
        assert!(got_files[name] == *bytes, "{label}: checkpoint file {name} differs");
    }
    // The comparison is not that of two idle runs: clipping bit and training moved the weights.
    let reports = &want[0].reports;
    assert!(
        reports.iter().all(|r| r.grad_norm > CLIP),
        "{label}: every step is clipped"
    );
    let untouched = bits(&values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS)));
    assert!(want[0].weights[0] != untouched, "{label}: training moved the weights");
    let _ = std::fs::remove_dir_all(&sync_dir);
    let _ = std::fs::remove_dir_all(&overlap_dir);
}

#[test]
fn overlapped_update_is_the_synchronous_update_bit_for_bit() {
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1, 2] {
            for (dtype, precision) in [("fp32", PrecisionSettings::fp32()), ("bf16", PrecisionSettings::bf16())] {
                let label = format!("stage {} world {world} {dtype}", stage.number());
                compare(&label, world, settings(stage, precision, true));
            }
        }
    }
}

#[test]
fn overlapped_update_with_activation_checkpointing_is_the_synchronous_update() {
    // Stages 1-2 run the checkpointed forward, segment by segment; each block still waits.
    for stage in [Stage::Zero1, Stage::Zero2] {
        let mut s = settings(stage, PrecisionSettings::bf16(), true);
        s.activation_checkpointing = Some(ActivationCheckpointing {
            number_checkpoints: Some(2),
            ..Default::default()
        });
        compare(&format!("stage {} checkpointed", stage.number()), 2, s);
    }
}

#[test]
fn synchronous_where_the_update_is_not_local_work() {
    // LAMB's trust ratio needs a collective inside the step: it stays in step(). Without
    // offload there is no CPU pool to run it on.
    let lamb = zero_core::optim::OptimizerSpec::Lamb(zero_core::optim::LambSpec::default());
    let cases = [
        ("lamb", {
            let mut s = settings(Stage::Zero2, PrecisionSettings::fp32(), true);
            s.optimizer = lamb;
            s
        }),
        ("no offload", {
            let mut s = settings(Stage::Zero3, PrecisionSettings::fp32(), true);
            s.offload_optimizer = OptimizerOffload::None;
            s
        }),
    ];
    for (label, s) in cases {
        let e = ChainEngine::new(s, Net::<B>::new(&Default::default(), BLOCKS), single()).expect("engine");
        assert!(!e.overlaps_optimizer_step(), "{label}");
    }
}

fn single() -> Arc<dyn zero_core::comm::ProcessGroup> {
    zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0)
}

#[test]
fn initialize_chain_overlaps_cpu_offload_by_default_and_the_option_turns_it_off() {
    let text = r#"{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}"#;
    let config = zero_core::config::DeepSpeedConfig::from_str(text, "ds_config.json")
        .expect("parses")
        .config;
    let engine = |overlap: Option<bool>| {
        let options = zero_burn::InitOptions {
            overlap_optimizer_step: overlap,
            ..Default::default()
        };
        let model = Net::<B>::new(&Default::default(), BLOCKS);
        zero_burn::initialize_chain::<B, _>(&config, model, single(), &options).expect("engine")
    };
    assert!(engine(None).overlaps_optimizer_step(), "default: on with cpu offload");
    assert!(engine(Some(true)).overlaps_optimizer_step(), "asked for");
    assert!(!engine(Some(false)).overlaps_optimizer_step(), "turned off");
}
