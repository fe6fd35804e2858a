//! The engine for chain models ([`ChainModel`]): every ZeRO stage, and the only one for stage 3.
//!
//! Stage 3 keeps each part (the ends, every block) as a skeleton whose parameters are never
//! materialised; the rank owns only its shards. A step goes, per micro-batch:
//!
//! - forward, on untracked tensors (no autodiff graph): gather the ends, embed, release; for each
//!   block gather, run, keep only its input, release; gather the ends again and compute the loss
//!   as a small graph of its own;
//! - backward: the loss graph gives the gradient of the last block's output and the head's share
//!   of the ends' gradients; then, for each block in reverse, re-gather, rebuild it on fresh
//!   leaves, recompute, and backpropagate `sum(y ⊙ dy)` as its own top-level graph; the block's
//!   gradients are reduce-scattered into the shard right away; last, the embedding's backward.
//!
//! Gathers follow a fixed schedule (`ends, blocks…, ends | blocks in reverse…, ends`), the same on
//! every rank, and with `overlap_comm` the next parts on it are prefetched up to
//! `stage3_prefetch_bucket_size` elements. Parameters smaller than
//! `stage3_param_persistence_threshold` stay replicated and are all-reduced once per step.
//!
//! Stages 0-2 keep every part's parameters whole. Forward builds one autodiff graph per part, cut
//! at the part boundaries and kept until backward (no recomputation); backward then runs part by
//! part in reverse, so each block's gradients go into the bucketed reductions (stage 2:
//! reduce-scattered, in the background with `overlap_comm`) while the blocks before it are still
//! to be differentiated.
//!
//! With the optimizer offloaded to the CPU, `step()` may leave the update of the shard running
//! in the background (`crate::deferred`, [`EngineSettings::overlap_optimizer_step`]): the next
//! forward waits for each part's update just before the part's gather (stage 3) or the rewrite
//! of its replica from the gathered masters (stages 0-2, which then happens there rather than
//! in `step()`), so the later blocks' updates run while the earlier blocks compute.

use crate::activation_checkpointing::{ActivationCheckpointing, Stored};
use crate::chain::{ChainModel, Hidden};
use crate::core::{EngineCore, StepReport};
use crate::error::ZeroError;
use crate::flat_state::GradFlow;
use crate::half_buffer;
use crate::memory::{MemoryReport, MemoryTracker};
use crate::params::{describe, fresh_leaves, read_values, skeleton, take_grads, write_data};
use crate::settings::{ComputeDtype, EngineSettings, Stage};
use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ProcessGroup, Work};
use zero_core::partition::{LayoutBuilder, ParamSpec, PartitionLayout, Placement};

/// One part of the chain: the ends (part 0) or a block (part `b + 1`).
#[derive(Clone, Debug)]
pub(crate) struct Part {
    /// Global parameter indices, in the part's visit order.
    pub(crate) params: Vec<usize>,
    /// Groups holding the part's parameters.
    pub(crate) groups: Vec<usize>,
    /// Elements of the part's sharded groups, padded: what a gather brings in.
    pub(crate) gathered_elements: usize,
}

/// A micro-batch's loss, and what its backward needs.
pub struct ChainLoss<B: AutodiffBackend, M: ChainModel<B>> {
    value: f32,
    loss: Tensor<B, 1>,
    pending: Pending<B, M>,
}

enum Pending<B: AutodiffBackend, M: ChainModel<B>> {
    /// Stages 0-2: one graph per part, kept from forward: the embedding's output, each block's
    /// input leaf and output, and the head's leaves.
    Kept {
        embedded: M::Hidden,
        blocks: Vec<(M::Hidden, M::Hidden)>,
        last: M::Hidden,
        head: M::Ends,
    },
    /// Stages 0-2 with activation checkpointing: the embedding's graph, each segment of blocks
    /// with its checkpointed input, and the head's leaves.
    Checkpointed {
        embedded: M::Hidden,
        segments: Vec<(Range<usize>, Stored<M::Hidden>)>,
        last: M::Hidden,
        head: M::Ends,
    },
    /// Stage 3: the head's graph, the blocks' inputs and the batch (for the embedding's backward).
    Blockwise {
        last: M::Hidden,
        ends: M::Ends,
        inputs: Vec<Stored<M::Hidden>>,
        batch: M::Batch,
    },
}

impl<B: AutodiffBackend, M: ChainModel<B>> ChainLoss<B, M> {
    /// The loss value.
    pub fn value(&self) -> f32 {
        self.value
    }
}

/// ZeRO, every stage, for a [`ChainModel`].
pub struct ChainEngine<B: AutodiffBackend, M: ChainModel<B>> {
    pub(crate) ends: M::Ends,
    pub(crate) blocks: Vec<M::Block>,
    pub(crate) parts: Vec<Part>,
    pub(crate) core: EngineCore,
    pub(crate) device: B::Device,
    /// Stage 3: gathers issued ahead of use, by group.
    pub(crate) prefetched: HashMap<usize, Work<FlatBuffer>>,
    /// Stage 3: the parts still to be gathered this micro-batch, in order.
    schedule: VecDeque<usize>,
    /// Stages 0-2: the leaves of the ends used by the pending micro-batch's embedding.
    embed_ends: Option<M::Ends>,
    /// Stage 3: the ends' gathered values, kept from the embedding to the head and on to the
    /// embedding's backward when `max_reuse_distance` and `max_live_parameters` allow.
    kept_ends: Option<HashMap<usize, FlatBuffer>>,
    /// Stage 3: whether the pending micro-batch keeps the ends between their uses.
    keep_ends: bool,
    /// Stages 0-2: the parts whose replica still holds the weights from before the last step,
    /// whose update runs in the background; each is rewritten just before its next use.
    stale: Vec<bool>,
}

impl<B: AutodiffBackend, M: ChainModel<B>> ChainEngine<B, M> {
    /// Wraps `model`, split into its parts. Rank 0's weights are broadcast. Under stage 3 each
    /// part is turned into a skeleton as soon as its shards are taken, so the full model is never
    /// held twice.
    pub fn new(settings: EngineSettings, model: M, comm: Arc<dyn ProcessGroup>) -> Result<Self, ZeroError> {
        crate::sharded::refuse_zero_modules::<B, M>(&model, "ChainEngine")?;
        let (ends, blocks) = model.into_parts();
        if blocks.is_empty() && settings.stage == Stage::Zero3 {
            return Err(ZeroError::Model(
                "stage 3 gathers parameters block by block, but the model's into_parts() returned no blocks".into(),
            ));
        }
        let device = ends
            .devices()
            .into_iter()
            .chain(blocks.iter().flat_map(|b| b.devices()))
            .next()
            .ok_or_else(|| ZeroError::Model("the model has no parameters (no device found)".into()))?;

        // Parameters: the ends, then each block, each in its visit order.
        let mut specs: Vec<ParamSpec> = Vec::new();
        let mut part_params = Vec::new();
        let mut push_part = |prefix: String, list: Vec<(burn::module::ParamId, ParamSpec)>| {
            let start = specs.len();
            specs.extend(list.into_iter().map(|(_, s)| ParamSpec {
                name: format!("{prefix}{}", s.name),
                ..s
            }));
            part_params.push((start..specs.len()).collect::<Vec<_>>());
        };
        push_part("ends.".into(), describe::<B, _>(&ends));
        for (b, block) in blocks.iter().enumerate() {
            push_part(format!("blocks.{b}."), describe::<B, _>(block));
        }
        // Parameters split over the tensor group (their slices all count in the global norm).
        let mut tensor_split = vec![false; specs.len()];
        let splits = std::iter::once(M::ends_tensor_split(&ends)).chain(blocks.iter().map(M::block_tensor_split));
        for (params, split) in part_params.iter().zip(splits) {
            for i in split {
                if let Some(&p) = params.get(i) {
                    tensor_split[p] = true;
                }
            }
        }

        let numels: Vec<usize> = specs.iter().map(ParamSpec::numel).collect();
        let world = comm.world_size();
        let mut builder = LayoutBuilder::new(specs, world, settings.alignment);
        let mut parts = Vec::new();
        for params in part_params {
            let groups = match settings.stage {
                Stage::Zero3 => {
                    let threshold = settings.param_persistence_threshold;
                    let (small, large): (Vec<usize>, Vec<usize>) = params.iter().partition(|&&p| numels[p] < threshold);
                    let mut g = Vec::new();
                    g.extend(builder.group(large, Placement::Sharded));
                    g.extend(builder.group(small, Placement::Replicated));
                    g
                }
                stage => {
                    let placement = if stage == Stage::Zero0 {
                        Placement::Replicated
                    } else {
                        Placement::Sharded
                    };
                    builder.buckets(&params, settings.reduce_bucket_size.max(1), placement)
                }
            };
            parts.push(Part {
                params,
                groups,
                gathered_elements: 0,
            });
        }
        let layout = builder.finish();
        count_gathered_elements(&mut parts, &layout);

        // Initial values: rank 0's, broadcast part by part; each rank keeps its owned ranges.
        let mut values: Vec<Vec<f32>> = vec![Vec::new(); layout.params.len()];
        let mut ends = Some(ends);
        let mut blocks: Vec<Option<M::Block>> = blocks.into_iter().map(Some).collect();
        for (pi, part) in parts.iter().enumerate() {
            let mut local = Vec::new();
            if pi == 0 {
                read_values::<B, _>(ends.as_ref().unwrap_or_else(|| unreachable!()), |_, v| local.push(v));
            } else {
                read_values::<B, _>(blocks[pi - 1].as_ref().unwrap_or_else(|| unreachable!()), |_, v| {
                    local.push(v)
                });
            }
            if world > 1 {
                let mut flat = Vec::new();
                for v in &local {
                    flat.extend_from_slice(v);
                }
                let mut buf = FlatBuffer::F32(flat);
                comm.broadcast(&mut buf, 0)?;
                let flat = buf.into_f32();
                let mut at = 0;
                for v in &mut local {
                    let n = v.len();
                    v.copy_from_slice(&flat[at..at + n]);
                    at += n;
                }
            }
            for (&p, mut v) in part.params.iter().zip(local) {
                // The model is cast to the compute dtype first and the masters are made from
                // it, as DeepSpeed does: the model always sees exactly its masters rounded.
                half_buffer::round_to(settings.precision.dtype, &mut v);
                values[p] = v;
            }
            if settings.stage == Stage::Zero3 {
                // Keep only the skeleton of this part.
                if pi == 0 {
                    ends = ends.map(skeleton::<B, _>);
                } else {
                    blocks[pi - 1] = blocks[pi - 1].take().map(skeleton::<B, _>);
                }
            }
        }
        let ends = ends.unwrap_or_else(|| unreachable!());
        let blocks: Vec<M::Block> = blocks
            .into_iter()
            .map(|b| b.unwrap_or_else(|| unreachable!()))
            .collect();

        let memory = Arc::new(MemoryTracker::default());
        let stage = settings.stage;
        let dtype = settings.precision.dtype;
        let (ends, blocks) = if stage == Stage::Zero3 {
            (ends, blocks)
        } else {
            memory.add_parameters(layout.numel() * dtype.size());
            let data = |p: usize, shape: burn::tensor::Shape| half_buffer::f32_to_data(values[p].clone(), shape, dtype);
            let ends = write_data(ends, &device, true, |i, shape| data(parts[0].params[i], shape));
            let blocks = blocks
                .into_iter()
                .enumerate()
                .map(|(b, m)| write_data(m, &device, true, |i, shape| data(parts[b + 1].params[i], shape)))
                .collect();
            (ends, blocks)
        };
        let flows = |g: usize| match (stage, layout.groups[g].placement) {
            (Stage::Zero2 | Stage::Zero3, Placement::Sharded) => GradFlow::ReduceThenAccumulate,
            _ => GradFlow::AccumulateThenReduce,
        };
        let tensor_group = settings.tensor_parallel_group.clone();
        let data_comm = comm.clone();
        let mut core = EngineCore::new(
            layout.clone(),
            comm,
            settings,
            flows,
            |i| std::mem::take(&mut values[i]),
            memory,
        )?;
        if let Some(tensor) = tensor_group {
            // Each split parameter counts on every tensor rank, a replicated one on tensor rank 0.
            let counted = tensor_split.iter().map(|&split| split || tensor.rank() == 0).collect();
            core.grad_norm = Some(crate::core::counted_grad_norm(
                counted,
                data_comm.rank(),
                vec![data_comm, tensor],
            ));
        }
        if stage == Stage::Zero3 && dtype == ComputeDtype::F32 {
            core.count_masters_as_parameters();
        }
        Ok(Self::from_state(ends, blocks, parts, core, device))
    }

    /// Forward of one micro-batch.
    pub fn forward(&mut self, batch: M::Batch) -> Result<ChainLoss<B, M>, ZeroError> {
        if self.core.settings.stage != Stage::Zero3 {
            // Each part is its own graph, cut at the part boundaries, so that backward can run
            // part by part and reduce each block's gradients as soon as they exist. The ends are
            // used twice (embedding, head): each use gets its own leaves over the same values.
            // Each part waits for its own update of the last step, if it runs in the background.
            self.ready_part(0)?;
            let embed_ends = fresh_leaves::<B, _>(self.ends.clone());
            let embedded = M::embed(&embed_ends, &batch);
            if let Some(ac) = self.core.settings.activation_checkpointing.clone() {
                return self.forward_checkpointed(&ac, embed_ends, embedded, batch);
            }
            let mut h = embedded.clone();
            let mut blocks = Vec::with_capacity(self.blocks.len());
            for b in 0..self.blocks.len() {
                self.ready_part(b + 1)?;
                let x = h.leaf();
                let y = M::block_forward(&self.blocks[b], x.clone());
                h = y.clone();
                blocks.push((x, y));
            }
            let head = fresh_leaves::<B, _>(self.ends.clone());
            let last = h.leaf();
            let loss = M::head_loss(&head, last.clone(), &batch);
            let value = loss.clone().into_scalar().elem::<f32>();
            // The embedding's graph holds the ends' leaves; keep them alive with it.
            self.embed_ends = Some(embed_ends);
            return Ok(ChainLoss {
                value,
                loss,
                pending: Pending::Kept {
                    embedded,
                    blocks,
                    last,
                    head,
                },
            });
        }
        let n = self.blocks.len();
        self.drop_kept_ends();
        self.keep_ends = self.ends_reused_within_limits();
        // ends, blocks…, ends | blocks in reverse…, ends; kept ends are gathered once.
        let again: &[usize] = if self.keep_ends { &[] } else { &[0] };
        self.schedule = std::iter::once(0)
            .chain(1..=n)
            .chain(again.iter().copied())
            .chain((1..=n).rev())
            .chain(again.iter().copied())
            .collect();

        let ends = self.materialize_ends(false)?;
        let mut h = M::embed(&ends, &batch).detached();
        self.release(0, ends);
        let mut inputs = Vec::with_capacity(n);
        let keep = self.core.settings.activation_checkpointing.clone().unwrap_or_default();
        for b in 0..n {
            let block = self.materialize_block(b, false)?;
            inputs.push(keep.store(h.clone())?);
            h = M::block_forward(&block, h).detached();
            self.release(b + 1, block);
        }
        let ends = self.materialize_ends(true)?;
        let last = h.leaf();
        let loss = M::head_loss(&ends, last.clone(), &batch);
        let value = loss.clone().into_scalar().elem::<f32>();
        Ok(ChainLoss {
            value,
            loss,
            pending: Pending::Blockwise {
                last,
                ends,
                inputs,
                batch,
            },
        })
    }

    /// Stages 0-2 with activation checkpointing: the blocks run untracked, keeping each
    /// segment's input; the head is its own graph on a leaf.
    fn forward_checkpointed(
        &mut self,
        ac: &ActivationCheckpointing,
        embed_ends: M::Ends,
        embedded: M::Hidden,
        batch: M::Batch,
    ) -> Result<ChainLoss<B, M>, ZeroError> {
        let mut h = embedded.detached();
        let mut segments = Vec::new();
        for seg in ac.segments(self.blocks.len())? {
            if ac.synchronize_checkpoint_boundary {
                self.core.comm.barrier()?;
            }
            segments.push((seg.clone(), ac.store(h.clone())?));
            for b in seg {
                self.ready_part(b + 1)?;
                // A copy whose parameters record nothing: no graph is built, nothing is kept.
                h = M::block_forward(&self.blocks[b].clone().no_grad(), h).detached();
            }
        }
        let head = fresh_leaves::<B, _>(self.ends.clone());
        let last = h.leaf();
        let loss = M::head_loss(&head, last.clone(), &batch);
        let value = loss.clone().into_scalar().elem::<f32>();
        self.embed_ends = Some(embed_ends);
        Ok(ChainLoss {
            value,
            loss,
            pending: Pending::Checkpointed {
                embedded,
                segments,
                last,
                head,
            },
        })
    }

    /// The loss of a batch without backward (evaluation). Under stage 3 the parts are gathered
    /// one by one and released, as in training; after a step whose update runs in the
    /// background, stages 1-2 gather the updated parts too. Every rank calls it together.
    pub fn eval_loss(&mut self, batch: M::Batch) -> Result<f32, ZeroError> {
        if self.core.settings.stage != Stage::Zero3 {
            self.ready_part(0)?;
            let mut h = M::embed(&self.ends, &batch).detached();
            for b in 0..self.blocks.len() {
                self.ready_part(b + 1)?;
                h = M::block_forward(&self.blocks[b], h).detached();
            }
            return Ok(M::head_loss(&self.ends, h, &batch).into_scalar().elem::<f32>());
        }
        let n = self.blocks.len();
        self.drop_kept_ends();
        self.keep_ends = false;
        self.schedule = std::iter::once(0).chain(1..=n).chain(std::iter::once(0)).collect();
        let ends = self.materialize_ends(false)?;
        let mut h = M::embed(&ends, &batch).detached();
        self.release(0, ends);
        for b in 0..n {
            let block = self.materialize_block(b, false)?;
            h = M::block_forward(&block, h).detached();
            self.release(b + 1, block);
        }
        let ends = self.materialize_ends(false)?;
        let value = M::head_loss(&ends, h, &batch).into_scalar().elem::<f32>();
        self.release(0, ends);
        Ok(value)
    }

    /// Backward of one micro-batch's loss, with the reduction of its gradients. Returns the loss
    /// value.
    pub fn backward(&mut self, loss: ChainLoss<B, M>) -> Result<f32, ZeroError> {
        // The forward collected every part's update; this only guards the accumulators.
        self.core.wait_for_updates()?;
        self.fence()?;
        let grads = self.core.backward_loss(loss.loss, loss.value).backward();
        match loss.pending {
            Pending::Kept {
                embedded,
                mut blocks,
                last,
                head,
            } => {
                let mut grad_h = self.head_backward(&last, &head, grads)?;
                drop(head);
                for b in (0..self.blocks.len()).rev() {
                    let (x, y) = blocks.pop().unwrap_or_else(|| unreachable!());
                    self.fence()?;
                    let mut grads = y.dot(grad_h).backward();
                    grad_h = x
                        .take_grad(&mut grads)
                        .ok_or_else(|| ZeroError::Model(format!("block {b}'s output does not depend on its input")))?;
                    absorb_into::<B, _>(&mut self.core, &self.parts[b + 1].params, &self.blocks[b], &mut grads)?;
                }
                self.embed_backward(embedded, grad_h)?;
            }
            Pending::Checkpointed {
                embedded,
                mut segments,
                last,
                head,
            } => {
                let mut grad_h = self.head_backward(&last, &head, grads)?;
                drop(head);
                let ac = self.core.settings.activation_checkpointing.clone().unwrap_or_default();
                while let Some((seg, stored)) = segments.pop() {
                    // Rerun the segment from its checkpoint, this time recording the graph.
                    let x = ac.restore(stored, &self.device)?.leaf();
                    let mut y = x.clone();
                    for block in &self.blocks[seg.clone()] {
                        y = M::block_forward(block, y);
                    }
                    self.fence()?;
                    let mut grads = y.dot(grad_h).backward();
                    grad_h = x.take_grad(&mut grads).ok_or_else(|| {
                        ZeroError::Model(format!("blocks {seg:?}: the output does not depend on the input"))
                    })?;
                    for b in seg.rev() {
                        absorb_into::<B, _>(&mut self.core, &self.parts[b + 1].params, &self.blocks[b], &mut grads)?;
                    }
                }
                self.embed_backward(embedded, grad_h)?;
            }
            Pending::Blockwise {
                last,
                ends,
                mut inputs,
                batch,
            } => {
                let mut grad_h = self.head_backward(&last, &ends, grads)?;
                self.release(0, ends);
                let keep = self.core.settings.activation_checkpointing.clone().unwrap_or_default();
                for b in (0..self.blocks.len()).rev() {
                    let block = self.materialize_block(b, true)?;
                    let stored = inputs.pop().unwrap_or_else(|| unreachable!());
                    let x = keep.restore(stored, &self.device)?.leaf();
                    let y = M::block_forward(&block, x.clone());
                    self.fence()?;
                    let mut grads = y.dot(grad_h).backward();
                    grad_h = x
                        .take_grad(&mut grads)
                        .ok_or_else(|| ZeroError::Model(format!("block {b}'s output does not depend on its input")))?;
                    absorb_into::<B, _>(&mut self.core, &self.parts[b + 1].params, &block, &mut grads)?;
                    self.release(b + 1, block);
                }
                let ends = self.materialize_ends(true)?;
                let embedded = M::embed(&ends, &batch);
                self.fence()?;
                let mut grads = embedded.dot(grad_h).backward();
                absorb_into::<B, _>(&mut self.core, &self.parts[0].params, &ends, &mut grads)?;
                // The ends' last use in this micro-batch.
                self.keep_ends = false;
                self.kept_ends = None;
                self.release(0, ends);
            }
        }
        self.core.finish_micro_batch()?;
        Ok(loss.value)
    }

    /// The head's part of backward: absorbs the ends' gradients from the loss graph and returns
    /// the gradient of the last block's output.
    fn head_backward(
        &mut self,
        last: &M::Hidden,
        ends: &M::Ends,
        mut grads: B::Gradients,
    ) -> Result<M::Hidden, ZeroError> {
        let grad_h = last
            .take_grad(&mut grads)
            .ok_or_else(|| ZeroError::Model("the loss does not depend on the last block's output".into()))?;
        absorb_into::<B, _>(&mut self.core, &self.parts[0].params, ends, &mut grads)?;
        Ok(grad_h)
    }

    /// Stages 0-2: the embedding's backward, on the graph kept from forward.
    fn embed_backward(&mut self, embedded: M::Hidden, grad_h: M::Hidden) -> Result<(), ZeroError> {
        let ends = self.embed_ends.take().unwrap_or_else(|| unreachable!("set by forward"));
        self.fence()?;
        let mut grads = embedded.dot(grad_h).backward();
        absorb_into::<B, _>(&mut self.core, &self.parts[0].params, &ends, &mut grads)
    }

    /// The optimizer step at an accumulation boundary; `None` between boundaries.
    ///
    /// With the optimizer offloaded to the CPU and
    /// [`EngineSettings::overlap_optimizer_step`] on, the step decides everything (reductions,
    /// norm, clipping, overflow, learning rate: the returned report is final) and leaves the
    /// update of the fp32 shard running in the background, part by part; the next forward
    /// waits for each part's update just before it uses the part. Whatever reads the weights
    /// or the optimizer state waits for the whole update first; [`Self::wait_for_update`]
    /// does it explicitly. An error of the background update is returned by the next call
    /// that waits for it, naming the part.
    pub fn step(&mut self) -> Result<Option<StepReport>, ZeroError> {
        if !self.core.at_boundary() {
            return Ok(None);
        }
        self.drop_kept_ends();
        let report = self.core.update()?;
        // A skipped step moved nothing; stage 3 gathers its new shards at the next use.
        if !report.skipped {
            if self.core.updates_pending() {
                if self.core.settings.stage != Stage::Zero3 {
                    self.stale.iter_mut().for_each(|s| *s = true);
                }
            } else {
                self.refresh_replica()?;
            }
        }
        Ok(Some(report))
    }

    /// Waits for the last step's update if it runs in the background, and (stages 0-2)
    /// rewrites the replica's parts that have not been rewritten since. Every rank calls it
    /// together (the rewrite gathers the shards). A no-op when nothing is pending.
    pub fn wait_for_update(&mut self) -> Result<(), ZeroError> {
        self.core.wait_for_updates()?;
        for part in 0..self.parts.len() {
            self.ready_part(part)?;
        }
        Ok(())
    }

    /// Whether this engine runs each step's optimizer update in the background, overlapped
    /// with the next forward ([`EngineSettings::overlap_optimizer_step`] on, the optimizer
    /// offloaded to the CPU, and an update that is local work: see that setting).
    pub fn overlaps_optimizer_step(&self) -> bool {
        self.core.defers_updates()
    }

    /// Waits for the last step's background update, if any, and puts the state back (no
    /// collective): before anything reads the masters or the optimizer state.
    pub(crate) fn settle_state(&mut self) -> Result<(), ZeroError> {
        self.core.wait_for_updates()
    }

    /// Makes `part`'s weights current before its use: waits for its background update and
    /// (stages 0-2) rewrites its replica from the masters. Every rank readies the same parts
    /// in the same order, so the rewrite's gathers match.
    fn ready_part(&mut self, part: usize) -> Result<(), ZeroError> {
        self.core.wait_for_part(part)?;
        if self.stale.get(part).copied().unwrap_or(false) {
            self.refresh_part(part)?;
            self.stale[part] = false;
        }
        Ok(())
    }

    /// The whole model with the current weights, on every rank (stage 3 gathers every part;
    /// stages 1-2 gather the parts whose update ran in the background since their last use):
    /// every rank calls it together.
    pub fn module(&mut self) -> Result<M, ZeroError> {
        self.wait_for_update()?;
        if self.core.settings.stage != Stage::Zero3 {
            return Ok(M::from_parts(self.ends.clone(), self.blocks.clone()));
        }
        self.schedule.clear();
        self.drop_kept_ends();
        self.keep_ends = false;
        let ends = self.materialize_ends(false)?;
        self.release(0, ());
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for b in 0..self.blocks.len() {
            blocks.push(self.materialize_block(b, false)?);
            self.release(b + 1, ());
        }
        Ok(M::from_parts(ends, blocks))
    }

    /// Bytes held by this rank, by kind (after the background update, if one runs, is done
    /// with what it frees).
    pub fn memory(&self) -> MemoryReport {
        self.core.wait_idle();
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

    /// The dtype of the model's parameters: a model's float inputs must be cast to
    /// `compute_dtype().burn()` (the chain's `embed` can follow its parameters' dtype).
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

    /// The barrier of `backward_fence` (see [`EngineSettings::backward_fence`]), if any.
    fn fence(&self) -> Result<(), ZeroError> {
        match &self.core.settings.backward_fence {
            Some(group) => Ok(group.barrier()?),
            None => Ok(()),
        }
    }

    /// Stage 3: the ends with their gathered weights (leaves recording gradients when
    /// `require_grad`); the next parts on the schedule are prefetched.
    fn materialize_ends(&mut self, require_grad: bool) -> Result<M::Ends, ZeroError> {
        let values = match self.kept_ends.take() {
            Some(values) => values,
            None => self.gather_values(0)?,
        };
        let ends = self.fill(self.ends.clone(), 0, &values, require_grad);
        if self.keep_ends {
            self.kept_ends = Some(values);
        }
        Ok(ends)
    }

    /// Whether the ends may stay gathered from the embedding to the head, and from the head's
    /// backward to the embedding's (DeepSpeed's `stage3_max_reuse_distance`: the parameters
    /// gathered in between, here every block; `stage3_max_live_parameters`: the ends and the
    /// largest block live at once).
    fn ends_reused_within_limits(&self) -> bool {
        let blocks = &self.parts[1..];
        let distance: usize = blocks.iter().map(|p| p.gathered_elements).sum();
        let largest = blocks.iter().map(|p| p.gathered_elements).max().unwrap_or(0);
        distance <= self.core.settings.max_reuse_distance
            && self.parts[0].gathered_elements + largest <= self.core.settings.max_live_parameters
    }

    /// Drops ends kept from a micro-batch whose backward never came (their values would be
    /// stale after the next step).
    fn drop_kept_ends(&mut self) {
        if self.kept_ends.take().is_some() {
            self.release(0, ());
        }
    }

    /// Stage 3: block `b` with its gathered weights (see [`Self::materialize_ends`]).
    fn materialize_block(&mut self, b: usize, require_grad: bool) -> Result<M::Block, ZeroError> {
        let values = self.gather_values(b + 1)?;
        Ok(self.fill(self.blocks[b].clone(), b + 1, &values, require_grad))
    }

    /// The full values of a part's groups (gathered, or taken from a prefetch), then the
    /// prefetch of what comes next on the schedule.
    fn gather_values(&mut self, part: usize) -> Result<HashMap<usize, FlatBuffer>, ZeroError> {
        self.core.wait_for_part(part)?;
        if self.schedule.front() == Some(&part) {
            self.schedule.pop_front();
        }
        let mut full = HashMap::new();
        for g in self.parts[part].groups.clone() {
            let values = match self.prefetched.remove(&g) {
                Some(work) => work.wait()?,
                None => {
                    if self.core.state.layout.groups[g].placement == Placement::Sharded {
                        let bytes = self.core.state.layout.groups[g].padded * self.element_size();
                        self.core.memory.add_gathered(bytes);
                    }
                    self.core.gather_group_buffer(g)?
                }
            };
            full.insert(g, values);
        }
        self.prefetch();
        Ok(full)
    }

    /// Pours a part's full values into a copy of its skeleton.
    fn fill<P: Module<B>>(&self, skeleton: P, part: usize, full: &HashMap<usize, FlatBuffer>, require_grad: bool) -> P {
        let places = &self.core.places;
        let layout = &self.core.state.layout;
        let params = &self.parts[part].params;
        let dtype = self.core.settings.precision.dtype;
        write_data(skeleton, &self.device, require_grad, |i, shape| {
            let place = places[params[i]];
            let n = layout.params[params[i]].numel();
            match full.get(&place.group) {
                Some(values) => half_buffer::slice_data(values, place.offset..place.offset + n, shape),
                // Every group of the part was gathered just before; zeros, never stale weights.
                None => half_buffer::f32_to_data(vec![0.0; n], shape, dtype),
            }
        })
    }

    /// Bytes per parameter element as the model holds it.
    fn element_size(&self) -> usize {
        self.core.settings.precision.dtype.size()
    }

    /// Starts the gathers of the next parts on the schedule, within the prefetch budget.
    fn prefetch(&mut self) {
        if !self.core.settings.overlap_comm || self.core.comm.world_size() == 1 {
            return;
        }
        let budget = self.core.settings.prefetch_bucket_size;
        let mut planned = 0usize;
        let ahead: Vec<usize> = self.schedule.iter().copied().collect();
        for part in ahead {
            let elements = self.parts[part].gathered_elements;
            if planned > 0 && planned + elements > budget {
                break;
            }
            // A part whose update still runs is gathered when it is needed, after the wait;
            // stopping here keeps every rank's gathers in schedule order whatever the timing.
            if self.core.part_pending(part) {
                break;
            }
            planned += elements;
            for &g in &self.parts[part].groups {
                let layout = &self.core.state.layout;
                if layout.groups[g].placement != Placement::Sharded || self.prefetched.contains_key(&g) {
                    continue;
                }
                // A shard that cannot be read is left to the gather that needs it, which fails.
                let Ok(shard) = self.core.shard_buffer(g) else { continue };
                self.core
                    .memory
                    .add_gathered(layout.groups[g].padded * self.element_size());
                self.prefetched.insert(g, self.core.comm.all_gather_async(shard));
            }
            if planned >= budget {
                break;
            }
        }
    }

    /// Drops a gathered part and its accounting.
    fn release<P>(&self, part: usize, module: P) {
        drop(module);
        if part == 0 && self.kept_ends.is_some() {
            // Still held for a later use; accounted for until then.
            return;
        }
        let bytes = self.parts[part].gathered_elements * self.element_size();
        self.core.memory.sub_gathered(bytes);
    }
}

/// Sets each part's `gathered_elements`: the padded elements of its sharded groups, what a
/// gather of the part brings in.
pub(crate) fn count_gathered_elements(parts: &mut [Part], layout: &PartitionLayout) {
    for part in parts {
        part.gathered_elements = part
            .groups
            .iter()
            .filter(|&&g| layout.groups[g].placement == Placement::Sharded)
            .map(|&g| layout.groups[g].padded)
            .sum();
    }
}

/// Takes the gradients of a part's parameters (`params`: their global indices, in the part's
/// visit order) out of `grads` into the engine's reductions.
fn absorb_into<B: AutodiffBackend, P: Module<B>>(
    core: &mut EngineCore,
    params: &[usize],
    module: &P,
    grads: &mut B::Gradients,
) -> Result<(), ZeroError> {
    let mut failure = None;
    take_grads::<B, P>(module, grads, |i, g| {
        if failure.is_none() {
            if let Err(e) = core.absorb(params[i], g) {
                failure = Some(e);
            }
        }
    });
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// What checkpointing needs of the engine (`crate::checkpoint`).
impl<B: AutodiffBackend, M: ChainModel<B>> ChainEngine<B, M> {
    /// An engine from parts already laid out and a core already holding the rank's state.
    pub(crate) fn from_state(
        ends: M::Ends,
        blocks: Vec<M::Block>,
        parts: Vec<Part>,
        mut core: EngineCore,
        device: B::Device,
    ) -> Self {
        let names_and_groups = parts
            .iter()
            .enumerate()
            .map(|(p, part)| {
                let name = if p == 0 {
                    "the ends".to_string()
                } else {
                    format!("block {}", p - 1)
                };
                (name, part.groups.clone())
            })
            .collect();
        core.defer_updates(names_and_groups);
        let stale = vec![false; parts.len()];
        ChainEngine {
            ends,
            blocks,
            parts,
            core,
            device,
            prefetched: HashMap::new(),
            schedule: VecDeque::new(),
            embed_ends: None,
            kept_ends: None,
            keep_ends: false,
            stale,
        }
    }

    /// The shared state, to save.
    pub(crate) fn core_ref(&self) -> &EngineCore {
        &self.core
    }

    /// The shared state, to restore.
    pub(crate) fn core_mut(&mut self) -> &mut EngineCore {
        &mut self.core
    }

    /// Stages 0-2: writes the owned masters, gathered, into the parts (after a load replaced
    /// them). Stage 3 holds no replica: its masters are gathered at each use.
    pub(crate) fn refresh_replica(&mut self) -> Result<(), ZeroError> {
        self.settle_state()?;
        if self.core.settings.stage == Stage::Zero3 {
            return Ok(());
        }
        for part in 0..self.parts.len() {
            self.refresh_part(part)?;
            self.stale[part] = false;
        }
        Ok(())
    }

    /// Stages 0-2: writes part `part`'s owned masters, gathered, into its replica. A group
    /// never spans two parts, so part by part gathers what the whole model's refresh would.
    fn refresh_part(&mut self, part: usize) -> Result<(), ZeroError> {
        let mut source = self.core.value_source();
        let params = &self.parts[part].params;
        if part == 0 {
            let placeholder = skeleton::<B, _>(self.ends.clone());
            let ends = std::mem::replace(&mut self.ends, placeholder);
            self.ends = write_data(ends, &self.device, true, |i, _| source.take_data(params[i]));
        } else {
            let block = &mut self.blocks[part - 1];
            let placeholder = skeleton::<B, _>(block.clone());
            let old = std::mem::replace(block, placeholder);
            *block = write_data(old, &self.device, true, |i, _| source.take_data(params[i]));
        }
        source.finish()
    }
}
