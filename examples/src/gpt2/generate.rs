//! `gpt2 generate`: greedy continuation of a prompt.

use super::TrainError;
use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use std::path::PathBuf;
use zero_models::{Gpt2, Gpt2Tokenizer};

/// Arguments of `gpt2 generate`.
#[derive(clap::Args, Clone, Debug)]
pub struct GenerateArgs {
    /// A HuggingFace GPT-2 directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Tokens to add.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
}

/// The prompt followed by the model's most likely continuation (greedy, within n_positions).
pub fn generate(args: &GenerateArgs) -> Result<String, TrainError> {
    let device = Default::default();
    let (model, config) =
        Gpt2::<Flex>::load_pretrained(&args.model, &device).map_err(|e| TrainError::Model(e.to_string()))?;
    let tokenizer = Gpt2Tokenizer::new().map_err(|e| TrainError::Model(e.to_string()))?;
    let mut ids = tokenizer.encode(&args.prompt);
    if ids.is_empty() {
        return Err(TrainError::Data("the prompt is empty".into()));
    }
    // GPT-2's tokenizer can give ids a smaller vocabulary does not have: they would index out
    // of the embedding table.
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= config.vocab_size) {
        return Err(TrainError::Data(format!(
            "the prompt's GPT-2 token {id} is outside the model's vocabulary of {}",
            config.vocab_size
        )));
    }
    for _ in 0..args.max_new_tokens {
        let window = &ids[ids.len().saturating_sub(config.n_positions)..];
        let input: Vec<i64> = window.iter().map(|&t| t as i64).collect();
        let n = input.len();
        let tokens = Tensor::<Flex, 2, Int>::from_data(TensorData::new(input, [1, n]), &device);
        let logits = model.forward(tokens); // [1, n, vocab]
        let vocab = logits.dims()[2];
        let last = logits.slice([0..1, n - 1..n]).reshape([vocab]);
        let next = last.argmax(0).into_scalar() as u32;
        ids.push(next);
    }
    tokenizer.decode(&ids).map_err(|e| TrainError::Model(e.to_string()))
}
