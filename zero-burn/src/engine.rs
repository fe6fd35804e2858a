//! The engine for any Burn module, ZeRO stages 0, 1 and 2.
//!
//! Every rank holds a full replica of the model for forward and backward. After backward, the
//! gradients leave Burn bucket by bucket (groups of about `reduce_bucket_size` elements): stage 0
//! accumulates them and all-reduces at the accumulation boundary; stage 1 accumulates and
//! reduce-scatters at the boundary; stage 2 reduce-scatters each bucket as soon as it is complete
//! (in the background with `overlap_comm`) and keeps only the rank's shard. The optimizer steps
//! the rank's fp32 master shard, the updated shards are all-gathered, and the replica is refreshed.
//!
//! Burn gives no hook inside `backward()`, so for a module that is not a chain the full gradient
//! exists for a moment once backward returns; for a [`crate::ChainModel`] the chain engine
//! reduces block by block instead.

use crate::core::{EngineCore, StepReport};
use crate::error::ZeroError;
use crate::flat_state::GradFlow;
use crate::half_buffer;
use crate::memory::{MemoryReport, MemoryTracker};
use crate::params::{describe, read_values, take_grads, write_data};
use crate::settings::{ComputeDtype, EngineSettings, Stage};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ProcessGroup};
use zero_core::partition::{LayoutBuilder, ParamSpec, PartitionLayout, Placement};

/// ZeRO stages 0-2 around any Burn module.
///
/// ```ignore
/// let mut engine = ZeroEngine::new(settings, model, group)?;
/// for batch in loader {
///     let loss = engine.forward(|model| model.loss(&batch));
///     engine.backward(loss)?;
///     engine.step()?; // no-op between accumulation boundaries
/// }
/// ```
pub struct ZeroEngine<B: AutodiffBackend, M: AutodiffModule<B>> {
    model: Option<M>,
    core: EngineCore,
    device: B::Device,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> ZeroEngine<B, M> {
    /// Wraps `model`. Rank 0's parameter values are broadcast, so every rank starts from the same
    /// weights whatever each built.
    pub fn new(settings: EngineSettings, model: M, comm: Arc<dyn ProcessGroup>) -> Result<Self, ZeroError> {
        crate::sharded::refuse_zero_modules::<B, M>(&model, "ZeroEngine")?;
        if settings.stage == Stage::Zero3 {
            return Err(ZeroError::Config(
                "zero_optimization.stage 3 needs to know the model's blocks: implement zero_burn::ChainModel for the \
                 model and use ChainEngine (or choose stage 0, 1 or 2)"
                    .into(),
            ));
        }
        let device = model
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| ZeroError::Model("the model has no parameters (no device found)".into()))?;
        let layout = replicated_layout(&model, &settings, comm.world_size());
        let dtype = settings.precision.dtype;
        let mut values = vec![Vec::new(); layout.params.len()];
        read_values::<B, M>(&model, |i, v| values[i] = v);
        let mut values = broadcast_values(values, &layout, comm.as_ref(), &vec![false; layout.groups.len()])?;
        // The model is cast to the compute dtype first and the masters are made from it, as
        // DeepSpeed does: the model always sees exactly its masters rounded.
        values.iter_mut().for_each(|v| half_buffer::round_to(dtype, v));
        let model = write_data(model, &device, true, |i, shape| {
            half_buffer::f32_to_data(values[i].clone(), shape, dtype)
        });
        let memory = Arc::new(MemoryTracker::default());
        memory.add_parameters(layout.numel() * dtype.size());
        let flow = match settings.stage {
            Stage::Zero2 => GradFlow::ReduceThenAccumulate,
            _ => GradFlow::AccumulateThenReduce,
        };
        let core = EngineCore::new(layout, comm, settings, |_| flow, |i| values[i].clone(), memory)?;
        Ok(ZeroEngine {
            model: Some(model),
            core,
            device,
        })
    }

    /// Runs `f` on the model (forward, or evaluation). Under bf16/fp16 the parameters are
    /// 16-bit: cast the float inputs to [`ZeroEngine::compute_dtype`] (integer inputs, like
    /// token ids through an embedding, need nothing).
    pub fn forward<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        f(self.module())
    }

    /// The model with the current weights.
    pub fn module(&self) -> &M {
        // `model` is only None inside `step`, which puts it back before returning.
        self.model
            .as_ref()
            .unwrap_or_else(|| unreachable!("model taken during step"))
    }

    /// Backward of one micro-batch's loss (times the fp16 loss scale), and the reduction of its
    /// gradients. Returns the loss value.
    pub fn backward(&mut self, loss: Tensor<B, 1>) -> Result<f32, ZeroError> {
        let value = loss.clone().into_scalar().elem::<f32>();
        let mut grads = self.core.backward_loss(loss, value).backward();
        let mut failure = None;
        let core = &mut self.core;
        take_grads::<B, M>(
            self.model.as_ref().unwrap_or_else(|| unreachable!()),
            &mut grads,
            |i, g| {
                if failure.is_none() {
                    if let Err(e) = core.absorb(i, g) {
                        failure = Some(e);
                    }
                }
            },
        );
        if let Some(e) = failure {
            return Err(e);
        }
        core.finish_micro_batch()?;
        Ok(value)
    }

    /// The optimizer step at an accumulation boundary; `None` between boundaries.
    pub fn step(&mut self) -> Result<Option<StepReport>, ZeroError> {
        if !self.core.at_boundary() {
            return Ok(None);
        }
        let report = self.core.update()?;
        if report.skipped {
            // Nothing moved: the model keeps its weights.
            return Ok(Some(report));
        }
        let model = self.model.take().unwrap_or_else(|| unreachable!());
        let mut source = self.core.value_source();
        let model = write_data(model, &self.device, true, |i, _| source.take_data(i));
        self.model = Some(model);
        source.finish()?;
        Ok(Some(report))
    }

    /// The dtype of the model's parameters: cast float inputs to `compute_dtype().burn()`.
    pub fn compute_dtype(&self) -> ComputeDtype {
        self.core.settings.precision.dtype
    }

    /// The loss scale of the next backward (1 without fp16 loss scaling).
    pub fn loss_scale(&self) -> f64 {
        self.core.current_loss_scale()
    }

    /// Steps skipped so far for a non-finite gradient.
    pub fn skipped_steps(&self) -> u64 {
        self.core.skipped_steps
    }

    /// Bytes held by this rank, by kind.
    pub fn memory(&self) -> MemoryReport {
        self.core.memory.report()
    }

    /// Optimizer steps taken.
    pub fn global_step(&self) -> u64 {
        self.core.global_step
    }

    /// The partition layout.
    pub fn layout(&self) -> &PartitionLayout {
        &self.core.state.layout
    }

    /// The settings in force.
    pub fn settings(&self) -> &EngineSettings {
        &self.core.settings
    }

    /// Gives the model back (it holds the current weights on every rank).
    pub fn into_module(mut self) -> M {
        self.model.take().unwrap_or_else(|| unreachable!())
    }
}

/// Stages 0-2: every parameter, in visit order, in buckets of about `reduce_bucket_size`.
pub(crate) fn replicated_layout<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    settings: &EngineSettings,
    world: usize,
) -> PartitionLayout {
    let specs: Vec<_> = describe::<B, M>(model).into_iter().map(|(_, s)| s).collect();
    stage_layout(specs, &[], settings.alignment, settings, world)
}

/// `specs` (in visit order) in buckets of about `reduce_bucket_size`, replicated at stage 0 and
/// sharded at stages 1-2, except the parameters of `units` (disjoint ranges, each a sharded
/// `ZeroModule`'s parameters): each unit is a sharded group of its own.
pub(crate) fn stage_layout(
    specs: Vec<ParamSpec>,
    units: &[std::ops::Range<usize>],
    alignment: usize,
    settings: &EngineSettings,
    world: usize,
) -> PartitionLayout {
    let bucketed: Vec<usize> = (0..specs.len())
        .filter(|i| !units.iter().any(|u| u.contains(i)))
        .collect();
    let placement = if settings.stage == Stage::Zero0 {
        Placement::Replicated
    } else {
        Placement::Sharded
    };
    let mut builder = LayoutBuilder::new(specs, world, alignment);
    builder.buckets(&bucketed, settings.reduce_bucket_size.max(1), placement);
    for unit in units {
        builder.group(unit.clone().collect(), Placement::Sharded);
    }
    builder.finish()
}

/// Rank 0's values of every parameter, on every rank (one broadcast per group), except the
/// groups marked in `own` (by group), which keep this rank's values.
pub(crate) fn broadcast_values(
    mut values: Vec<Vec<f32>>,
    layout: &PartitionLayout,
    comm: &dyn ProcessGroup,
    own: &[bool],
) -> Result<Vec<Vec<f32>>, ZeroError> {
    if comm.world_size() == 1 {
        return Ok(values);
    }
    for (g, _) in layout.groups.iter().zip(own).filter(|(_, &own)| !own) {
        let mut flat = Vec::with_capacity(g.numel);
        for &p in &g.params {
            flat.extend_from_slice(&values[p]);
        }
        let mut buf = FlatBuffer::F32(flat);
        comm.broadcast(&mut buf, 0)?;
        let flat = buf.into_f32();
        for (&p, &offset) in g.params.iter().zip(&g.offsets) {
            let n = values[p].len();
            values[p].copy_from_slice(&flat[offset..offset + n]);
        }
    }
    Ok(values)
}

/// What checkpointing needs of the engine (`crate::checkpoint`).
impl<B: AutodiffBackend, M: AutodiffModule<B>> ZeroEngine<B, M> {
    /// The shared state, to save.
    pub(crate) fn core_ref(&self) -> &EngineCore {
        &self.core
    }

    /// The shared state, to restore.
    pub(crate) fn core_mut(&mut self) -> &mut EngineCore {
        &mut self.core
    }

    /// Writes the owned masters, gathered, into the replica (after they were replaced by a load).
    pub(crate) fn refresh_replica(&mut self) -> Result<(), ZeroError> {
        let model = self.model.take().unwrap_or_else(|| unreachable!());
        let mut source = self.core.value_source();
        let model = write_data(model, &self.device, true, |i, _| source.take_data(i));
        self.model = Some(model);
        source.finish()
    }
}
