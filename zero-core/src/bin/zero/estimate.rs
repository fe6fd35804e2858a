//! `zero estimate`: bytes of model states per device, per host and on NVMe for a parameter
//! count or a GPT-2 preset, a ZeRO stage, a cluster shape and offload choices.

use std::process::ExitCode;
use zero_core::estimate::{
    estimate, human_bytes, Dtype, EstimateInput, Gpt2Shape, OffloadTarget, StateBytes, GPT2_PRESETS,
};

/// Arguments of `zero estimate`.
#[derive(clap::Args)]
pub struct Args {
    /// Trainable parameters (e.g. 1500000000, 1.5e9).
    #[arg(long, conflicts_with = "preset", required_unless_present = "preset")]
    pub params: Option<String>,
    /// A GPT-2 preset: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-10b.
    #[arg(long)]
    pub preset: Option<String>,
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
}

/// Runs the subcommand: the estimate on stdout, or the error on stderr with exit status 2.
pub fn run(args: Args) -> ExitCode {
    match report(&args) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
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

fn parse_count(text: &str) -> Result<u64, String> {
    let clean = text.replace(['_', ','], "");
    if let Ok(n) = clean.parse::<u64>() {
        return Ok(n);
    }
    match clean.parse::<f64>() {
        Ok(v) if (1.0..1e18).contains(&v) => Ok(v.round() as u64),
        _ => Err(format!(
            "--params {text}: expected a positive count such as 124439808 or 1.5e9"
        )),
    }
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
    let (params, largest, what) = match (&args.params, &args.preset) {
        (Some(p), _) => (parse_count(p)?, None, format!("{} parameters", parse_count(p)?)),
        (None, Some(name)) => {
            let shape = Gpt2Shape::preset(name)
                .ok_or_else(|| format!("--preset {name}: unknown (known: {})", GPT2_PRESETS.join(", ")))?;
            let what = format!(
                "{name}: {} parameters ({} layers, hidden {}), largest gather unit {} parameters",
                shape.num_params(),
                shape.n_layer,
                shape.n_embd,
                shape.largest_gather()
            );
            (shape.num_params(), Some(shape.largest_gather()), what)
        }
        (None, None) => return Err("give --params N or --preset NAME".into()),
    };
    let input = EstimateInput {
        params,
        largest_gather: largest,
        stage: args.stage,
        gpus_per_node: args.gpus_per_node,
        nodes: args.nodes,
        offload_optimizer: target("offload-optimizer", args.offload_optimizer.as_deref())?,
        offload_param,
        dtype,
    };
    let e = estimate(&input);
    let mut out = format!(
        "{what}\nstage {}, {:?}, {} node(s) × {} device(s) (N = {})\n",
        args.stage,
        dtype,
        args.nodes,
        args.gpus_per_node,
        input.world()
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
            ("largest gather", b.gathered),
        ] {
            if v > 0 {
                out.push_str(&format!("  {kind:<16} {:>12}  ({v} bytes)\n", human_bytes(v)));
            }
        }
    };
    section("per device", &e.per_device);
    section("per host", &e.per_host);
    section("per node on NVMe", &e.per_node_nvme);
    out.push_str("formula (Ψ parameters, N devices, G devices per node):\n");
    for line in &e.formula {
        out.push_str(&format!("  {line}\n"));
    }
    Ok(out.trim_end().to_string())
}
