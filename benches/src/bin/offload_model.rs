//! The largest GPT-2 whose training step runs on this machine with ZeRO-3 and offload: one
//! preset per process, its training steps timed, its peak resident memory (`VmHWM`) read from
//! the kernel beside what `zero estimate` predicts for the same setting.
//!
//! The run is refused before anything is allocated when the estimate's host bytes (device and
//! host together: the CPU backend's device is host memory) exceed `--max-host-gib`, so that a
//! ladder of presets stops at the first one the machine cannot hold instead of swapping.
//!
//! What trains is the zoo's `ShardedGpt2`, drawn unit by unit (`Gpt2Config::init_sharded`, so
//! the whole model never exists at once), from `zero_burn::initialize_settings`, in Burn's own
//! loop with `ZeroOptimizer` under `Autodiff<Flex, BalancedCheckpointing>`. The first two steps
//! are warm-ups and not counted in the median: the first optimizer step touches the optimizer
//! state's pages for the first time.
//!
//! `offload_model --preset gpt2-large [--seq 32] [--batch 1] [--world 1] [--steps 2]
//!  [--dtype fp32|bf16] [--optimizer nvme|cpu] [--param nvme|cpu|none] [--dir PATH]
//!  [--max-host-gib 20] [--optimizer-threads 0]`
//!
//! `--optimizer-threads` sizes the offloaded optimizer's own thread pool (0: one per core).
//! With `RAYON_NUM_THREADS=1` for the model's compute and `--optimizer-threads 1`, the two
//! run on separate cores, as a GPU's forward and the host's Adam would.
//!
//! `--delayed on` trains with `offload_optimizer.delayed_update` (the host's update of a step
//! runs beside the next forward and backward); `--delayed both` trains sequentially and delayed
//! in turn, `--rounds` times each, in this one process, and prints the two medians and their
//! ratio (the baseline is the sequential step, measured in the same run). The optimizer's
//! `flush` after the last step is timed apart.

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use zero_benches::cli::{self, MAX_THREADS};
use zero_burn::{EngineSettings, OptimizerOffload, ParamOffload, PrecisionSettings, Stage};
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::estimate::{estimate, human_bytes, Dtype, EstimateInput, Gpt2Shape, OffloadTarget};
use zero_core::optim::OptimizerSpec;
use zero_models::Gpt2Config;

type B = Autodiff<Flex, BalancedCheckpointing>;

struct Args {
    preset: String,
    seq: usize,
    batch: usize,
    world: usize,
    steps: usize,
    dtype: String,
    optimizer: String,
    param: String,
    dir: PathBuf,
    max_host_gib: f64,
    optimizer_threads: usize,
    delayed: String,
    rounds: usize,
}

/// What `--help` prints.
const USAGE: &str = "usage: offload_model [--preset gpt2] [--seq 32] [--batch 1] [--world 1] [--steps 2]
  [--dtype fp32|bf16] [--optimizer nvme|cpu|none] [--param nvme|cpu|none] [--dir PATH] [--max-host-gib 20]
  [--optimizer-threads 0] [--delayed off|on|both] [--rounds 1]";

/// The options, every one checked before anything is allocated (a bad one exits with status 2).
fn args() -> Args {
    let mut a = Args {
        preset: "gpt2".into(),
        seq: 32,
        batch: 1,
        world: 1,
        steps: 2,
        dtype: "fp32".into(),
        optimizer: "nvme".into(),
        param: "nvme".into(),
        dir: std::env::temp_dir().join("zero-offload-model"),
        max_host_gib: 20.0,
        optimizer_threads: 0,
        delayed: "off".into(),
        rounds: 1,
    };
    let mut args = cli::Args::new("offload_model", USAGE);
    let mut config = Gpt2Config::gpt2();
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--preset" => {
                (a.preset, config) = args.preset(&flag);
                if Gpt2Shape::preset(&a.preset).is_none() {
                    args.fail(format_args!(
                        "--preset {}: no `zero estimate` shape of that name",
                        a.preset
                    ));
                }
            }
            "--seq" => a.seq = args.seq(&flag),
            "--batch" => a.batch = args.count(&flag, 1),
            "--world" => a.world = args.ranks(&flag),
            "--steps" => a.steps = args.count(&flag, 1),
            "--dtype" => a.dtype = args.choice(&flag, &["fp32", "bf16"]),
            "--optimizer" => a.optimizer = args.choice(&flag, &["nvme", "cpu", "none"]),
            "--param" => a.param = args.choice(&flag, &["nvme", "cpu", "none"]),
            "--dir" => a.dir = PathBuf::from(args.value(&flag, "a directory for the swap files")),
            "--max-host-gib" => a.max_host_gib = args.real(&flag, 0.0),
            "--optimizer-threads" => a.optimizer_threads = args.number(&flag, 0..=MAX_THREADS),
            "--delayed" => a.delayed = args.choice(&flag, &["off", "on", "both"]),
            "--rounds" => a.rounds = args.count(&flag, 1),
            other => args.unknown(other),
        }
    }
    if a.seq > config.n_positions {
        args.fail(format_args!(
            "--seq {}: expected at most {} (n_positions of --preset {})",
            a.seq, config.n_positions, a.preset
        ));
    }
    args.check_tokens(("--batch", "--seq"), a.batch, a.seq);
    if a.delayed != "off" && a.optimizer == "none" {
        args.fail(format_args!(
            "--delayed {}: the delayed update is the offloaded optimizer's; choose --optimizer cpu or nvme",
            a.delayed
        ));
    }
    a
}

/// A field of /proc/self/status in bytes (`VmHWM`: peak resident set; `VmRSS`: now).
fn proc_status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn main() {
    let a = args();
    if let Err(e) = run(&a) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn target(name: &str) -> Result<Option<OffloadTarget>, String> {
    match name {
        "cpu" => Ok(Some(OffloadTarget::Cpu)),
        "nvme" => Ok(Some(OffloadTarget::Nvme)),
        "none" => Ok(None),
        other => Err(format!("offload device {other}: expected cpu, nvme or none")),
    }
}

fn run(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let config = Gpt2Config::preset(&a.preset)?;
    let shape = Gpt2Shape::preset(&a.preset).ok_or_else(|| format!("no estimate shape for {}", a.preset))?;
    let dtype = Dtype::from_name(&a.dtype).ok_or_else(|| format!("--dtype {}", a.dtype))?;
    // What `zero estimate --preset` predicts.
    let mut input = shape.input(&EstimateInput::new(0, 3, a.world as u64, dtype));
    input.offload_optimizer = target(&a.optimizer)?;
    input.offload_param = target(&a.param)?;
    let predicted = estimate(&input)?;
    // Per process: every rank thread's device and host bytes (both are this machine's memory).
    let host = (predicted.per_device.total() + predicted.per_host.total()).saturating_mul(a.world as u64);
    println!(
        "{} ({:.0}M params), stage 3, {} rank thread(s), {}, optimizer {}, params {}, seq {} batch {}",
        a.preset,
        shape.num_params() as f64 / 1e6,
        a.world,
        a.dtype,
        a.optimizer,
        a.param,
        a.seq,
        a.batch
    );
    println!(
        "zero estimate: per device {} + per host {} (x{} ranks = {:.2} GiB in this process), NVMe {}",
        human_bytes(predicted.per_device.total()),
        human_bytes(predicted.per_host.total()),
        a.world,
        gib(host),
        human_bytes(predicted.per_node_nvme.total())
    );
    if gib(host) > a.max_host_gib {
        println!(
            "refused: the estimate ({:.2} GiB) exceeds --max-host-gib {}",
            gib(host),
            a.max_host_gib
        );
        return Ok(());
    }

    let precision = match a.dtype.as_str() {
        "fp32" => PrecisionSettings::fp32(),
        "bf16" => PrecisionSettings::bf16(),
        other => return Err(format!("--dtype {other}: fp32 or bf16 here").into()),
    };
    let offload_optimizer = match a.optimizer.as_str() {
        "cpu" => OptimizerOffload::Cpu {
            threads: a.optimizer_threads,
        },
        "nvme" => OptimizerOffload::Nvme {
            path: a.dir.join("optimizer"),
            buffer_count: 4,
            chunk_elements: 1 << 22, // the engine's largest chunk (initialize.rs)
            threads: a.optimizer_threads,
        },
        "none" => OptimizerOffload::None,
        other => return Err(format!("--optimizer {other}").into()),
    };
    let offload_param = match a.param.as_str() {
        "cpu" => ParamOffload::Cpu,
        "nvme" => ParamOffload::Nvme {
            path: a.dir.join("params"),
            max_in_cpu: 0,
        },
        "none" => ParamOffload::None,
        other => return Err(format!("--param {other}").into()),
    };
    let started = Instant::now();
    let mut setup = Setup {
        config,
        precision,
        offload_optimizer,
        offload_param,
        delayed: a.delayed == "on",
    };
    if a.delayed == "both" {
        return compare_delayed(a, &mut setup);
    }
    let rank0 = train(a, &setup)?;
    let hwm = proc_status_bytes("VmHWM:").unwrap_or(0);
    let m = &rank0.memory;
    println!(
        "model and optimizer built in {:.1} s (peak RSS then {:.2} GiB); rank 0 after the last step: parameters {} (host {}, \
         nvme {}), gradients {} (peak {}), masters {} (nvme {}), optimizer state {} (nvme {}), gathered peak {}",
        rank0.init,
        gib(rank0.after_init.unwrap_or(0)),
        human_bytes(m.parameters.current as u64),
        human_bytes(m.locations.parameters.host as u64),
        human_bytes(m.locations.parameters.nvme as u64),
        human_bytes(m.gradients.current as u64),
        human_bytes(m.gradients.peak as u64),
        human_bytes(m.master_weights.current as u64),
        human_bytes(m.locations.master_weights.nvme as u64),
        human_bytes(m.optimizer_state.current as u64),
        human_bytes(m.locations.optimizer_state.nvme as u64),
        human_bytes(m.gathered.peak as u64),
    );
    // The last step: the first one also warms the page cache and the allocator up.
    let last_step = rank0.times.last().copied().unwrap_or_default();
    println!(
        "RESULT {}: steps ran; last step {:.1} s (forward+backward {:.1} s, optimizer {:.1} s); peak RSS \
         (VmHWM) {:.2} GiB; estimate {:.2} GiB (measured / estimate {:.2}); wall {:.0} s",
        a.preset,
        last_step.total(),
        last_step.forward + last_step.backward,
        last_step.step,
        gib(hwm),
        gib(host),
        hwm as f64 / host.max(1) as f64,
        started.elapsed().as_secs_f64()
    );
    let counted: Vec<StepTimes> = rank0.times.iter().skip(WARMUP_STEPS).copied().collect();
    if !counted.is_empty() {
        let med = |f: fn(&StepTimes) -> f64| median(counted.iter().map(f).collect());
        println!(
            "median of {} steps after {WARMUP_STEPS} warm-ups: step total {:.3} s (forward {:.3}, backward {:.3}, \
             step() {:.3})",
            counted.len(),
            med(StepTimes::total),
            med(|t| t.forward),
            med(|t| t.backward),
            med(|t| t.step),
        );
    }
    let _ = std::fs::remove_dir_all(&a.dir);
    Ok(())
}

/// Steps not counted in the median (see the file's doc).
const WARMUP_STEPS: usize = 2;

/// `--delayed both`: sequential and delayed runs in turn, `--rounds` of each; the medians of
/// their counted steps and the ratio, delayed over sequential.
fn compare_delayed(a: &Args, setup: &mut Setup) -> Result<(), Box<dyn std::error::Error>> {
    let mut counted: [Vec<StepTimes>; 2] = [Vec::new(), Vec::new()];
    let mut flushes = Vec::new();
    for round in 0..a.rounds {
        for (mode, delayed) in [false, true].into_iter().enumerate() {
            setup.delayed = delayed;
            let run = train(a, setup)?;
            println!(
                "round {round}, {}: counted steps {}",
                if delayed { "delayed" } else { "sequential" },
                run.times
                    .iter()
                    .skip(WARMUP_STEPS)
                    .map(|t| format!("{:.3}", t.total()))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            counted[mode].extend(run.times.iter().skip(WARMUP_STEPS).copied());
            if delayed {
                flushes.push(run.flush);
            }
        }
    }
    let row = |label: &str, times: &[StepTimes]| {
        let med = |f: fn(&StepTimes) -> f64| median(times.iter().map(f).collect());
        println!(
            "  {label:<10} forward {:.3} s, backward {:.3} s, step() {:.3} s, total {:.3} s ({} steps)",
            med(|t| t.forward),
            med(|t| t.backward),
            med(|t| t.step),
            med(StepTimes::total),
            times.len()
        );
        med(StepTimes::total)
    };
    println!("medians after {WARMUP_STEPS} warm-ups per run:");
    let sequential = row("sequential", &counted[0]);
    let delayed = row("delayed", &counted[1]);
    println!(
        "RESULT delayed / sequential step: {:.3} ({:.3} s against {:.3} s); flush after the last step {:.3} s (median)",
        delayed / sequential,
        delayed,
        sequential,
        median(flushes)
    );
    let _ = std::fs::remove_dir_all(&a.dir);
    Ok(())
}

/// What a run is built from.
struct Setup {
    config: Gpt2Config,
    precision: PrecisionSettings,
    offload_optimizer: OptimizerOffload,
    offload_param: ParamOffload,
    /// `offload_optimizer.delayed_update`.
    delayed: bool,
}

/// Seconds of one training step, as rank 0 saw them.
#[derive(Clone, Copy, Debug, Default)]
struct StepTimes {
    forward: f64,
    backward: f64,
    step: f64,
}

impl StepTimes {
    fn total(&self) -> f64 {
        self.forward + self.backward + self.step
    }
}

/// Rank 0's run.
struct RankRun {
    init: f64,
    after_init: Option<u64>,
    times: Vec<StepTimes>,
    /// Seconds of the optimizer's `flush` after the last step (the delayed update's wait).
    flush: f64,
    memory: zero_burn::MemoryReport,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Builds the model and its optimizer on each rank thread and trains `a.steps` steps; returns
/// rank 0's run.
fn train(a: &Args, setup: &Setup) -> Result<RankRun, Box<dyn std::error::Error>> {
    let groups = ThreadGroup::new_group(a.world)?;
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let config = setup.config.clone();
            let (precision, offload_optimizer, offload_param) = (
                setup.precision.clone(),
                setup.offload_optimizer.clone(),
                setup.offload_param.clone(),
            );
            let (steps, seq, batch, delayed) = (a.steps, a.seq, a.batch, setup.delayed);
            std::thread::spawn(move || -> Result<_, String> {
                let device = Default::default();
                let mut settings = EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw());
                settings.precision = precision;
                settings.offload_optimizer = offload_optimizer;
                settings.offload_param = offload_param;
                settings.delayed_update = delayed;
                settings.overlap_comm = true;
                settings.reduce_bucket_size = config.n_embd * config.n_embd;
                settings.prefetch_bucket_size = 9 * config.n_embd * config.n_embd / 10;
                settings.param_persistence_threshold = 10 * config.n_embd;
                let dtype = settings.precision.dtype;
                let group: Arc<dyn ProcessGroup> = group;
                let units: zero_burn::sharded::UnitComm<Flex> = Arc::new(zero_burn::HostStaged::new(group.clone()));
                let t = Instant::now();
                let model = config
                    .init_sharded::<B>(&device, units.clone(), settings.param_persistence_threshold)
                    .map_err(|e| e.to_string())?;
                let (model, mut optim) =
                    zero_burn::initialize_settings(settings, model, group, units).map_err(|e| e.to_string())?;
                let mut model = Some(model);
                let init = t.elapsed().as_secs_f64();
                let after_init = proc_status_bytes("VmHWM:");
                let mut times = Vec::new();
                for step in 0..steps {
                    let ids: Vec<i64> = (0..batch * seq)
                        .map(|i| ((i * 7919 + rank * 104_729 + step * 31) % config.vocab_size) as i64)
                        .collect();
                    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &device);
                    let m = model.take().ok_or("a failed step left no model")?;
                    let t = Instant::now();
                    let loss = m.loss(tokens.clone(), tokens).map_err(|e| e.to_string())?;
                    let value = loss.clone().into_scalar().elem::<f32>();
                    let forward = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &m);
                    let backward = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    model = Some(optim.try_step(1e-4, m, grads).map_err(|e| e.to_string())?);
                    let opt = t.elapsed().as_secs_f64();
                    if rank == 0 {
                        println!(
                            "step {step}: loss {value:.4}, forward {forward:.2} s, backward {backward:.2} s, \
                             optimizer step {opt:.2} s ({dtype:?})",
                        );
                    }
                    times.push(StepTimes {
                        forward,
                        backward,
                        step: opt,
                    });
                }
                let t = Instant::now();
                let model = model.take().ok_or("a failed step left no model")?;
                drop(optim.flush(model).map_err(|e| e.to_string())?);
                let flush = t.elapsed().as_secs_f64();
                Ok(RankRun {
                    init,
                    after_init,
                    times,
                    flush,
                    memory: optim.memory(),
                })
            })
        })
        .collect();
    let mut results = Vec::new();
    for h in handles {
        results.push(h.join().map_err(|_| "a rank thread panicked")??);
    }
    results.into_iter().next().ok_or_else(|| "no rank ran".into())
}
