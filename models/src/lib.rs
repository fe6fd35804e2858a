//! Models for zero-burn: GPT-2 in plain Burn (generic over any `Backend`), numerically equal
//! to HuggingFace transformers' `GPT2LMHeadModel` and reading and writing its checkpoints, with
//! GPT-2's BPE tokenizer.
//!
//! The models here know nothing of ZeRO: they are ordinary Burn modules. What makes them easy
//! to shard is their shape: GPT-2 exposes its forward pass as embedding → blocks → head, so a
//! training engine can gather, run and recompute one block at a time.

pub mod gpt2;
pub mod tokenizer;
pub mod tp;

pub use gpt2::{Gpt2, Gpt2Block, Gpt2Config};
pub use tokenizer::Gpt2Tokenizer;
