//! `zero to-fp32`: a checkpoint's fp32 master weights, whole, as safetensors files that any tool
//! reads, with no engine and no GPU. Streams one tensor at a time; verifies every byte it reads
//! against the checkpoint's checksums. A checkpoint that records its model (the zoo's GPT-2 and
//! Llama family do) becomes that model's own directory format: its names and layouts (the
//! Llama family's linear weights transposed to PyTorch's `[out, in]`), and its `config.json`
//! beside.

use std::path::PathBuf;
use std::process::ExitCode;
use zero_core::checkpoint::{
    export_fp32, parse_size, Checkpoint, ExportNaming, Fp32Source, NameMap, NameRule, TensorParallelCheckpoint,
};

/// Arguments of `zero to-fp32`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory (the one holding `latest` and the tag directories, or, for a
    /// tensor-parallel model, the `tensor_rank_{t}` directories, whose slices are merged).
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
    /// The naming to apply before --rename rules: `gpt2-hf` gives HuggingFace GPT2LMHeadModel
    /// keys (`transformer.h.3.attn.c_attn.weight`), `llama-hf` the Llama family's
    /// (`model.layers.3.self_attn.q_proj.weight`, linear weights transposed to `[out, in]`),
    /// `internal` the engine's own names. Default: the naming the checkpoint records, with the
    /// model's config.json written beside the weights (the zoo's GPT-2 records `gpt2-hf`, its
    /// Llama family `llama-hf`: OUT is then a HuggingFace directory); `internal` for a
    /// checkpoint that records none.
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
    // Refused before the checkpoint is opened: a naming no checkpoint could make known.
    if let Some(naming) = args.names.as_deref() {
        NameMap::named(naming).map_err(|e| format!("--names {e}"))?;
    }
    let renames = args
        .rename
        .iter()
        .map(|rule| NameMap::parse_rule(rule).map_err(|e| format!("--rename {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let max = args
        .max_shard_size
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| format!("--max-shard-size {e}"))?;
    // The export never goes into one of the checkpoint's tag directories, which would then
    // read as a model and as a checkpoint at once. (Beside the tags is where HuggingFace's
    // Trainer keeps a checkpoint's weights, and works.)
    if in_a_tag(&args.out, &args.checkpoint_dir) {
        return Err(format!(
            "{} is inside a tag directory of the checkpoint {}: give an output directory of its own (a new one \
             beside the tags does)",
            args.out.display(),
            args.checkpoint_dir.display()
        ));
    }
    // A tensor-parallel checkpoint (one per tensor rank under tensor_rank_{t}) is converted
    // whole: each split parameter merged from the ranks' slices.
    let split = TensorParallelCheckpoint::open(&args.checkpoint_dir, args.tag.as_deref()).map_err(|e| e.to_string())?;
    let (checkpoint, tensor_ranks) = match &split {
        Some(tp) => (tp.ranks[0].clone(), tp.ranks.len()),
        None => (
            Checkpoint::open(&args.checkpoint_dir, args.tag.as_deref()).map_err(|e| e.to_string())?,
            1,
        ),
    };
    if args.verify {
        match &split {
            Some(tp) => tp.ranks.iter().try_for_each(Checkpoint::verify),
            None => checkpoint.verify(),
        }
        .map_err(|e| e.to_string())?;
    }
    let naming = ExportNaming::resolve(&checkpoint.meta, args.names.as_deref()).map_err(|e| e.to_string())?;
    let mut map = naming.names;
    let first_own = map.rules.len();
    map.rules.extend(renames);
    // A --rename rule that renames no name changes nothing: a misspelt prefix would go out as
    // the names it meant to replace. Refused, naming a few of the names it could have met. (A
    // drop rule that meets nothing leaves out nothing, which is what it asks.)
    if let Some(&unused) = map
        .unused_rules(checkpoint.meta.params.iter().map(|p| p.name.as_str()))
        .iter()
        .find(|&&i| i >= first_own && !matches!(map.rules[i], NameRule::Drop(_)))
    {
        let before = NameMap {
            rules: map.rules[..unused].to_vec(),
            ..NameMap::default()
        };
        let seen: Vec<String> = checkpoint
            .meta
            .params
            .iter()
            .filter_map(|p| before.apply(&p.name))
            .take(3)
            .collect();
        return Err(format!(
            "--rename {}: no tensor name matches it (the names it sees begin {}, ...)",
            args.rename[unused - first_own],
            seen.join(", ")
        ));
    }
    // The weights and the config.json beside them are staged and moved into place together:
    // a conversion that fails leaves nothing it created.
    let source = match &split {
        Some(tp) => Fp32Source::TensorParallel(tp),
        None => Fp32Source::Checkpoint(&checkpoint),
    };
    let report =
        export_fp32(source, &args.out, max, &|n| map.export(n), naming.config.as_ref()).map_err(|e| e.to_string())?;
    let meta = &checkpoint.meta;
    let ranks = match tensor_ranks {
        1 => format!(
            "{} rank{}",
            meta.world_size,
            if meta.world_size == 1 { "" } else { "s" }
        ),
        t => format!("{t} tensor × {} data ranks", meta.world_size),
    };
    let mut summary = format!(
        "checkpoint {} (step {}, saved by {ranks} at stage {}): {} tensors, {} bytes of fp32 weights",
        meta.tag, meta.global_step, meta.stage, report.tensors, report.value_bytes
    );
    for f in &report.files {
        summary.push_str(&format!("\n  {}", f.display()));
    }
    for extra in report.index.iter().chain(&report.config) {
        summary.push_str(&format!("\n  {}", extra.display()));
    }
    Ok(summary)
}

/// Whether `path` (which may not exist yet) is, or lies under, a tag directory of the
/// checkpoint in `dir` (one holding checkpoint metadata, or a tensor rank's `tensor_rank_{t}`),
/// by what they are on disk: the nearest part of `path` that exists is resolved, links and `..`
/// included.
fn in_a_tag(path: &std::path::Path, dir: &std::path::Path) -> bool {
    let Ok(dir) = std::fs::canonicalize(dir) else {
        return false;
    };
    let mut existing = path;
    let mut rest = Vec::new();
    let resolved = loop {
        if let Ok(resolved) = std::fs::canonicalize(existing) {
            break rest.iter().rev().fold(resolved, |p: PathBuf, part| p.join(part));
        }
        let (Some(parent), Some(name)) = (existing.parent(), existing.file_name()) else {
            return false;
        };
        rest.push(name.to_os_string());
        existing = if parent.as_os_str().is_empty() {
            std::path::Path::new(".")
        } else {
            parent
        };
    };
    let Some(first) = resolved
        .strip_prefix(&dir)
        .ok()
        .and_then(|below| below.components().next())
    else {
        return false;
    };
    let tensor_rank = first
        .as_os_str()
        .to_str()
        .and_then(zero_core::checkpoint::tensor_rank_of);
    tensor_rank.is_some() || dir.join(first).join(zero_core::checkpoint::format::META_FILE).is_file()
}
