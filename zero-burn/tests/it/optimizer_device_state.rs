//! `ZeroOptimizer`'s device state against its host state: stages 0-2 at world sizes 1, 2 and 4,
//! with two micro-batches accumulated by Burn's `GradientsAccumulator` and clipping, in fp32,
//! bf16 and fp16; a poisoned (NaN) micro-batch; the memory report; a parameter without
//! gradient; SGD, Lion and LAMB.
//!
//! Reference: `ZeroOptimizer` with its host state (`offload_optimizer` cpu: fp32 masters and
//! Adam moments in host memory, the fused CPU Adam), with the same settings, the same model,
//! the same data and the same Burn loop. The host state is `EngineCore`, which exactness.rs
//! tests against plain Burn AdamW on one thread (as it tests the device state), so agreement
//! here carries that reference over. Every run asserts where its state lives
//! (`tensor_state()`), so that a comparison cannot compare a path with itself. Both states
//! receive the same accumulated gradients and reduce them through the same thread group in the
//! same order, so the gradients they average are the same; what differs is
//! - Adam: the host's SIMD kernel fuses its multiply-adds (one rounding each), the device's
//!   Burn ops round the multiply and the add apart: about one f32 rounding (6e-8 relative) per
//!   operation and step, in the update only;
//! - the gradient norm: f32 sums on the device in another order than the host's f64 sums,
//!   about 1e-7 relative, which moves the clip factor by as much (and from the second step on,
//!   the gradients of weights already 1e-7 apart differ by as much again).
//!
//! After 5 steps of lr 0.01 on weights of magnitude 0.3 these give differences around 1e-7 of
//! the largest weight; the fp32 tolerance is 1e-5 (max |a - b| / max |b|, and the norms'
//! relative difference), a hundred times the expected and a thousand times below the effect of
//! one missing or doubled step (the check that the weights moved by more than 1e-2 makes sure).
//! Measured: weights 1.8e-7 to 4.5e-7, norms 1e-7 to 1.3e-6.
//!
//! Under bf16 and fp16 the model holds its masters rounded to 8 (11) significant bits: a master
//! a few f32 ulps from a rounding boundary may round the other way in one state, so a few
//! elements differ by a rounding step, at most 2^-7 (2^-10) of the largest weight (one step of
//! the top binade). The tolerance is that step, and at most 10 % of the elements may differ at
//! all (a real fault, such as a wrong average or a skipped step, moves nearly all of them).
//! Measured: no element differs in the bf16 and fp16 runs here, nor under SGD and Lion (fp32).
//! LAMB's norms are f32 sums on the device, f64 on the host, as the gradient norm's.

use crate::common;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, ElementConversion};
use common::*;
use zero_burn::{
    ComputeDtype, EngineSettings, NonFinitePolicy, OptimizerOffload, PrecisionSettings, Stage, StepReport, ZeroError,
    ZeroOptimizer,
};
use zero_core::loss_scaler::LossScalerConfig;
use zero_core::optim::{LambSpec, LionSpec, OptimizerSpec, SgdSpec};
use zero_test_support::max_relative_error;

const STEPS: usize = 5;
const BLOCKS: usize = 3;
/// Micro-batches per step, accumulated by Burn's `GradientsAccumulator`.
const GAS: usize = 2;
const LR: f64 = SMALL_BUCKET_LR;

fn settings(stage: Stage, clip: f64, precision: PrecisionSettings) -> EngineSettings {
    small_bucket_settings(stage, GAS, clip, precision)
}

/// Where the optimizer keeps its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `offload_optimizer` cpu: `EngineCore` in host memory.
    Host,
    /// No offload: `DeviceState` on the model's device.
    Device,
}

/// A `ZeroOptimizer` of `kind` over `group` (the host kind offloads the optimizer to the CPU).
fn optimizer(
    kind: Kind,
    mut settings: EngineSettings,
    group: std::sync::Arc<dyn zero_core::comm::ProcessGroup>,
) -> ZeroOptimizer {
    if kind == Kind::Host {
        settings.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
    }
    ZeroOptimizer::new(settings, group).expect("optimizer")
}

/// Asserts that `optim`'s state lives where `kind` says.
fn assert_kind(optim: &ZeroOptimizer, kind: Kind) {
    assert_eq!(
        optim.tensor_state(),
        Some(kind == Kind::Device),
        "{kind:?}: the state lives elsewhere"
    );
}

/// One step of Burn's loop: `GAS` micro-batches of rank `rank`'s rows of batch `step`, each
/// loss noted, scaled (fp16) and averaged over the micro-batches, the gradients accumulated;
/// then the optimizer's step. `poison`: the inputs are all NaN. Returns the new model (or the
/// step's error) and the micro-batches' loss values.
fn step(
    optim: &mut ZeroOptimizer,
    model: Net<B>,
    step: usize,
    (rank, world): (usize, usize),
    poison: bool,
) -> (Result<Net<B>, ZeroError>, Vec<f32>) {
    let device = Default::default();
    let dtype = model.ends.input.weight.val().dtype();
    let mut accumulator = GradientsAccumulator::new();
    let mut losses = Vec::new();
    for micro in 0..GAS {
        let (mut x, y) = batch::<B>(step, rows(rank, world, micro, GAS), &device);
        if poison {
            x = x.zeros_like().add_scalar(f32::NAN);
        }
        let loss = model.loss(x.cast(dtype), y.cast(dtype));
        let value: f32 = loss.clone().into_scalar().elem();
        optim.note_loss(value as f64);
        losses.push(value);
        let grads = optim.scale_loss(loss).div_scalar(GAS as f64).backward();
        accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
    }
    (optim.try_step(LR, model, accumulator.grads()), losses)
}

/// What one rank ended with: the weights, and every step's report and micro-batch losses.
struct Run {
    values: Vec<Vec<f32>>,
    reports: Vec<StepReport>,
    losses: Vec<f32>,
}

/// Trains `Net` for `STEPS` steps on `world` ranks with a state of `kind`; the inputs of rank
/// `poison.1` at step `poison.0` (0-based) are all NaN.
fn train(kind: Kind, settings: EngineSettings, world: usize, poison: Option<(usize, usize)>) -> Vec<Run> {
    on_ranks(world, move |rank, group| {
        let dtype = settings.precision.dtype.burn();
        let mut optim = optimizer(kind, settings.clone(), group);
        let mut model = optim
            .synchronize::<B, _>(Net::<B>::new(&Default::default(), BLOCKS))
            .expect("synchronize");
        let (mut reports, mut losses) = (Vec::new(), Vec::new());
        for s in 0..STEPS {
            let (next, l) = step(&mut optim, model, s, (rank, world), poison == Some((s, rank)));
            model = next.expect("step");
            losses.extend(l);
            reports.push(optim.last_step().expect("a step report"));
            assert_kind(&optim, kind);
        }
        let mut dtypes = Vec::new();
        use burn::module::{Module, ModuleVisitor, Param};
        struct Dtypes<'a>(&'a mut Vec<DType>);
        impl ModuleVisitor<B> for Dtypes<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<burn::tensor::Tensor<B, D>>) {
                self.0.push(p.val().dtype());
            }
        }
        model.visit(&mut Dtypes(&mut dtypes));
        assert!(
            dtypes.iter().all(|&d| d == dtype),
            "{kind:?}: parameters are {dtypes:?}, not {dtype:?}"
        );
        Run {
            values: values::<B, _>(&model),
            reports,
            losses,
        }
    })
}

/// The largest difference between `got` and `want` in units of the last place of the element
/// (for `bits` significant bits), and how many elements differ at all.
fn half_ulps(got: &[Vec<f32>], want: &[Vec<f32>], bits: i32) -> (f64, usize, usize) {
    let (mut worst, mut differing, mut total) = (0.0f64, 0, 0);
    for (a, b) in got.iter().flatten().zip(want.iter().flatten()) {
        total += 1;
        if a != b {
            differing += 1;
            let magnitude = a.abs().max(b.abs()) as f64;
            let ulp = 2f64.powi(magnitude.log2().floor() as i32 - (bits - 1));
            worst = worst.max((a - b).abs() as f64 / ulp);
        }
    }
    (worst, differing, total)
}

/// Compares the device state's run with the host state's, rank by rank; returns the host
/// state's runs.
fn compare(
    label: &str,
    settings: EngineSettings,
    world: usize,
    tolerance: f64,
    poison: Option<(usize, usize)>,
) -> Vec<Run> {
    let half = settings.precision.dtype != ComputeDtype::F32;
    let bits = match settings.precision.dtype {
        ComputeDtype::Bf16 => 8,
        ComputeDtype::F16 => 11,
        ComputeDtype::F32 => 24,
    };
    let want = train(Kind::Host, settings.clone(), world, poison);
    let got = train(Kind::Device, settings, world, poison);
    let (mut worst, mut worst_norm) = (0.0f64, 0.0f64);
    for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.reports.len(), STEPS, "{label}: rank {rank} steps");
        for (a, b) in g.reports.iter().zip(&w.reports) {
            assert_eq!(
                (a.step, a.skipped, a.loss_scale, a.lr),
                (b.step, b.skipped, b.loss_scale, b.lr),
                "{label}: rank {rank}"
            );
            if !b.skipped {
                let rel = (a.grad_norm - b.grad_norm).abs() / b.grad_norm;
                worst_norm = worst_norm.max(rel);
                assert!(
                    rel < tolerance,
                    "{label}: step {} norm {} vs host {}",
                    a.step,
                    a.grad_norm,
                    b.grad_norm
                );
            }
        }
        // A 16-bit loss is itself rounded: a weight one ulp apart may move it by one ulp of
        // the loss, hence the margin of 4.
        for (a, b) in g.losses.iter().zip(&w.losses).filter(|(_, b)| b.is_finite()) {
            let rel = ((a - b) / b).abs() as f64;
            assert!(rel < 4.0 * tolerance, "{label}: loss {a} vs host {b}");
        }
        let err = max_relative_error(&format!("{label}: rank {rank}"), &g.values, &w.values);
        worst = worst.max(err);
        let (ulps, differing, total) = half_ulps(&g.values, &w.values, bits);
        println!(
            "{label}: rank {rank}: max {ulps} ulps of the element, {differing} of {total} differ, max rel {err:e}"
        );
        assert!(
            err < tolerance,
            "{label}: rank {rank}: max relative error {err:e} (tolerance {tolerance:e})"
        );
        if half {
            assert!(
                differing * 10 <= total,
                "{label}: rank {rank}: {differing} of {total} elements differ (rounding flips touch a few)"
            );
        }
        assert_eq!(g.values, got[0].values, "{label}: every rank holds the same weights");
    }
    // The runs trained: the weights moved far beyond the tolerance.
    let initial = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    assert!(
        max_relative_error(&format!("{label}: the initial weights"), &initial, &want[0].values) > 1e-2,
        "{label}: the reference did not train"
    );
    println!("{label}: max relative error {worst:e}, of the gradient norm {worst_norm:e}");
    want
}

#[test]
fn fp32_stages_0_1_2_worlds_1_2_4_with_accumulation_and_clipping_match_the_host_state() {
    // A clip of 0.05 is below every step's norm (asserted below), so clipping acts each step.
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for world in [1, 2, 4] {
            let s = settings(stage, 0.05, PrecisionSettings::fp32());
            let host = compare(&format!("fp32 {stage:?} world {world}"), s, world, 1e-5, None);
            let norms: Vec<f64> = host[0].reports.iter().map(|r| r.grad_norm).collect();
            assert!(norms.iter().all(|&n| n > 0.05), "clipping must act: norms {norms:?}");
        }
    }
}

#[test]
fn bf16_stages_and_worlds_match_the_host_state() {
    // One bf16 rounding step of the largest weights' binade: see the header.
    for (stage, world) in [(Stage::Zero2, 2), (Stage::Zero1, 4), (Stage::Zero0, 1)] {
        let s = settings(stage, 0.05, PrecisionSettings::bf16());
        compare(&format!("bf16 {stage:?} world {world}"), s, world, 2f64.powi(-7), None);
    }
}

#[test]
fn fp16_with_the_dynamic_loss_scaler_matches_the_host_state() {
    // An initial scale of 2^19 overflows fp16 gradients at first: the first steps are skipped
    // in both states, with the same scale sequence (asserted in `compare`).
    let scaler = LossScalerConfig {
        initial_scale_power: 19,
        hysteresis: 1,
        ..Default::default()
    };
    let s = settings(Stage::Zero2, 0.05, PrecisionSettings::fp16(scaler));
    let host = compare("fp16 Zero2 world 2", s, 2, 2f64.powi(-10), None);
    assert!(
        host[0].reports.iter().any(|r| r.skipped),
        "the scaler must skip a step here"
    );
    let applied = host[0].reports.iter().filter(|r| !r.skipped).count();
    assert!(applied > 0, "and apply some");
    println!("fp16: {applied} of {STEPS} steps applied");
}

#[test]
fn a_non_finite_micro_batch_is_skipped_on_every_rank_as_by_the_host_state() {
    // The NaN micro-batch of rank 1 at step 2 (0-based) makes step 3 a skipped step on both
    // ranks (asserted against the host state's reports in `compare`), and training goes on to
    // the host state's weights. fp16: the loss scaler skips it (an initial scale of 2^8 that
    // overflows nothing else) and backs the scale off; bf16 under `NonFinitePolicy::Skip`.
    let scaler = LossScalerConfig {
        initial_scale_power: 8,
        hysteresis: 1,
        ..Default::default()
    };
    let fp16 = settings(Stage::Zero2, 0.05, PrecisionSettings::fp16(scaler));
    let mut bf16 = settings(Stage::Zero1, 0.05, PrecisionSettings::bf16());
    bf16.precision.non_finite = NonFinitePolicy::Skip;
    for (label, s, tolerance) in [("fp16 skip", fp16, 2f64.powi(-10)), ("bf16 skip", bf16, 2f64.powi(-7))] {
        let host = compare(label, s, 2, tolerance, Some((2, 1)));
        for (rank, run) in host.iter().enumerate() {
            let skipped: Vec<bool> = run.reports.iter().map(|r| r.skipped).collect();
            assert_eq!(skipped, [false, false, true, false, false], "{label}: rank {rank}");
        }
    }
}

#[test]
fn a_non_finite_fp32_or_bf16_step_fails_on_every_rank_naming_the_rank_as_the_host_state() {
    // Reference: the host state's error, rank by rank (rank 1 saw its loss NaN; rank 0 the
    // averaged gradient, which the NaN reached). Both states refuse the step on both ranks.
    for precision in [PrecisionSettings::fp32(), PrecisionSettings::bf16()] {
        let run = |kind: Kind| {
            let precision = precision.clone();
            on_ranks(2, move |rank, group| {
                let s = settings(Stage::Zero1, 0.0, precision.clone());
                let mut optim = optimizer(kind, s, group);
                let model = optim
                    .synchronize::<B, _>(Net::<B>::new(&Default::default(), 1))
                    .expect("synchronize");
                let err = step(&mut optim, model, 0, (rank, 2), rank == 1)
                    .0
                    .expect_err("the step fails");
                assert_kind(&optim, kind);
                let ZeroError::NonFinite { step, rank: seen, .. } = &err else {
                    panic!("{kind:?} rank {rank}: {err}")
                };
                assert_eq!((*step, optim.global_step()), (1, 1), "{kind:?} rank {rank}: {err}");
                (err.to_string(), *seen)
            })
        };
        let (want, got) = (run(Kind::Host), run(Kind::Device));
        println!("{:?}: {got:?}", precision.dtype);
        assert_eq!(got, want, "{:?}", precision.dtype);
        let (text, seen) = &got[1];
        assert_eq!(*seen, 1, "{text}");
        assert!(text.contains("the loss") && text.contains("rank 1"), "{text}");
    }
}

#[test]
fn memory_report_counts_the_same_model_states_as_the_host_state_on_the_device() {
    // Reference: the host state's counts (checked against the ZeRO formulas in zero_formulas.rs) for
    // parameters, fp32 masters and Adam state, and the formulas themselves: 2Ψ bytes of bf16
    // parameters, 4Ψ of masters and 8Ψ of Adam state at stage 0; at stage 1 on 4 ranks the
    // masters and the state are a quarter of that plus padding. The device state's masters and
    // moments are counted on the device, the host state's in host memory.
    let count = |kind: Kind, stage: Stage| {
        on_ranks(4, move |rank, group| {
            let mut optim = optimizer(kind, settings(stage, 0.0, PrecisionSettings::bf16()), group);
            let model = optim
                .synchronize::<B, _>(Net::<B>::new(&Default::default(), BLOCKS))
                .expect("synchronize");
            step(&mut optim, model, 0, (rank, 4), false).0.expect("step");
            assert_kind(&optim, kind);
            optim.memory()
        })
        .remove(0)
    };
    let counts = |m: &zero_burn::MemoryReport| {
        (
            m.parameters.current,
            m.master_weights.current,
            m.optimizer_state.current,
        )
    };
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        let (device, host) = (count(Kind::Device, stage), count(Kind::Host, stage));
        assert_eq!(counts(&device), counts(&host), "{stage:?}");
        let l = device.locations;
        assert_eq!(
            (l.master_weights.device, l.optimizer_state.device, l.master_weights.host),
            (device.master_weights.current, device.optimizer_state.current, 0),
            "{stage:?}: the device state is on the device"
        );
        let l = host.locations;
        assert_eq!(
            (l.master_weights.host, l.optimizer_state.host, l.master_weights.device),
            (host.master_weights.current, host.optimizer_state.current, 0),
            "{stage:?}: the host state is in host memory"
        );
    }
    let (params, zero0_master, zero0_state) = counts(&count(Kind::Device, Stage::Zero0));
    let (_, zero1_master, zero1_state) = counts(&count(Kind::Device, Stage::Zero1));
    assert_eq!(params, psi(BLOCKS) * 2, "bf16 parameters");
    assert_eq!(zero0_master, psi(BLOCKS) * 4);
    assert_eq!(zero0_state, psi(BLOCKS) * 8);
    // Sharded: a quarter each, plus each group's padding to a multiple of 4 ranks × 16.
    assert!(zero1_master * 4 >= zero0_master, "{zero1_master} vs {zero0_master}");
    assert!(zero1_master * 2 < zero0_master, "{zero1_master} vs {zero0_master}");
    assert_eq!(zero1_state, 2 * zero1_master);
}

/// `Net` beside a layer the loss never uses.
#[derive(burn::module::Module, Debug)]
struct WithSpare<B: burn::tensor::backend::Backend> {
    net: Net<B>,
    spare: burn::nn::Linear<B>,
}

/// `WithSpare` with deterministic weights: `Net`'s, and a smooth function for the spare layer.
fn with_spare(device: &burn::backend::flex::FlexDevice) -> WithSpare<B> {
    let model = WithSpare {
        net: Net::<B>::new(device, 1),
        spare: burn::nn::LinearConfig::new(4, 3).init(device),
    };
    let mut current = Vec::new();
    zero_burn::params::read_values::<B, _>(&model, |_, v| current.push(v));
    let spare = current.len() - 2;
    zero_burn::params::write_values(model, device, true, |i| {
        if i < spare {
            current[i].clone()
        } else {
            (0..current[i].len()).map(|k| 0.1 + 0.05 * k as f32).collect()
        }
    })
}

#[test]
fn a_parameter_without_gradient_is_stepped_with_zeros_as_by_the_host_state() {
    // Reference: the host state, which gives such a parameter a zero gradient; AdamW's decay
    // still moves it (by lr·wd per step, relative), and so must the device state. At bucket
    // size 100 the spare layer's weight (12) and bias (3) share a group without any gradient.
    let run = |kind: Kind| {
        on_ranks(2, move |rank, group| {
            let device = Default::default();
            let mut optim = optimizer(kind, settings(Stage::Zero2, 0.0, PrecisionSettings::fp32()), group);
            let mut model = with_spare(&device);
            let (x, y) = batch::<B>(0, rows(rank, 2, 0, 1), &device);
            for _ in 0..3 {
                let grads = GradientsParams::from_grads(model.net.loss(x.clone(), y.clone()).backward(), &model);
                model = optim.try_step(LR, model, grads).expect("step");
            }
            assert_kind(&optim, kind);
            values::<B, _>(&model)
        })
        .remove(0)
    };
    let want = run(Kind::Host);
    let got = run(Kind::Device);
    let err = max_relative_error("spare: device against host state", &got, &want);
    println!("spare: max relative error {err:e}");
    assert!(err < 1e-5, "max relative error {err:e}");
    // The spare layer's weight (second to last parameter) moved by the decay alone: three
    // steps of p·(1 - lr·wd), with lr 0.01 and wd 0.01 (f64 reference).
    let initial = values::<B, _>(&with_spare(&Default::default()));
    let spare = want.len() - 2;
    for (k, (&p, &p0)) in got[spare].iter().zip(&initial[spare]).enumerate() {
        let decayed = p0 as f64 * (1.0 - LR * 0.01f64).powi(3);
        assert!((p as f64 - decayed).abs() < 1e-7, "spare[{k}] = {p}, decayed {decayed}");
    }
    assert_ne!(initial[0], want[0], "the used parameters trained");
}

#[test]
fn sgd_lion_and_lamb_on_the_device_match_the_host_state() {
    // SGD (momentum 0.9), Lion and LAMB against the host state as Adam is (`compare` asserts
    // where each state lives). Lion's update is a sign, the same ±lr in both states unless a
    // rounding flips a sign near zero (none here). LAMB's trust ratio is per tensor: at stage 1
    // and 2 on 2 and 4 ranks tensors are cut between ranks, whose norms both states sum over
    // them (the device state through the device collective).
    let sgd = OptimizerSpec::Sgd(SgdSpec {
        lr: LR,
        momentum: 0.9,
        ..Default::default()
    });
    let lion = OptimizerSpec::Lion(LionSpec {
        lr: LR,
        ..Default::default()
    });
    let lamb = OptimizerSpec::Lamb(LambSpec {
        lr: LR,
        weight_decay: 0.01,
        ..Default::default()
    });
    let runs = [
        ("SGD", sgd, Stage::Zero1, 2),
        ("Lion", lion, Stage::Zero1, 2),
        ("LAMB", lamb.clone(), Stage::Zero0, 2),
        ("LAMB", lamb.clone(), Stage::Zero1, 2),
        ("LAMB", lamb, Stage::Zero2, 4),
    ];
    for (name, spec, stage, world) in runs {
        // Unclipped: clipped at 0.05, SGD would move the weights less than `compare` asks.
        let mut s = settings(stage, 0.0, PrecisionSettings::fp32());
        s.optimizer = spec;
        compare(&format!("{name} {stage:?} world {world}"), s, world, 1e-5, None);
    }
}
