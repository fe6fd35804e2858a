//! Lion: the sign of an interpolated momentum as the update, with decoupled weight decay
//! (Chen et al. 2023, as DeepSpeed's FusedLion computes it).

use rayon::prelude::*;

use super::state::load_buffers;
use super::{check_len, LionSpec, OptimError, ShardOptimizer};

/// Elements per parallel chunk (see the Adam kernel for the reasoning).
const CHUNK: usize = 1 << 16;

/// Lion over one shard: `c = β1·m + (1-β1)·g`, `p ← p·(1 - lr·wd) - lr·sign(c)`,
/// `m ← β2·m + (1-β2)·g`. One state buffer, `exp_avg`.
///
/// `sign(0) = 0`, as in the reference implementation (`torch.sign`): an element whose gradient
/// and momentum are both zero (ZeRO's padding, a frozen row) does not move. DeepSpeed's CUDA
/// FusedLion instead steps such an element by +lr (`c > 0 ? -lr : lr`).
#[derive(Debug)]
pub struct Lion {
    spec: LionSpec,
    step: u64,
    exp_avg: Vec<f32>,
}

impl Lion {
    /// An optimizer for a shard of `len` elements, with zeroed momentum.
    pub fn new(spec: LionSpec, len: usize) -> Result<Self, OptimError> {
        spec.validate()?;
        Ok(Lion {
            spec,
            step: 0,
            exp_avg: vec![0.0; len],
        })
    }
}

/// One Lion update in place, on slices of one length: `params` and the momentum `exp_avg` from
/// `grads` (see [`Lion`]), in parallel chunks. What [`Lion`] steps with, for callers that keep
/// the state themselves.
pub fn lion_update(
    params: &mut [f32],
    grads: &[f32],
    exp_avg: &mut [f32],
    betas: (f64, f64),
    weight_decay: f64,
    lr: f64,
) {
    let (b1, c1) = (betas.0 as f32, (1.0 - betas.0) as f32);
    let (b2, c2) = (betas.1 as f32, (1.0 - betas.1) as f32);
    let scale = (1.0 - lr * weight_decay) as f32;
    let lr = lr as f32;
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(exp_avg.par_chunks_mut(CHUNK))
        .for_each(|((p, g), m)| {
            for ((p, &g), m) in p.iter_mut().zip(g).zip(m) {
                let c = b1 * *m + c1 * g;
                *p = *p * scale - lr * sign(c);
                *m = b2 * *m + c2 * g;
            }
        });
}

/// `torch.sign`: 0 for ±0 (and NaN stays NaN), ±1 otherwise.
#[inline(always)]
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

impl ShardOptimizer for Lion {
    fn name(&self) -> &'static str {
        "lion"
    }

    fn len(&self) -> usize {
        self.exp_avg.len()
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError> {
        check_len("params", self.len(), params.len())?;
        check_len("grads", self.len(), grads.len())?;
        lion_update(
            params,
            grads,
            &mut self.exp_avg,
            self.spec.betas,
            self.spec.weight_decay,
            lr,
        );
        self.step += 1;
        Ok(())
    }

    fn set_betas(&mut self, betas: (f64, f64)) -> bool {
        self.spec.betas = betas;
        true
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        vec![("exp_avg", self.exp_avg.as_slice())]
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    fn load_state(&mut self, step: u64, buffers: &[(&str, &[f32])]) -> Result<(), OptimError> {
        let len = self.len();
        load_buffers(len, &mut [("exp_avg", &mut self.exp_avg)], buffers)?;
        self.step = step;
        Ok(())
    }
}
