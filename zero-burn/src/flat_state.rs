//! The rank's share of the training state, on flat host buffers: fp32 master weights, gradient
//! accumulators (in the compute dtype: 16-bit under bf16/fp16) and optimizer state for every
//! group of the partition layout, the 16-bit copy of the owned masters that stage 3 gathers, and
//! the update that turns reduced gradients into new weights.
//!
//! This is where a gradient goes after `backward`: into a group's accumulator (whole, or already
//! reduced to the rank's shard), then through the boundary reduction, the global-norm clip and
//! the optimizer, into the master weights.

use crate::agreement::TensorNorms;
use crate::error::ZeroError;
use crate::half_buffer;
use crate::memory::MemoryTracker;
use crate::optimizer_bridge::{GroupOptimizer, OptimizerFactory};
use crate::settings::{ComputeDtype, OptimizerOffload};
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp};
use zero_core::offload::{stream_chunks, SwapFile, SwapRegion};
use zero_core::optim::{CpuPool, HalfCopy};
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
    /// fp32 master weights of the owned range (empty when they are swapped to NVMe).
    pub master: Vec<f32>,
    /// Gradient accumulator, in the accumulation dtype: the whole padded group
    /// (AccumulateThenReduce) or the owned slice.
    pub grad: FlatBuffer,
    /// How gradients arrive.
    pub flow: GradFlow,
    /// Optimizer over `master`: dormant (no state) for a group in memory whose parameters have
    /// not trained yet, made whole at its first gradient.
    pub optimizer: GroupOptimizer,
    /// The owned masters in the 16-bit compute dtype, written by the optimizer step in the same
    /// pass (`None` when parameters are not sharded or are fp32). With the masters on NVMe it
    /// is always there, in the compute dtype (fp32 included): the step's output, read once to
    /// write the model's new values. Empty (of its dtype) once released
    /// ([`FlatState::release_param_copies`]) until the next step writes it again.
    pub half: Option<FlatBuffer>,
}

/// Masters and optimizer state swapped to a file: where each group's chunks are, and the host
/// buffers they stream through.
struct NvmeState {
    file: SwapFile,
    regions: Vec<SwapRegion>,
    buffer_count: usize,
    buffers: Vec<Vec<f32>>,
}

/// The optimizer step's placement: its own thread pool (CPU and NVMe offload) and the swap file
/// (NVMe).
#[derive(Default)]
struct OffloadState {
    pool: Option<CpuPool>,
    nvme: Option<NvmeState>,
}

/// The dtypes of the flat state besides the fp32 masters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StateDtypes {
    /// Gradient accumulators.
    pub accumulate: ComputeDtype,
    /// Keep a 16-bit copy of the owned masters in this dtype (stage 3 under bf16/fp16).
    pub half_shard: Option<ComputeDtype>,
    /// Gradient reductions.
    pub communicate: ComputeDtype,
}

/// The rank's state for all groups.
pub(crate) struct FlatState {
    pub layout: PartitionLayout,
    pub groups: Vec<GroupState>,
    pub dtypes: StateDtypes,
    offload: OffloadState,
    /// The parameter copies (`half`) are in host memory beside an offloaded optimizer's state
    /// (how the memory report counts them).
    copies_on_host: bool,
    /// With tensor parallelism, LAMB's norms over the tensor ranks.
    pub tensor_norms: Option<TensorNorms>,
    /// By group, whether any of its parameters trains (empty: every group does). A group that
    /// does not is neither reduced nor stepped and holds no gradient accumulator; its masters
    /// and optimizer state stay as they are (in memory, a dormant optimizer until its first
    /// gradient). Set with [`FlatState::set_trains`].
    trains: Vec<bool>,
    /// What makes a dormant group's optimizer, and this rank's place.
    factory: OptimizerFactory,
    rank: usize,
    /// The betas a schedule set last (a dormant group's optimizer takes them when made).
    betas: Option<(f64, f64)>,
    /// A delayed update ([`FlatState::launch`]) running on its own thread: it holds `groups`
    /// and `offload` (left empty here) until [`FlatState::settle`] takes them back.
    in_flight: Option<std::thread::JoinHandle<Landed>>,
}

/// What a delayed update's thread hands back: the groups and the offload state it stepped, and
/// how the step went.
struct Landed {
    groups: Vec<GroupState>,
    offload: OffloadState,
    outcome: Result<(), ZeroError>,
}

impl FlatState {
    /// Builds the state from the full initial values of every parameter (`values(i)`), keeping
    /// only the owned ranges. `trains`: by group, whether its parameters train (empty: all do);
    /// one that does not gets no accumulator and, in memory, a dormant optimizer.
    // Each argument is a separate part of the engine's setup, passed once at construction.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layout: PartitionLayout,
        rank: usize,
        flows: impl Fn(usize) -> GradFlow,
        factory: &OptimizerFactory,
        mut values: impl FnMut(usize) -> Vec<f32>,
        memory: &MemoryTracker,
        dtypes: StateDtypes,
        offload: &OptimizerOffload,
        trains: Vec<bool>,
    ) -> Result<Self, ZeroError> {
        let mut groups = Vec::with_capacity(layout.groups.len());
        let (pool_threads, swap) = match offload {
            OptimizerOffload::None => (None, None),
            OptimizerOffload::Cpu { threads } => (Some(*threads), None),
            OptimizerOffload::Nvme {
                path,
                buffer_count,
                chunk_elements,
                threads,
            } => {
                let file = SwapFile::create(path, &format!("zero_optimizer_rank{rank}"))?;
                (
                    Some(*threads),
                    Some((file, (*buffer_count).max(1), (*chunk_elements).max(1))),
                )
            }
        };
        let mut regions = Vec::new();
        let mut file_elements = 0u64;
        let mut widest_chunk = 0usize;
        let mut widest_width = 0usize;
        if pool_threads.is_some() {
            memory.set_optimizer_on_host();
        }
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
                let full = pending[seg.param].as_deref().unwrap_or(&[]);
                master[seg.local.clone()].copy_from_slice(&full[seg.in_param.clone()]);
            }
            // Release parameters whose every piece has been copied.
            for &p in &layout.groups[gi].params {
                pending[p] = None;
            }
            let flow = flows(gi);
            let trained = trains.get(gi).copied().unwrap_or(true);
            let grad_len = match flow {
                _ if !trained => 0,
                GradFlow::AccumulateThenReduce => layout.groups[gi].padded,
                GradFlow::ReduceThenAccumulate => owned.len(),
            };
            memory.add_grads(grad_len * dtypes.accumulate.size());
            let (master, optimizer, half) = match &swap {
                None => {
                    let optimizer = if trained {
                        factory.build(&layout, gi, rank)?
                    } else {
                        factory.build_dormant()?
                    };
                    memory.add_master(master.len() * 4);
                    memory.add_optimizer(optimizer.state_bytes());
                    let half = dtypes.half_shard.map(|d| FlatBuffer::from_f32(&master, d.flat()));
                    (master, optimizer, half)
                }
                Some((file, _, chunk_elements)) => {
                    let chunk = (*chunk_elements).min(master.len());
                    let optimizer = factory.build_chunked(gi)?;
                    let width = 1 + optimizer.state_width();
                    let region = SwapRegion::new(file_elements, master.len(), width, chunk.max(1));
                    // Fresh state is zero, like an in-memory optimizer's.
                    let zeros = vec![0.0f32; master.len()];
                    let mut buffers: Vec<&[f32]> = vec![&master];
                    buffers.extend(std::iter::repeat_n(zeros.as_slice(), width - 1));
                    file.write_region(&region, &buffers)?;
                    file_elements += region.elements();
                    widest_chunk = widest_chunk.max(chunk * width);
                    widest_width = widest_width.max(width);
                    regions.push(region);
                    // The chunk optimizer's scratch state (one chunk's worth, for one group at a
                    // time) is counted with the host buffers below.
                    memory.add_nvme_master(master.len() * 4);
                    memory.add_nvme_optimizer(master.len() * 4 * (width - 1));
                    let param_dtype = dtypes.half_shard.unwrap_or(dtypes.accumulate);
                    let half = Some(FlatBuffer::from_f32(&master, param_dtype.flat()));
                    (Vec::new(), optimizer, half)
                }
            };
            if let Some(h) = &half {
                // The copy of the owned values in the compute dtype (the masters on NVMe): in
                // host memory beside an offloaded optimizer's state.
                if *offload == OptimizerOffload::None {
                    memory.add_parameters(h.byte_len());
                } else {
                    memory.add_host_parameters(h.byte_len());
                }
            }
            let grad = half_buffer::zeros(dtypes.accumulate, grad_len);
            groups.push(GroupState {
                master,
                grad,
                flow,
                optimizer,
                half,
            });
        }
        let pool = pool_threads
            .map(|t| {
                let threads = if t == 0 {
                    std::thread::available_parallelism().map_or(1, |n| n.get())
                } else {
                    t
                };
                CpuPool::new(threads).map_err(|e| ZeroError::Optimizer(format!("offload_optimizer: {e}")))
            })
            .transpose()?;
        let nvme = swap.map(|(file, buffer_count, _)| {
            // The host buffers are allocated once, here, and counted as host optimizer memory.
            // A group streams through at most as many buffers as it has chunks: more would
            // never be filled (a small model's one-chunk groups need one).
            let buffer_count = buffer_count.min(regions.iter().map(|r| r.chunks()).max().unwrap_or(1).max(1));
            let buffers: Vec<Vec<f32>> = (0..buffer_count).map(|_| vec![0.0f32; widest_chunk]).collect();
            // The scratch optimizer of the group being stepped: its state buffers for one chunk.
            let scratch = widest_chunk / widest_width.max(1) * widest_width.saturating_sub(1) * 4;
            memory.add_optimizer(buffer_count * widest_chunk * 4 + scratch);
            NvmeState {
                file,
                regions,
                buffer_count,
                buffers,
            }
        });
        Ok(FlatState {
            layout,
            groups,
            dtypes,
            offload: OffloadState { pool, nvme },
            copies_on_host: *offload != OptimizerOffload::None,
            tensor_norms: None,
            trains,
            factory: factory.clone(),
            rank,
            betas: None,
            in_flight: None,
        })
    }

    /// Whether the state is told which groups train ([`FlatState::set_trains`]): only then may
    /// a group's optimizer be dormant.
    pub fn tracks_trains(&self) -> bool {
        !self.trains.is_empty()
    }

    /// Which groups train from now on (by group; see [`FlatState::trains`]): a group that
    /// starts training gets its accumulator (its optimizer state comes at its first step); one
    /// that stops gives its accumulator back and keeps its optimizer state. Call it at a
    /// boundary (the accumulators empty).
    pub fn set_trains(&mut self, trains: Vec<bool>, memory: &MemoryTracker) {
        for gi in 0..self.groups.len() {
            let (was, now) = (self.group_trains(gi), trains.get(gi).copied().unwrap_or(true));
            if was == now {
                continue;
            }
            let bytes = self.accumulator_len(gi) * self.dtypes.accumulate.size();
            let len = if now { self.accumulator_len(gi) } else { 0 };
            self.groups[gi].grad = half_buffer::zeros(self.dtypes.accumulate, len);
            if now {
                memory.add_grads(bytes);
            } else {
                memory.sub_grads(bytes);
            }
        }
        self.trains = trains;
    }

    /// Whether group `group` trains this step ([`FlatState::trains`]).
    pub fn group_trains(&self, group: usize) -> bool {
        self.trains.get(group).copied().unwrap_or(true)
    }

    /// Whether the masters and optimizer state are in a swap file.
    pub fn swapped(&self) -> bool {
        self.offload.nvme.is_some()
    }

    /// The rank's values of `group` in the compute dtype, when a copy apart from the masters is
    /// held now. `None`: read them from the masters.
    pub fn param_shard(&self, group: usize) -> Option<FlatBuffer> {
        let owned = self.layout.owned_len(group);
        self.groups[group].half.clone().filter(|h| h.len() == owned)
    }

    /// Frees every parameter copy kept apart from the masters until the next step writes it
    /// again: the model holds the values now (a `ZeroModule` unit its shard, in its store under
    /// `offload_param`), and a reader in between takes them from the masters.
    pub fn release_param_copies(&mut self, memory: &MemoryTracker) {
        for g in &mut self.groups {
            let Some(h) = &mut g.half else { continue };
            if h.is_empty() {
                continue;
            }
            if self.copies_on_host {
                memory.sub_host_parameters(h.byte_len());
            } else {
                memory.sub_parameters(h.byte_len());
            }
            *h = FlatBuffer::from_f32(&[], h.dtype());
        }
    }

    /// Allocates group `group`'s parameter copy again if it was released, for the step to
    /// write.
    fn restore_param_copy(&mut self, group: usize, memory: &MemoryTracker) {
        let owned = self.layout.owned_len(group);
        let Some(h) = &mut self.groups[group].half else { return };
        if h.len() == owned {
            return;
        }
        *h = FlatBuffer::zeros(h.dtype(), owned);
        if self.copies_on_host {
            memory.add_host_parameters(h.byte_len());
        } else {
            memory.add_parameters(h.byte_len());
        }
    }

    /// Swapped state: group `group`'s masters, then each optimizer buffer (in the order of its
    /// optimizer's `state()`), read from the swap file chunk by chunk. `None` when the state is
    /// in memory.
    pub fn read_swapped_group(&self, group: usize) -> Result<Option<Vec<Vec<f32>>>, ZeroError> {
        let Some(nvme) = &self.offload.nvme else {
            return Ok(None);
        };
        Ok(Some(nvme.file.read_region(&nvme.regions[group])?))
    }

    /// Swapped state: replaces group `group`'s masters and optimizer buffers in the swap file
    /// (`buffers` as [`FlatState::read_swapped_group`] returns them), chunk by chunk.
    pub fn write_swapped_group(&self, group: usize, buffers: &[&[f32]]) -> Result<(), ZeroError> {
        let Some(nvme) = &self.offload.nvme else {
            return Err(ZeroError::Usage(format!(
                "group {group}: writing swapped state of an engine whose state is in memory"
            )));
        };
        Ok(nvme.file.write_region(&nvme.regions[group], buffers)?)
    }

    /// Puts a restored group in place: its owned masters, its optimizer, and (swapped state
    /// only) the optimizer's buffers in the order of its `state()`, which go to the swap file
    /// with the masters. The parameter shard is derived from the masters.
    pub fn restore_group(
        &mut self,
        group: usize,
        master: Vec<f32>,
        optimizer: GroupOptimizer,
        swapped_state: Option<Vec<Vec<f32>>>,
        memory: &MemoryTracker,
    ) -> Result<(), ZeroError> {
        let g = &mut self.groups[group];
        if let Some(half) = &mut g.half {
            // A copy released since the step is held again: counted again.
            let released = half.is_empty();
            *half = FlatBuffer::from_f32(&master, half.dtype());
            if released && self.copies_on_host {
                memory.add_host_parameters(half.byte_len());
            } else if released {
                memory.add_parameters(half.byte_len());
            }
        }
        memory.sub_optimizer(g.optimizer.state_bytes());
        memory.add_optimizer(optimizer.state_bytes());
        g.optimizer = optimizer;
        match swapped_state {
            None => g.master = master,
            Some(state) => {
                let mut buffers: Vec<&[f32]> = vec![&master];
                buffers.extend(state.iter().map(Vec::as_slice));
                self.write_swapped_group(group, &buffers)?;
            }
        }
        Ok(())
    }

    /// Adds a micro-batch gradient of the whole (padded) group, `scale` times.
    ///
    /// For `ReduceThenAccumulate` groups the caller reduce-scatters first and calls
    /// [`FlatState::add_owned`] instead.
    pub fn add_full(&mut self, group: usize, full: &[f32]) {
        let g = &mut self.groups[group];
        debug_assert_eq!(g.flow, GradFlow::AccumulateThenReduce);
        half_buffer::add_into(&mut g.grad, full);
    }

    /// Adds an already reduced gradient of the owned slice.
    pub fn add_owned(&mut self, group: usize, owned: &[f32]) {
        half_buffer::add_into(&mut self.groups[group].grad, owned);
    }

    /// At the accumulation boundary: reduces the locally accumulated groups so that every
    /// group's `grad` holds the data-parallel mean gradient of its owned range.
    pub fn reduce_at_boundary(&mut self, group_comm: &dyn ProcessGroup) -> Result<(), ZeroError> {
        let world = group_comm.world_size();
        for gi in 0..self.groups.len() {
            if self.groups[gi].flow != GradFlow::AccumulateThenReduce || world == 1 || !self.group_trains(gi) {
                continue;
            }
            let accumulated = std::mem::replace(&mut self.groups[gi].grad, FlatBuffer::F32(Vec::new()));
            let full = half_buffer::convert(accumulated, self.dtypes.communicate.flat());
            let reduced = match self.layout.groups[gi].placement {
                Placement::Replicated => {
                    let mut b = full;
                    group_comm.all_reduce(&mut b, ReduceOp::Avg)?;
                    b
                }
                Placement::Sharded => group_comm
                    .reduce_scatter_of_async(full, ReduceOp::Avg, crate::core::bucket(gi))
                    .wait()?,
            };
            self.groups[gi].grad = reduced;
        }
        Ok(())
    }

    /// Takes every group's reduced gradient of the owned range out of the accumulators, as f32
    /// (valid after [`FlatState::reduce_at_boundary`]; [`FlatState::reset_accumulators`] gives
    /// the accumulators back); none for a group that does not train.
    pub fn take_owned_grads(&mut self) -> Vec<Vec<f32>> {
        let trains: Vec<bool> = (0..self.groups.len()).map(|g| self.group_trains(g)).collect();
        self.groups
            .iter_mut()
            .enumerate()
            .map(|(gi, g)| {
                if !trains[gi] {
                    return Vec::new();
                }
                let grad = std::mem::replace(&mut g.grad, FlatBuffer::F32(Vec::new())).into_f32();
                debug_assert_eq!(grad.len(), self.layout.owned_len(gi), "gradient not reduced yet");
                grad
            })
            .collect()
    }

    /// Global L2 norm of `grads` (every group's owned slice) over every rank.
    pub fn global_grad_norm(&self, grads: &[Vec<f32>], group_comm: &dyn ProcessGroup) -> Result<f64, ZeroError> {
        let mut sharded = 0.0f64;
        let mut replicated = 0.0f64;
        for (gi, grad) in grads.iter().enumerate() {
            let sum = zero_core::passes::sum_squares(grad);
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

    /// Multiplies the gradients by `coef` (unscaling and clipping in one pass), runs the
    /// optimizer on every group that trains (refreshing the 16-bit shards in the same pass), and
    /// gives the accumulators back.
    pub fn apply(
        &mut self,
        mut grads: Vec<Vec<f32>>,
        coef: f32,
        lr: f64,
        group_comm: &dyn ProcessGroup,
        memory: &MemoryTracker,
    ) -> Result<(), ZeroError> {
        let trains = self.prepare_update(memory)?;
        let norms = self.tensor_norms.as_ref();
        step_groups(
            &mut self.groups,
            &mut self.offload,
            &trains,
            &mut grads,
            coef,
            lr,
            group_comm,
            norms,
        )?;
        self.reset_accumulators();
        Ok(())
    }

    /// [`FlatState::apply`] on a thread of its own, returning at once: the update of a delayed
    /// step (`offload_optimizer.delayed_update`), which runs while the model computes the next
    /// step's gradients. The groups go with it; [`FlatState::settle`] waits for it and takes
    /// them back, and nothing else may touch the groups before (the engine settles first).
    /// Refused for an optimizer whose step communicates (LAMB's trust ratios sum norms over the
    /// ranks): its collectives would run beside the next step's.
    pub fn launch(
        &mut self,
        mut grads: Vec<Vec<f32>>,
        coef: f32,
        lr: f64,
        group_comm: Arc<dyn ProcessGroup>,
        memory: &MemoryTracker,
    ) -> Result<(), ZeroError> {
        self.settle()?;
        let trains = self.prepare_update(memory)?;
        let communicates = self.tensor_norms.is_some()
            || self
                .groups
                .iter()
                .zip(&trains)
                .any(|(g, &t)| t && g.optimizer.inner.needs_cross_rank_norms());
        if communicates {
            return Err(crate::settings::delayed_update_communicates());
        }
        let mut groups = std::mem::take(&mut self.groups);
        let mut offload = std::mem::take(&mut self.offload);
        let thread = std::thread::Builder::new()
            .name("zero-delayed-step".into())
            .spawn(move || {
                let outcome = step_groups(
                    &mut groups,
                    &mut offload,
                    &trains,
                    &mut grads,
                    coef,
                    lr,
                    group_comm.as_ref(),
                    None,
                );
                Landed {
                    groups,
                    offload,
                    outcome,
                }
            })
            .map_err(|e| {
                ZeroError::Optimizer(format!(
                    "offload_optimizer: cannot start the delayed step's thread: {e}"
                ))
            })?;
        self.in_flight = Some(thread);
        Ok(())
    }

    /// Waits for the delayed update [`FlatState::launch`] started, if one is running, and takes
    /// its groups back (their accumulators given back). `true` when there was one; its error
    /// when its step failed.
    pub fn settle(&mut self) -> Result<bool, ZeroError> {
        let Some(thread) = self.in_flight.take() else {
            return Ok(false);
        };
        let landed = thread.join().map_err(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            ZeroError::Optimizer(format!("the delayed optimizer step panicked: {what}"))
        })?;
        self.groups = landed.groups;
        self.offload = landed.offload;
        self.reset_accumulators();
        landed.outcome.map(|()| true)
    }

    /// Before an update: a dormant optimizer of a group that trains now gets its state, and a
    /// released parameter copy is allocated again for the step to write. Returns, by group,
    /// whether it trains.
    fn prepare_update(&mut self, memory: &MemoryTracker) -> Result<Vec<bool>, ZeroError> {
        let trains: Vec<bool> = (0..self.groups.len()).map(|g| self.group_trains(g)).collect();
        for gi in (0..self.groups.len()).filter(|&g| trains[g]) {
            // A dormant optimizer (its parameters had not trained) gets its state, all zero, as
            // an optimizer's before its first step.
            if self.groups[gi].optimizer.is_dormant() {
                let mut optimizer = self.factory.build(&self.layout, gi, self.rank)?;
                if let Some(betas) = self.betas {
                    optimizer.set_betas(betas);
                }
                memory.add_optimizer(optimizer.state_bytes());
                self.groups[gi].optimizer = optimizer;
            }
            self.restore_param_copy(gi, memory);
        }
        Ok(trains)
    }

    /// Elements of group `group`'s gradient accumulator (in `dtypes.accumulate`): the whole
    /// padded group when it is reduced at the boundary, else the owned slice.
    pub fn accumulator_len(&self, group: usize) -> usize {
        match self.groups[group].flow {
            GradFlow::AccumulateThenReduce => self.layout.groups[group].padded,
            GradFlow::ReduceThenAccumulate => self.layout.owned_len(group),
        }
    }

    /// Sets every group's optimizer betas for the steps to come (a schedule that cycles the
    /// momentum).
    pub fn set_betas(&mut self, betas: (f64, f64)) {
        self.betas = Some(betas);
        for g in &mut self.groups {
            g.optimizer.set_betas(betas);
        }
    }

    /// Zeroes the accumulators and gives AccumulateThenReduce groups back their whole-group
    /// length (the boundary reduction shrank them to the owned slice).
    pub fn reset_accumulators(&mut self) {
        for gi in 0..self.groups.len() {
            self.reset_accumulator(gi);
        }
    }

    /// [`FlatState::reset_accumulators`] for one group (none for a group that does not train).
    fn reset_accumulator(&mut self, group: usize) {
        let len = if self.group_trains(group) {
            self.accumulator_len(group)
        } else {
            0
        };
        self.groups[group].grad = half_buffer::zeros(self.dtypes.accumulate, len);
    }
}

/// Scales the gradients by `coef` and steps every group that `trains` marks, in the optimizer's
/// pool when it has one (so that the step keeps to its threads): from memory, or streamed
/// through the swap file.
#[allow(clippy::too_many_arguments)]
fn step_groups(
    groups: &mut [GroupState],
    offload: &mut OffloadState,
    trains: &[bool],
    grads: &mut [Vec<f32>],
    coef: f32,
    lr: f64,
    group_comm: &dyn ProcessGroup,
    norms: Option<&TensorNorms>,
) -> Result<(), ZeroError> {
    let OffloadState { pool, nvme } = offload;
    let mut run = || -> Result<(), ZeroError> {
        if coef != 1.0 {
            for grad in grads.iter_mut() {
                zero_core::passes::scale(grad, coef);
            }
        }
        for gi in (0..groups.len()).filter(|&g| trains[g]) {
            match nvme {
                None => step_group_in_memory(&mut groups[gi], &grads[gi], lr, group_comm, norms.map(|n| (n, gi)))?,
                Some(nvme) => step_swapped(std::slice::from_mut(&mut groups[gi]), nvme, gi, &grads[gi..=gi], lr)?,
            }
        }
        Ok(())
    };
    match pool {
        Some(pool) => pool.install(run),
        None => run(),
    }
}

/// One optimizer step of one group on in-memory masters and state (also writing the parameter
/// shard kept apart from the masters, if any).
fn step_group_in_memory(
    g: &mut GroupState,
    grad: &[f32],
    lr: f64,
    comm: &dyn ProcessGroup,
    tensor: Option<(&TensorNorms, usize)>,
) -> Result<(), ZeroError> {
    let out = match &mut g.half {
        None => HalfCopy::None,
        Some(FlatBuffer::BF16(h)) => HalfCopy::Bf16(h),
        Some(FlatBuffer::F16(h)) => HalfCopy::F16(h),
        Some(FlatBuffer::F32(_)) => HalfCopy::None,
    };
    g.optimizer.step(&mut g.master, grad, lr, comm, tensor, out)?;
    // An fp32 shard kept apart from the masters (parameter offload) is their copy.
    if let Some(FlatBuffer::F32(h)) = &mut g.half {
        h.copy_from_slice(&g.master);
    }
    Ok(())
}

/// One optimizer step of every group (`groups` starting at group `first`) with masters and state
/// streamed from the swap file: each
/// chunk is read, stepped (writing the new parameter shard in the compute dtype), written back.
fn step_swapped(
    groups: &mut [GroupState],
    nvme: &mut NvmeState,
    first: usize,
    grads: &[Vec<f32>],
    lr: f64,
) -> Result<(), ZeroError> {
    for ((g, grad), region) in groups.iter_mut().zip(grads).zip(&nvme.regions[first..]) {
        let GroupState { optimizer, half, .. } = g;
        stream_chunks(&nvme.file, region, nvme.buffer_count, &mut nvme.buffers, |c, chunk| {
            let range = region.chunk_range(c);
            let n = range.len();
            match half {
                Some(FlatBuffer::BF16(h)) => {
                    optimizer.step_chunk(chunk, &grad[range.clone()], lr, HalfCopy::Bf16(&mut h[range]))
                }
                Some(FlatBuffer::F16(h)) => {
                    optimizer.step_chunk(chunk, &grad[range.clone()], lr, HalfCopy::F16(&mut h[range]))
                }
                Some(FlatBuffer::F32(h)) => {
                    optimizer.step_chunk(chunk, &grad[range.clone()], lr, HalfCopy::None)?;
                    h[range].copy_from_slice(&chunk[..n]);
                    Ok(())
                }
                None => optimizer.step_chunk(chunk, &grad[range], lr, HalfCopy::None),
            }
        })?;
        optimizer.end_swapped_step();
    }
    Ok(())
}
