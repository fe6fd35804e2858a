//! Prefetching at stage 3 (`overlap_comm` with `stage3_prefetch_bucket_size`): once a
//! micro-batch has shown the order of the units, each gather in forward starts the gathers of
//! the units that come next, within the budget (at the end of forward, those its backward
//! begins with), and each gather again in backward those that come next there; the last unit
//! of forward is kept for the start of backward; what is prefetched is used only for the shard
//! value it was gathered from.
//! References: for the values, the same run with nothing prefetched (bit for bit; that run
//! equals one process, tested elsewhere); for the schedule, the units' order in this model.

use crate::common;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use common::counting::{Counting, Gather};
use std::sync::Arc;
use zero_burn::params::write_values;
use zero_burn::sharded::{shard_len, shard_units_with, UnitComm, UnitPlan, ZeroModule};
use zero_burn::HostStaged;
use zero_core::config::DeepSpeedConfig;

type AB = Autodiff<Flex, BalancedCheckpointing>;

const WORLD: usize = 2;
const ROWS: usize = 4;
const GAS: usize = 2;
const STEPS: usize = 3;
const LR: f64 = 0.05;
/// Layer sizes whose whole vectors (every rank's shard, padded) differ: 32, 96, 64, 160
/// elements at world 2, so that a gather's length names its unit.
const SIZES: [(usize, usize); 4] = [(4, 6), (6, 12), (12, 3), (3, 40)];
/// Units are started while fewer elements than this are in flight (DeepSpeed's rule: the last
/// one may pass it).
const BUDGET: usize = 160;

fn whole_len(u: usize) -> usize {
    let (i, o) = SIZES[u];
    shard_len(i * o + o, WORLD) * WORLD
}

#[derive(Module, Debug)]
struct Chain<B: Backend> {
    units: Vec<ZeroModule<B, Linear<B>>>,
}

impl<B: zero_burn::sharded::ShardBackend> Chain<B> {
    fn whole(device: &B::Device) -> Self {
        let units = SIZES
            .iter()
            .enumerate()
            .map(|(u, &(i, o))| {
                let linear = write_values(LinearConfig::new(i, o).init(device), device, true, |p| {
                    let n = if p == 0 { i * o } else { o };
                    (0..n)
                        .map(|k| 0.4 * ((k * 5 + u * 97 + p * 13) as f32 * 0.31).sin())
                        .collect()
                });
                ZeroModule::new(linear)
            })
            .collect();
        Chain { units }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let mut h = x;
        for unit in &self.units {
            h = unit.unshard(&h).unwrap().forward(h).tanh();
        }
        (h - y).powf_scalar(2.0).mean()
    }
}

fn rows<B: Backend>(rank: usize, cols: usize, salt: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..ROWS * cols)
        .map(|k| ((k * 3 + rank * 31 + salt * 7) as f32 * 0.29).cos())
        .collect();
    Tensor::from_data(TensorData::new(values, [ROWS, cols]), device)
}

fn config(overlap: bool) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": {}, "gradient_accumulation_steps": {GAS},
        "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "weight_decay": 0.01}}}},
        "zero_optimization": {{"stage": 3, "overlap_comm": {overlap},
            "stage3_prefetch_bucket_size": {BUDGET}, "stage3_param_persistence_threshold": 0}}}}"#,
        ROWS * WORLD * GAS,
    );
    DeepSpeedConfig::from_str(&text, "prefetch.json")
        .expect("config")
        .config
}

/// Each rank's shards after the run, and its gathers step by step.
type Run = Vec<(Vec<Vec<f32>>, Vec<Vec<Gather>>)>;

/// `STEPS` steps through `initialize` and `ZeroOptimizer`.
fn train(overlap: bool) -> Run {
    common::on_ranks(WORLD, |rank, group| {
        let device = Default::default();
        let counting = Arc::new(Counting::new(HostStaged::new(group.clone())));
        let (mut model, mut optim) = zero_burn::initialize_on(
            &config(overlap),
            Chain::<AB>::whole(&device),
            group,
            counting.clone(),
            &zero_burn::InitOptions::default(),
        )
        .expect("initialize");
        counting.take_gathers();
        let mut steps = Vec::new();
        for step in 0..STEPS {
            let mut acc = GradientsAccumulator::new();
            for micro in 0..GAS {
                let x = rows::<AB>(rank, SIZES[0].0, step * GAS + micro, &device);
                let y = rows::<AB>(rank, SIZES[3].1, 50 + step * GAS + micro, &device);
                let loss = model.loss(x, y).div_scalar(GAS as f32);
                acc.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            model = optim.step(LR, model, acc.grads());
            steps.push(counting.take_gathers());
        }
        (shards(&model), steps)
    })
}

fn shards(model: &Chain<AB>) -> Vec<Vec<f32>> {
    model
        .units
        .iter()
        .map(|u| zero_burn::params::tensor_to_vec(u.shard().val().inner()))
        .collect()
}

/// For each wait, the elements of the other gathers started and not yet waited for: what was
/// in flight ahead of the unit being waited for. Also checks that every gather started is
/// waited for, in the order started.
fn ahead_at_each_wait(gathers: &[Gather]) -> Vec<usize> {
    let mut open: Vec<usize> = Vec::new();
    let mut ahead = Vec::new();
    for g in gathers {
        match *g {
            Gather::Start(len) => open.push(len),
            Gather::Wait(len) => {
                assert_eq!(
                    open.first(),
                    Some(&len),
                    "gathers are waited for in the order started: {gathers:?}"
                );
                open.remove(0);
                ahead.push(open.iter().sum());
            }
        }
    }
    assert!(
        open.is_empty(),
        "gathers started and never used: {open:?} in {gathers:?}"
    );
    ahead
}

#[test]
fn each_gather_starts_the_next_units_within_the_budget_and_changes_no_value() {
    let with = train(true);
    let without = train(false);
    for (rank, ((shards, steps), (plain, plain_steps))) in with.iter().zip(&without).enumerate() {
        assert_eq!(shards, plain, "rank {rank}: prefetching changed the trained values");
        for (step, (gathers, plain_gathers)) in steps.iter().zip(plain_steps).enumerate() {
            let lens = |g: &[Gather]| {
                let mut l: Vec<usize> = g
                    .iter()
                    .filter_map(|g| match g {
                        Gather::Start(n) => Some(*n),
                        Gather::Wait(_) => None,
                    })
                    .collect();
                l.sort();
                l
            };
            // Without prefetching: each unit in each micro-batch's forward and again in its
            // backward, but for unit 0, whose input needs no gradient (its backward needs its
            // input, not its weights).
            let per_micro: Vec<usize> = [0, 1, 1, 2, 2, 3, 3].map(whole_len).to_vec();
            let plain_want: Vec<usize> = {
                let mut l = [per_micro.clone(), per_micro.clone()].concat();
                l.sort();
                l
            };
            assert_eq!(lens(plain_gathers), plain_want, "rank {rank}, step {step}");
            assert!(
                ahead_at_each_wait(plain_gathers).iter().all(|&a| a == 0),
                "rank {rank}, step {step}: without overlap_comm nothing is prefetched: {plain_gathers:?}"
            );
            // With it, the last unit of a forward that follows the learned order keeps its
            // whole vector for the start of its backward: gathered once in that micro-batch. The
            // first step learns the order in its first micro-batch.
            let scheduled = if step == 0 { 1 } else { GAS };
            let mut want = plain_want.clone();
            for _ in 0..scheduled {
                let last = want.iter().rposition(|&l| l == whole_len(3)).expect("unit 3");
                want.remove(last);
            }
            assert_eq!(lens(gathers), want, "rank {rank}, step {step}");
            let ahead = ahead_at_each_wait(gathers);
            assert!(
                ahead.iter().all(|&a| a < BUDGET + whole_len(3)),
                "rank {rank}, step {step}: more than the budget and one unit in flight: {ahead:?} in {gathers:?}"
            );
            // What was in flight at each wait. Forward: at unit 0, units 1 and 2 start
            // (96, then 64: 160 in flight, the budget, so 3 waits); at 1, unit 3 starts beside 2
            // (64 < 160); at 2, unit 3 is in flight, and with 160 in flight nothing more starts;
            // at 3, the end of forward, the units its backward needs next start (2, then 1;
            // 3 itself is kept). Backward: unit 3 is at hand (no gather to wait for); at 2, unit 1
            // is in flight; at 1, nothing comes after.
            let (l1, l2, l3) = (whole_len(1), whole_len(2), whole_len(3));
            let once = [l1 + l2, l2 + l3, l3, l2 + l1, l1, 0];
            let want: Vec<usize> = if step == 0 {
                [0; 7].iter().chain(&once).copied().collect()
            } else {
                once.iter().chain(&once).copied().collect()
            };
            assert_eq!(ahead, want, "rank {rank}, step {step}: {gathers:?}");
            assert_eq!(whole_len(0), 32, "the sizes name the units");
            assert_eq!((l1, l2, l3), (96, 64, 160), "the sizes name the units");
        }
    }
}

/// With Burn's own optimizer (which tells the schedule nothing), a forward's prefetches gather
/// the shards of the last forward, which the step has since replaced: they are dropped, the
/// units gathered again, and the values are those of a run without prefetching.
#[test]
fn a_prefetch_of_a_shard_the_step_replaced_is_not_used() {
    let run = |prefetch: usize| {
        common::on_ranks(WORLD, move |rank, group| {
            let device = Default::default();
            let comm: UnitComm<Flex> = Arc::new(HostStaged::new(group));
            let plan = UnitPlan {
                prefetch,
                ..UnitPlan::default()
            };
            let mut model = shard_units_with(Chain::<AB>::whole(&device), comm, &plan).expect("cut");
            let mut optim = AdamWConfig::new().init();
            for step in 0..STEPS {
                let x = rows::<AB>(rank, SIZES[0].0, step, &device);
                let y = rows::<AB>(rank, SIZES[3].1, 50 + step, &device);
                let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                model = optim.step(LR, model, grads);
            }
            shards(&model)
        })
    };
    let (with, without) = (run(BUDGET), run(0));
    assert_eq!(with, without, "a stale prefetch was used");
}
