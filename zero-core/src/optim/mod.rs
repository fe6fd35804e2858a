//! Optimizers that update one rank's flat fp32 shard in place.
//!
//! Under ZeRO each rank owns a contiguous shard of the flat parameter buffer: its fp32 master
//! weights, the averaged gradient of that shard, and the optimizer state of exactly those
//! elements. The optimizers here work on such shards as plain slices, with PyTorch's formulas,
//! and know nothing of tensors or ranks. Only LAMB needs to see across ranks (its trust ratio is
//! per parameter tensor, and a tensor may be cut between shards): every optimizer therefore offers
//! the same two-phase step, [`ShardOptimizer::begin_step`] then [`ShardOptimizer::finish_step`],
//! between which the caller sums the returned [`NormPartials`] over ranks. For the others the
//! partials are empty and the two phases amount to [`ShardOptimizer::step`].
//!
//! ```
//! use zero_core::optim::{build, OptimizerSpec, ShardSegments};
//!
//! let spec = OptimizerSpec::adamw();
//! let mut opt = build(&spec, 4, ShardSegments::single(4)).unwrap();
//! let mut params = vec![1.0_f32, 2.0, 3.0, 4.0];
//! opt.step(&mut params, &[0.1, 0.1, -0.1, 0.0], 1e-3).unwrap();
//! assert!(params[0] < 1.0 && params[2] > 3.0);
//! ```

mod adam;
pub mod adam_kernel;
mod cpu_pool;
mod error;
mod lamb;
mod lion;
mod segments;
mod sgd;
mod spec;
mod state;

pub use adam::Adam;
pub use adam_kernel::{HalfCopy, Isa};
pub use cpu_pool::CpuPool;
pub use error::OptimError;
pub use lamb::Lamb;
pub use lion::{lion_update, Lion};
pub use segments::{NormPartials, Segment, ShardSegments};
pub use sgd::{sgd_update, Sgd};
pub(crate) use spec::check_learning_rate;
pub use spec::{AdamSpec, LambSpec, LambVariant, LionSpec, OptimizerSpec, SgdSpec};

/// An optimizer over one rank's flat fp32 shard.
///
/// The learning rate is passed to every step (the engine owns the schedule); everything else is
/// fixed at construction. State buffers are as long as the shard and named as in PyTorch's
/// `optimizer.state_dict()` (`exp_avg`, `exp_avg_sq`, `momentum_buffer`, ...), so checkpoints
/// carry them by name.
pub trait ShardOptimizer: Send + std::fmt::Debug {
    /// The optimizer's name (`adam`, `adamw`, `sgd`, `lamb`, `lion`).
    fn name(&self) -> &'static str;

    /// The shard length this optimizer was built for.
    fn len(&self) -> usize;

    /// Whether the shard is empty (a rank may own only padding).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One update of `params` from `grads` with learning rate `lr`, using local norms only.
    ///
    /// For LAMB this is exact only when no parameter is cut across ranks (one rank, or a layout
    /// that keeps tensors whole); sharded LAMB must use the two-phase step.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError>;

    /// [`step`](Self::step), then the updated parameters written into a 16-bit copy. Adam fuses
    /// the copy into its single pass; the others make a second pass.
    fn step_with_copy(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f64,
        out: HalfCopy<'_>,
    ) -> Result<(), OptimError> {
        self.step(params, grads, lr)?;
        adam_kernel::copy_to_half(params, out)
    }

    /// Whether [`begin_step`](Self::begin_step) returns partial sums that must be summed over
    /// ranks before [`finish_step`](Self::finish_step).
    fn needs_cross_rank_norms(&self) -> bool {
        false
    }

    /// Phase 1 of the two-phase step: advances whatever state does not depend on cross-rank
    /// quantities and returns this shard's partial sums (empty unless
    /// [`needs_cross_rank_norms`](Self::needs_cross_rank_norms)).
    fn begin_step(&mut self, params: &[f32], grads: &[f32]) -> Result<NormPartials, OptimError> {
        let _ = (params, grads);
        Ok(NormPartials::empty())
    }

    /// Phase 2: applies the update with `totals`, the element-wise sum over ranks of every rank's
    /// [`begin_step`](Self::begin_step) result. For optimizers without cross-rank norms this is
    /// [`step_with_copy`](Self::step_with_copy).
    fn finish_step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f64,
        totals: &NormPartials,
        out: HalfCopy<'_>,
    ) -> Result<(), OptimError> {
        let _ = totals;
        self.step_with_copy(params, grads, lr, out)
    }

    /// Sets (β1, β2) for the next steps (Adam, LAMB, Lion), for schedules that cycle the
    /// momentum; bias correction then uses the new values. Returns false, changing nothing,
    /// where there are no betas: like DeepSpeed's OneCycle, which cycles only optimizers with
    /// `betas`, SGD's momentum is left alone.
    fn set_betas(&mut self, betas: (f64, f64)) -> bool {
        let _ = betas;
        false
    }

    /// Bytes of optimizer state held (not counting the parameters).
    fn state_bytes(&self) -> usize {
        self.state().iter().map(|(_, b)| std::mem::size_of_val(*b)).sum()
    }

    /// The state buffers, by name, each as long as the shard.
    fn state(&self) -> Vec<(&'static str, &[f32])>;

    /// Number of steps taken (PyTorch's `state["step"]`).
    fn step_count(&self) -> u64;

    /// Sets the number of steps taken, e.g. after restoring a checkpoint.
    fn set_step_count(&mut self, step: u64);

    /// Restores the state: `step` and every buffer [`state`](Self::state) names, each as long as
    /// the shard. Fails without changing anything if a buffer is missing, unknown or misshapen.
    fn load_state(&mut self, step: u64, buffers: &[(&str, &[f32])]) -> Result<(), OptimError>;
}

/// Builds the optimizer `spec` describes for a shard of `len` elements cut into `segments`.
pub fn build(spec: &OptimizerSpec, len: usize, segments: ShardSegments) -> Result<Box<dyn ShardOptimizer>, OptimError> {
    segments.validate(len)?;
    Ok(match spec {
        OptimizerSpec::Adam(s) => Box::new(Adam::new(s.clone(), len)?),
        OptimizerSpec::Sgd(s) => Box::new(Sgd::new(s.clone(), len)?),
        OptimizerSpec::Lamb(s) => Box::new(Lamb::new(s.clone(), len, segments)?),
        OptimizerSpec::Lion(s) => Box::new(Lion::new(s.clone(), len)?),
    })
}

/// Checks a slice's length against the shard's.
pub(crate) fn check_len(what: &str, expected: usize, actual: usize) -> Result<(), OptimError> {
    if expected == actual {
        Ok(())
    } else {
        Err(OptimError::LengthMismatch {
            what: what.to_string(),
            expected,
            actual,
        })
    }
}
