//! The errors of reading and writing HuggingFace checkpoint directories, shared by the zoo's
//! architectures.

use std::path::PathBuf;

use crate::gpt2::Gpt2ConfigError;
use crate::llama::LlamaConfigError;

/// Why a HuggingFace checkpoint directory (GPT-2 or the Llama family) could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is not a usable GPT-2 configuration.
    #[error("{}: {source}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: Gpt2ConfigError,
    },
    /// `config.json` is not a usable Llama-family configuration.
    #[error("{}: {source}", path.display())]
    LlamaConfig {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it (the key, and what is valid).
        #[source]
        source: LlamaConfigError,
    },
    /// A JSON file (the shard index) does not parse.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file is malformed, or could not be written.
    #[error("{}: safetensors: {source}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The format error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A safetensors file ends before what its header describes.
    #[error("{}: truncated: {what} needs the file to be {needed} bytes long, it is {len}", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What lies past the end: "its header", or a tensor by name.
        what: String,
        /// The length it needs.
        needed: u64,
        /// The file's length.
        len: u64,
    },
    /// A tensor's header entry does not describe its bytes (dtype, shape and offsets disagree).
    #[error("{}: tensor `{key}`: {detail}", path.display())]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name as stored.
        key: String,
        /// What disagrees.
        detail: String,
    },
    /// The directory is a ZeRO training checkpoint (sharded optimizer state), not a model.
    #[error(
        "{}: a ZeRO training checkpoint, not a model directory: `{command}` writes its weights as \
         one (then give OUT)",
        dir.display()
    )]
    TrainingCheckpoint {
        /// The directory given.
        dir: PathBuf,
        /// The conversion to run.
        command: String,
    },
    /// The directory has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{}: no model.safetensors nor model.safetensors.index.json", dir.display())]
    NoWeights {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// The index names a shard file outside the checkpoint directory.
    #[error("{}: shard file name `{file}` is not a plain file name", index.display())]
    BadShardName {
        /// The index file.
        index: PathBuf,
        /// The offending shard name.
        file: String,
    },
    /// The checkpoint's tensors do not match the model's parameters (on load), or the config
    /// given to a save does not describe the model (then `path` is the config.json to write).
    #[error(
        "{}: checkpoint does not match its config: missing [{}], unexpected [{}]",
        path.display(), missing.join(", "), unexpected.join(", ")
    )]
    KeyMismatch {
        /// The weights file, the shard index, or the config.json being written.
        path: PathBuf,
        /// Parameters the config needs that no file has (HuggingFace names, without prefix).
        missing: Vec<String>,
        /// Tensors (of the files, or of the model) the config has no place for.
        unexpected: Vec<String>,
    },
    /// A tensor appears in more than one shard.
    #[error("{}: tensor `{key}` appears twice", path.display())]
    DuplicateKey {
        /// The file holding the second copy.
        path: PathBuf,
        /// The tensor's name.
        key: String,
    },
    /// `config.json` gives a size that the weights beside it contradict (a config of another
    /// model, or one edited): said before anything is blamed on the data or the run's flags.
    #[error(
        "{}: {field} is {value}, but the weights say {implied}: {evidence}; this config.json does not belong to \
         these weights (correct {field}, or use the config.json saved with them)",
        path.display()
    )]
    ConfigContradictsWeights {
        /// The config.json.
        path: PathBuf,
        /// The field of config.json.
        field: &'static str,
        /// Its value there.
        value: usize,
        /// The value the weights' shapes imply.
        implied: usize,
        /// Where the weights say so: a tensor and its shape in its file, or the blocks a file holds.
        evidence: String,
    },
    /// A tensor's shape differs from the parameter's.
    #[error("{}: tensor `{key}` has shape {found:?}, the config needs {expected:?}", path.display())]
    ShapeMismatch {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        key: String,
        /// Shape the configuration implies.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor's element type is not a float type the loader converts.
    #[error("{}: tensor `{key}` has dtype {dtype}, expected F32, F16, BF16 or F64", path.display())]
    UnsupportedDtype {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        key: String,
        /// The dtype found.
        dtype: String,
    },
    /// A tensor holds NaN or an infinity: what a run that diverged leaves, or a damaged file.
    /// The model would compute with it silently (Burn's CPU attention treats a NaN score as
    /// masked), so it is refused.
    #[error(
        "{}: tensor `{key}` holds {value}: these weights are not usable (a run that diverged, or a damaged file)",
        path.display()
    )]
    NonFinite {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        key: String,
        /// The first non-finite value found ("NaN", "inf", "-inf").
        value: String,
    },
    /// `lm_head.weight` is stored and differs from the token embedding the config ties it to.
    #[error("{}: lm_head.weight differs from the token embedding, but the config ties them", path.display())]
    UntiedHead {
        /// The file holding `lm_head.weight`.
        path: PathBuf,
    },
    /// A parameter could not be read back from the model for saving.
    #[error("parameter `{key}` could not be read as f32: {reason}")]
    TensorData {
        /// The parameter's HuggingFace name.
        key: String,
        /// Burn's description of the failure.
        reason: String,
    },
}
