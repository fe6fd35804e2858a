//! The Llama family of decoders (Llama 3.x, Qwen2/Qwen2.5, Qwen3, Mistral) in Burn, written
//! once: RMSNorm, rotary embeddings (with Llama 3's rescaling), grouped-query attention with
//! optional q/k/v biases (Qwen2) and per-head q/k norms (Qwen3), a SwiGLU MLP, tied or untied
//! embeddings. Numerically equal to transformers' `LlamaForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM` and `MistralForCausalLM`, and reading and writing their checkpoints.
//!
//! The model knows nothing of parallelism: [`Llama::into_sharded`] makes its embedding and each
//! decoder layer a ZeRO unit, and its linears are plain `burn::nn::Linear` for a tensor-parallel
//! plan to split.

mod attention;
mod block;
mod chain;
mod checkpoint;
mod config;
mod error;
mod init;
mod mlp;
mod model;
mod names;
mod partitioned;
mod presets;
mod rope;
mod sharded;

pub use attention::LlamaAttention;
pub use block::LlamaDecoderLayer;
pub use chain::LlamaBatch;
pub use config::{LlamaConfig, LlamaFamily, SUPPORTED_MODEL_TYPES};
pub use error::LlamaConfigError;
pub use mlp::LlamaMlp;
pub use model::Llama;
pub use presets::PRESET_NAMES;
pub use rope::{Llama3RopeScaling, RotaryEmbedding};
pub use sharded::ShardedLlama;
