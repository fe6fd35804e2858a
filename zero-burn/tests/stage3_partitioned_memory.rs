//! Partitioned construction never holds the whole model on a rank: the process's peak heap (all
//! rank threads) while building a stage-3 engine, counted by a global allocator.
//!
//! Reference: `ChainEngine::new` on the whole model, built on every rank, at the same world
//! size; and the bound the design gives: the engine's steady state (fp32 master and gradient
//! accumulator of each rank's shard, 2 × 4Ψ bytes over all ranks) plus, per rank, a few blocks
//! in flight (the block being cut, its values, the broadcast buffer).

mod common;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use common::{on_ranks, B};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use zero_burn::{ChainEngine, ChainModel, EngineSettings, InitValues, Stage};
use zero_core::optim::{OptimizerSpec, SgdSpec};

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

/// Peak heap bytes above the start while `f` runs.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = CURRENT.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed) - start)
}

const WIDTH: usize = 256;
const BLOCKS: usize = 24;
const WORLD: usize = 4;
/// One block: a 256 × 256 linear layer (no bias), 256 KiB in fp32.
const BLOCK_BYTES: usize = WIDTH * WIDTH * 4;

#[derive(Module, Debug)]
struct Ends<B: Backend> {
    head: Linear<B>,
}

#[derive(Module, Debug)]
struct Deep<B: Backend> {
    ends: Ends<B>,
    blocks: Vec<Linear<B>>,
}

impl<B: AutodiffBackend> ChainModel<B> for Deep<B> {
    type Batch = Tensor<B, 2>;
    type Hidden = Tensor<B, 2>;
    type Ends = Ends<B>;
    type Block = Linear<B>;
    fn into_parts(self) -> (Ends<B>, Vec<Linear<B>>) {
        (self.ends, self.blocks)
    }
    fn from_parts(ends: Ends<B>, blocks: Vec<Linear<B>>) -> Self {
        Deep { ends, blocks }
    }
    fn embed(_: &Ends<B>, batch: &Tensor<B, 2>) -> Tensor<B, 2> {
        batch.clone()
    }
    fn block_forward(block: &Linear<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        block.forward(x)
    }
    fn head_loss(ends: &Ends<B>, h: Tensor<B, 2>, _: &Tensor<B, 2>) -> Tensor<B, 1> {
        ends.head.forward(h).sum()
    }
}

fn block<Bk: Backend>(device: &Bk::Device) -> Linear<Bk> {
    LinearConfig::new(WIDTH, WIDTH).with_bias(false).init(device)
}

fn ends<Bk: Backend>(device: &Bk::Device) -> Ends<Bk> {
    Ends {
        head: LinearConfig::new(WIDTH, 1).with_bias(false).init(device),
    }
}

fn settings() -> EngineSettings {
    let mut s = EngineSettings::new(Stage::Zero3, OptimizerSpec::Sgd(SgdSpec::default()));
    s.param_persistence_threshold = 1000;
    s
}

#[test]
fn a_rank_never_holds_the_whole_model() {
    let model_bytes = BLOCKS * BLOCK_BYTES;
    let (_, whole) = peak_during(|| {
        on_ranks(WORLD, |_, comm| {
            let device = Default::default();
            let model = Deep::<B> {
                ends: ends(&device),
                blocks: (0..BLOCKS).map(|_| block(&device)).collect(),
            };
            let engine = ChainEngine::new(settings(), model, comm.clone()).expect("engine");
            // Every rank's engine alive at once.
            comm.barrier().expect("barrier");
            drop(engine);
        })
    });
    let (_, partitioned) = peak_during(|| {
        on_ranks(WORLD, |_, comm| {
            let device = Default::default();
            let engine = ChainEngine::<B, Deep<B>>::new_partitioned(
                settings(),
                ends(&device),
                BLOCKS,
                |_| block(&device),
                InitValues::RankZero,
                comm.clone(),
            )
            .expect("engine");
            comm.barrier().expect("barrier");
            drop(engine);
        })
    });
    let mb = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "peak heap, {WORLD} ranks, model {:.1} MiB: ChainEngine::new {:.1} MiB, new_partitioned {:.1} MiB",
        mb(model_bytes),
        mb(whole),
        mb(partitioned)
    );
    // Every rank holds the whole model when it is built whole.
    assert!(
        whole >= WORLD * model_bytes,
        "reference peak {whole} below {WORLD} models"
    );
    // Steady state 2 × 4Ψ over all ranks, plus at most four blocks in flight per rank.
    let bound = 2 * model_bytes + WORLD * 4 * BLOCK_BYTES;
    assert!(
        partitioned <= bound,
        "partitioned peak {partitioned} above the bound {bound}"
    );
    assert!(partitioned * 2 < whole);
}
