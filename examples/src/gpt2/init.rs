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
    if args.out.exists() && !args.out.is_dir() {
        return Err(TrainError::Model(format!(
            "--out {}: exists and is not a directory",
            args.out.display()
        )));
    }
    let device = Default::default();
    Flex::seed(&device, args.seed);
    config
        .write_random_pretrained::<Flex>(&args.out, &device)
        .map_err(|e| TrainError::Model(e.to_string()))?;
    Ok(format!(
        "wrote {}: GPT-2 {} ({:.2}M parameters) in {} shards",
        args.out.display(),
        args.preset,
        config.num_params() as f64 / 1e6,
        config.n_layer + 1
    ))
}
