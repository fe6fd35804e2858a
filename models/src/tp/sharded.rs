//! Tensor parallelism with ZeRO stage 3: [`TpGpt2`] with its embeddings and each block a
//! `ZeroModule`, so that each tensor rank's slice of them is cut over the data-parallel ranks
//! and gathered for its forward (Megatron combined with ZeRO-3). A [`ChainModel`] too, so that
//! `zero_burn::checkpointed_grads` checkpoints its activations.

use super::block::TpBlock;
use super::collectives::TpBackend;
use super::model::TpGpt2;
use super::pipeline::TpEmbed;
use crate::gpt2::Gpt2Batch;
use burn::module::Module;
use burn::nn::LayerNorm;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::{ChainModel, ZeroError};

/// [`TpGpt2`] whose embeddings (this tensor rank's vocabulary rows of `wte`, which is also the
/// LM head, and `wpe`) and blocks (this tensor rank's slice of each) are `ZeroModule`s, cut by
/// `zero_burn::initialize` at stage 3 over the data-parallel ranks, as the zoo's `ShardedGpt2`
/// is; the final norm stays a plain parameter (stage 3 shards its optimizer state as stage 2
/// does). Train it with `ZeroOptimizer` and
/// `with_tensor_parallel(tensor_group, model.tensor_splits())`.
#[derive(Module, Debug)]
pub struct ShardedTpGpt2<B: Backend> {
    /// Token embedding (this rank's vocabulary rows; also the LM head) and position embedding.
    pub embed: ZeroModule<B, TpEmbed<B>>,
    /// The blocks, each this tensor rank's slice as one unit.
    pub blocks: Vec<ZeroModule<B, TpBlock<B>>>,
    /// The final LayerNorm (replicated).
    pub ln_f: LayerNorm<B>,
    /// The vocabulary, without padding.
    pub vocab: usize,
    /// The tensor ranks the model is split over.
    pub tensor_ranks: usize,
}

impl<B: TpBackend + ShardBackend> TpGpt2<B> {
    /// The embeddings and each block a `ZeroModule` (whole until `zero_burn::initialize` cuts
    /// them at stage 3).
    pub fn into_sharded(self) -> ShardedTpGpt2<B> {
        ShardedTpGpt2 {
            vocab: self.wte.vocab,
            tensor_ranks: self.wte.group.size(),
            embed: ZeroModule::new(TpEmbed {
                wte: self.wte,
                wpe: self.wpe,
            }),
            blocks: self.blocks.into_iter().map(ZeroModule::new).collect(),
            ln_f: self.ln_f,
        }
    }
}

impl<B: TpBackend + ShardBackend> ShardedTpGpt2<B> {
    /// Mean next-token cross-entropy, as [`TpGpt2::loss`], each unit gathered for its forward
    /// (the embeddings again for the head). Fails when a gather fails (a peer lost, a collective
    /// out of order).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        let mut h = self.ends(self.embed.gathered()?).embed(tokens);
        for block in &self.blocks {
            h = block.unshard(&h)?.forward(h);
        }
        self.head_loss(h, labels)
    }

    /// The loss from the last block's output: the final norm and the LM head tied to `wte`
    /// (the embedding unit gathered again).
    fn head_loss(&self, h: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        let embed = self.embed.unshard(&h)?;
        Ok(self.ends(embed).head_loss(h, labels))
    }

    /// How each parameter is split over the tensor group, as [`TpGpt2::tensor_splits`]: the
    /// rule `ZeroOptimizer::with_tensor_parallel` takes.
    pub fn tensor_splits(&self) -> impl Fn(&str) -> Option<zero_burn::TensorSplit> + Send + Sync + 'static {
        super::model::tensor_split_rule(self.vocab, self.tensor_ranks)
    }

    /// The model without blocks from the gathered embeddings: its embedding and head.
    fn ends(&self, embed: TpEmbed<B>) -> TpGpt2<B> {
        TpGpt2 {
            wte: embed.wte,
            wpe: embed.wpe,
            blocks: Vec::new(),
            ln_f: self.ln_f.clone(),
        }
    }
}

/// The chain `zero_burn::checkpointed_grads` runs: the ends are the model without its blocks
/// (the embeddings' unit, also the head's, and the final norm), each block's slice a unit. Every tensor rank runs the same chain, so the tensor collectives inside each
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
        Ok(ends.ends(ends.embed.gathered()?).embed(batch.0.clone()))
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
