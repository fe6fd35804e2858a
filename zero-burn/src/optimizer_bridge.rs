//! The optimizer of one flat group: zero-core's shard optimizers, plus the cross-rank sum that
//! LAMB's per-tensor trust ratio needs when a tensor is cut across ranks.

use crate::error::ZeroError;
use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp};
use zero_core::optim::{self, HalfCopy, NormPartials, OptimizerSpec, ShardOptimizer, ShardSegments};
use zero_core::partition::{PartitionLayout, Placement};

/// Builds the optimizer of every group from one spec.
#[derive(Clone, Debug)]
pub(crate) struct OptimizerFactory {
    pub spec: OptimizerSpec,
}

impl OptimizerFactory {
    /// The optimizer for `rank`'s owned range of `group`.
    pub fn build(&self, layout: &PartitionLayout, group: usize, rank: usize) -> Result<GroupOptimizer, ZeroError> {
        let g = &layout.groups[group];
        let len = layout.owned_len(group);
        let segments = ShardSegments {
            num_params: g.params.len(),
            segments: layout
                .segments(group, rank)
                .into_iter()
                .map(|s| optim::Segment {
                    // Parameters are numbered within the group: the cross-rank sum is per group.
                    param_id: g.params.iter().position(|&p| p == s.param).unwrap_or(0),
                    range: s.local,
                })
                .collect(),
        };
        let inner = optim::build(&self.spec, len, segments).map_err(|e| ZeroError::Optimizer(e.to_string()))?;
        Ok(GroupOptimizer { inner, sharded: g.placement == Placement::Sharded })
    }
}

/// One group's optimizer.
pub(crate) struct GroupOptimizer {
    pub inner: Box<dyn ShardOptimizer>,
    sharded: bool,
}

impl GroupOptimizer {
    /// One update of the owned masters, also written rounded into `out` (the 16-bit shard).
    pub fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f64,
        comm: &dyn ProcessGroup,
        out: HalfCopy<'_>,
    ) -> Result<(), ZeroError> {
        let err = |e: optim::OptimError| ZeroError::Optimizer(e.to_string());
        if !self.inner.needs_cross_rank_norms() {
            return match out {
                HalfCopy::None => self.inner.step(params, grads, lr).map_err(err),
                out => self.inner.step_with_copy(params, grads, lr, out).map_err(err),
            };
        }
        let mut partials = self.inner.begin_step(params, grads).map_err(err)?;
        if self.sharded && comm.world_size() > 1 {
            let mut buf = FlatBuffer::F32(std::mem::take(&mut partials.0));
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
            partials = NormPartials(buf.into_f32());
        }
        self.inner.finish_step(params, grads, lr, &partials, out).map_err(err)
    }

    /// Bytes of optimizer state.
    pub fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
}
