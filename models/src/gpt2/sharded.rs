//! GPT-2 for ZeRO stage 3 in Burn's own loop: the embeddings and every transformer block a
//! [`ZeroModule`], trained with `zero_burn::initialize`'s model and `ZeroOptimizer`.

use super::block::Gpt2Block;
use super::model::Gpt2;
use super::pipeline::{Gpt2Embed, Gpt2Head};
use burn::module::Module;
use burn::nn::LayerNorm;
use burn::prelude::*;
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::ZeroError;

/// GPT-2 whose embeddings (`wte`, `wpe`) and transformer blocks are each a [`ZeroModule`]: at
/// stage 3 every rank holds its shard of each and gathers one unit at a time. The LM head is
/// tied to `wte`: it gathers the embedding unit a second time, and both uses' gradients reach
/// the one shard. The final LayerNorm stays replicated.
#[derive(Module, Debug)]
pub struct ShardedGpt2<B: Backend> {
    /// Token and position embeddings.
    pub embed: ZeroModule<B, Gpt2Embed<B>>,
    /// The transformer blocks.
    pub blocks: Vec<ZeroModule<B, Gpt2Block<B>>>,
    /// The final LayerNorm.
    pub ln_f: LayerNorm<B>,
}

impl<B: ShardBackend> Gpt2<B> {
    /// The model with its embeddings and each block one [`ZeroModule`] (whole until
    /// `zero_burn::initialize` shards them at stage 3).
    pub fn into_sharded(self) -> ShardedGpt2<B> {
        ShardedGpt2 {
            embed: ZeroModule::new(Gpt2Embed {
                wte: self.wte,
                wpe: self.wpe,
            }),
            blocks: self.blocks.into_iter().map(ZeroModule::new).collect(),
            ln_f: self.ln_f,
        }
    }
}

impl<B: ShardBackend> ShardedGpt2<B> {
    /// Mean next-token cross-entropy of `tokens` against `labels`, as [`Gpt2::loss`]. Fails
    /// when a gather fails (a peer lost, a collective out of order).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        let mut h = self.embed.gathered()?.forward(tokens);
        for block in &self.blocks {
            h = block.unshard(&h)?.forward(h);
        }
        let wte = self.embed.unshard(&h)?.wte;
        let head = Gpt2Head {
            wte,
            ln_f: self.ln_f.clone(),
        };
        Ok(head.loss(h, labels))
    }
}
