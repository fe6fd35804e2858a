//! Step time of mixed-precision training against fp32, on the Flex (CPU) backend: a small GPT-2
//! (the zoo's `ShardedGpt2`) trained by `ZeroOptimizer` in Burn's own loop, from
//! `zero_burn::initialize_settings`, with the same data, once per precision.
//!
//! ```text
//! cargo run --release -p zero-benches --bin precision -- [--steps S] [--world N] [--stage K]
//!     [--layers L] [--hidden H] [--vocab V] [--seq T] [--batch B]
//! ```
//!
//! Prints, for fp32, bf16 and fp16, the median of S step times (forward, backward, step) after
//! two warm-up steps, the split of that time between forward+backward and the optimizer step,
//! and the ratio to fp32.
//!
//! Each precision runs in a process of its own (this binary re-executed with `--only NAME`):
//! under bf16/fp16 the process sets the device's default float dtype, so that the tensors the
//! model creates itself (masks, loss weights) follow its 16-bit parameters, and that setting
//! can be made only once per process.

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zero_benches::cli;
use zero_burn::sharded::UnitComm;
use zero_burn::{EngineSettings, HostStaged, PrecisionSettings, Stage};
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::loss_scaler::LossScalerConfig;
use zero_core::optim::OptimizerSpec;
use zero_models::gpt2::Gpt2Config;

/// Stage 3 frees each unit's gathered weights after its use (as `gpt2 train` runs).
type B = Autodiff<Flex, BalancedCheckpointing>;

const WARMUP: usize = 2;

struct Args {
    only: Option<String>,
    steps: usize,
    world: usize,
    stage: u8,
    layers: usize,
    hidden: usize,
    vocab: usize,
    seq: usize,
    batch: usize,
}

/// What `--help` prints.
const USAGE: &str = "usage: precision [--steps 8] [--world 1] [--stage 2] [--layers 4] [--hidden 256] [--vocab 8192]
  [--seq 128] [--batch 4]";

/// Attention heads of the measured GPT-2: `--hidden` must be a multiple of it.
const HEADS: usize = 4;

/// The options, every one checked before any precision runs (a bad one exits with status 2).
fn parse() -> Args {
    let mut a = Args {
        only: None,
        steps: 8,
        world: 1,
        stage: 2,
        layers: 4,
        hidden: 256,
        vocab: 8192,
        seq: 128,
        batch: 4,
    };
    let mut args = cli::Args::new("precision", USAGE);
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            // Internal: the precision this process runs (see the file's doc).
            "--only" => a.only = Some(args.choice(&flag, &["fp32", "bf16", "fp16"])),
            "--steps" => a.steps = args.count(&flag, 1),
            "--world" => a.world = args.ranks(&flag),
            "--stage" => a.stage = args.stage(&flag).number(),
            "--layers" => a.layers = args.count(&flag, 1),
            "--hidden" => a.hidden = args.multiple(&flag, HEADS, "the model's attention heads"),
            "--vocab" => a.vocab = args.count(&flag, 1),
            "--seq" => a.seq = args.seq(&flag),
            "--batch" => a.batch = args.count(&flag, 1),
            other => args.unknown(other),
        }
    }
    args.check_tokens(("--batch", "--seq"), a.batch, a.seq);
    if let Err(e) = config(&a).validate() {
        args.fail(format_args!(
            "--layers {} --hidden {} --vocab {} --seq {}: {e}",
            a.layers, a.hidden, a.vocab, a.seq
        ));
    }
    a
}

/// The measured GPT-2.
fn config(args: &Args) -> Gpt2Config {
    Gpt2Config::new(args.vocab, args.seq.max(16), args.hidden, args.layers, HEADS)
}

/// Median step time, and the medians of its forward+backward and optimizer-step parts.
#[derive(Clone, Copy)]
struct Timing {
    step: Duration,
    compute: Duration,
    update: Duration,
    final_loss: f32,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn run(args: &Args, precision: PrecisionSettings) -> Result<Timing, String> {
    let stage = Stage::from_number(args.stage).ok_or("--stage must be 0-3")?;
    let config = config(args);
    let groups = ThreadGroup::new_group(args.world).map_err(|e| e.to_string())?;
    let (steps, seq, batch, vocab) = (args.steps, args.seq, args.batch, args.vocab);
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let precision = precision.clone();
            let config = config.clone();
            std::thread::spawn(move || -> Result<Timing, String> {
                let device = Default::default();
                let mut settings = EngineSettings::new(stage, OptimizerSpec::adamw());
                settings.precision = precision;
                let model = config.init::<B>(&device).into_sharded();
                let group: Arc<dyn ProcessGroup> = group;
                let units: UnitComm<Flex> = Arc::new(HostStaged::new(group.clone()));
                let (mut model, mut optim) =
                    zero_burn::initialize_settings(settings, model, group, units).map_err(|e| e.to_string())?;
                let (mut total, mut compute, mut update) = (Vec::new(), Vec::new(), Vec::new());
                let mut last = f32::NAN;
                for step in 0..WARMUP + steps {
                    // Deterministic tokens, different per rank and step.
                    let ids: Vec<i64> = (0..batch * seq)
                        .map(|i| ((i * 7919 + step * 104_729 + rank * 31) % vocab) as i64)
                        .collect();
                    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &device);
                    let start = Instant::now();
                    let loss = model.loss(tokens.clone(), tokens).map_err(|e| e.to_string())?;
                    last = loss.clone().into_scalar().elem::<f32>();
                    optim.note_loss(last as f64);
                    let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
                    let mid = Instant::now();
                    model = optim.try_step(1e-4, model, grads).map_err(|e| e.to_string())?;
                    let end = Instant::now();
                    if step >= WARMUP {
                        total.push(end - start);
                        compute.push(mid - start);
                        update.push(end - mid);
                    }
                }
                Ok(Timing {
                    step: median(total),
                    compute: median(compute),
                    update: median(update),
                    final_loss: last,
                })
            })
        })
        .collect();
    let mut results = Vec::new();
    for h in handles {
        results.push(h.join().map_err(|_| "a rank panicked".to_string())??);
    }
    Ok(results[0])
}

fn precision(name: &str) -> Option<PrecisionSettings> {
    match name {
        "fp32" => Some(PrecisionSettings::fp32()),
        "bf16" => Some(PrecisionSettings::bf16()),
        "fp16" => Some(PrecisionSettings::fp16(LossScalerConfig::default())),
        _ => None,
    }
}

/// One precision, in this process: prints `RESULT name step_ms compute_ms update_ms loss`.
fn child(args: &Args, name: &str) -> Result<(), String> {
    let precision = precision(name).ok_or_else(|| format!("--only {name}: not fp32, bf16 or fp16"))?;
    if precision.dtype.is_half() {
        let device = Default::default();
        // Only the float default changes: i32 is Flex's default int dtype (its `IntElem`).
        let int = burn::tensor::DType::I32;
        burn::tensor::set_default_dtypes::<B>(&device, precision.dtype.burn(), int)
            .map_err(|e| format!("setting the default float dtype: {e:?}"))?;
    }
    let t = run(args, precision)?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "RESULT {name} {:.3} {:.3} {:.3} {:.4}",
        ms(t.step),
        ms(t.compute),
        ms(t.update),
        t.final_loss
    );
    Ok(())
}

fn main() {
    let args = parse();
    if let Some(name) = &args.only {
        if let Err(e) = child(&args, name) {
            eprintln!("precision {name}: {e}");
            std::process::exit(1);
        }
        return;
    }
    println!(
        "GPT-2 {} layers, hidden {}, vocab {}, seq {}, batch {} per rank; stage {}, world {}; median of {} steps",
        args.layers, args.hidden, args.vocab, args.seq, args.batch, args.stage, args.world, args.steps
    );
    let exe = std::env::current_exe().unwrap_or_else(|_| "precision".into());
    let passed: Vec<String> = std::env::args().skip(1).collect();
    let mut base: Option<f64> = None;
    let mut failed = 0;
    for name in ["fp32", "bf16", "fp16"] {
        let out = std::process::Command::new(&exe)
            .args(&passed)
            .args(["--only", name])
            .output();
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                println!("{name}: could not start: {e}");
                failed += 1;
                continue;
            }
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(line) = text.lines().find(|l| l.starts_with("RESULT ")) else {
            let err = String::from_utf8_lossy(&out.stderr);
            println!(
                "{name}: failed: {}",
                err.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
            );
            failed += 1;
            continue;
        };
        let f: Vec<f64> = line.split_whitespace().skip(2).filter_map(|v| v.parse().ok()).collect();
        if f.len() < 4 {
            println!("{name}: unreadable result `{line}`");
            failed += 1;
            continue;
        }
        let ratio = base.map(|b| f[0] / b).unwrap_or(1.0);
        if name == "fp32" {
            base = Some(f[0]);
        }
        println!(
            "{name}: step {:8.1} ms (forward+backward {:8.1} ms, optimizer step {:6.1} ms)  x{ratio:.2} of fp32  last loss {:.3}",
            f[0], f[1], f[2], f[3]
        );
    }
    // A run with a failed precision measured less than it names: its caller must not read it
    // as a success.
    if failed > 0 {
        eprintln!("precision: {failed} of 3 runs failed");
        std::process::exit(1);
    }
}
