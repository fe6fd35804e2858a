//! fp16 dynamic loss scaling in `ZeroOptimizer`, with DeepSpeed's semantics.
//!
//! Reference: the scale trajectories below are derived by hand from DeepSpeed's
//! `DynamicLossScaler.update_scale` (the rules `zero_core::loss_scaler` implements and checks
//! against a trace of DeepSpeed): an overflow decrements the hysteresis and, once it is used up,
//! halves the scale; the scale doubles when `loss_scale_window` steps have passed since the last
//! overflow. A skipped step must leave the weights bit for bit as they were.
//!
//! Every test runs on the `ZeroModule` path (`UnitNet` and `ZeroOptimizer` in Burn's own loop),
//! with the optimizer's state as tensors and in host buffers.

use crate::common;
use crate::precision_support;
use common::B;
use precision_support::*;
use std::sync::Arc;
use zero_burn::{EngineSettings, PrecisionSettings, Stage, StepReport};
use zero_core::loss_scaler::LossScalerConfig;
use zero_test_support::max_relative_error;

fn fp16(scaler: LossScalerConfig) -> PrecisionSettings {
    PrecisionSettings::fp16(scaler)
}

/// The runs of every path: `ZeroOptimizer` with its state as tensors and in host buffers,
/// labelled.
fn every_path(
    settings: EngineSettings,
    world: usize,
    steps: usize,
    poison: Vec<Poison>,
) -> Vec<(&'static str, Vec<RankRun>)> {
    vec![
        (
            "ZeroOptimizer (tensors)",
            train_zero(settings.clone(), world, steps, poison.clone(), false),
        ),
        ("ZeroOptimizer (host)", train_zero(settings, world, steps, poison, true)),
    ]
}

fn reports(run: &RankRun) -> Vec<StepReport> {
    run.steps
        .iter()
        .map(|r| r.clone().expect("no step fails here"))
        .collect()
}

/// An input of 3e4 is finite in fp16, but the activations and the scaled gradients it causes
/// are not.
const HUGE: f32 = 3.0e4;

#[test]
fn an_injected_overflow_skips_exactly_that_step_on_every_rank_and_halves_after_hysteresis() {
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let scaler = LossScalerConfig {
            initial_scale_power: 8,
            hysteresis: 2,
            ..Default::default()
        };
        let mut s: EngineSettings = settings(stage, 1, fp16(scaler));
        // A schedule that moves every step, to see that skipped steps do not advance it.
        s.lr_schedule = Some(Arc::new(|k| LR * (k + 1) as f64));
        // Only rank 1 sees the bad batches, at steps 2 and 4 (0-based).
        let poison = vec![
            Poison {
                step: 2,
                rank: 1,
                value: HUGE,
            },
            Poison {
                step: 4,
                rank: 1,
                value: HUGE,
            },
        ];
        for (path, runs) in every_path(s, 2, 7, poison) {
            for (rank, run) in runs.iter().enumerate() {
                let r = reports(run);
                let label = format!("{path} {stage:?} rank {rank}");
                let skipped: Vec<bool> = r.iter().map(|r| r.skipped).collect();
                assert_eq!(
                    skipped,
                    [false, false, true, false, true, false, false],
                    "{label}: skipped steps"
                );
                assert!(
                    !run.losses[2].is_finite() || rank == 0,
                    "{label}: the poisoned batch overflows"
                );
                // Hysteresis 2: the first overflow only uses it up, the second halves the scale.
                let scales: Vec<f64> = r.iter().map(|r| r.loss_scale).collect();
                assert_eq!(
                    scales,
                    [256.0, 256.0, 256.0, 256.0, 256.0, 128.0, 128.0],
                    "{label}: loss scales"
                );
                // The step counter counts skipped steps (DeepSpeed's global_steps); the LR schedule
                // does not: step 4 runs at the rate step 3 would have had.
                assert_eq!(r.iter().map(|r| r.step).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6, 7]);
                let lrs: Vec<f64> = r.iter().map(|r| (r.lr / LR).round()).collect();
                assert_eq!(
                    lrs,
                    [1.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0],
                    "{label}: the schedule advances only on applied steps"
                );
                assert!(
                    r[2].grad_norm.is_nan() && r[3].grad_norm.is_finite(),
                    "{label}: grad norms"
                );
                // A skipped step leaves every weight bit for bit; an applied one moves them.
                assert_eq!(
                    run.values[2], run.values[1],
                    "{label}: skipped step 3 changed the weights"
                );
                assert_eq!(
                    run.values[4], run.values[3],
                    "{label}: skipped step 5 changed the weights"
                );
                assert_ne!(run.values[3], run.values[2], "{label}: step 4 must move the weights");
                assert!(
                    run.values[6].iter().flatten().all(|v| v.is_finite()),
                    "{label}: no overflow reached the weights"
                );
            }
            assert_eq!(runs[0].values, runs[1].values, "{path} {stage:?}: ranks agree");
        }
    }
}

#[test]
fn the_scale_doubles_after_each_window_without_overflow() {
    let scaler = LossScalerConfig {
        initial_scale_power: 4,
        loss_scale_window: 3,
        ..Default::default()
    };
    for (path, runs) in every_path(settings(Stage::Zero2, 1, fp16(scaler)), 2, 8, vec![]) {
        let scales: Vec<f64> = reports(&runs[0]).iter().map(|r| r.loss_scale).collect();
        // Updates 0-3 at 16; the update of iteration 3 (3 steps since the start) doubles; again at 6.
        assert_eq!(scales, [16.0, 16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0], "{path}");
        assert!(reports(&runs[0]).iter().all(|r| !r.skipped), "{path}");
    }
}

#[test]
fn a_static_scale_never_moves_but_still_skips_an_overflow() {
    let scaler = LossScalerConfig {
        loss_scale: 128.0,
        loss_scale_window: 2,
        ..Default::default()
    };
    let poison = vec![Poison {
        step: 1,
        rank: 0,
        value: HUGE,
    }];
    for (path, runs) in every_path(settings(Stage::Zero0, 1, fp16(scaler)), 2, 5, poison) {
        let r = reports(&runs[1]);
        assert!(r.iter().all(|r| r.loss_scale == 128.0), "{path}");
        assert_eq!(
            r.iter().map(|r| r.skipped).collect::<Vec<_>>(),
            [false, true, false, false, false],
            "{path}"
        );
        assert_eq!(
            runs[1].values[1], runs[1].values[0],
            "{path}: the skipped step moved the weights of rank 1"
        );
    }
}

#[test]
fn an_overflow_at_the_minimum_scale_fails_naming_the_step_and_suggesting_bf16() {
    let scaler = LossScalerConfig {
        initial_scale_power: 6,
        hysteresis: 1,
        min_loss_scale: 32.0,
        ..Default::default()
    };
    let poison = vec![
        Poison {
            step: 1,
            rank: 0,
            value: HUGE,
        },
        Poison {
            step: 3,
            rank: 0,
            value: HUGE,
        },
    ];
    for (path, runs) in every_path(settings(Stage::Zero2, 1, fp16(scaler)), 2, 6, poison) {
        for (rank, run) in runs.iter().enumerate() {
            // Step 2 halves 64 to the minimum 32; step 4 overflows again at the minimum.
            assert_eq!(run.steps.len(), 4, "{path} rank {rank} stops at the failed step");
            assert!(run.steps[1]
                .as_ref()
                .map(|r| r.skipped && r.loss_scale == 64.0)
                .unwrap_or(false));
            let err = run.steps[3].clone().expect_err("the fourth step must fail");
            assert!(
                err.contains("step 4") && err.contains("bf16") && err.contains("minimum"),
                "{path} rank {rank}: {err}"
            );
        }
    }
}

#[test]
fn fp16_gradients_are_unscaled_before_the_norm_and_the_update() {
    // Reference: the same fp16 run with a static scale of 1 (nothing to undo). Scales are powers
    // of two, so scaling and unscaling are exact except where a gradient is subnormal in fp16 at
    // scale 1; the two runs then differ by fp16 rounding, far less than a missing or doubled
    // unscale would make (a factor 256 in SGD's step and in the reported norm).
    let one = LossScalerConfig {
        loss_scale: 1.0,
        ..Default::default()
    };
    let dynamic = LossScalerConfig {
        initial_scale_power: 8,
        ..Default::default()
    };
    let sgd = |scaler| {
        let mut s = settings(Stage::Zero2, 1, fp16(scaler));
        s.optimizer = zero_core::optim::OptimizerSpec::Sgd(zero_core::optim::SgdSpec {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        });
        s
    };
    for ((path, a), (_, b)) in
        every_path(sgd(one), 2, 5, vec![])
            .into_iter()
            .zip(every_path(sgd(dynamic), 2, 5, vec![]))
    {
        let (na, nb) = (reports(&a[0])[0].grad_norm, reports(&b[0])[0].grad_norm);
        assert_eq!(reports(&b[0])[0].loss_scale, 256.0, "{path}");
        assert!(
            (na - nb).abs() <= 1e-2 * na,
            "{path}: first-step gradient norms {na} (scale 1) and {nb} (scale 256)"
        );
        let initial = common::values::<B, _>(&common::Net::<B>::new(&Default::default(), 3));
        let (va, vb) = (&a[0].values[4], &b[0].values[4]);
        let err = max_relative_error(&format!("{path}: scale 1 against 256"), va, vb);
        let moved = max_relative_error(&format!("{path}: the initial weights"), &initial, vb);
        println!(
            "{path}: fp16 scale 1 vs 256 after 5 SGD steps: max relative difference {err:e}; training moved {moved:e}"
        );
        assert!(moved > 1e-2, "{path}: training must move the weights");
        assert!(
            err <= moved * 0.05,
            "{path}: unscaling is wrong: difference {err:e} against a move of {moved:e}"
        );
    }
}
