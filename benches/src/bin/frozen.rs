//! What a fine-tune of part of a model costs: GPT-2 with its embeddings and all but its last
//! `--trained` blocks frozen (`no_grad()`, the final LayerNorm training too), beside the same
//! model trained whole, in one run on the same batches (the named baseline: "whole"). The
//! zoo's `ShardedGpt2` from `zero_burn::initialize`, trained in Burn's loop with
//! `ZeroOptimizer`, ranks as threads.
//!
//! Memory is the optimizer's per-rank accounting (rank 0): the optimizer's moments, the
//! gradients, the fp32 masters and the parameters. Step time is the slowest rank's median over
//! the timed steps (after one warm-up).
//!
//! `cargo run --release -p zero-benches --bin frozen -- [--model gpt2] [--worlds 1,2]
//!  [--stages 0,1,2,3] [--trained 1] [--steps 3] [--seq 64] [--paths module,buffers]`
//! (`buffers`: the optimizer's state in host buffers, as `offload_optimizer` keeps it)

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use std::time::Instant;
use zero_benches::cli::Args;
use zero_burn::{MemoryReport, Stage};
use zero_core::comm::ThreadGroup;
use zero_models::Gpt2Config;

struct Options {
    model: (String, Gpt2Config),
    worlds: Vec<usize>,
    stages: Vec<Stage>,
    trained: usize,
    steps: usize,
    seq: usize,
    paths: Vec<String>,
}

const USAGE: &str = "usage: frozen [--model gpt2] [--worlds 1,2] [--stages 0,1,2,3] [--trained 1] [--steps 3]
  [--seq 64] [--paths module,buffers]";

fn options() -> Options {
    let mut args = Args::new("frozen", USAGE);
    let mut o = Options {
        model: ("gpt2".into(), Gpt2Config::gpt2()),
        worlds: vec![1, 2],
        stages: vec![Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3],
        trained: 1,
        steps: 3,
        seq: 64,
        paths: vec!["module".into(), "buffers".into()],
    };
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--model" => o.model = args.preset(&flag),
            "--worlds" => o.worlds = args.ranks_list(&flag),
            "--stages" => o.stages = args.stages(&flag),
            "--trained" => o.trained = args.number(&flag, 0..=usize::MAX),
            "--steps" => o.steps = args.count(&flag, 1),
            "--seq" => o.seq = args.seq(&flag),
            "--paths" => o.paths = args.choices(&flag, &["module", "buffers"]),
            other => args.unknown(other),
        }
    }
    let (name, config) = &o.model;
    if o.trained > config.n_layer {
        args.fail(format_args!(
            "--trained {}: expected at most {} (the blocks of {name})",
            o.trained, config.n_layer
        ));
    }
    if o.seq > config.n_positions {
        args.fail(format_args!(
            "--seq {}: expected at most {} (n_positions of {name})",
            o.seq, config.n_positions
        ));
    }
    o
}

/// The slowest rank's median step and rank 0's memory report, training with all but the last
/// `trained` blocks frozen (`None`: the whole model).
fn run<C: CheckpointStrategy + 'static>(
    o: &Options,
    stage: Stage,
    world: usize,
    tensors: bool,
    trained: Option<usize>,
) -> (f64, MemoryReport) {
    let config = &o.model.1;
    let ds = format!(
        r#"{{"train_batch_size": {world}, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
        "zero_optimization": {{"stage": {}, "stage3_param_persistence_threshold": 0, "overlap_comm": true}}}}"#,
        stage.number()
    );
    let ds = zero_core::config::DeepSpeedConfig::from_str(&ds, "frozen.json")
        .unwrap_or_else(|e| zero_benches::cli::refuse("frozen", e))
        .config;
    let groups = ThreadGroup::new_group(world).expect("group");
    let results: Vec<(f64, MemoryReport)> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let ds = &ds;
                s.spawn(move || {
                    let device = Default::default();
                    let mut model = config.init::<Autodiff<Flex, C>>(&device).into_sharded();
                    if let Some(trained) = trained {
                        model.embed = model.embed.no_grad();
                        let frozen = model.blocks.len() - trained;
                        for block in &mut model.blocks[..frozen] {
                            *block = block.clone().no_grad();
                        }
                    }
                    let (model, optim) = zero_burn::initialize(ds, model, group).expect("initialize");
                    let mut optim = optim.with_tensor_state(tensors);
                    let mut model = Some(model);
                    let mut times = Vec::new();
                    for step in 0..=o.steps {
                        let ids: Vec<i64> = (0..o.seq)
                            .map(|i| ((i * 7919 + rank * 104_729 + step * 31) % config.vocab_size) as i64)
                            .collect();
                        let tokens =
                            Tensor::<Autodiff<Flex, C>, 2, Int>::from_data(TensorData::new(ids, [1, o.seq]), &device);
                        let t = Instant::now();
                        let m = model.take().expect("the model");
                        let loss = m.loss(tokens.clone(), tokens).expect("forward");
                        let grads = GradientsParams::from_grads(loss.backward(), &m);
                        model = Some(optim.step(1e-3, m, grads));
                        if step > 0 {
                            times.push(t.elapsed().as_secs_f64());
                        }
                    }
                    times.sort_by(f64::total_cmp);
                    (times[times.len() / 2], optim.memory())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let time = results.iter().map(|r| r.0).fold(0.0, f64::max);
    (time, results[0].1)
}

fn main() {
    let o = options();
    let (name, config) = &o.model;
    let psi = config.num_params() as f64 / 1e6;
    println!(
        "| model | world | stage | path | trained | step (s) | vs whole | moments (MB) | gradients (MB) | masters (MB) | parameters (MB) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mb = |b: usize| b as f64 / 1e6;
    for &world in &o.worlds {
        for &stage in &o.stages {
            for path in &o.paths {
                let tensors = path == "module";
                let mut whole = None;
                for trained in [None, Some(o.trained)] {
                    let (time, m) = match stage {
                        Stage::Zero3 => run::<BalancedCheckpointing>(&o, stage, world, tensors, trained),
                        _ => run::<NoCheckpointing>(&o, stage, world, tensors, trained),
                    };
                    let base = *whole.get_or_insert(time);
                    let what = match trained {
                        None => "whole".to_string(),
                        Some(k) => format!("last {k} block(s) + ln_f"),
                    };
                    println!(
                        "| {name} ({psi:.1}M) | {world} | {} | {path} | {what} | {time:.3} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} |",
                        stage.number(),
                        time / base,
                        mb(m.optimizer_state.current),
                        mb(m.gradients.peak),
                        mb(m.master_weights.current),
                        mb(m.parameters.current),
                    );
                }
            }
        }
    }
}
