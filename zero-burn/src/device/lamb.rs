//! LAMB on flat fp32 device tensors, with the host kernel's arithmetic (zero_core::optim::Lamb).
//!
//! The trust ratio ‖p‖ / ‖u‖ is per parameter tensor, and a tensor may be cut between ranks: the
//! shard's partial squared norms (one pair per parameter of the group) are summed over the ranks
//! through the device collective, a tensor of 2·P elements, and the ratios computed from the
//! totals on the device. Nothing is read on the host, but with tensor parallelism: those 2·P
//! scalars then also add over the tensor ranks through their host group (`TensorNorms`).

use super::collective::DeviceCollective;
use crate::agreement::TensorNorms;
use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use std::ops::Range;
use zero_core::comm::ReduceOp;
use zero_core::optim::{LambSpec, LambVariant, ShardSegments};

/// LAMB over one flat shard. State: `exp_avg`, `exp_avg_sq` (the host optimizer's names).
#[derive(Debug)]
pub(crate) struct DeviceLamb<B: Backend> {
    spec: LambSpec,
    step: u64,
    /// The shard's pieces of parameter tensors, in shard order; what lies between them is
    /// padding, never changed.
    segments: Vec<(usize, Range<usize>)>,
    /// Parameters of the group (the length of every rank's partial sums).
    num_params: usize,
    pub(super) exp_avg: Tensor<B, 1>,
    pub(super) exp_avg_sq: Tensor<B, 1>,
}

impl<B: Backend> DeviceLamb<B> {
    /// Sets (β1, β2) for the next steps (momentum-cycling schedules).
    pub(crate) fn set_betas(&mut self, betas: (f64, f64)) {
        self.spec.betas = betas;
    }

    /// An optimizer for a shard of `len` elements cut into `segments` (already validated
    /// against `len`), with zeroed moments on `device`.
    pub(crate) fn new(spec: LambSpec, len: usize, segments: &ShardSegments, device: &B::Device) -> Self {
        let mut pieces: Vec<(usize, Range<usize>)> = segments
            .segments
            .iter()
            .filter(|s| !s.range.is_empty())
            .map(|s| (s.param_id, s.range.clone()))
            .collect();
        pieces.sort_by_key(|(_, r)| r.start);
        let zeros = || super::flat::zeros::<B>(len, DType::F32, device);
        DeviceLamb {
            spec,
            step: 0,
            segments: pieces,
            num_params: segments.num_params,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.exp_avg.dims()[0]
    }

    pub(crate) fn step_count(&self) -> u64 {
        self.step
    }

    pub(crate) fn load(&mut self, step: u64, exp_avg: Tensor<B, 1>, exp_avg_sq: Tensor<B, 1>) {
        self.step = step;
        self.exp_avg = exp_avg;
        self.exp_avg_sq = exp_avg_sq;
    }

    /// (1 - β1^t, 1 - β2^t) of the current step, or ones without bias correction.
    fn bias_corrections(&self) -> (f64, f64) {
        if self.spec.bias_correction {
            let t = self.step.min(i32::MAX as u64) as i32;
            (1.0 - self.spec.betas.0.powi(t), 1.0 - self.spec.betas.1.powi(t))
        } else {
            (1.0, 1.0)
        }
    }

    /// One update of `params` from `grads` at `lr`. `across`: the ranks the group's parameter
    /// tensors are cut over, whose partial norms are summed (none when this rank holds every
    /// tensor of the group whole). `tensor`: with tensor parallelism, the norms over the tensor
    /// ranks too, and this group's index.
    pub(crate) fn step(
        &mut self,
        params: Tensor<B, 1>,
        grads: Tensor<B, 1>,
        lr: f64,
        across: Option<&dyn DeviceCollective<B>>,
        tensor: Option<(&TensorNorms, usize)>,
    ) -> Result<Tensor<B, 1>, ZeroError> {
        let device = params.device();
        self.step += 1;
        let (b1, b2) = self.spec.betas;
        // The host kernel's f32 constants.
        let (bc1, bc2) = self.bias_corrections();
        let (dir_bc1, dir_bc2, factor) = match self.spec.variant {
            LambVariant::Paper => (bc1, bc2, 1.0),
            LambVariant::DeepSpeed => (1.0, 1.0, bc2.sqrt() / bc1),
        };
        let inv_bc1 = (1.0 / dir_bc1) as f32;
        let inv_sqrt_bc2 = (1.0 / dir_bc2.sqrt()) as f32;
        let eps = self.spec.eps as f32;
        let wd = self.spec.weight_decay as f32;
        let m = self.exp_avg.clone().mul_scalar(b1 as f32) + grads.clone().mul_scalar((1.0 - b1) as f32);
        let v = self.exp_avg_sq.clone().mul_scalar(b2 as f32) + (grads.clone() * grads).mul_scalar((1.0 - b2) as f32);
        // u = m̂ / (sqrt(v̂) + eps) + wd·p
        let mut u = m.clone().mul_scalar(inv_bc1) / v.clone().sqrt().mul_scalar(inv_sqrt_bc2).add_scalar(eps);
        if wd != 0.0 {
            u = u + params.clone().mul_scalar(wd);
        }
        self.exp_avg = m;
        self.exp_avg_sq = v;
        let across = across.filter(|c| c.world_size() > 1);
        let tensor = tensor.filter(|(n, _)| n.spans_ranks());
        if self.num_params == 0 || (self.segments.is_empty() && across.is_none() && tensor.is_none()) {
            return Ok(params);
        }
        // The shard's ‖p‖² of every parameter, then its ‖u‖²: zero for a parameter it holds
        // no piece of.
        let square_sum = |t: &Tensor<B, 1>, r: &Range<usize>| {
            let piece = t.clone().slice(r.clone());
            (piece.clone() * piece).sum()
        };
        let zero = || Tensor::<B, 1>::zeros([1], (&device, DType::F32));
        let mut weight_sq: Vec<Option<Tensor<B, 1>>> = vec![None; self.num_params];
        let mut update_sq: Vec<Option<Tensor<B, 1>>> = vec![None; self.num_params];
        for (id, r) in &self.segments {
            let (w, s) = (square_sum(&params, r), square_sum(&u, r));
            weight_sq[*id] = Some(match weight_sq[*id].take() {
                Some(t) => t + w,
                None => w,
            });
            update_sq[*id] = Some(match update_sq[*id].take() {
                Some(t) => t + s,
                None => s,
            });
        }
        let mut sums = Tensor::cat(
            weight_sq
                .into_iter()
                .chain(update_sq)
                .map(|t| t.unwrap_or_else(zero))
                .collect(),
            0,
        );
        // Every rank of the group joins the sum, one holding only padding too (with zeros).
        if let Some(ranks) = across {
            sums = ranks.all_reduce(sums, ReduceOp::Sum)?;
        }
        if let Some((norms, gi)) = tensor {
            // 2·P scalars through the host: [‖p‖² of each parameter, then ‖u‖² of each].
            let p = self.num_params;
            let mut host = crate::params::tensor_to_vec(sums);
            norms.sum(gi, &mut host, |k| k % p)?;
            sums = Tensor::from_data(burn::tensor::TensorData::new(host, [2 * p]), (&device, DType::F32));
        }
        if self.segments.is_empty() {
            return Ok(params);
        }
        let p = self.num_params;
        let w = sums.clone().slice(0..p);
        let s = sums.slice(p..2 * p);
        // The clamped ratio, 1 where either norm is zero (the host kernel's rule).
        let both = w.clone().greater_elem(0.0).bool_and(s.clone().greater_elem(0.0));
        let ratio = (w.sqrt() / s.sqrt())
            .clamp(self.spec.min_coeff as f32, self.spec.max_coeff as f32)
            .mask_fill(both.bool_not(), 1.0);
        let step = ratio.mul_scalar((lr * factor) as f32);
        // Each element's step size: its parameter's, zero on padding.
        let mut scale = Vec::with_capacity(2 * self.segments.len() + 1);
        let mut at = 0;
        for (id, r) in &self.segments {
            if r.start > at {
                scale.push(Tensor::zeros([r.start - at], (&device, DType::F32)));
            }
            scale.push(step.clone().slice(*id..*id + 1).expand([r.len()]));
            at = r.end;
        }
        if self.len() > at {
            scale.push(Tensor::zeros([self.len() - at], (&device, DType::F32)));
        }
        Ok(params - u * Tensor::cat(scale, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostStaged;
    use burn::backend::Flex;
    use burn::tensor::TensorData;
    use std::sync::Arc;
    use zero_core::comm::ThreadGroup;
    use zero_core::optim::{Lamb, Segment, ShardOptimizer};

    type F = Flex;
    const STEPS: usize = 5;
    const LR: f64 = 0.01;

    fn tensor(v: &[f32]) -> Tensor<F, 1> {
        Tensor::from_data(
            TensorData::new(v.to_vec(), [v.len()]),
            (&Default::default(), DType::F32),
        )
    }

    fn values(t: Tensor<F, 1>) -> Vec<f32> {
        crate::params::tensor_to_vec(t)
    }

    /// A shard of 40 elements: parameter 0 (weights ~0.001, so its ratio is clamped at
    /// min_coeff), padding, parameter 2 (~3.0), parameter 1 (~0.4), padding; parameter 3 lies
    /// elsewhere.
    fn shard() -> (Vec<f32>, ShardSegments) {
        let segments = ShardSegments {
            num_params: 4,
            segments: vec![
                Segment {
                    param_id: 0,
                    range: 0..12,
                },
                Segment {
                    param_id: 2,
                    range: 15..27,
                },
                Segment {
                    param_id: 1,
                    range: 27..36,
                },
            ],
        };
        let mut p = vec![0.0f32; 40];
        for (i, v) in p.iter_mut().enumerate() {
            let wave = ((i * 7 % 11) as f32 - 5.0) / 5.0;
            *v = match i {
                0..=11 => 0.001 * wave,
                15..=26 => 3.0 + wave,
                27..=35 => 0.4 * wave,
                _ => 0.0,
            };
        }
        (p, segments)
    }

    fn grads(step: usize, len: usize, padding: &[usize]) -> Vec<f32> {
        (0..len)
            .map(|i| {
                if padding.contains(&i) {
                    0.0
                } else {
                    (((i + 3 * step) * 5 % 13) as f32 - 6.0) * 0.02 + 0.003
                }
            })
            .collect()
    }

    const PADDING: [usize; 7] = [12, 13, 14, 36, 37, 38, 39];

    fn assert_close(label: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{label}: length");
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * scale, "{label}: element {i}: {g} against {w}");
        }
    }

    fn spec_of(variant: LambVariant) -> LambSpec {
        LambSpec {
            weight_decay: 0.01,
            variant,
            ..LambSpec::default()
        }
    }

    /// Five steps on one rank, both forms of the update, with weight decay: parameters and
    /// moments against zero-core's `Lamb` (the host state's kernel) on the same segments.
    #[test]
    fn follows_the_host_kernel_per_tensor_with_padding_untouched() {
        for variant in [LambVariant::Paper, LambVariant::DeepSpeed] {
            let spec = spec_of(variant);
            let (initial, segments) = shard();
            let mut host = Lamb::new(spec.clone(), initial.len(), segments.clone()).expect("host lamb");
            let mut device = DeviceLamb::<F>::new(spec, initial.len(), &segments, &Default::default());
            let (mut want, mut got) = (initial.clone(), tensor(&initial));
            for step in 0..STEPS {
                let g = grads(step, initial.len(), &PADDING);
                host.step(&mut want, &g, LR).expect("host step");
                got = device.step(got, tensor(&g), LR, None, None).expect("device step");
            }
            let got = values(got);
            assert_close(&format!("{variant:?}"), &got, &want);
            for i in PADDING {
                assert_eq!(got[i], 0.0, "{variant:?}: padding element {i}");
            }
            // One ratio for the whole shard would have moved the weights elsewhere.
            let mut one =
                Lamb::new(spec_of(variant), initial.len(), ShardSegments::single(initial.len())).expect("lamb");
            let mut whole = initial.clone();
            for step in 0..STEPS {
                one.step(&mut whole, &grads(step, initial.len(), &PADDING), LR)
                    .expect("host step");
            }
            let apart = whole.iter().zip(&want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                apart > 1e-3,
                "{variant:?}: per-tensor ratios must matter here ({apart})"
            );
            assert_eq!(device.step_count(), STEPS as u64);
            for ((name, h), (dn, d)) in host.state().into_iter().zip([
                ("exp_avg", device.exp_avg.clone()),
                ("exp_avg_sq", device.exp_avg_sq.clone()),
            ]) {
                assert_eq!(name, dn);
                assert_close(name, &values(d), h);
            }
        }
    }

    /// A parameter cut between two ranks: each rank's device optimizer holds half of it and
    /// sums its norms with the other's through the collective. Reference: the host kernel on
    /// the whole tensor, on one rank (and the host kernel's own cut, whose partials are summed
    /// by hand).
    #[test]
    fn a_tensor_cut_between_ranks_uses_the_norms_summed_over_them() {
        let n = 24;
        let initial: Vec<f32> = (0..n)
            .map(|i| ((i * 5 % 7) as f32 - 3.0) * 0.1 * (1 + i / 12) as f32)
            .collect();
        let mut whole = Lamb::new(LambSpec::default(), n, ShardSegments::single(n)).expect("host lamb");
        let mut want = initial.clone();
        for step in 0..STEPS {
            whole.step(&mut want, &grads(step, n, &[]), LR).expect("host step");
        }
        let groups = ThreadGroup::new_group(2).expect("thread group");
        let initial = Arc::new(initial);
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                let initial = initial.clone();
                std::thread::spawn(move || {
                    let comm = HostStaged::new(g);
                    let half = rank * n / 2..(rank + 1) * n / 2;
                    let segments = ShardSegments {
                        num_params: 1,
                        segments: vec![Segment {
                            param_id: 0,
                            range: 0..n / 2,
                        }],
                    };
                    let mut lamb = DeviceLamb::<F>::new(LambSpec::default(), n / 2, &segments, &Default::default());
                    let mut p = tensor(&initial[half.clone()]);
                    for step in 0..STEPS {
                        let g = grads(step, n, &[]);
                        p = lamb
                            .step(
                                p,
                                tensor(&g[half.clone()]),
                                LR,
                                Some(&comm as &dyn DeviceCollective<F>),
                                None,
                            )
                            .expect("step");
                    }
                    values(p)
                })
            })
            .collect();
        let got: Vec<f32> = handles.into_iter().flat_map(|h| h.join().expect("rank")).collect();
        assert_close("cut over 2 ranks", &got, &want);
        // Without the sum the first half would use its own ratio: the reference differs from that.
        let mut alone = initial[..n / 2].to_vec();
        let mut first = Lamb::new(LambSpec::default(), n / 2, ShardSegments::single(n / 2)).expect("host lamb");
        for step in 0..STEPS {
            first
                .step(&mut alone, &grads(step, n, &[])[..n / 2], LR)
                .expect("host step");
        }
        let apart = alone.iter().zip(&want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(apart > 1e-4, "the test's halves must need the summed norms ({apart})");
    }
}
