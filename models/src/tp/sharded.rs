//! Tensor parallelism with ZeRO stage 3: [`TpGpt2`] with each block a `ZeroModule`, so that
//! each tensor rank's slice of a block is cut over the data-parallel ranks and gathered for its
//! forward (Megatron combined with ZeRO-3).

use super::block::TpBlock;
use super::collectives::TpBackend;
use super::embedding::VocabParallelEmbedding;
use super::model::TpGpt2;
use burn::module::Module;
use burn::nn::{Embedding, LayerNorm};
use burn::prelude::*;
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::ZeroError;

/// [`TpGpt2`] whose blocks are `ZeroModule`s (cut by `zero_burn::initialize` at stage 3 over the
/// data-parallel ranks); the embeddings and the final norm stay plain parameters (stage 3
/// shards their optimizer state as stage 2 does). Train it with `ZeroOptimizer` and
/// `with_tensor_parallel(tensor_group, TpGpt2::is_tensor_split)`.
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
        // The ends, as the unsharded model's (its embedding and head), without blocks.
        let ends = TpGpt2 {
            wte: self.wte.clone(),
            wpe: self.wpe.clone(),
            blocks: Vec::new(),
            ln_f: self.ln_f.clone(),
        };
        let mut h = ends.embed(tokens);
        for block in &self.blocks {
            h = block.unshard(&h)?.forward(h);
        }
        Ok(ends.head_loss(h, labels))
    }
}
