//! Stage 2 on the `ZeroModule` path: each unit's parameter, and the gradient Burn's backward
//! leaves for it, is the rank's shard, a view of the unit's whole vector; the whole vector is
//! gathered once per step (at the end of the step, from the new shards: ZeRO-2's all-gather of
//! the updated parameters) and kept, so neither forward nor backward (which under
//! `BalancedCheckpointing` needs the weights again) gathers; the gradient is reduce-scattered in
//! every micro-batch's backward. Reference for the counts: ZeRO-2's schedule
//! for three units (one gather per unit per step, one reduce-scatter per unit per micro-batch);
//! for the values: the same model trained on one process by Burn's AdamW.

use crate::common;
use crate::sharded_support;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::DType;
use common::counting::Counting;
use sharded_support::*;
use std::sync::{Arc, Mutex};
use zero_burn::sharded::shard_len;
use zero_burn::HostStaged;
use zero_core::config::DeepSpeedConfig;
use zero_test_support::{assert_close, max_abs_diff};

type AB = Autodiff<Flex, BalancedCheckpointing>;

const GAS: usize = 2;
const STEPS: usize = 3;
const LR: f64 = 0.05;

fn config() -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": {}, "gradient_accumulation_steps": {GAS},
        "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "eps": 1e-6, "weight_decay": 0.01}}}},
        "zero_optimization": {{"stage": 2}}}}"#,
        ROWS * GAS,
    );
    DeepSpeedConfig::from_str(&text, "stage2.json").expect("config").config
}

/// Each unit's whole values, one process, Burn's AdamW on the plain layers over the same data.
fn one_process() -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut layers = units::<AB>(&device);
    let mut optim = AdamWConfig::new().with_epsilon(1e-6).with_weight_decay(0.01).init();
    for step in 0..STEPS {
        let mut acc = GradientsAccumulator::new();
        for micro in 0..GAS {
            let salt = step * GAS + micro;
            let x = rows::<AB>(0..ROWS, SIZES[0].0, salt, &device);
            let y = rows::<AB>(0..ROWS, SIZES[2].1, salt + 100, &device);
            let l = loss(&layers, x, y).div_scalar(GAS as f32);
            acc.accumulate(&layers, GradientsParams::from_grads(l.backward(), &layers));
        }
        layers = optim.step(LR, layers, acc.grads());
    }
    layers
        .iter()
        .map(|l| {
            let mut v = zero_burn::params::tensor_to_vec(l.weight.val().inner().flatten::<1>(0, 1));
            if let Some(b) = &l.bias {
                v.extend(zero_burn::params::tensor_to_vec(b.val().inner()));
            }
            v
        })
        .collect()
}

#[test]
fn each_unit_is_gathered_once_per_step_and_its_gradient_is_the_shard() {
    let world = 2;
    let want = one_process();
    let calls_per_rank = Mutex::new(Vec::new());
    let runs = common::on_ranks(world, |rank, group| {
        let device = Default::default();
        let counting = Arc::new(Counting::new(HostStaged::new(group.clone())));
        let model = Net::<AB>::whole(&device);
        let (mut model, mut optim) = zero_burn::initialize_on(
            &config(),
            model,
            group,
            counting.clone(),
            &zero_burn::InitOptions::default(),
        )
        .expect("initialize");
        counting.take();
        let mut steps = Vec::new();
        for step in 0..STEPS {
            let mut acc = GradientsAccumulator::new();
            for micro in 0..GAS {
                let salt = step * GAS + micro;
                // This rank's half of the micro-batch's rows; the mean over ranks is the whole's.
                let half = rank * ROWS / world..(rank + 1) * ROWS / world;
                let x = rows::<AB>(half.clone(), SIZES[0].0, salt, &device);
                let y = rows::<AB>(half, SIZES[2].1, salt + 100, &device);
                let grads = GradientsParams::from_grads(model.loss(x, y).div_scalar(GAS as f32).backward(), &model);
                for (u, unit) in model.units.iter().enumerate() {
                    let g = grads.get::<Flex, 1>(unit.shard().id).expect("a unit's gradient");
                    let numel = SIZES[u].0 * SIZES[u].1 + SIZES[u].1;
                    assert_eq!(
                        g.dims()[0],
                        shard_len(numel, world),
                        "unit {u}: the gradient is the shard"
                    );
                }
                acc.accumulate(&model, grads);
            }
            model = optim.step(LR, model, acc.grads());
            steps.push(counting.take());
        }
        calls_per_rank.lock().expect("calls").push((rank, optim.memory()));
        (
            model
                .units
                .iter()
                .map(|u| zero_burn::params::tensor_to_vec(u.shard().val().inner()))
                .collect::<Vec<_>>(),
            steps,
        )
    });
    // The collectives of every step: a gather per unit (the shard's length), a reduce-scatter
    // per unit per micro-batch (the whole padded vector), then the optimizer's scalars.
    for (rank, (_, steps)) in runs.iter().enumerate() {
        for (step, calls) in steps.iter().enumerate() {
            let tensors: Vec<_> = calls.iter().filter(|c| c.0 != "scalars").collect();
            let gathers: Vec<usize> = tensors.iter().filter(|c| c.0 == "all_gather").map(|c| c.1).collect();
            let scatters = tensors.iter().filter(|c| c.0 == "reduce_scatter").count();
            let lens: Vec<usize> = SIZES.iter().map(|&(i, o)| shard_len(i * o + o, world)).collect();
            assert_eq!(gathers, lens, "rank {rank}, step {step}: one gather per unit");
            assert_eq!(scatters, SIZES.len() * GAS, "rank {rank}, step {step}: {calls:?}");
            assert_eq!(
                tensors.len(),
                gathers.len() + scatters,
                "rank {rank}, step {step}: {calls:?}"
            );
            assert!(tensors.iter().all(|c| c.2 == DType::F32));
        }
    }
    // The values: the ranks' shards put together equal one process's Burn AdamW.
    for (u, want) in want.iter().enumerate() {
        let got: Vec<f32> = runs.iter().flat_map(|r| r.0[u].clone()).take(want.len()).collect();
        assert_close(&format!("unit {u}"), &got, want, 1e-6);
    }
    // Memory: each rank holds every unit's whole vector once (ZeRO-2's parameters; the shards
    // are views of it), gradients and optimizer state of its shards only, nothing gathered
    // beyond the kept.
    let total: usize = SIZES.iter().map(|&(i, o)| shard_len(i * o + o, world) * world).sum();
    let shards: usize = SIZES.iter().map(|&(i, o)| shard_len(i * o + o, world)).sum();
    for (rank, memory) in calls_per_rank.into_inner().expect("calls") {
        assert_eq!(memory.parameters.current, total * 4, "rank {rank}: {memory:?}");
        assert_eq!(memory.gradients.current, shards * 4, "rank {rank}: {memory:?}");
        assert_eq!(
            memory.optimizer_state.current,
            2 * shards * 4,
            "rank {rank}: {memory:?}"
        );
        assert_eq!(memory.gathered.peak, 0, "rank {rank}: {memory:?}");
    }
}

/// A copy of the model taken before a step keeps its own weights: the kept vector belongs to
/// the shard value it was gathered from.
#[test]
fn a_copy_from_before_a_step_computes_with_its_own_weights() {
    let world = 2;
    let outs = common::on_ranks(world, |rank, group| {
        let device = Default::default();
        let collective = Arc::new(HostStaged::new(group.clone()));
        let (model, mut optim) = zero_burn::initialize_on(
            &config(),
            Net::<AB>::whole(&device),
            group,
            collective,
            &zero_burn::InitOptions::default(),
        )
        .expect("initialize");
        let x = rows::<AB>(0..ROWS, SIZES[0].0, 7, &device);
        let before = model.valid().forward(x.clone().inner());
        let old = model.clone();
        let half = rank * ROWS / world..(rank + 1) * ROWS / world;
        let y = rows::<AB>(half.clone(), SIZES[2].1, 100, &device);
        let xs = rows::<AB>(half, SIZES[0].0, 0, &device);
        let grads = GradientsParams::from_grads(model.loss(xs, y).backward(), &model);
        let new = optim.step(LR, model, grads);
        let after = new.forward(x.clone());
        let old_again = old.forward(x);
        (
            zero_burn::params::tensor_to_vec(before.flatten::<1>(0, 1)),
            zero_burn::params::tensor_to_vec(old_again.inner().flatten::<1>(0, 1)),
            zero_burn::params::tensor_to_vec(after.inner().flatten::<1>(0, 1)),
        )
    });
    for (rank, (before, old_again, after)) in outs.iter().enumerate() {
        assert_eq!(before, old_again, "rank {rank}: the old copy's weights");
        assert!(
            max_abs_diff(
                &format!("rank {rank}: outputs before and after the step"),
                before,
                after
            ) > 1e-4,
            "rank {rank}: the step changed the weights"
        );
    }
}

/// A forward that reuses the kept whole vectors calls one scalar all-reduce per unit where the
/// ranks may be threads of one process (the fence against burn 0.21's graph lock), and no
/// collective at all where the collective says its ranks are processes of their own (NCCL's).
/// Forward only: without a backward, rank threads without the fence cannot meet that lock.
#[test]
fn a_stage_2_forward_communicates_only_where_ranks_may_share_a_process() {
    for separate in [false, true] {
        let logs = common::on_ranks(2, |_, group| {
            let device = Default::default();
            let counting = Arc::new(Counting::new(HostStaged::new(group.clone())).in_processes(separate));
            let (model, _optim) = zero_burn::initialize_on(
                &config(),
                Net::<AB>::whole(&device),
                group,
                counting.clone(),
                &zero_burn::InitOptions::default(),
            )
            .expect("initialize");
            counting.take();
            let x = rows::<AB>(0..ROWS, SIZES[0].0, 3, &device);
            for _ in 0..2 {
                let _ = model.forward(x.clone());
            }
            counting.take()
        });
        for (rank, calls) in logs.iter().enumerate() {
            let want = if separate { 0 } else { 2 * SIZES.len() };
            assert_eq!(
                calls.len(),
                want,
                "rank {rank}, separate processes {separate}: {calls:?}"
            );
            assert!(calls.iter().all(|c| c.0 == "scalars"), "rank {rank}: {calls:?}");
        }
    }
}
