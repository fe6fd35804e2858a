//! What a forward keeps: with balanced checkpointing, the gathered weights are freed after
//! forward (a recipe to gather again is kept instead), so what forward keeps does not grow
//! with the number of units beyond their activations; without checkpointing every gathered
//! unit stays until backward. Live heap bytes (every thread) counted by a global allocator,
//! at world 2, for 2 and 16 units of 256 × 256 (256 KiB each in f32, gathered on each rank).

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::Tensor;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Barrier;
use zero_burn::sharded::{UnitComm, ZeroModule};
use zero_burn::HostStaged;
use zero_core::comm::ThreadGroup;

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
const UNIT_BYTES: i64 = (WIDTH * WIDTH * 4) as i64;
const WORLD: usize = 2;
const WORLD_BYTES: i64 = WORLD as i64;

/// Runs `body(rank, group, mark)` on `WORLD` rank threads; `mark(what)` records, once every
/// rank has reached it, the bytes alive then. Returns those marks by name. The threads are
/// joined, not scoped: a join returns after the thread's thread-local destructors have run, so
/// no rank thread of an earlier measurement frees memory during a later one.
fn measured<F>(body: F) -> Vec<(&'static str, i64)>
where
    F: Fn(usize, Arc<dyn zero_core::comm::ProcessGroup>, &dyn Fn(&'static str)) + Send + Sync + 'static,
{
    let groups = ThreadGroup::new_group(WORLD).unwrap();
    let barrier = Arc::new(Barrier::new(WORLD));
    let marks = Arc::new(std::sync::Mutex::new(Vec::new()));
    let body = Arc::new(body);
    let ranks: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let (barrier, marks, body) = (barrier.clone(), marks.clone(), body.clone());
            std::thread::spawn(move || {
                let mark = |what: &'static str| {
                    barrier.wait();
                    if rank == 0 {
                        marks
                            .lock()
                            .unwrap()
                            .push((what, CURRENT.load(Ordering::SeqCst) as i64));
                    }
                    barrier.wait();
                };
                body(rank, group, &mark);
            })
        })
        .collect();
    for rank in ranks {
        rank.join().unwrap();
    }
    let marks = marks.lock().unwrap().clone();
    marks
}

/// The mark named `what`.
fn at(marks: &[(&'static str, i64)], what: &str) -> i64 {
    marks.iter().find(|(w, _)| *w == what).unwrap().1
}

/// Over both ranks: bytes alive after forward above those alive before it, and bytes the
/// sharded units hold.
fn retained<C: CheckpointStrategy>(units: usize) -> (i64, i64) {
    let marks = measured(move |_, group, mark| {
        let device = Default::default();
        let comm: UnitComm<Flex> = Arc::new(HostStaged::new(group));
        mark("start");
        let units: Vec<LinearUnit<C>> = (0..units)
            .map(|_| {
                let linear = LinearConfig::new(WIDTH, WIDTH).with_bias(false).init(&device);
                zero_burn::sharded::shard_units(ZeroModule::new(linear), comm.clone(), 0).unwrap()
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
    (
        at(&marks, "forward") - at(&marks, "sharded"),
        at(&marks, "sharded") - at(&marks, "start"),
    )
}

#[test]
fn balanced_checkpointing_frees_each_units_gathered_weights_after_forward() {
    let (few, few_sharded) = retained::<BalancedCheckpointing>(2);
    let (many, many_sharded) = retained::<BalancedCheckpointing>(16);
    let (few_plain, _) = retained::<NoCheckpointing>(2);
    let (many_plain, _) = retained::<NoCheckpointing>(16);
    let gathered = 14 * UNIT_BYTES * WORLD_BYTES;
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
    // And with 16 units, forward keeps every unit's gathered weights fewer than without
    // checkpointing: the rest (the backend's per-thread scratch, which varies by a few hundred
    // KiB from run to run and by machine, the graph's bookkeeping) is the same either way.
    let all_gathered = 16 * UNIT_BYTES * WORLD_BYTES;
    assert!(
        many_plain - many >= all_gathered * 9 / 10,
        "16 units: balanced keeps {many} bytes, none {many_plain}; the units gathered are {all_gathered}"
    );
}

/// A model of `units` sharded linear layers.
#[derive(burn::module::Module, Debug)]
struct Units<B: burn::tensor::backend::Backend> {
    units: Vec<ZeroModule<B, Linear<B>>>,
}

/// Over both ranks: bytes alive after one stage-2 step of `initialize`'s model and optimizer
/// (both kept), above those alive before the model was built.
fn held_after_a_stage_2_step(units: usize) -> i64 {
    use burn::optim::{GradientsParams, Optimizer};
    type AB = Autodiff<Flex>;
    let config = zero_core::config::DeepSpeedConfig::from_str(
        r#"{"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 2}}"#,
        "stage2.json",
    )
    .unwrap()
    .config;
    let marks = measured(move |_, group, mark| {
        let device = Default::default();
        mark("start");
        let model = Units::<AB> {
            units: (0..units)
                .map(|_| ZeroModule::new(LinearConfig::new(WIDTH, WIDTH).with_bias(false).init(&device)))
                .collect(),
        };
        let (model, mut optim) = zero_burn::initialize(&config, model, group).unwrap();
        let mut h = Tensor::<AB, 2>::ones([2, WIDTH], &device);
        for unit in &model.units {
            h = relu(unit.unshard(&h).unwrap().forward(h));
        }
        let grads = GradientsParams::from_grads(h.sum().backward(), &model);
        let model = optim.step(0.01, model, grads);
        mark("stepped");
        drop((model, optim));
    });
    at(&marks, "stepped") - at(&marks, "start")
}

/// Stage 2 keeps each unit's whole vector between steps, and the rank's shard (the parameter
/// the optimizer writes) is a view of it, not a second copy: per unit, over both ranks, the
/// two whole vectors (2 units' bytes) and the optimizer's fp32 master and two moments of each
/// rank's half (3), nothing more. Reference: ZeRO-2's accounting, parameters 4Ψ per rank.
#[test]
fn stage_2_holds_each_units_parameters_once() {
    let (few, many) = (held_after_a_stage_2_step(2), held_after_a_stage_2_step(16));
    let per_unit = (many - few) as f64 / 14.0 / UNIT_BYTES as f64;
    eprintln!("held after a stage-2 step: 2 units {few} bytes, 16 units {many}; {per_unit:.2} units' bytes per unit");
    assert!(
        (4.8..5.3).contains(&per_unit),
        "a unit holds {per_unit:.2} units' bytes over both ranks (5: two wholes and three half-size optimizer buffers)"
    );
}
