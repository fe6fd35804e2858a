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

use crate::core::{EngineCore, StepReport};
use crate::engine::{broadcast_values, stage_layout};
use crate::error::ZeroError;
use crate::flat_state::GradFlow;
use crate::half_buffer;
use crate::memory::{MemoryReport, MemoryTracker};
use crate::params::write_data;
use crate::settings::{ComputeDtype, EngineSettings, LrFn, ParamOffload, Stage};
use crate::sharded::{held_params, HeldParam, UNIT_ALIGNMENT};
use burn::module::ParamId;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn::tensor::TensorData;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use zero_core::comm::{FlatBuffer, ProcessGroup};
use zero_core::loss_scaler::LossScaler;
use zero_core::partition::PartitionLayout;

/// ZeRO as a `burn::optim::Optimizer`: stages 0-2 for any model; stage 3 for the units of a
/// model holding [`crate::sharded::ZeroModule`]s cut by [`crate::initialize`] (other parameters
/// as at stage 2).
///
/// Burn's `Optimizer::step` cannot return an error, so a failed collective (a dead or diverging
/// peer) panics with the error's message, on every surviving rank; use [`crate::ZeroEngine`] for
/// a `Result`-returning loop. Clones share one state: the optimizer is one per rank.
///
/// Its Burn record is empty: Burn's own checkpointing of the optimizer (`to_record`) does not
/// carry the sharded Adam state. Resumable training goes through
/// [`ZeroOptimizer::save_checkpoint`] / [`ZeroOptimizer::load_checkpoint`] (the engines' sharded
/// format, loadable by them and at another world size).
#[derive(Clone)]
pub struct ZeroOptimizer {
    settings: EngineSettings,
    comm: Arc<dyn ProcessGroup>,
    core: Arc<Mutex<Option<EngineCore>>>,
    last: Arc<Mutex<Option<StepReport>>>,
    /// A micro-batch since the last step had a non-finite loss ([`ZeroOptimizer::note_loss`]).
    loss_non_finite: Arc<std::sync::atomic::AtomicBool>,
    /// The model's backend keeps every gathered unit until backward (autodiff without a
    /// checkpointing strategy), as [`crate::initialize`] found it: for the memory report.
    keeps_gathered: Arc<std::sync::atomic::AtomicBool>,
    /// [`ZeroOptimizer::scale_loss`] scaled a loss since the last step (fp16).
    scaled: Arc<std::sync::atomic::AtomicBool>,
}

impl ZeroOptimizer {
    /// A ZeRO optimizer over `comm` (the stage from `settings`; [`crate::initialize`] builds it
    /// from a config). The flat state is built at the first step, from the module passed to it.
    /// Every rank must start from the same weights: build the model from one seed, or call
    /// [`ZeroOptimizer::synchronize`] first (`initialize` does).
    pub fn new(settings: EngineSettings, comm: Arc<dyn ProcessGroup>) -> Result<Self, ZeroError> {
        if settings.offload_param != ParamOffload::None {
            return Err(ZeroError::Config(
                "zero_optimization.offload_param: ZeroOptimizer keeps the parameter shards on the model's device \
                 (on the CPU backend, host memory: offload_param cpu is accepted there by initialize); remove \
                 offload_param (offload_optimizer is available)"
                    .into(),
            ));
        }
        Ok(ZeroOptimizer {
            settings,
            comm,
            core: Arc::new(Mutex::new(None)),
            last: Arc::new(Mutex::new(None)),
            loss_non_finite: Default::default(),
            keeps_gathered: Default::default(),
            scaled: Default::default(),
        })
    }

    /// Rank 0's weights, on every rank, in the compute dtype (bf16 parameters under bf16). A
    /// sharded `ZeroModule` keeps its own shard (the ranks' shards are different parts of one
    /// unit, cut from one model).
    pub fn synchronize<B: AutodiffBackend, M: AutodiffModule<B>>(&self, module: M) -> Result<M, ZeroError> {
        let view = ModuleView::of::<B, M>(&module, &self.settings, self.comm.world_size());
        let mut own = vec![false; view.layout.groups.len()];
        for held in &view.held {
            if let Holding::Shard { group, .. } = held {
                own[*group] = true;
            }
        }
        let (values, mut shards) = view.read::<B, M>(&module);
        let values = broadcast_values(values, &view.layout, self.comm.as_ref(), &own)?;
        let device = first_device::<B, M>(&module)?;
        let dtype = self.settings.precision.dtype;
        Ok(write_data(module, &device, true, |i, shape| match &view.held[i] {
            Holding::Param(p) => half_buffer::f32_to_data(values[*p].clone(), shape, dtype),
            Holding::Whole(params) => half_buffer::f32_to_data(values[params.clone()].concat(), shape, dtype),
            Holding::Shard { .. } => half_buffer::f32_to_data(shards.remove(&i).unwrap_or_default(), shape, dtype),
            Holding::Nothing => TensorData::new(Vec::<f32>::new(), shape),
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
            core: self.core.clone(),
        }
    }

    /// The loss to call `backward()` on: under fp16, `loss` in fp32 times the dynamic loss scale
    /// (the step unscales the gradients, and a step whose gradients overflowed on any rank is
    /// skipped on every rank, the scale backed off); `loss` itself under bf16 and fp32.
    pub fn scale_loss<B: burn::tensor::backend::Backend>(&self, loss: Tensor<B, 1>) -> Tensor<B, 1> {
        if self.settings.precision.dtype != ComputeDtype::F16 {
            return loss;
        }
        self.scaled.store(true, std::sync::atomic::Ordering::Relaxed);
        loss.cast(burn::tensor::DType::F32).mul_scalar(self.loss_scale())
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
        let core = self.core.lock().unwrap_or_else(|e| e.into_inner());
        match (core.as_ref(), &self.settings.precision.loss_scaler) {
            (Some(core), _) => core.current_loss_scale(),
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
        self.step_with::<B, M>(lr, module, |id| by_id.remove(&id))
    }

    /// Optimizer steps taken (skipped fp16 steps included), as a loaded checkpoint left them.
    pub fn global_step(&self) -> u64 {
        let core = self.core.lock().unwrap_or_else(|e| e.into_inner());
        core.as_ref().map_or(0, |c| c.global_step)
    }

    /// What the last step did (its gradient norm, learning rate).
    pub fn last_step(&self) -> Option<StepReport> {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that the model's backend keeps every gathered unit until backward (autodiff
    /// without a checkpointing strategy; [`crate::initialize`] tells it), so that the memory
    /// report counts every unit gathered rather than the largest.
    pub(crate) fn set_keeps_gathered(&self, keeps: bool) {
        self.keeps_gathered.store(keeps, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes held by this rank, by kind (zero before the first step). `gathered` is counted
    /// from the layout: the largest sharded unit whole (every sharded unit when the backend
    /// keeps them until backward).
    pub fn memory(&self) -> MemoryReport {
        let core = self.core.lock().unwrap_or_else(|e| e.into_inner());
        core.as_ref().map(|c| c.memory.report()).unwrap_or_default()
    }

    /// Saves the optimizer's state (every rank's fp32 master shard and optimizer buffers, the
    /// step count) under `dir/tag` (tag None: `global_step{N}`), in the engines' sharded format;
    /// every rank calls this after a step. The module's weights are the masters rounded, so this
    /// is the whole training state. Returns the tag directory.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
    ) -> Result<std::path::PathBuf, ZeroError> {
        let guard = self.core.lock().unwrap_or_else(|e| e.into_inner());
        let core = guard.as_ref().ok_or_else(|| {
            ZeroError::Usage(
                "ZeroOptimizer::save_checkpoint before the first step: the state is built at the first step".into(),
            )
        })?;
        core.save_checkpoint(dir.as_ref(), tag, client_state)
    }

    /// Restores the state saved by [`ZeroOptimizer::save_checkpoint`] (or by an engine, at any
    /// world size and stage 0-2) for `module`, and returns the module with the restored weights
    /// and the client state. Every file is verified before anything changes.
    pub fn load_checkpoint<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        module: M,
    ) -> Result<(M, serde_json::Value), ZeroError> {
        let device = first_device::<B, M>(&module)?;
        let mut guard = self.core.lock().unwrap_or_else(|e| e.into_inner());
        self.ensure_core::<B, M>(&mut guard, &module)?;
        let core = guard.as_mut().unwrap_or_else(|| unreachable!("just built"));
        let client = core.load_checkpoint(dir.as_ref(), tag)?;
        let view = ModuleView::of::<B, M>(&module, &self.settings, self.comm.world_size());
        Ok((write_back::<B, M>(core, module, &device, &view.held)?, client))
    }

    /// Builds the flat state from `module` if this is its first use.
    fn ensure_core<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        guard: &mut Option<EngineCore>,
        module: &M,
    ) -> Result<(), ZeroError> {
        if guard.is_none() {
            let world = self.comm.world_size();
            let view = ModuleView::of::<B, M>(module, &self.settings, world);
            let units = view
                .held
                .iter()
                .any(|h| matches!(h, Holding::Whole(_) | Holding::Shard { .. }));
            if self.settings.stage == Stage::Zero3 && !units {
                return Err(no_units_at_stage_3());
            }
            let (mut values, mut shards) = view.read::<B, M>(module);
            let ModuleView { layout, held, .. } = view;
            // A unit's whole parameters, from every rank's shard (each in turn, at the first
            // step only).
            let mut unit_groups = Vec::new();
            for (i, held) in held.iter().enumerate() {
                let Holding::Shard { params, group } = held else {
                    continue;
                };
                let shard = shards.remove(&i).unwrap_or_default();
                if shard.len() != layout.owned_len(*group) {
                    return Err(ZeroError::Model(format!(
                        "the ZeroModule shard holding `{}` has {} elements where {world} ranks own {} each: it was \
                         sharded for another number of ranks",
                        layout.params[params.start].name,
                        shard.len(),
                        layout.owned_len(*group)
                    )));
                }
                let shard = FlatBuffer::F32(shard);
                let whole = if world > 1 {
                    self.comm.all_gather(shard)?.into_f32()
                } else {
                    shard.into_f32()
                };
                split_into(&mut values, &layout, params.clone(), &whole);
                unit_groups.push(*group);
            }
            let dtype = self.settings.precision.dtype;
            for v in &mut values {
                half_buffer::round_to(dtype, v);
            }
            let memory = Arc::new(MemoryTracker::default());
            // What the module holds: replicated parameters whole, each unit's shard.
            let held: usize = (0..layout.groups.len())
                .map(|g| {
                    if unit_groups.contains(&g) {
                        layout.owned_len(g)
                    } else {
                        layout.groups[g].numel
                    }
                })
                .sum();
            memory.add_parameters(held * dtype.size());
            // The units' gathers are the autodiff graph's, out of sight: counted from the
            // layout, as the ZeRO formulas do. Under a checkpointing strategy a unit is freed
            // after its use (one whole at a time); without, every unit stays until backward.
            let units = unit_groups.iter().map(|&g| layout.groups[g].padded * dtype.size());
            let gathered = if self.keeps_gathered.load(std::sync::atomic::Ordering::Relaxed) {
                units.sum()
            } else {
                units.max().unwrap_or(0)
            };
            memory.add_gathered(gathered);
            let flow = if matches!(self.settings.stage, Stage::Zero2 | Stage::Zero3) {
                GradFlow::ReduceThenAccumulate
            } else {
                GradFlow::AccumulateThenReduce
            };
            let mut settings = self.settings.clone();
            settings.gradient_accumulation_steps = 1;
            *guard = Some(EngineCore::new(
                layout,
                self.comm.clone(),
                settings,
                // A unit's gradient arrives reduced (its backward reduce-scattered it).
                |g| {
                    if unit_groups.contains(&g) {
                        GradFlow::ReduceThenAccumulate
                    } else {
                        flow
                    }
                },
                |i| std::mem::take(&mut values[i]),
                memory,
            )?);
        }
        Ok(())
    }

    fn step_with<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        lr: f64,
        module: M,
        mut take: impl FnMut(burn::module::ParamId) -> Option<Vec<f32>>,
    ) -> Result<M, ZeroError> {
        let device = first_device::<B, M>(&module)?;
        // fp16 unscales the gradients by the loss scale: gradients of a loss that was never
        // scaled would be taken 2^16 times too small, silently.
        let scaled = self.scaled.swap(false, std::sync::atomic::Ordering::Relaxed);
        if self.settings.precision.dtype == ComputeDtype::F16 && !scaled {
            return Err(ZeroError::Usage(
                "fp16: the step's gradients come from a loss that ZeroOptimizer::scale_loss did not scale; call \
                 `optim.scale_loss(loss).backward()` (a step divides the gradients by the loss scale), or train \
                 in bf16, which needs no scale"
                    .into(),
            ));
        }
        let mut guard = self.core.lock().unwrap_or_else(|e| e.into_inner());
        self.ensure_core::<B, M>(&mut guard, &module)?;
        let core = guard.as_mut().unwrap_or_else(|| unreachable!());
        // Burn's loop owns the schedule: use its learning rate for this step.
        let fixed = lr;
        core.settings.lr_schedule = Some(Arc::new(move |_| fixed));
        let view = ModuleView::of::<B, M>(&module, &core.settings, self.comm.world_size());
        for (id, held) in view.ids.iter().zip(&view.held) {
            match held {
                Holding::Param(p) => core.absorb(*p, take(*id))?,
                Holding::Whole(params) => {
                    let grad = take(*id);
                    let mut start = 0;
                    for p in params.clone() {
                        let numel = view.layout.params[p].numel();
                        core.absorb(p, grad.as_ref().map(|g| g[start..start + numel].to_vec()))?;
                        start += numel;
                    }
                }
                // A ZeroModule's shard: its gradient is this rank's slice, already averaged.
                Holding::Shard { group, .. } => {
                    if let Some(grad) = take(*id) {
                        core.absorb_owned(*group, &grad)?;
                    }
                }
                Holding::Nothing => {
                    take(*id);
                }
            }
        }
        core.finish_micro_batch()?;
        if self.loss_non_finite.swap(false, std::sync::atomic::Ordering::Relaxed) {
            core.note_non_finite_loss();
        }
        let report = core.update()?;
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
        write_back::<B, M>(core, module, &device, &view.held)
    }
}

/// A DeepSpeed config's learning-rate schedule as a Burn `LrScheduler`
/// ([`ZeroOptimizer::lr_scheduler`]): `step()` gives the rate of the optimizer's next applied
/// step. Its record is that position, for reading; loading one changes nothing (the position is
/// the optimizer's, restored with its checkpoint).
#[derive(Clone)]
pub struct ZeroLr {
    schedule: LrFn,
    core: Arc<Mutex<Option<EngineCore>>>,
}

impl ZeroLr {
    /// Applied optimizer steps so far.
    fn position(&self) -> u64 {
        let core = self.core.lock().unwrap_or_else(|e| e.into_inner());
        core.as_ref().map_or(0, |c| c.global_step - c.skipped_steps)
    }
}

impl burn::optim::lr_scheduler::LrScheduler for ZeroLr {
    type Record<B: burn::tensor::backend::Backend> = u64;

    fn step(&mut self) -> f64 {
        (self.schedule)(self.position())
    }

    fn to_record<B: burn::tensor::backend::Backend>(&self) -> u64 {
        self.position()
    }

    fn load_record<B: burn::tensor::backend::Backend>(self, _position: u64) -> Self {
        self
    }
}

/// Stage 3 over a model without `ZeroModule`s: nothing to partition.
pub(crate) fn no_units_at_stage_3() -> ZeroError {
    ZeroError::Config(
        "zero_optimization.stage 3 partitions the parameters of ZeroModules, and this model holds none: wrap its \
         blocks in zero_burn::sharded::ZeroModule, or choose stage 2"
            .into(),
    )
}

/// What one float parameter of the module holds, in the optimizer's layout.
#[derive(Clone, Debug)]
enum Holding {
    /// Layout parameter `.0`.
    Param(usize),
    /// A unit kept whole: layout parameters `.0` (contiguous), as one flat vector.
    Whole(Range<usize>),
    /// This rank's shard of a unit whose parameters are `params`: the owned slice of `group`.
    Shard { params: Range<usize>, group: usize },
    /// Nothing (a unit's skeleton).
    Nothing,
}

/// The optimizer's view of a module: the layout of its parameters (a `ZeroModule`'s named
/// one by one, as the unwrapped model's are, so that a checkpoint holds the model's own names
/// at every stage), and by float parameter of the module (visit order) its id and what it
/// holds.
struct ModuleView {
    layout: PartitionLayout,
    ids: Vec<ParamId>,
    held: Vec<Holding>,
}

impl ModuleView {
    /// The view of `module` at `settings`' stage over `world` ranks: [`stage_layout`] with each
    /// sharded unit's parameters one sharded group, cut as the unit cut its shards.
    fn of<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, settings: &EngineSettings, world: usize) -> Self {
        let mut specs = Vec::new();
        let mut ids = Vec::new();
        let mut held = Vec::new();
        let mut sharded = Vec::new();
        for (id, param) in held_params::<B, M>(module) {
            ids.push(id);
            held.push(match param {
                HeldParam::Plain(spec) => {
                    specs.push(spec);
                    Holding::Param(specs.len() - 1)
                }
                HeldParam::Unit { params, sharded: cut } => {
                    let range = specs.len()..specs.len() + params.len();
                    specs.extend(params);
                    if cut {
                        sharded.push(range.clone());
                        Holding::Shard {
                            params: range,
                            group: usize::MAX,
                        }
                    } else {
                        Holding::Whole(range)
                    }
                }
                HeldParam::Skeleton => Holding::Nothing,
            });
        }
        let alignment = if sharded.is_empty() {
            settings.alignment
        } else {
            UNIT_ALIGNMENT
        };
        let layout = stage_layout(specs, &sharded, alignment, settings, world);
        let places = layout.places();
        for h in &mut held {
            if let Holding::Shard { params, group } = h {
                *group = places[params.start].group;
            }
        }
        ModuleView { layout, ids, held }
    }

    /// The values of every layout parameter that `module` holds whole, and by float parameter
    /// of the module, the shards it holds.
    fn read<B: AutodiffBackend, M: AutodiffModule<B>>(&self, module: &M) -> (Vec<Vec<f32>>, HashMap<usize, Vec<f32>>) {
        let mut values = vec![Vec::new(); self.layout.params.len()];
        let mut shards = HashMap::new();
        crate::params::read_values::<B, M>(module, |i, v| match &self.held[i] {
            Holding::Param(p) => values[*p] = v,
            Holding::Whole(params) => split_into(&mut values, &self.layout, params.clone(), &v),
            Holding::Shard { .. } => {
                shards.insert(i, v);
            }
            Holding::Nothing => {}
        });
        (values, shards)
    }
}

/// Cuts a unit's flat vector `flat` into its parameters `params` of `layout` (padding beyond
/// them ignored).
fn split_into(values: &mut [Vec<f32>], layout: &PartitionLayout, params: Range<usize>, flat: &[f32]) {
    let mut start = 0;
    for p in params {
        let numel = layout.params[p].numel();
        values[p] = flat[start.min(flat.len())..(start + numel).min(flat.len())].to_vec();
        start += numel;
    }
}

/// `module` with the state's values: replicated parameters whole (gathered where sharded), a
/// unit kept whole as its flat vector, a unit's shard this rank's slice of it.
fn write_back<B: AutodiffBackend, M: AutodiffModule<B>>(
    core: &EngineCore,
    module: M,
    device: &B::Device,
    held: &[Holding],
) -> Result<M, ZeroError> {
    let mut source = core.value_source();
    let mut error = None;
    let dtype = core.settings.precision.dtype;
    let module = write_data(module, device, true, |i, shape| match &held[i] {
        Holding::Param(p) => source.take_data(*p),
        Holding::Whole(params) => {
            let flat: Vec<f32> = params.clone().flat_map(|p| source.take(p)).collect();
            half_buffer::f32_to_data(flat, shape, dtype)
        }
        Holding::Shard { group, .. } => {
            let len = core.state.layout.owned_len(*group);
            let shard = core.shard_buffer(*group).unwrap_or_else(|e| {
                error.get_or_insert(e);
                half_buffer::zeros(dtype, len)
            });
            half_buffer::slice_data(&shard, 0..len, vec![len])
        }
        Holding::Nothing => TensorData::new(Vec::<f32>::new(), shape),
    });
    source.finish()?;
    match error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

fn first_device<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Result<B::Device, ZeroError> {
    module
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| ZeroError::Model("the model has no parameters (no device found)".into()))
}

/// Takes every float parameter's gradient out of a `GradientsParams`, by id.
fn collect_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
) -> std::collections::HashMap<burn::module::ParamId, Vec<f32>> {
    struct Collect<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        out: std::collections::HashMap<burn::module::ParamId, Vec<f32>>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.out.insert(param.id, crate::params::tensor_to_vec(g));
            }
        }
    }
    let mut c = Collect::<B> {
        grads,
        out: Default::default(),
        _b: std::marker::PhantomData,
    };
    module.visit(&mut c);
    c.out
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Optimizer<M, B> for ZeroOptimizer {
    type Record = ();

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self.try_step::<B, M>(lr, module, grads) {
            Ok(m) => m,
            Err(e) => panic!("ZeRO optimizer step failed: {e}"),
        }
    }

    fn step_multi(&mut self, lr: f64, module: M, mut grads: MultiGradientsParams) -> M {
        // Gradients from several devices of this rank: sum them per parameter first.
        let mut summed: std::collections::HashMap<burn::module::ParamId, Vec<f32>> = Default::default();
        for (g, _) in grads.grads.iter_mut() {
            for (id, v) in collect_grads::<B, M>(&module, g) {
                match summed.get_mut(&id) {
                    Some(acc) => acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b),
                    None => {
                        summed.insert(id, v);
                    }
                }
            }
        }
        match self.step_with::<B, M>(lr, module, |id| summed.remove(&id)) {
            Ok(m) => m,
            Err(e) => panic!("ZeRO optimizer step failed: {e}"),
        }
    }

    fn to_record(&self) -> Self::Record {}

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }
}
