//! SGD with momentum, dampening, Nesterov and L2 weight decay (`torch.optim.SGD`).

use rayon::prelude::*;

use super::state::load_buffers;
use super::{check_len, OptimError, SgdSpec, ShardOptimizer};

/// Elements per parallel chunk (see the Adam kernel for the reasoning).
const CHUNK: usize = 1 << 16;

/// One SGD update in place (`torch.optim.SGD`'s rule, as [`Sgd`] steps): `params` from
/// `grads`, with the momentum buffer when `spec` has momentum (`buffer`, of the same length;
/// `first` for the step that starts it, whose buffer is the gradient itself), in parallel
/// chunks. For callers that keep the state themselves.
pub fn sgd_update(params: &mut [f32], grads: &[f32], buffer: Option<&mut [f32]>, spec: &SgdSpec, first: bool, lr: f64) {
    let wd = spec.weight_decay as f32;
    let momentum = spec.momentum as f32;
    let damp = (1.0 - spec.dampening) as f32;
    let lr = lr as f32;
    let nesterov = spec.nesterov;
    match buffer {
        Some(buffer) => params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(buffer.par_chunks_mut(CHUNK))
            .for_each(|((p, g), buf)| {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(buf) {
                    let d = g + wd * *p;
                    *b = if first { d } else { momentum * *b + damp * d };
                    let d = if nesterov { d + momentum * *b } else { *b };
                    *p -= lr * d;
                }
            }),
        None => params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .for_each(|(p, g)| {
                for (p, &g) in p.iter_mut().zip(g) {
                    *p -= lr * (g + wd * *p);
                }
            }),
    }
}

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
        let buffer = self.has_buffer().then_some(self.momentum_buffer.as_mut_slice());
        sgd_update(params, grads, buffer, &self.spec, self.step == 0, lr);
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
