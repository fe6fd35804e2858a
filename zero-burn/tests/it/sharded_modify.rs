//! `ZeroModule::modify` (DeepSpeed's `GatheredParameters` with a modifier rank) in the ordinary
//! Burn loop with `ZeroOptimizer`: rank 0's change to a unit reaches every rank's shard and the
//! optimizer's fp32 masters, the moments kept.
//!
//! Reference: the plain model (the same three linear layers, a skip connection) trained on one
//! process by Burn's own AdamW over the whole batch, with the same change made to its layer
//! between the same steps (Burn's optimizer reads the parameters at every step and keeps its
//! moments), every unit's parameters after the run to 1e-6 of the largest.

use crate::sharded_support;
use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use sharded_support::*;
use zero_burn::params::read_values;
use zero_burn::{EngineSettings, OptimizerOffload, Stage, ZeroError, ZeroOptimizer};
use zero_core::optim::{AdamSpec, OptimizerSpec};
use zero_test_support::{assert_close, max_relative_error};

type AB = Autodiff<Flex>;
const EPS: f64 = 1e-4;
const LR: f64 = 1e-2;
/// Steps before the change, and after it.
const BEFORE: usize = 2;
const AFTER: usize = 3;

/// The change: the second layer's weight halved (its bias kept), a new leaf (a weight that is
/// the output of an op on the old one would get no gradient of its own). A rank other than the
/// modifier triples it instead, which must not count where the unit is cut.
fn change(layer: Linear<AB>, factor: f32) -> Linear<AB> {
    let weight = Tensor::from_inner(layer.weight.val().inner().mul_scalar(factor)).require_grad();
    Linear {
        weight: Param::initialized(layer.weight.id, weight),
        ..layer
    }
}

fn flat(layer: &Linear<AB>) -> Vec<f32> {
    let mut v = Vec::new();
    read_values::<AB, _>(layer, |_, p| v.extend(p));
    v
}

/// The reference: Burn's AdamW on one process, the change made to the plain layer between the
/// steps (at `at` steps).
fn reference(at: usize) -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut layers = units::<AB>(&device);
    let mut optim = AdamWConfig::new()
        .with_epsilon(EPS as f32)
        .with_weight_decay(0.01)
        .init();
    for step in 0..BEFORE + AFTER {
        if step == at {
            let l = layers.remove(1);
            layers.insert(1, change(l, 0.5));
        }
        let x = rows::<AB>(0..ROWS, 4, step, &device);
        let l = loss(&layers, x, rows::<AB>(0..ROWS, 3, 5 + step, &device));
        let grads = GradientsParams::from_grads(l.backward(), &layers);
        layers = optim.step(LR, layers, grads);
    }
    layers.iter().map(flat).collect()
}

/// `ZeroOptimizer` on `world` rank threads over `Net` (cut, or `whole`), rank 0 changing the
/// second unit after `at` steps (the others ask for another change unless the units are whole,
/// where every rank makes its own). Returns each rank's units, whole (gathered).
fn zero_run(stage: Stage, world: usize, whole: bool, host: bool, at: usize) -> Vec<Vec<Vec<f32>>> {
    on_ranks(world, |rank, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let mut model = if whole {
            Net::<AB>::whole(&device)
        } else {
            Net::<AB>::new(comm, &device)
        };
        let spec = OptimizerSpec::Adam(AdamSpec {
            eps: EPS,
            weight_decay: 0.01,
            ..AdamSpec::adamw()
        });
        let mut settings = EngineSettings::new(stage, spec);
        if host {
            settings.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
        }
        let mut optim = ZeroOptimizer::new(settings, group).expect("optimizer");
        let per = ROWS / world;
        let mine = rank * per..(rank + 1) * per;
        for step in 0..BEFORE + AFTER {
            if step == at {
                let factor = if rank == 0 || whole { 0.5 } else { 3.0 };
                model.units[1] = model.units[1].modify(0, |l| change(l, factor)).expect("modify");
            }
            let x = rows::<AB>(mine.clone(), 4, step, &device);
            let l = model.loss(x, rows::<AB>(mine.clone(), 3, 5 + step, &device));
            let grads = GradientsParams::from_grads(l.backward(), &model);
            model = optim.try_step(LR, model, grads).expect("step");
        }
        assert_eq!(optim.tensor_state(), Some(!host), "where the state lives");
        model
            .units
            .iter()
            .map(|u| {
                let mut v = Vec::new();
                read_values::<AB, _>(&u.gathered().expect("gather"), |_, p| v.extend(p));
                v
            })
            .collect()
    })
}

#[test]
fn a_change_on_the_modifier_rank_reaches_every_shard_and_the_masters() {
    let want = reference(BEFORE);
    // Without the change the run ends elsewhere: the comparison can tell.
    let unchanged = reference(usize::MAX);
    assert!(
        max_relative_error("unit 1 without the change", &unchanged[1], &want[1]) > 1e-2,
        "the change must matter"
    );
    for (stage, world, whole, host) in [
        (Stage::Zero3, 2, false, false),
        (Stage::Zero3, 4, false, true),
        (Stage::Zero1, 2, false, false),
        (Stage::Zero0, 2, true, false),
        (Stage::Zero1, 2, true, true),
    ] {
        let runs = zero_run(stage, world, whole, host, BEFORE);
        for (rank, run) in runs.iter().enumerate() {
            let label = format!("{stage:?}, world {world}, whole {whole}, host {host}: rank {rank}");
            assert_eq!(run.len(), want.len(), "{label}: units");
            for (u, (got, want)) in run.iter().zip(&want).enumerate() {
                assert_close(&format!("{label}, unit {u}"), got, want, 1e-6);
            }
        }
    }
}

/// Before the first step there is no optimizer state yet: the change is simply the model the
/// state is built from.
#[test]
fn a_change_before_the_first_step_is_where_training_starts() {
    let want = reference(0);
    for (rank, run) in zero_run(Stage::Zero3, 2, false, false, 0).iter().enumerate() {
        assert_eq!(run.len(), want.len(), "rank {rank}: units");
        for (u, (got, want)) in run.iter().zip(&want).enumerate() {
            assert_close(&format!("rank {rank}, unit {u}"), got, want, 1e-6);
        }
    }
}

#[test]
fn a_modifier_rank_outside_the_ranks_and_a_changed_shape_are_errors() {
    let errors = on_ranks(2, |_, comm| {
        let device = Default::default();
        let model = Net::<AB>::new(comm, &device);
        let outside = model.units[1].modify(2, |l| l).expect_err("rank 2 of 2");
        let reshaped = model.units[1]
            .modify(0, |l| Linear {
                weight: Param::initialized(l.weight.id, Tensor::zeros([2, 2], &Default::default())),
                ..l
            })
            .expect_err("a changed shape");
        (outside, reshaped)
    });
    for (outside, reshaped) in errors {
        assert!(
            matches!(outside, ZeroError::Usage(_)) && outside.to_string().contains("modifier rank 2"),
            "{outside}"
        );
        assert!(reshaped.to_string().contains("change values, not shapes"), "{reshaped}");
    }
}
