//! How a model tells the engine its blocks: `embed → blocks → head`.
//!
//! Burn has no module hooks, so for ZeRO stage 3 the engine drives the model itself, one part at
//! a time: it gathers a block's parameters, runs it, releases them, and in backward walks the
//! blocks in reverse, re-gathering and recomputing each as its own small autodiff graph. For that
//! it needs to know the chain. A model says it by implementing [`ChainModel`]: how to split into
//! parts and rebuild from them, and the three functions that run the parts.
//!
//! The *ends* are the parameters used before the first block and after the last (token and
//! position embeddings, the final norm, the head). A weight tied between the embedding and the
//! head (GPT-2's `wte`) lives once, in the ends, and the engine sums both uses' gradients.

use crate::error::ZeroError;
use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

/// A model the engine can run part by part (required for ZeRO stage 3; usable at every stage).
///
/// All three functions must be pure functions of their inputs (no state kept between calls):
/// the engine calls `block_forward` twice per block and step (forward, then the recomputation in
/// backward) and `embed` twice (forward, then for its backward).
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

    /// Under tensor parallelism, the indices (in visit order) of the ends' parameters that are
    /// split over the tensor group, each tensor rank holding a different slice; the others are
    /// replicated over it. The global gradient norm counts a split parameter's slices on every
    /// tensor rank and a replicated one once. Default: none is split.
    fn ends_tensor_split(_ends: &Self::Ends) -> Vec<usize> {
        Vec::new()
    }
    /// As [`ChainModel::ends_tensor_split`], for a block.
    fn block_tensor_split(_block: &Self::Block) -> Vec<usize> {
        Vec::new()
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
    /// Bytes held by the activation (f32 elements).
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
        self.shape().num_elements() * 4
    }
    fn to_host(&self) -> Vec<TensorData> {
        vec![self.to_data()]
    }
    fn from_host(mut data: Vec<TensorData>, device: &B::Device) -> Self {
        // One tensor in, one out: `to_host` wrote exactly one.
        Tensor::from_data(
            data.pop().unwrap_or_else(|| unreachable!("to_host gives one tensor")),
            device,
        )
    }
}
