//! Step time and per-rank memory of ZeRO stages 0-3 on GPT-2, ranks as threads.
//!
//! For each model and world size, every stage trains the same batches; the step time is the
//! median over the timed steps, printed as a ratio to stage 0 at the same world size (the named
//! baseline, measured in the same run). Memory is the engine's own per-rank accounting of model
//! states, beside the ZeRO paper's formula for fp32 Adam (params 4Ψ, grads 4Ψ, Adam 8Ψ, each
//! divided by N where the stage shards it).
//!
//! `cargo run --release -p zero-benches --bin stages -- [--models tiny,gpt2] [--worlds 1,2,4]
//!  [--steps 3] [--seq 64] [--micro 1] [--max-reuse-distance N]`
//!
//! `--max-reuse-distance 0` makes stage 3 gather the ends for each of their three uses per
//! micro-batch (the default keeps them gathered between uses).

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Int, Tensor, TensorData};
use std::sync::Arc;
use std::time::Instant;
use zero_burn::{ChainEngine, EngineSettings, MemoryReport, Stage};
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::optim::OptimizerSpec;
use zero_models::Gpt2Config;

type B = Autodiff<Flex>;

struct Options {
    models: Vec<String>,
    worlds: Vec<usize>,
    steps: usize,
    seq: usize,
    micro: usize,
    max_reuse_distance: usize,
}

fn options() -> Options {
    let mut o = Options {
        models: vec!["tiny".into(), "gpt2".into()],
        worlds: vec![1, 2, 4],
        steps: 3,
        seq: 64,
        micro: 1,
        max_reuse_distance: 1_000_000_000,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = pair.get(1).cloned().unwrap_or_default();
        match pair[0].as_str() {
            "--models" => o.models = value.split(',').map(String::from).collect(),
            "--worlds" => o.worlds = value.split(',').filter_map(|v| v.parse().ok()).collect(),
            "--steps" => o.steps = value.parse().unwrap_or(o.steps),
            "--seq" => o.seq = value.parse().unwrap_or(o.seq),
            "--micro" => o.micro = value.parse().unwrap_or(o.micro),
            "--max-reuse-distance" => o.max_reuse_distance = value.parse().unwrap_or(o.max_reuse_distance),
            other => {
                eprintln!("unknown option {other}");
                std::process::exit(2);
            }
        }
    }
    o
}

/// Median seconds per step (after one warm-up step) and rank 0's memory report.
fn run(config: &Gpt2Config, stage: Stage, world: usize, o: &Options) -> (f64, MemoryReport) {
    let groups = ThreadGroup::new_group(world).expect("group");
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let config = config.clone();
            let (steps, seq, micro, reuse) = (o.steps, o.seq, o.micro, o.max_reuse_distance);
            std::thread::spawn(move || {
                let device = Default::default();
                let mut settings = EngineSettings::new(stage, OptimizerSpec::adamw());
                settings.overlap_comm = true;
                settings.reduce_bucket_size = config.n_embd * config.n_embd;
                settings.prefetch_bucket_size = 9 * config.n_embd * config.n_embd / 10;
                settings.param_persistence_threshold = 10 * config.n_embd;
                settings.max_reuse_distance = reuse;
                let group: Arc<dyn ProcessGroup> = group;
                let mut engine = ChainEngine::new(settings, config.init::<B>(&device), group).expect("engine");
                let mut times = Vec::new();
                for step in 0..=steps {
                    let ids: Vec<i64> = (0..micro * seq)
                        .map(|i| ((i * 7919 + rank * 104_729 + step * 31) % config.vocab_size) as i64)
                        .collect();
                    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [micro, seq]), &device);
                    let t = Instant::now();
                    let loss = engine.forward((tokens.clone(), tokens)).expect("forward");
                    engine.backward(loss).expect("backward");
                    engine.step().expect("step");
                    if step > 0 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                times.sort_by(f64::total_cmp);
                (times[times.len() / 2], engine.memory())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank")).collect();
    // The step is as slow as the slowest rank.
    let time = results.iter().map(|r| r.0).fold(0.0, f64::max);
    (time, results[0].1)
}

fn formula(stage: Stage, psi: f64, n: f64) -> f64 {
    match stage {
        Stage::Zero0 => 16.0 * psi,
        Stage::Zero1 => 4.0 * psi + 4.0 * psi + 8.0 * psi / n,
        Stage::Zero2 => 4.0 * psi + 4.0 * psi / n + 8.0 * psi / n,
        Stage::Zero3 => 16.0 * psi / n,
    }
}

fn main() {
    let o = options();
    println!("| model | world | stage | step (s) | vs stage 0 | rank-0 model states (MB) | formula (MB) | gathered peak (MB) |");
    println!("|---|---|---|---|---|---|---|---|");
    for name in &o.models {
        let config = Gpt2Config::preset(name).unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        });
        let psi = config.num_params() as f64;
        for &world in &o.worlds {
            let mut baseline = None;
            for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
                let (time, m) = run(&config, stage, world, &o);
                let base = *baseline.get_or_insert(time);
                // Model states as the formula counts them (fp32: the master of stage 0 is the
                // parameters; stages 1-2 keep a separate fp32 shard, shown in the total).
                let states = m.parameters.current + m.gradients.current + m.optimizer_state.current;
                println!(
                    "| {name} ({:.1}M) | {world} | {} | {time:.3} | {:.2} | {:.1} (+{:.1} master) | {:.1} | {:.1} |",
                    psi / 1e6,
                    stage.number(),
                    time / base,
                    states as f64 / 1e6,
                    m.master_weights.current as f64 / 1e6,
                    formula(stage, psi, world as f64) / 1e6,
                    m.gathered.peak as f64 / 1e6
                );
            }
        }
    }
}
