//! `Gpt2Config::init_sharded` never holds the whole model on a rank: the process's peak heap
//! (both rank threads) while drawing a GPT-2 of 24 blocks at world 2, counted by a global
//! allocator.
//!
//! Reference: the same draws as a whole model on each rank (`init`, then `into_sharded` and the
//! cut), which keeps the same shards and holds a whole model beside them on the way; and the
//! bound of the design: above what is kept (every rank's shards), a few copies of the unit
//! being cut (its drawn tensors, the flat vector, the shard).

use burn::backend::Flex;
use burn::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use zero_burn::sharded::{shard_units, UnitComm};
use zero_burn::HostStaged;
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::estimate::Gpt2Shape;
use zero_models::gpt2::ShardedGpt2;
use zero_models::Gpt2Config;

/// Counts live heap bytes and their peak.
struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
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

/// Burn's CPU generator is one per process: the ranks draw one at a time.
static RNG: Mutex<()> = Mutex::new(());

/// Heap bytes above the start while both rank threads build their model with `build`, each
/// kept until both are built: the peak, and what is held once both are built (the threads
/// joined, their thread-local destructors run); and what each rank holds.
fn peak_of(build: fn(&Gpt2Config, UnitComm<Flex>) -> ShardedGpt2<Flex>) -> (isize, isize, Vec<Vec<usize>>) {
    let groups = ThreadGroup::new_group(2).expect("group");
    let start = CURRENT.load(Ordering::SeqCst);
    PEAK.store(start, Ordering::SeqCst);
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| {
            std::thread::spawn(move || {
                let comm: UnitComm<Flex> = Arc::new(HostStaged::new(g as Arc<dyn ProcessGroup>));
                let _one_at_a_time = RNG.lock().unwrap_or_else(|e| e.into_inner());
                Flex::seed(&Default::default(), 5);
                build(&config(), comm)
            })
        })
        .collect();
    let models: Vec<ShardedGpt2<Flex>> = handles.into_iter().map(|h| h.join().expect("rank")).collect();
    let peak = PEAK.load(Ordering::SeqCst) as isize - start as isize;
    let kept = CURRENT.load(Ordering::SeqCst) as isize - start as isize;
    (peak, kept, models.iter().map(held).collect())
}

fn config() -> Gpt2Config {
    Gpt2Config::new(96, 16, 32, 24, 4)
}

/// The rank's units' element counts (its shards, or the whole units under the threshold),
/// read while the model is still alive.
fn held(model: &ShardedGpt2<Flex>) -> Vec<usize> {
    let mut out = Vec::new();
    zero_burn::params::read_values::<Flex, _>(model, |_, v| out.push(v.len()));
    out
}

#[test]
fn a_sharded_random_init_never_holds_the_whole_model() {
    let shape = Gpt2Shape {
        vocab: 96,
        n_positions: 16,
        n_embd: 32,
        n_layer: 24,
        n_head: 4,
        n_inner: 128,
    };
    let whole = 4 * shape.num_params() as isize;
    let unit = 4 * shape.block_params().max(shape.embed_params()) as isize;
    let (drawn, kept_drawn, held_drawn) =
        peak_of(|c, comm| c.init_sharded::<Flex>(&Default::default(), comm, 0).expect("init"));
    let (cut, kept_cut, held_cut) =
        peak_of(|c, comm| shard_units(c.init::<Flex>(&Default::default()).into_sharded(), comm, 0).expect("cut"));
    assert_eq!(held_drawn, held_cut, "both hold the same shards");
    println!(
        "peak above what is kept: drawn unit by unit {} B, drawn whole then cut {} B; model {whole} B, unit {unit} B",
        drawn - kept_drawn,
        cut - kept_cut
    );
    // What both keep: each rank half of every unit, the model once over both ranks, and each
    // unit's bookkeeping (the same but for the allocator's noise).
    assert!(kept_drawn >= whole, "kept {kept_drawn} B");
    assert!(
        (kept_drawn - kept_cut).abs() <= unit,
        "kept {kept_drawn} B and {kept_cut} B"
    );
    // Above it, drawing unit by unit holds copies of the unit being cut (its drawn tensors, the
    // values read from them, the flat vector, the values cut from it, the shard); drawing whole
    // holds a rank's whole model beside the shards.
    assert!(
        drawn - kept_drawn <= 6 * unit,
        "drawn unit by unit: {} B above what is kept, more than a few units",
        drawn - kept_drawn
    );
    assert!(
        cut - kept_cut >= whole,
        "the reference holds a whole model beside the shards"
    );
}
