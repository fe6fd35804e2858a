//! The Llama family for ZeRO in Burn's own loop: the token embedding, every decoder layer and an
//! untied LM head each a [`ZeroModule`], trained with `zero_burn::initialize`'s model and
//! `ZeroOptimizer`; a [`ChainModel`] too, so that `zero_burn::checkpointed_grads` checkpoints
//! its activations.

use burn::module::Module;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::{ChainModel, ZeroError};

use super::block::LlamaDecoderLayer;
use super::chain::LlamaBatch;
use super::model::{head_loss, HeadWeight, Llama};

/// A Llama-family model whose token embedding, decoder layers and (untied) LM head are each a
/// [`ZeroModule`]: at stage 3 every rank holds its shard of each and gathers one unit at a time.
/// A tied head gathers the embedding unit a second time, and both uses' gradients reach the one
/// shard. The final RMSNorm stays replicated.
#[derive(Module, Debug)]
pub struct ShardedLlama<B: Backend> {
    /// The token embedding.
    pub embed_tokens: ZeroModule<B, Embedding<B>>,
    /// The decoder layers.
    pub layers: Vec<ZeroModule<B, LlamaDecoderLayer<B>>>,
    /// The final RMSNorm.
    pub norm: RmsNorm<B>,
    /// The LM head; `None` when tied to the embedding.
    pub lm_head: Option<ZeroModule<B, Linear<B>>>,
}

impl<B: ShardBackend> Llama<B> {
    /// The model with its embedding, each layer and an untied head one [`ZeroModule`] (whole
    /// until `zero_burn::initialize` shards them at stage 3).
    pub fn into_sharded(self) -> ShardedLlama<B> {
        ShardedLlama {
            embed_tokens: ZeroModule::new(self.embed_tokens),
            layers: self.layers.into_iter().map(ZeroModule::new).collect(),
            norm: self.norm,
            lm_head: self.lm_head.map(ZeroModule::new),
        }
    }
}

impl<B: ShardBackend> ShardedLlama<B> {
    /// Mean next-token cross-entropy of `tokens` against `labels`, as [`Llama::loss`]. Fails
    /// when a gather fails (a peer lost, a collective out of order).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        let mut h = self.embed_tokens.gathered()?.forward(tokens);
        for layer in &self.layers {
            h = layer.unshard(&h)?.forward(h);
        }
        self.head_loss(h, labels)
    }

    /// The loss from the last layer's output: the final norm and the head (its own unit, or
    /// the embedding unit gathered again).
    fn head_loss(&self, h: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        match &self.lm_head {
            Some(head) => {
                let head = head.unshard(&h)?;
                Ok(head_loss(&self.norm, HeadWeight::Linear(&head), h, labels))
            }
            None => {
                let embed = self.embed_tokens.unshard(&h)?;
                Ok(head_loss(&self.norm, HeadWeight::Tied(&embed), h, labels))
            }
        }
    }
}

/// The chain `zero_burn::checkpointed_grads` runs: the ends are the model without its layers
/// (the embedding unit, the final norm, the head), each layer a unit. A failed gather is an
/// error of the `try_` functions (what `checkpointed_grads` calls); the plain ones panic with it.
impl<B: AutodiffBackend + ShardBackend> ChainModel<B> for ShardedLlama<B> {
    type Batch = LlamaBatch<B>;
    type Hidden = Tensor<B, 3>;
    type Ends = ShardedLlama<B>;
    type Block = ZeroModule<B, LlamaDecoderLayer<B>>;

    fn into_parts(mut self) -> (Self, Vec<Self::Block>) {
        let layers = std::mem::take(&mut self.layers);
        (self, layers)
    }

    fn from_parts(mut ends: Self, layers: Vec<Self::Block>) -> Self {
        ends.layers = layers;
        ends
    }

    fn try_embed(ends: &Self, batch: &Self::Batch) -> Result<Tensor<B, 3>, ZeroError> {
        Ok(ends.embed_tokens.gathered()?.forward(batch.0.clone()))
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
