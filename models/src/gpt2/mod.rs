//! GPT-2 (Radford et al., 2019) in Burn, numerically equal to HuggingFace transformers'
//! `GPT2LMHeadModel`, and reading and writing its checkpoints.

mod attention;
mod block;
mod chain;
mod checkpoint;
mod config;
mod error;
mod hf_writer;
mod init;
mod mlp;
mod model;
mod names;
mod partitioned;
mod pipeline;
pub(crate) use pipeline::LayerKind;
mod presets;
mod sharded;

pub use attention::Gpt2Attention;
pub use block::Gpt2Block;
pub use chain::Gpt2Batch;
pub use config::{Activation, Gpt2Config};
pub use error::{CheckpointError, Gpt2ConfigError};
pub use mlp::Gpt2Mlp;
pub use model::{Gpt2, IGNORE_INDEX};
pub use names::HF_PREFIX;
pub use partitioned::PartitionedLoadError;
pub use pipeline::{Gpt2Embed, Gpt2Head, Gpt2Layer, Gpt2LayerSpec, TIED_WTE};
pub use presets::{GPT2_VOCAB_SIZE, PRESET_NAMES};
pub use sharded::ShardedGpt2;
