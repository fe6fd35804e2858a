//! What every engine shares: the flat state, the process group, the step counters, and the
//! machinery that turns per-parameter gradients into reduced group gradients and updated
//! weights back into per-parameter values.

use crate::agreement::{decide_step, Agreement, GradNormFn, NonFiniteSeen};
use crate::error::ZeroError;
use crate::flat_state::{FlatState, GradFlow, StateDtypes};
use crate::half_buffer;
use crate::memory::MemoryTracker;
use crate::optimizer_bridge::OptimizerFactory;
use crate::settings::{ComputeDtype, EngineSettings, NonFinitePolicy, Stage};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use std::collections::HashMap;
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp, Work};
use zero_core::loss_scaler::{has_overflow, LossScaler};
use zero_core::partition::{ParamPlace, PartitionLayout, Placement};

/// What one call to `step` did.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Learning rate used.
    pub lr: f64,
    /// Global L2 norm of the averaged (unscaled) gradient, before clipping; NaN for a skipped
    /// step.
    pub grad_norm: f64,
    /// Whether the step was skipped because a gradient (or the loss) was infinite or NaN on
    /// some rank: fp16's overflow, or bf16/fp32 with [`crate::NonFinitePolicy::Skip`]. The
    /// weights, the optimizer state and the LR schedule did not move; `step` still counts it,
    /// as DeepSpeed's `global_steps` does.
    pub skipped: bool,
    /// The loss scale this step's gradients were computed with (1 without fp16 loss scaling).
    pub loss_scale: f64,
}

/// The shared state and logic of the engines.
pub(crate) struct EngineCore {
    pub state: FlatState,
    pub comm: Arc<dyn ProcessGroup>,
    pub settings: EngineSettings,
    pub places: Vec<ParamPlace>,
    pub memory: Arc<MemoryTracker>,
    /// Micro-batches absorbed since the last optimizer step.
    pub micro_steps: usize,
    /// Optimizer steps taken.
    pub global_step: u64,
    /// Steps skipped for a non-finite gradient (counted in `global_step` too).
    pub skipped_steps: u64,
    /// fp16's loss scaler.
    pub scaler: Option<LossScaler>,
    /// A micro-batch loss of this step was infinite or NaN on this rank.
    loss_non_finite: bool,
    /// Replaces the norm over the data-parallel group when the model spans more ranks.
    pub grad_norm: Option<GradNormFn>,
    /// The ranks that must agree on skipping (or failing) a step, when more than `comm`'s: a
    /// pipeline's whole world, so that every stage skips together, or every tensor rank's data
    /// ranks.
    pub overflow: Option<Agreement>,
    /// With tensor parallelism: this tensor rank and how the parameters are split, for the
    /// checkpoints.
    pub tensor_parallel: Option<zero_core::checkpoint::TensorParallelRecord>,
    /// Which tags of a checkpoint directory are this run's: a save refuses to replace or orphan
    /// another trajectory's ([`zero_core::checkpoint::Lineage`]).
    pub lineage: zero_core::checkpoint::Lineage,
    /// A delayed update's values that the model does not hold yet
    /// ([`EngineCore::update_delayed`]; the optimizer writes them at its next step).
    pub owed: Option<Owed>,
    assembler: Assembler,
    in_flight: Vec<(usize, Work<FlatBuffer>)>,
}

/// What a delayed update leaves to be written into the model: by group, whether it stepped, and
/// the model's float parameters (visit order) that did not train then, whose module values go
/// back into the masters first (as after an undelayed step).
pub(crate) struct Owed {
    pub trains: Vec<bool>,
    pub frozen: Vec<usize>,
}

impl EngineCore {
    pub fn new(
        layout: PartitionLayout,
        comm: Arc<dyn ProcessGroup>,
        settings: EngineSettings,
        flows: impl Fn(usize) -> GradFlow,
        values: impl FnMut(usize) -> Vec<f32>,
        memory: Arc<MemoryTracker>,
        trains: Vec<bool>,
    ) -> Result<Self, ZeroError> {
        let factory = OptimizerFactory {
            spec: settings.optimizer.clone(),
        };
        let precision = &settings.precision;
        let dtypes = StateDtypes {
            accumulate: precision.dtype,
            // Stage 3 keeps the parameter shard apart from the masters when it is 16-bit.
            half_shard: (settings.stage == Stage::Zero3 && precision.dtype.is_half()).then_some(precision.dtype),
            communicate: precision.comm_dtype(),
        };
        let scaler = match &precision.loss_scaler {
            Some(config) if precision.dtype == ComputeDtype::F16 => {
                Some(LossScaler::new(config.clone()).map_err(|e| ZeroError::Config(format!("fp16: {e}")))?)
            }
            _ => None,
        };
        let state = FlatState::new(
            layout,
            comm.rank(),
            flows,
            &factory,
            values,
            &memory,
            dtypes,
            &settings.offload_optimizer,
            trains,
        )?;
        let places = state.layout.places();
        let assembler = Assembler::new(&state.layout);
        Ok(EngineCore {
            state,
            comm,
            settings,
            places,
            memory,
            micro_steps: 0,
            global_step: 0,
            skipped_steps: 0,
            scaler,
            loss_non_finite: false,
            grad_norm: None,
            overflow: None,
            tensor_parallel: None,
            lineage: zero_core::checkpoint::Lineage::new(),
            assembler,
            in_flight: Vec::new(),
            owed: None,
        })
    }

    /// Takes one parameter's micro-batch gradient (`None`: the parameter was not used). When a
    /// group is complete it goes on: added to the accumulator, or reduce-scattered (in the
    /// background when `overlap_comm` is set).
    pub fn absorb(&mut self, param: usize, grad: Option<Vec<f32>>) -> Result<(), ZeroError> {
        let place = self.places[param];
        let group = &self.state.layout.groups[place.group];
        let n = self.state.layout.params[param].numel();
        // A group that does not train is not reduced: its parameters have no gradients.
        if !self.state.group_trains(place.group) {
            return Ok(());
        }
        if let Some(g) = &grad {
            if g.len() != n {
                let spec = &self.state.layout.params[param];
                return Err(ZeroError::Model(format!(
                    "parameter `{}` had shape {:?} ({} elements) at initialize but its gradient now has {} elements: \
                     parameters must keep their shapes for the engine's lifetime",
                    spec.name,
                    spec.shape,
                    n,
                    g.len()
                )));
            }
        }
        let Some(full) = self.assembler.put(place.group, group.padded, place.offset, n, grad) else {
            return Ok(());
        };
        self.memory.add_grads(full.len() * 4);
        match self.state.groups[place.group].flow {
            GradFlow::AccumulateThenReduce => {
                self.state.add_full(place.group, &full);
                self.memory.sub_grads(full.len() * 4);
            }
            GradFlow::ReduceThenAccumulate if self.comm.world_size() == 1 => {
                self.state.add_owned(place.group, &full);
                self.memory.sub_grads(full.len() * 4);
            }
            GradFlow::ReduceThenAccumulate => {
                let buf = half_buffer::convert(FlatBuffer::F32(full), self.state.dtypes.communicate.flat());
                let work = self
                    .comm
                    .reduce_scatter_of_async(buf, ReduceOp::Avg, bucket(place.group));
                self.in_flight.push((place.group, work));
                if self.settings.overlap_comm {
                    // Overlap, but never hold more than about two buckets of gradients in flight
                    // (DeepSpeed's reduce_bucket_size bounds this memory the same way).
                    let limit = 2 * self.settings.reduce_bucket_size.max(group.padded);
                    self.drain_to(limit)?;
                } else {
                    self.drain_to(0)?;
                }
            }
        }
        Ok(())
    }

    /// Adds the gradient of a group this rank owns a shard of and that arrives already reduced
    /// over the ranks (a `ZeroModule`'s shard: its backward reduce-scattered it): the owned slice,
    /// added as it is. The group must accumulate owned slices (`ReduceThenAccumulate`).
    pub fn absorb_owned(&mut self, group: usize, owned: &[f32]) -> Result<(), ZeroError> {
        let len = self.state.layout.owned_len(group);
        if owned.len() != len || self.state.groups[group].flow != GradFlow::ReduceThenAccumulate {
            let name = self.state.layout.groups[group]
                .params
                .first()
                .map_or("?", |&p| self.state.layout.params[p].name.as_str());
            return Err(ZeroError::Model(format!(
                "the shard `{name}` has a gradient of {} elements where this rank owns {len}: the ZeroModule was \
                 sharded for another number of ranks",
                owned.len()
            )));
        }
        self.state.add_owned(group, owned);
        Ok(())
    }

    /// Waits for every reduction in flight and accumulates the results.
    pub fn drain(&mut self) -> Result<(), ZeroError> {
        self.drain_to(0)
    }

    /// Waits for the oldest reductions in flight until at most `limit` elements remain in
    /// flight, and accumulates their results.
    fn drain_to(&mut self, limit: usize) -> Result<(), ZeroError> {
        let mut in_flight: usize = self
            .in_flight
            .iter()
            .map(|(g, _)| self.state.layout.groups[*g].padded)
            .sum();
        while in_flight > limit && !self.in_flight.is_empty() {
            let (group, work) = self.in_flight.remove(0);
            let padded = self.state.layout.groups[group].padded;
            let shard = work.wait()?.into_f32();
            self.memory.sub_grads(padded * 4);
            self.state.add_owned(group, &shard);
            in_flight -= padded;
        }
        Ok(())
    }

    /// Ends a micro-batch: waits for its reductions and counts it.
    pub fn finish_micro_batch(&mut self) -> Result<(), ZeroError> {
        self.drain()?;
        if !self.assembler.is_empty() {
            return Err(ZeroError::Model(
                "some parameters of a group received no gradient call: the model's parameter list changed after initialize"
                    .into(),
            ));
        }
        self.micro_steps += 1;
        Ok(())
    }

    /// The optimizer step on the owned masters (at a boundary): unless a gradient overflowed,
    /// in which case the step is skipped (fp16, or the skip policy) or fails, on every rank.
    pub fn update(&mut self) -> Result<StepReport, ZeroError> {
        self.update_with(false)
    }

    /// [`EngineCore::update`] whose update, once every rank agreed on it (the reductions, the
    /// overflow check, the gradient norm and clipping: everything that communicates), runs on a
    /// thread of its own and is still running when this returns: the delayed step of
    /// `offload_optimizer.delayed_update`. [`EngineCore::settle`] waits for it.
    pub fn update_delayed(&mut self) -> Result<StepReport, ZeroError> {
        self.update_with(true)
    }

    /// Waits for a delayed update ([`EngineCore::update_delayed`]) still running; `true` when
    /// there was one (its new masters are then what the model does not hold yet).
    pub fn settle(&mut self) -> Result<bool, ZeroError> {
        self.state.settle()
    }

    fn update_with(&mut self, delayed: bool) -> Result<StepReport, ZeroError> {
        self.state.settle()?;
        self.state.reduce_at_boundary(self.comm.as_ref())?;
        let step = self.global_step + 1;
        // The schedule advances only with applied steps (DeepSpeed does not step its LR
        // scheduler on an overflow).
        let lr = self.settings.lr_at(self.global_step - self.skipped_steps);
        if let Some(betas) = self.settings.betas_at(self.global_step - self.skipped_steps) {
            self.state.set_betas(betas);
        }
        let loss_scale = self.current_loss_scale();
        let grads = self.state.take_owned_grads();
        // The f32 copy of 16-bit gradients lives for the step (for f32 it is the accumulator).
        let copy_bytes = if self.state.dtypes.accumulate.is_half() {
            grads.iter().map(|g| g.len() * 4).sum()
        } else {
            0
        };
        self.memory.add_grads(copy_bytes);
        let outcome = self.apply_or_skip(grads, step, lr, loss_scale, delayed);
        self.memory.sub_grads(copy_bytes);
        self.micro_steps = 0;
        self.global_step += 1;
        self.loss_non_finite = false;
        let applied = match outcome {
            Ok(a) => a,
            Err(e) => {
                self.skipped_steps += 1;
                self.state.reset_accumulators();
                return Err(e);
            }
        };
        let (skipped, grad_norm) = match applied {
            Some(norm) => (false, norm),
            None => {
                self.skipped_steps += 1;
                self.state.reset_accumulators();
                (true, f64::NAN)
            }
        };
        Ok(StepReport {
            step,
            lr,
            grad_norm,
            skipped,
            loss_scale,
        })
    }

    /// Checks for overflow, then either applies the step (returning the gradient norm; with
    /// `delayed`, launches it) or decides to skip it (`None`).
    fn apply_or_skip(
        &mut self,
        grads: Vec<Vec<f32>>,
        step: u64,
        lr: f64,
        loss_scale: f64,
        delayed: bool,
    ) -> Result<Option<f64>, ZeroError> {
        let policy = self.settings.precision.non_finite;
        if self.scaler.is_some() || policy != NonFinitePolicy::Ignore {
            // What this rank saw; the code is shared so that every rank takes the same path.
            let seen = if self.loss_non_finite {
                Some(NonFiniteSeen::Loss)
            } else if grads.iter().any(|g| has_overflow(g)) {
                Some(NonFiniteSeen::Gradient)
            } else {
                None
            };
            let (mine, agreed) = match &self.overflow {
                Some(agreement) => agreement.agree(seen)?,
                None => Agreement::over(self.comm.clone()).agree(seen)?,
            };
            if !decide_step(&mut self.scaler, &self.settings, agreed, mine, step, loss_scale)? {
                return Ok(None);
            }
        }
        let scaled_norm = match &self.grad_norm {
            Some(norm) => norm(&self.state, &grads)?,
            None => self.state.global_grad_norm(&grads, self.comm.as_ref())?,
        };
        let unscale = 1.0 / loss_scale;
        let grad_norm = scaled_norm * unscale;
        let max_norm = self.settings.gradient_clipping;
        // torch.nn.utils.clip_grad_norm_'s rule: scale by max/(norm + 1e-6) when that is below 1.
        let ratio = max_norm / (grad_norm + 1e-6);
        let clip = if max_norm > 0.0 && ratio < 1.0 { ratio } else { 1.0 };
        // Unscaling and clipping in one pass over the gradients.
        let coef = (unscale * clip) as f32;
        if delayed {
            self.state.launch(grads, coef, lr, self.comm.clone(), &self.memory)?;
        } else {
            self.state.apply(grads, coef, lr, self.comm.as_ref(), &self.memory)?;
        }
        Ok(Some(grad_norm))
    }

    /// Writes each `(start, values)` of `writes` into the rank's fp32 masters of `group` from
    /// the owned range's offset `start`, and into their 16-bit copy: values set in the module
    /// (`ZeroModule::modify`, a parameter that does not train), which the next update starts
    /// from. Masters swapped to NVMe are read, changed and written back once for all of them.
    pub fn write_masters(&mut self, group: usize, writes: &[(usize, &[f32])]) -> Result<(), ZeroError> {
        let owned = self.state.layout.owned_len(group);
        if let Some(&(start, values)) = writes.iter().find(|(start, values)| start + values.len() > owned) {
            return Err(ZeroError::Usage(format!(
                "flat group {group}: new master values {start}..{} outside the {owned} this rank holds",
                start + values.len()
            )));
        }
        if let Some(mut buffers) = self.state.read_swapped_group(group)? {
            for &(start, values) in writes {
                buffers[0][start..start + values.len()].copy_from_slice(values);
            }
            let views: Vec<&[f32]> = buffers.iter().map(Vec::as_slice).collect();
            self.state.write_swapped_group(group, &views)?;
        }
        let state = self
            .state
            .groups
            .get_mut(group)
            .ok_or_else(|| ZeroError::Model(format!("no flat group {group}")))?;
        for &(start, values) in writes {
            let end = start + values.len();
            if let Some(master) = state.master.get_mut(start..end) {
                master.copy_from_slice(values);
            }
            if let Some(half) = state.half.as_mut().filter(|h| h.len() >= end) {
                crate::half_buffer::write_rounded(half, start, values);
            }
        }
        Ok(())
    }

    /// The loss scale of the next backward (1 without fp16 loss scaling).
    pub fn current_loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// Notes that a micro-batch of this step had a non-finite loss: the step's overflow check
    /// then names the loss.
    pub fn note_non_finite_loss(&mut self) {
        self.loss_non_finite = true;
    }

    /// The tensor to call `backward()` on for one micro-batch's loss: the loss in fp32 (so that
    /// the loss scale cannot overflow a 16-bit loss), times the loss scale, over the
    /// accumulation steps. Also notes a non-finite loss value for the step's overflow check.
    pub fn backward_loss<B: Backend>(&mut self, loss: Tensor<B, 1>, value: f32) -> Tensor<B, 1> {
        if !value.is_finite() {
            self.loss_non_finite = true;
        }
        let factor = (self.current_loss_scale() / self.settings.gradient_accumulation_steps as f64) as f32;
        loss.cast(DType::F32).mul_scalar(factor)
    }

    /// Every parameter's full value, in the order asked for: a group is gathered the first time
    /// one of its parameters is asked for and released after its last.
    pub fn value_source(&self) -> ValueSource<'_> {
        ValueSource {
            core: self,
            cache: HashMap::new(),
            error: None,
        }
    }

    /// The full padded values of one group, from the owned masters, as f32.
    #[allow(dead_code)] // the f32 view, for readers that do not care about the compute dtype
    pub fn gather_group(&self, group: usize) -> Result<Vec<f32>, ZeroError> {
        Ok(self.gather_group_buffer(group)?.into_f32())
    }

    /// The full padded values of one group in the compute dtype: what the model sees. A 16-bit
    /// gather moves half the bytes of an fp32 one.
    pub fn gather_group_buffer(&self, group: usize) -> Result<FlatBuffer, ZeroError> {
        let shard = self.shard_buffer(group)?;
        match self.state.layout.groups[group].placement {
            Placement::Sharded if self.comm.world_size() > 1 => Ok(self.comm.all_gather(shard)?),
            _ => Ok(shard),
        }
    }

    /// The rank's owned values of a group in the compute dtype (the step's copy while it is
    /// held, else the masters, read from the swap file when they are there, rounded when the
    /// compute dtype is 16-bit). The buffer is the caller's, dropped after the gather.
    pub fn shard_buffer(&self, group: usize) -> Result<FlatBuffer, ZeroError> {
        let dtype = self.settings.precision.dtype.flat();
        if let Some(h) = self.state.param_shard(group) {
            return Ok(h);
        }
        Ok(match self.state.read_swapped_group(group)? {
            Some(buffers) => FlatBuffer::from_f32(buffers.first().map_or(&[][..], Vec::as_slice), dtype),
            None => FlatBuffer::from_f32(&self.state.groups[group].master, dtype),
        })
    }
}

/// Hands out parameter values group by group (see [`EngineCore::value_source`]).
pub(crate) struct ValueSource<'a> {
    core: &'a EngineCore,
    cache: HashMap<usize, (FlatBuffer, usize)>,
    /// The first collective error met; the values handed out after it are zeros.
    pub error: Option<ZeroError>,
}

impl ValueSource<'_> {
    /// The values of parameter `param`, as f32.
    #[allow(dead_code)] // the f32 view, for readers that do not care about the compute dtype
    pub fn take(&mut self, param: usize) -> Vec<f32> {
        let data = self.take_data(param);
        crate::params::data_to_vec(data)
    }

    /// The values of parameter `param` in the compute dtype, shaped: a parameter tensor's data.
    pub fn take_data(&mut self, param: usize) -> TensorData {
        let place = self.core.places[param];
        let spec = &self.core.state.layout.params[param];
        let n = spec.numel();
        if !self.cache.contains_key(&place.group) {
            let values = match self.core.gather_group_buffer(place.group) {
                Ok(v) => v,
                Err(e) => {
                    self.error.get_or_insert(e);
                    let padded = self.core.state.layout.groups[place.group].padded;
                    half_buffer::zeros(self.core.settings.precision.dtype, padded)
                }
            };
            let count = self.core.state.layout.groups[place.group].params.len();
            self.cache.insert(place.group, (values, count));
        }
        let (values, remaining) = self.cache.get_mut(&place.group).unwrap_or_else(|| unreachable!());
        let out = half_buffer::slice_data(values, place.offset..place.offset + n, spec.shape.clone());
        *remaining -= 1;
        if *remaining == 0 {
            self.cache.remove(&place.group);
        }
        out
    }

    /// The first error met, if any.
    pub fn finish(self) -> Result<(), ZeroError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Collects per-parameter gradients into whole group buffers.
struct Assembler {
    pending: HashMap<usize, (Vec<f32>, usize)>,
    sizes: Vec<usize>,
}

impl Assembler {
    fn new(layout: &PartitionLayout) -> Self {
        Assembler {
            pending: HashMap::new(),
            sizes: layout.groups.iter().map(|g| g.params.len()).collect(),
        }
    }

    /// Puts one parameter's gradient in place; returns the group's buffer when it is complete.
    fn put(
        &mut self,
        group: usize,
        padded: usize,
        offset: usize,
        n: usize,
        grad: Option<Vec<f32>>,
    ) -> Option<Vec<f32>> {
        let entry = self
            .pending
            .entry(group)
            .or_insert_with(|| (vec![0.0; padded], self.sizes[group]));
        if let Some(g) = grad {
            entry.0[offset..offset + n].copy_from_slice(&g[..n]);
        }
        entry.1 -= 1;
        if entry.1 == 0 {
            self.pending.remove(&group).map(|(buf, _)| buf)
        } else {
            None
        }
    }

    fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Flat group `group` of the layout, as its collectives name it to the peers.
pub(crate) fn bucket(group: usize) -> zero_core::comm::Subject {
    zero_core::comm::Subject::Bucket(u32::try_from(group).unwrap_or(u32::MAX))
}
