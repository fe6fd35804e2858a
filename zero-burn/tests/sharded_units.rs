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
    fn new(comm: UnitComm<B::Collective>, device: &B::Device) -> Self {
        let units = units::<B>(device)
            .into_iter()
            .map(|u| ZeroModule::new(u, comm.clone()).unwrap())
            .collect();
        Net { units }
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

fn check<C: CheckpointStrategy>(label: &str) {
    let want = reference();
    for world in [1, 2, 4] {
        let got = sharded::<C>(world);
        for (u, whole) in want.iter().enumerate() {
            let per = zero_burn::sharded::shard_len(whole.len(), world);
            let mut padded = whole.clone();
            padded.resize(per * world, 0.0);
            let scale = whole.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (rank, shards) in got.iter().enumerate() {
                let expect = &padded[rank * per..(rank + 1) * per];
                let err = shards[u]
                    .iter()
                    .zip(expect)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max)
                    / scale;
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
            let scale = whole.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got.iter().zip(whole).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
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

mod memory {
    //! What a forward keeps: with balanced checkpointing, the gathered weights are freed after
    //! forward (a recipe to gather again is kept instead), so what forward keeps does not grow
    //! with the number of units beyond their activations; without checkpointing every gathered
    //! unit stays until backward. Live heap bytes (every thread) counted by a global allocator,
    //! at world 2, for 2 and 16 units of 256 × 256 (256 KiB each in f32, gathered on each rank).
    use super::*;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    struct Counting;
    static CURRENT: AtomicUsize = AtomicUsize::new(0);

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let p = unsafe { System.alloc(layout) };
            if !p.is_null() {
                CURRENT.fetch_add(layout.size(), Ordering::Relaxed);
            }
            p
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            let p = unsafe { System.alloc_zeroed(layout) };
            if !p.is_null() {
                CURRENT.fetch_add(layout.size(), Ordering::Relaxed);
            }
            p
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { System.dealloc(ptr, layout) };
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    /// A sharded linear layer under checkpointing strategy `C`.
    type LinearUnit<C> = ZeroModule<Autodiff<Flex, C>, Linear<Autodiff<Flex, C>>>;

    const WIDTH: usize = 256;
    /// One unit gathered on one rank.
    const UNIT_BYTES: usize = WIDTH * WIDTH * 4;
    const WORLD: usize = 2;

    /// Over both ranks: bytes alive after forward above those alive before it, and bytes the
    /// sharded units hold.
    fn retained<C: CheckpointStrategy>(units: usize) -> (usize, usize) {
        let groups = ThreadGroup::new_group(WORLD).unwrap();
        let barrier = Barrier::new(WORLD);
        let marks = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for (rank, group) in groups.into_iter().enumerate() {
                let (barrier, marks) = (&barrier, &marks);
                s.spawn(move || {
                    let device = Default::default();
                    let comm: UnitComm<Flex> = Arc::new(HostStaged::new(group));
                    let mark = |what: &'static str| {
                        barrier.wait();
                        if rank == 0 {
                            marks.lock().unwrap().push((what, CURRENT.load(Ordering::Relaxed)));
                        }
                        barrier.wait();
                    };
                    mark("start");
                    let units: Vec<LinearUnit<C>> = (0..units)
                        .map(|_| {
                            let linear = LinearConfig::new(WIDTH, WIDTH).with_bias(false).init(&device);
                            ZeroModule::new(linear, comm.clone()).unwrap()
                        })
                        .collect();
                    mark("sharded");
                    let mut h = Tensor::<Autodiff<Flex, C>, 2>::ones([2, WIDTH], &device).require_grad();
                    for unit in &units {
                        let module = unit.unshard(&h).unwrap();
                        h = relu(module.forward(h));
                    }
                    let loss = h.sum();
                    mark("forward");
                    let _ = loss.backward();
                });
            }
        });
        let marks = marks.into_inner().unwrap();
        let at = |what: &str| marks.iter().find(|(w, _)| *w == what).unwrap().1;
        (at("forward") - at("sharded"), at("sharded") - at("start"))
    }

    #[test]
    fn balanced_checkpointing_frees_each_units_gathered_weights_after_forward() {
        let (few, few_sharded) = retained::<BalancedCheckpointing>(2);
        let (many, many_sharded) = retained::<BalancedCheckpointing>(16);
        let (few_plain, _) = retained::<NoCheckpointing>(2);
        let (many_plain, _) = retained::<NoCheckpointing>(16);
        let gathered = 14 * UNIT_BYTES * WORLD;
        eprintln!(
            "kept after forward, 2 and 16 units: balanced {few} and {many} bytes, none {few_plain} and {many_plain}; \
             the 14 more units gathered: {gathered}; sharded units hold {few_sharded} and {many_sharded}"
        );
        // Sharded, a unit holds its shard on each rank (half of it at world 2), not its module's
        // values.
        let per_unit_sharded = (many_sharded - few_sharded) / 14;
        assert!(
            per_unit_sharded < UNIT_BYTES * 11 / 10,
            "a sharded unit holds {per_unit_sharded} bytes over both ranks"
        );
        // Without checkpointing every gathered unit stays alive until backward...
        assert!(
            many_plain - few_plain >= gathered * 9 / 10,
            "without checkpointing: {many_plain} - {few_plain}"
        );
        // ...with it, 14 more units keep only their activations (2 rows, a few KiB each).
        assert!(
            many - few < gathered / 10,
            "balanced: {many} - {few} bytes for 14 more units"
        );
        // And what forward keeps at all stays below a few units (the collectives' buffers, the
        // graph's bookkeeping).
        assert!(few < 3 * UNIT_BYTES * WORLD, "balanced, 2 units: {few} bytes kept");
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

fn gain<B: Backend>(device: &B::Device) -> burn::module::Param<Tensor<B, 1>> {
    burn::module::Param::from_tensor(Tensor::from_data(TensorData::new(vec![1.0f32, 0.8, 1.2], [3]), device))
}

/// `ZeroOptimizer` in the ordinary Burn loop over a model of `ZeroModule`s (stage 3 for the
/// units) and a replicated parameter (reduced at the optimizer's stage 0, 1 or 2): the same
/// parameters after 5 steps as Burn's AdamW on one process over the whole batch, the unsharded
/// model (the reference), at worlds 1, 2 and 4.
#[test]
fn zero_optimizer_steps_zero_module_shards_like_burns_adamw_on_one_process() {
    use zero_burn::{EngineSettings, Stage, ZeroOptimizer};
    use zero_core::optim::{AdamSpec, OptimizerSpec};
    type B = Autodiff<Flex>;
    const STEPS: usize = 5;
    const EPS: f64 = 1e-4;
    let device = Default::default();
    let mut plain = PlainGained {
        units: units::<B>(&device),
        gain: gain(&device),
    };
    let mut optim = AdamWConfig::new()
        .with_epsilon(EPS as f32)
        .with_weight_decay(0.01)
        .init();
    for _ in 0..STEPS {
        let y = forward(&plain.units, rows(0..ROWS, 4, 0, &device)) * plain.gain.val().unsqueeze();
        let grads = (y - rows(0..ROWS, 3, 5, &device)).powf_scalar(2.0).mean().backward();
        let params = GradientsParams::from_grads(grads, &plain);
        plain = optim.step(1e-2, plain, params);
    }
    let want_units: Vec<Vec<f32>> = plain
        .units
        .iter()
        .map(|u| {
            let mut v = Vec::new();
            read_values::<B, _>(u, |_, p| v.extend(p));
            v
        })
        .collect();
    let want_gain = plain.gain.val().into_data().to_vec::<f32>().unwrap();

    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for world in [1, 2, 4] {
            let runs = on_ranks(world, |rank, comm| {
                let device = Default::default();
                let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
                let mut model = Gained {
                    net: Net::<B>::new(comm, &device),
                    gain: gain(&device),
                };
                let spec = OptimizerSpec::Adam(AdamSpec {
                    eps: EPS,
                    weight_decay: 0.01,
                    ..AdamSpec::adamw()
                });
                let mut settings = EngineSettings::new(stage, spec);
                settings.reduce_bucket_size = 2;
                let mut optim = ZeroOptimizer::new(settings, group).unwrap();
                let per = ROWS / world;
                for _ in 0..STEPS {
                    let x = rows::<B>(rank * per..(rank + 1) * per, 4, 0, &device);
                    let target = rows::<B>(rank * per..(rank + 1) * per, 3, 5, &device);
                    let y = model.net.forward(x) * model.gain.val().unsqueeze();
                    let grads = (y - target).powf_scalar(2.0).mean().backward();
                    let grads = GradientsParams::from_grads(grads, &model);
                    model = optim.step(1e-2, model, grads);
                }
                let shards: Vec<Vec<f32>> = model
                    .net
                    .units
                    .iter()
                    .map(|u| u.shard().val().into_data().to_vec::<f32>().unwrap())
                    .collect();
                (shards, model.gain.val().into_data().to_vec::<f32>().unwrap())
            });
            let close = |got: &[f32], want: &[f32], what: &str| {
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
                assert!(err < 1e-6, "{stage:?}, world {world}, {what}: off by {err:e}");
            };
            for (u, whole) in want_units.iter().enumerate() {
                let got: Vec<f32> = runs
                    .iter()
                    .flat_map(|(shards, _)| shards[u].clone())
                    .take(whole.len())
                    .collect();
                assert_eq!(got.len(), whole.len());
                close(&got, whole, &format!("unit {u}"));
            }
            for (rank, (_, gain)) in runs.iter().enumerate() {
                close(gain, &want_gain, &format!("the replicated gain on rank {rank}"));
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
    type B = Autodiff<Flex>;
    let dir = std::env::temp_dir().join(format!("zero-module-ckpt-{}", std::process::id()));
    let settings = || {
        let spec = OptimizerSpec::Adam(AdamSpec {
            eps: 1e-4,
            ..AdamSpec::adamw()
        });
        EngineSettings::new(Stage::Zero1, spec)
    };
    // Trains steps `from..to` at `world`, loading from `load` first and saving to `save` after.
    let run = |world: usize, from: usize, to: usize, load: bool, save: bool| {
        on_ranks(world, |rank, comm| {
            let device = Default::default();
            let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
            let mut model = Gained {
                net: Net::<B>::new(comm, &device),
                gain: gain(&device),
            };
            let mut optim = ZeroOptimizer::new(settings(), group).unwrap();
            if load {
                model = optim.load_checkpoint(&dir, None, model).expect("loads").0;
            }
            let per = ROWS / world;
            for step in from..to {
                let x = rows::<B>(rank * per..(rank + 1) * per, 4, step, &device);
                let target = rows::<B>(rank * per..(rank + 1) * per, 3, 5 + step, &device);
                let y = model.net.forward(x) * model.gain.val().unsqueeze();
                let grads = (y - target).powf_scalar(2.0).mean().backward();
                let grads = GradientsParams::from_grads(grads, &model);
                model = optim.step(1e-2, model, grads);
            }
            if save {
                optim
                    .save_checkpoint(&dir, None, &serde_json::json!({}))
                    .expect("saves");
            }
            let mut units: Vec<Vec<f32>> = model
                .net
                .units
                .iter()
                .map(|u| u.shard().val().into_data().to_vec::<f32>().unwrap())
                .collect();
            units.push(model.gain.val().into_data().to_vec::<f32>().unwrap());
            units
        })
    };
    // Per unit, the ranks' shards put together (the gain: rank 0's copy).
    let whole = |runs: Vec<Vec<Vec<f32>>>| -> Vec<Vec<f32>> {
        (0..4)
            .map(|u| {
                if u == 3 {
                    runs[0][3].clone()
                } else {
                    runs.iter().flat_map(|r| r[u].clone()).collect::<Vec<f32>>()
                }
            })
            .collect()
    };
    let want = whole(run(4, 0, 5, false, false));
    run(2, 0, 2, false, true);
    let got = whole(run(4, 2, 5, true, false));
    for (u, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
        assert!(err < 1e-5, "unit {u}: the resumed run is off by {err:e}");
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
    type B = Autodiff<Flex>;
    const STEPS: usize = 4;
    let settings = || {
        let mut s = EngineSettings::new(Stage::Zero1, OptimizerSpec::adamw());
        s.gradient_clipping = 0.05;
        s
    };
    let device = Default::default();
    let mut plain = PlainGained {
        units: units::<B>(&device),
        gain: gain(&device),
    };
    let mut optim = ZeroOptimizer::new(settings(), ThreadGroup::new_group(1).unwrap().remove(0)).unwrap();
    let mut norms = Vec::new();
    for _ in 0..STEPS {
        let y = forward(&plain.units, rows(0..ROWS, 4, 0, &device)) * plain.gain.val().unsqueeze();
        let grads = (y - rows(0..ROWS, 3, 5, &device)).powf_scalar(2.0).mean().backward();
        let params = GradientsParams::from_grads(grads, &plain);
        plain = optim.step(1e-2, plain, params);
        norms.push(optim.last_step().unwrap().grad_norm);
    }
    assert!(norms.iter().all(|&n| n > 0.05), "every step clips: {norms:?}");
    let mut want: Vec<Vec<f32>> = plain
        .units
        .iter()
        .map(|u| {
            let mut v = Vec::new();
            read_values::<B, _>(u, |_, p| v.extend(p));
            v
        })
        .collect();
    want.push(plain.gain.val().into_data().to_vec::<f32>().unwrap());

    for world in [2, 4] {
        let runs = on_ranks(world, |rank, comm| {
            let device = Default::default();
            let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
            let mut model = Gained {
                net: Net::<B>::new(comm, &device),
                gain: gain(&device),
            };
            let mut optim = ZeroOptimizer::new(settings(), group).unwrap();
            let per = ROWS / world;
            let mut norms = Vec::new();
            for _ in 0..STEPS {
                let x = rows::<B>(rank * per..(rank + 1) * per, 4, 0, &device);
                let target = rows::<B>(rank * per..(rank + 1) * per, 3, 5, &device);
                let y = model.net.forward(x) * model.gain.val().unsqueeze();
                let grads = (y - target).powf_scalar(2.0).mean().backward();
                let grads = GradientsParams::from_grads(grads, &model);
                model = optim.step(1e-2, model, grads);
                norms.push(optim.last_step().unwrap().grad_norm);
            }
            let mut out: Vec<Vec<f32>> = model
                .net
                .units
                .iter()
                .map(|u| u.shard().val().into_data().to_vec::<f32>().unwrap())
                .collect();
            out.push(model.gain.val().into_data().to_vec::<f32>().unwrap());
            (out, norms)
        });
        for (rank, (_, got_norms)) in runs.iter().enumerate() {
            for (s, (g, w)) in got_norms.iter().zip(&norms).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * w,
                    "world {world}, rank {rank}, step {s}: norm {g} against {w}"
                );
            }
        }
        for (u, w) in want.iter().enumerate() {
            let g: Vec<f32> = if u == 3 {
                runs[0].0[3].clone()
            } else {
                runs.iter().flat_map(|(r, _)| r[u].clone()).take(w.len()).collect()
            };
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
            assert!(err < 1e-5, "world {world}, part {u}: off by {err:e}");
        }
    }
}
