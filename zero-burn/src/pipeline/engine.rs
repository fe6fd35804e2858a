//! Training one pipeline stage: the 1F1B schedule over the step's micro-batches, the stage's
//! parameters as one ZeRO flat state over its data-parallel group, tied weights, and the global
//! gradient norm.

use super::channel::Channel;
use super::layer::{PipeHidden, PipeLayer};
use super::recompute::Checkpoints;
use super::schedule::{one_f_one_b, PipeOp};
use crate::chain::Hidden;
use crate::core::{EngineCore, StepReport};
use crate::error::ZeroError;
use crate::flat_state::FlatState;
use crate::params::{fresh_leaves, skeleton, take_grads, write_data};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};
use zero_core::checkpoint::TensorParallelRecord;
use zero_core::comm::{FlatBuffer, ReduceOp, SharedGroup};

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
/// Every rank of the job builds one, from its [`PipelineModule`](super::PipelineModule) and its groups of a
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
    pub(super) params_of: Vec<Vec<usize>>,
    /// Per tied key (sorted), the layout indices of this stage's copies.
    pub(super) tied: BTreeMap<String, Vec<usize>>,
    pub(super) core: EngineCore,
    pub(super) send_next: Option<Channel>,
    pub(super) recv_prev: Option<Channel>,
    pub(super) send_prev: Option<Channel>,
    pub(super) recv_next: Option<Channel>,
    pub(super) tied_group: Option<SharedGroup>,
    pub(super) pipeline_group: SharedGroup,
    /// Under stage 2, the groups holding this stage's tied copies, reduce-scattered like the
    /// others and summed shard by shard over the tied group (empty: summed whole).
    pub(super) tied_shards: Vec<usize>,
    /// Every rank of the job: checkpoints and the overflow decision are agreed over it.
    pub(super) world: SharedGroup,
    /// This rank's place in the tensor group and how this stage's split parameters are cut,
    /// by name (what its checkpoints record); size 1 without tensor parallelism.
    pub(super) tensor: TensorParallelRecord,
    pub(super) device: B::Device,
    pub(super) timeline: Vec<OpSpan>,
}

impl<B: AutodiffBackend, L: PipeLayer<B>> PipelineEngine<B, L> {
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
