//! Mixed precision through the pipeline: fp16's dynamic loss scaler decides over every stage,
//! and a bf16 non-finite gradient fails every stage at once.
//!
//! Reference for fp16: zero-models' single `Gpt2` trained by `ZeroOptimizer` on one process,
//! with the same fp16 scaler. A loss scale of 2^17 is the injected overflow: the first steps overflow
//! somewhere in the model (where first depends on the stage: an embedding's gradient sums many
//! rows, a head's activation gradient does not), and one process skips a step whenever any
//! part overflowed. Every stage must skip exactly the reference's steps, with its loss scales.

use crate::pipeline_support;
use burn::prelude::*;
use pipeline_support::{micro_batch, B};
use std::time::{Duration, Instant};
use zero_burn::pipeline::{PartitionMethod, PipelineEngine, PipelineModule};
use zero_burn::{EngineSettings, PrecisionSettings, Stage, StepReport, ZeroError};
use zero_core::comm::ThreadGroup;
use zero_core::loss_scaler::LossScalerConfig;
use zero_core::optim::{OptimizerSpec, SgdSpec};
use zero_core::parallel::ParallelLayout;
use zero_models::gpt2::{Gpt2, Gpt2Config, Gpt2Layer};

fn config() -> Gpt2Config {
    pipeline_support::config(3)
}

fn full_model(device: &Device<B>) -> Gpt2<B> {
    pipeline_support::full_model(&config(), device)
}

const MICRO: usize = 2;
const STEPS: usize = 12;

fn settings(precision: PrecisionSettings) -> EngineSettings {
    let mut s = EngineSettings::new(
        Stage::Zero1,
        OptimizerSpec::Sgd(SgdSpec {
            lr: 0.05,
            momentum: 0.5,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }),
    );
    s.gradient_accumulation_steps = MICRO;
    s.precision = precision;
    s
}

fn fp16() -> PrecisionSettings {
    PrecisionSettings::fp16(LossScalerConfig {
        initial_scale_power: 17,
        hysteresis: 1,
        ..LossScalerConfig::default()
    })
}

/// (skipped, loss scale) of each step.
fn pattern(reports: &[StepReport]) -> Vec<(bool, f64)> {
    reports.iter().map(|r| (r.skipped, r.loss_scale)).collect()
}

#[test]
fn fp16_overflow_skips_the_same_steps_on_every_stage_as_one_process() {
    let device = Default::default();
    let group = ThreadGroup::new_group(1).unwrap().remove(0);
    let (want, _, _) =
        pipeline_support::zero_optimizer_run(settings(fp16()), full_model(&device), group, STEPS, |step, m| {
            micro_batch(step, m, &device)
        });
    let want = pattern(&want);
    let skipped = want.iter().filter(|(s, _)| *s).count();
    assert!(
        (2..STEPS - 2).contains(&skipped),
        "the injected overflow skips some steps, not all: {want:?}"
    );

    let groups = ParallelLayout::with_pipeline(1, 1, 2).unwrap().threads().unwrap();
    let runs: Vec<Vec<StepReport>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|groups| {
                s.spawn(move || {
                    let device = Default::default();
                    let layers = full_model(&device).into_pipeline_layers();
                    let module =
                        PipelineModule::from_layers::<B>(layers, 2, PartitionMethod::Uniform, groups.coords.pipeline)
                            .unwrap();
                    let mut engine = PipelineEngine::<B, Gpt2Layer<B>>::new(settings(fp16()), module, &groups).unwrap();
                    (0..STEPS)
                        .map(|step| {
                            let batches: Vec<_> = (0..MICRO).map(|m| micro_batch(step, m, &device)).collect();
                            engine.train_batch(&batches).unwrap().report
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (stage, reports) in runs.iter().enumerate() {
        assert_eq!(
            pattern(reports),
            want,
            "stage {stage}: skipped steps and loss scales vs one process"
        );
    }
}

/// bf16 with the error policy: a NaN weight on stage 0 (an embedding row every micro-batch
/// uses) fails the step on both stages with the non-finite error, well before any timeout.
#[test]
fn bf16_non_finite_fails_every_stage_at_once() {
    let groups = ParallelLayout::with_pipeline(1, 1, 2).unwrap().threads().unwrap();
    let started = Instant::now();
    let errors: Vec<ZeroError> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|groups| {
                s.spawn(move || {
                    let device = Default::default();
                    let mut layers = full_model(&device).into_pipeline_layers();
                    if let Gpt2Layer::Embed(e) = &mut layers[0] {
                        let w = e.wpe.weight.val().detach();
                        let nan = w.clone().slice(0..1).mul_scalar(f32::NAN);
                        e.wpe.weight = burn::module::Param::from_tensor(w.slice_assign(0..1, nan).detach());
                    }
                    let module =
                        PipelineModule::from_layers::<B>(layers, 2, PartitionMethod::Uniform, groups.coords.pipeline)
                            .unwrap();
                    let mut engine =
                        PipelineEngine::<B, Gpt2Layer<B>>::new(settings(PrecisionSettings::bf16()), module, &groups)
                            .unwrap();
                    let batches: Vec<_> = (0..MICRO).map(|m| micro_batch(0, m, &device)).collect();
                    match engine.train_batch(&batches) {
                        Ok(_) => panic!("a NaN weight trained without error"),
                        Err(e) => e,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (stage, e) in errors.iter().enumerate() {
        assert!(
            matches!(e, ZeroError::NonFinite { step: 1, .. }),
            "stage {stage}: expected the non-finite error, got {e}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the stages failed only after {:?}",
        started.elapsed()
    );
}
