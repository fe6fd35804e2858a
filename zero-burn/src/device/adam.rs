//! Adam and AdamW on flat fp32 device tensors.

use super::cpu::{with_slice, HostTensor};
use super::flat::take;
use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use zero_core::optim::adam_kernel::{self, AdamScalars, HalfCopy, Isa};
use zero_core::optim::{self, AdamSpec, OptimizerSpec, ShardSegments};

/// Adam / AdamW (`torch.optim.Adam`, `torch.optim.AdamW`) over one flat fp32 shard held as a
/// Burn tensor, with its moments on the same device.
///
/// The arithmetic is the host kernel's (`zero_core::optim::Adam`): the same f32 constants
/// ([`AdamScalars`], derived in f64 and rounded once), the same operations in the same order,
/// with separate multiplies and adds. The host's SIMD kernels fuse the multiply-adds, so the two
/// agree to an f32 rounding per operation, not bit for bit.
#[derive(Debug)]
pub struct DeviceAdam<B: Backend> {
    spec: AdamSpec,
    step: u64,
    exp_avg: Tensor<B, 1>,
    exp_avg_sq: Tensor<B, 1>,
    max_exp_avg_sq: Option<Tensor<B, 1>>,
    /// Steps taken by the one-kernel CUDA path ([`DeviceAdam::fused_steps`]).
    fused_steps: u64,
}

impl<B: Backend> DeviceAdam<B> {
    /// An optimizer for a shard of `len` elements on `device`, with zeroed moments. Fails for
    /// an invalid setting (the host optimizer's checks).
    pub fn new(spec: AdamSpec, len: usize, device: &B::Device) -> Result<Self, ZeroError> {
        // The host optimizer's validation, on an empty shard.
        optim::build(&OptimizerSpec::Adam(spec.clone()), 0, ShardSegments::single(0))
            .map_err(|e| ZeroError::Optimizer(e.to_string()))?;
        let zeros = || super::flat::zeros::<B>(len, DType::F32, device);
        Ok(DeviceAdam {
            max_exp_avg_sq: spec.amsgrad.then(zeros),
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            spec,
            step: 0,
            fused_steps: 0,
        })
    }

    /// Steps this optimizer took as one CUDA kernel over the shard (feature `cuda`: Adam and
    /// AdamW without AMSGrad, on buffers it may write in place); the others ran as Burn tensor
    /// ops or, on the CPU backend, as the host's kernel.
    pub fn fused_steps(&self) -> u64 {
        self.fused_steps
    }

    /// Shard length.
    pub fn len(&self) -> usize {
        self.exp_avg.dims()[0]
    }

    /// Whether the shard is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The optimizer's name in checkpoints, as the host optimizer's: `adamw` with decoupled
    /// weight decay, else `adam`.
    pub fn name(&self) -> &'static str {
        if self.spec.decoupled_weight_decay {
            "adamw"
        } else {
            "adam"
        }
    }

    /// Replaces the moments and the step count with a checkpoint's: `buffers` by the names of
    /// [`DeviceAdam::state`], each of this optimizer's length. Nothing changes on an error.
    pub fn load_state(
        &mut self,
        step: u64,
        buffers: &[(String, Vec<f32>)],
        device: &B::Device,
    ) -> Result<(), ZeroError> {
        let n = self.len();
        let find = |name: &str| load_buffer::<B>(buffers, name, n, device);
        let exp_avg = find("exp_avg")?;
        let exp_avg_sq = find("exp_avg_sq")?;
        let max_exp_avg_sq = match self.max_exp_avg_sq {
            Some(_) => Some(find("max_exp_avg_sq")?),
            None => None,
        };
        (self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.step) = (exp_avg, exp_avg_sq, max_exp_avg_sq, step);
        Ok(())
    }

    /// Steps taken (PyTorch's `state["step"]`).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Sets (β1, β2) for the next steps (momentum-cycling schedules).
    pub fn set_betas(&mut self, betas: (f64, f64)) {
        self.spec.betas = betas;
    }

    /// The state tensors by PyTorch's names: `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq`
    /// with AMSGrad).
    pub fn state(&self) -> Vec<(&'static str, &Tensor<B, 1>)> {
        let mut s = vec![("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)];
        if let Some(m) = &self.max_exp_avg_sq {
            s.push(("max_exp_avg_sq", m));
        }
        s
    }

    /// Bytes of state on the device.
    pub fn state_bytes(&self) -> usize {
        self.state().len() * self.len() * 4
    }

    /// Fails unless `params` and `grads` are fp32 shards of this optimizer's length: what
    /// [`DeviceAdam::step`] checks before it changes anything.
    pub fn check(&self, params: &Tensor<B, 1>, grads: &Tensor<B, 1>) -> Result<(), ZeroError> {
        check_shard("Adam", self.len(), params, grads)
    }

    /// One update of the fp32 `params` from the fp32 `grads` with learning rate `lr`; returns
    /// the new parameters. Pass the only handle to `params` to let the backend update it in
    /// place. On the CPU backend the update is zero-core's fused kernel on the tensors' storage;
    /// on CUDA (feature `cuda`) one kernel over the shard, in place; elsewhere, and where the
    /// buffers cannot be written in place, Burn tensor ops.
    pub fn step(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64) -> Result<Tensor<B, 1>, ZeroError> {
        self.check(&params, &grads)?;
        let s = self.advance(lr);
        if super::cpu::is_cpu::<B>() {
            return self.step_on_host(params, grads, &s);
        }
        #[cfg(feature = "cuda")]
        let (params, grads) = match self.step_on_cuda(params, grads, &s) {
            Ok(updated) => return Ok(updated),
            Err(back) => back,
        };
        Ok(self.step_with_tensor_ops(params, grads, &s))
    }

    /// The update as one CUDA kernel, in place; the tensors back where it cannot run (another
    /// backend, AMSGrad, a buffer shared with another tensor).
    #[cfg(feature = "cuda")]
    #[allow(clippy::type_complexity)]
    fn step_on_cuda(
        &mut self,
        params: Tensor<B, 1>,
        grads: Tensor<B, 1>,
        s: &AdamScalars,
    ) -> Result<Tensor<B, 1>, (Tensor<B, 1>, Tensor<B, 1>)> {
        if self.max_exp_avg_sq.is_some() || !super::cuda_adam::is_cuda::<B>() {
            return Err((params, grads));
        }
        // Taken out, so that each moment is the only handle to its buffer.
        let (m, v) = (take(&mut self.exp_avg), take(&mut self.exp_avg_sq));
        match super::cuda_adam::adam_step(params, grads, m, v, s, 1.0) {
            Ok((p, m, v)) => {
                (self.exp_avg, self.exp_avg_sq) = (m, v);
                self.fused_steps += 1;
                Ok(p)
            }
            Err([p, g, m, v]) => {
                (self.exp_avg, self.exp_avg_sq) = (m, v);
                Err((p, g))
            }
        }
    }

    /// Counts one more step and gives its constants at learning rate `lr`.
    fn advance(&mut self, lr: f64) -> AdamScalars {
        self.step += 1;
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

    /// The update in Burn tensor ops (a GPU's path).
    fn step_with_tensor_ops(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, s: &AdamScalars) -> Tensor<B, 1> {
        // The moments are taken out (an empty tensor stands in), so that each is the only
        // handle to its buffer and the backend may update it in place.
        let m = take(&mut self.exp_avg);
        let v = take(&mut self.exp_avg_sq);
        // g += wd·p (Adam's L2 decay; AdamW has l2_decay 0).
        let g = if s.l2_decay != 0.0 {
            params.clone().mul_scalar(s.l2_decay) + grads
        } else {
            grads
        };
        let m = m.mul_scalar(s.beta1) + g.clone().mul_scalar(s.one_minus_beta1);
        let v = v.mul_scalar(s.beta2) + g.clone().mul_scalar(s.one_minus_beta2) * g;
        let second = match &mut self.max_exp_avg_sq {
            Some(max) => {
                *max = take(max).max_pair(v.clone());
                max.clone()
            }
            None => v.clone(),
        };
        let denom = second.sqrt().mul_scalar(s.inv_sqrt_bc2).add_scalar(s.eps);
        let scaled = if s.param_scale != 1.0 {
            params.mul_scalar(s.param_scale)
        } else {
            params
        };
        let updated = scaled - (m.clone() / denom).mul_scalar(s.step_size);
        self.exp_avg = m;
        self.exp_avg_sq = v;
        updated
    }

    /// The update as zero-core's fused SIMD kernel (the host state's) on the CPU backend's
    /// tensors, in place on their own storage.
    fn step_on_host(
        &mut self,
        params: Tensor<B, 1>,
        grads: Tensor<B, 1>,
        s: &AdamScalars,
    ) -> Result<Tensor<B, 1>, ZeroError> {
        let not_host = || ZeroError::Optimizer("device Adam: a shard is not fp32 on the CPU".into());
        let host = |t: Tensor<B, 1>| HostTensor::of(t).ok_or_else(not_host);
        let (mut p, mut m, mut v) = (
            host(params)?,
            host(take(&mut self.exp_avg))?,
            host(take(&mut self.exp_avg_sq))?,
        );
        let mut vmax = self.max_exp_avg_sq.as_mut().map(|max| host(take(max))).transpose()?;
        // The gradient is only read: its storage is used as it is, shared or not.
        let result = with_slice(&grads, |g| match &mut vmax {
            Some(vmax) => {
                adam_kernel::adam_amsgrad_step(p.slice_mut(), g, m.slice_mut(), v.slice_mut(), vmax.slice_mut(), s)
            }
            None => adam_kernel::adam_step(
                Isa::fastest(),
                p.slice_mut(),
                g,
                m.slice_mut(),
                v.slice_mut(),
                HalfCopy::None,
                s,
            ),
        });
        (self.exp_avg, self.exp_avg_sq) = (m.into_tensor(), v.into_tensor());
        if let (Some(max), Some(vmax)) = (&mut self.max_exp_avg_sq, vmax) {
            *max = vmax.into_tensor();
        }
        result
            .ok_or_else(not_host)?
            .map_err(|e| ZeroError::Optimizer(format!("device Adam: {e}")))?;
        Ok(p.into_tensor())
    }
}

/// Fails unless `params` and `grads` are fp32 shards of `n` elements, naming the `optimizer`.
pub(super) fn check_shard<B: Backend>(
    optimizer: &str,
    n: usize,
    params: &Tensor<B, 1>,
    grads: &Tensor<B, 1>,
) -> Result<(), ZeroError> {
    for (what, t) in [("params", params), ("grads", grads)] {
        if t.dims()[0] != n {
            return Err(ZeroError::Optimizer(format!(
                "device {optimizer}: {what} hold {} elements, the shard {n}",
                t.dims()[0]
            )));
        }
        if t.dtype() != DType::F32 {
            return Err(ZeroError::Optimizer(format!(
                "device {optimizer}: {what} are {:?}, the shard is fp32",
                t.dtype()
            )));
        }
    }
    Ok(())
}

/// The checkpoint's state buffer `name` (of `n` elements) as an fp32 tensor on `device`.
pub(super) fn load_buffer<B: Backend>(
    buffers: &[(String, Vec<f32>)],
    name: &str,
    n: usize,
    device: &B::Device,
) -> Result<Tensor<B, 1>, ZeroError> {
    let (_, values) = buffers
        .iter()
        .find(|(b, _)| b == name)
        .ok_or_else(|| ZeroError::Optimizer(format!("the checkpoint has no `{name}` buffer")))?;
    if values.len() != n {
        return Err(ZeroError::Optimizer(format!(
            "the checkpoint's `{name}` has {} elements, the shard {n}",
            values.len()
        )));
    }
    Ok(Tensor::from_data(
        burn::tensor::TensorData::new(values.clone(), [n]),
        (device, DType::F32),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type F = Flex;

    /// PyTorch's Adam/AdamW update, in f64.
    struct Reference {
        spec: AdamSpec,
        m: Vec<f64>,
        v: Vec<f64>,
        vmax: Vec<f64>,
        t: i32,
    }

    impl Reference {
        fn step(&mut self, p: &mut [f64], g: &[f64], lr: f64) {
            let s = &self.spec;
            self.t += 1;
            let (b1, b2) = s.betas;
            let bc1 = 1.0 - b1.powi(self.t);
            let bc2 = 1.0 - b2.powi(self.t);
            for i in 0..p.len() {
                let mut gi = g[i];
                if s.decoupled_weight_decay {
                    p[i] *= 1.0 - lr * s.weight_decay;
                } else {
                    gi += s.weight_decay * p[i];
                }
                self.m[i] = b1 * self.m[i] + (1.0 - b1) * gi;
                self.v[i] = b2 * self.v[i] + (1.0 - b2) * gi * gi;
                self.vmax[i] = self.vmax[i].max(self.v[i]);
                let second = if s.amsgrad { self.vmax[i] } else { self.v[i] };
                let denom = (second / bc2).sqrt() + s.eps;
                p[i] -= lr / bc1 * self.m[i] / denom;
            }
        }
    }

    /// Which of the two updates a test runs: on the CPU backend [`DeviceAdam::step`] takes the
    /// fused kernel; the tensor ops are a GPU's path, run here on the CPU.
    #[derive(Clone, Copy, Debug)]
    enum Path {
        Fused,
        TensorOps,
    }

    fn update(adam: &mut DeviceAdam<F>, path: Path, params: Tensor<F, 1>, g: Tensor<F, 1>, lr: f64) -> Tensor<F, 1> {
        match path {
            Path::Fused => adam.step(params, g, lr).expect("step"),
            Path::TensorOps => {
                adam.check(&params, &g).expect("shapes");
                let s = adam.advance(lr);
                adam.step_with_tensor_ops(params, g, &s)
            }
        }
    }

    fn tensor(v: &[f64]) -> Tensor<F, 1> {
        let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        let n = v.len();
        Tensor::from_data(TensorData::new(v, [n]), &Default::default())
    }

    fn run(spec: AdamSpec) {
        for path in [Path::Fused, Path::TensorOps] {
            run_on(spec.clone(), path);
        }
    }

    fn run_on(spec: AdamSpec, path: Path) {
        let n = 37;
        let mut p: Vec<f64> = (0..n).map(|i| ((i as f64) * 0.7).sin()).collect();
        // Start from f32-exact values, so both sides see the same inputs.
        p.iter_mut().for_each(|x| *x = *x as f32 as f64);
        let mut reference = Reference {
            spec: spec.clone(),
            m: vec![0.0; n],
            v: vec![0.0; n],
            vmax: vec![0.0; n],
            t: 0,
        };
        let mut adam = DeviceAdam::<F>::new(spec, n, &Default::default()).expect("adam");
        let mut params = tensor(&p);
        for step in 0..20 {
            // Gradients of varied sign and magnitude, shrinking at some steps (AMSGrad's max
            // then differs from v).
            let g: Vec<f64> = (0..n)
                .map(|i| (((i * 13 + step * 7) as f64) * 0.31).cos() * if step % 3 == 2 { 0.1 } else { 1.0 })
                .map(|x| x as f32 as f64)
                .collect();
            let lr = 0.01 * (1.0 + step as f64 * 0.1);
            reference.step(&mut p, &g, lr);
            params = update(&mut adam, path, params, tensor(&g), lr);
        }
        assert_eq!(adam.step_count(), 20);
        let got = crate::params::tensor_to_vec(params);
        // 20 steps of f32 arithmetic (a handful of roundings of 6e-8 each per step, on updates
        // of lr ≈ 0.01-0.03): the f32 run stays within 1e-6 of the f64 one.
        for (i, (a, b)) in got.iter().zip(&p).enumerate() {
            assert!(
                (*a as f64 - b).abs() < 1e-6,
                "{path:?}, element {i}: device {a}, f64 reference {b}"
            );
        }
        // And the update is not negligible: the parameters moved by far more than the tolerance.
        let start: Vec<f64> = (0..n).map(|i| ((i as f64) * 0.7).sin()).collect();
        assert!(got.iter().zip(&start).any(|(a, b)| (*a as f64 - b).abs() > 0.05));
    }

    #[test]
    fn adamw_matches_f64() {
        run(AdamSpec {
            eps: 1e-6,
            ..AdamSpec::adamw()
        });
    }

    #[test]
    fn adam_l2_matches_f64() {
        run(AdamSpec {
            weight_decay: 0.1,
            ..AdamSpec::adam()
        });
    }

    #[test]
    fn amsgrad_without_bias_correction_matches_f64() {
        for path in [Path::Fused, Path::TensorOps] {
            amsgrad_on(path);
        }
    }

    fn amsgrad_on(path: Path) {
        let spec = AdamSpec {
            amsgrad: true,
            bias_correction: false,
            ..AdamSpec::adamw()
        };
        // The reference always corrects; without correction its bc terms must be 1, which it
        // gets from β^t → 0 (it is run at step 10^6).
        let n = 8;
        let mut adam = DeviceAdam::<F>::new(spec.clone(), n, &Default::default()).expect("adam");
        let mut reference = Reference {
            spec: spec.clone(),
            m: vec![0.0; n],
            v: vec![0.0; n],
            vmax: vec![0.0; n],
            t: 0,
        };
        let mut p: Vec<f64> = (0..n).map(|i| i as f64 * 0.125).collect();
        let mut params = tensor(&p);
        for step in 0..6 {
            let g: Vec<f64> = (0..n)
                .map(|i| if step < 3 { 1.0 } else { 0.01 } * (i as f64 - 3.5))
                .collect();
            reference.t = 1_000_000;
            reference.step(&mut p, &g, 0.01);
            params = update(&mut adam, path, params, tensor(&g), 0.01);
        }
        let got = crate::params::tensor_to_vec(params);
        for (a, b) in got.iter().zip(&p) {
            assert!((*a as f64 - b).abs() < 1e-6, "{path:?}: device {a}, f64 reference {b}");
        }
    }

    #[test]
    fn refuses_bad_lengths() {
        let device = Default::default();
        let mut adam = DeviceAdam::<F>::new(AdamSpec::adamw(), 4, &device).expect("adam");
        let err = adam.step(tensor(&[0.0; 4]), tensor(&[0.0; 3]), 0.1).unwrap_err();
        assert!(err.to_string().contains("grads hold 3"), "{err}");
    }
}
