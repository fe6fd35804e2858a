//! The stage-3 gather op inside Burn's autodiff: a model that is not a chain (a skip connection
//! across sharded units) trained on each rank's slice of the batch gives every rank's shard the
//! gradient of plain autodiff on one process over the whole batch (the reference), cut to that
//! shard. Worlds 1, 2 and 4 as threads, with and without Burn's balanced checkpointing (which
//! frees the gathered weights after forward and gathers them again in backward).

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use std::sync::Arc;
use zero_burn::params::{read_values, write_values};
use zero_burn::sharded::{ShardBackend, UnitComm, ZeroModule};
use zero_burn::HostStaged;
use zero_core::comm::ThreadGroup;

/// The model with every linear layer a `ZeroModule`.
#[derive(Module, Debug)]
struct Net<B: Backend> {
    units: Vec<ZeroModule<B, Linear<B>>>,
}

impl<B: ShardBackend> Net<B> {
    /// The units whole, as a model written for Burn builds them.
    fn whole(device: &B::Device) -> Self {
        Net {
            units: units::<B>(device).into_iter().map(ZeroModule::new).collect(),
        }
    }

    /// Every unit cut over `comm`'s ranks.
    fn new(comm: UnitComm<B::Collective>, device: &B::Device) -> Self {
        zero_burn::sharded::shard_units(Self::whole(device), comm, 0).unwrap()
    }

    /// `loss`'s model, each unit gathered for its one forward.
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let u1 = self.units[0].unshard(&x).unwrap();
        let h1 = relu(u1.forward(x));
        let u2 = self.units[1].unshard(&h1).unwrap();
        let h2 = relu(u2.forward(h1.clone()));
        let s = h2 + h1;
        let u3 = self.units[2].unshard(&s).unwrap();
        u3.forward(s)
    }

    fn loss(&self, x: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
        (self.forward(x) - target).powf_scalar(2.0).mean()
    }
}

const ROWS: usize = 8;
const SIZES: [(usize, usize); 3] = [(4, 6), (6, 6), (6, 3)];

/// The three units with weights from a fixed formula.
fn units<B: burn::tensor::backend::Backend>(device: &B::Device) -> Vec<Linear<B>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(u, &(i, o))| {
            write_values(LinearConfig::new(i, o).init(device), device, true, |p| {
                let n = if p == 0 { i * o } else { o };
                (0..n)
                    .map(|k| 0.5 * ((k * 7 + u * 131 + p * 17) as f32 * 0.37).sin())
                    .collect()
            })
        })
        .collect()
}

fn rows<B: burn::tensor::backend::Backend>(
    range: std::ops::Range<usize>,
    cols: usize,
    salt: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let n = range.len();
    let values: Vec<f32> = range
        .flat_map(|r| (0..cols).map(move |c| ((r * 11 + c * 3 + salt) as f32 * 0.43).cos()))
        .collect();
    Tensor::from_data(TensorData::new(values, [n, cols]), device)
}

/// The model: h1 = relu(u1 x), h2 = relu(u2 h1), y = u3 (h2 + h1); loss = mean squared error.
fn forward<B: Backend>(u: &[Linear<B>], x: Tensor<B, 2>) -> Tensor<B, 2> {
    let h1 = relu(u[0].forward(x));
    let h2 = relu(u[1].forward(h1.clone()));
    u[2].forward(h2 + h1)
}

fn loss<B: Backend>(u: &[Linear<B>], x: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
    (forward(u, x) - target).powf_scalar(2.0).mean()
}

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

/// `body(rank, comm)` on `world` rank threads; the results in rank order.
fn on_ranks<T: Send>(world: usize, body: impl Fn(usize, UnitComm<Flex>) -> T + Sync) -> Vec<T> {
    let groups = ThreadGroup::new_group(world).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let body = &body;
                s.spawn(move || body(rank, Arc::new(HostStaged::new(group)) as UnitComm<Flex>))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The largest magnitude in `v`.
fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// max |got - want|.
fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
}

/// max |got - want| / max |want|.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    max_diff(got, want) / max_abs(want)
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
                let err = max_diff(&shards[u], expect) / max_abs(whole);
                assert!(
                    err < 1e-6,
                    "{label}, world {world}, unit {u}, rank {rank}: off by {err:e}"
                );
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
            let err = relative_error(&got, whole);
            assert!(err < 1e-6, "world {world}, unit {u}: off by {err:e}");
        }
        for (rank, (_, loss)) in runs.iter().enumerate() {
            assert!(
                (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
                "world {world}, rank {rank}: the valid() copy's loss {loss} against {want_loss}"
            );
        }
    }
}

/// Until they step shards, `ZeroEngine` and `DeviceEngine` refuse a model holding `ZeroModule`s
/// instead of averaging different ranks' shards as if they were replicas.
#[test]
fn the_engines_refuse_zero_modules_they_cannot_step_yet() {
    use zero_burn::{EngineSettings, Stage};
    use zero_core::optim::OptimizerSpec;
    type B = Autodiff<Flex>;
    let group = ThreadGroup::new_group(1).unwrap().remove(0);
    let comm: UnitComm<Flex> = Arc::new(HostStaged::new(group.clone()));
    let device = Default::default();
    let net = Net::<B>::new(comm.clone(), &device);
    assert!(zero_burn::sharded::contains_zero_module::<B, _>(&net));
    assert!(!zero_burn::sharded::contains_zero_module::<B, _>(&units::<B>(&device)));
    let settings = EngineSettings::new(Stage::Zero1, OptimizerSpec::adamw());
    let engine = zero_burn::ZeroEngine::<B, Net<B>>::new(settings.clone(), net.clone(), group);
    assert!(engine.is_err_and(|e| e.to_string().contains("ZeroEngine does not step ZeroModule")));
    let engine = zero_burn::DeviceEngine::<B, Net<B>>::new(settings, net, comm);
    assert!(engine.is_err_and(|e| e.to_string().contains("DeviceEngine does not step ZeroModule")));
}

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
                assert_eq!(g.len(), w.len());
                let err = relative_error(g, w);
                assert!(err < 1e-6, "{stage:?}, world {world}, part {u}: off by {err:e}");
            }
            let gain = want.len() - 1;
            for (rank, parts) in runs.iter().enumerate() {
                let err = relative_error(&parts[gain], &want[gain]);
                assert!(
                    err < 1e-6,
                    "{stage:?}, world {world}, the replicated gain on rank {rank}: off by {err:e}"
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
        let err = relative_error(g, w);
        assert!(err < 1e-5, "part {u}: the resumed run is off by {err:e}");
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
            let err = relative_error(g, w);
            assert!(err < 1e-5, "world {world}, part {u}: off by {err:e}");
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

/// A model is cut once: cutting it again (or a clone of it) is an error that says so, not a
/// shard of a shard.
#[test]
fn sharding_a_model_twice_is_an_error() {
    let errors = on_ranks(2, |_, comm| {
        let net = Net::<Autodiff<Flex>>::new(comm.clone(), &Default::default());
        zero_burn::sharded::shard_units(net, comm, 0)
            .err()
            .map(|e| e.to_string())
    });
    for (rank, e) in errors.iter().enumerate() {
        let e = e
            .as_deref()
            .unwrap_or_else(|| panic!("rank {rank}: a second cut must fail"));
        assert!(e.contains("sharded twice"), "rank {rank}: {e}");
    }
}
