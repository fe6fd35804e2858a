//! The device-resident engine: ZeRO stages 0, 1 and 2 around any Burn module, with gradients,
//! fp32 master shards and Adam state held as tensors on the model's device.

use super::adam::DeviceAdam;
use super::collective::DeviceCollective;
use super::flat::{flatten, read_flat, take_flat_grads, write_flat};
use crate::core::{NonFiniteSeen, Overflow, StepReport};
use crate::error::ZeroError;
use crate::memory::{MemoryReport, MemoryTracker};
use crate::settings::{ComputeDtype, EngineSettings, NonFinitePolicy, OptimizerOffload, ParamOffload, Stage};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor};
use std::sync::Arc;
use zero_core::comm::ReduceOp;
use zero_core::loss_scaler::LossScaler;
use zero_core::partition::{ParamPlace, PartitionLayout, Placement};

/// A flat tensor on the inner (non-autodiff) backend.
type Flat<B> = Tensor<<B as AutodiffBackend>::InnerBackend, 1>;

/// One flat group's share of the state, on the device.
struct GroupState<B: AutodiffBackend> {
    /// fp32 master weights of the owned range.
    master: Flat<B>,
    /// Gradient accumulator in the compute dtype: the whole padded group (stages 0 and 1) or the
    /// owned shard (stage 2); `None` when nothing was accumulated since the last step.
    grad: Option<Flat<B>>,
    /// Adam over `master`.
    optimizer: DeviceAdam<B::InnerBackend>,
}

/// ZeRO stages 0-2 around any Burn module, every model state on the model's device.
///
/// Like [`crate::ZeroEngine`], whose arithmetic it follows step for step, but gradients never
/// leave Burn: after `backward` they are flattened on the device (reshape and concatenation, in
/// the parameters' visit order, in buckets of about `reduce_bucket_size` elements), averaged over
/// the ranks by a [`DeviceCollective`] and accumulated over `gradient_accumulation_steps`. Stage
/// 0 all-reduces at the accumulation boundary; stage 1 reduce-scatters there; stage 2
/// reduce-scatters every micro-batch and keeps only its shard. At the boundary the global norm
/// is clipped to `gradient_clipping`, [`DeviceAdam`] steps the rank's fp32 master shard, and the
/// updated shards, all-gathered in the compute dtype, become the module's parameters (new
/// autodiff leaves over device tensors; no `TensorData` round trip). The host reads only the
/// loss, the norm's partial sums and the overflow flag, once per micro-batch and once per step.
///
/// Mixed precision as in [`crate::ZeroEngine`]: bf16 or fp16 parameters and gradients, fp32
/// masters, fp16 with the dynamic loss scaler. The optimizer must be Adam or AdamW. Stage 3 and
/// optimizer or parameter offload are refused (use [`crate::ChainEngine`] or
/// [`crate::ZeroEngine`]).
///
/// ```ignore
/// let comm = Arc::new(HostStaged::new(group)); // or NcclDevice on CUDA
/// let mut engine = DeviceEngine::new(settings, model, comm)?;
/// for batch in loader {
///     let loss = engine.forward(|model| model.loss(&batch));
///     engine.backward(loss)?;
///     engine.step()?; // None between accumulation boundaries
/// }
/// ```
pub struct DeviceEngine<B: AutodiffBackend, M: AutodiffModule<B>> {
    model: Option<M>,
    comm: Arc<dyn DeviceCollective<B::InnerBackend>>,
    settings: EngineSettings,
    layout: PartitionLayout,
    places: Vec<ParamPlace>,
    groups: Vec<GroupState<B>>,
    device: B::Device,
    memory: Arc<MemoryTracker>,
    micro_steps: usize,
    global_step: u64,
    skipped_steps: u64,
    scaler: Option<LossScaler>,
    loss_non_finite: bool,
}

/// Refuses what the device engine does not do, naming the setting and what to use instead.
fn check_settings(settings: &EngineSettings) -> Result<(), ZeroError> {
    if settings.stage == Stage::Zero3 {
        return Err(ZeroError::Config(
            "zero_optimization.stage 3: the device engine runs stages 0, 1 and 2; stage 3 needs the model's blocks: \
             implement zero_burn::ChainModel for the model and use ChainEngine"
                .into(),
        ));
    }
    if settings.offload_optimizer != OptimizerOffload::None {
        return Err(ZeroError::Config(
            "zero_optimization.offload_optimizer: the device engine keeps the masters and optimizer state on the \
             model's device; remove offload_optimizer, or use ZeroEngine or ChainEngine, which step the optimizer on \
             the CPU or stream it from NVMe"
                .into(),
        ));
    }
    if settings.offload_param != ParamOffload::None {
        return Err(ZeroError::Config(
            "zero_optimization.offload_param: parameter offload is a stage-3 feature; use ChainEngine with stage 3"
                .into(),
        ));
    }
    if settings.tensor_parallel_group.is_some() {
        return Err(ZeroError::Config(
            "tensor parallelism: the device engine's gradient norm covers its data-parallel group only; use \
             ChainEngine for tensor-parallel models"
                .into(),
        ));
    }
    Ok(())
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> DeviceEngine<B, M> {
    /// Wraps `model`. Rank 0's parameter values are broadcast, so every rank starts from the
    /// same weights whatever each built; the model is then cast to the compute dtype and the
    /// fp32 masters are made from the cast values (the model always sees its masters rounded).
    pub fn new(
        settings: EngineSettings,
        model: M,
        comm: Arc<dyn DeviceCollective<B::InnerBackend>>,
    ) -> Result<Self, ZeroError> {
        check_settings(&settings)?;
        crate::sharded::refuse_zero_modules::<B, M>(&model, "DeviceEngine")?;
        let device = model
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| ZeroError::Model("the model has no parameters (no device found)".into()))?;
        let world = comm.world_size();
        let rank = comm.rank();
        let layout = crate::engine::replicated_layout::<B, M>(&model, &settings, world);
        let places = layout.places();
        let dtype = settings.precision.dtype;
        let scaler = match &settings.precision.loss_scaler {
            Some(config) if dtype == ComputeDtype::F16 => {
                Some(LossScaler::new(config.clone()).map_err(|e| ZeroError::Config(format!("fp16: {e}")))?)
            }
            _ => None,
        };
        let memory = Arc::new(MemoryTracker::default());
        memory.add_parameters(layout.numel() * dtype.size());
        let mut values: Vec<Option<Flat<B>>> = read_flat(&model).into_iter().map(Some).collect();
        // Each group's full padded values in the compute dtype: the model's new parameters.
        let mut rounded = Vec::with_capacity(layout.groups.len());
        let mut groups = Vec::with_capacity(layout.groups.len());
        for (gi, g) in layout.groups.iter().enumerate() {
            let parts = g
                .params
                .iter()
                .map(|&p| {
                    values[p]
                        .take()
                        .map(|v| v.cast(DType::F32))
                        .ok_or_else(|| ZeroError::Model(format!("parameter {p} is listed in two groups")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut full = flatten(parts, g.padded, DType::F32, &device);
            if world > 1 {
                full = comm.broadcast(full, 0)?;
            }
            let cast = full.cast(dtype.burn());
            let owned = layout.owned_range(gi, rank);
            let master = cast.clone().cast(DType::F32).narrow(0, owned.start, owned.len());
            let optimizer = DeviceAdam::from_spec(&settings.optimizer, owned.len(), &device)?;
            memory.add_master(owned.len() * 4);
            memory.add_optimizer(optimizer.state_bytes());
            rounded.push(cast);
            groups.push(GroupState {
                master,
                grad: None,
                optimizer,
            });
        }
        let model = write_flat(model, |i, _| {
            let place = places[i];
            let n = layout.params[i].numel();
            rounded[place.group].clone().narrow(0, place.offset, n)
        });
        Ok(DeviceEngine {
            model: Some(model),
            comm,
            settings,
            layout,
            places,
            groups,
            device,
            memory,
            micro_steps: 0,
            global_step: 0,
            skipped_steps: 0,
            scaler,
            loss_non_finite: false,
        })
    }

    /// Runs `f` on the model (forward, or evaluation). Under bf16/fp16 the parameters are
    /// 16-bit: cast the float inputs to [`DeviceEngine::compute_dtype`].
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

    /// Backward of one micro-batch's loss (in fp32, times the fp16 loss scale, over the
    /// accumulation steps), and the reduction of its gradients on the device. Returns the loss
    /// value (the one host read of the micro-batch).
    pub fn backward(&mut self, loss: Tensor<B, 1>) -> Result<f32, ZeroError> {
        let value = loss.clone().into_scalar().elem::<f32>();
        if !value.is_finite() {
            self.loss_non_finite = true;
        }
        let factor = (self.loss_scale() / self.settings.gradient_accumulation_steps as f64) as f32;
        let mut grads = loss.cast(DType::F32).mul_scalar(factor).backward();
        let mut flat = take_flat_grads::<B, M>(self.module(), &mut grads);
        drop(grads);
        if flat.len() != self.layout.params.len() {
            return Err(ZeroError::Model(format!(
                "the model had {} parameters at initialize but has {} now: parameters must stay the same for the \
                 engine's lifetime",
                self.layout.params.len(),
                flat.len()
            )));
        }
        let dtype = self.settings.precision.dtype.burn();
        let world = self.comm.world_size();
        for gi in 0..self.layout.groups.len() {
            let g = &self.layout.groups[gi];
            let mut parts = Vec::with_capacity(g.params.len());
            for &p in &g.params {
                let spec = &self.layout.params[p];
                let n = spec.numel();
                parts.push(match flat[p].take() {
                    Some(grad) if grad.dims()[0] != n => {
                        return Err(ZeroError::Model(format!(
                            "parameter `{}` had shape {:?} ({n} elements) at initialize but its gradient now has {} \
                             elements: parameters must keep their shapes for the engine's lifetime",
                            spec.name,
                            spec.shape,
                            grad.dims()[0]
                        )))
                    }
                    Some(grad) => grad.cast(dtype),
                    // A parameter that took no part in the loss has a zero gradient.
                    None => Tensor::zeros([n], (&self.device, dtype)),
                });
            }
            let full = flatten(parts, g.padded, dtype, &self.device);
            let arriving = match self.settings.stage {
                Stage::Zero2 if world > 1 => {
                    let comm_dtype = self.settings.precision.comm_dtype().burn();
                    self.comm.reduce_scatter(full.cast(comm_dtype), ReduceOp::Avg)?
                }
                _ => full,
            };
            let state = &mut self.groups[gi];
            state.grad = Some(match state.grad.take() {
                None => {
                    self.memory
                        .add_grads(arriving.dims()[0] * self.settings.precision.dtype.size());
                    arriving.cast(dtype)
                }
                // Added in f32 and rounded once, as the host accumulators do.
                Some(acc) => (acc.cast(DType::F32) + arriving.cast(DType::F32)).cast(dtype),
            });
        }
        self.micro_steps += 1;
        Ok(value)
    }

    /// The optimizer step at an accumulation boundary; `None` between boundaries.
    pub fn step(&mut self) -> Result<Option<StepReport>, ZeroError> {
        if self.micro_steps < self.settings.gradient_accumulation_steps {
            return Ok(None);
        }
        let step = self.global_step + 1;
        // The schedule advances only with applied steps.
        let lr = self.settings.lr_at(self.global_step - self.skipped_steps);
        let loss_scale = self.loss_scale();
        let outcome = self
            .boundary_grads()
            .and_then(|grads| self.apply_or_skip(grads, step, lr, loss_scale));
        self.micro_steps = 0;
        self.global_step += 1;
        self.loss_non_finite = false;
        let grad_norm = match outcome {
            Ok(Some(norm)) => norm,
            Ok(None) => {
                self.skipped_steps += 1;
                return Ok(Some(StepReport {
                    step,
                    lr,
                    grad_norm: f64::NAN,
                    skipped: true,
                    loss_scale,
                }));
            }
            Err(e) => {
                self.skipped_steps += 1;
                return Err(e);
            }
        };
        self.refresh_replica()?;
        Ok(Some(StepReport {
            step,
            lr,
            grad_norm,
            skipped: false,
            loss_scale,
        }))
    }

    /// Takes the accumulators and reduces those not reduced yet (stages 0 and 1): every group's
    /// data-parallel mean gradient of its owned range, in fp32.
    fn boundary_grads(&mut self) -> Result<Vec<Flat<B>>, ZeroError> {
        let world = self.comm.world_size();
        let dtype = self.settings.precision.dtype;
        let comm_dtype = self.settings.precision.comm_dtype().burn();
        let mut out = Vec::with_capacity(self.groups.len());
        for (gi, state) in self.groups.iter_mut().enumerate() {
            let g = &self.layout.groups[gi];
            let acc = match state.grad.take() {
                Some(acc) => {
                    self.memory.sub_grads(acc.dims()[0] * dtype.size());
                    acc
                }
                None => {
                    let len = match self.settings.stage {
                        Stage::Zero2 => self.layout.owned_len(gi),
                        _ => g.padded,
                    };
                    Tensor::zeros([len], (&self.device, dtype.burn()))
                }
            };
            let reduced = match (self.settings.stage, g.placement) {
                (Stage::Zero2, _) => acc,
                _ if world == 1 => acc,
                (_, Placement::Replicated) => self.comm.all_reduce(acc.cast(comm_dtype), ReduceOp::Avg)?,
                (_, Placement::Sharded) => self.comm.reduce_scatter(acc.cast(comm_dtype), ReduceOp::Avg)?,
            };
            out.push(reduced.cast(DType::F32));
        }
        Ok(out)
    }

    /// Checks for overflow, then either applies the step (returning the gradient norm) or
    /// decides to skip it (`None`). Mirrors the host engines' rules.
    fn apply_or_skip(
        &mut self,
        grads: Vec<Flat<B>>,
        step: u64,
        lr: f64,
        loss_scale: f64,
    ) -> Result<Option<f64>, ZeroError> {
        let world = self.comm.world_size();
        let policy = self.settings.precision.non_finite;
        let check = self.scaler.is_some() || policy != NonFinitePolicy::Ignore;
        // One host read for the whole step: each group's sum of squares and, when overflow is
        // checked, its count of non-finite elements.
        let width = if check { 2 } else { 1 };
        let mut stats = Vec::with_capacity(width * grads.len());
        for g in &grads {
            stats.push((g.clone() * g.clone()).sum());
            if check {
                stats.push(g.clone().is_finite().bool_not().float().sum().cast(DType::F32));
            }
        }
        let stats: Vec<f32> = if stats.is_empty() {
            Vec::new()
        } else {
            crate::params::tensor_to_vec(Tensor::cat(stats, 0))
        };
        if check {
            let seen = if self.loss_non_finite {
                Some(NonFiniteSeen::Loss)
            } else if stats.chunks_exact(2).any(|s| s[1] > 0.0) {
                Some(NonFiniteSeen::Gradient)
            } else {
                None
            };
            let mine = seen.map(|seen| Overflow {
                rank: self.comm.rank(),
                seen,
            });
            let mut agreed = mine;
            if world > 1 {
                let mut code = [Overflow::code(mine, world)];
                self.comm.all_reduce_scalars(&mut code, ReduceOp::Max)?;
                agreed = Overflow::decode(code[0], world);
            }
            if !crate::core::decide_step(&mut self.scaler, &self.settings, agreed, mine, step, loss_scale)? {
                return Ok(None);
            }
        }
        // Sharded groups' partial sums add over ranks; replicated groups are whole everywhere.
        let (mut sharded, mut replicated) = (0.0f64, 0.0f64);
        for (gi, s) in stats.chunks_exact(width).enumerate() {
            match self.layout.groups[gi].placement {
                Placement::Sharded => sharded += s[0] as f64,
                Placement::Replicated => replicated += s[0] as f64,
            }
        }
        if world > 1 {
            let mut total = [sharded as f32];
            self.comm.all_reduce_scalars(&mut total, ReduceOp::Sum)?;
            sharded = total[0] as f64;
        }
        let unscale = 1.0 / loss_scale;
        let grad_norm = (sharded + replicated).sqrt() * unscale;
        let max_norm = self.settings.gradient_clipping;
        // torch.nn.utils.clip_grad_norm_'s rule: scale by max/(norm + 1e-6) when that is below 1.
        let ratio = max_norm / (grad_norm + 1e-6);
        let clip = if max_norm > 0.0 && ratio < 1.0 { ratio } else { 1.0 };
        let coef = (unscale * clip) as f32;
        for (state, grad) in self.groups.iter_mut().zip(grads) {
            let grad = if coef != 1.0 { grad.mul_scalar(coef) } else { grad };
            state.optimizer.check(&state.master, &grad)?;
            // Taken out, so that the optimizer may update the only handle in place (the check
            // above is all that could fail).
            let empty = Tensor::zeros([0], (&self.device, DType::F32));
            let master = std::mem::replace(&mut state.master, empty);
            state.master = state.optimizer.step(master, grad, lr)?;
        }
        Ok(Some(grad_norm))
    }

    /// Micro-batches absorbed since the last step, and per step.
    pub(super) fn micro_batches(&self) -> (usize, usize) {
        (self.micro_steps, self.settings.gradient_accumulation_steps)
    }

    /// The collective the engine reduces through.
    pub(super) fn collective(&self) -> &Arc<dyn DeviceCollective<B::InnerBackend>> {
        &self.comm
    }

    /// Every group's fp32 master shard, in group order.
    pub(super) fn masters(&self) -> impl Iterator<Item = &Flat<B>> {
        self.groups.iter().map(|g| &g.master)
    }

    /// Every group's optimizer, in group order.
    pub(super) fn optimizers(&self) -> impl Iterator<Item = &DeviceAdam<B::InnerBackend>> {
        self.groups.iter().map(|g| &g.optimizer)
    }

    /// fp16's loss-scaler state, for a checkpoint.
    pub(super) fn scaler_state(&self) -> Option<zero_core::loss_scaler::LossScalerState> {
        self.scaler.as_ref().map(|s| s.state())
    }

    /// Replaces every group's master shard and optimizer (a loaded checkpoint's), the step count
    /// and the loss scaler's state, drops any accumulated gradient, and gives the module the
    /// restored weights.
    pub(super) fn restore(
        &mut self,
        groups: Vec<(Flat<B>, DeviceAdam<B::InnerBackend>)>,
        global_step: u64,
        scaler: Option<zero_core::loss_scaler::LossScalerState>,
    ) -> Result<(), ZeroError> {
        for (state, (master, optimizer)) in self.groups.iter_mut().zip(groups) {
            (state.master, state.optimizer, state.grad) = (master, optimizer, None);
        }
        self.micro_steps = 0;
        self.global_step = global_step;
        self.loss_non_finite = false;
        if let (Some(s), Some(state)) = (self.scaler.as_mut(), scaler) {
            s.load_state(state);
        }
        self.refresh_replica()
    }

    /// Gathers the masters in the compute dtype and makes them the module's parameters.
    fn refresh_replica(&mut self) -> Result<(), ZeroError> {
        let world = self.comm.world_size();
        let dtype = self.settings.precision.dtype.burn();
        let mut full = Vec::with_capacity(self.groups.len());
        for (gi, state) in self.groups.iter().enumerate() {
            let shard = state.master.clone().cast(dtype);
            full.push(match self.layout.groups[gi].placement {
                Placement::Sharded if world > 1 => self.comm.all_gather(shard)?,
                _ => shard,
            });
        }
        let model = self.model.take().unwrap_or_else(|| unreachable!());
        let (places, layout) = (&self.places, &self.layout);
        self.model = Some(write_flat(model, |i, _| {
            let place = places[i];
            full[place.group]
                .clone()
                .narrow(0, place.offset, layout.params[i].numel())
        }));
        Ok(())
    }

    /// The dtype of the model's parameters: cast float inputs to `compute_dtype().burn()`.
    pub fn compute_dtype(&self) -> ComputeDtype {
        self.settings.precision.dtype
    }

    /// The loss scale of the next backward (1 without fp16 loss scaling).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// Steps skipped so far for a non-finite gradient.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Optimizer steps taken.
    pub fn global_step(&self) -> u64 {
        self.global_step
    }

    /// Bytes held by this rank, by kind (all on the model's device). Gradients count the
    /// accumulators while they exist: from a step's first backward to the step.
    pub fn memory(&self) -> MemoryReport {
        self.memory.report()
    }

    /// The partition layout (the same as [`crate::ZeroEngine`]'s for these settings).
    pub fn layout(&self) -> &PartitionLayout {
        &self.layout
    }

    /// The settings in force.
    pub fn settings(&self) -> &EngineSettings {
        &self.settings
    }

    /// The fp32 master weights of this rank's owned range of `group`, on the device.
    pub fn master_shard(&self, group: usize) -> Option<&Tensor<B::InnerBackend, 1>> {
        self.groups.get(group).map(|g| &g.master)
    }

    /// The device the model and the state are on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Gives the model back (it holds the current weights on every rank).
    pub fn into_module(mut self) -> M {
        self.model.take().unwrap_or_else(|| unreachable!())
    }
}
