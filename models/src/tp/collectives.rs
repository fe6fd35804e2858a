//! Megatron-LM's two conjugate collectives, as autodiff operations over the tensor-parallel
//! group.
//!
//! - `f` ([`copy_to_tp`]): identity forward, all-reduce (sum) of the gradient backward. It marks
//!   where a replicated activation enters a layer whose weights are split: each rank's branch
//!   contributes part of the activation's gradient.
//! - `g` ([`reduce_from_tp`]): all-reduce (sum) forward, identity backward. It marks where the
//!   ranks' partial results are combined into a replicated activation, whose gradient every rank
//!   already has whole.
//!
//! A backend says how to run them through [`TpBackend`]: plain backends run the forward only,
//! `Autodiff<B>` records a backward step that runs the conjugate collective on the gradient.
//! Collectives inside a backward step are safe on burn 0.21 (a nested `backward()` is not), and
//! the steps run in an order given by the graph's shape alone, so every tensor-parallel rank,
//! whose graph has the same shape, issues them in the same order.

use super::group::TpGroup;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{TensorMetadata, TensorPrimitive};
use zero_core::comm::ReduceOp;

/// A backend that can run tensor-parallel layers: it knows Megatron's `f` and `g`.
///
/// Implemented for [`Flex`], for CUDA (with the `cuda` feature) and for `Autodiff` over any
/// implementor. Another backend needs the two forward functions only (identity, and
/// [`all_reduce_primitive`]).
pub trait TpBackend: Backend {
    /// `f`: returns `x`; under autodiff, the gradient is all-reduced over `group`.
    fn tp_copy(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self>;
    /// `g`: the sum of `x` over `group`; under autodiff, the gradient passes unchanged.
    fn tp_reduce(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self>;
}

/// The element-wise sum of a tensor primitive over `group` (values only, no graph).
pub fn all_reduce_primitive<B: Backend>(x: FloatTensor<B>, group: &TpGroup, what: &'static str) -> FloatTensor<B> {
    if group.size() == 1 {
        return x;
    }
    let shape = x.shape();
    let flat = B::float_reshape(x, Shape::new([shape.num_elements()]));
    let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat));
    let reduced = group.all_reduce_tensor(flat, ReduceOp::Sum, what);
    B::float_reshape(reduced.into_primitive().tensor(), shape)
}

/// `TpBackend` for a backend without autodiff: `f` is the identity, `g` the all-reduce.
macro_rules! forward_only_tp_backend {
    ($backend:ty) => {
        impl TpBackend for $backend {
            fn tp_copy(x: FloatTensor<Self>, _group: &TpGroup) -> FloatTensor<Self> {
                x
            }

            fn tp_reduce(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self> {
                all_reduce_primitive::<Self>(x, group, "g forward")
            }
        }
    };
}

forward_only_tp_backend!(Flex);
#[cfg(feature = "cuda")]
forward_only_tp_backend!(burn::backend::Cuda);

/// Backward of `f`: all-reduce the gradient.
#[derive(Debug)]
struct CopyBackward;

impl<B: Backend> Backward<B, 1> for CopyBackward {
    type State = TpGroup;

    fn backward(self, ops: Ops<TpGroup, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let group = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            all_reduce_primitive::<B>(grad, &group, "f backward")
        });
    }
}

/// Backward of `g`: the gradient passes unchanged.
#[derive(Debug)]
struct ReduceBackward;

impl<B: Backend> Backward<B, 1> for ReduceBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

impl<B: TpBackend, C: CheckpointStrategy> TpBackend for Autodiff<B, C> {
    fn tp_copy(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self> {
        let out = B::tp_copy(x.primitive.clone(), group);
        match <CopyBackward as Backward<B, 1>>::prepare::<C>(CopyBackward, [x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(group.clone(), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn tp_reduce(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self> {
        let out = B::tp_reduce(x.primitive.clone(), group);
        <ReduceBackward as Backward<B, 1>>::prepare::<C>(ReduceBackward, [x.node.clone()])
            .compute_bound()
            .stateless(out)
    }
}

/// Megatron's `f`: `x` unchanged; its gradient is summed over the tensor-parallel group.
pub fn copy_to_tp<B: TpBackend, const D: usize>(x: Tensor<B, D>, group: &TpGroup) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    Tensor::from_primitive(TensorPrimitive::Float(B::tp_copy(x.into_primitive().tensor(), group)))
}

/// Megatron's `g`: the sum of `x` over the tensor-parallel group; its gradient passes unchanged.
pub fn reduce_from_tp<B: TpBackend, const D: usize>(x: Tensor<B, D>, group: &TpGroup) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    Tensor::from_primitive(TensorPrimitive::Float(B::tp_reduce(x.into_primitive().tensor(), group)))
}
