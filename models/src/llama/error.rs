//! Typed errors of the Llama-family configuration.

/// A Llama-family `config.json` (or a configuration built in code) that cannot be used. Each
/// variant names the key of `config.json` and what would be valid; loading a directory wraps it
/// with the file's path ([`crate::hf::CheckpointError::LlamaConfig`]).
#[derive(Debug, thiserror::Error)]
pub enum LlamaConfigError {
    /// The text is not a JSON object.
    #[error("invalid config JSON: {0}")]
    Json(#[source] serde_json::Error),
    /// `model_type` is missing or names another architecture.
    #[error(
        "model_type = {found} is not a Llama-family model (supported: {})",
        super::config::SUPPORTED_MODEL_TYPES.join(", ")
    )]
    UnsupportedModelType {
        /// The value found, as JSON (`null` when the key is missing).
        found: String,
    },
    /// A key holds a value of the wrong JSON type, or one outside what the model computes with.
    #[error("{key} = {value}: {valid}")]
    Invalid {
        /// The key (`rope_scaling.factor` for a key inside an object).
        key: String,
        /// The value found, as JSON.
        value: String,
        /// What is valid.
        valid: String,
    },
    /// The rotary embedding is of a type this implementation does not compute.
    #[error(
        "{key} = {value:?} is not supported (supported rope types: default, llama3); \
         this model's positions would be computed differently from transformers'"
    )]
    UnsupportedRope {
        /// The key that names the type (`rope_scaling.rope_type`, `rope_parameters.type`...).
        key: String,
        /// The type found.
        value: String,
    },
    /// `hidden_act` is not SwiGLU's SiLU.
    #[error("hidden_act = {0:?} is not supported (the Llama family's MLP is SwiGLU: \"silu\")")]
    UnsupportedActivation(String),
    /// The sizes describe more parameters than any model this implementation holds.
    #[error("the sizes describe {params} parameters, more than {max} (2^50)", max = super::presets::MAX_PARAMS)]
    TooLarge {
        /// The count the sizes describe (saturated at `u128::MAX`).
        params: u128,
    },
    /// A preset name that is not known.
    #[error("unknown Llama-family preset `{0}` (known: {known})", known = super::presets::PRESET_NAMES.join(", "))]
    UnknownPreset(String),
    /// A sequence longer than the sliding window of the config's attention: transformers would
    /// mask keys further back than the window, which this implementation does not compute.
    #[error(
        "sequence length {seq} exceeds the attention's sliding_window = {window}: transformers would let each \
         position see only the {window} positions before it, which this implementation does not compute \
         (use sequences of at most {window} tokens)"
    )]
    SequenceBeyondWindow {
        /// The sequence length asked for.
        seq: usize,
        /// The sliding window.
        window: usize,
    },
}
