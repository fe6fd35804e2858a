//! GPT-2 as a chain for the ZeRO engine: the embeddings and final norm are the ends (the LM head
//! is tied to `wte`, so it lives there too), each transformer layer is a block.

use super::{Gpt2, Gpt2Block};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};
use zero_burn::ChainModel;

/// One micro-batch: token ids `[batch, seq]` and labels aligned with them (usually equal; see
/// [`Gpt2::head_loss`]).
pub type Gpt2Batch<B> = (Tensor<B, 2, Int>, Tensor<B, 2, Int>);

impl<B: AutodiffBackend> ChainModel<B> for Gpt2<B> {
    type Batch = Gpt2Batch<B>;
    type Hidden = Tensor<B, 3>;
    /// The model without its blocks: `wte`, `wpe`, `ln_f`.
    type Ends = Gpt2<B>;
    type Block = Gpt2Block<B>;

    fn into_parts(mut self) -> (Gpt2<B>, Vec<Gpt2Block<B>>) {
        let blocks = std::mem::take(&mut self.blocks);
        (self, blocks)
    }

    fn from_parts(mut ends: Gpt2<B>, blocks: Vec<Gpt2Block<B>>) -> Self {
        ends.blocks = blocks;
        ends
    }

    fn embed(ends: &Gpt2<B>, batch: &Self::Batch) -> Tensor<B, 3> {
        ends.embed(batch.0.clone())
    }

    fn block_forward(block: &Gpt2Block<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        block.forward(x)
    }

    fn head_loss(ends: &Gpt2<B>, h: Tensor<B, 3>, batch: &Self::Batch) -> Tensor<B, 1> {
        ends.head_loss(h, batch.1.clone())
    }
}
