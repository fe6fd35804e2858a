//! `gpt2 generate`: greedy continuation of a prompt.

use super::TrainError;
use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use std::io::{ErrorKind, Write};
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
    /// Tokens to add (printed as they come; past the model's n_positions each one is predicted
    /// from the last n_positions tokens).
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
}

/// The prompt followed by the model's most likely continuation (greedy, within n_positions),
/// written to `out` as it grows: the prompt, then each new token's text
/// (a token that ends inside a character waits for the next; bytes that never make a
/// character show as U+FFFD). A reader that went away
/// (`gpt2 generate ... | head -c 100`) ends the generation: it has what it wanted. Returns the
/// whole text.
pub fn generate(args: &GenerateArgs, out: &mut dyn Write) -> Result<String, TrainError> {
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
    if ids.len() > config.n_positions {
        eprintln!(
            "gpt2: the prompt is {} tokens and the model sees {} (n_positions): it continues from the last {}",
            ids.len(),
            config.n_positions,
            config.n_positions
        );
    }
    // Any bytes the model's tokens make decode, as transformers' decode does: a byte sequence
    // that is not UTF-8 (a character split, or never completed) reads as U+FFFD.
    let decode = |ids: &[u32]| {
        tokenizer
            .decode_bytes(ids)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .map_err(|e| TrainError::Model(e.to_string()))
    };
    let stdout = |source: std::io::Error| TrainError::Io {
        path: "standard output".into(),
        source,
    };
    let mut shown = String::new();
    // Writes what `text` adds to what is shown; false once the reader has gone.
    let mut show = |text: String, out: &mut dyn Write| -> Result<bool, TrainError> {
        // A token ending inside a multi-byte character decodes to a replacement character
        // until the next completes it.
        if !text.starts_with(shown.as_str()) || text.ends_with('\u{fffd}') {
            return Ok(true);
        }
        let written = out
            .write_all(&text.as_bytes()[shown.len()..])
            .and_then(|()| out.flush());
        shown = text;
        match written {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(false),
            Err(e) => Err(stdout(e)),
        }
    };
    if !show(decode(&ids)?, out)? {
        return decode(&ids);
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
        if !show(decode(&ids)?, out)? {
            break;
        }
    }
    let text = decode(&ids)?;
    // What a last incomplete character held back.
    if let Some(rest) = text.strip_prefix(shown.as_str()) {
        let _ = out.write_all(rest.as_bytes());
    }
    Ok(text)
}
