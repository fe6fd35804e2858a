//! The per-unit hook of ZeRO stage 3 inside Burn's own autodiff graph: `gather(shard)` is a
//! differentiable op whose forward all-gathers the rank's flat shard into the unit's whole flat
//! parameters, and whose backward reduce-scatters the whole gradient into the shard's gradient
//! (the mean over the ranks: data-parallel averaging). No nested `backward()` runs, so nothing
//! waits on burn-autodiff 0.21's graph locks.
//!
//! The op is memory-bound with a retro-forward that gathers again: under
//! `Autodiff<B, BalancedCheckpointing>` the ops that consume the gathered weights keep a recipe
//! instead of the weights, so the whole parameters are freed after forward and gathered again
//! when backward needs them (stage 3). Under `Autodiff<B>` (no checkpointing) the weights stay
//! alive until backward: the same gradients, stage 2's memory.
//!
//! `after`, a tensor the unit's computation starts from (its input), is a parent of the op
//! without a gradient: it raises the op's depth in the tape, which burn 0.21 runs deepest first,
//! so the reduce-scatter runs right after the unit's own backward instead of at the very end
//! with every unit's whole gradient alive.

use crate::device::DeviceCollective;
use crate::error::ZeroError;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use std::sync::Arc;
use zero_core::comm::ReduceOp;

/// The ranks a unit is sharded over.
pub type UnitComm<I> = Arc<dyn DeviceCollective<I>>;

fn tensor<I: Backend>(primitive: FloatTensor<I>) -> Tensor<I, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// What the backward step keeps: the group only (no tensor).
#[derive(Clone, Debug)]
struct GatherState<I: Backend> {
    comm: UnitComm<I>,
}

/// The backward step, with 1 parent (the shard) or 2 (the shard and `after`).
#[derive(Debug)]
struct GatherBackward;

impl<I: Backend, const N: usize> Backward<I, N> for GatherBackward {
    type State = GatherState<I>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let whole = tensor::<I>(grads.consume::<I>(&ops.node));
        // A backward step cannot return an error: a failed collective (a dead peer, a timeout,
        // both named by the group) ends the rank's backward with that error as the panic.
        let shard = match ops.state.comm.reduce_scatter(whole, ReduceOp::Avg) {
            Ok(shard) => shard,
            Err(e) => panic!("ZeRO stage 3: reduce-scatter of a unit's gradient failed: {e}"),
        };
        // parents[1], `after`, gets no gradient from this op.
        if let Some(node) = &ops.parents[0] {
            grads.register::<I>(node.id, shard.into_primitive().tensor());
        }
    }
}

/// The recipe kept instead of the gathered parameters (checkpointing strategies that recompute
/// memory-bound ops): gather again.
#[derive(Debug)]
struct RetroGather<I: Backend> {
    shard: NodeId,
    after: Option<NodeId>,
    comm: UnitComm<I>,
}

impl<I: Backend> RetroForward for RetroGather<I> {
    fn forward(&self, states: &mut BackwardStates, out: NodeId) {
        let shard: FloatTensor<I> = states.get_state(&self.shard);
        // `after` is a parent: the checkpointer counted a use of it for this op. Take it, or its
        // state stays alive to the end of backward.
        if let Some(after) = self.after {
            let _ = states.get_state::<FloatTensor<I>>(&after);
        }
        let whole = match self.comm.all_gather(tensor::<I>(shard)) {
            Ok(whole) => whole,
            Err(e) => panic!("ZeRO stage 3: all-gather of a unit's parameters in backward failed: {e}"),
        };
        states.save(out, whole.into_primitive().tensor());
    }
}

/// Every rank's `shard` concatenated in rank order (the unit's whole flat parameters, padding
/// included), as a differentiable op: the gradient reaching the result is averaged over the
/// ranks and cut to this rank's shard. `after` (optional) orders the reduce-scatter right after
/// the backward of what it feeds (see the module docs).
pub fn gather<I, C, const D: usize>(
    shard: Tensor<Autodiff<I, C>, 1>,
    after: Option<&Tensor<Autodiff<I, C>, D>>,
    comm: &UnitComm<I>,
) -> Result<Tensor<Autodiff<I, C>, 1>, ZeroError>
where
    I: Backend,
    C: CheckpointStrategy,
{
    let shard = shard.into_primitive().tensor();
    // Only a tracked parent helps: an untracked one would make the op compute-bound (the
    // gathered weights kept).
    let after = after
        .map(|t| t.clone().into_primitive().tensor())
        .filter(|t| !t.node.requirement.is_none());
    let whole = comm.all_gather(tensor::<I>(shard.primitive.clone()))?;
    let whole = whole.into_primitive().tensor();
    let state = GatherState { comm: comm.clone() };
    let retro = RetroGather::<I> {
        shard: shard.node.id,
        after: after.as_ref().map(|t| t.node.id),
        comm: comm.clone(),
    };
    let out = match &after {
        None => {
            let prep = <GatherBackward as Backward<I, 1>>::prepare::<C>(GatherBackward, [shard.node.clone()]);
            match prep.memory_bound().retro_forward(retro).parents([&shard]).stateful() {
                OpsKind::Tracked(p) => p.finish(state, whole),
                OpsKind::UnTracked(p) => p.finish(whole),
            }
        }
        Some(after) => {
            let prep = <GatherBackward as Backward<I, 2>>::prepare::<C>(
                GatherBackward,
                [shard.node.clone(), after.node.clone()],
            );
            match prep
                .memory_bound()
                .retro_forward(retro)
                .parents([&shard, after])
                .stateful()
            {
                OpsKind::Tracked(p) => p.finish(state, whole),
                OpsKind::UnTracked(p) => p.finish(whole),
            }
        }
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}
