//! The stage-3 gather op inside Burn's autodiff: a model that is not a chain (a skip connection
//! across sharded units) trained on each rank's slice of the batch gives every rank's shard the
//! gradient of plain autodiff on one process over the whole batch (the reference), cut to that
//! shard. Worlds 1, 2 and 4 as threads, with and without Burn's balanced checkpointing (which
//! frees the gathered weights after forward and gathers them again in backward).

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Tensor, TensorData};
use std::sync::Arc;
use zero_burn::params::{read_values, write_values};
use zero_burn::sharded::{ShardedUnit, UnitComm};
use zero_burn::HostStaged;
use zero_core::comm::ThreadGroup;

/// A sharded linear unit.
type Unit<I, C> = ShardedUnit<I, C, Linear<Autodiff<I, C>>>;

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
fn loss<B: burn::tensor::backend::Backend>(u: &[Linear<B>], x: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
    let h1 = relu(u[0].forward(x));
    let h2 = relu(u[1].forward(h1.clone()));
    let y = u[2].forward(h2 + h1);
    (y - target).powf_scalar(2.0).mean()
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
    type I = Flex;
    let groups = ThreadGroup::new_group(world).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                s.spawn(move || {
                    let device = Default::default();
                    let comm: UnitComm<I> = Arc::new(HostStaged::new(group));
                    let sharded: Vec<Unit<I, C>> = units::<Autodiff<I, C>>(&device)
                        .into_iter()
                        .map(|u| ShardedUnit::new(u, comm.clone()).unwrap())
                        .collect();
                    let per = ROWS / world;
                    let x = rows::<Autodiff<I, C>>(rank * per..(rank + 1) * per, 4, 0, &device).require_grad();
                    let target = rows::<Autodiff<I, C>>(rank * per..(rank + 1) * per, 3, 5, &device);
                    // The model written with its units gathered one forward at a time.
                    let u1 = sharded[0].unshard(&x).unwrap();
                    let h1 = relu(u1.forward(x));
                    let u2 = sharded[1].unshard(&h1).unwrap();
                    let h2 = relu(u2.forward(h1.clone()));
                    let s = h2 + h1;
                    let u3 = sharded[2].unshard(&s).unwrap();
                    let y = u3.forward(s);
                    let grads = (y - target).powf_scalar(2.0).mean().backward();
                    sharded
                        .iter()
                        .map(|u| {
                            u.shard()
                                .grad(&grads)
                                .expect("a shard gradient")
                                .into_data()
                                .to_vec::<f32>()
                                .unwrap()
                        })
                        .collect::<Vec<_>>()
                })
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
            let per = whole.len().div_ceil(world);
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

#[test]
fn a_module_reads_back_from_its_shards() {
    // World 1: the gathered module holds the module's own values, in its own layout.
    type B = Autodiff<Flex>;
    let device = Default::default();
    let comm: UnitComm<Flex> = Arc::new(HostStaged::new(ThreadGroup::new_group(1).unwrap().remove(0)));
    let u = units::<B>(&device).remove(0);
    let mut want = Vec::new();
    read_values::<B, _>(&u, |_, v| want.extend(v));
    let sharded = ShardedUnit::new(u, comm).unwrap();
    let x = Tensor::<B, 2>::zeros([1, 4], &device).require_grad();
    let mut got = Vec::new();
    read_values::<B, _>(&sharded.unshard(&x).unwrap(), |_, v| got.extend(v));
    assert_eq!(got, want);
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
                    let units: Vec<Unit<Flex, C>> = (0..units)
                        .map(|_| {
                            let linear = LinearConfig::new(WIDTH, WIDTH).with_bias(false).init(&device);
                            ShardedUnit::new(linear, comm.clone()).unwrap()
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
