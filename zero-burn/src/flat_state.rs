//! The rank's share of the training state, on flat host buffers: fp32 master weights, gradient
//! accumulators and optimizer state for every group of the partition layout, and the update that
//! turns reduced gradients into new weights.
//!
//! This is where a gradient goes after `backward`: into a group's accumulator (whole, or already
//! reduced to the rank's shard), then through the boundary reduction, the global-norm clip and
//! the optimizer, into the master weights.

use crate::error::ZeroError;
use crate::memory::MemoryTracker;
use crate::optimizer_bridge::{GroupOptimizer, OptimizerFactory};
use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp};
use zero_core::partition::{PartitionLayout, Placement};

/// How a group's gradients reach the owned slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GradFlow {
    /// Each micro-batch's gradient is added, whole, to a local accumulator; the accumulator is
    /// reduced at the accumulation boundary (all-reduce for replicated groups, reduce-scatter
    /// for sharded ones). Stage 0, stage 1, and replicated groups of stage 3.
    AccumulateThenReduce,
    /// Each micro-batch's gradient is reduce-scattered as soon as it exists; only the owned
    /// shard is accumulated. Stages 2 and 3.
    ReduceThenAccumulate,
}

/// One group's share of the state.
pub(crate) struct GroupState {
    /// fp32 master weights of the owned range.
    pub master: Vec<f32>,
    /// Gradient accumulator: the whole padded group (AccumulateThenReduce) or the owned slice.
    pub grad: Vec<f32>,
    /// How gradients arrive.
    pub flow: GradFlow,
    /// Optimizer over `master`.
    pub optimizer: GroupOptimizer,
}

/// The rank's state for all groups.
pub(crate) struct FlatState {
    pub layout: PartitionLayout,
    pub groups: Vec<GroupState>,
    pub rank: usize,
}

impl FlatState {
    /// Builds the state from the full initial values of every parameter (`values(i)`), keeping
    /// only the owned ranges.
    pub fn new(
        layout: PartitionLayout,
        rank: usize,
        flows: impl Fn(usize) -> GradFlow,
        factory: &OptimizerFactory,
        mut values: impl FnMut(usize) -> Vec<f32>,
        memory: &MemoryTracker,
    ) -> Result<Self, ZeroError> {
        let mut groups = Vec::with_capacity(layout.groups.len());
        let mut pending: Vec<Option<Vec<f32>>> = vec![None; layout.params.len()];
        // Parameters are asked for in visit order; groups may list them in another order.
        let mut next_param = 0;
        for gi in 0..layout.groups.len() {
            let owned = layout.owned_range(gi, rank);
            let mut master = vec![0.0f32; owned.len()];
            for seg in layout.segments(gi, rank) {
                while pending[seg.param].is_none() {
                    pending[next_param] = Some(values(next_param));
                    next_param += 1;
                }
                let full = pending[seg.param].as_ref().map(Vec::as_slice).unwrap_or(&[]);
                master[seg.local.clone()].copy_from_slice(&full[seg.in_param.clone()]);
            }
            // Release parameters whose every piece has been copied.
            for &p in &layout.groups[gi].params {
                pending[p] = None;
            }
            let flow = flows(gi);
            let grad_len = match flow {
                GradFlow::AccumulateThenReduce => layout.groups[gi].padded,
                GradFlow::ReduceThenAccumulate => owned.len(),
            };
            let optimizer = factory.build(&layout, gi, rank)?;
            memory.add_master(master.len() * 4);
            memory.add_grads(grad_len * 4);
            memory.add_optimizer(optimizer.state_bytes());
            groups.push(GroupState { master, grad: vec![0.0; grad_len], flow, optimizer });
        }
        Ok(FlatState { layout, groups, rank })
    }

    /// Adds a micro-batch gradient of the whole (padded) group, `scale` times.
    ///
    /// For `ReduceThenAccumulate` groups the caller reduce-scatters first and calls
    /// [`FlatState::add_owned`] instead.
    pub fn add_full(&mut self, group: usize, full: &[f32]) {
        let g = &mut self.groups[group];
        debug_assert_eq!(g.flow, GradFlow::AccumulateThenReduce);
        for (acc, v) in g.grad.iter_mut().zip(full) {
            *acc += v;
        }
    }

    /// Adds an already reduced gradient of the owned slice.
    pub fn add_owned(&mut self, group: usize, owned: &[f32]) {
        let g = &mut self.groups[group];
        for (acc, v) in g.grad.iter_mut().zip(owned) {
            *acc += v;
        }
    }

    /// At the accumulation boundary: reduces the locally accumulated groups so that every
    /// group's `grad` holds the data-parallel mean gradient of its owned range.
    pub fn reduce_at_boundary(&mut self, group_comm: &dyn ProcessGroup) -> Result<(), ZeroError> {
        let world = group_comm.world_size();
        for gi in 0..self.groups.len() {
            if self.groups[gi].flow != GradFlow::AccumulateThenReduce || world == 1 {
                continue;
            }
            let full = FlatBuffer::F32(std::mem::take(&mut self.groups[gi].grad));
            let reduced = match self.layout.groups[gi].placement {
                Placement::Replicated => {
                    let mut b = full;
                    group_comm.all_reduce(&mut b, ReduceOp::Avg)?;
                    b
                }
                Placement::Sharded => group_comm.reduce_scatter(full, ReduceOp::Avg)?,
            };
            self.groups[gi].grad = reduced.into_f32();
        }
        Ok(())
    }

    /// The owned slice of a group's reduced gradient (valid after [`FlatState::reduce_at_boundary`]).
    fn owned_grad(&self, group: usize) -> &[f32] {
        let g = &self.groups[group];
        debug_assert_eq!(g.grad.len(), g.master.len(), "gradient not reduced yet");
        &g.grad
    }

    /// Global L2 norm of the reduced gradient over every rank's owned slices.
    pub fn global_grad_norm(&self, group_comm: &dyn ProcessGroup) -> Result<f64, ZeroError> {
        let mut sharded = 0.0f64;
        let mut replicated = 0.0f64;
        for gi in 0..self.groups.len() {
            let sum: f64 = self.owned_grad(gi).iter().map(|&v| (v as f64) * (v as f64)).sum();
            match self.layout.groups[gi].placement {
                Placement::Sharded => sharded += sum,
                Placement::Replicated => replicated += sum,
            }
        }
        if group_comm.world_size() > 1 {
            let mut b = FlatBuffer::F32(vec![sharded as f32]);
            // Sum in f32 over ranks is enough for a norm; the per-rank partial sums are f64.
            group_comm.all_reduce(&mut b, ReduceOp::Sum)?;
            sharded = b.into_f32()[0] as f64;
        }
        Ok((sharded + replicated).sqrt())
    }

    /// Clips (when `max_norm > 0`), runs the optimizer on every group, and clears the
    /// accumulators. Returns the gradient norm before clipping.
    pub fn update(&mut self, group_comm: &dyn ProcessGroup, lr: f64, max_norm: f64) -> Result<f64, ZeroError> {
        let norm = self.global_grad_norm(group_comm)?;
        // torch.nn.utils.clip_grad_norm_'s rule: scale by max/(norm + 1e-6) when that is below 1.
        let ratio = max_norm / (norm + 1e-6);
        let coef = if max_norm > 0.0 && ratio < 1.0 { ratio as f32 } else { 1.0 };
        for g in &mut self.groups {
            if coef != 1.0 {
                for v in &mut g.grad {
                    *v *= coef;
                }
            }
            g.optimizer.step(&mut g.master, &g.grad, lr, group_comm)?;
        }
        self.reset_accumulators();
        Ok(norm)
    }

    /// Zeroes the accumulators and gives AccumulateThenReduce groups back their whole-group
    /// length (the boundary reduction shrank them to the owned slice).
    pub fn reset_accumulators(&mut self) {
        for (gi, g) in self.groups.iter_mut().enumerate() {
            let len = match g.flow {
                GradFlow::AccumulateThenReduce => self.layout.groups[gi].padded,
                GradFlow::ReduceThenAccumulate => g.master.len(),
            };
            g.grad.clear();
            g.grad.resize(len, 0.0);
        }
    }
}
