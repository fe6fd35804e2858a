//! Activation memory against the number of activation checkpoints, on a GPT-2.
//!
//! A counting allocator records the peak of live heap bytes during one micro-batch's forward
//! and backward, above what was live before it (the model states). The named baseline is the
//! same model and optimizer without checkpointing, in the same run: the zoo's `ShardedGpt2` with
//! `ZeroOptimizer` in Burn's loop, checkpointed through `zero_burn::checkpointed_grads`.
//!
//! The model: with `L` blocks, `h` bytes per block input (batch × seq × n_embd × 4), `A` bytes
//! of activations a block's graph holds and `C` for the embedding and head, no checkpointing
//! holds about `L·A + C`; `k` checkpoints hold `k·h`, plus one segment's graph in backward,
//! `⌈L/k⌉·A`, plus `C`. `A` and `C` are fitted from two measured points (no checkpointing and one
//! checkpoint per block); the other rows are predictions.
//!
//! `cargo run --release -p zero-benches --bin activation_memory -- [--layers 8] [--embd 128]
//!  [--seq 256] [--batch 4] [--pipeline P --micro M]`
//!
//! With `--pipeline P` the same GPT-2 is cut into P stages (ranks as threads) and the peak is
//! that of one whole `train_batch` of M micro-batches on the 1F1B schedule, all stages together,
//! without checkpointing (the baseline) and with one checkpoint per layer inside the stages.

use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Barrier;
use std::time::Instant;
use zero_benches::cli::{Args, MAX_THREADS};
use zero_burn::pipeline::{PartitionMethod, PipelineEngine, PipelineModule};
use zero_burn::sharded::UnitComm;
use zero_burn::{ActivationCheckpointing, EngineSettings, HostStaged, Stage};
use zero_core::comm::{SharedGroup, ThreadGroup};
use zero_core::optim::OptimizerSpec;
use zero_core::parallel::ParallelLayout;
use zero_models::gpt2::Gpt2Layer;
use zero_models::Gpt2Config;

type B = Autodiff<Flex>;

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(live, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let live = LIVE.fetch_add(new_size - layout.size(), Relaxed) + new_size - layout.size();
                PEAK.fetch_max(live, Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

struct Options {
    layers: usize,
    embd: usize,
    seq: usize,
    batch: usize,
    /// Pipeline stages (0: no pipeline).
    pipeline: usize,
    /// Micro-batches per pipelined step.
    micro: usize,
}

/// What `--help` prints.
const USAGE: &str =
    "usage: activation_memory [--layers 8] [--embd 128] [--seq 256] [--batch 4] [--pipeline P --micro M]";

/// Attention heads of the measured GPT-2: `--embd` must be a multiple of it.
const HEADS: usize = 4;

/// The options, every one checked before the model is built (a bad one exits with status 2).
fn options() -> Options {
    let mut o = Options {
        layers: 8,
        embd: 128,
        seq: 256,
        batch: 4,
        pipeline: 0,
        micro: 4,
    };
    let mut args = Args::new("activation_memory", USAGE);
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--layers" => o.layers = args.count(&flag, 1),
            "--embd" => o.embd = args.multiple(&flag, HEADS, "the model's attention heads"),
            "--seq" => o.seq = args.seq(&flag),
            "--batch" => o.batch = args.count(&flag, 1),
            "--pipeline" => o.pipeline = args.number(&flag, 0..=MAX_THREADS),
            "--micro" => o.micro = args.count(&flag, 1),
            other => args.unknown(other),
        }
    }
    // The pipeline's layers: the embedding, each block, the head; each stage needs one.
    if o.pipeline > o.layers + 2 {
        args.fail(format_args!(
            "--pipeline {}: expected at most {} (--layers {} blocks, the embedding and the head: one per stage)",
            o.pipeline,
            o.layers + 2,
            o.layers
        ));
    }
    // Without a pipeline, A and C are fitted from no checkpointing and one checkpoint per
    // block: two distinct points only with two blocks or more.
    if o.pipeline == 0 && o.layers < 2 {
        args.fail(format_args!(
            "--layers {}: expected at least 2 without --pipeline (with one block, no checkpointing and one \
             checkpoint per block are the same point, and A cannot be told from C)",
            o.layers
        ));
    }
    args.check_tokens(("--batch", "--seq"), o.batch, o.seq);
    if let Err(e) = config(&o).validate() {
        args.fail(format_args!(
            "--layers {} --embd {} --seq {}: {e}",
            o.layers, o.embd, o.seq
        ));
    }
    o
}

/// The measured GPT-2. A small vocabulary keeps the logits (part of C) from hiding the blocks'
/// share.
fn config(o: &Options) -> Gpt2Config {
    Gpt2Config::new(512, o.seq.max(64), o.embd, o.layers, HEADS)
}

/// Peak bytes above the resting level during forward + backward (median-free: the allocator's
/// peak is exact), and the seconds it took; after one warm-up step. The zoo's `ShardedGpt2`
/// (stage 0, one rank) with `ZeroOptimizer` in Burn's own loop: `ac` runs each micro-batch
/// through `zero_burn::checkpointed_grads`, as `gpt2 train` does under an
/// `activation_checkpointing` section; without, `loss.backward()`.
fn measure(config: &Gpt2Config, o: &Options, ac: Option<ActivationCheckpointing>) -> (usize, f64) {
    let device = Default::default();
    let group = ThreadGroup::new_group(1).expect("group").remove(0) as SharedGroup;
    let units: UnitComm<Flex> = std::sync::Arc::new(HostStaged::new(group.clone()));
    let settings = EngineSettings::new(Stage::Zero0, OptimizerSpec::adamw());
    let (mut model, mut optim) =
        zero_burn::initialize_settings(settings, config.init::<B>(&device).into_sharded(), group, units)
            .expect("initialize");
    let ids: Vec<i64> = (0..o.batch * o.seq)
        .map(|i| ((i * 7919) % config.vocab_size) as i64)
        .collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [o.batch, o.seq]), &device);
    let mut result = (0, 0.0);
    for step in 0..2 {
        let rest = LIVE.load(Relaxed);
        PEAK.store(rest, Relaxed);
        let t = Instant::now();
        let grads = match &ac {
            Some(ac) => {
                zero_burn::checkpointed_grads(&model, &(tokens.clone(), tokens.clone()), ac, 1.0)
                    .expect("checkpointed")
                    .1
            }
            None => {
                let loss = model.loss(tokens.clone(), tokens.clone()).expect("forward");
                GradientsParams::from_grads(loss.backward(), &model)
            }
        };
        let secs = t.elapsed().as_secs_f64();
        let peak = PEAK.load(Relaxed) - rest;
        model = optim.try_step(1e-4, model, grads).expect("step");
        if step == 1 {
            result = (peak, secs);
        }
    }
    result
}

/// As [`measure`], for one pipelined step of `o.micro` micro-batches over `o.pipeline` stages:
/// the peak of all stages together, and the step's seconds.
fn measure_pipeline(config: &Gpt2Config, o: &Options, ac: Option<ActivationCheckpointing>) -> (usize, f64) {
    let ranks = ParallelLayout::with_pipeline(1, 1, o.pipeline)
        .and_then(|l| l.threads())
        .expect("pipeline groups");
    // Every stage, then this thread: warm-up done / measured step may start / measured step done.
    let barrier = Barrier::new(o.pipeline + 1);
    std::thread::scope(|s| {
        for groups in ranks {
            let (barrier, ac) = (&barrier, ac.clone());
            s.spawn(move || {
                let device = Default::default();
                let mut settings = EngineSettings::new(Stage::Zero0, OptimizerSpec::adamw());
                settings.gradient_accumulation_steps = o.micro;
                settings.activation_checkpointing = ac;
                let layers = config.init::<B>(&device).into_pipeline_layers();
                let module = PipelineModule::from_layers::<B>(
                    layers,
                    o.pipeline,
                    PartitionMethod::Uniform,
                    groups.coords.pipeline,
                )
                .expect("stage");
                let mut engine = PipelineEngine::<B, Gpt2Layer<B>>::new(settings, module, &groups).expect("engine");
                let batches: Vec<_> = (0..o.micro)
                    .map(|m| {
                        let ids: Vec<i64> = (0..o.batch * o.seq)
                            .map(|i| ((i * 7919 + m * 31) % config.vocab_size) as i64)
                            .collect();
                        let t = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [o.batch, o.seq]), &device);
                        (t.clone(), t)
                    })
                    .collect();
                engine.train_batch(&batches).expect("warm-up step");
                barrier.wait();
                barrier.wait();
                engine.train_batch(&batches).expect("measured step");
                barrier.wait();
            });
        }
        barrier.wait();
        let rest = LIVE.load(Relaxed);
        PEAK.store(rest, Relaxed);
        let t = Instant::now();
        barrier.wait();
        barrier.wait();
        (PEAK.load(Relaxed) - rest, t.elapsed().as_secs_f64())
    })
}

/// The pipelined table: no checkpointing against one checkpoint per layer.
fn pipeline_table(config: &Gpt2Config, o: &Options) {
    println!(
        "pipeline: {} stages, {} micro-batches per step (1F1B), peak of all stages together",
        o.pipeline, o.micro
    );
    let (off, off_t) = measure_pipeline(config, o, None);
    let (on, on_t) = measure_pipeline(config, o, Some(ActivationCheckpointing::default()));
    println!("| checkpoints | peak activation memory | vs none | step time | vs none |");
    println!("|---|---|---|---|---|");
    println!(
        "| none (baseline) | {:.1} MB | 1.00x | {off_t:.3} s | 1.00x |",
        mb(off as f64)
    );
    println!(
        "| one per layer | {:.1} MB | {:.2}x | {on_t:.3} s | {:.2}x |",
        mb(on as f64),
        on as f64 / off as f64,
        on_t / off_t
    );
}

fn mb(bytes: f64) -> f64 {
    bytes / 1e6
}

fn main() {
    let o = options();
    let config = config(&o);
    if o.pipeline > 0 {
        println!(
            "GPT-2: {} layers, n_embd {}, vocab 512; batch {} x seq {}",
            o.layers, o.embd, o.batch, o.seq
        );
        pipeline_table(&config, &o);
        return;
    }
    let l = o.layers;
    let h = (o.batch * o.seq * o.embd * 4) as f64;
    println!(
        "GPT-2: {l} layers, n_embd {}, vocab 512; batch {} x seq {}; stage 0, 1 rank; h = {:.2} MB per block input",
        o.embd,
        o.batch,
        o.seq,
        mb(h)
    );
    let (off, off_t) = measure(&config, &o, None);
    let (every, every_t) = measure(&config, &o, Some(ActivationCheckpointing::default()));
    let a = (off as f64 - every as f64 + l as f64 * h) / (l as f64 - 1.0);
    let c = off as f64 - l as f64 * a;
    println!("fitted: A = {:.2} MB per block graph, C = {:.2} MB", mb(a), mb(c));
    println!(
        "| checkpoints | peak activation memory | vs none | predicted k·h + ⌈L/k⌉·A + C | fwd+bwd time | vs none |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| none (baseline) | {:.1} MB | 1.00x | (fit) | {:.3} s | 1.00x |",
        mb(off as f64),
        off_t
    );
    let mut counts: Vec<usize> = vec![1, 2, 4, l];
    counts.retain(|&k| k <= l);
    counts.dedup();
    for k in counts {
        let (peak, t) = if k == l {
            (every, every_t)
        } else {
            measure(
                &config,
                &o,
                Some(ActivationCheckpointing {
                    number_checkpoints: Some(k),
                    ..Default::default()
                }),
            )
        };
        let predicted = k as f64 * h + l.div_ceil(k) as f64 * a + c;
        let note = if k == l { " (fit)" } else { "" };
        println!(
            "| {k} | {:.1} MB | {:.2}x | {:.1} MB{note} | {t:.3} s | {:.2}x |",
            mb(peak as f64),
            peak as f64 / off as f64,
            mb(predicted),
            t / off_t
        );
    }
}
