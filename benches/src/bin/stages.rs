//! Step time and per-rank memory of ZeRO stages 0-3 on GPT-2, ranks as threads: the zoo's
//! `ShardedGpt2` from `zero_burn::initialize`, trained in Burn's loop with `ZeroOptimizer`
//! (stage 3 under `Autodiff<Flex, BalancedCheckpointing>`, stages 0-2 under `Autodiff<Flex>`).
//!
//! For each model and world size, every stage trains the same batches; the step time is the
//! median over the timed steps, printed as a ratio to the same path's first stage at the same
//! world size, and path `buffers` also as a ratio to path `module` at the same stage (the named
//! baselines, measured in the same run). Memory is the optimizer's own per-rank accounting of
//! model states, beside the ZeRO paper's formula for fp32 Adam (params 4Ψ, grads 4Ψ, Adam 8Ψ,
//! each divided by N where the stage shards it).
//!
//! Path `module` keeps the optimizer's state as tensors on the model's device (what
//! `initialize` gives); path `buffers` keeps it in host buffers stepped by the fused CPU kernel
//! (`ZeroOptimizer::with_tensor_state(false)`).
//!
//! `cargo run --release -p zero-benches --bin stages -- [--models tiny,gpt2] [--worlds 1,2,4]
//!  [--steps 3] [--seq 64] [--micro 1] [--paths module,buffers] [--stages 0,1,2,3]
//!  [--prefetch N]` (the first stage listed is the "vs first stage" baseline; `--prefetch` is
//!  `stage3_prefetch_bucket_size` in elements, default "auto", 0.9·n_embd²: one block ahead;
//!  0 prefetches nothing)

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use std::sync::Arc;
use std::time::Instant;
use zero_benches::cli::Args;
use zero_burn::{MemoryReport, Stage};
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_models::Gpt2Config;

struct Options {
    models: Vec<String>,
    worlds: Vec<usize>,
    steps: usize,
    seq: usize,
    micro: usize,
    paths: Vec<String>,
    stages: Vec<Stage>,
    /// `stage3_prefetch_bucket_size` of both paths, in elements (`None`: DeepSpeed's "auto",
    /// 0.9·n_embd², which on the module path, whose units are blocks, starts one block ahead);
    /// 0: no prefetch on the module path.
    prefetch: Option<usize>,
}

/// What `--help` prints.
const USAGE: &str = "usage: stages [--models tiny,gpt2] [--worlds 1,2,4] [--steps 3] [--seq 64] [--micro 1]
  [--paths module,buffers] [--stages 0,1,2,3] [--prefetch N]";

/// The options, every one checked before anything trains (a bad one exits with status 2).
fn options() -> Options {
    let mut o = Options {
        models: vec!["tiny".into(), "gpt2".into()],
        worlds: vec![1, 2, 4],
        steps: 3,
        seq: 64,
        micro: 1,
        prefetch: None,
        paths: vec!["module".into(), "buffers".into()],
        stages: vec![Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3],
    };
    let mut args = Args::new("stages", USAGE);
    let mut configs = vec![
        ("tiny".to_string(), Gpt2Config::tiny()),
        ("gpt2".to_string(), Gpt2Config::gpt2()),
    ];
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--models" => {
                configs = args.presets(&flag);
                o.models = configs.iter().map(|(name, _)| name.clone()).collect();
            }
            "--worlds" => o.worlds = args.ranks_list(&flag),
            "--steps" => o.steps = args.count(&flag, 1),
            "--seq" => o.seq = args.seq(&flag),
            "--micro" => o.micro = args.count(&flag, 1),
            "--prefetch" => o.prefetch = Some(args.number(&flag, 0..=usize::MAX)),
            "--paths" => o.paths = args.choices(&flag, &["module", "buffers"]),
            "--stages" => o.stages = args.stages(&flag),
            other => args.unknown(other),
        }
    }
    for (name, config) in &configs {
        if o.seq > config.n_positions {
            args.fail(format_args!(
                "--seq {}: expected at most {} (n_positions of {name})",
                o.seq, config.n_positions
            ));
        }
    }
    args.check_tokens(("--micro", "--seq"), o.micro, o.seq);
    // The config's train_batch_size.
    for &world in &o.worlds {
        args.check_product(("--micro", o.micro), ("--worlds", world), "samples per step");
    }
    o
}

/// Rank `rank`'s tokens of step `step`: the same on every path.
fn tokens<Bk: burn::tensor::backend::Backend>(
    config: &Gpt2Config,
    rank: usize,
    step: usize,
    micro: usize,
    seq: usize,
) -> Tensor<Bk, 2, Int> {
    let ids: Vec<i64> = (0..micro * seq)
        .map(|i| ((i * 7919 + rank * 104_729 + step * 31) % config.vocab_size) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [micro, seq]), &Default::default())
}

/// The middle of `times`.
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// `body(rank, group, timed)` on `world` rank threads, where `timed(step, one_step)` times one
/// step (the first is a warm-up); the slowest rank's median step and rank 0's memory report.
fn on_ranks<F>(world: usize, body: F) -> (f64, MemoryReport)
where
    F: Fn(usize, Arc<dyn ProcessGroup>, &mut dyn FnMut(usize, &mut dyn FnMut())) -> MemoryReport + Sync,
{
    let groups = ThreadGroup::new_group(world).expect("group");
    let results: Vec<(f64, MemoryReport)> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let body = &body;
                s.spawn(move || {
                    let mut times = Vec::new();
                    let memory = body(rank, group, &mut |step, one_step| {
                        let t = Instant::now();
                        one_step();
                        if step > 0 {
                            times.push(t.elapsed().as_secs_f64());
                        }
                    });
                    (median(times), memory)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    // The step is as slow as the slowest rank.
    let time = results.iter().map(|r| r.0).fold(0.0, f64::max);
    (time, results[0].1)
}

/// Median seconds per step (after one warm-up step) of the slowest rank, and rank 0's memory
/// report: `ShardedGpt2` from `initialize` in Burn's own loop; the optimizer's state in host
/// buffers unless `tensors`. Fails when the DeepSpeed config the options make is refused.
fn run_module<C: CheckpointStrategy + 'static>(
    config: &Gpt2Config,
    stage: Stage,
    world: usize,
    o: &Options,
    tensors: bool,
) -> Result<(f64, MemoryReport), String> {
    let ds = format!(
        r#"{{"train_batch_size": {}, "train_micro_batch_size_per_gpu": {}, "gradient_clipping": 0.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
        "zero_optimization": {{"stage": {}, "reduce_bucket_size": {}, "stage3_param_persistence_threshold": {},
            "overlap_comm": true, "stage3_prefetch_bucket_size": {}}}}}"#,
        o.micro * world,
        o.micro,
        stage.number(),
        config.n_embd * config.n_embd,
        10 * config.n_embd,
        prefetch_elements(config, o)
    );
    let ds = zero_core::config::DeepSpeedConfig::from_str(&ds, "stages.json")
        .map_err(|e| format!("the DeepSpeed config of stage {}, world {world}: {e}", stage.number()))?
        .config;
    Ok(on_ranks(world, |rank, group, timed| {
        let device = Default::default();
        let model = config.init::<Autodiff<Flex, C>>(&device).into_sharded();
        let (model, optim) = zero_burn::initialize(&ds, model, group).expect("initialize");
        let mut optim = optim.with_tensor_state(tensors);
        let mut model = Some(model);
        for step in 0..=o.steps {
            let tokens = tokens(config, rank, step, o.micro, o.seq);
            timed(step, &mut || {
                let m = model.take().expect("the model");
                let loss = m.loss(tokens.clone(), tokens.clone()).expect("forward");
                let grads = GradientsParams::from_grads(loss.backward(), &m);
                model = Some(optim.step(1e-3, m, grads));
            });
        }
        optim.memory()
    }))
}

/// `stage3_prefetch_bucket_size` for `config`: the option, or DeepSpeed's "auto".
fn prefetch_elements(config: &Gpt2Config, o: &Options) -> usize {
    o.prefetch.unwrap_or(9 * config.n_embd * config.n_embd / 10)
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
    println!(
        "| model | world | stage | path | step (s) | vs first stage | vs module | rank-0 model states (MB) | formula (MB) | gathered peak (MB) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for name in &o.models {
        let config = Gpt2Config::preset(name).unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        });
        let psi = config.num_params() as f64;
        for &world in &o.worlds {
            let mut baselines: std::collections::HashMap<&str, f64> = Default::default();
            for &stage in &o.stages {
                let mut module = None;
                for path in &o.paths {
                    let run = match (path.as_str(), stage) {
                        ("module" | "buffers", Stage::Zero3) => {
                            run_module::<BalancedCheckpointing>(&config, stage, world, &o, path != "buffers")
                        }
                        ("module" | "buffers", _) => {
                            run_module::<NoCheckpointing>(&config, stage, world, &o, path != "buffers")
                        }
                        (other, _) => {
                            eprintln!("unknown path {other}: module or buffers");
                            std::process::exit(2)
                        }
                    };
                    let (time, m) = run.unwrap_or_else(|e| {
                        eprintln!("stages: {e}");
                        std::process::exit(1)
                    });
                    let base = *baselines.entry(path.as_str()).or_insert(time);
                    let vs_module = match (path.as_str(), module) {
                        ("module", _) => {
                            module = Some(time);
                            "1.00".to_string()
                        }
                        (_, Some(c)) => format!("{:.2}", time / c),
                        (_, None) => "-".to_string(),
                    };
                    // Model states as the formula counts them (fp32: the master of stage 0 is
                    // the parameters; stages 1-2 keep a separate fp32 shard, shown in the total).
                    let states = m.parameters.current + m.gradients.current + m.optimizer_state.current;
                    println!(
                        "| {name} ({:.1}M) | {world} | {} | {path} | {time:.3} | {:.2} | {vs_module} | {:.1} (+{:.1} master) | {:.1} | {:.1} |",
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
}
