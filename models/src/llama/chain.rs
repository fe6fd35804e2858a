//! The Llama family as a chain for the ZeRO engine: the ends are the embedding, the final norm
//! and the head; each decoder layer is a block.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};
use zero_burn::ChainModel;

use super::{Llama, LlamaDecoderLayer};

/// One micro-batch: token ids `[batch, seq]` and labels aligned with them (usually equal; see
/// [`Llama::head_loss`]).
pub type LlamaBatch<B> = (Tensor<B, 2, Int>, Tensor<B, 2, Int>);

impl<B: AutodiffBackend> ChainModel<B> for Llama<B> {
    type Batch = LlamaBatch<B>;
    type Hidden = Tensor<B, 3>;
    /// The model without its layers: embedding, final norm, head.
    type Ends = Llama<B>;
    type Block = LlamaDecoderLayer<B>;

    fn into_parts(mut self) -> (Llama<B>, Vec<LlamaDecoderLayer<B>>) {
        let layers = std::mem::take(&mut self.layers);
        (self, layers)
    }

    fn from_parts(mut ends: Llama<B>, layers: Vec<LlamaDecoderLayer<B>>) -> Self {
        ends.layers = layers;
        ends
    }

    fn embed(ends: &Llama<B>, batch: &Self::Batch) -> Tensor<B, 3> {
        ends.embed(batch.0.clone())
    }

    fn block_forward(block: &LlamaDecoderLayer<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        block.forward(x)
    }

    fn head_loss(ends: &Llama<B>, h: Tensor<B, 3>, batch: &Self::Batch) -> Tensor<B, 1> {
        ends.head_loss(h, batch.1.clone())
    }
}
