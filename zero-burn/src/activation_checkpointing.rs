//! Activation checkpointing: keep a few block inputs from forward, recompute the rest in backward.
//!
//! A chain's blocks are cut into `number_checkpoints` contiguous segments. Forward runs every
//! block without recording a graph and keeps only each segment's input (the *checkpoint*);
//! backward walks the segments in reverse, reruns each one from its checkpoint with a graph, and
//! backpropagates through it. Activation memory is then about `k` checkpoints plus one segment's
//! activations instead of every block's, for one more forward of the blocks.
//!
//! DeepSpeed's `activation_checkpointing` section maps onto [`ActivationCheckpointing`]:
//! `number_checkpoints` (default: one per block), `cpu_checkpointing` (checkpoints kept as host
//! data), `partition_activations` (each rank of the tensor-parallel group keeps 1/t of every
//! checkpoint; the pieces are all-gathered before recomputation) and
//! `synchronize_checkpoint_boundary` (a barrier of the data-parallel group at each checkpoint).
//! `contiguous_memory_optimization` has nothing to act on here: it packs checkpoints into one
//! preallocated device buffer against CUDA allocator fragmentation, and host checkpoints are
//! already one allocation each.
//!
//! Engines apply it through [`crate::EngineSettings::activation_checkpointing`]; a plain Burn
//! training loop (with `ZeroOptimizer`, or Burn's own optimizers) gets the same for any
//! [`ChainModel`] from [`checkpointed_grads`], whose blocks may be `ZeroModule`s (each segment's
//! backward is a graph of its own: a unit's gradient is reduce-scattered there).

use crate::chain::{ChainModel, Hidden};
use crate::error::ZeroError;
use crate::params::fresh_leaves;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Shape, Tensor, TensorData};
use std::ops::Range;
use zero_core::comm::{FlatBuffer, SharedGroup};

/// How a chain's block activations are checkpointed (DeepSpeed's `activation_checkpointing`).
#[derive(Clone, Default)]
pub struct ActivationCheckpointing {
    /// Checkpoints (segments of blocks) in the model; `None`: one per block.
    pub number_checkpoints: Option<usize>,
    /// Keep checkpoints as host data rather than tensors on the model's device.
    pub cpu_checkpointing: bool,
    /// Split every checkpoint across this group (the tensor-parallel ranks, which hold the same
    /// activation), each keeping one piece.
    pub partition_group: Option<SharedGroup>,
    /// Wait for every rank of the data-parallel group at each checkpoint.
    pub synchronize_checkpoint_boundary: bool,
    /// The group [`checkpointed_grads`] waits on under `synchronize_checkpoint_boundary` (the
    /// data-parallel ranks; engines wait on their own group).
    pub boundary_group: Option<SharedGroup>,
}

impl std::fmt::Debug for ActivationCheckpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivationCheckpointing")
            .field("number_checkpoints", &self.number_checkpoints)
            .field("cpu_checkpointing", &self.cpu_checkpointing)
            .field(
                "partition_group",
                &self.partition_group.as_ref().map(|g| g.world_size()),
            )
            .field("synchronize_checkpoint_boundary", &self.synchronize_checkpoint_boundary)
            .field("boundary_group", &self.boundary_group.as_ref().map(|g| g.world_size()))
            .finish()
    }
}

impl ActivationCheckpointing {
    /// The blocks `0..blocks` cut into this setting's segments, in order.
    pub fn segments(&self, blocks: usize) -> Result<Vec<Range<usize>>, ZeroError> {
        segments(blocks, self.number_checkpoints)
    }

    /// Keeps a checkpoint as this setting says.
    pub(crate) fn store<B: AutodiffBackend, H: Hidden<B>>(&self, h: H) -> Result<Stored<H>, ZeroError> {
        if let Some(group) = &self.partition_group {
            return Stored::partition(&h, group);
        }
        if self.cpu_checkpointing {
            return Ok(Stored::Host(h.to_host()));
        }
        Ok(Stored::Device(h.detached()))
    }

    /// The checkpoint back as an activation on `device`, recording nothing.
    pub(crate) fn restore<B: AutodiffBackend, H: Hidden<B>>(
        &self,
        stored: Stored<H>,
        device: &B::Device,
    ) -> Result<H, ZeroError> {
        match stored {
            Stored::Device(h) => Ok(h),
            Stored::Host(data) => Ok(H::from_host(data, device)),
            Stored::Piece { piece, tensors } => {
                let group = self.partition_group.as_ref().ok_or_else(|| {
                    ZeroError::Model("a partitioned checkpoint needs the partition group to restore it".into())
                })?;
                let full = group.all_gather(FlatBuffer::F32(piece))?.into_f32();
                let mut data = Vec::with_capacity(tensors.len());
                let mut at = 0;
                for (shape, dtype) in tensors {
                    let n = shape.num_elements();
                    let values = full.get(at..at + n).ok_or_else(|| {
                        ZeroError::Model("a partitioned checkpoint came back shorter than it was stored".into())
                    })?;
                    data.push(TensorData::new(values.to_vec(), shape).convert_dtype(dtype));
                    at += n;
                }
                Ok(H::from_host(data, device))
            }
        }
    }
}

/// `blocks` cut into `count` contiguous segments as equal as possible, the longer ones first
/// (`None`: one segment per block). Zero checkpoints is an error.
pub fn segments(blocks: usize, count: Option<usize>) -> Result<Vec<Range<usize>>, ZeroError> {
    let count = match count {
        Some(0) => {
            return Err(ZeroError::Model(
                "activation_checkpointing.number_checkpoints must be at least 1 (or left unset: one per block)".into(),
            ))
        }
        Some(c) => c.min(blocks),
        None => blocks,
    };
    if blocks == 0 {
        return Ok(Vec::new());
    }
    let (base, extra) = (blocks / count, blocks % count);
    let mut out = Vec::with_capacity(count);
    let mut start = 0;
    for s in 0..count {
        let len = base + usize::from(s < extra);
        out.push(start..start + len);
        start += len;
    }
    Ok(out)
}

/// A kept checkpoint.
pub(crate) enum Stored<H> {
    /// The activation itself, cut from any graph.
    Device(H),
    /// Host copies of its tensors.
    Host(Vec<TensorData>),
    /// This rank's piece of the activation's elements (f32, concatenated over its tensors and
    /// padded to a multiple of the group size), and each tensor's shape and dtype.
    Piece {
        piece: Vec<f32>,
        tensors: Vec<(Shape, DType)>,
    },
}

impl<H> Stored<H> {
    fn partition<B: AutodiffBackend>(h: &H, group: &SharedGroup) -> Result<Self, ZeroError>
    where
        H: Hidden<B>,
    {
        let data = h.to_host();
        let mut tensors = Vec::with_capacity(data.len());
        let mut flat = Vec::new();
        for d in data {
            tensors.push((d.shape.clone(), d.dtype));
            let values = d
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| ZeroError::Model(format!("a checkpoint's values cannot be read as f32: {e:?}")))?;
            flat.extend(values);
        }
        let world = group.world_size();
        let piece_len = flat.len().div_ceil(world);
        flat.resize(piece_len * world, 0.0);
        let rank = group.rank();
        let piece = flat[rank * piece_len..(rank + 1) * piece_len].to_vec();
        Ok(Stored::Piece { piece, tensors })
    }
}

/// Loss and gradients of one batch for a chain model in plain Burn, with its blocks
/// checkpointed as `setting` says (segments, checkpoints in host memory or partitioned, a
/// barrier at each boundary).
///
/// The result is what `(model.loss(batch) * loss_scale).backward()` would give, as
/// [`GradientsParams`] for the optimizer (`optim.step(lr, model, grads)`; under fp16,
/// `loss_scale` is `ZeroOptimizer::scale_for_backward()`, which tells the step that the
/// gradients it gets are scaled), without keeping every block's activations
/// alive between forward and backward; the loss is returned unscaled.
pub fn checkpointed_grads<B, M>(
    model: &M,
    batch: &M::Batch,
    setting: &ActivationCheckpointing,
    loss_scale: f32,
) -> Result<(f32, GradientsParams), ZeroError>
where
    B: AutodiffBackend,
    M: ChainModel<B> + AutodiffModule<B>,
    M::Ends: AutodiffModule<B>,
    M::Block: AutodiffModule<B>,
{
    let (ends, blocks) = model.clone().into_parts();
    // The ends serve the embedding and the head, each its own graph: each use gets its own
    // leaves over the same values (and the same parameter ids).
    let (embed_ends, head_ends) = (fresh_leaves::<B, _>(ends.clone()), fresh_leaves::<B, _>(ends));
    let segments = setting.segments(blocks.len())?;
    let mut out = GradientsParams::new();
    // Where checkpoints kept on the host come back to.
    let device = model.devices().into_iter().next().unwrap_or_default();

    // Forward: the embedding and the blocks run untracked, keeping only the inputs of the
    // segments after the first (the first starts from the embedding, run again in its
    // backward); the head is its own graph on a leaf.
    let mut h = M::try_embed(&embed_ends.clone().no_grad(), batch)?.detached();
    let mut checkpoints = Vec::with_capacity(segments.len());
    for (i, seg) in segments.iter().enumerate() {
        if let (true, Some(group)) = (setting.synchronize_checkpoint_boundary, &setting.boundary_group) {
            group.barrier()?;
        }
        if i > 0 {
            checkpoints.push(setting.store(h.clone())?);
        }
        for block in &blocks[seg.clone()] {
            h = M::try_block_forward(&block.clone().no_grad(), h)?.detached();
        }
    }
    let last = h.leaf();
    let head_input = if segments.is_empty() {
        // No blocks: the embedding is the head's input, in the head's graph.
        M::try_embed(&embed_ends, batch)?
    } else {
        last.clone()
    };
    let loss = M::try_head_loss(&head_ends, head_input, batch)?;
    let value = loss.clone().into_scalar().elem::<f32>();

    let seed = if loss_scale != 1.0 {
        loss.mul_scalar(loss_scale)
    } else {
        loss
    };
    let mut grads = seed.backward();
    add_grads::<B, _>(
        &mut out,
        &head_ends,
        GradientsParams::from_module(&mut grads, &head_ends),
    );
    if segments.is_empty() {
        add_grads::<B, _>(
            &mut out,
            &embed_ends,
            GradientsParams::from_module(&mut grads, &embed_ends),
        );
        return Ok((value, out));
    }
    let mut grad_h = last
        .take_grad(&mut grads)
        .ok_or_else(|| ZeroError::Model("the loss does not depend on the last block's output".into()))?;
    drop(grads);

    // Backward, the segments in reverse, each run again from its checkpoint as a graph of its
    // own; the first from the embedding, whose backward is that graph's too. Every backward
    // then follows a forward of its own: a unit's gather there keeps rank threads in step
    // before its reduce-scatter in backward (on burn 0.21 a rank still cleaning up its last
    // backward holds every graph's lock, the peer's included).
    for (i, seg) in segments.iter().enumerate().rev() {
        let (x, mut y) = if i == 0 {
            (None, M::try_embed(&embed_ends, batch)?)
        } else {
            let stored = checkpoints
                .pop()
                .unwrap_or_else(|| unreachable!("one per segment after the first"));
            let x = setting.restore::<B, M::Hidden>(stored, &device)?.leaf();
            (Some(x.clone()), x)
        };
        for block in &blocks[seg.clone()] {
            y = M::try_block_forward(block, y)?;
        }
        let mut grads = y.dot(grad_h.clone()).backward();
        for block in &blocks[seg.clone()] {
            add_grads::<B, _>(&mut out, block, GradientsParams::from_module(&mut grads, block));
        }
        match x {
            Some(x) => {
                grad_h = x.take_grad(&mut grads).ok_or_else(|| {
                    ZeroError::Model(format!("blocks {seg:?}: the output does not depend on the input"))
                })?;
            }
            None => add_grads::<B, _>(
                &mut out,
                &embed_ends,
                GradientsParams::from_module(&mut grads, &embed_ends),
            ),
        }
    }
    Ok((value, out))
}

/// Moves `module`'s gradients from `part` into `total`, adding where `total` has one already
/// (the ends are used by both the embedding and the head).
fn add_grads<B: AutodiffBackend, P: Module<B>>(total: &mut GradientsParams, module: &P, mut part: GradientsParams) {
    struct Move<'a> {
        total: &'a mut GradientsParams,
        part: &'a mut GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Move<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            type Inner<B> = <B as AutodiffBackend>::InnerBackend;
            if let Some(g) = self.part.remove::<Inner<B>, D>(param.id) {
                let sum = match self.total.remove::<Inner<B>, D>(param.id) {
                    Some(before) => before + g,
                    None => g,
                };
                self.total.register::<Inner<B>, D>(param.id, sum);
            }
        }
    }
    module.visit(&mut Move { total, part: &mut part });
}
