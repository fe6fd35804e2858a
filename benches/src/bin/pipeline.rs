//! Pipeline bubble: the idle fraction of each stage under the 1F1B schedule, measured from the
//! engine's per-operation timestamps, against the theory (p - 1) / (m + p - 1) for p stages
//! and m micro-batches (GPipe's and 1F1B's bubble when every stage costs the same).
//!
//! The model is p equal layers (one `width × width` linear layer each, the first reading the
//! batch, the last giving a squared-error loss), one per stage, so that the stages cost the
//! same. The ranks are threads of this process. A stage is busy from the moment an operation's
//! input is there to the moment its output is handed on; idle = 1 - busy / makespan, where the
//! makespan runs from the step's start (after a barrier) to the last stage's last operation.
//!
//! Usage: pipeline [--width 384] [--rows 256] [--steps 3]

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use std::time::Duration;
use zero_benches::cli::Args;
use zero_burn::pipeline::{PartitionMethod, PipeLayer, PipelineEngine, PipelineModule};
use zero_burn::{EngineSettings, Stage};
use zero_core::optim::{OptimizerSpec, SgdSpec};
use zero_core::parallel::ParallelLayout;

type B = Autodiff<Flex>;

/// One equal-cost layer.
#[derive(Module, Debug)]
struct Equal<B: Backend> {
    linear: Linear<B>,
}

impl<B: AutodiffBackend> PipeLayer<B> for Equal<B> {
    type Batch = (Tensor<B, 2>, Tensor<B, 2>);
    type Hidden = Tensor<B, 2>;

    fn input(&self, batch: &Self::Batch) -> Tensor<B, 2> {
        burn::tensor::activation::relu(self.linear.forward(batch.0.clone()))
    }
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        burn::tensor::activation::relu(self.linear.forward(x))
    }
    fn loss(&self, x: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        (self.linear.forward(x) - batch.1.clone()).powi_scalar(2).mean()
    }
}

/// What `--help` prints.
const USAGE: &str = "usage: pipeline [--width 384] [--rows 256] [--steps 3]";

/// The widest layer `--width` takes: its width × width weights stay within 2^32.
const MAX_WIDTH: usize = 1 << 16;

/// Width, rows and measured steps, every one checked before anything runs (a bad one exits
/// with status 2).
fn options() -> (usize, usize, usize) {
    let (mut width, mut rows, mut steps) = (384, 256, 3);
    let mut args = Args::new("pipeline", USAGE);
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--width" => width = args.number(&flag, 1..=MAX_WIDTH),
            "--rows" => rows = args.count(&flag, 1),
            "--steps" => steps = args.count(&flag, 1),
            other => args.unknown(other),
        }
    }
    args.check_product(("--rows", rows), ("--width", width), "elements per micro-batch");
    (width, rows, steps)
}

/// Idle fraction of each stage, averaged over the measured steps.
fn measure(stages: usize, micro: usize, width: usize, rows: usize, steps: usize) -> Vec<f64> {
    let ranks = ParallelLayout::with_pipeline(1, 1, stages)
        .and_then(|l| l.threads())
        .unwrap_or_else(|e| panic!("layout: {e}"));
    let timelines: Vec<Vec<(Duration, Duration)>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|groups| {
                s.spawn(move || {
                    let device = Default::default();
                    let layers: Vec<Equal<B>> = (0..stages)
                        .map(|_| Equal {
                            linear: LinearConfig::new(width, width).init(&device),
                        })
                        .collect();
                    let module = PipelineModule::from_layers::<B>(
                        layers,
                        stages,
                        PartitionMethod::Uniform,
                        groups.coords.pipeline,
                    )
                    .unwrap_or_else(|e| panic!("module: {e}"));
                    let mut settings = EngineSettings::new(
                        Stage::Zero0,
                        OptimizerSpec::Sgd(SgdSpec {
                            lr: 1e-3,
                            momentum: 0.0,
                            dampening: 0.0,
                            weight_decay: 0.0,
                            nesterov: false,
                        }),
                    );
                    settings.gradient_accumulation_steps = micro;
                    let mut engine = PipelineEngine::<B, Equal<B>>::new(settings, module, &groups)
                        .unwrap_or_else(|e| panic!("engine: {e}"));
                    let batches: Vec<_> = (0..micro)
                        .map(|_| {
                            let x = Tensor::<B, 2>::random([rows, width], burn::tensor::Distribution::Default, &device);
                            (x.clone(), x)
                        })
                        .collect();
                    // Per measured step: this stage's (busy, makespan so far).
                    let mut out = Vec::new();
                    for step in 0..=steps {
                        groups.world.barrier().unwrap_or_else(|e| panic!("barrier: {e}"));
                        engine.train_batch(&batches).unwrap_or_else(|e| panic!("step: {e}"));
                        if step == 0 {
                            continue; // warm-up
                        }
                        let spans = engine.timeline();
                        let busy: Duration = spans.iter().map(|s| s.end - s.start).sum();
                        let end = spans.iter().map(|s| s.end).max().unwrap_or_default();
                        out.push((busy, end));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    (0..stages)
        .map(|stage| {
            let mut idle = 0.0;
            for step in 0..steps {
                let makespan = timelines.iter().map(|t| t[step].1).max().unwrap_or_default();
                idle += 1.0 - timelines[stage][step].0.as_secs_f64() / makespan.as_secs_f64();
            }
            idle / steps as f64
        })
        .collect()
}

fn main() {
    let (width, rows, steps) = options();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "width {width}, rows {rows}, {steps} measured steps; load average {}",
        load.trim()
    );
    println!("| p | m | theory (p-1)/(m+p-1) | measured idle, mean over stages | per stage |");
    println!("|---|---|---|---|---|");
    for p in [2, 4] {
        for m in [1, 2, 4, 8] {
            let idle = measure(p, m, width, rows, steps);
            let theory = (p - 1) as f64 / (m + p - 1) as f64;
            let mean = idle.iter().sum::<f64>() / idle.len() as f64;
            let per: Vec<String> = idle.iter().map(|v| format!("{:.0}%", 100.0 * v)).collect();
            println!(
                "| {p} | {m} | {:.0}% | {:.0}% | {} |",
                100.0 * theory,
                100.0 * mean,
                per.join(" ")
            );
        }
    }
}
