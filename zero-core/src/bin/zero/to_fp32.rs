//! `zero to-fp32`: a checkpoint's fp32 master weights, whole, as safetensors files that any tool
//! reads, with no engine and no GPU. Streams one tensor at a time; verifies every byte it reads
//! against the checkpoint's checksums.

use std::path::PathBuf;
use std::process::ExitCode;
use zero_core::checkpoint::{parse_size, to_fp32, Checkpoint, NameMap};

/// Arguments of `zero to-fp32`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory (the one holding `latest` and the tag directories).
    pub checkpoint_dir: PathBuf,
    /// Output directory: receives `model.safetensors`, or numbered shards and
    /// `model.safetensors.index.json` when the weights exceed --max-shard-size.
    pub out: PathBuf,
    /// The tag to convert (default: the one `latest` names).
    #[arg(long)]
    pub tag: Option<String>,
    /// Largest output file, e.g. 5GB, 500MB, 2GiB (default: one file).
    #[arg(long, value_name = "SIZE")]
    pub max_shard_size: Option<String>,
    /// Rename parameters, in order: PREFIX=NEW (replace a prefix; `=NEW` adds one, `PREFIX=`
    /// strips one), *SUFFIX=NEW (replace a suffix), !PREFIX (leave out); repeatable.
    #[arg(long = "rename", value_name = "RULE")]
    pub rename: Vec<String>,
    /// Apply a model's standard renaming before --rename rules: `gpt2-hf` gives HuggingFace
    /// GPT2LMHeadModel keys (`transformer.h.3.attn.c_attn.weight`).
    #[arg(long, value_name = "NAME")]
    pub names: Option<String>,
    /// Also read every shard file whole and check every checksum first (a conversion already
    /// verifies every byte it reads).
    #[arg(long)]
    pub verify: bool,
}

/// Runs the subcommand: a summary on stdout, or the error on stderr with exit status 2.
pub fn run(args: Args) -> ExitCode {
    match convert(&args) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

fn convert(args: &Args) -> Result<String, String> {
    let mut map = match args.names.as_deref() {
        None => NameMap::default(),
        Some("gpt2-hf") => NameMap::gpt2_huggingface(),
        Some(other) => return Err(format!("--names {other}: unknown naming (known: gpt2-hf)")),
    };
    for rule in &args.rename {
        map.rules
            .push(NameMap::parse_rule(rule).map_err(|e| format!("--rename {e}"))?);
    }
    let max = args
        .max_shard_size
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| format!("--max-shard-size {e}"))?;
    let checkpoint = Checkpoint::open(&args.checkpoint_dir, args.tag.as_deref()).map_err(|e| e.to_string())?;
    if args.verify {
        checkpoint.verify().map_err(|e| e.to_string())?;
    }
    let report = to_fp32(&checkpoint, &args.out, max, &|n| map.apply(n)).map_err(|e| e.to_string())?;
    let meta = &checkpoint.meta;
    let mut summary = format!(
        "checkpoint {} (step {}, saved by {} ranks at stage {}): {} tensors, {} bytes of fp32 weights",
        meta.tag, meta.global_step, meta.world_size, meta.stage, report.tensors, report.value_bytes
    );
    for f in &report.files {
        summary.push_str(&format!("\n  {}", f.display()));
    }
    if let Some(index) = &report.index {
        summary.push_str(&format!("\n  {}", index.display()));
    }
    Ok(summary)
}
