//! GPT-2 for ZeRO stage 3 in Burn's own loop: the embeddings and every transformer block a
//! [`ZeroModule`], trained with `zero_burn::initialize`'s model and `ZeroOptimizer`; a
//! [`ChainModel`] too, so that `zero_burn::checkpointed_grads` checkpoints its activations.

use super::block::Gpt2Block;
use super::chain::Gpt2Batch;
use super::model::Gpt2;
use super::pipeline::{Gpt2Embed, Gpt2Head};
use burn::module::Module;
use burn::nn::LayerNorm;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::{ChainModel, ZeroError};

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
        self.head_loss(h, labels)
    }

    /// The loss from the last block's output: the final norm and the LM head tied to `wte`
    /// (the embedding unit gathered again).
    fn head_loss(&self, h: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        let wte = self.embed.unshard(&h)?.wte;
        let head = Gpt2Head {
            wte,
            ln_f: self.ln_f.clone(),
        };
        Ok(head.loss(h, labels))
    }
}

/// The chain `zero_burn::checkpointed_grads` runs: the ends are the model without its blocks
/// (the embedding unit, also the head's, and the final norm), each block a unit. A failed
/// gather is an error of the `try_` functions (what `checkpointed_grads` calls); the plain ones
/// panic with it.
impl<B: AutodiffBackend + ShardBackend> ChainModel<B> for ShardedGpt2<B> {
    type Batch = Gpt2Batch<B>;
    type Hidden = Tensor<B, 3>;
    type Ends = ShardedGpt2<B>;
    type Block = ZeroModule<B, Gpt2Block<B>>;

    fn into_parts(mut self) -> (Self, Vec<Self::Block>) {
        let blocks = std::mem::take(&mut self.blocks);
        (self, blocks)
    }

    fn from_parts(mut ends: Self, blocks: Vec<Self::Block>) -> Self {
        ends.blocks = blocks;
        ends
    }

    fn try_embed(ends: &Self, batch: &Self::Batch) -> Result<Tensor<B, 3>, ZeroError> {
        Ok(ends.embed.gathered()?.forward(batch.0.clone()))
    }

    fn try_block_forward(block: &Self::Block, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, ZeroError> {
        Ok(block.unshard(&x)?.forward(x))
    }

    fn try_head_loss(ends: &Self, h: Tensor<B, 3>, batch: &Self::Batch) -> Result<Tensor<B, 1>, ZeroError> {
        ends.head_loss(h, batch.1.clone())
    }

    fn embed(ends: &Self, batch: &Self::Batch) -> Tensor<B, 3> {
        Self::try_embed(ends, batch).unwrap_or_else(|e| panic!("{e}"))
    }

    fn block_forward(block: &Self::Block, x: Tensor<B, 3>) -> Tensor<B, 3> {
        Self::try_block_forward(block, x).unwrap_or_else(|e| panic!("{e}"))
    }

    fn head_loss(ends: &Self, h: Tensor<B, 3>, batch: &Self::Batch) -> Tensor<B, 1> {
        Self::try_head_loss(ends, h, batch).unwrap_or_else(|e| panic!("{e}"))
    }
}
