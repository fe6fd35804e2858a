//! Tensor parallelism with ZeRO stage 3: [`TpGpt2`] with each block a `ZeroModule`, so that
//! each tensor rank's slice of a block is cut over the data-parallel ranks and gathered for its
//! forward (Megatron combined with ZeRO-3). A [`ChainModel`] too, so that
//! `zero_burn::checkpointed_grads` checkpoints its activations.

use super::block::TpBlock;
use super::collectives::TpBackend;
use super::embedding::VocabParallelEmbedding;
use super::model::TpGpt2;
use crate::gpt2::Gpt2Batch;
use burn::module::Module;
use burn::nn::{Embedding, LayerNorm};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::{ChainModel, ZeroError};

/// [`TpGpt2`] whose blocks are `ZeroModule`s (cut by `zero_burn::initialize` at stage 3 over the
/// data-parallel ranks); the embeddings and the final norm stay plain parameters (stage 3
/// shards their optimizer state as stage 2 does). Train it with `ZeroOptimizer` and
/// `with_tensor_parallel(tensor_group, model.tensor_splits())`.
#[derive(Module, Debug)]
pub struct ShardedTpGpt2<B: Backend> {
    /// Token embedding, this rank's vocabulary rows; also the LM head.
    pub wte: VocabParallelEmbedding<B>,
    /// Position embedding (replicated).
    pub wpe: Embedding<B>,
    /// The blocks, each this tensor rank's slice as one unit.
    pub blocks: Vec<ZeroModule<B, TpBlock<B>>>,
    /// The final LayerNorm (replicated).
    pub ln_f: LayerNorm<B>,
}

impl<B: TpBackend + ShardBackend> TpGpt2<B> {
    /// Each block a `ZeroModule` (whole until `zero_burn::initialize` cuts it at stage 3).
    pub fn into_sharded(self) -> ShardedTpGpt2<B> {
        ShardedTpGpt2 {
            wte: self.wte,
            wpe: self.wpe,
            blocks: self.blocks.into_iter().map(ZeroModule::new).collect(),
            ln_f: self.ln_f,
        }
    }
}

impl<B: TpBackend + ShardBackend> ShardedTpGpt2<B> {
    /// Mean next-token cross-entropy, as [`TpGpt2::loss`], each block gathered for its
    /// forward. Fails when a gather fails (a peer lost, a collective out of order).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        let mut h = self.ends().embed(tokens);
        for block in &self.blocks {
            h = block.unshard(&h)?.forward(h);
        }
        Ok(self.ends().head_loss(h, labels))
    }

    /// How each parameter is split over the tensor group, as [`TpGpt2::tensor_splits`]: the
    /// rule `ZeroOptimizer::with_tensor_parallel` takes.
    pub fn tensor_splits(&self) -> impl Fn(&str) -> Option<zero_burn::TensorSplit> + Send + Sync + 'static {
        super::model::tensor_split_rule(self.wte.vocab, self.wte.group.size())
    }

    /// The ends, as the unsharded model's (its embedding and head), without blocks.
    fn ends(&self) -> TpGpt2<B> {
        TpGpt2 {
            wte: self.wte.clone(),
            wpe: self.wpe.clone(),
            blocks: Vec::new(),
            ln_f: self.ln_f.clone(),
        }
    }
}

/// The chain `zero_burn::checkpointed_grads` runs: the ends are the model without its blocks
/// (the vocabulary-parallel embedding, also the head, and the replicated norms), each block's
/// slice a unit. Every tensor rank runs the same chain, so the tensor collectives inside each
/// block's forward and its recomputation meet in the same order on every rank.
impl<B: AutodiffBackend + TpBackend + ShardBackend> ChainModel<B> for ShardedTpGpt2<B> {
    type Batch = Gpt2Batch<B>;
    type Hidden = Tensor<B, 3>;
    type Ends = ShardedTpGpt2<B>;
    type Block = ZeroModule<B, TpBlock<B>>;

    fn into_parts(mut self) -> (Self, Vec<Self::Block>) {
        let blocks = std::mem::take(&mut self.blocks);
        (self, blocks)
    }

    fn from_parts(mut ends: Self, blocks: Vec<Self::Block>) -> Self {
        ends.blocks = blocks;
        ends
    }

    fn try_embed(ends: &Self, batch: &Self::Batch) -> Result<Tensor<B, 3>, ZeroError> {
        Ok(ends.ends().embed(batch.0.clone()))
    }

    fn try_block_forward(block: &Self::Block, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, ZeroError> {
        Ok(block.unshard(&x)?.forward(x))
    }

    fn try_head_loss(ends: &Self, h: Tensor<B, 3>, batch: &Self::Batch) -> Result<Tensor<B, 1>, ZeroError> {
        Ok(ends.ends().head_loss(h, batch.1.clone()))
    }

    fn embed(ends: &Self, batch: &Self::Batch) -> Tensor<B, 3> {
        ends.ends().embed(batch.0.clone())
    }

    fn block_forward(block: &Self::Block, x: Tensor<B, 3>) -> Tensor<B, 3> {
        Self::try_block_forward(block, x).unwrap_or_else(|e| panic!("{e}"))
    }

    fn head_loss(ends: &Self, h: Tensor<B, 3>, batch: &Self::Batch) -> Tensor<B, 1> {
        ends.ends().head_loss(h, batch.1.clone())
    }
}
