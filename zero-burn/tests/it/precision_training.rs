//! bf16 and fp16 training on the `ZeroModule` path (`UnitNet` and `ZeroOptimizer` in Burn's
//! own loop, its state as tensors and in host buffers): the loss curve against fp32, every stage
//! and world size against stage 0, what the collectives move, non-finite values under bf16, the
//! config keys, and a plain Burn module under `ZeroOptimizer` against `UnitNet`.

use crate::common;
use crate::precision_support;
use burn::tensor::DType;
use common::{Net, B};
use precision_support::*;
use std::sync::{Arc, Mutex};
use zero_burn::{ComputeDtype, NonFinitePolicy, PrecisionSettings, Stage};
use zero_core::comm::DType as Flat;
use zero_core::loss_scaler::LossScalerConfig;
use zero_test_support::{max_abs_diff, max_relative_error};

fn fp16() -> PrecisionSettings {
    PrecisionSettings::fp16(LossScalerConfig {
        initial_scale_power: 12,
        ..Default::default()
    })
}

#[test]
fn bf16_and_fp16_follow_the_fp32_loss_curve() {
    // Reference: the same training in fp32 at stage 0 on one rank (60 steps fitting one batch;
    // the loss falls by 1000x).
    // The 16-bit runs differ by rounding: bf16 keeps 8 significant bits (relative step 2^-8 =
    // 0.4%), fp16 11 bits; the loss passes through ~10 rounded operations, so a 16-bit loss is
    // within about 1% of the fp32 loss at the same weights, and the fp32 masters keep the
    // trajectories together. Measured (printed): bf16 0.85% of the initial loss, fp16 0.07%.
    // The tolerance is 2% of the initial loss, and each run must learn as fp32 does.
    const STEPS: usize = 60;
    // One global batch with targets the model can represent: a curve that falls.
    let settings = |stage, precision| {
        let mut s = settings(stage, 1, precision);
        s.lr_schedule = Some(Arc::new(|_| 0.02));
        s
    };
    let want = train_zero_on(
        settings(Stage::Zero0, PrecisionSettings::fp32()),
        1,
        STEPS,
        vec![],
        false,
        Data::Fit,
        plain,
    )
    .remove(0)
    .losses;
    assert!(want[STEPS - 1] < 0.01 * want[0], "the fp32 run must learn: {want:?}");
    for (label, precision, stage, world, host) in [
        ("bf16 stage 0", PrecisionSettings::bf16(), Stage::Zero0, 1, false),
        (
            "bf16 stage 3 world 2",
            PrecisionSettings::bf16(),
            Stage::Zero3,
            2,
            false,
        ),
        ("fp16 stage 0", fp16(), Stage::Zero0, 1, false),
        ("fp16 stage 2 world 2", fp16(), Stage::Zero2, 2, false),
        ("fp16 stage 3 world 2, host", fp16(), Stage::Zero3, 2, true),
    ] {
        let s = settings(stage, precision);
        let runs = train_zero_on(s, world, STEPS, vec![], host, Data::Fit, plain);
        // The global loss: the mean of the ranks' losses (equal row counts).
        let got: Vec<f32> = (0..STEPS)
            .map(|s| runs.iter().map(|r| r.losses[s]).sum::<f32>() / world as f32)
            .collect();
        let worst = max_abs_diff(&format!("{label}: losses"), &got, &want);
        println!(
            "{label}: max |loss - fp32 loss| = {worst:.5} (initial loss {:.4}, final {:.4} vs {:.4})",
            want[0],
            got[STEPS - 1],
            want[STEPS - 1]
        );
        assert!(
            got[STEPS - 1] < 0.01 * want[0],
            "{label}: must learn as fp32 does: {got:?}"
        );
        assert!(
            worst <= 0.02 * f64::from(want[0]),
            "{label}: loss curve deviates by {worst} from fp32's: {got:?} vs {want:?}"
        );
        assert!(
            runs.iter()
                .all(|r| r.steps.iter().all(|s| s.as_ref().map(|r| !r.skipped).unwrap_or(false))),
            "{label}: no step skipped"
        );
    }
}

#[test]
fn bf16_every_stage_and_world_size_agrees_with_stage_0() {
    // Reference: stage 0 at the same world size, and stage 0 on one rank.
    // - Same world size, one micro-batch per step: every stage reduces the same bf16 gradients
    //   with the same kernels (f32 sums in rank order, one rounding), and the update is
    //   element-wise on fp32 masters, so the result must be bit for bit stage 0's.
    // - Other world sizes or accumulation: each rank's bf16 gradient is a mean over other rows,
    //   and accumulators round after each micro-batch, so gradients differ by bf16 rounding
    //   (2^-8 relative). Adam turns that into at most a few percent of a step (lr = 0.01) per
    //   element and step, and the model sees its masters rounded to bf16, where such a
    //   difference can flip the last bit. Over 5 steps that bounds the difference by about two
    //   bf16 ulps of the largest weight: 2 * 2^-8 relative. Training itself moves the weights
    //   by more than 10% of the largest.
    const STEPS: usize = 5;
    let bf16 = PrecisionSettings::bf16;
    let base = train_zero(settings(Stage::Zero0, 1, bf16()), 1, STEPS, vec![], false)
        .remove(0)
        .values
        .remove(STEPS - 1);
    let initial = common::values::<B, _>(&Net::<B>::new(&Default::default(), 3));
    let moved = max_relative_error("bf16 initial weights", &initial, &base);
    println!("bf16 training moved the weights by {moved:e} of the largest");
    assert!(moved > 0.1, "the reference must train");
    // Observed: 1 or 2 ulps (printed); the bound is 4 ulps of the largest weight (0.3-0.4,
    // whose ulp is 2^-9, about max|w| * 2^-7.5), under a tenth of what training moved.
    let rounding = 2f64.powi(-6);
    assert!(rounding < moved / 8.0);
    for world in 1..=4 {
        let stage0 = train_zero(settings(Stage::Zero0, 1, bf16()), world, STEPS, vec![], false);
        let stage0 = &stage0[0].values[STEPS - 1];
        let err = max_relative_error(&format!("bf16 stage 0 world {world}"), stage0, &base);
        println!("bf16 stage 0 world {world} vs world 1: {err:e}");
        assert!(err <= rounding, "stage 0 world {world}: {err:e} from world 1");
        for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for gas in [1, 2] {
                let runs = train_zero(settings(stage, gas, bf16()), world, STEPS, vec![], false);
                for r in &runs[1..] {
                    assert_eq!(r.values, runs[0].values, "{stage:?} world {world}: ranks agree");
                }
                let got = &runs[0].values[STEPS - 1];
                let label = format!("bf16 {stage:?} world {world} gas {gas}");
                if gas == 1 {
                    let diff = max_abs_diff(&label, got, stage0);
                    assert_eq!(diff, 0.0, "{label}: differs from stage 0's bits by up to {diff:e}");
                } else {
                    let err = max_relative_error(&label, got, stage0);
                    println!("{label} vs stage 0 gas 1: {err:e}");
                    assert!(err <= rounding, "{label}: {err:e} from stage 0");
                }
            }
        }
    }
}

/// Every collective rank 0 issued in a 2-step run on 2 ranks, after the initial broadcasts.
fn issued(stage: Stage, precision: PrecisionSettings) -> Vec<Issued> {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    let wrap = move |inner: Arc<dyn zero_core::comm::ProcessGroup>| -> Arc<dyn zero_core::comm::ProcessGroup> {
        let log = if inner.rank() == 0 {
            l.clone()
        } else {
            Arc::new(Mutex::new(Vec::new()))
        };
        Arc::new(Recording { inner, log })
    };
    let mut s = settings(stage, 1, precision);
    s.param_persistence_threshold = 0;
    train_zero_on(s, 2, 2, vec![], false, Data::PerStep, wrap);
    let log = log.lock().unwrap_or_else(|e| e.into_inner()).clone();
    log.into_iter().filter(|i| i.op != "broadcast").collect()
}

fn bytes(log: &[Issued], op: &str) -> usize {
    log.iter().filter(|i| i.op == op).map(|i| i.bytes).sum()
}

/// The model's parameters are 16-bit; a unit's gathers and its gradient's reduce-scatter in
/// backward move 16-bit values (half the bytes of fp32, op for op); `communication_data_type`
/// fp32 reduces the gradients (the units' in their backward, the others' in the optimizer) in
/// fp32 while the units are still gathered in bf16, and fp16 makes stage 0's all-reduce fp16.
#[test]
fn parameters_gathers_and_gradient_reductions_are_16_bit_and_follow_the_communication_dtype() {
    for (precision, dtype, flat) in [
        (PrecisionSettings::bf16(), DType::BF16, Flat::BF16),
        (fp16(), DType::F16, Flat::F16),
        (PrecisionSettings::fp32(), DType::F32, Flat::F32),
    ] {
        for stage in [Stage::Zero0, Stage::Zero3] {
            assert_eq!(
                param_dtypes(&settings(stage, 1, precision.clone())),
                [dtype; 2],
                "{stage:?}: the model's parameters (a replicated layer's, a unit's)"
            );
        }
        let log = issued(Stage::Zero3, precision.clone());
        for op in ["all_gather", "reduce_scatter"] {
            let ops: Vec<_> = log.iter().filter(|i| i.op == op).collect();
            assert!(!ops.is_empty(), "stage 3 issues {op}");
            assert!(ops.iter().all(|i| i.dtype == flat), "{flat:?}: every {op}: {log:?}");
        }
    }
    // Half the bytes of the fp32 run, op for op.
    let full = issued(Stage::Zero3, PrecisionSettings::fp32());
    let half = issued(Stage::Zero3, PrecisionSettings::bf16());
    for op in ["all_gather", "reduce_scatter"] {
        assert_eq!(
            2 * bytes(&half, op),
            bytes(&full, op),
            "{op}: bf16 moves half the bytes"
        );
    }
    // communication_data_type fp32: gradients reduced in fp32, parameters still gathered in bf16.
    let mut p = PrecisionSettings::bf16();
    p.communication_dtype = Some(ComputeDtype::F32);
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let log = issued(stage, p.clone());
        let grads: Vec<_> = log.iter().filter(|i| i.op == "reduce_scatter").collect();
        assert!(
            !grads.is_empty() && grads.iter().all(|i| i.dtype == Flat::F32),
            "{stage:?}: {log:?}"
        );
        let gathers: Vec<_> = log.iter().filter(|i| i.op == "all_gather").collect();
        assert!(gathers.iter().all(|i| i.dtype == Flat::BF16), "{stage:?}: {log:?}");
        if stage >= Stage::Zero2 {
            assert!(!gathers.is_empty(), "{stage:?}: the units are gathered: {log:?}");
        }
    }
    // And fp16 communication of bf16 gradients, at stage 0 (the all-reduce of the step).
    p.communication_dtype = Some(ComputeDtype::F16);
    let log = issued(Stage::Zero0, p);
    // (Scalars and initialize's agreement are fp32 and a few bytes; the gradients are more.)
    let reduced: Vec<_> = log.iter().filter(|i| i.op == "all_reduce" && i.bytes > 8).collect();
    assert!(
        !reduced.is_empty() && reduced.iter().all(|i| i.dtype == Flat::F16),
        "{log:?}"
    );
}

#[test]
fn a_non_finite_bf16_gradient_fails_naming_the_step_or_is_skipped() {
    let poison = vec![Poison {
        step: 2,
        rank: 1,
        value: f32::NAN,
    }];
    // ZeroOptimizer with its state as tensors and in host buffers.
    let bf16 = settings(Stage::Zero2, 1, PrecisionSettings::bf16());
    for (path, runs) in [
        ("tensors", train_zero(bf16.clone(), 2, 5, poison.clone(), false)),
        ("host", train_zero(bf16, 2, 5, poison.clone(), true)),
    ] {
        for (rank, run) in runs.iter().enumerate() {
            assert_eq!(run.steps.len(), 3, "{path}: rank {rank} stops at the failed step");
            let err = run.steps[2].clone().expect_err("step 3 must fail");
            assert!(
                err.contains("step 3") && err.contains("bf16") && err.contains("Skip"),
                "{path}: rank {rank}: {err}"
            );
            // Each rank says what it saw: the NaN was in rank 1's batch, and reached rank 0
            // through the averaged gradient.
            let seen = if rank == 1 { "the loss" } else { "the averaged gradient" };
            assert!(err.contains(seen), "{path}: rank {rank}: {err}");
        }
    }
    let mut p = PrecisionSettings::bf16();
    p.non_finite = NonFinitePolicy::Skip;
    let s = settings(Stage::Zero3, 1, p);
    let runs: Vec<RankRun> = [
        train_zero(s.clone(), 2, 5, poison.clone(), false),
        train_zero(s, 2, 5, poison, true),
    ]
    .into_iter()
    .flatten()
    .collect();
    for run in &runs {
        let skipped: Vec<bool> = run
            .steps
            .iter()
            .map(|s| s.as_ref().map(|r| r.skipped).unwrap_or(false))
            .collect();
        assert_eq!(skipped, [false, false, true, false, false]);
        assert_eq!(run.values[2], run.values[1], "the skipped step moved the weights");
        assert!(
            run.values[4].iter().flatten().all(|v| v.is_finite()),
            "NaN reached the weights"
        );
    }
}

#[test]
fn the_config_sections_set_the_precision() {
    let parse = |text: &str| {
        let config = zero_core::config::DeepSpeedConfig::from_str(text, "ds_config.json")
            .expect("valid")
            .config;
        let resolved = zero_burn::resolve(&config, 2, &Default::default()).expect("resolves");
        zero_burn::engine_settings(&resolved).expect("accepted").precision
    };
    let base = r#""train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}"#;
    let p = parse(&format!(
        r#"{{{base}, "fp16": {{"enabled": true, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 50,
            "hysteresis": 3, "consecutive_hysteresis": true, "min_loss_scale": 4}}}}"#
    ));
    assert_eq!(p.dtype, ComputeDtype::F16);
    assert_eq!(
        p.loss_scaler,
        Some(LossScalerConfig {
            loss_scale: 0.0,
            initial_scale_power: 10,
            loss_scale_window: 50,
            hysteresis: 3,
            consecutive_hysteresis: true,
            min_loss_scale: 4.0
        })
    );
    assert_eq!(
        p.comm_dtype(),
        ComputeDtype::F16,
        "gradients are reduced in the compute dtype by default"
    );
    let p = parse(&format!(
        r#"{{{base}, "bf16": {{"enabled": true}}, "communication_data_type": "fp32"}}"#
    ));
    assert_eq!(
        (p.dtype, p.non_finite, p.comm_dtype()),
        (ComputeDtype::Bf16, NonFinitePolicy::Error, ComputeDtype::F32)
    );
    let p = parse(&format!(
        r#"{{{base}, "bf16": {{"enabled": true, "check_grad_overflow": false}}}}"#
    ));
    assert_eq!(p.non_finite, NonFinitePolicy::Ignore);
    assert_eq!(parse(&format!("{{{base}}}")), PrecisionSettings::fp32());
}

#[test]
fn zero_optimizer_on_a_plain_burn_module_trains_in_bf16_and_fp16_like_zero_modules() {
    use burn::optim::{GradientsParams, Optimizer};
    use zero_burn::ZeroOptimizer;
    // The plain `Net` under `ZeroOptimizer::new` and `synchronize`, stepped by Burn's
    // `Optimizer::step`. Reference: `train_zero`, the same blocks each a `ZeroModule` from
    // `initialize_settings` (at stage 2 cut, their gradients reduce-scattered in their
    // backward), same stage, world size, data and 16-bit settings. Both reduce the same 16-bit
    // gradients with the same kernels (f32 sums in rank order, one rounding) and step the same
    // fp32 masters, and under fp16 both scale the fp32 loss by the same dynamic scale
    // (`ZeroOptimizer::scale_loss`) and skip the same overflowing steps, so the weights must
    // agree bit for bit after every step.
    const STEPS: usize = 4;
    for (stage, precision) in [
        (Stage::Zero1, PrecisionSettings::bf16()),
        (Stage::Zero2, PrecisionSettings::bf16()),
        (Stage::Zero1, fp16()),
        (Stage::Zero2, fp16()),
    ] {
        let half = precision.dtype.burn();
        let by_units = train_zero(settings(stage, 1, precision.clone()), 2, STEPS, vec![], false);
        let by_optimizer = common::on_ranks(2, move |rank, group| {
            let device = Default::default();
            let s = settings(stage, 1, precision.clone());
            let dtype = s.precision.dtype.burn();
            let optim = ZeroOptimizer::new(s, group).expect("optimizer");
            let mut model = optim
                .synchronize::<B, _>(Net::<B>::new(&device, 3))
                .expect("synchronize");
            assert_eq!(
                model.ends.input.weight.val().dtype(),
                half,
                "synchronize casts the model"
            );
            let mut optim = optim;
            let mut values = Vec::new();
            for step in 0..STEPS {
                let (x, y) = common::batch::<B>(step, rows(rank, 2, 0, 1), &device);
                let loss = optim.scale_loss(model.loss(x.cast(dtype), y.cast(dtype)));
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(LR, model, grads);
                values.push(common::values::<B, _>(&model));
            }
            assert_eq!(
                model.ends.head.weight.val().dtype(),
                half,
                "the step writes 16-bit parameters"
            );
            values
        });
        for (rank, (by_optimizer, by_units)) in by_optimizer.iter().zip(&by_units).enumerate() {
            assert_eq!(by_units.steps.len(), STEPS, "{:?}", by_units.steps);
            for (step, (got, want)) in by_optimizer.iter().zip(&by_units.values).enumerate() {
                assert!(
                    got == want,
                    "{stage:?}, {half:?}, rank {rank}: the plain module and the ZeroModules differ after step {step}"
                );
            }
            assert!(
                by_optimizer[0] != by_optimizer[STEPS - 1],
                "{stage:?}, {half:?}: training must move the weights"
            );
        }
    }
}
