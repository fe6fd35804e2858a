//! [`crate::ZeroOptimizer`]'s state on the model's device: the fp32 master shard and the Adam
//! moments of every flat group as tensors of the model's backend, the gradients reduced as
//! tensors through a [`DeviceCollective`]. The host reads scalars only: each group's sum of
//! squares and count of non-finite elements, once per step.

use super::collective::DeviceCollective;
use super::optim::DeviceOptimizer;
use crate::agreement::{Agreement, NonFiniteSeen, Overflow, TensorNorms};
use crate::core::StepReport;
use crate::error::ZeroError;
use crate::memory::MemoryTracker;
use crate::settings::{ComputeDtype, EngineSettings, NonFinitePolicy};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use std::sync::Arc;
use zero_core::comm::{ProcessGroup, ReduceOp};
use zero_core::loss_scaler::LossScaler;
use zero_core::partition::{PartitionLayout, Placement};

/// One flat group's share of the state.
struct GroupState<I: Backend> {
    /// fp32 master weights of the rank's owned range.
    master: Tensor<I, 1>,
    /// Made at the group's first step: a group whose parameters do not train (frozen, running
    /// statistics) holds none, as a PyTorch optimizer holds no state for a parameter without
    /// gradients.
    optimizer: Option<DeviceOptimizer<I>>,
    /// A `ZeroModule`'s sharded unit: its gradient arrives as the owned shard, already averaged
    /// over the ranks (the unit's backward reduce-scattered it), and the module holds the shard.
    unit: bool,
}

/// The optimizer's state with every model state on the device (no `offload_optimizer`).
pub(crate) struct DeviceState<I: Backend> {
    comm: Arc<dyn DeviceCollective<I>>,
    /// The same ranks as a host group: what checkpoints travel over.
    host: Arc<dyn ProcessGroup>,
    pub(crate) settings: EngineSettings,
    pub(crate) layout: PartitionLayout,
    groups: Vec<GroupState<I>>,
    device: I::Device,
    pub(crate) memory: Arc<MemoryTracker>,
    pub(crate) global_step: u64,
    pub(crate) skipped_steps: u64,
    scaler: Option<LossScaler>,
    /// Bytes of the gradients handed to the latest step.
    grad_bytes: usize,
    /// With tensor parallelism: the tensor ranks and what each rank's norm counts.
    tensor: Option<TensorRanks<I>>,
    /// Which tags of a checkpoint directory are this run's ([`zero_core::checkpoint::Lineage`]).
    pub(crate) lineage: zero_core::checkpoint::Lineage,
}

/// What the step needs of a model split over tensor ranks besides the data-parallel ones.
struct TensorRanks<I: Backend> {
    /// The tensor ranks: the norm's partial sums add over them after the data ranks.
    group: Arc<dyn ProcessGroup>,
    /// Per group, a 0/1 mask over the rank's owned range where the norm counts only some of its
    /// parameters (a replicated parameter counts on tensor rank 0 alone); `None`: all of them.
    masks: Vec<Option<Tensor<I, 1>>>,
    /// Every tensor rank's data ranks skip an overflowed step together.
    agreement: Agreement,
    /// What the checkpoints record.
    record: zero_core::checkpoint::TensorParallelRecord,
    /// LAMB's per-tensor norms over the tensor ranks.
    norms: TensorNorms,
}

impl<I: Backend> DeviceState<I> {
    /// The state of `layout`'s groups, group `g` starting from the fp32 masters of the rank's
    /// owned range that `group(g)` gives, with whether the group is a `ZeroModule`'s sharded
    /// unit. A group's optimizer state is made at its first step.
    pub(crate) fn new(
        settings: EngineSettings,
        comm: Arc<dyn DeviceCollective<I>>,
        host: Arc<dyn ProcessGroup>,
        layout: PartitionLayout,
        device: I::Device,
        mut group: impl FnMut(usize) -> (Tensor<I, 1>, bool),
        memory: Arc<MemoryTracker>,
    ) -> Result<Self, ZeroError> {
        let scaler = match &settings.precision.loss_scaler {
            Some(config) if settings.precision.dtype == ComputeDtype::F16 => {
                Some(LossScaler::new(config.clone()).map_err(|e| ZeroError::Config(format!("fp16: {e}")))?)
            }
            _ => None,
        };
        // The settings' checks, before any step.
        DeviceOptimizer::<I>::check_spec(&settings.optimizer)?;
        let mut groups = Vec::with_capacity(layout.groups.len());
        for g in 0..layout.groups.len() {
            let (master, unit) = group(g);
            let len = master.dims()[0];
            if len != layout.owned_len(g) {
                return Err(ZeroError::Model(format!(
                    "flat group {g}: {len} master elements where this rank owns {}",
                    layout.owned_len(g)
                )));
            }
            memory.add_master(len * 4);
            groups.push(GroupState {
                master,
                optimizer: None,
                unit,
            });
        }
        Ok(DeviceState {
            comm,
            host,
            settings,
            layout,
            groups,
            device,
            memory,
            global_step: 0,
            skipped_steps: 0,
            scaler,
            grad_bytes: 0,
            tensor: None,
            lineage: zero_core::checkpoint::Lineage::new(),
        })
    }

    /// The model is split over `tensor` as `split` says: the gradient norm becomes the whole
    /// model's (a split parameter counts on every tensor rank, a replicated one on tensor rank 0,
    /// the partial sums added over the data ranks, then the tensor ranks), an overflow on any
    /// rank of either skips the step on all, and the checkpoints record the rank and the splits.
    pub(crate) fn split_over_tensor_ranks(
        &mut self,
        tensor: Arc<dyn ProcessGroup>,
        split: &crate::optimizer::SplitRule,
    ) {
        let record = crate::optimizer::tensor_record(&self.layout, &tensor, split);
        let masks = (0..self.layout.groups.len())
            .map(|g| {
                if tensor.rank() == 0 {
                    return None;
                }
                let rank = match self.layout.groups[g].placement {
                    Placement::Replicated => 0,
                    Placement::Sharded => self.comm.rank(),
                };
                let mut mask = vec![0f32; self.groups[g].master.dims()[0]];
                for seg in self.layout.segments(g, rank) {
                    if record.splits.contains_key(&self.layout.params[seg.param].name) {
                        mask[seg.local].fill(1.0);
                    }
                }
                let len = mask.len();
                Some(Tensor::from_data(
                    burn::tensor::TensorData::new(mask, [len]),
                    &self.device,
                ))
            })
            .collect();
        let norms = TensorNorms::new(tensor.clone(), &self.layout, |p| {
            record.splits.contains_key(&self.layout.params[p].name)
        });
        self.tensor = Some(TensorRanks {
            agreement: Agreement::data_and_tensor(self.host.clone(), tensor.clone()),
            norms,
            record,
            group: tensor,
            masks,
        });
    }

    /// With tensor parallelism, this tensor rank and how the parameters are split.
    pub(crate) fn tensor_parallel(&self) -> Option<zero_core::checkpoint::TensorParallelRecord> {
        self.tensor.as_ref().map(|t| t.record.clone())
    }

    /// Writes each `(start, values)` of `writes` into the rank's fp32 masters of `group` from
    /// the owned range's offset `start`: values set in the module between steps
    /// (`ZeroModule::modify`, a parameter that does not train), which the next update starts
    /// from. The masters are put together once from the kept ranges and the new values (a
    /// copy per write would copy the whole group each time).
    pub(crate) fn write_masters(
        &mut self,
        group: usize,
        mut writes: Vec<(usize, Tensor<I, 1>)>,
    ) -> Result<(), ZeroError> {
        let state = self
            .groups
            .get_mut(group)
            .ok_or_else(|| ZeroError::Model(format!("no flat group {group}")))?;
        let len = state.master.dims()[0];
        writes.sort_by_key(|(start, _)| *start);
        let mut at = 0;
        for (start, values) in &writes {
            let end = start + values.dims()[0];
            if end > len || *start < at {
                return Err(ZeroError::Model(format!(
                    "flat group {group}: new master values {start}..{end} outside the {len} this rank holds, or \
                     over another write"
                )));
            }
            at = end;
        }
        let master = super::flat::take(&mut state.master);
        let mut pieces = Vec::with_capacity(2 * writes.len() + 1);
        let mut at = 0;
        for (start, values) in writes {
            let end = start + values.dims()[0];
            if start > at {
                pieces.push(master.clone().narrow(0, at, start - at));
            }
            pieces.push(values.cast(DType::F32));
            at = end;
        }
        if at < len {
            pieces.push(master.narrow(0, at, len - at));
        }
        state.master = match pieces.len() {
            // The whole group written: a buffer of its own, not a view of the module's.
            1 => super::cpu::own_buffer(pieces.pop().unwrap_or_else(|| unreachable!("one piece"))),
            _ => Tensor::cat(pieces, 0),
        };
        Ok(())
    }

    /// This rank's place in the device collective.
    pub(crate) fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks of the device collective.
    pub(crate) fn comm_world(&self) -> usize {
        self.comm.world_size()
    }

    /// Every rank's `shard` in rank order (a sharded group's whole padded masters).
    pub(crate) fn gather(&self, shard: Tensor<I, 1>) -> Result<Tensor<I, 1>, ZeroError> {
        self.comm.all_gather(shard)
    }

    /// The loss scale of the next backward (1 without fp16 loss scaling).
    pub(crate) fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// One optimizer step at learning rate `lr` from each group's gradient (`None`: no
    /// parameter of the group took part in the loss): a unit's owned shard, already averaged;
    /// any other group's whole padded vector, averaged here over the ranks (all-reduced when
    /// replicated, reduce-scattered to the owned range when sharded). A group none of whose
    /// parameters trains (`trains`, by group; the same on every rank) is neither reduced nor
    /// stepped. `loss_non_finite`: a micro-batch of this step had a non-finite loss.
    pub(crate) fn step(
        &mut self,
        grads: Vec<Option<Tensor<I, 1>>>,
        trains: &[bool],
        lr: f64,
        loss_non_finite: bool,
    ) -> Result<StepReport, ZeroError> {
        let step = self.global_step + 1;
        let loss_scale = self.loss_scale();
        // A cycled momentum follows the schedule's position: the applied steps, as the rate.
        if let Some(betas) = self.settings.betas_at(self.global_step - self.skipped_steps) {
            for g in self.groups.iter_mut().filter_map(|g| g.optimizer.as_mut()) {
                g.set_betas(betas);
            }
        }
        // The gradients Burn's backward left, from one backward to the next step: counted as
        // the latest step's.
        let bytes: usize = grads.iter().flatten().map(|g| g.dims()[0] * g.dtype().size()).sum();
        self.memory.sub_grads(self.grad_bytes);
        self.memory.add_grads(bytes);
        self.grad_bytes = bytes;
        let outcome = self
            .reduce(grads, trains)
            .and_then(|grads| self.apply_or_skip(grads, step, lr, loss_scale, loss_non_finite));
        self.global_step += 1;
        let grad_norm = match outcome {
            Ok(Some(norm)) => norm,
            Ok(None) => {
                self.skipped_steps += 1;
                f64::NAN
            }
            Err(e) => {
                self.skipped_steps += 1;
                return Err(e);
            }
        };
        Ok(StepReport {
            step,
            lr,
            grad_norm,
            skipped: grad_norm.is_nan(),
            loss_scale,
        })
    }

    /// Every training group's data-parallel mean gradient of its owned range, in fp32 (`None`
    /// for a group that does not train).
    fn reduce(
        &self,
        grads: Vec<Option<Tensor<I, 1>>>,
        trains: &[bool],
    ) -> Result<Vec<Option<Tensor<I, 1>>>, ZeroError> {
        let world = self.comm.world_size();
        let dtype = self.settings.precision.dtype.burn();
        let comm_dtype = self.settings.precision.comm_dtype().burn();
        let mut out = Vec::with_capacity(self.groups.len());
        for (gi, (state, grad)) in self.groups.iter().zip(grads).enumerate() {
            if !trains.get(gi).copied().unwrap_or(true) {
                out.push(None);
                continue;
            }
            let g = &self.layout.groups[gi];
            let expected = if state.unit {
                self.layout.owned_len(gi)
            } else {
                g.padded
            };
            let grad = match grad {
                Some(grad) if grad.dims()[0] != expected => {
                    return Err(ZeroError::Model(format!(
                        "flat group {gi}: a gradient of {} elements where the group has {expected}",
                        grad.dims()[0]
                    )))
                }
                Some(grad) => super::cpu::cast(grad, dtype),
                None => super::flat::zeros(expected, dtype, &self.device),
            };
            let reduced = match g.placement {
                _ if state.unit || world == 1 => grad,
                Placement::Replicated => self
                    .comm
                    .all_reduce(super::cpu::cast(grad, comm_dtype), ReduceOp::Avg)?,
                Placement::Sharded => self.comm.reduce_scatter_of(
                    super::cpu::cast(grad, comm_dtype),
                    ReduceOp::Avg,
                    crate::core::bucket(gi),
                )?,
            };
            out.push(Some(super::cpu::cast(reduced, DType::F32)));
        }
        Ok(out)
    }

    /// Checks for overflow, then either applies the step (returning the gradient norm) or
    /// decides to skip it (`None`), by the host engines' rules.
    fn apply_or_skip(
        &mut self,
        grads: Vec<Option<Tensor<I, 1>>>,
        step: u64,
        lr: f64,
        loss_scale: f64,
        loss_non_finite: bool,
    ) -> Result<Option<f64>, ZeroError> {
        let world = self.comm.world_size();
        let policy = self.settings.precision.non_finite;
        let check = self.scaler.is_some() || policy != NonFinitePolicy::Ignore;
        // One host read for the whole step: each group's sum of squares and, when overflow is
        // checked, its count of non-finite elements.
        let width = if check { 2 } else { 1 };
        // The groups that train, and their gradients.
        let (trained, grads): (Vec<usize>, Vec<Tensor<I, 1>>) =
            grads.into_iter().enumerate().filter_map(|(g, t)| Some((g, t?))).unzip();
        let stats = self.grad_stats(&grads, check);
        if check {
            let seen = if loss_non_finite {
                Some(NonFiniteSeen::Loss)
            } else if stats.chunks_exact(2).any(|s| s[1] > 0.0) {
                Some(NonFiniteSeen::Gradient)
            } else {
                None
            };
            let (mine, agreed) = match &self.tensor {
                Some(tensor) => tensor.agreement.agree(seen)?,
                None => {
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
                    (mine, agreed)
                }
            };
            if !crate::agreement::decide_step(&mut self.scaler, &self.settings, agreed, mine, step, loss_scale)? {
                return Ok(None);
            }
        }
        // Each group's sum of squares; under tensor parallelism, of the parameters this tensor
        // rank counts.
        let mut sums: Vec<f64> = stats.chunks_exact(width).map(|s| s[0]).collect();
        if let Some(tensor) = self.tensor.as_ref().filter(|t| t.masks.iter().any(Option::is_some)) {
            let counted: Vec<Tensor<I, 1>> = grads
                .iter()
                .zip(&trained)
                .map(|(g, &gi)| {
                    tensor.masks[gi]
                        .as_ref()
                        .map_or_else(|| g.clone(), |m| g.clone() * m.clone())
                })
                .collect();
            sums = self.grad_stats(&counted, false);
        }
        // Sharded groups' partial sums add over ranks; replicated groups are whole everywhere.
        let (mut sharded, mut replicated) = (0.0f64, 0.0f64);
        for (&gi, s) in trained.iter().zip(sums) {
            match self.layout.groups[gi].placement {
                Placement::Sharded => sharded += s,
                Placement::Replicated => replicated += s,
            }
        }
        // Only sharded groups have partial sums to add (none at stage 0).
        let any_sharded = self.layout.groups.iter().any(|g| g.placement == Placement::Sharded);
        if world > 1 && any_sharded {
            let mut total = [sharded as f32];
            self.comm.all_reduce_scalars(&mut total, ReduceOp::Sum)?;
            sharded = total[0] as f64;
        }
        let mut total = sharded + replicated;
        if let Some(tensor) = self.tensor.as_ref().filter(|t| t.group.world_size() > 1) {
            let mut b = zero_core::comm::FlatBuffer::F32(vec![total as f32]);
            tensor.group.all_reduce(&mut b, ReduceOp::Sum)?;
            total = b.into_f32()[0] as f64;
        }
        let unscale = 1.0 / loss_scale;
        let grad_norm = total.sqrt() * unscale;
        let max_norm = self.settings.gradient_clipping;
        // torch.nn.utils.clip_grad_norm_'s rule: scale by max/(norm + 1e-6) when that is below 1.
        let ratio = max_norm / (grad_norm + 1e-6);
        let clip = if max_norm > 0.0 && ratio < 1.0 { ratio } else { 1.0 };
        let coef = (unscale * clip) as f32;
        // A group without optimizer state (its parameters had not trained) gets it, all zero, as
        // an optimizer's before its first step: every one before any group steps.
        for &gi in &trained {
            let state = &mut self.groups[gi];
            if state.optimizer.is_some() {
                continue;
            }
            let len = state.master.dims()[0];
            let segments = crate::optimizer_bridge::shard_segments(&self.layout, gi, self.comm.rank());
            let mut optimizer = DeviceOptimizer::from_spec(&self.settings.optimizer, len, &segments, &self.device)?;
            if let Some(betas) = self.settings.betas_at(self.global_step - self.skipped_steps) {
                optimizer.set_betas(betas);
            }
            self.memory.add_optimizer(optimizer.state_bytes());
            state.optimizer = Some(optimizer);
        }
        for (gi, grad) in trained.into_iter().zip(grads) {
            // A sharded group's tensors may be cut between ranks (LAMB sums their norms).
            let across = (self.layout.groups[gi].placement == Placement::Sharded).then_some(self.comm.as_ref());
            let grad = if coef != 1.0 { grad.mul_scalar(coef) } else { grad };
            let state = &mut self.groups[gi];
            let optimizer = state.optimizer.as_mut().unwrap_or_else(|| unreachable!("made above"));
            optimizer.check(&state.master, &grad)?;
            // Taken out, so that the optimizer may update the only handle in place (the check
            // above is all that could fail).
            let master = super::flat::take(&mut state.master);
            let norms = self.tensor.as_ref().map(|t| (&t.norms, gi));
            state.master = optimizer.step(master, grad, lr, across, norms)?;
        }
        Ok(Some(grad_norm))
    }

    /// Each group's sum of squares, followed with `check` by its count of non-finite elements,
    /// read on the host in one go.
    fn grad_stats(&self, grads: &[Tensor<I, 1>], check: bool) -> Vec<f64> {
        // The CPU backend: one pass over each gradient's own storage.
        let host: Option<Vec<(f64, usize)>> = grads
            .iter()
            .map(|g| super::cpu::with_slice(g, |g| zero_core::passes::stats(g, check)))
            .collect();
        if let Some(host) = host {
            return host
                .into_iter()
                .flat_map(|(sum, bad)| [sum, bad as f64].into_iter().take(if check { 2 } else { 1 }))
                .collect();
        }
        let mut stats = Vec::with_capacity(2 * grads.len());
        for g in grads {
            stats.push((g.clone() * g.clone()).sum());
            if check {
                stats.push(g.clone().is_finite().bool_not().float().sum().cast(DType::F32));
            }
        }
        if stats.is_empty() {
            return Vec::new();
        }
        crate::params::tensor_to_vec(Tensor::cat(stats, 0))
            .into_iter()
            .map(f64::from)
            .collect()
    }

    /// The values of the groups `wanted` marks (by group; `None` for the others) in the
    /// compute dtype, for the module: a unit's owned shard; any other group whole (its masters
    /// gathered over the ranks when sharded), padding included.
    pub(crate) fn values(&self, wanted: &[bool]) -> Result<Vec<Option<Tensor<I, 1>>>, ZeroError> {
        let world = self.comm.world_size();
        let dtype = self.settings.precision.dtype.burn();
        let mut out = Vec::with_capacity(self.groups.len());
        for (gi, state) in self.groups.iter().enumerate() {
            if !wanted.get(gi).copied().unwrap_or(true) {
                out.push(None);
                continue;
            }
            let shard = super::cpu::cast(state.master.clone(), dtype);
            out.push(Some(match self.layout.groups[gi].placement {
                Placement::Sharded if world > 1 && !state.unit => self.comm.all_gather(shard)?,
                _ => shard,
            }));
        }
        Ok(out)
    }

    /// The host group checkpoints travel over.
    pub(crate) fn host_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.host
    }

    /// The device the state is on.
    pub(crate) fn device(&self) -> &I::Device {
        &self.device
    }

    /// Every group's fp32 master shard and optimizer (none before the group's first step), in
    /// group order.
    pub(crate) fn shards(&self) -> impl Iterator<Item = (&Tensor<I, 1>, Option<&DeviceOptimizer<I>>)> {
        self.groups.iter().map(|g| (&g.master, g.optimizer.as_ref()))
    }

    /// fp16's loss-scaler state, for a checkpoint.
    pub(crate) fn scaler_state(&self) -> Option<zero_core::loss_scaler::LossScalerState> {
        self.scaler.as_ref().map(|s| s.state())
    }

    /// Replaces every group's master shard and optimizer (a loaded checkpoint's), the step
    /// counts (all, and skipped) and the loss scaler's state.
    pub(crate) fn restore(
        &mut self,
        groups: Vec<(Tensor<I, 1>, Option<DeviceOptimizer<I>>)>,
        global_step: u64,
        skipped_steps: u64,
        scaler: Option<zero_core::loss_scaler::LossScalerState>,
    ) {
        for (state, (master, optimizer)) in self.groups.iter_mut().zip(groups) {
            let bytes = |o: &Option<DeviceOptimizer<I>>| o.as_ref().map_or(0, DeviceOptimizer::state_bytes);
            self.memory.sub_optimizer(bytes(&state.optimizer));
            self.memory.add_optimizer(bytes(&optimizer));
            (state.master, state.optimizer) = (master, optimizer);
        }
        self.global_step = global_step;
        self.skipped_steps = skipped_steps;
        self.lineage.loaded_at(global_step);
        if let (Some(s), Some(state)) = (self.scaler.as_mut(), scaler) {
            s.load_state(state);
        }
    }
}
