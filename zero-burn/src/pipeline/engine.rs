//! Training one pipeline stage: the 1F1B schedule over the step's micro-batches, the stage's
//! parameters as one ZeRO flat state over its data-parallel group, tied weights, and the global
//! gradient norm.

use super::channel::Channel;
use super::layer::{PipeHidden, PipeLayer};
use super::module::PipelineModule;
use super::recompute::Checkpoints;
use super::schedule::{one_f_one_b, PipeOp};
use crate::chain::Hidden;
use crate::core::{EngineCore, StepReport};
use crate::error::ZeroError;
use crate::flat_state::{FlatState, GradFlow};
use crate::half_buffer;
use crate::memory::MemoryTracker;
use crate::params::{describe, fresh_leaves, read_values, skeleton, take_grads, write_data};
use crate::settings::{EngineSettings, Stage};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zero_core::checkpoint::TensorParallelRecord;
use zero_core::comm::{FlatBuffer, ReduceOp, SharedGroup};
use zero_core::parallel::{Axis, RankGroups};
use zero_core::partition::{LayoutBuilder, ParamSpec, Placement};

/// What one optimizer step of the pipeline did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PipelineStep {
    /// The full model's loss: the mean over the step's micro-batches and data-parallel ranks,
    /// the same on every stage.
    pub loss: f32,
    /// The optimizer step (its gradient norm is the whole model's).
    pub report: StepReport,
}

/// When a stage was computing during the last step: one span per forward or backward, from
/// the moment its input was there to the moment its output was handed on (waits for a
/// neighbour are outside the spans).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpSpan {
    /// The operation.
    pub op: PipeOp,
    /// Start, from the start of the step's schedule.
    pub start: Duration,
    /// End, from the start of the step's schedule.
    pub end: Duration,
}

/// A micro-batch between its forward and its backward.
struct InFlight<B: AutodiffBackend, L: PipeLayer<B>> {
    /// The layers' leaves this micro-batch's graph was built on.
    layers: Vec<L>,
    /// The stage's input leaf (none on the first stage).
    input: Option<L::Hidden>,
    output: Output<B, L::Hidden>,
    /// Under activation checkpointing, the middle layers' kept segment inputs: the output's
    /// graph then starts after them.
    checkpoints: Option<Checkpoints<L::Hidden>>,
}

/// What a micro-batch's backward starts from.
enum Seed<B: AutodiffBackend, H> {
    /// The last stage: the loss, scaled for backward.
    Loss(Tensor<B, 1>),
    /// The other stages: the output sent on, and its gradient received back.
    Output(H, H),
}

enum Output<B: AutodiffBackend, H> {
    /// The last stage: the loss and its value.
    Loss(Tensor<B, 1>, f32),
    /// The other stages: the activation sent on.
    Hidden(H),
}

/// One pipeline stage, trained with ZeRO stage 0, 1 or 2 over its data-parallel group.
///
/// Every rank of the job builds one, from its [`PipelineModule`] and its groups of a
/// `ParallelLayout` with a pipeline axis; then each step every rank calls
/// [`train_batch`](Self::train_batch) with the step's `gradient_accumulation_steps`
/// micro-batches of its data-parallel index.
pub struct PipelineEngine<B: AutodiffBackend, L: PipeLayer<B>> {
    pub(super) layers: Vec<L>,
    pub(super) first: bool,
    pub(super) last: bool,
    pub(super) stage: usize,
    pub(super) stages: usize,
    /// Per layer, the layout indices of its parameters.
    params_of: Vec<Vec<usize>>,
    /// Per tied key (sorted), the layout indices of this stage's copies.
    tied: BTreeMap<String, Vec<usize>>,
    pub(super) core: EngineCore,
    pub(super) send_next: Option<Channel>,
    pub(super) recv_prev: Option<Channel>,
    send_prev: Option<Channel>,
    recv_next: Option<Channel>,
    tied_group: Option<SharedGroup>,
    pub(super) pipeline_group: SharedGroup,
    /// Under stage 2, the groups holding this stage's tied copies, reduce-scattered like the
    /// others and summed shard by shard over the tied group (empty: summed whole).
    tied_shards: Vec<usize>,
    /// Every rank of the job: checkpoints and the overflow decision are agreed over it.
    pub(super) world: SharedGroup,
    /// This rank's place in the tensor group and how this stage's split parameters are cut,
    /// by name (what its checkpoints record); size 1 without tensor parallelism.
    pub(super) tensor: TensorParallelRecord,
    pub(super) device: B::Device,
    timeline: Vec<OpSpan>,
}

impl<B: AutodiffBackend, L: PipeLayer<B>> PipelineEngine<B, L> {
    /// The engine of this rank's stage. `module` must be the stage of `groups.coords.pipeline`
    /// of `groups.layout`'s pipeline size. The data-parallel rank 0's weights are broadcast over
    /// the data group, and the first stage's tied weights to the last stage's copies.
    pub fn new(settings: EngineSettings, module: PipelineModule<L>, groups: &RankGroups) -> Result<Self, ZeroError> {
        if settings.stage == Stage::Zero3 {
            return Err(ZeroError::Config(
                "zero_optimization.stage 3 with pipeline parallelism: stage 3 gathers every layer's weights for each \
                 forward and backward, and the 1F1B schedule interleaves the micro-batches' forwards and backwards, \
                 so each layer would be gathered twice per micro-batch for weights that a stage holds for its own \
                 layers only anyway; DeepSpeed's pipeline engine refuses it too. Use stage 0, 1 or 2"
                    .into(),
            ));
        }
        let stages = groups.layout.size(Axis::Pipeline);
        let stage = groups.coords.pipeline;
        if module.stage != stage || module.stages != stages {
            return Err(ZeroError::Usage(format!(
                "the module is stage {} of {} but this rank is stage {stage} of {stages}",
                module.stage, module.stages
            )));
        }
        let (first, last) = (module.is_first(), module.is_last());
        let mut layers = module.layers;
        let device =
            layers.iter().flat_map(|l| l.devices()).next().ok_or_else(|| {
                ZeroError::Model(format!("stage {stage}'s layers have no parameters (no device found)"))
            })?;

        // Parameters, layer by layer, named by the layer's index in the whole model.
        let mut specs: Vec<ParamSpec> = Vec::new();
        let mut params_of = Vec::new();
        for (i, layer) in layers.iter().enumerate() {
            let start = specs.len();
            specs.extend(describe::<B, _>(layer).into_iter().map(|(_, s)| ParamSpec {
                name: layer.param_name(module.range.start + i, &s.name),
                ..s
            }));
            params_of.push((start..specs.len()).collect::<Vec<_>>());
        }
        let mut tied: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, layer) in layers.iter().enumerate() {
            for t in layer.tied() {
                let p = *params_of[i].get(t.param).ok_or_else(|| {
                    ZeroError::Model(format!(
                        "layer {} ties parameter {} as `{}` but has {} parameters",
                        module.range.start + i,
                        t.param,
                        t.key,
                        params_of[i].len()
                    ))
                })?;
                tied.entry(t.key).or_default().push(p);
            }
        }
        let tied_group = groups.stage.tied.clone();
        if !tied.is_empty() && stages > 1 && tied_group.is_none() {
            return Err(ZeroError::Model(format!(
                "stage {stage} holds tied weights ({:?}) but only the first and last stage may",
                tied.keys().collect::<Vec<_>>()
            )));
        }

        let data = groups.data.clone();
        let dp = data.world_size();
        let mut builder = LayoutBuilder::new(specs, dp, settings.alignment);
        let all: Vec<usize> = (0..params_of.iter().map(Vec::len).sum()).collect();
        let placement = if settings.stage == Stage::Zero0 {
            Placement::Replicated
        } else {
            Placement::Sharded
        };
        let bucket = settings.reduce_bucket_size.max(1);
        // Stage 2 reduce-scatters each micro-batch's gradients as they come. The tied copies
        // live in groups of their own, laid out by key: when each stage holds one copy of each
        // key, the first and the last stage's tied groups are cut alike, so a data rank's
        // reduced shards of them hold the same elements and are summed over the tied group as
        // they are. Otherwise (copies sharing a stage) the tied groups accumulate whole.
        let mut whole_groups = Vec::new();
        let mut tied_shards = Vec::new();
        if settings.stage == Stage::Zero2 {
            let tied_params: Vec<usize> = tied.values().flatten().copied().collect();
            let rest: Vec<usize> = all.iter().copied().filter(|p| !tied_params.contains(p)).collect();
            builder.buckets(&rest, bucket, placement);
            if !tied_params.is_empty() {
                let added = builder.buckets(&tied_params, bucket, placement);
                if stages > 1 && tied_group.is_some() && tied.values().all(|c| c.len() == 1) {
                    tied_shards = added;
                } else {
                    whole_groups = added;
                }
            }
        } else {
            builder.buckets(&all, bucket, placement);
        }
        let layout = builder.finish();
        let stage_2 = settings.stage == Stage::Zero2;

        // Initial values: the layers', then data rank 0's, then the tied keys' first copy.
        let mut values: Vec<Vec<f32>> = Vec::with_capacity(layout.params.len());
        for layer in &layers {
            read_values::<B, _>(layer, |_, v| values.push(v));
        }
        if dp > 1 {
            let mut buf = FlatBuffer::F32(values.concat());
            data.broadcast(&mut buf, 0)?;
            split_into(&buf.into_f32(), &mut values);
        }
        for (key, copies) in &tied {
            let mut source = values[copies[0]].clone();
            if let Some(group) = &tied_group {
                let mut buf = FlatBuffer::F32(source);
                group.broadcast(&mut buf, 0)?;
                source = buf.into_f32();
            }
            for &c in copies {
                if values[c].len() != source.len() {
                    return Err(ZeroError::Model(format!(
                        "the copies of tied weight `{key}` differ in size ({} and {} elements)",
                        source.len(),
                        values[c].len()
                    )));
                }
                values[c].copy_from_slice(&source);
            }
        }
        let dtype = settings.precision.dtype;
        for v in &mut values {
            half_buffer::round_to(dtype, v);
        }
        layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, layer)| {
                write_data(layer, &device, true, |j, shape| {
                    half_buffer::f32_to_data(values[params_of[i][j]].clone(), shape, dtype)
                })
            })
            .collect();

        let memory = Arc::new(MemoryTracker::default());
        memory.add_parameters(layout.numel() * dtype.size());
        let mut core = EngineCore::new(
            layout,
            data.clone(),
            settings,
            |g| {
                if stage_2 && !whole_groups.contains(&g) {
                    GradFlow::ReduceThenAccumulate
                } else {
                    GradFlow::AccumulateThenReduce
                }
            },
            |i| std::mem::take(&mut values[i]),
            memory,
        )?;
        // The norm counts each parameter once: the slices of a tensor-split parameter on every
        // tensor rank, a replicated one on tensor rank 0; a tied key on the first stage holding
        // it, its first copy.
        let mut split = vec![false; core.state.layout.params.len()];
        let mut tensor = TensorParallelRecord {
            rank: groups.coords.tensor,
            size: groups.layout.size(Axis::Tensor),
            splits: BTreeMap::new(),
        };
        for (layer, params) in layers.iter().zip(&params_of) {
            for (i, how) in layer.tensor_split() {
                if let Some(&p) = params.get(i) {
                    split[p] = true;
                    tensor.splits.insert(core.state.layout.params[p].name.clone(), how);
                }
            }
        }
        let mut counted: Vec<bool> = split.iter().map(|&s| s || groups.coords.tensor == 0).collect();
        for copies in tied.values() {
            for (k, &c) in copies.iter().enumerate() {
                counted[c] = counted[c] && k == 0 && (tied_group.is_none() || stage == 0);
            }
        }
        core.grad_norm = Some(crate::agreement::counted_grad_norm(
            counted,
            data.rank(),
            vec![groups.world.clone()],
        ));
        // fp16's overflow (and a non-finite gradient under bf16 or fp32) is decided over the
        // whole world: every stage skips the step together, or fails together at once.
        core.overflow = Some(crate::agreement::Agreement::over(groups.world.clone()));
        // LAMB's per-tensor norms: a split tensor's add over its slices on the stage's tensor
        // ranks.
        core.state.tensor_norms = Some(crate::agreement::TensorNorms::new(
            groups.tensor.clone(),
            &core.state.layout,
            |p| split[p],
        ));

        let channel = |g: &Option<SharedGroup>, send: bool, what: String| -> Result<Option<Channel>, ZeroError> {
            g.clone()
                .map(|g| {
                    if send {
                        Channel::sender(g, what)
                    } else {
                        Channel::receiver(g, what)
                    }
                })
                .transpose()
        };
        let s = groups.stage.clone();
        Ok(PipelineEngine {
            layers,
            first,
            last,
            stage,
            stages,
            params_of,
            tied,
            core,
            send_next: channel(
                &s.send_next,
                true,
                format!("activations from stage {stage} to {}", stage + 1),
            )?,
            recv_prev: channel(
                &s.recv_prev,
                false,
                format!("activations from stage {} to {stage}", stage.wrapping_sub(1)),
            )?,
            send_prev: channel(
                &s.send_prev,
                true,
                format!("gradients from stage {stage} to {}", stage.wrapping_sub(1)),
            )?,
            recv_next: channel(
                &s.recv_next,
                false,
                format!("gradients from stage {} to {stage}", stage + 1),
            )?,
            tied_group,
            pipeline_group: groups.pipeline.clone(),
            tied_shards,
            world: groups.world.clone(),
            tensor,
            device,
            timeline: Vec::new(),
        })
    }

    /// One optimizer step over `micro_batches` (exactly `gradient_accumulation_steps` of them):
    /// forwards and backwards on the 1F1B schedule, then the tied weights' gradients summed,
    /// the data-parallel reduction and the optimizer.
    pub fn train_batch(&mut self, micro_batches: &[L::Batch]) -> Result<PipelineStep, ZeroError> {
        let m = self.core.settings.gradient_accumulation_steps;
        if micro_batches.len() != m {
            return Err(ZeroError::Usage(format!(
                "train_batch got {} micro-batches but gradient_accumulation_steps is {m}",
                micro_batches.len()
            )));
        }
        self.timeline.clear();
        let clock = Instant::now();
        let mut in_flight: VecDeque<InFlight<B, L>> = VecDeque::new();
        let mut losses = Vec::with_capacity(m);
        for op in one_f_one_b(self.stage, self.stages, m) {
            match op {
                PipeOp::Forward(i) => {
                    let flight = self.forward_micro(&micro_batches[i], op, clock)?;
                    if let Output::Loss(_, value) = &flight.output {
                        losses.push(*value);
                    }
                    in_flight.push_back(flight);
                }
                PipeOp::Backward(_) => {
                    let flight = in_flight
                        .pop_front()
                        .ok_or_else(|| ZeroError::Usage("the schedule ran a backward before its forward".into()))?;
                    self.backward_micro(flight, op, clock)?;
                }
            }
        }
        for channel in [&mut self.send_next, &mut self.send_prev].into_iter().flatten() {
            channel.flush()?;
        }
        self.reduce_tied()?;
        let report = self.core.update()?;
        self.refresh_layers()?;
        let loss = self.shared_loss(&losses)?;
        Ok(PipelineStep { loss, report })
    }

    fn forward_micro(&mut self, batch: &L::Batch, op: PipeOp, clock: Instant) -> Result<InFlight<B, L>, ZeroError> {
        let layers: Vec<L> = self.layers.iter().map(|l| fresh_leaves::<B, _>(l.clone())).collect();
        let n = layers.len();
        let (input, mut h) = match &mut self.recv_prev {
            Some(channel) if !self.first => {
                let (shape, values) = channel.recv()?;
                let x = L::Hidden::from_values(values, shape, self.dtype(), &self.device).leaf();
                (Some(x.clone()), x)
            }
            _ => (None, layers[0].input(batch)),
        };
        let start = clock.elapsed();
        let end = if self.last { n - 1 } else { n };
        let middle = usize::from(self.first).min(end)..end;
        let checkpoints = self.checkpointed_forward(&layers, middle.clone(), &h)?;
        match &checkpoints {
            Some(kept) => h = kept.exit(),
            None => {
                for layer in &layers[middle] {
                    h = layer.forward(h);
                }
            }
        }
        let output = if self.last {
            let loss = layers[n - 1].loss(h, batch);
            let value = loss.clone().into_scalar().elem::<f32>();
            Output::Loss(loss, value)
        } else {
            let values = h.to_values();
            self.timeline.push(OpSpan {
                op,
                start,
                end: clock.elapsed(),
            });
            self.send_next
                .as_mut()
                .ok_or_else(|| ZeroError::Usage(format!("stage {} has no next stage to send to", self.stage)))?
                .send(&h.dims(), values)?;
            return Ok(InFlight {
                layers,
                input,
                output: Output::Hidden(h),
                checkpoints,
            });
        };
        self.timeline.push(OpSpan {
            op,
            start,
            end: clock.elapsed(),
        });
        Ok(InFlight {
            layers,
            input,
            output,
            checkpoints,
        })
    }

    fn backward_micro(&mut self, flight: InFlight<B, L>, op: PipeOp, clock: Instant) -> Result<(), ZeroError> {
        let InFlight {
            layers,
            input,
            output,
            checkpoints,
        } = flight;
        // What the backward starts from: the (scaled) loss, or the output and its gradient.
        let (seed, start) = match output {
            Output::Loss(loss, value) => (Seed::Loss(self.core.backward_loss(loss, value)), clock.elapsed()),
            Output::Hidden(y) => {
                let channel = self
                    .recv_next
                    .as_mut()
                    .ok_or_else(|| ZeroError::Usage(format!("stage {} has no next stage to hear from", self.stage)))?;
                let (shape, values) = channel.recv()?;
                let start = clock.elapsed();
                let dy = L::Hidden::from_values(values, shape, self.dtype(), &self.device);
                (Seed::Output(y, dy), start)
            }
        };
        let dx = match checkpoints {
            None => {
                self.fence()?;
                let mut grads = match seed {
                    Seed::Loss(loss) => loss.backward(),
                    Seed::Output(y, dy) => y.dot(dy).backward(),
                };
                for (i, layer) in layers.iter().enumerate() {
                    self.absorb_layer(i, layer, &mut grads)?;
                }
                input.map(|x| x.take_grad(&mut grads).unwrap_or_else(|| x.zeros_like()))
            }
            Some(kept) => {
                // The forward's graph went on from a leaf after the checkpointed layers: only
                // the loss layer hangs from it (on the last stage); the middle layers' gradients
                // come from their reruns.
                let grad_exit = match seed {
                    Seed::Loss(loss) => {
                        self.fence()?;
                        let mut grads = loss.backward();
                        let n = layers.len();
                        self.absorb_layer(n - 1, &layers[n - 1], &mut grads)?;
                        let exit = kept.exit();
                        exit.take_grad(&mut grads).unwrap_or_else(|| exit.zeros_like())
                    }
                    // The output is that leaf: its gradient is the one received.
                    Seed::Output(_, dy) => dy,
                };
                let (entry, grad_entry) = self.checkpointed_backward(&layers, kept, grad_exit)?;
                if self.first {
                    self.fence()?;
                    let mut grads = entry.dot(grad_entry).backward();
                    self.absorb_layer(0, &layers[0], &mut grads)?;
                    None
                } else {
                    Some(grad_entry)
                }
            }
        };
        self.core.finish_micro_batch()?;
        self.timeline.push(OpSpan {
            op,
            start,
            end: clock.elapsed(),
        });
        if let (Some(dx), Some(channel)) = (dx, self.send_prev.as_mut()) {
            channel.send(&dx.dims(), dx.to_values())?;
        }
        Ok(())
    }

    /// Gives the engine the gradients of layer `index` of this stage from `grads`.
    pub(super) fn absorb_layer(&mut self, index: usize, layer: &L, grads: &mut B::Gradients) -> Result<(), ZeroError> {
        let params = &self.params_of[index];
        let mut failure = None;
        take_grads::<B, L>(layer, grads, |i, g| {
            if failure.is_none() {
                if let Err(e) = self.core.absorb(params[i], g) {
                    failure = Some(e);
                }
            }
        });
        failure.map_or(Ok(()), Err)
    }

    /// The dtype the layers compute in (activations arrive in it).
    pub(super) fn dtype(&self) -> burn::tensor::DType {
        self.core.settings.precision.dtype.burn()
    }

    /// Tensor parallelism in threads: every rank of the fence group passes a barrier before a
    /// `backward()` (see [`EngineSettings::backward_fence`]). With a pipeline the fence must be
    /// the tensor group: ranks of other stages reach their backwards at other times, and a
    /// barrier with them would wait on gradients that wait on the barrier.
    pub(super) fn fence(&self) -> Result<(), ZeroError> {
        if let Some(group) = &self.core.settings.backward_fence {
            group.barrier()?;
        }
        Ok(())
    }

    /// Sums the accumulated gradients of every tied key's copies, on this stage and over the
    /// tied group, and gives the sum to each copy.
    fn reduce_tied(&mut self) -> Result<(), ZeroError> {
        if let (false, Some(group)) = (self.tied_shards.is_empty(), &self.tied_group) {
            for &g in &self.tied_shards {
                let mut shard = Vec::new();
                with_accumulator(&mut self.core.state, g, |acc| shard = acc.to_vec());
                let mut buf = FlatBuffer::F32(shard);
                group.all_reduce(&mut buf, ReduceOp::Sum)?;
                let sum = buf.into_f32();
                with_accumulator(&mut self.core.state, g, |acc| acc.copy_from_slice(&sum));
            }
            return Ok(());
        }
        let places = self.core.places.clone();
        for copies in self.tied.values() {
            let n = self.core.state.layout.params[copies[0]].numel();
            let mut sum = vec![0.0f32; n];
            for &c in copies {
                with_accumulator(&mut self.core.state, places[c].group, |acc| {
                    let at = places[c].offset;
                    for (s, g) in sum.iter_mut().zip(&acc[at..at + n]) {
                        *s += g;
                    }
                });
            }
            if let Some(group) = &self.tied_group {
                let mut buf = FlatBuffer::F32(sum);
                group.all_reduce(&mut buf, ReduceOp::Sum)?;
                sum = buf.into_f32();
            }
            for &c in copies {
                with_accumulator(&mut self.core.state, places[c].group, |acc| {
                    let at = places[c].offset;
                    acc[at..at + n].copy_from_slice(&sum);
                });
            }
        }
        Ok(())
    }

    /// Writes the updated masters (gathered over the data group under stage 1) into the layers.
    pub(super) fn refresh_layers(&mut self) -> Result<(), ZeroError> {
        let mut source = self.core.value_source();
        for (layer, params) in self.layers.iter_mut().zip(&self.params_of) {
            let old = std::mem::replace(layer, skeleton::<B, _>(layer.clone()));
            *layer = write_data(old, &self.device, true, |i, _| source.take_data(params[i]));
        }
        source.finish()
    }

    /// The last stage's mean loss, averaged over the data group, then broadcast to every stage.
    pub(super) fn shared_loss(&self, losses: &[f32]) -> Result<f32, ZeroError> {
        let mut loss = if losses.is_empty() {
            0.0
        } else {
            losses.iter().sum::<f32>() / losses.len() as f32
        };
        if self.last && self.core.comm.world_size() > 1 {
            let mut buf = FlatBuffer::F32(vec![loss]);
            self.core.comm.all_reduce(&mut buf, ReduceOp::Avg)?;
            loss = buf.into_f32()[0];
        }
        if self.stages > 1 {
            let mut buf = FlatBuffer::F32(vec![loss]);
            self.pipeline_group.broadcast(&mut buf, self.stages - 1)?;
            loss = buf.into_f32()[0];
        }
        Ok(loss)
    }

    /// This stage's layers, holding the current weights (in the compute dtype).
    pub fn layers(&self) -> &[L] {
        &self.layers
    }

    /// Bytes held by this rank (its stage's parameters, gradients and optimizer shard), by kind.
    pub fn memory(&self) -> crate::memory::MemoryReport {
        self.core.memory.report()
    }

    /// This rank's stage.
    pub fn stage(&self) -> usize {
        self.stage
    }

    /// Optimizer steps taken.
    pub fn global_step(&self) -> u64 {
        self.core.global_step
    }

    /// The forward and backward spans of the last step (see [`OpSpan`]).
    pub fn timeline(&self) -> &[OpSpan] {
        &self.timeline
    }
}

/// Runs `f` on a group's accumulated (not yet reduced) gradient, as f32.
fn with_accumulator(state: &mut FlatState, group: usize, f: impl FnOnce(&mut [f32])) {
    let grad = &mut state.groups[group].grad;
    let dtype = grad.dtype();
    let mut values = std::mem::replace(grad, FlatBuffer::F32(Vec::new())).into_f32();
    f(&mut values);
    *grad = FlatBuffer::from_f32(&values, dtype);
}

/// Cuts `flat` back into the lengths of `values`.
fn split_into(flat: &[f32], values: &mut [Vec<f32>]) {
    let mut at = 0;
    for v in values {
        let n = v.len();
        v.copy_from_slice(&flat[at..at + n]);
        at += n;
    }
}
