//! `ZeroOptimizer` in the ordinary Burn loop over a model of `ZeroModule`s and a replicated
//! parameter: against Burn's AdamW and against itself on the unsharded model on one process, at
//! worlds 1, 2 and 4 as threads; clipping, checkpoints at another world size, `synchronize`, and
//! the `ZeroModule` skeletons it leaves alone.

use crate::sharded_support;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use sharded_support::*;
use zero_burn::params::read_values;
use zero_burn::sharded::UnitComm;
use zero_core::comm::ThreadGroup;
use zero_test_support::assert_close;

/// A model of `ZeroModule`s and a replicated parameter (an output gain).
#[derive(Module, Debug)]
struct Gained<B: Backend> {
    net: Net<B>,
    gain: burn::module::Param<Tensor<B, 1>>,
}

/// The same model unsharded.
#[derive(Module, Debug)]
struct PlainGained<B: Backend> {
    units: Vec<Linear<B>>,
    gain: burn::module::Param<Tensor<B, 1>>,
}

type AB = Autodiff<Flex>;

fn gain(device: &burn::tensor::Device<AB>) -> burn::module::Param<Tensor<AB, 1>> {
    burn::module::Param::from_tensor(Tensor::from_data(TensorData::new(vec![1.0f32, 0.8, 1.2], [3]), device))
}

/// The squared error of `y` scaled by `gain` against the target rows `rows`, batch `salt`.
fn gained_loss(
    y: Tensor<AB, 2>,
    gain: &burn::module::Param<Tensor<AB, 1>>,
    rows_: std::ops::Range<usize>,
    salt: usize,
) -> Tensor<AB, 1> {
    let device = y.device();
    ((y * gain.val().unsqueeze()) - rows::<AB>(rows_, 3, 5 + salt, &device))
        .powf_scalar(2.0)
        .mean()
}

impl Gained<AB> {
    fn new(comm: UnitComm<Flex>, device: &burn::tensor::Device<AB>) -> Self {
        Gained {
            net: Net::new(comm, device),
            gain: gain(device),
        }
    }

    /// One step of `optim` on rank `rank`'s rows (of `world`) of batch `salt`.
    fn step<O: Optimizer<Self, AB>>(self, optim: &mut O, rank: usize, world: usize, salt: usize) -> Self {
        let per = ROWS / world;
        let mine = rank * per..(rank + 1) * per;
        let x = rows::<AB>(mine.clone(), 4, salt, &self.gain.device());
        let loss = gained_loss(self.net.forward(x), &self.gain, mine, salt);
        let grads = GradientsParams::from_grads(loss.backward(), &self);
        optim.step(1e-2, self, grads)
    }

    /// Each unit's shard, then the gain.
    fn parts(&self) -> Vec<Vec<f32>> {
        let mut parts: Vec<Vec<f32>> = self
            .net
            .units
            .iter()
            .map(|u| u.shard().val().into_data().to_vec::<f32>().unwrap())
            .collect();
        parts.push(self.gain.val().into_data().to_vec::<f32>().unwrap());
        parts
    }
}

impl PlainGained<AB> {
    fn new(device: &burn::tensor::Device<AB>) -> Self {
        PlainGained {
            units: units::<AB>(device),
            gain: gain(device),
        }
    }

    /// One step of `optim` on the whole batch `salt`.
    fn step<O: Optimizer<Self, AB>>(self, optim: &mut O, salt: usize) -> Self {
        let x = rows::<AB>(0..ROWS, 4, salt, &self.gain.device());
        let loss = gained_loss(forward(&self.units, x), &self.gain, 0..ROWS, salt);
        let grads = GradientsParams::from_grads(loss.backward(), &self);
        optim.step(1e-2, self, grads)
    }

    /// Each unit's parameters, flat, then the gain.
    fn parts(&self) -> Vec<Vec<f32>> {
        let mut parts: Vec<Vec<f32>> = self
            .units
            .iter()
            .map(|u| {
                let mut v = Vec::new();
                read_values::<AB, _>(u, |_, p| v.extend(p));
                v
            })
            .collect();
        parts.push(self.gain.val().into_data().to_vec::<f32>().unwrap());
        parts
    }
}

/// The ranks' `Gained::parts` put together as `PlainGained::parts` (`want`) holds them: each
/// unit's shards in rank order, cut to the unit's length; the gain, rank 0's.
fn put_together(runs: &[Vec<Vec<f32>>], want: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let gain = want.len() - 1;
    (0..want.len())
        .map(|u| match u == gain {
            true => runs[0][gain].clone(),
            false => runs.iter().flat_map(|r| r[u].clone()).take(want[u].len()).collect(),
        })
        .collect()
}

/// `ZeroOptimizer` in the ordinary Burn loop over a model of `ZeroModule`s (stage 3 for the
/// units) and a replicated parameter (reduced at the optimizer's stage 0, 1 or 2): the same
/// parameters after 5 steps as Burn's AdamW on one process over the whole batch, the unsharded
/// model (the reference), at worlds 1, 2 and 4.
#[test]
fn zero_optimizer_steps_zero_module_shards_like_burns_adamw_on_one_process() {
    use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
    use zero_core::optim::{AdamSpec, OptimizerSpec};
    const STEPS: usize = 5;
    const EPS: f64 = 1e-4;
    let device = Default::default();
    let mut plain = PlainGained::new(&device);
    let mut optim = AdamWConfig::new()
        .with_epsilon(EPS as f32)
        .with_weight_decay(0.01)
        .init();
    for _ in 0..STEPS {
        plain = plain.step(&mut optim, 0);
    }
    let want = plain.parts();

    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for world in [1, 2, 4] {
            let runs = on_ranks(world, |rank, comm| {
                let device = Default::default();
                let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
                let mut model = Gained::new(comm, &device);
                let spec = OptimizerSpec::Adam(AdamSpec {
                    eps: EPS,
                    weight_decay: 0.01,
                    ..AdamSpec::adamw()
                });
                let mut settings = EngineSettings::new(stage, spec);
                settings.reduce_bucket_size = 2;
                let mut optim = ZeroOptimizer::new(settings, group).unwrap();
                for _ in 0..STEPS {
                    model = model.step(&mut optim, rank, world, 0);
                }
                model.parts()
            });
            let got = put_together(&runs, &want);
            for (u, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_close(&format!("{stage:?}, world {world}, part {u}"), g, w, 1e-6);
            }
            let gain = want.len() - 1;
            for (rank, parts) in runs.iter().enumerate() {
                assert_close(
                    &format!("{stage:?}, world {world}, the replicated gain on rank {rank}"),
                    &parts[gain],
                    &want[gain],
                    1e-6,
                );
            }
        }
    }
}

/// `ZeroOptimizer`'s checkpoint of a model of `ZeroModule`s reloads at another world size: 2
/// steps at world 2, saved, then 3 steps at world 4 from the checkpoint, end where 5 steps at
/// world 4 without a break end (the reference), to the rounding of other reduction orders.
#[test]
fn a_zero_module_checkpoint_resumes_at_another_world_size() {
    use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
    use zero_core::optim::{AdamSpec, OptimizerSpec};
    let dir = std::env::temp_dir().join(format!("zero-module-ckpt-{}", std::process::id()));
    let settings = || {
        let spec = OptimizerSpec::Adam(AdamSpec {
            eps: 1e-4,
            ..AdamSpec::adamw()
        });
        EngineSettings::new(Stage::Zero1, spec)
    };
    // Trains steps `from..to` at `world`, loading from `dir` first and saving to it after.
    let run = |world: usize, from: usize, to: usize, load: bool, save: bool| {
        on_ranks(world, |rank, comm| {
            let device = Default::default();
            let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
            let mut model = Gained::new(comm, &device);
            let mut optim = ZeroOptimizer::new(settings(), group).unwrap();
            if load {
                model = optim.load_checkpoint(&dir, None, model).expect("loads").0;
            }
            for step in from..to {
                model = model.step(&mut optim, rank, world, step);
            }
            if save {
                optim
                    .save_checkpoint(&dir, None, &serde_json::json!({}))
                    .expect("saves");
            }
            model.parts()
        })
    };
    let shape = PlainGained::new(&Default::default()).parts();
    let want = put_together(&run(4, 0, 5, false, false), &shape);
    run(2, 0, 2, false, true);
    let got = put_together(&run(4, 2, 5, true, false), &shape);
    for (u, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("part {u} of the resumed run"), g, w, 1e-5);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Clipping by the global norm spans the units' shards and the replicated parameters: a model of
/// `ZeroModule`s at worlds 2 and 4, clipped at 0.05 (below every step's norm), ends where
/// `ZeroOptimizer` on the unsharded model on one process ends (the reference: its clipping is
/// the engines', checked against torch's `clip_grad_norm_` by the engine tests).
#[test]
fn clipping_covers_zero_module_shards_and_replicated_parameters() {
    use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
    use zero_core::optim::OptimizerSpec;
    const STEPS: usize = 4;
    let settings = || {
        let mut s = EngineSettings::new(Stage::Zero1, OptimizerSpec::adamw());
        s.gradient_clipping = 0.05;
        s
    };
    let device = Default::default();
    let mut plain = PlainGained::new(&device);
    let mut optim = ZeroOptimizer::new(settings(), ThreadGroup::new_group(1).unwrap().remove(0)).unwrap();
    let mut norms = Vec::new();
    for _ in 0..STEPS {
        plain = plain.step(&mut optim, 0);
        norms.push(optim.last_step().unwrap().grad_norm);
    }
    assert!(norms.iter().all(|&n| n > 0.05), "every step clips: {norms:?}");
    let want = plain.parts();

    for world in [2, 4] {
        let runs = on_ranks(world, |rank, comm| {
            let device = Default::default();
            let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
            let mut model = Gained::new(comm, &device);
            let mut optim = ZeroOptimizer::new(settings(), group).unwrap();
            let mut norms = Vec::new();
            for _ in 0..STEPS {
                model = model.step(&mut optim, rank, world, 0);
                norms.push(optim.last_step().unwrap().grad_norm);
            }
            (model.parts(), norms)
        });
        for (rank, (_, got_norms)) in runs.iter().enumerate() {
            for (s, (g, w)) in got_norms.iter().zip(&norms).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * w,
                    "world {world}, rank {rank}, step {s}: norm {g} against {w}"
                );
            }
        }
        let parts: Vec<_> = runs.into_iter().map(|(parts, _)| parts).collect();
        for (u, (g, w)) in put_together(&parts, &want).iter().zip(&want).enumerate() {
            assert_close(&format!("world {world}, part {u}"), g, w, 1e-5);
        }
    }
}

/// `ZeroOptimizer::synchronize` broadcasts rank 0's replicated parameters and leaves each rank's
/// shards its own: after it, rank 1 still holds its half of every unit (not rank 0's), and the
/// gain, different on each rank before, is rank 0's everywhere.
#[test]
fn synchronize_keeps_each_ranks_shards() {
    use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
    use zero_core::optim::OptimizerSpec;
    let runs = on_ranks(2, |rank, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let mut model = Gained::new(comm, &device);
        model.gain =
            burn::module::Param::from_tensor(Tensor::from_data(TensorData::new(vec![rank as f32; 3], [3]), &device));
        let before = model.parts();
        let optim = ZeroOptimizer::new(EngineSettings::new(Stage::Zero1, OptimizerSpec::adamw()), group).unwrap();
        let after = optim.synchronize(model).expect("synchronize").parts();
        (before, after)
    });
    for (rank, (before, after)) in runs.iter().enumerate() {
        let units = before.len() - 1;
        assert_eq!(after[..units], before[..units], "rank {rank}: its shards are its own");
        assert_eq!(after[units], vec![0.0; 3], "rank {rank}: the gain is rank 0's");
    }
    assert_ne!(runs[0].0[0], runs[1].0[0], "the ranks hold different halves");
}

/// `ZeroOptimizer` leaves a `ZeroModule`'s skeleton (its module's structure, every float
/// parameter an empty tensor) as it is, in `synchronize` and in a step of either state: it used
/// to write an empty `[0, 0]` tensor back into each, which Burn's CUDA backend refuses to upload
/// (a zero stride), so that every CUDA run failed before its first step. The CPU backend accepts
/// such an upload; what shows here is that the parameter was replaced, by a new leaf recording
/// gradients where the skeleton's records none. Reference: the skeleton before the optimizer ran.
#[test]
fn the_optimizer_leaves_zero_module_skeletons_alone() {
    use burn::module::{ModuleVisitor, Param};
    use zero_burn::{EngineSettings, OptimizerOffload, Stage, ZeroOptimizer};
    use zero_core::optim::OptimizerSpec;

    /// Each skeleton parameter's element count and whether it records gradients.
    #[derive(Default)]
    struct Skeletons {
        depth: usize,
        inside: Option<usize>,
        found: Vec<(usize, bool)>,
    }
    impl ModuleVisitor<AB> for Skeletons {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.depth += 1;
            if name == "skeleton" && self.inside.is_none() {
                self.inside = Some(self.depth);
            }
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            if self.inside == Some(self.depth) {
                self.inside = None;
            }
            self.depth -= 1;
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if self.inside.is_some() {
                let value = param.val();
                self.found.push((value.shape().num_elements(), value.is_require_grad()));
            }
        }
    }
    let skeletons = |model: &Gained<AB>| {
        let mut visitor = Skeletons::default();
        model.visit(&mut visitor);
        visitor.found
    };

    for offload in [false, true] {
        let mut settings = EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw());
        if offload {
            settings.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
        }
        let runs = on_ranks(1, |_, comm| {
            let device = Default::default();
            let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
            let model = Gained::new(comm, &device);
            let before = skeletons(&model);
            let mut optim = ZeroOptimizer::new(settings.clone(), group).unwrap();
            let model = optim.synchronize(model).expect("synchronize");
            let synchronized = skeletons(&model);
            let model = model.step(&mut optim, 0, 1, 0);
            assert_eq!(optim.tensor_state(), Some(!offload), "the state asked for ran");
            (before, synchronized, skeletons(&model))
        });
        let (before, synchronized, stepped) = &runs[0];
        assert!(!before.is_empty(), "the model has skeletons");
        assert!(before.iter().all(|&(n, grad)| n == 0 && !grad), "{before:?}");
        assert_eq!(synchronized, before, "offload {offload}: synchronize");
        assert_eq!(stepped, before, "offload {offload}: a step");
    }
}
