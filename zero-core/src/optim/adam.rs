//! Adam and AdamW on a flat shard, driving the fused SIMD kernel.

use super::adam_kernel::{self, AdamScalars, HalfCopy, Isa};
use super::state::load_buffers;
use super::{check_len, AdamSpec, OptimError, ShardOptimizer};

/// Adam / AdamW over one shard: `torch.optim.Adam` (L2 decay) or `torch.optim.AdamW` (decoupled
/// decay), with optional AMSGrad and optional bias correction.
#[derive(Debug)]
pub struct Adam {
    spec: AdamSpec,
    isa: Isa,
    step: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    max_exp_avg_sq: Vec<f32>,
}

impl Adam {
    /// An optimizer for a shard of `len` elements, with zeroed moments, on the kernel that
    /// measures fastest on this CPU ([`Isa::fastest`]).
    pub fn new(spec: AdamSpec, len: usize) -> Result<Self, OptimError> {
        spec.validate()?;
        let max_exp_avg_sq = if spec.amsgrad { vec![0.0; len] } else { Vec::new() };
        Ok(Adam {
            spec,
            isa: Isa::fastest(),
            step: 0,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
            max_exp_avg_sq,
        })
    }

    /// Runs the kernel for `isa` instead of the detected one (for tests and benchmarks).
    pub fn with_isa(mut self, isa: Isa) -> Result<Self, OptimError> {
        if !isa.is_supported() {
            return Err(OptimError::UnsupportedIsa(isa.name()));
        }
        self.isa = isa;
        Ok(self)
    }

    /// The kernel in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The settings.
    pub fn spec(&self) -> &AdamSpec {
        &self.spec
    }

    fn scalars(&self, lr: f64) -> AdamScalars {
        AdamScalars::new(
            lr,
            self.spec.betas.0,
            self.spec.betas.1,
            self.spec.eps,
            self.spec.weight_decay,
            self.spec.decoupled_weight_decay,
            self.spec.bias_correction,
            self.step,
        )
    }
}

impl ShardOptimizer for Adam {
    fn name(&self) -> &'static str {
        if self.spec.decoupled_weight_decay {
            "adamw"
        } else {
            "adam"
        }
    }

    fn len(&self) -> usize {
        self.exp_avg.len()
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError> {
        self.step_with_copy(params, grads, lr, HalfCopy::None)
    }

    fn step_with_copy(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f64,
        out: HalfCopy<'_>,
    ) -> Result<(), OptimError> {
        check_len("params", self.len(), params.len())?;
        check_len("grads", self.len(), grads.len())?;
        self.step += 1;
        let scalars = self.scalars(lr);
        let result = if self.spec.amsgrad {
            adam_kernel::adam_amsgrad_step(
                params,
                grads,
                &mut self.exp_avg,
                &mut self.exp_avg_sq,
                &mut self.max_exp_avg_sq,
                &scalars,
            )
            .and_then(|()| adam_kernel::copy_to_half(params, out))
        } else {
            adam_kernel::adam_step(
                self.isa,
                params,
                grads,
                &mut self.exp_avg,
                &mut self.exp_avg_sq,
                out,
                &scalars,
            )
        };
        if result.is_err() {
            self.step -= 1;
        }
        result
    }

    fn set_betas(&mut self, betas: (f64, f64)) -> bool {
        self.spec.betas = betas;
        true
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        let mut s = vec![
            ("exp_avg", self.exp_avg.as_slice()),
            ("exp_avg_sq", self.exp_avg_sq.as_slice()),
        ];
        if self.spec.amsgrad {
            s.push(("max_exp_avg_sq", self.max_exp_avg_sq.as_slice()));
        }
        s
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    fn load_state(&mut self, step: u64, buffers: &[(&str, &[f32])]) -> Result<(), OptimError> {
        let len = self.len();
        let mut targets = vec![("exp_avg", &mut self.exp_avg), ("exp_avg_sq", &mut self.exp_avg_sq)];
        if self.spec.amsgrad {
            targets.push(("max_exp_avg_sq", &mut self.max_exp_avg_sq));
        }
        load_buffers(len, &mut targets, buffers)?;
        self.step = step;
        Ok(())
    }
}
