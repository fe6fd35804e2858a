//! How a model tells activation checkpointing its blocks: `embed → blocks → head`.
//!
//! [`crate::checkpointed_grads`] runs a model part by part: the blocks in segments, keeping only
//! each segment's input from forward and running the segment again in backward as its own small
//! autodiff graph. For that it needs to know the chain. A model says it by implementing
//! [`ChainModel`]: how to split into parts and rebuild from them, and the three functions that
//! run the parts.
//!
//! The *ends* are the parameters used before the first block and after the last (token and
//! position embeddings, the final norm, the head). A weight tied between the embedding and the
//! head (GPT-2's `wte`) lives once, in the ends, and both uses' gradients are summed.

use crate::error::ZeroError;
use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

/// A model that activation checkpointing ([`crate::checkpointed_grads`]) can run part by part.
///
/// All three functions must be pure functions of their inputs (no state kept between calls):
/// `block_forward` runs twice per block and micro-batch (forward, then the recomputation in
/// backward), and so may `embed`.
///
/// ```ignore
/// impl<B: AutodiffBackend> ChainModel<B> for Mlp<B> {
///     type Batch = (Tensor<B, 2>, Tensor<B, 1, Int>);
///     type Hidden = Tensor<B, 2>;
///     type Ends = Ends<B>;              // input projection + classifier
///     type Block = ResidualBlock<B>;
///     fn into_parts(self) -> (Ends<B>, Vec<ResidualBlock<B>>) { (self.ends, self.blocks) }
///     fn from_parts(ends: Ends<B>, blocks: Vec<ResidualBlock<B>>) -> Self { Self { ends, blocks } }
///     fn embed(ends: &Ends<B>, batch: &Self::Batch) -> Tensor<B, 2> { ends.input.forward(batch.0.clone()) }
///     fn block_forward(block: &ResidualBlock<B>, x: Tensor<B, 2>) -> Tensor<B, 2> { block.forward(x) }
///     fn head_loss(ends: &Ends<B>, h: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> { ... }
/// }
/// ```
pub trait ChainModel<B: AutodiffBackend>: Module<B> + Sized {
    /// One micro-batch (inputs and targets).
    type Batch;
    /// The activation passed from part to part.
    type Hidden: Hidden<B>;
    /// Parameters used before the first block and after the last.
    type Ends: Module<B>;
    /// One block of the chain. All blocks have the same type (their sizes may differ).
    type Block: Module<B>;

    /// Splits the model into its ends and its blocks, in order.
    fn into_parts(self) -> (Self::Ends, Vec<Self::Block>);
    /// Rebuilds the model from its parts.
    fn from_parts(ends: Self::Ends, blocks: Vec<Self::Block>) -> Self;
    /// The input of the first block.
    fn embed(ends: &Self::Ends, batch: &Self::Batch) -> Self::Hidden;
    /// One block.
    fn block_forward(block: &Self::Block, x: Self::Hidden) -> Self::Hidden;
    /// The loss (a one-element tensor) from the last block's output.
    fn head_loss(ends: &Self::Ends, h: Self::Hidden, batch: &Self::Batch) -> Tensor<B, 1>;

    /// [`ChainModel::embed`] for parts that can fail (a `ZeroModule`'s gather: a peer lost, a
    /// collective out of order), as [`crate::checkpointed_grads`] calls it. Default: `embed`.
    fn try_embed(ends: &Self::Ends, batch: &Self::Batch) -> Result<Self::Hidden, ZeroError> {
        Ok(Self::embed(ends, batch))
    }
    /// [`ChainModel::block_forward`] for parts that can fail. Default: `block_forward`.
    fn try_block_forward(block: &Self::Block, x: Self::Hidden) -> Result<Self::Hidden, ZeroError> {
        Ok(Self::block_forward(block, x))
    }
    /// [`ChainModel::head_loss`] for parts that can fail. Default: `head_loss`.
    fn try_head_loss(ends: &Self::Ends, h: Self::Hidden, batch: &Self::Batch) -> Result<Tensor<B, 1>, ZeroError> {
        Ok(Self::head_loss(ends, h, batch))
    }
}

/// An activation between parts of a chain: what the engine needs to cut the autodiff graph at
/// a part boundary and to carry the gradient across it. Implemented for every float tensor.
pub trait Hidden<B: AutodiffBackend>: Clone + Send {
    /// The same values, cut from any graph, as a leaf that records gradients.
    fn leaf(&self) -> Self;
    /// The same values, cut from any graph, recording nothing.
    fn detached(&self) -> Self;
    /// Removes and returns the gradient of this leaf from `grads`.
    fn take_grad(&self, grads: &mut B::Gradients) -> Option<Self>;
    /// `sum(self ⊙ seed)`: its backward pushes `seed` into the graph as the gradient of `self`.
    fn dot(self, seed: Self) -> Tensor<B, 1>;
    /// Bytes held by the activation.
    fn bytes(&self) -> usize;
    /// The values as host data, one [`TensorData`] per tensor (activation checkpoints kept in
    /// host memory, or partitioned across ranks).
    fn to_host(&self) -> Vec<TensorData>;
    /// The activation rebuilt on `device` from [`Hidden::to_host`]'s data, recording nothing.
    fn from_host(data: Vec<TensorData>, device: &B::Device) -> Self;
}

impl<B: AutodiffBackend, const D: usize> Hidden<B> for Tensor<B, D> {
    fn leaf(&self) -> Self {
        self.clone().detach().require_grad()
    }
    fn detached(&self) -> Self {
        self.clone().detach()
    }
    fn take_grad(&self, grads: &mut B::Gradients) -> Option<Self> {
        self.grad_remove(grads).map(Tensor::from_inner)
    }
    fn dot(self, seed: Self) -> Tensor<B, 1> {
        (self * seed).sum()
    }
    fn bytes(&self) -> usize {
        self.shape().num_elements() * self.dtype().size()
    }
    fn to_host(&self) -> Vec<TensorData> {
        vec![self.to_data()]
    }
    fn from_host(mut data: Vec<TensorData>, device: &B::Device) -> Self {
        // One tensor in, one out: `to_host` wrote exactly one. In its own dtype (a bf16
        // activation stays bf16), not the device's default float.
        let data = data.pop().unwrap_or_else(|| unreachable!("to_host gives one tensor"));
        let dtype = data.dtype;
        Tensor::from_data(data, (device, dtype))
    }
}
