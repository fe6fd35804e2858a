//! The device engine against the host engine: stages 0-2 at world sizes 1, 2 and 4, with
//! gradient accumulation and clipping, in fp32, bf16 and fp16; and the settings it refuses.
//!
//! Reference: `ZeroEngine` with the same settings, the same model and the same data. The host
//! engine is itself tested against plain Burn AdamW on one thread (exactness.rs), so agreement
//! here carries that reference over. Both engines reduce through the same thread group, in the
//! same order, so the gradients they average are the same; what differs is
//! - Adam: the host's SIMD kernel fuses its multiply-adds (one rounding each), the device's
//!   Burn ops round the multiply and the add apart: about one f32 rounding (6e-8 relative) per
//!   operation and step, in the update only;
//! - the gradient norm: f32 sums on the device in another order than the host's f64 sums,
//!   about 1e-7 relative, which moves the clip factor by as much.
//!
//! After 5 steps of lr 0.01 on weights of magnitude 0.3 these give differences around 1e-7 of
//! the largest weight; the fp32 tolerance is 1e-5 (max |a - b| / max |b|), a hundred times the
//! expected and a thousand times below the effect of one missing or doubled step (the check
//! that the weights moved by more than 1e-2 makes sure). Measured: 2e-7 to 5e-7.
//!
//! Under bf16 and fp16 the model holds its masters rounded to 8 (11) significant bits: a master
//! a few f32 ulps from a rounding boundary may round the other way on one engine, so a few
//! elements differ by a rounding step, at most 2^-7 (2^-10) of the largest weight (one step of
//! the top binade). The tolerance is that step, and at most 10 % of the elements may differ at
//! all (a real fault, such as a wrong average or a skipped step, moves nearly all of them).
//! Measured: bf16 14 of 672 elements differ, by 5.9e-3 of the largest weight at most (one step
//! of the top binade); fp16 none.

mod common;

use burn::tensor::DType;
use common::*;
use std::sync::Arc;
use zero_burn::{
    DeviceCollective, DeviceEngine, EngineSettings, HostStaged, NonFinitePolicy, OptimizerOffload, ParamOffload,
    PrecisionSettings, Stage, StepReport, ZeroEngine, ZeroError,
};
use zero_core::loss_scaler::LossScalerConfig;
use zero_core::optim::OptimizerSpec;

const STEPS: usize = 5;
const BLOCKS: usize = 3;
const LR: f64 = SMALL_BUCKET_LR;

fn settings(stage: Stage, gas: usize, clip: f64, precision: PrecisionSettings) -> EngineSettings {
    small_bucket_settings(stage, gas, clip, precision)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Host,
    Device,
}

/// What one rank ended with: the weights, and every step's report.
struct Run {
    values: Vec<Vec<f32>>,
    reports: Vec<StepReport>,
    losses: Vec<f32>,
}

/// Trains `Net` for `STEPS` steps on `world` ranks with the host or the device engine.
fn train(kind: Kind, settings: EngineSettings, world: usize) -> Vec<Run> {
    train_poisoned(kind, settings, world, None)
}

/// [`train`], with the inputs of rank `poison.1` at step `poison.0` (0-based) all NaN.
fn train_poisoned(kind: Kind, settings: EngineSettings, world: usize, poison: Option<(usize, usize)>) -> Vec<Run> {
    on_ranks(world, move |rank, group| {
        let device = Default::default();
        let gas = settings.gradient_accumulation_steps;
        let dtype = settings.precision.dtype.burn();
        let model = Net::<B>::new(&device, BLOCKS);
        let mut host = None;
        let mut dev = None;
        match kind {
            Kind::Host => host = Some(ZeroEngine::new(settings.clone(), model, group).expect("host engine")),
            Kind::Device => {
                let comm: Arc<dyn DeviceCollective<_>> = Arc::new(HostStaged::new(group));
                dev = Some(DeviceEngine::new(settings.clone(), model, comm).expect("device engine"));
            }
        }
        let mut reports = Vec::new();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            for micro in 0..gas {
                let (mut x, y) = batch::<B>(step, rows(rank, world, micro, gas), &device);
                if poison == Some((step, rank)) {
                    x = x.zeros_like().add_scalar(f32::NAN);
                }
                let (x, y) = (x.cast(dtype), y.cast(dtype));
                let (loss, report) = match (&mut host, &mut dev) {
                    (Some(e), _) => {
                        let loss = e.forward(|m| m.loss(x, y));
                        (e.backward(loss).expect("backward"), e.step().expect("step"))
                    }
                    (_, Some(e)) => {
                        let loss = e.forward(|m| m.loss(x, y));
                        (e.backward(loss).expect("backward"), e.step().expect("step"))
                    }
                    _ => unreachable!(),
                };
                losses.push(loss);
                assert_eq!(report.is_some(), micro + 1 == gas, "a step exactly at the boundary");
                reports.extend(report);
            }
        }
        let values = match (&host, &dev) {
            (Some(e), _) => values::<B, _>(e.module()),
            (_, Some(e)) => {
                // The model follows the compute dtype.
                use burn::module::{Module, ModuleVisitor, Param};
                let mut dtypes = Vec::new();
                struct Dtypes<'a>(&'a mut Vec<DType>);
                impl ModuleVisitor<B> for Dtypes<'_> {
                    fn visit_float<const D: usize>(&mut self, p: &Param<burn::tensor::Tensor<B, D>>) {
                        self.0.push(p.val().dtype());
                    }
                }
                e.module().visit(&mut Dtypes(&mut dtypes));
                assert!(
                    dtypes.iter().all(|&d| d == dtype),
                    "parameters are {dtypes:?}, not {dtype:?}"
                );
                values::<B, _>(e.module())
            }
            _ => unreachable!(),
        };
        Run {
            values,
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

/// Compares the device engine's run with the host engine's, rank by rank.
fn compare(label: &str, settings: EngineSettings, world: usize, tolerance: f64) -> f64 {
    compare_poisoned(label, settings, world, tolerance, None)
}

/// [`compare`] with a poisoned micro-batch (see [`train_poisoned`]).
fn compare_poisoned(
    label: &str,
    settings: EngineSettings,
    world: usize,
    tolerance: f64,
    poison: Option<(usize, usize)>,
) -> f64 {
    let half = settings.precision.dtype.is_half();
    let half_bits = match settings.precision.dtype {
        zero_burn::ComputeDtype::Bf16 => 8,
        zero_burn::ComputeDtype::F16 => 11,
        zero_burn::ComputeDtype::F32 => 24,
    };
    let want = train_poisoned(Kind::Host, settings.clone(), world, poison);
    let got = train_poisoned(Kind::Device, settings, world, poison);
    let mut worst = 0.0f64;
    for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.reports.len(), STEPS, "{label}: rank {rank} steps");
        for (a, b) in g.reports.iter().zip(&w.reports) {
            assert_eq!(
                (a.step, a.skipped, a.loss_scale),
                (b.step, b.skipped, b.loss_scale),
                "{label}"
            );
            assert_eq!(a.lr, b.lr, "{label}");
            if !b.skipped {
                let rel = (a.grad_norm - b.grad_norm).abs() / b.grad_norm;
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
        let err = max_relative_error(&g.values, &w.values);
        worst = worst.max(err);
        let (ulps, differing, total) = half_ulps(&g.values, &w.values, half_bits);
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
        max_relative_error(&initial, &want[0].values) > 1e-2,
        "{label}: the reference did not train"
    );
    println!("{label}: max relative error {worst:e}");
    worst
}

#[test]
fn fp32_stages_0_1_2_worlds_1_2_4_with_accumulation_and_clipping_match_the_host_engine() {
    // A clip of 0.05 is below every step's norm (asserted below), so clipping acts each step.
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for world in [1, 2, 4] {
            let s = settings(stage, 2, 0.05, PrecisionSettings::fp32());
            compare(&format!("fp32 {stage:?} world {world}"), s, world, 1e-5);
        }
    }
    let host = train(
        Kind::Host,
        settings(Stage::Zero0, 2, 0.05, PrecisionSettings::fp32()),
        1,
    );
    assert!(
        host[0].reports.iter().all(|r| r.grad_norm > 0.05),
        "clipping must act: norms {:?}",
        host[0].reports.iter().map(|r| r.grad_norm).collect::<Vec<_>>()
    );
}

#[test]
fn bf16_stages_and_worlds_match_the_host_engine() {
    // One bf16 rounding step of the largest weights' binade: see the header.
    for (stage, world) in [(Stage::Zero2, 2), (Stage::Zero1, 4), (Stage::Zero0, 1)] {
        let s = settings(stage, 2, 0.05, PrecisionSettings::bf16());
        compare(&format!("bf16 {stage:?} world {world}"), s, world, 2f64.powi(-7));
    }
}

#[test]
fn fp16_with_the_dynamic_loss_scaler_matches_the_host_engine() {
    // An initial scale of 2^19 overflows fp16 gradients at first: the first steps are skipped
    // on both engines, with the same scale sequence (asserted in `compare`).
    let s = settings(
        Stage::Zero2,
        2,
        0.05,
        PrecisionSettings::fp16(LossScalerConfig {
            initial_scale_power: 19,
            hysteresis: 1,
            ..Default::default()
        }),
    );
    let host = train(Kind::Host, s.clone(), 2);
    assert!(
        host[0].reports.iter().any(|r| r.skipped),
        "the scaler must skip a step here"
    );
    assert!(host[0].reports.iter().any(|r| !r.skipped), "and apply some");
    compare("fp16 Zero2 world 2", s, 2, 2f64.powi(-10));
    let applied = host[0].reports.iter().filter(|r| !r.skipped).count();
    println!("fp16: {applied} of {STEPS} steps applied");
}

#[test]
fn a_non_finite_micro_batch_is_skipped_or_fails_on_every_rank_as_on_the_host_engine() {
    // Skip: the NaN batch of rank 1 at step 2 makes step 3 (1-based) a skipped step on both
    // ranks (asserted against the host engine's reports in `compare`), and training goes on
    // to the host engine's weights.
    let mut s = settings(Stage::Zero2, 2, 0.05, PrecisionSettings::bf16());
    s.precision.non_finite = NonFinitePolicy::Skip;
    let host = train_poisoned(Kind::Host, s.clone(), 2, Some((2, 1)));
    assert!(
        host.iter().all(|r| r.reports[2].skipped),
        "the host engine skips step 3"
    );
    compare_poisoned("bf16 skip", s, 2, 2f64.powi(-7), Some((2, 1)));

    // Error: the step fails on both ranks, naming what each saw.
    let out = on_ranks(2, |rank, group| {
        let device = Default::default();
        let s = settings(Stage::Zero1, 1, 0.0, PrecisionSettings::bf16());
        let comm: Arc<dyn DeviceCollective<_>> = Arc::new(HostStaged::new(group));
        let mut engine = DeviceEngine::new(s, Net::<B>::new(&device, 1), comm).expect("engine");
        let (mut x, y) = batch::<B>(0, rows(rank, 2, 0, 1), &device);
        if rank == 1 {
            x = x.zeros_like().add_scalar(f32::NAN);
        }
        let loss = engine.forward(|m| m.loss(x.cast(DType::BF16), y.cast(DType::BF16)));
        engine.backward(loss).expect("backward");
        let err = engine.step().unwrap_err();
        (
            err.to_string(),
            matches!(err, ZeroError::NonFinite { step: 1, .. }),
            engine.skipped_steps(),
        )
    });
    for (rank, (text, non_finite, skipped)) in out.into_iter().enumerate() {
        assert!(non_finite, "rank {rank}: {text}");
        assert_eq!(skipped, 1, "rank {rank}");
        if rank == 1 {
            assert!(text.contains("the loss"), "{text}");
        }
    }
}

#[test]
fn memory_report_counts_the_same_model_states_as_the_host_engine() {
    // Reference: the host engine's counts (checked against the ZeRO formulas in memory.rs) for
    // parameters, fp32 masters and Adam state, and the formulas themselves: 2Ψ bytes of bf16
    // parameters, 4Ψ of masters and 8Ψ of Adam state at stage 0; at stage 1 on 4 ranks the
    // masters and the state are a quarter of that plus padding.
    let count = |kind: Kind, stage: Stage| {
        on_ranks(4, move |_, group| {
            let s = settings(stage, 1, 0.0, PrecisionSettings::bf16());
            let model = Net::<B>::new(&Default::default(), BLOCKS);
            let m = match kind {
                Kind::Host => ZeroEngine::new(s, model, group).expect("host").memory(),
                Kind::Device => {
                    let comm: Arc<dyn DeviceCollective<_>> = Arc::new(HostStaged::new(group));
                    DeviceEngine::new(s, model, comm).expect("device").memory()
                }
            };
            (
                m.parameters.current,
                m.master_weights.current,
                m.optimizer_state.current,
            )
        })
        .remove(0)
    };
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        assert_eq!(count(Kind::Device, stage), count(Kind::Host, stage), "{stage:?}");
    }
    let (params, zero0_master, zero0_state) = count(Kind::Device, Stage::Zero0);
    let (_, zero1_master, zero1_state) = count(Kind::Device, Stage::Zero1);
    assert_eq!(params, psi(BLOCKS) * 2, "bf16 parameters");
    assert_eq!(zero0_master, psi(BLOCKS) * 4);
    assert_eq!(zero0_state, psi(BLOCKS) * 8);
    // Sharded: a quarter each, plus each group's padding to a multiple of 4 ranks × 16.
    assert!(zero1_master * 4 >= zero0_master, "{zero1_master} vs {zero0_master}");
    assert!(zero1_master * 2 < zero0_master, "{zero1_master} vs {zero0_master}");
    assert_eq!(zero1_state, 2 * zero1_master);
}

fn new_device(settings: EngineSettings) -> Result<(), ZeroError> {
    let group = zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0);
    let comm: Arc<dyn DeviceCollective<_>> = Arc::new(HostStaged::new(group));
    DeviceEngine::<B, _>::new(settings, Net::<B>::new(&Default::default(), 1), comm).map(|_| ())
}

#[test]
fn stage_3_offload_and_other_optimizers_are_refused_with_what_to_use() {
    let err = new_device(settings(Stage::Zero3, 1, 0.0, PrecisionSettings::fp32())).unwrap_err();
    assert!(matches!(err, ZeroError::Config(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("stage 3") && text.contains("ChainEngine"), "{text}");

    let mut s = settings(Stage::Zero1, 1, 0.0, PrecisionSettings::fp32());
    s.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
    let text = new_device(s).unwrap_err().to_string();
    assert!(
        text.contains("offload_optimizer") && text.contains("ZeroEngine"),
        "{text}"
    );

    let mut s = settings(Stage::Zero2, 1, 0.0, PrecisionSettings::fp32());
    s.offload_param = ParamOffload::Cpu;
    let text = new_device(s).unwrap_err().to_string();
    assert!(text.contains("offload_param") && text.contains("ChainEngine"), "{text}");

    let mut s = settings(Stage::Zero0, 1, 0.0, PrecisionSettings::fp32());
    s.optimizer = OptimizerSpec::Sgd(Default::default());
    let text = new_device(s).unwrap_err().to_string();
    assert!(text.contains("SGD") && text.contains("Adam"), "{text}");

    // And the supported settings build.
    new_device(settings(Stage::Zero2, 2, 1.0, PrecisionSettings::bf16())).expect("stage 2 bf16");
}

#[test]
fn rank_0_weights_are_broadcast_at_construction() {
    // Reference: rank 0's model. Every other rank builds different weights; after
    // construction every rank holds rank 0's (bit for bit: the broadcast copies).
    let out = on_ranks(3, |rank, group| {
        let device = Default::default();
        let mut model = Net::<B>::new(&device, 1);
        if rank > 0 {
            let shapes: Vec<usize> = zero_burn::params::describe::<B, _>(&model)
                .iter()
                .map(|(_, s)| s.numel())
                .collect();
            model = zero_burn::params::write_values(model, &device, true, |i| vec![rank as f32; shapes[i]]);
        }
        let comm: Arc<dyn DeviceCollective<_>> = Arc::new(HostStaged::new(group));
        let engine =
            DeviceEngine::new(settings(Stage::Zero1, 1, 0.0, PrecisionSettings::fp32()), model, comm).expect("engine");
        values::<B, _>(engine.module())
    });
    let want = values::<B, _>(&Net::<B>::new(&Default::default(), 1));
    for v in out {
        assert_eq!(v, want);
    }
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
fn a_parameter_without_gradient_is_stepped_with_zeros_as_on_the_host_engine() {
    // Reference: the host engine, which gives such a parameter a zero gradient; AdamW's decay
    // still moves it (by lr·wd per step, relative), and so must the device engine's.
    let run = |kind: Kind| {
        on_ranks(2, move |rank, group| {
            let device = Default::default();
            let model = with_spare(&device);
            let s = settings(Stage::Zero2, 1, 0.0, PrecisionSettings::fp32());
            let (x, y) = batch::<B>(0, rows(rank, 2, 0, 1), &device);
            match kind {
                Kind::Host => {
                    let mut e = ZeroEngine::new(s, model, group).expect("host");
                    for _ in 0..3 {
                        let loss = e.forward(|m| m.net.loss(x.clone(), y.clone()));
                        e.backward(loss).expect("backward");
                        e.step().expect("step");
                    }
                    values::<B, _>(e.module())
                }
                Kind::Device => {
                    let comm: Arc<dyn DeviceCollective<_>> = Arc::new(HostStaged::new(group));
                    let mut e = DeviceEngine::new(s, model, comm).expect("device");
                    for _ in 0..3 {
                        let loss = e.forward(|m| m.net.loss(x.clone(), y.clone()));
                        e.backward(loss).expect("backward");
                        e.step().expect("step");
                    }
                    values::<B, _>(e.module())
                }
            }
        })
        .remove(0)
    };
    let want = run(Kind::Host);
    let got = run(Kind::Device);
    let err = max_relative_error(&got, &want);
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
