//! Tensor and pipeline parallelism together: tensor-parallel GPT-2 cut into pipeline stages.
//!
//! Reference: zero-models' `Gpt2` trained by `ZeroOptimizer` on one rank, same initial weights (each
//! tensor rank slices them with `TpGpt2::from_full`), same micro-batches, same optimizer (SGD, and
//! LAMB, whose per-tensor trust ratios need a split tensor's norms summed over its slices) and
//! clipping. TP 2 × PP 2 (4 ranks as threads) must give the same per-step losses and gradient
//! norms over 5 steps; every loss after the first depends on every weight, so a wrong update
//! anywhere shows.

use crate::pipeline_support;
use burn::prelude::*;
use pipeline_support::{micro_batch, B};
use zero_burn::pipeline::{PartitionMethod, PipelineEngine, PipelineModule};
use zero_burn::{EngineSettings, Stage};
use zero_core::comm::ThreadGroup;
use zero_core::optim::{LambSpec, OptimizerSpec, SgdSpec};
use zero_core::parallel::ParallelLayout;
use zero_models::gpt2::{Gpt2, Gpt2Config};
use zero_models::tp::{TpGpt2, TpGpt2Layer, TpGroup};

fn config() -> Gpt2Config {
    pipeline_support::config(2)
}

fn full_model(device: &Device<B>) -> Gpt2<B> {
    pipeline_support::full_model(&config(), device)
}

const STEPS: usize = 5;
const MICRO: usize = 3;

/// A gentle SGD: with lr 0.2 and momentum 0.9 this tiny model is near the edge of stability,
/// and the rounding differences of tensor-parallel sums (1e-7) grow tenfold per step.
fn settings() -> EngineSettings {
    let mut s = EngineSettings::new(
        Stage::Zero0,
        OptimizerSpec::Sgd(SgdSpec {
            lr: 0.05,
            momentum: 0.5,
            dampening: 0.0,
            weight_decay: 0.01,
            nesterov: false,
        }),
    );
    s.gradient_accumulation_steps = MICRO;
    // Small enough to clip every step: the norm must count split weights' slices on every
    // tensor rank and replicated weights once.
    s.gradient_clipping = 0.5;
    s
}

/// [`settings`] with LAMB (the paper's form, its clamps wide enough that every ratio shows).
fn lamb_settings() -> EngineSettings {
    let mut s = settings();
    s.optimizer = OptimizerSpec::Lamb(LambSpec {
        lr: 0.01,
        weight_decay: 0.01,
        max_coeff: 1e6,
        min_coeff: 0.0,
        ..LambSpec::default()
    });
    s
}

#[test]
fn tensor_2_by_pipeline_2_matches_one_process() {
    matches_one_process(settings());
}

#[test]
fn tensor_2_by_pipeline_2_with_lamb_matches_one_process() {
    matches_one_process(lamb_settings());
}

fn matches_one_process(settings: EngineSettings) {
    let device = Default::default();
    let group = ThreadGroup::new_group(1).unwrap().remove(0);
    let (reports, want, _) =
        pipeline_support::zero_optimizer_run(settings.clone(), full_model(&device), group, STEPS, |step, m| {
            micro_batch(step, m, &device)
        });
    let want_norms: Vec<f64> = reports.iter().map(|r| r.grad_norm).collect();

    let ranks = ParallelLayout::with_pipeline(1, 2, 2).unwrap().threads().unwrap();
    let runs: Vec<Vec<(f32, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|groups| {
                let settings = settings.clone();
                s.spawn(move || {
                    let device = Default::default();
                    let tp = TpGpt2::from_full(&full_model(&device), TpGroup::new(groups.tensor.clone())).unwrap();
                    let module = PipelineModule::from_layers::<B>(
                        tp.into_pipeline_layers(),
                        2,
                        PartitionMethod::Uniform,
                        groups.coords.pipeline,
                    )
                    .unwrap();
                    let mut settings = settings;
                    // Collectives run inside backward(): fence the stage's tensor ranks.
                    settings.backward_fence = Some(groups.tensor.clone());
                    let mut engine = PipelineEngine::<B, TpGpt2Layer<B>>::new(settings, module, &groups).unwrap();
                    (0..STEPS)
                        .map(|step| {
                            let batches: Vec<_> = (0..MICRO).map(|m| micro_batch(step, m, &device)).collect();
                            let out = engine.train_batch(&batches).unwrap();
                            (out.loss, out.report.grad_norm)
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, steps) in runs.iter().enumerate() {
        for (step, ((got, norm), (want, want_norm))) in steps.iter().zip(want.iter().zip(&want_norms)).enumerate() {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "rank {rank}, step {step}: loss {got} vs reference {want}"
            );
            assert!(
                (norm - want_norm).abs() <= 1e-4 * want_norm,
                "rank {rank}, step {step}: gradient norm {norm} vs reference {want_norm}"
            );
        }
    }
    // Every step clipped: the global norm decided each update's size, so a wrong norm would
    // have moved the losses too.
    assert!(want_norms.iter().all(|&n| n > 0.5), "norms {want_norms:?}");
}
