//! The backends a `ZeroModule` runs on ([`ShardBackend`]): how a unit's shard becomes its whole
//! flat parameters on each (the differentiable gather under autodiff, a plain all-gather for a
//! `valid()` copy), and the ranks a unit is cut over whatever the backend at hand ([`ShardComm`]).

use super::gather::{gather_parts, UnitComm, UnitGather};
use crate::error::ZeroError;
use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::backend::Autodiff;
#[cfg(feature = "flex")]
use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use std::any::Any;
use std::sync::Arc;

/// The backends a [`ZeroModule`](super::ZeroModule) runs on: how a unit's shard becomes its whole flat parameters.
/// Autodiff backends gather with the differentiable op; the others (a model's `valid()` copy)
/// gather plainly.
pub trait ShardBackend: Backend {
    /// The backend whose tensors the collectives move (the innermost one).
    type Collective: Backend;

    /// The unit's parameters as flat parts of lengths `sizes`, from this rank's `shard`:
    /// every rank's shard in rank order with `gather` (`kept` instead, when the unit keeps its
    /// whole vector between steps), `shard` itself (the whole vector) without; `after` is the
    /// tensor the unit's forward starts from.
    #[doc(hidden)]
    fn gather_parts<const D: usize>(
        shard: Tensor<Self, 1>,
        after: Option<&Tensor<Self, D>>,
        gather: Option<&UnitGather<Self::Collective>>,
        kept: Option<Tensor<Self::Collective, 1>>,
        sizes: &[usize],
    ) -> Result<Vec<Tensor<Self, 1>>, ZeroError>;

    /// What identifies `t`'s value, for a unit that keeps its gathered vector between steps:
    /// `None` where values cannot be told apart cheaply (a copy without autodiff, which then
    /// gathers at every forward).
    fn value_key(t: &Tensor<Self, 1>) -> Option<u64>;

    /// `t` as a tensor of the collective's backend (the autodiff wrapper removed).
    fn collective_value(t: Tensor<Self, 1>) -> Tensor<Self::Collective, 1>;

    /// A value of the collective's backend as a parameter of this one (one that takes a
    /// gradient, under autodiff).
    fn from_collective(t: Tensor<Self::Collective, 1>) -> Tensor<Self, 1>;

    /// Whether a gathered unit's whole parameters are freed after its forward and gathered
    /// again for backward (autodiff with a checkpointing strategy); otherwise they stay alive
    /// until backward, as at stage 2.
    fn frees_gathered() -> bool {
        false
    }

    /// Whether the backend's tensors live in host memory (the CPU backend): parameter shards
    /// there are already where `offload_param: cpu` would put them.
    fn host_resident() -> bool;
}

impl<I: ShardBackend<Collective = I>, C: CheckpointStrategy + 'static> ShardBackend for Autodiff<I, C> {
    type Collective = I;

    fn frees_gathered() -> bool {
        std::any::TypeId::of::<C>() != std::any::TypeId::of::<NoCheckpointing>()
    }

    fn host_resident() -> bool {
        I::host_resident()
    }

    fn gather_parts<const D: usize>(
        shard: Tensor<Self, 1>,
        after: Option<&Tensor<Self, D>>,
        gather: Option<&UnitGather<I>>,
        kept: Option<Tensor<I, 1>>,
        sizes: &[usize],
    ) -> Result<Vec<Tensor<Self, 1>>, ZeroError> {
        gather_parts(shard, after, gather, kept, sizes)
    }

    fn value_key(t: &Tensor<Self, 1>) -> Option<u64> {
        Some(super::gather::value_key(t))
    }

    fn collective_value(t: Tensor<Self, 1>) -> Tensor<I, 1> {
        t.inner()
    }

    fn from_collective(t: Tensor<I, 1>) -> Tensor<Self, 1> {
        Tensor::from_inner(t).require_grad()
    }
}

/// A plain all-gather (with `comm`; `kept` instead when given), cut into parts, for backends
/// without autodiff.
#[cfg(any(feature = "flex", feature = "cuda"))]
fn plain_parts<B: Backend>(
    shard: Tensor<B, 1>,
    gather: Option<&UnitGather<B>>,
    kept: Option<Tensor<B, 1>>,
    sizes: &[usize],
) -> Result<Vec<Tensor<B, 1>>, ZeroError> {
    let whole = match (kept, gather) {
        (Some(kept), _) => kept,
        // No autodiff node to tell values apart: gathered now, without the prefetch schedule.
        (None, Some(gather)) => gather.gather_now(shard)?,
        (None, None) => shard,
    };
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            start += n;
            whole.clone().narrow(0, start - n, n)
        })
        .collect())
}

#[cfg(feature = "flex")]
impl ShardBackend for Flex {
    type Collective = Flex;

    fn host_resident() -> bool {
        true
    }

    fn gather_parts<const D: usize>(
        shard: Tensor<Self, 1>,
        _after: Option<&Tensor<Self, D>>,
        gather: Option<&UnitGather<Self>>,
        kept: Option<Tensor<Self, 1>>,
        sizes: &[usize],
    ) -> Result<Vec<Tensor<Self, 1>>, ZeroError> {
        plain_parts(shard, gather, kept, sizes)
    }

    fn value_key(_: &Tensor<Self, 1>) -> Option<u64> {
        None
    }

    fn collective_value(t: Tensor<Self, 1>) -> Tensor<Self, 1> {
        t
    }

    fn from_collective(t: Tensor<Self, 1>) -> Tensor<Self, 1> {
        t
    }
}

/// Burn's CUDA backends, fused (`burn::backend::Cuda`) or not: collectives on their own tensors.
#[cfg(feature = "cuda")]
impl<B: crate::device::CudaBuffers> ShardBackend for B {
    type Collective = Self;

    fn host_resident() -> bool {
        false
    }

    fn gather_parts<const D: usize>(
        shard: Tensor<Self, 1>,
        _after: Option<&Tensor<Self, D>>,
        gather: Option<&UnitGather<Self>>,
        kept: Option<Tensor<Self, 1>>,
        sizes: &[usize],
    ) -> Result<Vec<Tensor<Self, 1>>, ZeroError> {
        plain_parts(shard, gather, kept, sizes)
    }

    fn value_key(_: &Tensor<Self, 1>) -> Option<u64> {
        None
    }

    fn collective_value(t: Tensor<Self, 1>) -> Tensor<Self, 1> {
        t
    }

    fn from_collective(t: Tensor<Self, 1>) -> Tensor<Self, 1> {
        t
    }
}

/// The ranks a [`ZeroModule`](super::ZeroModule) is sharded over, whatever the backend of the module's copy at
/// hand (a training model and its `valid()` copy share it): a [`UnitComm`] of the innermost
/// backend.
#[derive(Clone)]
pub struct ShardComm(Arc<dyn Any + Send + Sync>);

impl ShardComm {
    /// The ranks of `comm`.
    pub fn new<I: Backend>(comm: UnitComm<I>) -> Self {
        ShardComm(Arc::new(comm))
    }

    pub(super) fn get<I: Backend>(&self) -> Result<&UnitComm<I>, ZeroError> {
        self.0.downcast_ref::<UnitComm<I>>().ok_or_else(|| {
            ZeroError::Config(format!(
                "a ZeroModule sharded for another backend was run on {}",
                std::any::type_name::<I>()
            ))
        })
    }
}

impl std::fmt::Debug for ShardComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardComm")
    }
}
