//! Evaluating a pipelined model: micro-batches through the stages' forwards only (validation).

use super::engine::PipelineEngine;
use super::layer::{PipeHidden, PipeLayer};
use crate::error::ZeroError;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;

impl<B: AutodiffBackend, L: PipeLayer<B>> PipelineEngine<B, L> {
    /// The whole model's mean loss over `micro_batches` (any number, the same on every stage)
    /// and the data-parallel ranks, without training: each micro-batch goes forward through the
    /// stages one after the other, and the gradients, the optimizer and the step count are left
    /// alone. Every rank of every stage calls it and gets the same value.
    pub fn eval_batch(&mut self, micro_batches: &[L::Batch]) -> Result<f32, ZeroError> {
        let n = self.layers.len();
        let mut losses = Vec::with_capacity(micro_batches.len());
        for batch in micro_batches {
            let mut h = match &mut self.recv_prev {
                Some(channel) if !self.first => {
                    let (shape, values) = channel.recv()?;
                    L::Hidden::from_values(values, shape, self.dtype(), &self.device)
                }
                _ => self.layers[0].input(batch),
            };
            let end = if self.last { n - 1 } else { n };
            for layer in self.layers.iter().take(end).skip(usize::from(self.first)) {
                h = layer.forward(h);
            }
            if self.last {
                // Detached: nothing of the evaluation's graph outlives the micro-batch.
                let loss = self.layers[n - 1].loss(h, batch).detach();
                losses.push(loss.into_scalar().elem::<f32>());
            } else {
                let values = h.to_values();
                let dims = h.dims();
                let stage = self.stage;
                self.send_next
                    .as_mut()
                    .ok_or_else(|| ZeroError::Usage(format!("stage {stage} has no next stage to send to")))?
                    .send(&dims, values)?;
            }
        }
        if let Some(channel) = self.send_next.as_mut() {
            channel.flush()?;
        }
        self.shared_loss(&losses)
    }
}
