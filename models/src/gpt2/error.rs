//! Typed errors of the GPT-2 configuration and of checkpoint loading and saving.

/// A `config.json` that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum Gpt2ConfigError {
    /// The JSON does not parse into a GPT-2 configuration.
    #[error("invalid GPT-2 config JSON: {0}")]
    Json(#[source] serde_json::Error),
    /// A size that must be positive is zero.
    #[error("GPT-2 config field `{field}` must be positive")]
    Zero {
        /// The field's name in `config.json`.
        field: &'static str,
    },
    /// `n_embd` is not a multiple of `n_head`.
    #[error("GPT-2 config: n_embd = {n_embd} is not divisible by n_head = {n_head}")]
    HeadsDoNotDivideHidden {
        /// Hidden size.
        n_embd: usize,
        /// Number of heads.
        n_head: usize,
    },
    /// The activation is not one the model implements.
    #[error(
        "GPT-2 config: activation_function `{0}` is not supported \
         (use gelu_new, gelu_pytorch_tanh, gelu or relu)"
    )]
    UnsupportedActivation(String),
    /// The configuration asks for an LM head separate from the token embedding.
    #[error("GPT-2 config: tie_word_embeddings = false is not supported (the LM head is wte)")]
    UntiedHead,
    /// The sizes describe more parameters than any model this implementation holds.
    #[error(
        "GPT-2 config: vocab_size, n_positions, n_embd, n_inner and n_layer describe {params} parameters, \
         more than {max} (2^50)",
        max = super::presets::MAX_PARAMS
    )]
    TooLarge {
        /// The count the sizes describe (saturated at `u128::MAX`).
        params: u128,
    },
    /// The sizes describe more parameters than the checkpoint's weight files can hold (2 bytes
    /// each, the smallest dtype read).
    #[error(
        "GPT-2 config: the sizes describe {params} parameters, at least {} bytes, but the weight files \
         hold {bytes} bytes: the config does not belong to these weights",
        2 * params
    )]
    MoreThanTheWeights {
        /// The count the sizes describe.
        params: u64,
        /// The weight files' total size.
        bytes: u64,
    },
    /// A value outside what the model can compute with.
    #[error("GPT-2 config: {field} = {value} ({valid})")]
    OutOfRange {
        /// The field's name in `config.json`.
        field: &'static str,
        /// The value found.
        value: String,
        /// What is valid.
        valid: &'static str,
    },
    /// A preset name that is not known.
    #[error(
        "unknown GPT-2 preset `{0}` (known: {known}, or gpt2-<layers>x<hidden> with hidden a multiple of 64)",
        known = super::presets::PRESET_NAMES.join(", ")
    )]
    UnknownPreset(String),
}

pub use crate::hf::CheckpointError;
