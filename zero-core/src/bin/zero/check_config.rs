//! `zero check-config`: parse a DeepSpeed config, print it resolved (defaults filled in) or the
//! error, including the settings DeepSpeed would run that `initialize` refuses here. Values
//! that only the run can settle (the model's hidden size, the world size, values supplied by
//! the training script) are printed as "(resolved at initialize from ...)"; `--set` and
//! `--hidden-size` settle them here. `--world-size` counts every rank: the batch sizes are over
//! the data-parallel ones.

use crate::{print_error, print_note, print_output};
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitCode;
use zero_core::config::{DeepSpeedConfig, Overrides};

/// Arguments of `zero check-config`.
#[derive(clap::Args)]
pub struct Args {
    /// The DeepSpeed JSON config file.
    pub file: PathBuf,
    /// Every rank of the run (data × pipeline × tensor parallel), to resolve the batch triad
    /// over its data-parallel ranks.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// The model's hidden size, to resolve "auto" bucket sizes.
    #[arg(long)]
    pub hidden_size: Option<usize>,
    /// A value for a key the file writes "auto", as KEY=JSON (e.g. optimizer.params.lr=3e-4);
    /// repeatable. A key the file writes otherwise, or not at all, is an error.
    #[arg(long = "set", value_name = "KEY=JSON")]
    pub set: Vec<String>,
}

/// Runs the subcommand: the resolved config on stdout, warnings on stderr, exit 2 on error.
pub fn run(args: Args) -> ExitCode {
    match check(&args) {
        Ok(json) => print_output(&json),
        Err(message) => print_error(message),
    }
}

fn check(args: &Args) -> Result<String, String> {
    for (flag, value) in [("--world-size", args.world_size), ("--hidden-size", args.hidden_size)] {
        if value == Some(0) {
            return Err(format!("{flag} 0: expected a positive count"));
        }
    }
    let overrides = Overrides::from_assignments(&args.set)?;
    let parsed = DeepSpeedConfig::from_file(&args.file).map_err(|e| e.to_string())?;
    let file = args.file.display().to_string();
    for warning in &parsed.warnings {
        // A warning about the text names its place in the file (`FILE:LINE: ...`) already.
        match warning.to_string() {
            w if w.starts_with(&file) => print_note(format_args!("warning: {w}")),
            w => print_note(format_args!("warning: {file}: {w}")),
        }
    }
    // A --set that fills nothing is a mistake the user should hear of, not a silent no-op.
    parsed
        .config
        .check_overrides(&overrides)
        .map_err(|e| format!("--set: {e}"))?;
    // The batch sizes are over the data-parallel ranks: the world's, less pipeline and tensor
    // parallelism.
    let data_parallel = args
        .world_size
        .map(|world| parsed.config.data_parallel_size(world))
        .transpose()
        .map_err(|e| format!("{}: --world-size {e}", args.file.display()))?;
    if let (Some(world), Some(data)) = (args.world_size, data_parallel) {
        if data != world {
            print_note(format_args!(
                "note: {} ranks are {data} data-parallel (pipeline.stages × tensor_parallel.autotp_size take the rest)",
                world
            ));
        }
    }
    let partial = parsed
        .config
        .resolve_partial(data_parallel, args.hidden_size, &overrides)
        .map_err(|e| e.to_string())?;
    // What DeepSpeed would run but this engine refuses at initialize, said now, every one.
    let deferred: Vec<&str> = partial.deferred.iter().map(|d| d.key.as_str()).collect();
    let refused = partial.config.unsupported_except(&deferred);
    if !refused.is_empty() {
        let each: Vec<String> = refused.iter().map(|u| format!("\n  {u}")).collect();
        return Err(format!(
            "{}: a valid DeepSpeed config, but initialize refuses {}:{}",
            args.file.display(),
            if refused.len() == 1 {
                "this setting"
            } else {
                "these settings"
            },
            each.concat()
        ));
    }
    if partial.config.optimizer.is_none() {
        print_note(format_args!(
            "note: {}: the config names no optimizer: the program gives it (zero_burn::InitOptions::optimizer, as a \
             training script hands its own to DeepSpeed's initialize)",
            args.file.display()
        ));
    }
    let mut json = serde_json::to_value(&partial.config).map_err(|e| e.to_string())?;
    for deferred in &partial.deferred {
        if deferred.key == "world_size" {
            print_note(format_args!(
                "note: {}; pass --world-size to check it",
                deferred.resolved_by
            ));
            continue;
        }
        let marker = Value::String(format!("(resolved at initialize from {})", deferred.resolved_by));
        match pointer_for(&json, &deferred.key) {
            Some(pointer) => {
                if let Some(slot) = json.pointer_mut(&pointer) {
                    *slot = marker;
                }
            }
            None => print_note(format_args!(
                "note: `{}` is resolved at initialize from {}",
                deferred.key, deferred.resolved_by
            )),
        }
    }
    serde_json::to_string_pretty(&json).map_err(|e| e.to_string())
}

/// Where a dotted config key appears in the printed resolved config.
fn pointer_for(json: &Value, key: &str) -> Option<String> {
    let candidates = match key {
        "fp16.enabled" | "bf16.enabled" | "bfloat16.enabled" => vec!["/precision".to_string()],
        _ => {
            let direct = format!("/{}", key.replace('.', "/"));
            // Unprefixed legacy spellings print under their stage3_ name.
            let prefixed = key
                .rsplit_once('.')
                .map(|(head, last)| format!("/{}/stage3_{last}", head.replace('.', "/")));
            std::iter::once(direct).chain(prefixed).collect()
        }
    };
    candidates.into_iter().find(|p| json.pointer(p).is_some())
}
