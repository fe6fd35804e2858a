//! Training tensor-parallel GPT-2 with `ZeroOptimizer`, against one process.
//!
//! 5 AdamW steps through `ZeroOptimizer` in Burn's own loop on data × tensor layouts (stages
//! 0-2 on `TpGpt2`, stage 3 on `TpGpt2::into_sharded`), with accumulation and clipping,
//! against one process running the whole global batch: the full `Gpt2` stepped by Burn's own
//! AdamW, its gradients clipped by their global norm (torch's `clip_grad_norm_`). Tolerance
//! 1e-5 of the largest weight after 5 steps: Burn's AdamW and ZeRO's Adam round differently
//! (2.7e-6 apart at lr 0.01 with ZeRO on one rank, measured), and tensor-parallel gradients
//! differ from the full model's by f32 rounding (measured in all: 5e-7 to 7e-6, the most at
//! tensor 4), while a wrong clip or a missing step moves the weights by more than 1e-3. LAMB,
//! whose trust ratios are per whole tensor, against `ZeroOptimizer`'s LAMB on one process.

use crate::tp_support;
use burn::backend::Flex;
use burn::module::{ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use tp_support::*;
use zero_burn::params::{describe, take_grads, write_values};
use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
use zero_core::comm::ThreadGroup;
use zero_core::optim::{AdamSpec, OptimizerSpec};
use zero_models::gpt2::{Gpt2, Gpt2Config};
use zero_models::tp::{TpGpt2, TpGroup};
use zero_test_support::{assert_close, max_relative_error};

/// The learning rate of the training comparison.
const LR: f64 = 0.01;
/// Adam's eps 1e-4 (see zero-burn's exactness tests: a tiny eps amplifies summation-order
/// rounding in near-zero gradient elements).
const EPS: f64 = 1e-4;
/// AdamW's decoupled weight decay.
const WEIGHT_DECAY: f64 = 0.01;

/// Settings of the training comparison: AdamW (betas 0.9, 0.999) with [`EPS`] and
/// [`WEIGHT_DECAY`], small buckets so that stages 1-2 reduce several per step.
fn settings(stage: Stage, clip: f64) -> EngineSettings {
    let mut s = EngineSettings::new(
        stage,
        OptimizerSpec::Adam(AdamSpec {
            lr: LR,
            betas: (0.9, 0.999),
            eps: EPS,
            weight_decay: WEIGHT_DECAY,
            decoupled_weight_decay: true,
            bias_correction: true,
            amsgrad: false,
        }),
    );
    s.reduce_bucket_size = 300;
    s.param_persistence_threshold = 20;
    s.prefetch_bucket_size = 1000;
    s.gradient_clipping = clip;
    s
}

const STEPS: usize = 5;
const GLOBAL_BATCH: usize = 4;

/// The reference: the full model on one process, the whole global batch, Burn's own AdamW
/// (the settings' betas, eps, weight decay and rate), the gradients scaled by torch's
/// `clip_grad_norm_` rule at `clip` (0: none). Its weights after `STEPS` steps.
fn reference_training(clip: f64) -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut model = full_model(&device);
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(EPS as f32)
        .with_weight_decay(WEIGHT_DECAY as f32)
        .init();
    for step in 0..STEPS {
        let batch = tokens(step, 0..GLOBAL_BATCH, &device);
        let mut grads = GradientsParams::from_grads(model.loss(batch.clone(), batch).backward(), &model);
        if clip > 0.0 {
            clip_by_global_norm(&model, &mut grads, clip);
        }
        model = optim.step(LR, model, grads);
    }
    values(&model)
}

/// torch's `clip_grad_norm_`: every gradient times `clip / (norm + 1e-6)` when that is below 1,
/// `norm` the L2 norm of all of them together.
fn clip_by_global_norm(model: &Gpt2<B>, grads: &mut GradientsParams, clip: f64) {
    struct Norm<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor<B> for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.get::<Flex, D>(param.id) {
                let v = g.into_data().to_vec::<f32>().expect("f32");
                self.1 += v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
            }
        }
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.remove::<Flex, D>(param.id) {
                self.0.register(param.id, g.mul_scalar(self.1));
            }
        }
    }
    let mut norm = Norm(grads, 0.0);
    model.visit(&mut norm);
    let coef = clip / (norm.1.sqrt() + 1e-6);
    if coef < 1.0 {
        model.visit(&mut Scale(grads, coef as f32));
    }
}

/// A rank's coordinates, its weights (one vector per parameter), and its slice of the reference's.
type RankWeights = (zero_core::parallel::Coords, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Every rank's weights within 1e-5 (max relative) of its slice of the reference's, after
/// `STEPS` steps.
fn assert_weights_close(label: &str, results: Vec<RankWeights>) {
    for (coords, got, want) in results {
        let label = format!("{label} {coords:?}: weights after {STEPS} steps");
        let err = max_relative_error(&label, &got, &want);
        eprintln!("{label}: max relative error {err:e}");
        assert_close(&label, &got, &want, 1e-5);
    }
}

/// Trains the tensor-parallel model on a `dp × tp` layout with `ZeroOptimizer` (its state as
/// tensors or in host buffers, `tensors`) in Burn's own loop over the data group (stages 0-2; `with_tensor_parallel` over the tensor group,
/// `TpGpt2::tensor_splits` naming the split parameters), `gas` micro-batches per step (the
/// global batch split in order across data-parallel ranks, then micro-batches) accumulated by
/// Burn's `GradientsAccumulator`, and compares every rank's weights with its slice of the
/// reference's.
fn check_zero_optimizer(
    (stage, dp, tp, gas): (Stage, usize, usize, usize),
    clip: f64,
    tensors: bool,
    reference: &[Vec<f32>],
) {
    use burn::optim::GradientsAccumulator;
    let results = on_layout(dp, tp, |groups| {
        let device = Default::default();
        let group = TpGroup::new(groups.tensor.clone());
        let mut model = TpGpt2::from_full(&full_model(&device), group.clone()).unwrap();
        let mut optim = ZeroOptimizer::new(settings(stage, clip), groups.data.clone())
            .unwrap()
            .with_tensor_state(tensors)
            .with_tensor_parallel(groups.tensor.clone(), model.tensor_splits());
        let per_micro = GLOBAL_BATCH / dp / gas;
        let d = groups.coords.data;
        for step in 0..STEPS {
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..gas {
                let start = (d * gas + micro) * per_micro;
                let batch = tokens(step, start..start + per_micro, &device);
                let loss = model.loss(batch.clone(), batch).div_scalar(gas as f32);
                accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            model = optim.try_step(LR, model, accumulator.grads()).unwrap();
        }
        group.check().unwrap();
        let want = values(&TpGpt2::from_full(&model_from(reference, &device), group).unwrap());
        (groups.coords, values(&model), want)
    });
    assert_weights_close(
        &format!("ZeroOptimizer stage {stage:?} dp {dp} tp {tp} gas {gas} clip {clip} tensor state {tensors}"),
        results,
    );
}

#[test]
fn zero_optimizer_with_tensor_parallelism_trains_like_one_process_and_clips_by_the_whole_norm() {
    let single = TpGroup::new(ThreadGroup::new_group(1).unwrap().remove(0));
    let model = TpGpt2::from_full(&full_model(&Default::default()), single).unwrap();
    let rule = model.tensor_splits();
    let split: Vec<String> = describe::<B, _>(&model)
        .into_iter()
        .map(|(_, s)| s.name)
        .filter(|n| rule(n).is_some())
        .collect();
    // wte, and per block c_attn (weight, bias), c_fc (weight, bias) and both c_proj weights.
    assert_eq!(split.len(), 1 + LAYERS * 6, "{split:?}");
    let reference = reference_training(0.0);
    assert!(
        max_relative_error(
            "the initial weights",
            &values(&full_model(&Default::default())),
            &reference
        ) > 1e-3,
        "the reference trained"
    );
    for (stage, dp, tp, gas) in [
        (Stage::Zero0, 2, 2, 1),
        (Stage::Zero1, 2, 2, 2),
        (Stage::Zero2, 2, 2, 1),
        (Stage::Zero2, 2, 2, 2),
        (Stage::Zero2, 1, 4, 1),
    ] {
        check_zero_optimizer((stage, dp, tp, gas), 0.0, true, &reference);
    }
    // Clipped at 0.05 every step (the norm is above 1 here): a norm over one rank's slices
    // would scale the gradients differently and the weights would part.
    let clipped = reference_training(0.05);
    assert!(
        max_relative_error("clipped against unclipped reference", &clipped, &reference) > 1e-3,
        "the clip engages"
    );
    // Both states: the tensors on the device (the default) and the host buffers (the state of
    // an offloaded optimizer).
    for layout in [(Stage::Zero1, 2, 2, 1), (Stage::Zero2, 1, 4, 2)] {
        for tensors in [true, false] {
            check_zero_optimizer(layout, 0.05, tensors, &clipped);
        }
    }
}

/// A `ZeroOptimizer` checkpoint of the tensor-parallel model (each tensor rank under its own
/// `tensor_rank_{t}` directory) resumes bit for bit. Reference: the same 5 steps without the
/// stop.
#[test]
fn a_tensor_parallel_zero_optimizer_checkpoint_resumes_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("zero-tp-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |steps: std::ops::Range<usize>, load: bool, save: bool| {
        on_layout(2, 2, |groups| {
            let device = Default::default();
            let group = TpGroup::new(groups.tensor.clone());
            let mut model = TpGpt2::from_full(&full_model(&device), group).unwrap();
            let mut optim = ZeroOptimizer::new(settings(Stage::Zero1, 0.05), groups.data.clone())
                .unwrap()
                .with_tensor_parallel(groups.tensor.clone(), model.tensor_splits());
            if load {
                model = optim.load_checkpoint(&dir, None, model).unwrap().0;
            }
            let per_rank = GLOBAL_BATCH / 2;
            let d = groups.coords.data;
            for step in steps.clone() {
                let batch = tokens(step, d * per_rank..(d + 1) * per_rank, &device);
                let loss = model.loss(batch.clone(), batch);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.try_step(LR, model, grads).unwrap();
            }
            if save {
                optim.save_checkpoint(&dir, None, &serde_json::Value::Null).unwrap();
            }
            (groups.coords, values(&model))
        })
    };
    let whole = run(0..STEPS, false, false);
    run(0..2, false, true);
    for t in 0..2 {
        assert!(
            dir.join(format!("tensor_rank_{t}")).join("latest").is_file(),
            "tensor rank {t}'s checkpoint"
        );
    }
    let resumed = run(2..STEPS, true, false);
    for ((coords, got), (_, want)) in resumed.iter().zip(&whole) {
        assert_eq!(got, want, "{coords:?}: resumed against uninterrupted");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Megatron with ZeRO-3 through `ZeroOptimizer`: `ShardedTpGpt2` (each block's slice a
/// `ZeroModule`, cut over the data-parallel ranks by `initialize_settings`) trains like one
/// process (data × tensor 2 × 2, accumulation, clipping by the whole model's norm).
#[test]
fn zero_optimizer_at_stage_3_with_tensor_parallelism_trains_like_one_process() {
    use burn::optim::GradientsAccumulator;
    use zero_burn::sharded::UnitComm;
    // (data, tensor, clip, accumulation): 1 × 4 cuts each unit over one rank (padded) while
    // every block's slice is a quarter of it.
    for (data, tensor, clip, gas) in [(2, 2, 0.0, 1), (2, 2, 0.05, 2), (1, 4, 0.05, 2)] {
        let reference = reference_training(clip);
        let results = on_layout(data, tensor, |groups| {
            let device = Default::default();
            let group = TpGroup::new(groups.tensor.clone());
            let model = TpGpt2::from_full(&full_model(&device), group.clone())
                .unwrap()
                .into_sharded();
            let units: UnitComm<Flex> = std::sync::Arc::new(zero_burn::HostStaged::new(groups.data.clone()));
            let (mut model, optim) =
                zero_burn::initialize_settings(settings(Stage::Zero3, clip), model, groups.data.clone(), units)
                    .unwrap();
            assert!(model.blocks.iter().all(|b| b.is_sharded()), "the blocks are cut");
            assert!(model.embed.is_sharded(), "the embeddings are cut");
            let mut optim = optim.with_tensor_parallel(groups.tensor.clone(), model.tensor_splits());
            let per_micro = GLOBAL_BATCH / data / gas;
            let d = groups.coords.data;
            for step in 0..STEPS {
                let mut accumulator = GradientsAccumulator::new();
                for micro in 0..gas {
                    let start = (d * gas + micro) * per_micro;
                    let batch = tokens(step, start..start + per_micro, &device);
                    let loss = model.loss(batch.clone(), batch).unwrap().div_scalar(gas as f32);
                    accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
                }
                model = optim.try_step(LR, model, accumulator.grads()).unwrap();
            }
            group.check().unwrap();
            let want = values(&TpGpt2::from_full(&model_from(&reference, &device), group.clone()).unwrap());
            // The trained model whole: each unit gathered.
            let embed = model.embed.gathered().unwrap();
            let got = TpGpt2 {
                wte: embed.wte,
                wpe: embed.wpe,
                blocks: model.blocks.iter().map(|b| b.gathered().unwrap()).collect(),
                ln_f: model.ln_f.clone(),
            };
            (groups.coords, values(&got), want)
        });
        assert_weights_close(
            &format!("ZeroOptimizer stage 3 tp {tensor} dp {data} gas {gas} clip {clip}"),
            results,
        );
    }
}

/// A non-finite loss on one rank of a 2 data × 2 tensor layout (data rank 1 of tensor rank 1:
/// rank 3 of the four) decides the step on every rank, with the host state and with the
/// tensor state: under `Skip` all four skip it and keep their weights; under the default
/// `Error` all four fail, naming rank 3. A tensor rank that stepped beside one that skipped
/// would hold slices of another model. Reference: each rank's weights before the step.
#[test]
fn a_non_finite_loss_on_one_tensor_rank_decides_the_step_on_every_rank() {
    use zero_burn::NonFinitePolicy;
    for tensors in [false, true] {
        for policy in [NonFinitePolicy::Skip, NonFinitePolicy::Error] {
            let results = on_layout(2, 2, |groups| {
                let device = Default::default();
                let model = TpGpt2::from_full(&full_model(&device), TpGroup::new(groups.tensor.clone())).unwrap();
                let mut s = settings(Stage::Zero2, 1.0);
                s.precision.non_finite = policy;
                let mut optim = ZeroOptimizer::new(s, groups.data.clone())
                    .unwrap()
                    .with_tensor_state(tensors)
                    .with_tensor_parallel(groups.tensor.clone(), model.tensor_splits());
                let per_rank = GLOBAL_BATCH / 2;
                let d = groups.coords.data;
                let mut model = model;
                let mut outcome = Ok(());
                let mut before = Vec::new();
                for step in 0..2 {
                    let batch = tokens(step, d * per_rank..(d + 1) * per_rank, &device);
                    let loss = model.loss(batch.clone(), batch);
                    if step == 1 && (groups.coords.data, groups.coords.tensor) == (1, 1) {
                        optim.note_loss(f64::NAN);
                    }
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    before = values(&model);
                    match optim.try_step(LR, model.clone(), grads) {
                        Ok(next) => model = next,
                        Err(e) => outcome = Err(e.to_string()),
                    }
                }
                let skipped = optim.last_step().is_some_and(|r| r.skipped);
                (outcome, skipped, before == values(&model))
            });
            let label = format!("tensor state {tensors}, {policy:?}");
            for (rank, (outcome, skipped, kept)) in results.into_iter().enumerate() {
                match policy {
                    NonFinitePolicy::Skip => {
                        assert!(outcome.is_ok(), "{label}: rank {rank} failed: {outcome:?}");
                        assert!(skipped && kept, "{label}: rank {rank} did not skip the step");
                    }
                    _ => {
                        let e = outcome.expect_err(&format!("{label}: rank {rank} must fail"));
                        assert!(e.contains("rank 3"), "{label}: rank {rank}: {e}");
                    }
                }
            }
        }
    }
}

/// A vocabulary that does not split evenly (47 tokens over 2 and 4 ranks) is padded with zero
/// rows on the last rank(s), as Megatron-LM pads it. Reference: the full model on one thread.
/// Every rank's logits of its real tokens, the loss, and every gradient equal the full model's
/// (the padding rows' gradient is 0); a step of `ZeroOptimizer` leaves the padding at 0, and the
/// checkpoint records the vocabulary's whole length, which `zero to-fp32` cuts the merged table
/// back to.
#[test]
fn an_uneven_vocabulary_is_padded_and_matches_the_full_model() {
    let config = Gpt2Config::new(47, 16, EMBD, LAYERS, HEADS);
    let device: Device<B> = Default::default();
    let batch = |device: &Device<B>| {
        let ids: Vec<i64> = (0..3 * SEQ).map(|i| ((i * 13 + 5) % 47) as i64).collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [3, SEQ]), device)
    };
    let full = full_model_of(&config, &device);
    let want_logits = zero_burn::params::tensor_to_vec(full.forward(batch(&device)));
    let want_loss = full.loss(batch(&device), batch(&device));
    let mut grads = want_loss.backward();
    let want_grads = gradients(&full, &mut grads);
    let want_loss: f32 = want_loss.into_scalar();
    for tp in [2, 4] {
        let results = on_layout(1, tp, |groups| {
            let device = Default::default();
            let group = TpGroup::new(groups.tensor.clone());
            let model = TpGpt2::from_full(&full_model_of(&config, &device), group.clone()).unwrap();
            let logits = zero_burn::params::tensor_to_vec(model.forward(batch(&device)));
            let loss = model.loss(batch(&device), batch(&device));
            let mut grads = loss.backward();
            let mut got = Vec::new();
            take_grads::<B, _>(&model, &mut grads, |_, g| got.push(g.expect("a gradient")));
            let sliced = write_values(config.init::<B>(&device), &device, false, |i| want_grads[i].clone());
            let want = values(&TpGpt2::from_full(&sliced, group.clone()).unwrap());
            // One step: the padding rows take no update.
            let mut optim = ZeroOptimizer::new(settings(Stage::Zero1, 1.0), groups.data.clone())
                .unwrap()
                .with_tensor_parallel(groups.tensor.clone(), model.tensor_splits());
            let split = model.tensor_splits()("wte.weight");
            // The gradients again (take_grads took the first backward's).
            let grads = model.loss(batch(&device), batch(&device)).backward();
            let step = optim
                .try_step(LR, model.clone(), GradientsParams::from_grads(grads, &model))
                .unwrap();
            let rows = step.wte.weight.val();
            let [local, _] = rows.dims();
            let real = 47usize.saturating_sub(groups.coords.tensor * local).min(local);
            let padding = if real < local {
                zero_burn::params::tensor_to_vec(rows.narrow(0, real, local - real))
            } else {
                Vec::new()
            };
            group.check().unwrap();
            (
                groups.coords.tensor,
                local,
                logits,
                loss.into_scalar(),
                got,
                want,
                padding,
                split,
            )
        });
        for (rank, local, logits, loss, got, want, padding, split) in results {
            let label = format!("vocab 47 over {tp}, rank {rank}");
            assert_eq!(local, 47usize.div_ceil(tp), "{label}: rows per rank");
            // This rank's columns of each row of the reference's [3, SEQ, 47] logits; padding
            // columns past 47 are not tokens.
            let start = rank * local;
            assert_eq!(logits.len() / local, want_logits.len() / 47, "{label}: rows of logits");
            for (row, want_row) in logits.chunks(local).zip(want_logits.chunks(47)) {
                for (c, &v) in row.iter().enumerate().take(47usize.saturating_sub(start)) {
                    let w = want_row[start + c];
                    assert!(
                        (v - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{label}: logit {} {v} vs {w}",
                        start + c
                    );
                }
            }
            assert!(
                (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
                "{label}: loss {loss} vs {want_loss}"
            );
            assert_close(&format!("{label}: gradients"), &got, &want, 1e-5);
            assert!(
                padding.iter().all(|&v| v == 0.0),
                "{label}: the padding moved: {padding:?}"
            );
            assert_eq!(
                split,
                Some(zero_burn::TensorSplit::padded(0, 47)),
                "{label}: the recorded split"
            );
        }
    }
}

/// LAMB's trust ratio is ‖p‖ / ‖u‖ of each whole parameter tensor. Under tensor parallelism a
/// split tensor's norms are the sums over its slices, and a tensor every tensor rank holds whole
/// counts once. Reference: the full model on one process, stepped by `ZeroOptimizer`'s LAMB at
/// stage 0 (the host kernel, no tensor split). A ratio from one rank's slice alone moves the
/// split weights by more than the tolerance.
#[test]
fn lamb_with_tensor_parallelism_trains_like_one_process() {
    use zero_core::optim::{LambSpec, LambVariant};
    let lamb = |stage| {
        let mut s = settings(stage, 0.0);
        s.optimizer = OptimizerSpec::Lamb(LambSpec {
            lr: LR,
            weight_decay: WEIGHT_DECAY,
            eps: EPS,
            // Clamps that do not bind here, so that every ratio shows.
            max_coeff: 1e6,
            min_coeff: 0.0,
            variant: LambVariant::Paper,
            ..LambSpec::default()
        });
        s
    };
    let reference = {
        let device = Default::default();
        let mut model = full_model(&device);
        let group = ThreadGroup::new_group(1).unwrap().remove(0);
        let mut optim = ZeroOptimizer::new(lamb(Stage::Zero0), group).unwrap();
        for step in 0..STEPS {
            let batch = tokens(step, 0..GLOBAL_BATCH, &device);
            let grads = GradientsParams::from_grads(model.loss(batch.clone(), batch).backward(), &model);
            model = optim.try_step(LR, model, grads).unwrap();
        }
        values(&model)
    };
    assert!(
        max_relative_error(
            "the initial weights",
            &values(&full_model(&Default::default())),
            &reference
        ) > 1e-3,
        "the reference trained"
    );
    for (stage, dp, tp, tensors) in [
        (Stage::Zero0, 1, 2, true),
        (Stage::Zero1, 2, 2, true),
        (Stage::Zero2, 1, 4, false),
        (Stage::Zero1, 2, 2, false),
    ] {
        let results = on_layout(dp, tp, |groups| {
            let device = Default::default();
            let group = TpGroup::new(groups.tensor.clone());
            let mut model = TpGpt2::from_full(&full_model(&device), group.clone()).unwrap();
            let mut optim = ZeroOptimizer::new(lamb(stage), groups.data.clone())
                .unwrap()
                .with_tensor_state(tensors)
                .with_tensor_parallel(groups.tensor.clone(), model.tensor_splits());
            let per_rank = GLOBAL_BATCH / dp;
            let d = groups.coords.data;
            for step in 0..STEPS {
                let batch = tokens(step, d * per_rank..(d + 1) * per_rank, &device);
                let grads = GradientsParams::from_grads(model.loss(batch.clone(), batch).backward(), &model);
                model = optim.try_step(LR, model, grads).unwrap();
            }
            let want = values(&TpGpt2::from_full(&model_from(&reference, &device), group).unwrap());
            (groups.coords, values(&model), want)
        });
        assert_weights_close(
            &format!("LAMB stage {stage:?} dp {dp} tp {tp} tensor state {tensors}"),
            results,
        );
    }
}
