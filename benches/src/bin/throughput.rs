//! Training throughput of GPT-2 under each ZeRO stage at world size 1: tokens per second and
//! model FLOPs utilisation, on the CPU (Flex) or, built with `--features cuda`, on a CUDA GPU
//! (`cuda`: `burn::backend::Cuda`, which fuses element-wise operations; `cuda-unfused`: the
//! `CubeBackend` under it, to measure what fusion brings).
//!
//! `cargo run --release -p zero-benches [--features cuda] --bin throughput -- [--backend cpu|cuda|cuda-unfused]
//!  [--models gpt2,gpt2-xl] [--stages 0,1,2,3] [--dtype bf16|fp16|fp32] [--batch 8] [--seq 1024]
//!  [--steps 10] [--peak-tflops T] [--offload-optimizer cpu] [--offload-param cpu] [--delayed-update]
//!  [--baseline NAME=TOKENS_PER_S]`
//!
//! What trains is the zoo's `ShardedGpt2` (embeddings and blocks as `ZeroModule`s) from
//! `zero_burn::initialize` in Burn's own loop with `ZeroOptimizer` (stage 3 under
//! `Autodiff<B, BalancedCheckpointing>`), whose masters and Adam state are tensors on the
//! model's device unless `--offload-optimizer cpu`.
//!
//! Each row's tokens/s is given as a ratio to the first stage measured for the same model in
//! this run, and, with `--baseline`, to a named baseline measured beside it (tools/gpu/run.sh
//! passes PyTorch + transformers' figure on the same GPU).
//!
//! One line per model and stage, in markdown. The step is forward + backward + optimizer step,
//! synchronised with the device before the clock stops; the figure is the median over `--steps`
//! timed steps after 2 warm-up steps; "of which optimizer" is the median time in
//! `ZeroOptimizer::try_step`, the device synchronised after backward and after the step (so a
//! step the optimizer could overlap with backward's tail is counted whole); "optimizer / memory
//! floor" divides it by the least time an AdamW step can take on the device, 28 bytes a
//! parameter at the bandwidth of an `x + 1` over 1 GiB (256 MiB on the host) measured in the same
//! run (not printed with `--offload-optimizer cpu`, whose step runs on the host). FLOPs per token follow the usual count for a decoder:
//! 6 × (matrix parameters: every parameter but the position embedding; the tied token embedding
//! counts once, as the LM head) + 12 × layers × n_embd × seq (attention scores and their use,
//! forward and backward). MFU = achieved FLOP/s ÷ `--peak-tflops` (default: 989 for cuda, the
//! H100/H200 SXM dense bf16 figure; for cpu the default is 0 and MFU is not printed).
//!
//! With `--offload-optimizer cpu` the fp32 masters and Adam state live in host memory (ZeRO-Offload)
//! and a model that does not fit runs as far as it can: a failure is printed as the row's result,
//! the other rows still run, and the bench then exits with status 1.
//! Stage 3 draws the model unit by unit, each cut as it is drawn (`Gpt2Config::init_sharded`), so
//! the whole model never exists at once.

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::Autodiff;
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ElementConversion;
use burn::tensor::{Int, Tensor, TensorData};
use std::time::Instant;
use zero_benches::cli::Args;
use zero_burn::sharded::ShardBackend;
use zero_burn::Stage;
use zero_core::comm::{SharedGroup, ThreadGroup};
use zero_core::config::DeepSpeedConfig;
use zero_models::gpt2::ShardedGpt2;
use zero_models::Gpt2Config;

/// What `--help` prints.
const USAGE: &str =
    "usage: throughput [--backend cpu|cuda|cuda-unfused] [--models tiny,gpt2,gpt2-xl] [--stages 0,1,2,3]
  [--dtype bf16|fp16|fp32] [--batch 4] [--seq 64] [--steps 3] [--peak-tflops T] [--offload-optimizer cpu]
  [--offload-param cpu] [--delayed-update] [--baseline NAME=TOKENS_PER_S]";

#[derive(Clone, Debug)]
struct Options {
    backend: String,
    models: Vec<String>,
    stages: Vec<Stage>,
    dtype: String,
    batch: usize,
    seq: usize,
    steps: usize,
    peak_tflops: Option<f64>,
    offload_cpu: bool,
    /// Stage 3's 16-bit shards in host memory (`offload_param: cpu`).
    offload_param: bool,
    /// The offloaded update delayed a step (`offload_optimizer.delayed_update`).
    delayed_update: bool,
    /// A named baseline's tokens/s measured beside this run (e.g. PyTorch's on the same GPU).
    baseline: Option<(String, f64)>,
}

/// The options, every one checked before any model is built (a bad one exits with status 2).
fn options() -> Options {
    let mut o = Options {
        backend: "cpu".into(),
        models: vec!["tiny".into()],
        stages: vec![Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3],
        dtype: "fp32".into(),
        batch: 4,
        seq: 64,
        steps: 3,
        peak_tflops: None,
        offload_cpu: false,
        offload_param: false,
        delayed_update: false,
        baseline: None,
    };
    let mut args = Args::new("throughput", USAGE);
    let mut configs = vec![("tiny".to_string(), Gpt2Config::tiny())];
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--backend" => o.backend = args.choice(&flag, &["cpu", "cuda", "cuda-unfused"]),
            "--models" => {
                configs = args.presets(&flag);
                o.models = configs.iter().map(|(name, _)| name.clone()).collect();
            }
            "--stages" => o.stages = args.stages(&flag),
            "--dtype" => o.dtype = args.choice(&flag, &["bf16", "fp16", "fp32"]),
            "--batch" => o.batch = args.count(&flag, 1),
            "--seq" => o.seq = args.seq(&flag),
            "--steps" => o.steps = args.count(&flag, 1),
            "--peak-tflops" => o.peak_tflops = Some(args.real(&flag, 0.0)),
            "--offload-optimizer" => {
                args.choice(&flag, &["cpu"]);
                o.offload_cpu = true;
            }
            "--offload-param" => {
                args.choice(&flag, &["cpu"]);
                o.offload_param = true;
            }
            "--delayed-update" => o.delayed_update = true,
            "--baseline" => {
                let expected = "NAME=TOKENS_PER_S, with a positive number of tokens per second";
                let value = args.value(&flag, expected);
                let baseline = value
                    .split_once('=')
                    .and_then(|(n, v)| Some((n.to_string(), v.parse::<f64>().ok()?)))
                    .filter(|(_, tps)| tps.is_finite() && *tps > 0.0);
                o.baseline = Some(baseline.unwrap_or_else(|| args.bad(&flag, &value, expected)));
            }
            other => args.unknown(other),
        }
    }
    if o.delayed_update && !o.offload_cpu {
        args.fail("--delayed-update delays the offloaded optimizer's update: give --offload-optimizer cpu too");
    }

    args.check_tokens(("--batch", "--seq"), o.batch, o.seq);
    for (name, config) in configs {
        // As `main` builds it: positions for the whole sequence.
        let config = Gpt2Config {
            n_positions: config.n_positions.max(o.seq),
            ..config
        };
        if let Err(e) = config.validate() {
            args.fail(format_args!("--models {name} with --seq {}: {e}", o.seq));
        }
    }
    o
}

/// Training FLOPs per token (see the header).
fn flops_per_token(c: &Gpt2Config, seq: usize) -> f64 {
    let matrix_params = c.num_params() as f64 - (c.n_positions * c.n_embd) as f64;
    6.0 * matrix_params + 12.0 * (c.n_layer * c.n_embd * seq) as f64
}

struct Row {
    step_s: f64,
    /// Of which in `ZeroOptimizer::try_step` (median over the timed steps; the device
    /// synchronised before it and after).
    optimizer_s: f64,
    /// The optimizer step's memory floor on this device: [`OPTIMIZER_BYTES_PER_PARAM`] for
    /// every parameter, at the bandwidth [`copy_bandwidth`] measured in this run.
    floor_s: f64,
    tokens_per_s: f64,
    loss: f32,
    memory: zero_burn::MemoryReport,
}

/// Bytes an AdamW step moves per parameter at its least: the gradient in (16-bit, or fp32 in
/// fp32), the fp32 master and both moments read and written, and the 16-bit weight written
/// (none in fp32, where the master is the weight): 28 either way.
const OPTIMIZER_BYTES_PER_PARAM: f64 = 28.0;

/// The device's memory bandwidth as a tensor operation sees it, in bytes a second: the best of
/// five `x + 1` over `n` fp32 elements (4 bytes read and 4 written each, in place: `x` is the
/// only handle to its buffer), synchronised, after one warm-up; the baseline the optimizer's
/// floor is computed from in the same run.
fn copy_bandwidth<B: Backend>(device: &B::Device, n: usize) -> Result<f64, String> {
    let mut x = Tensor::<B, 1>::zeros([n], device);
    let mut best = f64::INFINITY;
    for round in 0..6 {
        B::sync(device).map_err(|e| format!("{e:?}"))?;
        let start = Instant::now();
        x = x.add_scalar(1.0);
        B::sync(device).map_err(|e| format!("{e:?}"))?;
        if round > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    Ok(8.0 * n as f64 / best)
}

/// Median step of `o.steps` timed steps after 2 warm-up steps, on one rank.
fn run<B: AutodiffBackend + ShardBackend>(
    device: B::Device,
    config: &Gpt2Config,
    stage: Stage,
    o: &Options,
) -> Result<Row, String> {
    // Progress on stderr (the table stays on stdout): where a row that ran out of time was.
    let begun = Instant::now();
    let progress = |what: String| {
        eprintln!(
            "  [{} layers x {}, stage {}] {what}",
            config.n_layer,
            config.n_embd,
            stage.number()
        )
    };
    // 1 GiB on a GPU, 256 MiB on the host: well past the caches either way.
    let elements = if o.backend.starts_with("cuda") {
        1 << 28
    } else {
        1 << 26
    };
    let bandwidth = copy_bandwidth::<B::InnerBackend>(&device, elements)?;
    let group = ThreadGroup::new_group(1).map_err(|e| e.to_string())?.remove(0) as SharedGroup;
    let ds = module_config(config, stage, o)?;
    let model = if stage == Stage::Zero3 {
        // Drawn unit by unit (zero.Init): the largest models fit only if the whole model never
        // exists at once, on the device or in host memory.
        let units: zero_burn::sharded::UnitComm<<B as ShardBackend>::Collective> =
            std::sync::Arc::new(zero_burn::HostStaged::new(group.clone()));
        config
            .init_sharded::<B>(&device, units, persistence_threshold(config))
            .map_err(|e| e.to_string())?
    } else {
        config.init::<B>(&device).into_sharded()
    };
    let (model, mut optim) = zero_burn::initialize(&ds, model, group).map_err(|e| e.to_string())?;
    progress(format!(
        "model and optimizer ready in {:.1} s",
        begun.elapsed().as_secs_f64()
    ));
    let mut model = Some(model);
    let (mut times, mut optimizer_times) = (Vec::new(), Vec::new());
    let mut loss = f32::NAN;
    for step in 0..2 + o.steps {
        let ids: Vec<i64> = (0..o.batch * o.seq)
            .map(|i| ((i * 7919 + step * 104_729) % config.vocab_size) as i64)
            .collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [o.batch, o.seq]), &device);
        B::sync(&device).map_err(|e| format!("{e:?}"))?;
        let start = Instant::now();
        // Taken out for the step, so that the old parameters are not held beside the new.
        let m: ShardedGpt2<B> = model.take().ok_or("a failed step left no model")?;
        let l = m.loss(tokens.clone(), tokens).map_err(|e| e.to_string())?;
        // Read once the step is timed, as the PyTorch baseline reads `loss.item()`: reading it
        // here would wait for the forward before backward's kernels are queued.
        let step_loss = l.clone().inner();
        let grads = GradientsParams::from_grads(optim.scale_loss(l).backward(), &m);
        B::sync(&device).map_err(|e| format!("{e:?}"))?;
        let backward_done = start.elapsed().as_secs_f64();
        model = Some(optim.try_step(1e-4, m, grads).map_err(|e| e.to_string())?);
        B::sync(&device).map_err(|e| format!("{e:?}"))?;
        if step >= 2 {
            times.push(start.elapsed().as_secs_f64());
            optimizer_times.push(start.elapsed().as_secs_f64() - backward_done);
        } else {
            progress(format!(
                "warm-up step {} in {:.2} s",
                step + 1,
                start.elapsed().as_secs_f64()
            ));
        }
        loss = step_loss.into_scalar().elem::<f32>();
    }
    times.sort_by(f64::total_cmp);
    optimizer_times.sort_by(f64::total_cmp);
    let step_s = times[times.len() / 2];
    Ok(Row {
        step_s,
        optimizer_s: optimizer_times[optimizer_times.len() / 2],
        floor_s: OPTIMIZER_BYTES_PER_PARAM * config.num_params() as f64 / bandwidth,
        tokens_per_s: (o.batch * o.seq) as f64 / step_s,
        loss,
        memory: optim.memory(),
    })
}

/// Units below this many elements stay whole (`stage3_param_persistence_threshold`): the
/// biases and layer norms, not the blocks.
fn persistence_threshold(config: &Gpt2Config) -> usize {
    10 * config.n_embd
}

/// The run's DeepSpeed config.
fn module_config(config: &Gpt2Config, stage: Stage, o: &Options) -> Result<DeepSpeedConfig, String> {
    let precision = match o.dtype.as_str() {
        "fp32" => "",
        "bf16" => r#""bf16": {"enabled": true},"#,
        "fp16" => r#""fp16": {"enabled": true},"#,
        other => return Err(format!("--dtype {other}: expected bf16, fp16 or fp32")),
    };
    let mut offload = String::new();
    if o.offload_cpu && o.delayed_update {
        offload += r#", "offload_optimizer": {"device": "cpu", "delayed_update": true}"#;
    } else if o.offload_cpu {
        offload += r#", "offload_optimizer": {"device": "cpu"}"#;
    }
    if o.offload_param && stage == Stage::Zero3 {
        offload += r#", "offload_param": {"device": "cpu"}"#;
    }
    let text = format!(
        r#"{{"train_batch_size": {batch}, "gradient_clipping": 0.0, {precision}
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.0001}}}},
        "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": {bucket}, "overlap_comm": true,
            "stage3_prefetch_bucket_size": {prefetch},
            "stage3_param_persistence_threshold": {threshold}{offload}}}}}"#,
        batch = o.batch,
        stage = stage.number(),
        bucket = 5 * config.n_embd * config.n_embd,
        prefetch = 9 * config.n_embd * config.n_embd,
        threshold = persistence_threshold(config),
    );
    DeepSpeedConfig::from_str(&text, "throughput.json")
        .map(|p| p.config)
        .map_err(|e| e.to_string())
}

fn run_on(backend: &str, config: &Gpt2Config, stage: Stage, o: &Options) -> Result<Row, String> {
    match backend {
        "cpu" if stage == Stage::Zero3 => {
            run::<Autodiff<burn::backend::Flex, BalancedCheckpointing>>(Default::default(), config, stage, o)
        }
        "cpu" => run::<Autodiff<burn::backend::Flex>>(Default::default(), config, stage, o),
        #[cfg(feature = "cuda")]
        "cuda" => run_on_cuda::<burn::backend::Cuda>(config, stage, o),
        #[cfg(feature = "cuda")]
        "cuda-unfused" => run_on_cuda::<CubeCuda>(config, stage, o),
        #[cfg(not(feature = "cuda"))]
        "cuda" | "cuda-unfused" => {
            Err("this binary was built without the `cuda` feature (cargo ... --features cuda)".into())
        }
        other => Err(format!("--backend {other}: expected cpu, cuda or cuda-unfused")),
    }
}

/// Burn's CUDA backend without its fusion of element-wise operations (`--backend cuda-unfused`),
/// to measure what fusion brings.
#[cfg(feature = "cuda")]
type CubeCuda = burn_cubecl::CubeBackend<burn_cubecl::cubecl::cuda::CudaRuntime, f32, i32, u8>;

#[cfg(feature = "cuda")]
fn run_on_cuda<B>(config: &Gpt2Config, stage: Stage, o: &Options) -> Result<Row, String>
where
    B: zero_burn::CudaBuffers + ShardBackend<Collective = B>,
{
    zero_burn::device::cuda_devices().map_err(|why| format!("--backend cuda: {why}"))?;
    if stage == Stage::Zero3 {
        run::<Autodiff<B, BalancedCheckpointing>>(Default::default(), config, stage, o)
    } else {
        run::<Autodiff<B>>(Default::default(), config, stage, o)
    }
}

fn main() {
    let o = options();
    let peak = o
        .peak_tflops
        .unwrap_or(if o.backend.starts_with("cuda") { 989.0 } else { 0.0 });
    println!(
        "backend {}, ZeroModule + ZeroOptimizer, {}, batch {} x seq {}, {} timed steps, optimizer offload: {}, \
         parameter offload (stage 3): {}",
        o.backend,
        o.dtype,
        o.batch,
        o.seq,
        o.steps,
        match (o.offload_cpu, o.delayed_update) {
            (true, true) => "cpu, its update delayed a step",
            (true, false) => "cpu",
            _ => "none",
        },
        if o.offload_param { "cpu" } else { "none" }
    );
    let baseline_column = o
        .baseline
        .as_ref()
        .map_or(String::new(), |(name, tps)| format!(" vs {name} ({tps:.0} tokens/s) |"));
    println!(
        "| model | params | stage | step | of which optimizer | optimizer / memory floor | tokens/s | vs first stage |{baseline_column} MFU | loss | model states (optimizer's count) |"
    );
    println!(
        "|---|---|---|---|---|---|---|---|{}---|---|---|",
        if o.baseline.is_some() { "---|" } else { "" }
    );
    let mut failed = 0;
    for name in &o.models {
        let config = match Gpt2Config::preset(name) {
            Ok(c) => Gpt2Config {
                n_positions: c.n_positions.max(o.seq),
                ..c
            },
            Err(e) => {
                eprintln!("throughput: {e}");
                std::process::exit(2);
            }
        };
        let mut first_stage: Option<(u8, f64)> = None;
        for &stage_kind in &o.stages {
            let stage = stage_kind.number();
            let params = format!("{:.1}M", config.num_params() as f64 / 1e6);
            match run_on(&o.backend, &config, stage_kind, &o) {
                Ok(r) => {
                    let achieved = r.tokens_per_s * flops_per_token(&config, o.seq);
                    let mfu = if peak > 0.0 {
                        format!("{:.1}%", 100.0 * achieved / (peak * 1e12))
                    } else {
                        "-".into()
                    };
                    let (first, first_tps) = *first_stage.get_or_insert((stage, r.tokens_per_s));
                    let vs_first = format!("{:.2}x stage {first}", r.tokens_per_s / first_tps);
                    let vs_baseline = o
                        .baseline
                        .as_ref()
                        .map_or(String::new(), |(_, tps)| format!(" {:.2}x |", r.tokens_per_s / tps));
                    println!(
                        "| {name} | {params} | {stage} | {:.1} ms | {:.1} ms | {:.1}x ({:.2} ms) | {:.0} | {vs_first} |{vs_baseline} {mfu} | {:.3} | {:.2} GB |",
                        r.step_s * 1e3,
                        r.optimizer_s * 1e3,
                        if o.offload_cpu { f64::NAN } else { r.optimizer_s / r.floor_s },
                        r.floor_s * 1e3,
                        r.tokens_per_s,
                        r.loss,
                        r.memory.total_current() as f64 / 1e9
                    );
                }
                Err(e) => {
                    failed += 1;
                    // On one line, so that the table stays a table.
                    let why = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
                    println!("| {name} | {params} | {stage} | failed: {why} | | | | | | | |");
                }
            }
        }
    }
    // A run with a failed row measured less than it names: its caller (tools/gpu/run.sh) must
    // not read it as a success.
    if failed > 0 {
        eprintln!(
            "throughput: {failed} of {} runs failed",
            o.models.len() * o.stages.len()
        );
        std::process::exit(1);
    }
}
