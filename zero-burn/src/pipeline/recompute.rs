//! Activation checkpointing inside a pipeline stage.
//!
//! With the config's `activation_checkpointing` section, a stage's forward runs its middle
//! layers (all but the first stage's input layer and the last stage's loss layer) without
//! recording a graph, keeping only the input of each segment of them (`number_checkpoints`
//! segments; unset: one per layer). The micro-batch's backward reruns each segment from its
//! checkpoint with a graph, last segment first, carrying the gradient of each segment's input to
//! the segment before. Between its forward and its backward a micro-batch then holds a few
//! checkpoints instead of every layer's activations: with 1F1B's up to `stages - stage`
//! micro-batches in flight on a stage, this is where a pipeline's activation memory goes.
//!
//! The checkpoints are kept as the setting says (device, host, or partitioned over the tensor
//! group), exactly as `checkpointed_grads` keeps them.

use super::engine::PipelineEngine;
use super::layer::{PipeHidden, PipeLayer};
use crate::activation_checkpointing::{ActivationCheckpointing, Stored};
use crate::chain::Hidden;
use crate::error::ZeroError;
use burn::tensor::backend::AutodiffBackend;
use std::ops::Range;

/// A micro-batch's checkpoints between its forward and its backward.
pub(super) struct Checkpoints<H> {
    /// The setting they were kept under.
    setting: ActivationCheckpointing,
    /// Layer indices of each segment, in forward order.
    segments: Vec<Range<usize>>,
    /// Each segment's kept input.
    stored: Vec<Stored<H>>,
    /// What the segments hang from: the first stage's input-layer output with its graph, or
    /// another stage's input leaf.
    entry: H,
    /// The leaf after the last segment, where the rest of the forward's graph starts.
    exit: H,
}

impl<B: AutodiffBackend, L: PipeLayer<B>> PipelineEngine<B, L> {
    /// Runs `layers[middle]` from `h` (which carries the graph so far) without recording, keeping
    /// the segments' inputs; returns the checkpoints and the leaf the forward goes on from.
    /// `None` when the stage has no activation checkpointing or no middle layers.
    pub(super) fn checkpointed_forward(
        &self,
        layers: &[L],
        middle: Range<usize>,
        h: &L::Hidden,
    ) -> Result<Option<Checkpoints<L::Hidden>>, ZeroError> {
        let Some(setting) = self.core.settings.activation_checkpointing.clone() else {
            return Ok(None);
        };
        if middle.is_empty() {
            return Ok(None);
        }
        let segments: Vec<Range<usize>> = setting
            .segments(middle.len())?
            .into_iter()
            .map(|s| s.start + middle.start..s.end + middle.start)
            .collect();
        let mut stored = Vec::with_capacity(segments.len());
        let mut x = h.detached();
        for segment in &segments {
            if setting.synchronize_checkpoint_boundary {
                self.core.comm.barrier()?;
            }
            stored.push(setting.store::<B, _>(x.clone())?);
            for layer in &layers[segment.clone()] {
                x = layer.clone().no_grad().forward(x).detached();
            }
        }
        Ok(Some(Checkpoints {
            setting,
            segments,
            stored,
            entry: h.clone(),
            exit: x.leaf(),
        }))
    }

    /// The backward through checkpointed segments: `grad_exit` is the gradient of the leaf the
    /// forward went on from; each segment is rerun from its checkpoint and its layers'
    /// gradients are absorbed. Returns the entry and the gradient of it, which the caller
    /// backpropagates into the input layer (first stage) or sends to the previous stage.
    pub(super) fn checkpointed_backward(
        &mut self,
        layers: &[L],
        mut checkpoints: Checkpoints<L::Hidden>,
        mut grad: L::Hidden,
    ) -> Result<(L::Hidden, L::Hidden), ZeroError> {
        for segment in checkpoints.segments.iter().rev() {
            let kept = checkpoints
                .stored
                .pop()
                .ok_or_else(|| ZeroError::Model("a checkpoint per segment".into()))?;
            let x = checkpoints.setting.restore::<B, _>(kept, &self.device)?.leaf();
            let mut y = x.clone();
            for layer in &layers[segment.clone()] {
                y = layer.forward(y);
            }
            self.fence()?;
            let mut grads = y.dot(grad).backward();
            for i in segment.clone() {
                self.absorb_layer(i, &layers[i], &mut grads)?;
            }
            grad = x.take_grad(&mut grads).unwrap_or_else(|| x.zeros_like());
        }
        Ok((checkpoints.entry, grad))
    }
}

impl<H: Clone> Checkpoints<H> {
    /// The leaf after the last segment.
    pub(super) fn exit(&self) -> H {
        self.exit.clone()
    }
}
