//! The optimizer of one flat group: zero-core's shard optimizers, plus the cross-rank sum that
//! LAMB's per-tensor trust ratio needs when a tensor is cut across ranks.

use crate::agreement::TensorNorms;
use crate::error::ZeroError;
use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp};
use zero_core::optim::{self, HalfCopy, NormPartials, OptimizerSpec, ShardOptimizer, ShardSegments};
use zero_core::partition::{PartitionLayout, Placement};

/// The pieces of `group`'s parameter tensors in `rank`'s owned range, the parameters numbered
/// within the group (the cross-rank sum of LAMB's norms is per group).
pub(crate) fn shard_segments(layout: &PartitionLayout, group: usize, rank: usize) -> ShardSegments {
    let g = &layout.groups[group];
    ShardSegments {
        num_params: g.params.len(),
        segments: layout
            .segments(group, rank)
            .into_iter()
            .map(|s| optim::Segment {
                param_id: g.params.iter().position(|&p| p == s.param).unwrap_or(0),
                range: s.local,
            })
            .collect(),
    }
}

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
        let segments = shard_segments(layout, group, rank);
        let inner = optim::build(&self.spec, len, segments).map_err(|e| ZeroError::Optimizer(e.to_string()))?;
        Ok(GroupOptimizer {
            inner,
            sharded: g.placement == Placement::Sharded,
            chunked: Vec::new(),
            swapped_steps: 0,
            chunk_spec: None,
        })
    }

    /// The optimizer of a group whose parameters do not train (yet): no state (its name, buffer
    /// names and a step count of 0), made whole by [`OptimizerFactory::build`] at the group's
    /// first gradient ([`GroupOptimizer::is_dormant`]).
    pub fn build_dormant(&self) -> Result<GroupOptimizer, ZeroError> {
        let inner =
            optim::build(&self.spec, 0, ShardSegments::single(0)).map_err(|e| ZeroError::Optimizer(e.to_string()))?;
        Ok(GroupOptimizer {
            inner,
            sharded: false,
            chunked: Vec::new(),
            swapped_steps: 0,
            chunk_spec: None,
        })
    }

    /// The optimizer for a shard whose state is swapped: `inner` holds no elements (the state
    /// buffers' names and the step count come from it), and [`GroupOptimizer::step_chunk`]
    /// updates chunks one after the other through a scratch optimizer of a chunk's length that
    /// lives only for the group's step. Only element-wise optimizers can be cut so: LAMB's
    /// per-tensor trust ratio needs every chunk at once.
    pub fn build_chunked(&self, group: usize) -> Result<GroupOptimizer, ZeroError> {
        let inner =
            optim::build(&self.spec, 0, ShardSegments::single(0)).map_err(|e| ZeroError::Optimizer(e.to_string()))?;
        if inner.needs_cross_rank_norms() {
            return Err(ZeroError::Config(format!(
                "zero_optimization.offload_optimizer: the `{}` optimizer of group {group} needs every element of a tensor \
                 at once (its trust ratio), so its state cannot be streamed from NVMe; use device \"cpu\" or Adam, \
                 SGD or Lion",
                inner.name()
            )));
        }
        Ok(GroupOptimizer {
            inner,
            sharded: false,
            chunked: Vec::new(),
            swapped_steps: 0,
            chunk_spec: Some(self.spec.clone()),
        })
    }
}

/// One group's optimizer.
pub(crate) struct GroupOptimizer {
    pub inner: Box<dyn ShardOptimizer>,
    sharded: bool,
    /// Swapped state: the scratch optimizers of this step's chunk lengths (the last chunk of a
    /// shard is shorter), dropped when the step ends.
    chunked: Vec<Box<dyn ShardOptimizer>>,
    /// Swapped state: steps taken (the chunk optimizers are reloaded with it for every chunk).
    swapped_steps: u64,
    /// Swapped state: the spec, to build the optimizer of another chunk length.
    chunk_spec: Option<OptimizerSpec>,
}

impl GroupOptimizer {
    /// Whether this is [`OptimizerFactory::build_dormant`]'s: no state, not swapped.
    pub fn is_dormant(&self) -> bool {
        self.inner.is_empty() && self.chunk_spec.is_none()
    }

    /// One update of the owned masters, also written rounded into `out` (the 16-bit shard).
    /// `tensor`: with tensor parallelism, the norms over the tensor ranks and this group's index.
    pub fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f64,
        comm: &dyn ProcessGroup,
        tensor: Option<(&TensorNorms, usize)>,
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
        if let Some((norms, gi)) = tensor {
            // Pairs [‖p‖², ‖u‖²] per parameter.
            norms.sum(gi, &mut partials.0, |k| k / 2)?;
        }
        self.inner.finish_step(params, grads, lr, &partials, out).map_err(err)
    }

    /// Sets the betas for the steps to come (a schedule that cycles the momentum), in the
    /// optimizer and in what builds a swapped step's chunk optimizers; SGD keeps its momentum.
    pub fn set_betas(&mut self, betas: (f64, f64)) {
        self.inner.set_betas(betas);
        for o in &mut self.chunked {
            o.set_betas(betas);
        }
        if let Some(spec) = &mut self.chunk_spec {
            spec.set_betas(betas);
        }
    }

    /// Bytes of optimizer state.
    pub fn state_bytes(&self) -> usize {
        self.inner.state_bytes() + self.chunked.iter().map(|o| o.state_bytes()).sum::<usize>()
    }

    /// State buffers per element besides the masters (2 for Adam, 0 for SGD without momentum).
    pub fn state_width(&self) -> usize {
        self.inner.state().len()
    }

    /// Swapped state: one step of one chunk. `chunk` holds the chunk's masters, then each state
    /// buffer, `grads.len()` elements each, as [`GroupOptimizer::state_width`] orders them; the
    /// masters are also written rounded into `out`. Every chunk of a step sees the same step
    /// count; [`GroupOptimizer::end_swapped_step`] advances it.
    pub fn step_chunk(
        &mut self,
        chunk: &mut [f32],
        grads: &[f32],
        lr: f64,
        out: HalfCopy<'_>,
    ) -> Result<(), ZeroError> {
        let n = grads.len();
        let err = |e: optim::OptimError| ZeroError::Optimizer(e.to_string());
        let opt = {
            match self.chunked.iter().position(|o| o.len() == n) {
                Some(i) => &mut self.chunked[i],
                None => {
                    let Some(spec) = &self.chunk_spec else {
                        return Err(ZeroError::Optimizer(format!(
                            "a chunk of {n} elements for an unswapped optimizer"
                        )));
                    };
                    let built = optim::build(spec, n, ShardSegments::single(n)).map_err(err)?;
                    self.chunked.push(built);
                    let last = self.chunked.len() - 1;
                    &mut self.chunked[last]
                }
            }
        };
        let (master, states) = chunk.split_at_mut(n);
        let names: Vec<&'static str> = opt.state().iter().map(|(name, _)| *name).collect();
        {
            let buffers: Vec<(&str, &[f32])> = names.iter().copied().zip(states.chunks_exact(n)).collect();
            opt.load_state(self.swapped_steps, &buffers).map_err(err)?;
        }
        match out {
            HalfCopy::None => opt.step(master, grads, lr).map_err(err)?,
            out => opt.step_with_copy(master, grads, lr, out).map_err(err)?,
        }
        for ((_, data), target) in opt.state().iter().zip(states.chunks_exact_mut(n)) {
            target.copy_from_slice(data);
        }
        Ok(())
    }

    /// Swapped state: the optimizer continues from `steps` steps taken (a restored checkpoint).
    pub fn set_swapped_steps(&mut self, steps: u64) {
        self.swapped_steps = steps;
        self.inner.set_step_count(steps);
    }

    /// Swapped state: every chunk of this step was updated.
    pub fn end_swapped_step(&mut self) {
        self.chunked.clear();
        self.swapped_steps += 1;
        self.inner.set_step_count(self.swapped_steps);
    }
}
