//! `ZeroOptimizer` with its optimizer offloaded (`offload_optimizer`): streamed from a swap file
//! (`nvme`) training is bit for bit the host-memory training (`cpu`), at every stage and world
//! size, in fp32 and bf16; a run saved from the swap file and resumed (into the swap file or
//! into memory) continues bit for bit; the memory report says the state is on NVMe.
//!
//! Reference: the same run with the state in host memory (`offload_optimizer: cpu`, the same
//! fused kernel on the same values: the chunks see exactly the in-memory values, and the
//! update is element-wise), and for the resume, the same run without the stop. The model is
//! sharded_support's three linear units (a skip connection), cut at stages 2-3 by
//! `initialize_settings`.

mod common;
mod sharded_support;

use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use sharded_support::*;
use std::path::{Path, PathBuf};
use zero_burn::params::read_values;
use zero_burn::{EngineSettings, OptimizerOffload, PrecisionSettings, Stage};
use zero_core::optim::{AdamSpec, OptimizerSpec};

type AB = Autodiff<Flex>;
const STEPS: usize = 4;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-optimizer-offload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Chunks of 29 elements and 2 buffers: every group spans several chunks, most with a shorter
/// last one.
fn nvme(dir: &Path) -> OptimizerOffload {
    OptimizerOffload::Nvme {
        path: dir.to_path_buf(),
        buffer_count: 2,
        chunk_elements: 29,
        threads: 1,
    }
}

fn settings(stage: Stage, precision: PrecisionSettings, offload: OptimizerOffload) -> EngineSettings {
    let mut s = EngineSettings::new(
        stage,
        OptimizerSpec::Adam(AdamSpec {
            lr: 0.01,
            eps: 1e-4,
            weight_decay: 0.01,
            ..AdamSpec::adamw()
        }),
    );
    // A schedule, so that a resume that lost its position would use the wrong rate.
    s.lr_schedule = Some(std::sync::Arc::new(|step| 0.01 / (1.0 + step as f64)));
    s.precision = precision;
    s.offload_optimizer = offload;
    s
}

/// What a rank saw: per step its loss bits, and its units (whole, gathered) after the run.
type Run = (Vec<u32>, Vec<Vec<u32>>);

/// Steps `steps` on `world` rank threads through `initialize_settings`; loads the checkpoint
/// `load` first and saves into `save` after the last step.
fn run(
    settings: EngineSettings,
    world: usize,
    steps: std::ops::Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<Run> {
    on_ranks(world, |rank, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let dtype = settings.precision.dtype.burn();
        let (mut model, mut optim) =
            zero_burn::initialize_settings(settings.clone(), Net::<AB>::whole(&device), group, comm)
                .expect("initialize");
        if let Some(dir) = load {
            model = optim.load_checkpoint(dir, None, model).expect("load").0;
        }
        let mut lr = optim.lr_scheduler();
        let per = ROWS / world;
        let mine = rank * per..(rank + 1) * per;
        let mut losses = Vec::new();
        for step in steps.clone() {
            let x = rows::<AB>(mine.clone(), 4, step, &device).cast(dtype);
            let loss = model.loss(x, rows::<AB>(mine.clone(), 3, 5 + step, &device).cast(dtype));
            losses.push(loss.clone().into_scalar().to_f32().to_bits());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let rate = burn::optim::lr_scheduler::LrScheduler::step(&mut lr);
            model = optim.try_step(rate, model, grads).expect("step");
        }
        if let Some(dir) = save {
            optim
                .save_checkpoint(dir, None, &serde_json::Value::Null)
                .expect("save");
        }
        assert_eq!(optim.tensor_state(), Some(false), "offloaded: host buffers");
        let units = model
            .units
            .iter()
            .map(|u| {
                let mut v = Vec::new();
                read_values::<AB, _>(&u.gathered().expect("gather"), |_, p| {
                    v.extend(p.iter().map(|x| x.to_bits()))
                });
                v
            })
            .collect();
        (losses, units)
    })
}

trait ToF32 {
    fn to_f32(self) -> f32;
}
impl<E: burn::tensor::ElementConversion> ToF32 for E {
    fn to_f32(self) -> f32 {
        self.elem::<f32>()
    }
}

#[test]
fn nvme_offloaded_training_is_bit_for_bit_host_memory_training() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1usize, 2] {
            for (dtype, precision) in [("fp32", PrecisionSettings::fp32()), ("bf16", PrecisionSettings::bf16())] {
                let label = format!("{stage:?} world {world} {dtype}");
                let dir = scratch(&format!("{stage:?}-{world}-{dtype}"));
                let want = run(
                    settings(stage, precision.clone(), OptimizerOffload::Cpu { threads: 1 }),
                    world,
                    0..STEPS,
                    None,
                    None,
                );
                let got = run(settings(stage, precision, nvme(&dir)), world, 0..STEPS, None, None);
                assert_eq!(got, want, "{label}: nvme against host memory");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

#[test]
fn a_run_saved_from_the_swap_file_resumes_bit_for_bit_into_the_swap_file_or_memory() {
    for stage in [Stage::Zero1, Stage::Zero3] {
        let whole = run(
            settings(stage, PrecisionSettings::bf16(), OptimizerOffload::Cpu { threads: 1 }),
            2,
            0..STEPS,
            None,
            None,
        );
        let (swap, ckpt) = (scratch(&format!("swap-{stage:?}")), scratch(&format!("ckpt-{stage:?}")));
        let first = run(
            settings(stage, PrecisionSettings::bf16(), nvme(&swap)),
            2,
            0..2,
            None,
            Some(&ckpt),
        );
        for (label, offload) in [
            ("into the swap file", nvme(&swap)),
            ("into memory", OptimizerOffload::Cpu { threads: 1 }),
        ] {
            let second = run(
                settings(stage, PrecisionSettings::bf16(), offload),
                2,
                2..STEPS,
                Some(&ckpt),
                None,
            );
            for (rank, ((a, b), w)) in first.iter().zip(&second).zip(&whole).enumerate() {
                let losses: Vec<u32> = a.0.iter().chain(&b.0).copied().collect();
                assert_eq!(losses, w.0, "{stage:?} {label}: rank {rank}'s losses");
                assert_eq!(b.1, w.1, "{stage:?} {label}: rank {rank}'s weights");
            }
        }
        let _ = std::fs::remove_dir_all(&swap);
        let _ = std::fs::remove_dir_all(&ckpt);
    }
}

#[test]
fn the_memory_report_puts_the_state_on_nvme() {
    let dir = scratch("report");
    let reports = on_ranks(1, |_, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let mut out = Vec::new();
        for offload in [OptimizerOffload::Cpu { threads: 1 }, nvme(&dir)] {
            let s = settings(Stage::Zero2, PrecisionSettings::bf16(), offload);
            let (model, mut optim) =
                zero_burn::initialize_settings(s, Net::<AB>::whole(&device), group.clone(), comm.clone())
                    .expect("init");
            let x = rows::<AB>(0..ROWS, 4, 0, &device).cast(burn::tensor::DType::BF16);
            let y = rows::<AB>(0..ROWS, 3, 5, &device).cast(burn::tensor::DType::BF16);
            let loss = model.loss(x, y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            optim.try_step(0.01, model, grads).expect("step");
            // The swap files, while the optimizer holds them.
            let files = std::fs::read_dir(&dir).map_or(0, |d| d.count());
            out.push((optim.memory(), files));
        }
        out
    })
    .remove(0);
    let (reports, files): (Vec<_>, Vec<_>) = reports.into_iter().unzip();
    assert_eq!(files, vec![0, 1], "one swap file for the rank, under nvme only");
    let (host, nv) = (&reports[0], &reports[1]);
    assert!(host.master_weights.current > 0 && host.locations.master_weights.host == host.master_weights.current);
    assert_eq!(nv.master_weights.current, 0, "nvme: no masters in memory");
    assert_eq!(nv.locations.master_weights.nvme, host.master_weights.current);
    assert_eq!(nv.locations.optimizer_state.nvme, host.optimizer_state.current);
    // In memory: the streaming buffers (2 buffers of 29 elements of the master and Adam's two
    // moments), not the state (on a model this small they are the larger).
    assert!(
        nv.locations.optimizer_state.host >= 2 * 29 * 3 * 4,
        "{:?}",
        nv.locations
    );
    let _ = std::fs::remove_dir_all(&dir);
}
