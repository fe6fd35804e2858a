//! `ZeroOptimizer` behind Burn's `Optimizer` trait: a plain Burn loop, data-parallel.
//!
//! Reference: one process, the whole global batch, Burn's own AdamW.

mod common;

use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use common::*;
use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
use zero_core::optim::{AdamSpec, OptimizerSpec};

const EPS: f64 = 1e-4; // see tests/exactness.rs for why not 1e-8

#[test]
fn zero_optimizer_in_a_burn_loop_matches_burn_adamw_on_one_process() {
    let device = Default::default();
    let mut model = Net::<B>::new(&device, 2);
    let mut optim = AdamWConfig::new()
        .with_epsilon(EPS as f32)
        .with_weight_decay(0.01)
        .init();
    for step in 0..4 {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    let want = values::<B, _>(&model);

    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for world in [2, 3] {
            let got = on_ranks(world, move |rank, group| {
                let device = Default::default();
                let spec = OptimizerSpec::Adam(AdamSpec {
                    eps: EPS,
                    weight_decay: 0.01,
                    ..AdamSpec::adamw()
                });
                let mut settings = EngineSettings::new(stage, spec);
                settings.reduce_bucket_size = 64;
                let mut optim = ZeroOptimizer::new(settings, group).expect("optimizer");
                let mut model = Net::<B>::new(&device, 2);
                let per = GLOBAL_BATCH / world;
                for step in 0..4 {
                    let (x, y) = batch::<B>(step, rank * per..(rank + 1) * per, &device);
                    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                    // Burn's loop passes the learning rate.
                    model = optim.step(1e-2, model, grads);
                }
                assert_eq!(optim.last_step().map(|r| r.step), Some(4));
                values::<B, _>(&model)
            });
            for g in &got {
                let err = max_relative_error(g, &want);
                assert!(err < 1e-6, "{stage:?} world {world}: relative error {err:e}");
            }
        }
    }
}
