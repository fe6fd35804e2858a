//! The stage-3 gather op inside Burn's autodiff: a model that is not a chain (a skip connection
//! across sharded units) trained on each rank's slice of the batch gives every rank's shard the
//! gradient of plain autodiff on one process over the whole batch (the reference), cut to that
//! shard. Worlds 1, 2 and 4 as threads, with and without Burn's balanced checkpointing (which
//! frees the gathered weights after forward and gathers them again in backward).

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use zero_burn::params::read_values;

use crate::sharded_support;
use sharded_support::*;
use zero_test_support::{assert_close, max_abs, max_abs_diff};

/// Per unit, the flat gradient of plain autodiff on one process, whole batch.
fn reference() -> Vec<Vec<f32>> {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let u = units::<B>(&device);
    let grads = loss(&u, rows(0..ROWS, 4, 0, &device), rows(0..ROWS, 3, 5, &device)).backward();
    u.iter()
        .map(|unit| {
            let values = |t: Tensor<Flex, 1>| t.into_data().to_vec::<f32>().unwrap();
            let mut flat = values(unit.weight.grad(&grads).expect("a weight gradient").flatten(0, 1));
            if let Some(bias) = &unit.bias {
                flat.extend(values(bias.grad(&grads).expect("a bias gradient")));
            }
            flat
        })
        .collect()
}

/// Per rank, per unit, the shard's gradient from `world` ranks each on its rows.
fn sharded<C: CheckpointStrategy>(world: usize) -> Vec<Vec<Vec<f32>>> {
    on_ranks(world, |rank, comm| {
        let device = Default::default();
        let net = Net::<Autodiff<Flex, C>>::new(comm, &device);
        let per = ROWS / world;
        let x = rows::<Autodiff<Flex, C>>(rank * per..(rank + 1) * per, 4, 0, &device).require_grad();
        let target = rows::<Autodiff<Flex, C>>(rank * per..(rank + 1) * per, 3, 5, &device);
        let grads = net.loss(x, target).backward();
        net.units
            .iter()
            .map(|u| {
                u.shard()
                    .grad(&grads)
                    .expect("a shard gradient")
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap()
            })
            .collect()
    })
}

fn check<C: CheckpointStrategy>(label: &str) {
    let want = reference();
    for world in [1, 2, 4] {
        let got = sharded::<C>(world);
        for (u, whole) in want.iter().enumerate() {
            let per = zero_burn::sharded::shard_len(whole.len(), world);
            let mut padded = whole.clone();
            padded.resize(per * world, 0.0);
            for (rank, shards) in got.iter().enumerate() {
                let expect = &padded[rank * per..(rank + 1) * per];
                let what = format!("{label}, world {world}, unit {u}, rank {rank}");
                let err = max_abs_diff(&what, &shards[u], expect) / max_abs(&what, whole);
                assert!(err < 1e-6, "{what}: off by {err:e}");
            }
        }
    }
}

#[test]
fn shard_gradients_equal_plain_autodiff_without_checkpointing() {
    check::<NoCheckpointing>("no checkpointing");
}

#[test]
fn shard_gradients_equal_plain_autodiff_under_balanced_checkpointing() {
    check::<BalancedCheckpointing>("balanced checkpointing");
}

/// The ordinary Burn loop at stage 3: every parameter is in a `ZeroModule`, so Burn's own AdamW
/// (element-wise) steps each rank's shards with the averaged gradient. Reference: the same
/// model, unsharded, trained by Burn's AdamW on one process over the whole batch; after 5 steps
/// the shards, put together, equal its parameters. The `valid()` copy (inner backend, plain
/// gathers) computes the reference's loss.
#[test]
fn burns_adamw_trains_zero_modules_like_one_process() {
    const STEPS: usize = 5;
    let adamw = || AdamWConfig::new().with_weight_decay(0.01);
    let device = Default::default();
    type B = Autodiff<Flex>;
    let mut plain = units::<B>(&device);
    let mut optim = adamw().init();
    for _ in 0..STEPS {
        let grads = loss(&plain, rows(0..ROWS, 4, 0, &device), rows(0..ROWS, 3, 5, &device)).backward();
        let params = GradientsParams::from_grads(grads, &plain);
        plain = optim.step(1e-2, plain, params);
    }
    let want_loss = loss(
        &plain.valid(),
        rows(0..ROWS, 4, 0, &device),
        rows(0..ROWS, 3, 5, &device),
    )
    .into_scalar();
    let want: Vec<Vec<f32>> = plain
        .iter()
        .map(|u| {
            let mut v = Vec::new();
            read_values::<B, _>(u, |_, p| v.extend(p));
            v
        })
        .collect();

    for world in [1, 2, 4] {
        let runs = on_ranks(world, |rank, comm| {
            let device = Default::default();
            let mut net = Net::<B>::new(comm, &device);
            let mut optim = adamw().init();
            let per = ROWS / world;
            for _ in 0..STEPS {
                let x = rows::<B>(rank * per..(rank + 1) * per, 4, 0, &device);
                let target = rows::<B>(rank * per..(rank + 1) * per, 3, 5, &device);
                let grads = GradientsParams::from_grads(net.loss(x, target).backward(), &net);
                net = optim.step(1e-2, net, grads);
            }
            let valid = net.valid();
            let loss = valid
                .loss(rows(0..ROWS, 4, 0, &device), rows(0..ROWS, 3, 5, &device))
                .into_scalar();
            let shards: Vec<Vec<f32>> = net
                .units
                .iter()
                .map(|u| u.shard().val().into_data().to_vec::<f32>().unwrap())
                .collect();
            (shards, loss)
        });
        for (u, whole) in want.iter().enumerate() {
            let got: Vec<f32> = runs
                .iter()
                .flat_map(|(shards, _)| shards[u].clone())
                .take(whole.len())
                .collect();
            assert_close(&format!("world {world}, unit {u}"), &got, whole, 1e-6);
        }
        for (rank, (_, loss)) in runs.iter().enumerate() {
            assert!(
                (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
                "world {world}, rank {rank}: the valid() copy's loss {loss} against {want_loss}"
            );
        }
    }
}

/// A model is cut once: cutting it again (or a clone of it) is an error that says so, not a
/// shard of a shard.
#[test]
fn a_second_cut_over_the_same_ranks_keeps_the_shards_and_a_unit_in_two_fields_is_an_error() {
    let results = on_ranks(2, |_, comm| {
        let net = Net::<Autodiff<Flex>>::new(comm.clone(), &Default::default());
        let shards = |net: &Net<Autodiff<Flex>>| -> Vec<Vec<f32>> {
            net.units
                .iter()
                .map(|u| u.shard().val().into_data().to_vec::<f32>().unwrap())
                .collect()
        };
        let before = shards(&net);
        let again = zero_burn::sharded::shard_units(net, comm.clone(), 0).expect("already cut: kept");
        // A unit whole in a second field (a copy taken before the cut) and cut in the first.
        let whole = Net::<Autodiff<Flex>>::whole(&Default::default());
        let copy = whole.units[0].clone();
        let mut twice = zero_burn::sharded::shard_units(whole, comm.clone(), 0).expect("first cut");
        twice.units.push(copy);
        let error = zero_burn::sharded::shard_units(twice, comm, 0)
            .err()
            .map(|e| e.to_string());
        (before == shards(&again), error)
    });
    for (rank, (kept, error)) in results.iter().enumerate() {
        assert!(kept, "rank {rank}: a second cut changed the shards");
        let e = error
            .as_deref()
            .unwrap_or_else(|| panic!("rank {rank}: a unit in two fields must fail"));
        assert!(e.contains("sharded twice"), "rank {rank}: {e}");
    }
}
