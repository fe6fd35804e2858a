//! zero-examples: runnable programs built on zero-burn.
//!
//! - `gpt2`: train GPT-2 from a DeepSpeed config (threads or one process per rank), score a
//!   checkpoint, generate text.
//! - `simple`: the smallest complete use of the engine (a two-layer MLP on synthetic data).
//! - `learner`: Burn's own training loop (`burn_train::Learner`) with `ZeroOptimizer`, ranks as
//!   threads.
//!
//! The library part holds what the binaries share: starting the ranks, and the GPT-2 trainer.

pub mod gpt2;
pub mod learner;
pub mod ranks;
