//! SGD with momentum, dampening, Nesterov and L2 weight decay (`torch.optim.SGD`).

use rayon::prelude::*;

use super::state::load_buffers;
use super::{check_len, OptimError, SgdSpec, ShardOptimizer};

/// Elements per parallel chunk (see the Adam kernel for the reasoning).
const CHUNK: usize = 1 << 16;

/// SGD over one shard. With momentum, the buffer starts as the first step's (decayed) gradient,
/// as PyTorch's does, and is named `momentum_buffer` in checkpoints.
#[derive(Debug)]
pub struct Sgd {
    spec: SgdSpec,
    step: u64,
    len: usize,
    momentum_buffer: Vec<f32>,
}

impl Sgd {
    /// An optimizer for a shard of `len` elements.
    pub fn new(spec: SgdSpec, len: usize) -> Result<Self, OptimError> {
        spec.validate()?;
        let momentum_buffer = if spec.momentum != 0.0 {
            vec![0.0; len]
        } else {
            Vec::new()
        };
        Ok(Sgd {
            spec,
            step: 0,
            len,
            momentum_buffer,
        })
    }

    fn has_buffer(&self) -> bool {
        self.spec.momentum != 0.0
    }
}

impl ShardOptimizer for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
    }

    fn len(&self) -> usize {
        self.len
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError> {
        check_len("params", self.len, params.len())?;
        check_len("grads", self.len, grads.len())?;
        let wd = self.spec.weight_decay as f32;
        let momentum = self.spec.momentum as f32;
        let damp = (1.0 - self.spec.dampening) as f32;
        let lr = lr as f32;
        let nesterov = self.spec.nesterov;
        let first = self.step == 0;
        if self.has_buffer() {
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .zip(self.momentum_buffer.par_chunks_mut(CHUNK))
                .for_each(|((p, g), buf)| {
                    for ((p, &g), b) in p.iter_mut().zip(g).zip(buf) {
                        let d = g + wd * *p;
                        *b = if first { d } else { momentum * *b + damp * d };
                        let d = if nesterov { d + momentum * *b } else { *b };
                        *p -= lr * d;
                    }
                });
        } else {
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .for_each(|(p, g)| {
                    for (p, &g) in p.iter_mut().zip(g) {
                        *p -= lr * (g + wd * *p);
                    }
                });
        }
        self.step += 1;
        Ok(())
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        if self.has_buffer() {
            vec![("momentum_buffer", self.momentum_buffer.as_slice())]
        } else {
            Vec::new()
        }
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    fn load_state(&mut self, step: u64, buffers: &[(&str, &[f32])]) -> Result<(), OptimError> {
        let len = self.len;
        let mut targets = Vec::new();
        if self.spec.momentum != 0.0 {
            targets.push(("momentum_buffer", &mut self.momentum_buffer));
        }
        load_buffers(len, &mut targets, buffers)?;
        self.step = step;
        Ok(())
    }
}
