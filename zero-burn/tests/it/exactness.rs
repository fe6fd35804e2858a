//! Stages 0-3 at world sizes 1-4, with and without accumulation, against a single process:
//! `ZeroOptimizer` in Burn's own loop (accumulation through Burn's `GradientsAccumulator`) over
//! the model with its blocks as `ZeroModule`s, from `initialize_settings` (stages 0-3; at stage
//! 3 each block cut over the ranks), and over the plain model (stages 0-2).
//!
//! Reference: plain Burn on one thread, the whole global batch in one forward/backward, and
//! Burn's own AdamW (`burn::optim::AdamWConfig`, an implementation independent of ours), with
//! the global-norm clip computed in f64 by the test. Parameters after 5 steps must agree to 1e-6
//! relative (max |a - b| / max |b|).
//!
//! Adam's eps is 1e-4 here, not 1e-8. With a tiny eps, Adam divides each gradient element by its
//! own magnitude, so an element whose gradient is near zero (a cancellation) turns a rounding
//! difference of the summation order (one process summing 24 rows, several ranks averaging
//! their means) into a visible difference of the update (5e-6 relative after 5 steps at 1e-8).
//! A larger eps keeps the comparison well conditioned, and it also breaks Adam's invariance to
//! the gradient's scale, so a wrong averaging factor cannot hide.

use crate::common;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use common::*;
use std::sync::Arc;
use zero_burn::params::read_values;
use zero_burn::sharded::UnitComm;
use zero_burn::{EngineSettings, HostStaged, Stage, ZeroOptimizer};
use zero_core::optim::{AdamSpec, OptimizerSpec};
use zero_test_support::{assert_close, max_relative_error};

const STEPS: usize = 5;
const LR: f64 = 0.01;
const BLOCKS: usize = 3;
const EPS: f64 = 1e-4;

fn adamw() -> OptimizerSpec {
    OptimizerSpec::Adam(AdamSpec {
        lr: LR,
        betas: (0.9, 0.999),
        eps: EPS,
        weight_decay: 0.01,
        decoupled_weight_decay: true,
        bias_correction: true,
        amsgrad: false,
    })
}

fn settings(stage: Stage, gas: usize, clip: f64) -> EngineSettings {
    let mut s = EngineSettings::new(stage, adamw());
    s.gradient_accumulation_steps = gas;
    s.gradient_clipping = clip;
    // Small buckets, so that stages 1-2 reduce several buckets per step.
    s.reduce_bucket_size = 100;
    // Every block (187 elements) is cut under stage 3 (the default threshold keeps units this
    // small whole), and with stage 3's `overlap_comm` the blocks that come next are prefetched,
    // up to 400 elements (two blocks).
    s.param_persistence_threshold = 13;
    s.prefetch_bucket_size = 400;
    s
}

/// The single-process run.
fn reference(clip: f64) -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut model = Net::<B>::new(&device, BLOCKS);
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(EPS as f32)
        .with_weight_decay(0.01)
        .init();
    for step in 0..STEPS {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = model.loss(x, y).backward();
        let mut grads = GradientsParams::from_grads(grads, &model);
        if clip > 0.0 {
            grads = clip_global(&model, grads, clip);
        }
        model = optim.step(LR, model, grads);
    }
    values::<B, _>(&model)
}

/// torch.nn.utils.clip_grad_norm_ over all parameters, in f64.
fn clip_global<M: AutodiffModule<B>>(model: &M, mut grads: GradientsParams, max_norm: f64) -> GradientsParams {
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::Tensor;
    type Inner = <B as AutodiffBackend>::InnerBackend;
    struct Norm<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor<B> for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.get::<Inner, D>(p.id) {
                let v = zero_burn::params::tensor_to_vec(g);
                self.1 += v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>();
            }
        }
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.remove::<Inner, D>(p.id) {
                self.0.register::<Inner, D>(p.id, g.mul_scalar(self.1));
            }
        }
    }
    let mut n = Norm(&grads, 0.0);
    model.visit(&mut n);
    let norm = n.1.sqrt();
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        model.visit(&mut Scale(&mut grads, coef as f32));
    }
    grads
}

/// This rank's rows of micro-batch `micro` (the global batch is split in order across ranks,
/// then across micro-batches).
fn rows(rank: usize, world: usize, micro: usize, gas: usize) -> std::ops::Range<usize> {
    let per_rank = GLOBAL_BATCH / world;
    let per_micro = per_rank / gas;
    let start = rank * per_rank + micro * per_micro;
    start..start + per_micro
}

/// [`run_optimizer`] over [`UnitNet`] from `initialize_settings`; rank 0's parameters in `Net`'s
/// order (each block gathered whole, from the inner backend's copy).
fn run_units(stage: Stage, world: usize, gas: usize, clip: f64) -> Vec<Vec<f32>> {
    let results = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(group.clone()));
        let (mut model, mut optim) = zero_burn::initialize_settings(
            settings(stage, gas, clip),
            UnitNet::<B>::new(&device, BLOCKS),
            group,
            units,
        )
        .expect("initialize");
        assert_eq!(
            model.blocks.iter().all(|b| b.is_sharded()),
            stage == Stage::Zero3 || (stage == Stage::Zero2 && world > 1),
            "{stage:?} world {world}: the blocks are cut at stage 3 (and at stage 2 over several ranks)"
        );
        for step in 0..STEPS {
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..gas {
                let (x, y) = batch::<B>(step, rows(rank, world, micro, gas), &device);
                let loss = model.loss(x, y).div_scalar(gas as f32);
                accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            model = optim.try_step(LR, model, accumulator.grads()).expect("step");
        }
        assert_eq!(optim.global_step(), STEPS as u64, "one step per accumulation boundary");
        let model = model.valid();
        let mut out = values(&model.ends);
        for b in &model.blocks {
            read_values::<burn::backend::Flex, _>(&b.gathered().expect("gather"), |_, v| out.push(v));
        }
        out
    });
    for r in &results[1..] {
        assert_eq!(r, &results[0], "every rank holds the same weights");
    }
    results.into_iter().next().unwrap_or_default()
}

/// `ZeroOptimizer` in Burn's loop: each micro-batch's loss divided by `gas` before backward,
/// the gradients summed by Burn's accumulator, one `step` per accumulation boundary.
fn run_optimizer(stage: Stage, world: usize, gas: usize, clip: f64) -> Vec<Vec<f32>> {
    let results = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let mut model = Net::<B>::new(&device, BLOCKS);
        let mut optim = ZeroOptimizer::new(settings(stage, gas, clip), group).expect("optimizer");
        for step in 0..STEPS {
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..gas {
                let (x, y) = batch::<B>(step, rows(rank, world, micro, gas), &device);
                let loss = model.loss(x, y).div_scalar(gas as f32);
                accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            model = optim.try_step(LR, model, accumulator.grads()).expect("step");
        }
        assert_eq!(optim.global_step(), STEPS as u64, "one step per accumulation boundary");
        values::<B, _>(&model)
    });
    for r in &results[1..] {
        assert_eq!(r, &results[0], "every rank holds the same weights");
    }
    results.into_iter().next().unwrap_or_default()
}

fn check(label: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_close(
        &format!("{label} against the single-process reference"),
        got,
        want,
        1e-6,
    );
    // The run must have moved the weights: a no-op optimizer would not match by accident.
    let initial = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    assert!(
        max_relative_error(&format!("{label}: the initial weights"), &initial, want) > 1e-3,
        "{label}: the reference did not train"
    );
}

#[test]
fn zero_modules_match_single_process_every_stage_world_and_accumulation() {
    let want = reference(0.0);
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in 1..=4 {
            for gas in [1, 2] {
                let got = run_units(stage, world, gas, 0.0);
                check(&format!("ZeroModules {stage:?} world {world} gas {gas}"), &got, &want);
            }
        }
    }
}

#[test]
fn zero_optimizer_matches_single_process_stages_0_to_2() {
    let want = reference(0.0);
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for world in 1..=4 {
            for gas in [1, 2] {
                let got = run_optimizer(stage, world, gas, 0.0);
                check(&format!("ZeroOptimizer {stage:?} world {world} gas {gas}"), &got, &want);
            }
        }
    }
}

#[test]
fn clipping_by_global_norm_matches_single_process() {
    // A max norm well below the gradients' norm, so every step clips.
    let want = reference(0.05);
    assert!(
        max_relative_error("clipped against unclipped reference", &want, &reference(0.0)) > 1e-4,
        "clipping must change the result"
    );
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1, 3, 4] {
            let got = run_units(stage, world, 2, 0.05);
            check(&format!("clipped ZeroModules {stage:?} world {world}"), &got, &want);
        }
    }
    for stage in [Stage::Zero1, Stage::Zero2] {
        let got = run_optimizer(stage, 3, 1, 0.05);
        check(&format!("clipped ZeroOptimizer {stage:?} world 3"), &got, &want);
    }
}
