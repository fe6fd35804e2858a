//! HuggingFace checkpoint directories, whatever the architecture: the safetensors files of a
//! directory read tensor by tensor and widened to f32, a directory written shard by shard, and
//! the errors of both. Each architecture's module maps its parameters to HuggingFace's names.

mod error;
pub(crate) mod safetensors;
pub(crate) mod writer;

pub use self::safetensors::{CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE};
pub use error::CheckpointError;
