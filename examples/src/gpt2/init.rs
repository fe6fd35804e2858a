//! `gpt2 init`: a randomly initialised HuggingFace GPT-2 directory of any preset, the starting
//! checkpoint for sizes that have no public weights (`gpt2-10b`, a shaped `gpt2-48x4096`).
//! Written one transformer block at a time, so it needs memory for one block, not the model.

use super::TrainError;
use burn::backend::Flex;
use burn::tensor::backend::Backend;
use std::path::PathBuf;
use zero_models::Gpt2Config;

/// Arguments of `gpt2 init`.
#[derive(clap::Args, Clone, Debug)]
pub struct InitArgs {
    /// tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-10b, or a shape gpt2-<layers>x<hidden>.
    #[arg(long)]
    pub preset: String,
    /// The directory to write (config.json, one safetensors shard per block, the index).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// Writes the directory; returns what was written, for the user.
pub fn init(args: &InitArgs) -> Result<String, TrainError> {
    let config = Gpt2Config::preset(&args.preset).map_err(|e| TrainError::Model(format!("--preset: {e}")))?;
    let refuse = |why: String| TrainError::Model(format!("--out {}: {why}", args.out.display()));
    if args.out.exists() && !args.out.is_dir() {
        return Err(refuse("exists and is not a directory".into()));
    }
    // A model already there is never overwritten, even in part: `init` writes a new directory.
    if std::fs::read_dir(&args.out).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(refuse(
            "already holds files; gpt2 init writes a new directory (give another --out, or remove this one)".into(),
        ));
    }
    // Written beside it, then renamed into place: an interrupted or failed init leaves no
    // directory that looks like a model.
    let name = args
        .out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let staging = args
        .out
        .with_file_name(format!(".{name}.partial{}", std::process::id()));
    let device = Default::default();
    Flex::seed(&device, args.seed);
    let written = config
        .write_random_pretrained::<Flex>(&staging, &device)
        .map_err(|e| TrainError::Model(e.to_string()))
        .and_then(|()| {
            // An empty directory named by --out is replaced.
            let _ = std::fs::remove_dir(&args.out);
            std::fs::rename(&staging, &args.out).map_err(|e| refuse(format!("cannot move the model into place: {e}")))
        });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    written?;
    Ok(format!(
        "wrote {}: GPT-2 {} ({:.2}M parameters) in {} shards",
        args.out.display(),
        args.preset,
        config.num_params() as f64 / 1e6,
        config.n_layer + 1
    ))
}
