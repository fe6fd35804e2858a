//! Models for zero-burn: GPT-2 and the Llama family (Llama 3.x, Qwen2/Qwen2.5, Qwen3, Mistral)
//! in plain Burn (generic over any `Backend`), numerically equal to HuggingFace transformers'
//! `GPT2LMHeadModel`, `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` and
//! `MistralForCausalLM` and reading and writing their checkpoints, with GPT-2's BPE tokenizer.
//!
//! The models here know nothing of ZeRO: they are ordinary Burn modules. What makes them easy
//! to shard is their shape: each model exposes its forward pass as embedding → blocks → head, so a
//! training engine can gather, run and recompute one block at a time.

pub mod gpt2;
pub mod hf;
pub mod llama;
mod loss;
pub mod tokenizer;
pub mod tp;

pub use gpt2::{Gpt2, Gpt2Block, Gpt2Config};
pub use llama::{Llama, LlamaConfig, LlamaDecoderLayer};
pub use tokenizer::Gpt2Tokenizer;
