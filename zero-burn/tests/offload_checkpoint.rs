//! Checkpoints of an engine whose masters and optimizer state are swapped to NVMe: saved from
//! the swap files, restored into them, and interchangeable with the checkpoints of an engine
//! that keeps its state in memory.
//!
//! Reference: the same training without the stop, with the state in memory (offload training
//! is bit for bit in-memory training, see offload_nvme.rs): losses and parameters must be
//! identical in every bit after the resume, whichever side used the swap file.

mod common;

use common::*;
use std::path::PathBuf;
use std::sync::Arc;
use zero_burn::{ChainEngine, EngineSettings, OptimizerOffload, ParamOffload, PrecisionSettings, Stage};
use zero_core::optim::{AdamSpec, OptimizerSpec};

const BLOCKS: usize = 3;
const STOP: usize = 2;
const TOTAL: usize = 4;

fn settings(stage: Stage, precision: PrecisionSettings, offload: OptimizerOffload) -> EngineSettings {
    let mut s = EngineSettings::new(
        stage,
        OptimizerSpec::Adam(AdamSpec {
            lr: 0.01,
            betas: (0.9, 0.999),
            eps: 1e-4,
            weight_decay: 0.01,
            decoupled_weight_decay: true,
            bias_correction: true,
            amsgrad: false,
        }),
    );
    s.reduce_bucket_size = 100;
    s.param_persistence_threshold = 13;
    s.prefetch_bucket_size = 400;
    // A schedule, so that a resume that lost its position would use the wrong rate.
    s.lr_schedule = Some(Arc::new(|step| 0.01 / (1.0 + step as f64)));
    s.precision = precision;
    s.offload_optimizer = offload;
    s
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-offload-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn nvme(dir: PathBuf) -> OptimizerOffload {
    // Chunks of 29 elements and 2 buffers: every group spans several chunks.
    OptimizerOffload::Nvme {
        path: dir,
        buffer_count: 2,
        chunk_elements: 29,
        threads: 1,
    }
}

/// Trains steps `steps` of one rank; returns the losses.
fn train(e: &mut ChainEngine<B, Net<B>>, rank: usize, world: usize, steps: std::ops::Range<usize>) -> Vec<f32> {
    let device = Default::default();
    let dtype = e.compute_dtype().burn();
    let per_rank = GLOBAL_BATCH / world;
    steps
        .map(|step| {
            let (x, y) = batch::<B>(step, rank * per_rank..(rank + 1) * per_rank, &device);
            let loss = e.forward((x.cast(dtype), y.cast(dtype))).expect("forward");
            let value = e.backward(loss).expect("backward");
            e.step().expect("step").expect("boundary");
            value
        })
        .collect()
}

/// Every rank's losses and rank 0's parameters: `first` trains to STOP and saves, a fresh
/// `second` loads and trains to TOTAL. Without a checkpoint dir, `first` trains to TOTAL.
fn run(
    world: usize,
    first: EngineSettings,
    second: EngineSettings,
    ckpt: Option<PathBuf>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let end = if ckpt.is_some() { STOP } else { TOTAL };
    let dir = ckpt.clone();
    let out = on_ranks(world, move |rank, group| {
        let mut e = ChainEngine::new(first.clone(), Net::<B>::new(&Default::default(), BLOCKS), group).expect("engine");
        let losses = train(&mut e, rank, world, 0..end);
        if let Some(dir) = &dir {
            e.save_checkpoint(dir, None, &serde_json::json!({ "next_step": end }))
                .expect("save");
        }
        (losses, values::<B, _>(&e.module().expect("module")))
    });
    let mut losses: Vec<f32> = out.iter().flat_map(|(l, _)| l.clone()).collect();
    let Some(dir) = ckpt else {
        return (losses, out.into_iter().next().map(|o| o.1).unwrap_or_default());
    };
    let out = on_ranks(world, move |rank, group| {
        let mut e =
            ChainEngine::new(second.clone(), Net::<B>::new(&Default::default(), BLOCKS), group).expect("engine");
        let client = e.load_checkpoint(&dir, None).expect("load");
        assert_eq!(client["next_step"], STOP, "client state");
        let losses = train(&mut e, rank, world, STOP..TOTAL);
        (losses, values::<B, _>(&e.module().expect("module")))
    });
    losses.extend(out.iter().flat_map(|(l, _)| l.clone()));
    (losses, out.into_iter().next().map(|o| o.1).unwrap_or_default())
}

fn sorted(mut v: Vec<f32>) -> Vec<f32> {
    // Ranks finish in any order within a phase; compare the multiset of losses per run.
    v.sort_by(f32::total_cmp);
    v
}

#[test]
fn nvme_offloaded_run_saved_and_resumed_equals_the_uninterrupted_run() {
    let world = 2;
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for (dtype, precision) in [("fp32", PrecisionSettings::fp32()), ("bf16", PrecisionSettings::bf16())] {
            let label = format!("{stage:?} {dtype}");
            let swap = scratch(&format!("swap-{stage:?}-{dtype}"));
            let ckpt = scratch(&format!("ckpt-{stage:?}-{dtype}"));
            let memory = settings(stage, precision.clone(), OptimizerOffload::None);
            let offloaded = settings(stage, precision.clone(), nvme(swap.clone()));
            let (want_losses, want_params) = run(world, memory.clone(), memory.clone(), None);
            let (got_losses, got_params) = run(world, offloaded.clone(), offloaded, Some(ckpt.clone()));
            assert_eq!(sorted(got_losses), sorted(want_losses.clone()), "{label}: losses");
            assert!(got_params == want_params, "{label}: parameters after the resume");
            // Training moved the weights: equality is not that of two untouched models.
            let untouched = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
            assert!(want_params != untouched, "{label}: training must move the weights");
            let _ = std::fs::remove_dir_all(&swap);
            let _ = std::fs::remove_dir_all(&ckpt);
        }
    }
}

#[test]
fn checkpoints_move_between_nvme_offload_and_memory() {
    let world = 2;
    let stage = Stage::Zero3;
    let precision = PrecisionSettings::bf16();
    let memory = settings(stage, precision.clone(), OptimizerOffload::None);
    let (want_losses, want_params) = run(world, memory.clone(), memory.clone(), None);
    let swap = scratch("swap-both-ways");
    let offloaded = settings(stage, precision, nvme(swap.clone()));
    for (label, first, second) in [
        ("saved with nvme, loaded in memory", offloaded.clone(), memory.clone()),
        ("saved in memory, loaded with nvme", memory.clone(), offloaded.clone()),
        ("saved with nvme, loaded with cpu offload", offloaded.clone(), {
            let mut s = memory.clone();
            s.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
            s
        }),
        (
            "saved with nvme, loaded with the parameter shards on nvme",
            offloaded.clone(),
            {
                let mut s = memory.clone();
                s.offload_param = ParamOffload::Nvme {
                    path: swap.join("params"),
                    max_in_cpu: 0,
                };
                s
            },
        ),
    ] {
        let ckpt = scratch(&format!("ckpt-{}", label.replace(' ', "-").replace(',', "")));
        let (losses, params) = run(world, first, second, Some(ckpt.clone()));
        assert_eq!(sorted(losses), sorted(want_losses.clone()), "{label}: losses");
        assert!(params == want_params, "{label}: parameters after the resume");
        let _ = std::fs::remove_dir_all(&ckpt);
    }
    let _ = std::fs::remove_dir_all(&swap);
}
