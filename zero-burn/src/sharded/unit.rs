//! A module whose float parameters live as this rank's shard of one flat vector (ZeRO stage 3),
//! put back together for one forward by [`ShardedUnit::unshard`] through the differentiable
//! [`gather`](super::gather): gradients reach the shard, averaged over the ranks, through
//! `loss.backward()` like any other parameter's.

use super::gather::{gather, UnitComm};
use crate::error::ZeroError;
use crate::params::read_values;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use std::collections::VecDeque;

/// A module of backend `Autodiff<I, C>` held as a shard of its flat parameters (visit order,
/// zero-padded to a multiple of the world size, cut in equal contiguous shards).
#[derive(Debug)]
pub struct ShardedUnit<I: Backend, C: CheckpointStrategy, M> {
    skeleton: M,
    numels: Vec<usize>,
    shard: Tensor<Autodiff<I, C>, 1>,
    comm: UnitComm<I>,
}

impl<I, C, M> ShardedUnit<I, C, M>
where
    I: Backend,
    C: CheckpointStrategy,
    M: Module<Autodiff<I, C>>,
{
    /// Shards `module` (the same on every rank) over `comm`: this rank keeps its slice of the
    /// flat parameters as a leaf that records gradients.
    pub fn new(module: M, comm: UnitComm<I>) -> Result<Self, ZeroError> {
        let mut values = Vec::new();
        let mut numels = Vec::new();
        read_values::<Autodiff<I, C>, _>(&module, |_, v| {
            numels.push(v.len());
            values.extend(v);
        });
        let device = module
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| ZeroError::Config("a sharded unit needs a module with parameters".into()))?;
        let world = comm.world_size();
        let per = values.len().div_ceil(world);
        values.resize(per * world, 0.0);
        let rank = comm.rank();
        let mine = values[rank * per..(rank + 1) * per].to_vec();
        let shard = Tensor::<Autodiff<I, C>, 1>::from_data(TensorData::new(mine, [per]), &device).require_grad();
        // The module keeps only its structure: every float parameter becomes a lazy one (its id
        // and shape, no values), filled from the gathered flat vector at each unshard.
        let skeleton = module.map(&mut Skeleton { device: device.clone() });
        Ok(ShardedUnit {
            skeleton,
            numels,
            shard,
            comm,
        })
    }

    /// This rank's shard (a leaf: its gradient is the rank's part of the averaged gradient).
    pub fn shard(&self) -> &Tensor<Autodiff<I, C>, 1> {
        &self.shard
    }

    /// The module with its whole parameters, gathered from every rank's shard, for one forward
    /// that starts from `input` (which orders the gradient's reduce-scatter, see
    /// [`gather`](super::gather)).
    pub fn unshard<const D: usize>(&self, input: &Tensor<Autodiff<I, C>, D>) -> Result<M, ZeroError> {
        let whole = gather(self.shard.clone(), Some(input), &self.comm)?;
        let mut offset = 0;
        let parts: VecDeque<_> = self
            .numels
            .iter()
            .map(|&n| {
                offset += n;
                whole.clone().narrow(0, offset - n, n)
            })
            .collect();
        Ok(self.skeleton.clone().map(&mut FromParts(parts)))
    }
}

/// Replaces each float parameter by a lazy one of the same id and shape that holds no values.
struct Skeleton<B: Backend> {
    device: B::Device,
}

impl<B: Backend> ModuleMapper<B> for Skeleton<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let shape = param.lazy_shape();
        let zeros = shape.clone();
        // Never initialised: `unshard` replaces the parameter before anything reads it.
        let init = move |device: &B::Device, _: bool| Tensor::<B, D>::zeros(zeros.clone(), device);
        Param::uninitialized(param.id, init, self.device.clone(), false, shape)
    }
}

/// Replaces each float parameter, in visit order, with the next flat part reshaped.
struct FromParts<B: Backend>(VecDeque<Tensor<B, 1>>);

impl<B: Backend> ModuleMapper<B> for FromParts<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let shape = param.lazy_shape();
        match self.0.pop_front() {
            Some(part) => Param::initialized(param.id, part.reshape(shape)),
            // The parts are cut from this module's own parameters: one per float parameter.
            None => unreachable!("a sharded unit's module has more float parameters than when it was sharded"),
        }
    }
}
