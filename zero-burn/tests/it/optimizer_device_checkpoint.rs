//! Checkpoints of `ZeroOptimizer`'s device state: a run saved after 3 steps and resumed by a
//! fresh optimizer ends where an uninterrupted 5-step run ends, and checkpoints move between the
//! device and the host states and across world sizes.
//!
//! References: the uninterrupted run of the same state (the resumed run must equal it bit for
//! bit: the same operations on the same values), and for the cross-state and cross-world cases
//! the uninterrupted run of the loading state at the loading world size, within
//! optimizer_device_state.rs's tolerance (1e-5 of the largest weight; the two states' Adam and
//! norm round differently, and other world sizes sum the gradients in another order, each about
//! 1e-7; measured 1.3e-7 to 1.8e-7). A resume that lost the Adam moments and the step count
//! ends 8e-2 of the largest weight away (measured by the control in the cross test, which must
//! exceed 1e-3); one that lost the weights starts from other values (the resumed optimizer is
//! handed a model holding other weights).

use crate::common;
use burn::optim::{GradientsAccumulator, GradientsParams};
use common::*;
use std::ops::Range;
use std::path::Path;
use zero_burn::{EngineSettings, OptimizerOffload, PrecisionSettings, Stage, StepReport, ZeroOptimizer};
use zero_core::loss_scaler::LossScalerConfig;
use zero_test_support::max_relative_error;

const BLOCKS: usize = 3;
/// Micro-batches per step, accumulated by Burn's `GradientsAccumulator`.
const GAS: usize = 2;
const LR: f64 = SMALL_BUCKET_LR;

/// A fresh empty directory of this process (removed when dropped).
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("zero-burn-optim-device-ckpt-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// AdamW with clipping at 0.5, in `precision`.
fn settings(stage: Stage, precision: PrecisionSettings) -> EngineSettings {
    let mut s = small_bucket_settings(stage, GAS, 0.5, precision);
    // A schedule, so that a resume that lost its position (the applied steps: skipped fp16
    // steps do not count) would step at the wrong rate.
    s.lr_schedule = Some(std::sync::Arc::new(|step| LR / (1.0 + step as f64)));
    s
}

/// One segment of a run: steps `steps` on `world` ranks with the device state (`device`) or the
/// host state (`offload_optimizer` cpu), starting as `load` says from the checkpoint in `dir`;
/// `save`: saved there after the last step.
struct Segment<'a> {
    world: usize,
    device: bool,
    settings: &'a EngineSettings,
    steps: Range<usize>,
    dir: &'a Path,
    load: Load,
    save: bool,
}

/// How a segment starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    /// From the model's initial weights.
    No,
    /// From the checkpoint.
    Full,
    /// From the checkpoint's weights only, with a fresh optimizer state: a resume that lost the
    /// Adam moments and the step count (the control that the tolerance tells one apart).
    WeightsOnly,
}

/// Rank 0's weights and step reports at the end of `seg`; every rank must hold the same weights.
fn run(seg: Segment) -> (Vec<Vec<f32>>, Vec<StepReport>) {
    let world = seg.world;
    let mut runs = on_ranks(world, |rank, group| {
        let device = Default::default();
        let mut settings = seg.settings.clone();
        if !seg.device {
            settings.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
        }
        let dtype = settings.precision.dtype.burn();
        let fresh = || ZeroOptimizer::new(settings.clone(), group.clone()).expect("optimizer");
        let mut optim = fresh();
        let mut model = if seg.load == Load::No {
            optim
                .synchronize::<B, _>(Net::<B>::new(&device, BLOCKS))
                .expect("synchronize")
        } else {
            // Other weights than the checkpoint's: everything must come from it.
            let sizes: Vec<usize> = zero_burn::params::describe::<B, _>(&Net::<B>::new(&device, BLOCKS))
                .iter()
                .map(|(_, s)| s.numel())
                .collect();
            let other = zero_burn::params::write_values(Net::<B>::new(&device, BLOCKS), &device, true, |i| {
                vec![0.5 + i as f32; sizes[i]]
            });
            let (model, client) = optim.load_checkpoint::<B, _>(seg.dir, None, other).expect("load");
            assert_eq!(client["next_step"], seg.steps.start, "the client state comes back");
            assert_eq!(optim.global_step(), seg.steps.start as u64, "the step count comes back");
            if seg.load == Load::WeightsOnly {
                optim = fresh();
            }
            model
        };
        let mut reports = Vec::new();
        let mut lr = optim.lr_scheduler();
        for step in seg.steps.clone() {
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..GAS {
                let (x, y) = batch::<B>(step, rows(rank, world, micro, GAS), &device);
                let loss = model.loss(x.cast(dtype), y.cast(dtype));
                let grads = optim.scale_loss(loss).div_scalar(GAS as f64).backward();
                accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
            }
            let rate = burn::optim::lr_scheduler::LrScheduler::step(&mut lr);
            model = optim.try_step(rate, model, accumulator.grads()).expect("step");
            reports.push(optim.last_step().expect("a report"));
        }
        assert_eq!(optim.tensor_state(), Some(seg.device), "the state lives elsewhere");
        if seg.save {
            let client = serde_json::json!({ "next_step": seg.steps.end });
            optim.save_checkpoint(seg.dir, None, &client).expect("save");
        }
        (values::<B, _>(&model), reports)
    });
    for (rank, (v, _)) in runs.iter().enumerate() {
        assert_eq!(v, &runs[0].0, "rank {rank} holds rank 0's weights");
    }
    runs.swap_remove(0)
}

/// Rank 0's weights and reports after 5 steps at `world` with the state `device`:
/// uninterrupted (`resume` None), or saved after 3 steps and finished at `resume`'s (world,
/// device) from the checkpoint as its `Load` says.
fn five_steps(
    world: usize,
    device: bool,
    settings: &EngineSettings,
    resume: Option<(usize, bool, Load)>,
) -> (Vec<Vec<f32>>, Vec<StepReport>) {
    let scratch = Scratch::new();
    let dir = scratch.0.as_path();
    let (split, save) = if resume.is_some() { (3, true) } else { (5, false) };
    let (values, mut reports) = run(Segment {
        world,
        device,
        settings,
        steps: 0..split,
        dir,
        load: Load::No,
        save,
    });
    let Some((world, device, load)) = resume else {
        return (values, reports);
    };
    let (values, rest) = run(Segment {
        world,
        device,
        settings,
        steps: split..5,
        dir,
        load,
        save: false,
    });
    reports.extend(rest);
    (values, reports)
}

#[test]
fn device_state_resumes_bit_for_bit() {
    // fp16 with an initial scale of 2^18 skips its first two steps (asserted) and backs the scale
    // off: the resumed run must carry on from the checkpoint's scale, step count and skips.
    let fp16 = PrecisionSettings::fp16(LossScalerConfig {
        initial_scale_power: 18,
        hysteresis: 1,
        ..Default::default()
    });
    let start = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    for (world, stage, precision) in [
        (1, Stage::Zero0, PrecisionSettings::fp32()),
        (2, Stage::Zero1, PrecisionSettings::fp32()),
        (2, Stage::Zero2, PrecisionSettings::fp32()),
        (4, Stage::Zero2, PrecisionSettings::fp32()),
        (2, Stage::Zero2, fp16.clone()),
    ] {
        let label = format!("world {world}, {stage:?}, {:?}", precision.dtype);
        let s = settings(stage, precision);
        let (want, want_reports) = five_steps(world, true, &s, None);
        let (got, got_reports) = five_steps(world, true, &s, Some((world, true, Load::Full)));
        assert_eq!(got, want, "{label}: resumed weights differ");
        let key = |r: &StepReport| (r.step, r.skipped, r.loss_scale, r.grad_norm.to_bits(), r.lr.to_bits());
        let (got_reports, want_reports): (Vec<_>, Vec<_>) = (
            got_reports.iter().map(key).collect(),
            want_reports.iter().map(key).collect(),
        );
        assert_eq!(got_reports, want_reports, "{label}: the steps' reports");
        // The run moved the weights: a resume that lost the state would not match by chance.
        assert!(
            max_relative_error(&format!("{label}: the initial weights"), &want, &start) > 1e-3,
            "{label}: trained"
        );
        if s.precision.loss_scaler.is_some() {
            let skipped: Vec<bool> = want_reports.iter().map(|r| r.1).collect();
            println!("{label}: skipped {skipped:?}");
            assert_eq!(skipped, [true, true, false, false, false], "{label}");
        }
    }
}

#[test]
fn checkpoints_move_between_the_device_and_host_states_and_world_sizes() {
    // (saving world, saving state on the device, loading world, loading state on the device)
    let cases = [
        (2, true, 2, false),
        (2, false, 2, true),
        (2, true, 4, false),
        (4, false, 1, true),
        (1, true, 2, true),
        (4, true, 2, true),
    ];
    for stage in [Stage::Zero1, Stage::Zero2] {
        let s = settings(stage, PrecisionSettings::fp32());
        for (saver_world, saver, loader_world, loader) in cases {
            let (want, _) = five_steps(loader_world, loader, &s, None);
            let (got, _) = five_steps(saver_world, saver, &s, Some((loader_world, loader, Load::Full)));
            let name = |device: bool| if device { "device" } else { "host" };
            let label = format!(
                "{stage:?}: {} state at world {saver_world} -> {} state at world {loader_world}",
                name(saver),
                name(loader)
            );
            let err = max_relative_error(&label, &got, &want);
            println!("{label}: {err:e}");
            assert!(err < 1e-5, "{label}: {err:e}");
        }
        // The control: the same resume without the optimizer's state lands far outside.
        let (want, _) = five_steps(2, true, &s, None);
        let (lost, _) = five_steps(2, true, &s, Some((2, true, Load::WeightsOnly)));
        let err = max_relative_error(&format!("{stage:?}: resumed without the optimizer state"), &lost, &want);
        println!("{stage:?}: resumed without the optimizer state: {err:e}");
        assert!(err > 1e-3, "{stage:?}: losing the moments must show: {err:e}");
    }
}
