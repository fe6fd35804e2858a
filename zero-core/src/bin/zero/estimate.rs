//! `zero estimate`: bytes of model states per device, per host and on NVMe for a parameter
//! count, a zoo preset (GPT-2 or the Llama family) or a HuggingFace `config.json`, a ZeRO stage,
//! a cluster shape and offload choices.

use crate::{print_error, print_output};
use std::process::ExitCode;
use zero_core::estimate::{
    estimate, human_bytes, Dtype, EstimateError, EstimateInput, FitError, Gpt2Shape, LlamaShape, NvmeStreaming,
    OffloadTarget, StateBytes, GPT2_PRESETS, LLAMA_PRESETS,
};

/// Arguments of `zero estimate`.
#[derive(clap::Args)]
pub struct Args {
    /// Trainable parameters (e.g. 1500000000, 1.5e9).
    #[arg(long, conflicts_with_all = ["preset", "fit_host_memory"])]
    pub params: Option<String>,
    /// A zoo preset: GPT-2 (tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-10b, or a shape
    /// `gpt2-<layers>x<hidden>`, e.g. gpt2-40x4096) or the Llama family (llama3.2-1b,
    /// llama3.2-3b, llama3-8b, llama3.1-8b, qwen2.5-0.5b, qwen2.5-7b, qwen3-0.6b, qwen3-8b,
    /// mistral-7b, and llama-tiny, qwen2-tiny, qwen3-tiny, mistral-tiny).
    #[arg(long, conflicts_with_all = ["fit_host_memory", "model_config"])]
    pub preset: Option<String>,
    /// A HuggingFace `config.json` of the Llama family (model_type llama, qwen2, qwen3 or
    /// mistral): the model it describes.
    #[arg(long, value_name = "CONFIG_JSON", conflicts_with_all = ["params", "fit_host_memory"])]
    pub model_config: Option<std::path::PathBuf>,
    /// Instead of a model: find the deepest GPT-2 of hidden size --hidden whose model states fit
    /// this much memory per host (e.g. 128GiB, 120e9), and print its estimate.
    #[arg(long, value_name = "BYTES")]
    pub fit_host_memory: Option<String>,
    /// With --fit-host-memory: the memory per device it must also fit (default: no limit).
    #[arg(long, value_name = "BYTES", requires = "fit_host_memory")]
    pub fit_device_memory: Option<String>,
    /// With --fit-host-memory: the hidden size of the GPT-2 searched (default 4096).
    #[arg(long, requires = "fit_host_memory")]
    pub hidden: Option<u64>,
    /// ZeRO stage, 0-3.
    #[arg(long)]
    pub stage: u8,
    /// Devices per node.
    #[arg(long, default_value_t = 1)]
    pub gpus_per_node: u64,
    /// Nodes.
    #[arg(long, default_value_t = 1)]
    pub nodes: u64,
    /// Offload the optimizer state: cpu or nvme.
    #[arg(long, value_name = "DEVICE")]
    pub offload_optimizer: Option<String>,
    /// Offload the parameters (stage 3): cpu or nvme.
    #[arg(long, value_name = "DEVICE")]
    pub offload_param: Option<String>,
    /// Training dtype: bf16, fp16 or fp32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Stage 3: elements gathered ahead of their use (`stage3_prefetch_bucket_size`: a count
    /// such as 5e7, 0 for none, or `auto`, 0.9 × hidden², as a config's "auto" resolves). The
    /// gathered term is one unit and what may be in flight beside it. Default 5e7. Needs the
    /// model's units: --preset or --fit-host-memory.
    #[arg(long, value_name = "ELEMENTS", conflicts_with = "params")]
    pub prefetch_bucket_size: Option<String>,
    /// With --offload-optimizer nvme: host buffers the state streams through
    /// (`offload_optimizer.buffer_count`).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub buffer_count: u64,
    /// With --offload-optimizer nvme: elements per streamed chunk (`sub_group_size`; within 64Ki..=4Mi).
    #[arg(long, default_value_t = 1_000_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub sub_group_size: u64,
    /// Tensor-parallel degree T (`tensor_parallel.autotp_size`): each device holds its slice of
    /// a GPT-2 split as the zoo's tensor-parallel model splits it, and ZeRO partitions over the
    /// devices / T data-parallel ones. Needs a GPT-2 (--preset or --fit-host-memory).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub tensor_parallel: u64,
}

impl Args {
    /// `--hidden`, or 4096.
    fn hidden(&self) -> u64 {
        self.hidden.unwrap_or(4096)
    }
}

/// Runs the subcommand: the estimate on stdout, or the error on stderr with exit status 2.
pub fn run(args: Args) -> ExitCode {
    match report(&args) {
        Ok(text) => print_output(&text),
        Err(message) => print_error(message),
    }
}

/// The flag (and its value) an overflowing input came from, for the error.
fn blame(args: &Args, e: &EstimateError) -> String {
    let input = match e {
        EstimateError::Overflow { input, .. } => *input,
        EstimateError::TensorParallel { .. } => return format!("--tensor-parallel {}", args.tensor_parallel),
    };
    match input {
        "gpus_per_node" => format!("--gpus-per-node {}", args.gpus_per_node),
        "nodes" => format!("--nodes {}", args.nodes),
        _ => match (&args.params, &args.preset, &args.model_config) {
            (Some(p), _, _) => format!("--params {p}"),
            (None, Some(name), _) => format!("--preset {name}"),
            (None, None, Some(path)) => format!("--model-config {}", path.display()),
            (None, None, None) => format!("--hidden {}", args.hidden()),
        },
    }
}

fn target(flag: &str, value: Option<&str>) -> Result<Option<OffloadTarget>, String> {
    match value {
        None | Some("none") => Ok(None),
        Some("cpu") => Ok(Some(OffloadTarget::Cpu)),
        Some("nvme") => Ok(Some(OffloadTarget::Nvme)),
        Some(other) => Err(format!("--{flag} {other}: expected cpu, nvme or none")),
    }
}

/// `--prefetch-bucket-size`: a count (0 allowed), or `auto` (`None`: 0.9 × hidden², once the
/// shape is known).
fn prefetch_budget(text: &str) -> Result<Option<u64>, String> {
    if text == "auto" {
        return Ok(None);
    }
    let clean = text.replace(['_', ','], "");
    match clean.parse::<f64>() {
        Ok(v) if (0.0..1e18).contains(&v) => Ok(Some(v.round() as u64)),
        _ => Err(format!(
            "--prefetch-bucket-size {text}: expected a count of elements such as 5e7, 0 (no prefetch) or auto"
        )),
    }
}

/// The prefetch budget `auto` resolves to for hidden size `hidden` (the config's rule).
fn auto_prefetch(hidden: u64) -> u64 {
    hidden.saturating_mul(hidden).saturating_mul(9) / 10
}

fn parse_count(text: &str) -> Result<u64, String> {
    let clean = text.replace(['_', ','], "");
    match clean.parse::<u64>() {
        Ok(0) => return Err(format!("--params {text}: expected a positive count")),
        Ok(n) => return Ok(n),
        Err(_) => {}
    }
    match clean.parse::<f64>() {
        Ok(v) if (1.0..1e18).contains(&v) && v.fract() == 0.0 => Ok(v as u64),
        Ok(v) if (1.0..1e18).contains(&v) => Err(format!("--params {text}: expected a whole count of parameters")),
        Ok(v) if v >= 1e18 => Err(format!(
            "--params {text}: estimates stop below 1e18 parameters (a million times the largest models trained)"
        )),
        _ => Err(format!(
            "--params {text}: expected a positive count such as 124439808 or 1.5e9"
        )),
    }
}

/// A byte size (`zero_core::checkpoint::parse_size`), the flag named in its error.
fn parse_bytes(flag: &str, text: &str) -> Result<u64, String> {
    zero_core::checkpoint::parse_size(text).map_err(|e| format!("--{flag} {e}"))
}

fn report(args: &Args) -> Result<String, String> {
    if args.stage > 3 {
        return Err(format!("--stage {}: expected 0, 1, 2 or 3", args.stage));
    }
    if args.gpus_per_node == 0 || args.nodes == 0 {
        return Err("--gpus-per-node and --nodes must be at least 1".into());
    }
    let dtype =
        Dtype::from_name(&args.dtype).ok_or_else(|| format!("--dtype {}: expected bf16, fp16 or fp32", args.dtype))?;
    let offload_param = target("offload-param", args.offload_param.as_deref())?;
    if offload_param.is_some() && args.stage != 3 {
        return Err(format!(
            "--offload-param applies to stage 3 only; the stage is {}",
            args.stage
        ));
    }
    if args.fit_host_memory.is_none() {
        if args.fit_device_memory.is_some() {
            return Err("--fit-device-memory bounds the search of --fit-host-memory; give both, or neither".into());
        }
        if let Some(h) = args.hidden {
            return Err(format!(
                "--hidden {h} sets the width --fit-host-memory searches at; a --preset names its own, --params has none"
            ));
        }
    }
    let prefetch = prefetch_budget(args.prefetch_bucket_size.as_deref().unwrap_or("5e7"))?;
    let mut input = EstimateInput {
        params: 0,
        gathered_at_once: None,
        prefetch_bucket_size: prefetch.unwrap_or(0),
        largest_group: None,
        stage: args.stage,
        gpus_per_node: args.gpus_per_node,
        nodes: args.nodes,
        offload_optimizer: target("offload-optimizer", args.offload_optimizer.as_deref())?,
        offload_param,
        dtype,
        nvme_streaming: NvmeStreaming {
            buffer_count: args.buffer_count,
            chunk_elements: zero_core::offload::chunk_elements(args.sub_group_size) as u64,
        },
        tensor_parallel: args.tensor_parallel,
    };
    if args.tensor_parallel > 1 && args.params.is_some() {
        return Err(format!(
            "--tensor-parallel {} with --params: what a tensor rank holds depends on the model's shape; give \
             --preset NAME (or --fit-host-memory)",
            args.tensor_parallel
        ));
    }
    // N, checked before any shape is looked at (the devices may not split into tensor groups).
    let world = input.data_parallel().map_err(|e| format!("{}: {e}", blame(args, &e)))?;
    let describe = |name: &str, shape: &Gpt2Shape| {
        let rank = shape.tensor_slice(args.tensor_parallel);
        let slice = match args.tensor_parallel {
            1 => String::new(),
            t => format!("; each of {t} tensor ranks holds {} of them, in", rank.num_params()),
        };
        format!(
            "{name}: {} parameters ({} layers, hidden {}){slice} units of {} (embeddings) and {} (a block) parameters",
            shape.num_params(),
            shape.n_layer,
            shape.n_embd,
            rank.embed_params(),
            rank.block_params()
        )
    };
    let llama = match (&args.preset, &args.model_config) {
        (Some(name), _) if Gpt2Shape::preset(name).is_none() => LlamaShape::preset(name).map(|s| (name.clone(), s)),
        (_, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("--model-config {}: {e}", path.display()))?;
            let shape =
                LlamaShape::from_config_json(&text).map_err(|e| format!("--model-config {}: {e}", path.display()))?;
            Some((path.display().to_string(), shape))
        }
        _ => None,
    };
    if let Some((name, shape)) = &llama {
        if args.tensor_parallel > 1 {
            return Err(format!(
                "--tensor-parallel {}: the zoo has no tensor-parallel plan for the Llama family yet; {name} is \
                 estimated over data-parallel devices only",
                args.tensor_parallel
            ));
        }
        if prefetch.is_none() {
            input.prefetch_bucket_size = auto_prefetch(shape.hidden);
        }
        input = shape.input(&input);
        let what = format!(
            "{name}: {} parameters ({} layers, hidden {}, {} heads over {} key/value heads), in units of {} \
             (embeddings{}) and {} (a layer) parameters",
            shape.num_params(),
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.embed_params(),
            if shape.tied {
                ", the tied head"
            } else {
                "; the untied head another"
            },
            shape.layer_params()
        );
        return render(args, dtype, world, &input, what);
    }
    let shape = match (&args.params, &args.preset, &args.fit_host_memory) {
        (Some(p), _, _) => {
            input.params = parse_count(p)?;
            None
        }
        (None, Some(name), _) => Some((
            name.clone(),
            Gpt2Shape::preset(name).ok_or_else(|| {
                format!(
                    "--preset {name}: unknown (known: {}, or gpt2-<layers>x<hidden> with hidden a multiple of 64 \
                     and fewer than 2^64 parameters; and {})",
                    GPT2_PRESETS.join(", "),
                    LLAMA_PRESETS.join(", ")
                )
            })?,
        )),
        (None, None, Some(host)) => {
            let host = parse_bytes("fit-host-memory", host)?;
            let device = match &args.fit_device_memory {
                Some(d) => parse_bytes("fit-device-memory", d)?,
                None => u64::MAX,
            };
            let limits = format!(
                "{} of host memory{}",
                human_bytes(host),
                if device == u64::MAX {
                    String::new()
                } else {
                    format!(" and {} per device", human_bytes(device))
                }
            );
            if prefetch.is_none() {
                input.prefetch_bucket_size = auto_prefetch(args.hidden());
            }
            let shape = Gpt2Shape::deepest_fitting(args.hidden(), &input, host, device).map_err(|e| match e {
                FitError::NothingFits { .. } => format!(
                    "no GPT-2 of hidden {} fits in {limits} at stage {}; {e}",
                    args.hidden(),
                    args.stage
                ),
                FitError::Unbounded => format!(
                    "--fit-host-memory {}: at stage {} with this offload the model states hold nothing in host \
                     memory that grows with the depth, so host memory does not limit it (every depth would \
                     \"fit\"); offload the optimizer state (--offload-optimizer cpu) or give --fit-device-memory",
                    human_bytes(host),
                    args.stage
                ),
                FitError::BadHidden(_) => format!("--hidden {}: {e}", args.hidden()),
                FitError::Estimate(e) => format!("{}: {e}", blame(args, &e)),
            })?;
            Some((format!("deepest fitting: {}", shape.shaped_name()), shape))
        }
        (None, None, None) => {
            return Err("give --params N, --preset NAME, --model-config CONFIG_JSON or --fit-host-memory BYTES".into())
        }
    };
    let what = match &shape {
        Some((name, shape)) if !shape.splits_over(args.tensor_parallel) => {
            return Err(format!(
                "--tensor-parallel {}: {name} has {} heads and an MLP of {}, which must both be multiples of it",
                args.tensor_parallel, shape.n_head, shape.n_inner
            ))
        }
        Some((name, shape)) => {
            if prefetch.is_none() {
                input.prefetch_bucket_size = auto_prefetch(shape.n_embd);
            }
            input = shape.input(&input);
            describe(name, shape)
        }
        None => format!("{} parameters", input.params),
    };
    render(args, dtype, world, &input, what)
}

/// The estimate of `input` as the report prints it, under the line `what` that names the model.
fn render(args: &Args, dtype: Dtype, world: u64, input: &EstimateInput, what: String) -> Result<String, String> {
    let e = estimate(input).map_err(|e| format!("{}: {e}", blame(args, &e)))?;
    let tensor = match args.tensor_parallel {
        1 => String::new(),
        t => format!(", {t} tensor ranks each"),
    };
    let mut out = format!(
        "{what}\nstage {}, {:?}, {} node(s) × {} device(s) (N = {world} data-parallel{tensor})\n",
        args.stage, dtype, args.nodes, args.gpus_per_node,
    );
    let mut section = |title: &str, b: &StateBytes| {
        if b.total() == 0 && title != "per device" {
            return;
        }
        out.push_str(&format!("{title}: {} ({} bytes)\n", human_bytes(b.total()), b.total()));
        for (kind, v) in [
            ("parameters", b.parameters),
            ("gradients", b.gradients),
            ("optimizer state", b.optimizer_state),
            ("gathered", b.gathered),
        ] {
            if v > 0 {
                out.push_str(&format!("  {kind:<16} {:>12}  ({v} bytes)\n", human_bytes(v)));
            }
        }
    };
    section("per device", &e.per_device);
    section("per host", &e.per_host);
    section("per node on NVMe", &e.per_node_nvme);
    out.push_str(match args.tensor_parallel {
        1 => "formula (Ψ parameters, N devices, G devices per node):\n",
        _ => "formula (Ψ parameters of a tensor rank, N data-parallel devices, G devices per node):\n",
    });
    for line in &e.formula {
        out.push_str(&format!("  {line}\n"));
    }
    Ok(out.trim_end().to_string())
}
