//! `ZeroOptimizer` behind Burn's `Optimizer` trait: a plain Burn loop, data-parallel.
//!
//! Reference: one process, the whole global batch, Burn's own AdamW.

use crate::common;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use common::*;
use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
use zero_core::optim::{AdamSpec, OptimizerSpec};
use zero_test_support::assert_close;

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
            for (rank, g) in got.iter().enumerate() {
                assert_close(&format!("{stage:?} world {world}, rank {rank}"), g, &want, 1e-6);
            }
        }
    }
}

/// Trains `steps` steps of the global batch on `world` ranks with `optim`, from `model`.
fn train_steps(
    optim: &mut ZeroOptimizer,
    mut model: Net<B>,
    steps: std::ops::Range<usize>,
    rank: usize,
    world: usize,
) -> Net<B> {
    let device = Default::default();
    let per = GLOBAL_BATCH / world;
    for step in steps {
        let (x, y) = batch::<B>(step, rank * per..(rank + 1) * per, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    model
}

#[test]
fn zero_optimizer_resumes_from_its_checkpoint_bit_for_bit() {
    // Reference: the same optimizer trained 4 steps without interruption. The resumed run
    // starts from a model with other weights and a fresh optimizer: everything it needs must
    // come from the checkpoint.
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        let dir = std::env::temp_dir().join(format!("zero-optim-ckpt-{}-{stage:?}", std::process::id()));
        let dir2 = dir.clone();
        let results = on_ranks(2, move |rank, group| {
            let settings = || {
                let spec = OptimizerSpec::Adam(AdamSpec {
                    eps: EPS,
                    weight_decay: 0.01,
                    ..AdamSpec::adamw()
                });
                EngineSettings::new(stage, spec)
            };
            let device = Default::default();
            let mut straight = ZeroOptimizer::new(settings(), group.clone()).expect("optimizer");
            let want = train_steps(&mut straight, Net::<B>::new(&device, 2), 0..4, rank, 2);

            let mut first = ZeroOptimizer::new(settings(), group.clone()).expect("optimizer");
            let half = train_steps(&mut first, Net::<B>::new(&device, 2), 0..2, rank, 2);
            assert!(
                ZeroOptimizer::new(settings(), group.clone())
                    .expect("optimizer")
                    .save_checkpoint(&dir2, None, &serde_json::json!({}))
                    .is_err(),
                "nothing to save before the first step"
            );
            first
                .save_checkpoint(&dir2, None, &serde_json::json!({ "step": 2 }))
                .expect("save");
            drop(half);

            let mut resumed = ZeroOptimizer::new(settings(), group).expect("optimizer");
            let other = zero_burn::params::write_values(Net::<B>::new(&device, 2), &device, true, |i| {
                vec![
                    0.5 + i as f32;
                    zero_burn::params::describe::<B, _>(&Net::<B>::new(&device, 2))[i]
                        .1
                        .numel()
                ]
            });
            let (model, client) = resumed.load_checkpoint(&dir2, None, other).expect("load");
            assert_eq!(client["step"], 2);
            let got = train_steps(&mut resumed, model, 2..4, rank, 2);
            (values::<B, _>(&got), values::<B, _>(&want))
        });
        let _ = std::fs::remove_dir_all(&dir);
        for (got, want) in results {
            assert!(
                got == want,
                "{stage:?}: the resumed run is not the uninterrupted one bit for bit"
            );
        }
    }
}

/// What `ZeroOptimizer` cannot do right is an error that says what to do, before any update:
/// an fp16 step whose loss `scale_loss` never scaled (its gradients would be taken 2^16 times
/// too small), and stage 3 over a model without `ZeroModule`s (nothing to partition). After
/// `scale_loss` the fp16 step goes through.
#[test]
fn an_unscaled_fp16_loss_and_stage_3_without_units_are_refused_naming_the_way_out() {
    let device = Default::default();
    let step = |optim: &mut ZeroOptimizer, scale: bool| {
        let model = Net::<B>::new(&device, 2);
        let (x, y) = batch::<B>(0, 0..GLOBAL_BATCH, &device);
        let loss = model.loss(x, y);
        let loss = if scale { optim.scale_loss(loss) } else { loss };
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        optim.try_step(1e-2, model, grads).err().map(|e| e.to_string())
    };
    let group = zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0);
    let mut settings = EngineSettings::new(Stage::Zero1, OptimizerSpec::adamw());
    settings.precision = zero_burn::PrecisionSettings::fp16(Default::default());
    let mut fp16 = ZeroOptimizer::new(settings, group.clone()).expect("optimizer");
    let e = step(&mut fp16, false).expect("an unscaled fp16 loss is refused");
    assert!(e.contains("fp16") && e.contains("scale_loss"), "{e}");
    assert_eq!(step(&mut fp16, true), None, "a scaled one steps");

    let settings = EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw());
    let mut stage3 = ZeroOptimizer::new(settings, group).expect("optimizer");
    let e = step(&mut stage3, false).expect("stage 3 without units is refused");
    assert!(e.contains("stage 3") && e.contains("ZeroModule"), "{e}");
}
