//! [`ZeroOptimizer`]: ZeRO behind Burn's `Optimizer` trait, for code written against Burn's
//! optimizers (a custom loop, burn-train's `Learner`).
//!
//! Each rank runs its own forward and backward on its replica, as with any Burn optimizer, and
//! hands the gradients to `step`. There they are averaged over the ranks (all-reduce at stage 0,
//! reduce-scatter at stages 1 and 2), the rank's fp32 shard is updated, and the new weights are
//! gathered back into the module. The learning rate is the one Burn's loop passes; gradient
//! accumulation is the loop's (Burn's `GradientsAccumulator`): every `step` is a boundary.
//!
//! A model may hold [`crate::sharded::ZeroModule`]s: each unit is then one sharded group whose
//! gradient arrives already reduced (the unit's backward reduce-scattered it) and whose owned
//! slice is the rank's shard; the step updates the shard's masters and writes the shard back,
//! never the whole unit. The other parameters go the stage's way.

mod adopt;
mod device;
mod files;
mod host;
mod lr;
mod record;
mod state;
mod view;

use crate::core::StepReport;
use crate::device::{DeviceCollective, HostStaged};
use crate::error::ZeroError;
use crate::half_buffer;
use crate::layout::broadcast_values;
use crate::memory::{MemoryReport, MemoryTracker};
use crate::params::rewrite_data_some;
use crate::settings::{ComputeDtype, EngineSettings, OptimizerOffload, Stage};
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
pub use lr::ZeroLr;
pub use record::ZeroOptimizerRecord;
use state::State;
use std::any::Any;
use std::sync::{Arc, Mutex};
use view::{collect_grads, first_device, FlatGrad, Holding, ModuleView};
use zero_core::checkpoint::TensorSplit;
use zero_core::comm::ProcessGroup;
use zero_core::loss_scaler::LossScaler;

/// ZeRO as a `burn::optim::Optimizer`: stages 0-2 for any model; stage 3 for the units of a
/// model holding [`crate::sharded::ZeroModule`]s cut by [`crate::initialize`] (other parameters
/// as at stage 2).
///
/// The fp32 master shard and the optimizer state live on the model's device (tensors of its
/// backend; the gradients are reduced there through the [`DeviceCollective`] that
/// [`crate::initialize_on`] was given), unless the config offloads the optimizer
/// (`offload_optimizer`: host memory and the fused CPU step, or NVMe). On the CPU backend too
/// the state is tensors (of the CPU backend): the code a GPU runs. Every optimizer (Adam,
/// AdamW, SGD, Lion, LAMB) has its device form.
///
/// Burn's `Optimizer::step` cannot return an error, so a failed collective (a dead or diverging
/// peer) panics with the error's message, on every surviving rank; [`ZeroOptimizer::try_step`]
/// returns it instead. Clones share one state: the optimizer is one per rank.
///
/// Its Burn record ([`ZeroOptimizerRecord`]) is the rank's part of the sharded checkpoint: each
/// rank saves its own with a Burn recorder and loads it back, at any stage over the same ranks
/// (`load_record` takes effect at the next step). [`ZeroOptimizer::save_checkpoint`] /
/// [`ZeroOptimizer::load_checkpoint`] write and read the sharded format's directory, loadable at
/// another world size too.
#[derive(Clone)]
pub struct ZeroOptimizer {
    settings: EngineSettings,
    comm: Arc<dyn ProcessGroup>,
    /// The device collective the state reduces through: an `Arc<dyn DeviceCollective<I>>` for
    /// the model's inner backend `I` (none: [`HostStaged`] over `comm`).
    collective: Option<Arc<dyn Any + Send + Sync>>,
    /// Without optimizer offload, the state as tensors ([`ZeroOptimizer::with_tensor_state`]).
    tensors: bool,
    state: Arc<Mutex<Option<State>>>,
    /// A record taken in by `load_record`, applied at the next step.
    pending: Arc<Mutex<Option<ZeroOptimizerRecord>>>,
    last: Arc<Mutex<Option<StepReport>>>,
    /// A micro-batch since the last step had a non-finite loss ([`ZeroOptimizer::note_loss`]).
    loss_non_finite: Arc<std::sync::atomic::AtomicBool>,
    /// The model's backend keeps every gathered unit until backward (autodiff without a
    /// checkpointing strategy), as [`crate::initialize`] found it: for the memory report.
    keeps_gathered: Arc<std::sync::atomic::AtomicBool>,
    /// [`ZeroOptimizer::scale_loss`] scaled a loss since the last step (fp16).
    scaled: Arc<std::sync::atomic::AtomicBool>,
    /// Under tensor parallelism, which parameters (by their names in the layout) each tensor
    /// rank holds a different slice of, and how ([`ZeroOptimizer::with_tensor_parallel`]).
    tensor_split: Option<Arc<SplitRule>>,
}

/// How the parameter of this name is split over the tensor-parallel group (`None`: each tensor
/// rank holds it whole).
pub(crate) type SplitRule = dyn Fn(&str) -> Option<TensorSplit> + Send + Sync;

/// What a checkpoint of this tensor rank records: the rank, and how each of `layout`'s
/// parameters that `split` names is cut. Both states build it the same way.
pub(crate) fn tensor_record(
    layout: &zero_core::partition::PartitionLayout,
    tensor: &zero_core::comm::SharedGroup,
    split: &SplitRule,
) -> zero_core::checkpoint::TensorParallelRecord {
    zero_core::checkpoint::TensorParallelRecord {
        rank: tensor.rank(),
        size: tensor.world_size(),
        splits: layout
            .params
            .iter()
            .filter_map(|p| Some((p.name.clone(), split(&p.name)?)))
            .collect(),
    }
}

impl ZeroOptimizer {
    /// A ZeRO optimizer over `comm` (the stage from `settings`; [`crate::initialize`] builds it
    /// from a config). The state is built at the first step, from the module passed to it.
    /// Every rank must start from the same weights: build the model from one seed, or call
    /// [`ZeroOptimizer::synchronize`] first (`initialize` does).
    pub fn new(settings: EngineSettings, comm: Arc<dyn ProcessGroup>) -> Result<Self, ZeroError> {
        Ok(ZeroOptimizer {
            settings,
            comm,
            collective: None,
            tensors: true,
            state: Arc::new(Mutex::new(None)),
            pending: Arc::new(Mutex::new(None)),
            last: Arc::new(Mutex::new(None)),
            loss_non_finite: Default::default(),
            keeps_gathered: Default::default(),
            scaled: Default::default(),
            tensor_split: None,
        })
    }

    /// The optimizer of a model split Megatron-style over `tensor` (each of its ranks holds a
    /// slice of the parameters `split` names, by their names in the layout, cut as it says, and a
    /// copy of the others), ZeRO running over this optimizer's data-parallel group: the global
    /// gradient norm, and so clipping, covers the whole model (a split parameter's slices from
    /// every tensor rank, a replicated one once), and an overflow on any rank skips the step on
    /// every rank. The state stays where it would be without tensor parallelism (on the device
    /// unless offloaded). Every rank of the tensor group trains the same batch (as the model's
    /// collectives require). Each
    /// tensor rank's checkpoint and weights files go under a `tensor_rank_{t}` directory; the
    /// checkpoint records the split, so `zero to-fp32` merges the ranks into the whole model.
    pub fn with_tensor_parallel(
        mut self,
        tensor: zero_core::comm::SharedGroup,
        split: impl Fn(&str) -> Option<TensorSplit> + Send + Sync + 'static,
    ) -> Self {
        self.settings.tensor_parallel_group = Some(tensor);
        self.tensor_split = Some(Arc::new(split));
        self
    }

    /// The optimizer reducing its device state through `collective` (on CUDA, `NcclDevice`
    /// over the same ranks as the process group) instead of [`HostStaged`] over the process
    /// group. `I` must be the model's inner backend (`B::InnerBackend`).
    pub fn with_collective<I: Backend>(mut self, collective: Arc<dyn DeviceCollective<I>>) -> Self {
        self.collective = Some(Arc::new(collective));
        self
    }

    /// Where the state lives when the optimizer is not offloaded: as tensors on the model's
    /// device (`true`, the default), or in host buffers stepped by the fused multi-threaded CPU
    /// kernel (`false`, as `offload_optimizer: cpu` does). On the CPU backend the two are the
    /// same memory and about the same speed (BENCHMARKS.md, "The optimizer's state as tensors
    /// on the CPU").
    pub fn with_tensor_state(mut self, tensors: bool) -> Self {
        self.tensors = tensors;
        self
    }

    /// Whether the state is tensors on the device: no optimizer offload, and tensors chosen
    /// ([`ZeroOptimizer::with_tensor_state`]).
    fn on_device(&self) -> bool {
        self.tensors && self.settings.offload_optimizer == OptimizerOffload::None
    }

    /// The rule of which parameters are split over the tensor-parallel group.
    fn split_rule(&self) -> Result<&SplitRule, ZeroError> {
        self.tensor_split.as_deref().ok_or_else(|| {
            ZeroError::Usage(
                "ZeroOptimizer: a tensor-parallel group without the rule of which parameters are split; use \
                 ZeroOptimizer::with_tensor_parallel"
                    .into(),
            )
        })
    }

    /// Rank 0's weights, on every rank, in the compute dtype (bf16 parameters under bf16). A
    /// sharded `ZeroModule` keeps its own shard (the ranks' shards are different parts of one
    /// unit, cut from one model).
    pub fn synchronize<B: AutodiffBackend, M: AutodiffModule<B>>(&self, module: M) -> Result<M, ZeroError> {
        let view = ModuleView::of::<B, M>(&module, &self.settings, self.comm.world_size(), None);
        let mut own = vec![false; view.layout.groups.len()];
        for group in view.unit_groups() {
            own[group] = true;
        }
        let (values, mut shards) = view.read::<B, M>(&module)?;
        let values = broadcast_values(values, &view.layout, self.comm.as_ref(), &own)?;
        let device = first_device::<B, M>(&module)?;
        let dtype = self.settings.precision.dtype;
        Ok(rewrite_data_some(module, &device, |i, shape| match &view.held[i] {
            Holding::Param(p) => Some(half_buffer::f32_to_data(values[*p].clone(), shape, dtype)),
            Holding::Whole(params) => Some(half_buffer::f32_to_data(values[params.clone()].concat(), shape, dtype)),
            Holding::Shard { .. } => Some(half_buffer::f32_to_data(
                shards.remove(&i).unwrap_or_default(),
                shape,
                dtype,
            )),
            // A `ZeroModule` skeleton's parameter: kept as it is.
            Holding::Nothing => None,
        }))
    }

    /// The config's learning-rate schedule (its optimizer's constant rate when it has no
    /// `scheduler`) as a Burn `LrScheduler`. Its position is this optimizer's count of applied
    /// steps, so it holds still over a skipped fp16 step (as DeepSpeed's scheduler does) and
    /// resumes where a loaded checkpoint left off.
    pub fn lr_scheduler(&self) -> ZeroLr {
        let settings = self.settings.clone();
        ZeroLr {
            schedule: Arc::new(move |step| settings.lr_at(step)),
            optimizer: self.clone(),
        }
    }

    /// The loss to call `backward()` on: under fp16, `loss` in fp32 times the dynamic loss scale
    /// (the step unscales the gradients, and a step whose gradients overflowed on any rank is
    /// skipped on every rank, the scale backed off); `loss` itself under bf16 and fp32.
    pub fn scale_loss<B: Backend>(&self, loss: Tensor<B, 1>) -> Tensor<B, 1> {
        if self.settings.precision.dtype != ComputeDtype::F16 {
            return loss;
        }
        self.scaled.store(true, std::sync::atomic::Ordering::Relaxed);
        loss.cast(burn::tensor::DType::F32).mul_scalar(self.loss_scale())
    }

    /// The factor a backward that scales the loss itself must apply
    /// ([`checkpointed_grads`](crate::checkpointed_grads)' `loss_scale`): fp16's loss scale, 1
    /// otherwise. As after [`ZeroOptimizer::scale_loss`], the next step divides the gradients
    /// by it.
    pub fn scale_for_backward(&self) -> f64 {
        if self.settings.precision.dtype == ComputeDtype::F16 {
            self.scaled.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.loss_scale()
    }

    /// Tells the next step one micro-batch's loss value (a loop that reads it anyway, to print
    /// it): a non-finite step is then reported as the loss's, the first thing that went wrong,
    /// rather than its gradient's.
    pub fn note_loss(&self, value: f64) {
        if !value.is_finite() {
            self.loss_non_finite.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The loss scale of the next backward: fp16's dynamic scale, 1 otherwise.
    pub fn loss_scale(&self) -> f64 {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match (state.as_ref(), &self.settings.precision.loss_scaler) {
            (Some(State::Host(core)), _) => core.current_loss_scale(),
            (Some(State::Device(state)), _) => state.loss_scale(),
            (None, Some(config)) if self.settings.precision.dtype == ComputeDtype::F16 => {
                LossScaler::new(config.clone()).map_or(1.0, |s| s.scale())
            }
            (None, _) => 1.0,
        }
    }

    /// [`Optimizer::step`] returning the error of a failed step (a dead or diverging peer, a
    /// non-finite fp32 step) instead of panicking with it: for a loop that reports errors.
    pub fn try_step<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<M, ZeroError> {
        let mut by_id = collect_grads::<B, M>(&module, &mut grads);
        if by_id.is_empty() {
            return Err(no_gradients());
        }
        self.step_with::<B, M>(lr, module, |id| by_id.remove(&id))
    }

    /// `module` with the values of a delayed update still owed to it
    /// (`offload_optimizer.delayed_update`: each step returns the model with the previous
    /// step's update and leaves its own running beside the next forward and backward). Call it
    /// after the last step, before using or saving the model itself; it waits for the update.
    /// Without delayed updates it returns `module` as it is. The optimizer's own saves
    /// (checkpoints, weights files, its record) wait for the update themselves.
    pub fn flush<B: AutodiffBackend, M: AutodiffModule<B>>(&self, module: M) -> Result<M, ZeroError> {
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(State::Host(core)) = guard.as_mut() else {
            return Ok(module);
        };
        let view = ModuleView::of::<B, M>(
            &module,
            &self.settings,
            self.comm.world_size(),
            Some(&core.state.layout),
        );
        let module = host::settle_into::<B, M>(core, &view, module)?;
        drop(guard);
        crate::sharded::after_step::<B, M>(module)
    }

    /// Optimizer steps taken (skipped fp16 steps included), as a loaded checkpoint left them.
    pub fn global_step(&self) -> u64 {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.as_ref().map_or(0, State::global_step)
    }

    /// What the last step did (its gradient norm, learning rate).
    pub fn last_step(&self) -> Option<StepReport> {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the fp32 masters and the optimizer state are tensors on the model's device
    /// (`false`: host buffers); built at the first step, `None` before it.
    pub fn tensor_state(&self) -> Option<bool> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.as_ref().map(|s| matches!(s, State::Device(_)))
    }

    /// Records that the model's backend keeps every gathered unit until backward (autodiff
    /// without a checkpointing strategy; [`crate::initialize`] tells it), so that the memory
    /// report counts every unit gathered rather than the largest.
    pub(crate) fn set_keeps_gathered(&self, keeps: bool) {
        self.keeps_gathered.store(keeps, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes held by this rank, by kind (zero before the first step). `gathered` is counted
    /// from the layout: the largest sharded unit whole, with prefetching (`overlap_comm`) the
    /// most a unit and the gathers in flight beside it can take (every sharded unit when the
    /// backend keeps them until backward).
    pub fn memory(&self) -> MemoryReport {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.as_ref() {
            Some(State::Host(core)) => core.memory.report(),
            Some(State::Device(state)) => state.memory(),
            None => MemoryReport::default(),
        }
    }

    /// Builds the state from `module` if this is its first use; returns the optimizer's view
    /// of `module`. `saved`: the layout of a state about to be loaded (a checkpoint's, a
    /// record's), whose groups a new state takes when it holds the same parameters over as many
    /// ranks at this stage: each group's step count then comes back as it was, where a part
    /// frozen or unfrozen since the first step would otherwise share a group with others.
    fn ensure_state<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        guard: &mut Option<State>,
        module: &M,
        saved: Option<(&zero_core::partition::PartitionLayout, u8)>,
    ) -> Result<ModuleView, ZeroError> {
        let world = self.comm.world_size();
        let stage = self.settings.stage.number();
        let saved = saved
            .filter(|(layout, saved_stage)| layout.world_size == world && *saved_stage == stage)
            .map(|(layout, _)| layout);
        let built = guard.as_ref().map(State::layout).or(saved);
        let view = ModuleView::of::<B, M>(module, &self.settings, world, built);
        if guard.is_some() {
            return Ok(view);
        }
        if self.settings.stage == Stage::Zero3 && !view.has_units() {
            return Err(no_units_at_stage_3());
        }
        view.check_offloaded(&self.settings)?;
        if self.settings.delayed_update && self.on_device() {
            return Err(ZeroError::Config(
                "zero_optimization.offload_optimizer.delayed_update delays the host's optimizer step, and this \
                 optimizer's state is on the model's device: offload it (offload_optimizer.device \"cpu\" or \
                 \"nvme\") or turn delayed_update off"
                    .into(),
            ));
        }
        let memory = Arc::new(MemoryTracker::default());
        view.account(
            &memory,
            &self.settings,
            world,
            self.keeps_gathered.load(std::sync::atomic::Ordering::Relaxed),
            !self.on_device(),
        );
        let built = view.clone();
        *guard = Some(if self.on_device() {
            let collective: Arc<dyn DeviceCollective<B::InnerBackend>> = match &self.collective {
                None => Arc::new(HostStaged::new(self.comm.clone())),
                Some(c) => c
                    .downcast_ref::<Arc<dyn DeviceCollective<B::InnerBackend>>>()
                    .cloned()
                    .ok_or_else(|| {
                        ZeroError::Usage(
                            "ZeroOptimizer::with_collective: the collective is for another backend than the model's \
                             (it must move tensors of the model's inner backend)"
                                .into(),
                        )
                    })?,
            };
            let mut state =
                device::build::<B, M>(module, built, &self.settings, collective, self.comm.clone(), memory)?;
            if let Some(tensor) = &self.settings.tensor_parallel_group {
                state.split_over_tensor_ranks(tensor.clone(), self.split_rule()?);
            }
            State::Device(Box::new(state))
        } else {
            let mut core = host::build::<B, M>(module, built, &self.settings, self.comm.clone(), memory)?;
            if let Some(tensor) = &self.settings.tensor_parallel_group {
                host::split_over_tensor_ranks(&mut core, &self.comm, tensor, self.split_rule()?);
            }
            State::Host(Box::new(core))
        });
        Ok(view)
    }

    fn step_with<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        lr: f64,
        module: M,
        take: impl FnMut(burn::module::ParamId) -> Option<FlatGrad<B>>,
    ) -> Result<M, ZeroError> {
        // A collective that failed inside this rank's backward (a dead peer, ranks pairing
        // different units) left zeros there: its error, not a step on them.
        if let Some(e) = crate::sharded::take_backward_error() {
            return Err(e);
        }
        // fp16 unscales the gradients by the loss scale: gradients of a loss that was never
        // scaled would be taken 2^16 times too small, silently.
        let scaled = self.scaled.swap(false, std::sync::atomic::Ordering::Relaxed);
        if self.settings.precision.dtype == ComputeDtype::F16 && !scaled {
            return Err(ZeroError::Usage(
                "fp16: the step's gradients come from a loss that ZeroOptimizer::scale_loss did not scale; call \
                 `optim.scale_loss(loss).backward()` (a step divides the gradients by the loss scale), or give \
                 `optim.scale_for_backward()` to a backward that scales the loss itself (checkpointed_grads), or \
                 train in bf16, which needs no scale"
                    .into(),
            ));
        }
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let built = guard.is_none();
        // A record waiting to be loaded: its groups, where they fit.
        let pending = match (built, self.pending.lock().unwrap_or_else(|e| e.into_inner()).as_ref()) {
            (true, Some(record)) => record.meta()?,
            _ => None,
        };
        let saved = pending.as_ref().map(|m| (&m.layout, m.stage));
        let view = self.ensure_state::<B, M>(&mut guard, &module, saved)?;
        // A delayed update still running (the last step's) ends before the state is touched.
        guard.as_mut().unwrap_or_else(|| unreachable!("just built")).settle()?;
        self.apply_pending(guard.as_mut().unwrap_or_else(|| unreachable!("just built")))?;
        // Units changed by `ZeroModule::modify` since the last step: their values are the
        // masters now (a state built from the module this step has them already).
        let modified = crate::sharded::take_modified::<B, M>(&module);
        if !built && !modified.is_empty() {
            let state = guard.as_mut().unwrap_or_else(|| unreachable!("built before"));
            adopt::adopt::<B, M>(state, &view, &module, &modified)?;
        }
        let loss_non_finite = self.loss_non_finite.swap(false, std::sync::atomic::Ordering::Relaxed);
        // Parameters that do not train keep the module's values through the update.
        let frozen = view::not_trained::<B, M>(&module, &view);
        let (module, report) = match guard.as_mut().unwrap_or_else(|| unreachable!("just built")) {
            State::Host(core) => host::step::<B, M>(core, &view, lr, module, loss_non_finite, take, &frozen)?,
            state @ State::Device(_) => {
                let state = state.device::<B::InnerBackend>()?;
                device::step::<B, M>(state, &view, lr, module, loss_non_finite, take, &frozen)?
            }
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
        // The units' new shards: gathered now at stage 2, what the next forward's prefetches
        // gather at stage 3.
        crate::sharded::after_step::<B, M>(module)
    }
}

/// A step whose gradients hold none of the module's parameters: refused, where an update would
/// still move every parameter (weight decay, momentum).
fn no_gradients() -> ZeroError {
    ZeroError::Usage(
        "the step's gradients hold none of the model's parameters: they come from another model (another instance, \
         or the model before initialize or the last step returned a new one), or every parameter is frozen"
            .into(),
    )
}

/// Stage 3 over a model without `ZeroModule`s: nothing to partition.
pub(crate) fn no_units_at_stage_3() -> ZeroError {
    ZeroError::Config(
        "zero_optimization.stage 3 partitions the parameters of ZeroModules, and this model holds none: wrap its \
         blocks in zero_burn::sharded::ZeroModule, or choose stage 2"
            .into(),
    )
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Optimizer<M, B> for ZeroOptimizer {
    type Record = ZeroOptimizerRecord;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self.try_step::<B, M>(lr, module, grads) {
            Ok(m) => m,
            Err(e) => panic!("ZeRO optimizer step failed: {e}"),
        }
    }

    fn step_multi(&mut self, lr: f64, module: M, mut grads: MultiGradientsParams) -> M {
        // Gradients from several devices of this rank: summed per parameter on the module's
        // device first.
        let device = first_device::<B, M>(&module).ok();
        let mut summed: std::collections::HashMap<burn::module::ParamId, FlatGrad<B>> = Default::default();
        for (g, _) in grads.grads.iter_mut() {
            for (id, v) in collect_grads::<B, M>(&module, g) {
                let v = match &device {
                    Some(d) => v.to_device(d),
                    None => v,
                };
                let v = match summed.remove(&id) {
                    Some(acc) => acc + v,
                    None => v,
                };
                summed.insert(id, v);
            }
        }
        if summed.is_empty() {
            panic!("ZeRO optimizer step failed: {}", no_gradients());
        }
        match self.step_with::<B, M>(lr, module, |id| summed.remove(&id)) {
            Ok(m) => m,
            Err(e) => panic!("ZeRO optimizer step failed: {e}"),
        }
    }

    fn to_record(&self) -> Self::Record {
        ZeroOptimizer::to_record(self)
    }

    /// Takes effect at the next step, on every rank together ([`ZeroOptimizer::load_record`]).
    fn load_record(self, record: Self::Record) -> Self {
        ZeroOptimizer::load_record(self, record)
    }
}
