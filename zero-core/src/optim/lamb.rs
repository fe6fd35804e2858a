//! LAMB: Adam-style moments, with each parameter tensor's step scaled by its trust ratio
//! ‖p‖ / ‖u‖ (You et al. 2019), in the paper's form or DeepSpeed FusedLamb's (see
//! [`LambVariant`]).
//!
//! The trust ratio is per tensor, and under ZeRO a tensor may be cut between ranks, so the step
//! is split in two: [`ShardOptimizer::begin_step`] updates the moments and returns the shard's
//! partial ‖p‖² and ‖u‖² per parameter; the caller sums them over ranks; then
//! [`ShardOptimizer::finish_step`] applies `p -= lr · clamp(‖p‖/‖u‖) · u` with the totals.

use rayon::prelude::*;

use super::adam_kernel::HalfCopy;
use super::state::load_buffers;
use super::{adam_kernel, check_len, LambSpec, LambVariant, NormPartials, OptimError, ShardOptimizer, ShardSegments};

/// Elements per parallel chunk (see the Adam kernel for the reasoning).
const CHUNK: usize = 1 << 16;

/// LAMB over one shard. State: `exp_avg`, `exp_avg_sq`.
#[derive(Debug)]
pub struct Lamb {
    spec: LambSpec,
    segments: ShardSegments,
    step: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Set by `begin_step`, cleared by `finish_step`: the moments are one step ahead of the
    /// parameters in between.
    pending: bool,
}

/// The per-step constants of the update direction.
#[derive(Clone, Copy)]
struct Direction {
    inv_bc1: f32,
    inv_sqrt_bc2: f32,
    eps: f32,
    wd: f32,
}

impl Direction {
    /// `u = m̂ / (sqrt(v̂) + eps) + wd·p`.
    #[inline(always)]
    fn update(&self, p: f32, m: f32, v: f32) -> f32 {
        (m * self.inv_bc1) / (v.sqrt() * self.inv_sqrt_bc2 + self.eps) + self.wd * p
    }
}

impl Lamb {
    /// An optimizer for a shard of `len` elements cut into `segments`.
    pub fn new(spec: LambSpec, len: usize, segments: ShardSegments) -> Result<Self, OptimError> {
        spec.validate()?;
        segments.validate(len)?;
        Ok(Lamb {
            spec,
            segments,
            step: 0,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
            pending: false,
        })
    }

    /// The bias-correction factors (1 - β1^t, 1 - β2^t) of the current step.
    fn bias_corrections(&self) -> (f64, f64) {
        if self.spec.bias_correction {
            let t = self.step.min(i32::MAX as u64) as i32;
            (1.0 - self.spec.betas.0.powi(t), 1.0 - self.spec.betas.1.powi(t))
        } else {
            (1.0, 1.0)
        }
    }

    fn direction(&self) -> Direction {
        let (bc1, bc2) = match self.spec.variant {
            LambVariant::Paper => self.bias_corrections(),
            LambVariant::DeepSpeed => (1.0, 1.0),
        };
        Direction {
            inv_bc1: (1.0 / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: self.spec.eps as f32,
            wd: self.spec.weight_decay as f32,
        }
    }

    /// What multiplies `lr · ratio · u`: 1 in the paper's form, DeepSpeed's step-size factor
    /// sqrt(bc2)/bc1 in its kernel's.
    fn step_factor(&self) -> f64 {
        match self.spec.variant {
            LambVariant::Paper => 1.0,
            LambVariant::DeepSpeed => {
                let (bc1, bc2) = self.bias_corrections();
                bc2.sqrt() / bc1
            }
        }
    }

    /// The clamped trust ratio from total squared norms; 1 when either norm is zero.
    fn trust_ratio(&self, weight_sq: f32, update_sq: f32) -> f32 {
        if weight_sq > 0.0 && update_sq > 0.0 {
            let ratio = (weight_sq as f64).sqrt() / (update_sq as f64).sqrt();
            ratio.clamp(self.spec.min_coeff, self.spec.max_coeff) as f32
        } else {
            1.0
        }
    }
}

impl ShardOptimizer for Lamb {
    fn name(&self) -> &'static str {
        "lamb"
    }

    fn len(&self) -> usize {
        self.exp_avg.len()
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError> {
        let partials = self.begin_step(params, grads)?;
        self.finish_step(params, grads, lr, &partials, HalfCopy::None)
    }

    fn needs_cross_rank_norms(&self) -> bool {
        true
    }

    fn begin_step(&mut self, params: &[f32], grads: &[f32]) -> Result<NormPartials, OptimError> {
        if self.pending {
            return Err(OptimError::PhaseOrder("begin_step called twice without finish_step"));
        }
        check_len("params", self.len(), params.len())?;
        check_len("grads", self.len(), grads.len())?;
        self.step += 1;
        let (b1, b2) = (self.spec.betas.0 as f32, self.spec.betas.1 as f32);
        let (c1, c2) = ((1.0 - self.spec.betas.0) as f32, (1.0 - self.spec.betas.1) as f32);
        let dir = self.direction();
        let mut sums = vec![0.0_f64; 2 * self.segments.num_params];
        for seg in &self.segments.segments {
            let r = seg.range.clone();
            // Per-chunk sums, collected in order and added in order: the result does not depend
            // on how rayon happened to split the work.
            let chunk_sums: Vec<(f64, f64)> = params[r.clone()]
                .par_chunks(CHUNK)
                .zip(grads[r.clone()].par_chunks(CHUNK))
                .zip(self.exp_avg[r.clone()].par_chunks_mut(CHUNK))
                .zip(self.exp_avg_sq[r].par_chunks_mut(CHUNK))
                .map(|(((p, g), m), v)| {
                    let (mut w2, mut u2) = (0.0_f64, 0.0_f64);
                    for (((&p, &g), m), v) in p.iter().zip(g).zip(m).zip(v) {
                        *m = b1 * *m + c1 * g;
                        *v = b2 * *v + c2 * g * g;
                        let u = dir.update(p, *m, *v);
                        w2 += (p as f64) * (p as f64);
                        u2 += (u as f64) * (u as f64);
                    }
                    (w2, u2)
                })
                .collect();
            for (w2, u2) in chunk_sums {
                sums[2 * seg.param_id] += w2;
                sums[2 * seg.param_id + 1] += u2;
            }
        }
        self.pending = true;
        Ok(NormPartials(sums.into_iter().map(|x| x as f32).collect()))
    }

    fn finish_step(
        &mut self,
        params: &mut [f32],
        _grads: &[f32],
        lr: f64,
        totals: &NormPartials,
        out: HalfCopy<'_>,
    ) -> Result<(), OptimError> {
        if !self.pending {
            return Err(OptimError::PhaseOrder("finish_step called before begin_step"));
        }
        check_len("params", self.len(), params.len())?;
        if totals.0.len() != 2 * self.segments.num_params {
            return Err(OptimError::NormTotalsLength {
                expected: 2 * self.segments.num_params,
                actual: totals.0.len(),
            });
        }
        let dir = self.direction();
        let step_factor = self.step_factor();
        for seg in &self.segments.segments {
            let ratio = self.trust_ratio(totals.weight_sq(seg.param_id), totals.update_sq(seg.param_id));
            let scale = (lr * step_factor * ratio as f64) as f32;
            let r = seg.range.clone();
            params[r.clone()]
                .par_chunks_mut(CHUNK)
                .zip(self.exp_avg[r.clone()].par_chunks(CHUNK))
                .zip(self.exp_avg_sq[r].par_chunks(CHUNK))
                .for_each(|((p, m), v)| {
                    for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
                        *p -= scale * dir.update(*p, m, v);
                    }
                });
        }
        self.pending = false;
        adam_kernel::copy_to_half(params, out)
    }

    fn set_betas(&mut self, betas: (f64, f64)) -> bool {
        self.spec.betas = betas;
        true
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        vec![
            ("exp_avg", self.exp_avg.as_slice()),
            ("exp_avg_sq", self.exp_avg_sq.as_slice()),
        ]
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    fn load_state(&mut self, step: u64, buffers: &[(&str, &[f32])]) -> Result<(), OptimError> {
        let len = self.len();
        load_buffers(
            len,
            &mut [("exp_avg", &mut self.exp_avg), ("exp_avg_sq", &mut self.exp_avg_sq)],
            buffers,
        )?;
        self.step = step;
        self.pending = false;
        Ok(())
    }
}
