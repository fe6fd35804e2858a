//! The optimizers of the device state: Adam/AdamW ([`DeviceAdam`]), SGD and Lion on flat fp32
//! device tensors, with the host kernels' arithmetic (zero_core::optim) in Burn tensor ops; on
//! the CPU backend, the host kernels themselves on the tensors' storage, in place; and LAMB
//! ([`DeviceLamb`]), whose trust ratio sums each parameter's norms over the ranks.

use super::adam::{check_shard, load_buffer, DeviceAdam};
use super::collective::DeviceCollective;
use super::cpu::{is_cpu, with_slice, HostTensor};
use super::flat::take;
use super::lamb::DeviceLamb;
use crate::agreement::TensorNorms;
use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use zero_core::optim::{self, LionSpec, OptimizerSpec, SgdSpec, ShardSegments};

/// One flat shard's optimizer on the device.
#[derive(Debug)]
pub(crate) enum DeviceOptimizer<B: Backend> {
    Adam(DeviceAdam<B>),
    Sgd(DeviceSgd<B>),
    Lion(DeviceLion<B>),
    Lamb(DeviceLamb<B>),
}

impl<B: Backend> DeviceOptimizer<B> {
    /// The optimizer `spec` names, for a shard of `len` elements cut into `segments` (the
    /// pieces of parameter tensors it holds: LAMB's trust ratio is per tensor), on `device`,
    /// with zeroed state. Fails for an invalid setting (the host optimizer's checks).
    pub(crate) fn from_spec(
        spec: &OptimizerSpec,
        len: usize,
        segments: &ShardSegments,
        device: &B::Device,
    ) -> Result<Self, ZeroError> {
        Self::check_spec(spec)?;
        segments
            .validate(len)
            .map_err(|e| ZeroError::Optimizer(e.to_string()))?;
        let zeros = || super::flat::zeros::<B>(len, DType::F32, device);
        Ok(match spec {
            OptimizerSpec::Adam(s) => DeviceOptimizer::Adam(DeviceAdam::new(s.clone(), len, device)?),
            OptimizerSpec::Sgd(s) => DeviceOptimizer::Sgd(DeviceSgd {
                spec: s.clone(),
                step: 0,
                len,
                buffer: (s.momentum != 0.0).then(zeros),
            }),
            OptimizerSpec::Lion(s) => DeviceOptimizer::Lion(DeviceLion {
                spec: s.clone(),
                step: 0,
                exp_avg: zeros(),
            }),
            OptimizerSpec::Lamb(s) => DeviceOptimizer::Lamb(DeviceLamb::new(s.clone(), len, segments, device)),
        })
    }

    /// Checks `spec` (the host optimizer's validation, on an empty shard) and gives its name in
    /// checkpoints, with no tensor made: on CUDA even an optimizer over no elements would fill
    /// its moments with kernels over no blocks, which the driver refuses.
    pub(crate) fn check_spec(spec: &OptimizerSpec) -> Result<&'static str, ZeroError> {
        optim::build(spec, 0, ShardSegments::single(0))
            .map(|o| o.name())
            .map_err(|e| ZeroError::Optimizer(e.to_string()))
    }

    /// Sets the betas for the steps to come (a schedule that cycles the momentum); SGD has none
    /// and keeps its momentum, as under DeepSpeed's OneCycle.
    pub(crate) fn set_betas(&mut self, betas: (f64, f64)) {
        match self {
            DeviceOptimizer::Adam(a) => a.set_betas(betas),
            DeviceOptimizer::Sgd(_) => {}
            DeviceOptimizer::Lion(l) => l.spec.betas = betas,
            DeviceOptimizer::Lamb(l) => l.set_betas(betas),
        }
    }

    /// The optimizer's name in checkpoints, as the host optimizer's.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            DeviceOptimizer::Adam(a) => a.name(),
            DeviceOptimizer::Sgd(_) => "sgd",
            DeviceOptimizer::Lion(_) => "lion",
            DeviceOptimizer::Lamb(_) => "lamb",
        }
    }

    /// Steps taken.
    pub(crate) fn step_count(&self) -> u64 {
        match self {
            DeviceOptimizer::Adam(a) => a.step_count(),
            DeviceOptimizer::Sgd(s) => s.step,
            DeviceOptimizer::Lion(l) => l.step,
            DeviceOptimizer::Lamb(l) => l.step_count(),
        }
    }

    /// The state tensors by PyTorch's names.
    pub(crate) fn state(&self) -> Vec<(&'static str, &Tensor<B, 1>)> {
        match self {
            DeviceOptimizer::Adam(a) => a.state(),
            DeviceOptimizer::Sgd(s) => s.buffer.iter().map(|b| ("momentum_buffer", b)).collect(),
            DeviceOptimizer::Lion(l) => vec![("exp_avg", &l.exp_avg)],
            DeviceOptimizer::Lamb(l) => vec![("exp_avg", &l.exp_avg), ("exp_avg_sq", &l.exp_avg_sq)],
        }
    }

    /// Bytes of state on the device.
    pub(crate) fn state_bytes(&self) -> usize {
        self.state().iter().map(|(_, t)| t.dims()[0] * 4).sum()
    }

    /// Shard length.
    fn len(&self) -> usize {
        match self {
            DeviceOptimizer::Adam(a) => a.len(),
            DeviceOptimizer::Sgd(s) => s.len,
            DeviceOptimizer::Lion(l) => l.exp_avg.dims()[0],
            DeviceOptimizer::Lamb(l) => l.len(),
        }
    }

    /// Fails unless `params` and `grads` are fp32 shards of this optimizer's length: what
    /// [`DeviceOptimizer::step`] checks before it changes anything.
    pub(crate) fn check(&self, params: &Tensor<B, 1>, grads: &Tensor<B, 1>) -> Result<(), ZeroError> {
        check_shard(self.name(), self.len(), params, grads)
    }

    /// One update of the fp32 `params` from the fp32 `grads` at learning rate `lr`; returns the
    /// new parameters. `across`: the ranks the shard's parameter tensors are cut over (none
    /// where this rank holds them whole), and `tensor`, the tensor ranks and this group's index
    /// with tensor parallelism: for LAMB's per-tensor norms.
    pub(crate) fn step(
        &mut self,
        params: Tensor<B, 1>,
        grads: Tensor<B, 1>,
        lr: f64,
        across: Option<&dyn DeviceCollective<B>>,
        tensor: Option<(&TensorNorms, usize)>,
    ) -> Result<Tensor<B, 1>, ZeroError> {
        self.check(&params, &grads)?;
        Ok(match self {
            DeviceOptimizer::Lamb(l) => l.step(params, grads, lr, across, tensor)?,
            DeviceOptimizer::Adam(a) => a.step(params, grads, lr)?,
            DeviceOptimizer::Sgd(s) if is_cpu::<B>() => s.step_on_host(params, grads, lr)?,
            DeviceOptimizer::Sgd(s) => s.step_with_tensor_ops(params, grads, lr),
            DeviceOptimizer::Lion(l) if is_cpu::<B>() => l.step_on_host(params, grads, lr)?,
            DeviceOptimizer::Lion(l) => l.step_with_tensor_ops(params, grads, lr),
        })
    }

    /// [`DeviceOptimizer::step`] through the fused kernels (`fused`, the CPU backend only) or
    /// the tensor ops, whichever backend: how the tests run both paths on the CPU.
    #[cfg(test)]
    fn step_via(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64, fused: bool) -> Tensor<B, 1> {
        self.check(&params, &grads).expect("shard");
        match (self, fused) {
            (DeviceOptimizer::Adam(a), _) => a.step(params, grads, lr).expect("adam"),
            (DeviceOptimizer::Sgd(s), true) => s.step_on_host(params, grads, lr).expect("sgd"),
            (DeviceOptimizer::Sgd(s), false) => s.step_with_tensor_ops(params, grads, lr),
            (DeviceOptimizer::Lion(l), true) => l.step_on_host(params, grads, lr).expect("lion"),
            (DeviceOptimizer::Lion(l), false) => l.step_with_tensor_ops(params, grads, lr),
            (DeviceOptimizer::Lamb(l), _) => l.step(params, grads, lr, None, None).expect("lamb"),
        }
    }

    /// Replaces the state and the step count with a checkpoint's: `buffers` by the names of
    /// [`DeviceOptimizer::state`], each of this optimizer's length. Nothing changes on an error.
    pub(crate) fn load_state(
        &mut self,
        step: u64,
        buffers: &[(String, Vec<f32>)],
        device: &B::Device,
    ) -> Result<(), ZeroError> {
        if let DeviceOptimizer::Adam(a) = self {
            return a.load_state(step, buffers, device);
        }
        let n = self.len();
        let find = |name: &str| load_buffer::<B>(buffers, name, n, device);
        match self {
            DeviceOptimizer::Adam(_) => unreachable!("handled above"),
            DeviceOptimizer::Sgd(s) => {
                if s.buffer.is_some() {
                    s.buffer = Some(find("momentum_buffer")?);
                }
                s.step = step;
            }
            DeviceOptimizer::Lion(l) => {
                l.exp_avg = find("exp_avg")?;
                l.step = step;
            }
            DeviceOptimizer::Lamb(l) => {
                let (m, v) = (find("exp_avg")?, find("exp_avg_sq")?);
                l.load(step, m, v);
            }
        }
        Ok(())
    }
}

/// SGD with momentum, dampening and Nesterov (`torch.optim.SGD`), as the host kernel computes it.
#[derive(Debug)]
pub(crate) struct DeviceSgd<B: Backend> {
    spec: SgdSpec,
    step: u64,
    len: usize,
    /// The momentum buffer (none without momentum).
    buffer: Option<Tensor<B, 1>>,
}

/// The error of a fused step given tensors that are not the CPU backend's fp32.
fn not_host(optimizer: &str) -> ZeroError {
    ZeroError::Optimizer(format!("device {optimizer}: a shard is not fp32 on the CPU"))
}

impl<B: Backend> DeviceSgd<B> {
    /// The update as zero-core's kernel (the host state's) on the CPU backend's tensors, in
    /// place on their own storage.
    fn step_on_host(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64) -> Result<Tensor<B, 1>, ZeroError> {
        let host = |t: Tensor<B, 1>| HostTensor::of(t).ok_or_else(|| not_host("SGD"));
        let mut p = host(params)?;
        let mut buffer = self.buffer.take().map(host).transpose()?;
        let first = self.step == 0;
        // The gradient is only read: its storage is used as it is, shared or not.
        let done = with_slice(&grads, |g| {
            optim::sgd_update(
                p.slice_mut(),
                g,
                buffer.as_mut().map(HostTensor::slice_mut),
                &self.spec,
                first,
                lr,
            )
        });
        self.buffer = buffer.map(HostTensor::into_tensor);
        done.ok_or_else(|| not_host("SGD"))?;
        self.step += 1;
        Ok(p.into_tensor())
    }

    /// The update in Burn tensor ops (a GPU's path).
    fn step_with_tensor_ops(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64) -> Tensor<B, 1> {
        let wd = self.spec.weight_decay as f32;
        let momentum = self.spec.momentum as f32;
        let damp = (1.0 - self.spec.dampening) as f32;
        // d = g + wd·p
        let mut d = if wd != 0.0 {
            grads + params.clone().mul_scalar(wd)
        } else {
            grads
        };
        if let Some(buffer) = self.buffer.take() {
            // The first step's buffer is the gradient itself (PyTorch's rule).
            let b = if self.step == 0 {
                d.clone()
            } else {
                buffer.mul_scalar(momentum) + d.clone().mul_scalar(damp)
            };
            d = if self.spec.nesterov {
                d + b.clone().mul_scalar(momentum)
            } else {
                b.clone()
            };
            self.buffer = Some(b);
        }
        self.step += 1;
        params - d.mul_scalar(lr as f32)
    }
}

/// Lion (DeepSpeed's FusedLion), as the host kernel computes it.
#[derive(Debug)]
pub(crate) struct DeviceLion<B: Backend> {
    spec: LionSpec,
    step: u64,
    exp_avg: Tensor<B, 1>,
}

impl<B: Backend> DeviceLion<B> {
    /// The update as zero-core's kernel (the host state's) on the CPU backend's tensors, in
    /// place on their own storage.
    fn step_on_host(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64) -> Result<Tensor<B, 1>, ZeroError> {
        let host = |t: Tensor<B, 1>| HostTensor::of(t).ok_or_else(|| not_host("Lion"));
        let mut p = host(params)?;
        let mut m = host(take(&mut self.exp_avg))?;
        let done = with_slice(&grads, |g| {
            optim::lion_update(
                p.slice_mut(),
                g,
                m.slice_mut(),
                self.spec.betas,
                self.spec.weight_decay,
                lr,
            )
        });
        self.exp_avg = m.into_tensor();
        done.ok_or_else(|| not_host("Lion"))?;
        self.step += 1;
        Ok(p.into_tensor())
    }

    /// The update in Burn tensor ops (a GPU's path).
    fn step_with_tensor_ops(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64) -> Tensor<B, 1> {
        let (b1, c1) = (self.spec.betas.0 as f32, (1.0 - self.spec.betas.0) as f32);
        let (b2, c2) = (self.spec.betas.1 as f32, (1.0 - self.spec.betas.1) as f32);
        let scale = (1.0 - lr * self.spec.weight_decay) as f32;
        let m = take(&mut self.exp_avg);
        let c = m.clone().mul_scalar(b1) + grads.clone().mul_scalar(c1);
        let updated = params.mul_scalar(scale) - c.sign().mul_scalar(lr as f32);
        self.exp_avg = m.mul_scalar(b2) + grads.mul_scalar(c2);
        self.step += 1;
        updated
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type F = Flex;

    fn tensor(v: &[f32]) -> Tensor<F, 1> {
        Tensor::from_data(
            TensorData::new(v.to_vec(), [v.len()]),
            (&Default::default(), DType::F32),
        )
    }

    fn values(t: Tensor<F, 1>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().expect("f32")
    }

    /// `torch.optim.SGD` and Lion (Chen et al.) in f64, one step: the references of both paths.
    fn reference_step(spec: &OptimizerSpec, p: &mut [f64], g: &[f32], state: &mut [f64], first: bool, lr: f64) {
        for i in 0..p.len() {
            let g = g[i] as f64;
            match spec {
                OptimizerSpec::Sgd(s) => {
                    let mut d = g + s.weight_decay * p[i];
                    if s.momentum != 0.0 {
                        state[i] = if first {
                            d
                        } else {
                            s.momentum * state[i] + (1.0 - s.dampening) * d
                        };
                        d = if s.nesterov {
                            d + s.momentum * state[i]
                        } else {
                            state[i]
                        };
                    }
                    p[i] -= lr * d;
                }
                OptimizerSpec::Lion(s) => {
                    let c = s.betas.0 * state[i] + (1.0 - s.betas.0) * g;
                    let sign = if c > 0.0 {
                        1.0
                    } else if c < 0.0 {
                        -1.0
                    } else {
                        0.0
                    };
                    p[i] = p[i] * (1.0 - lr * s.weight_decay) - lr * sign;
                    state[i] = s.betas.1 * state[i] + (1.0 - s.betas.1) * g;
                }
                _ => unreachable!("SGD and Lion only"),
            }
        }
    }

    /// Five steps of the device optimizer, through the fused kernels and through the tensor ops,
    /// against the host kernel from the same values (the same parameters and state to 1e-6
    /// relative: the host may fuse a multiply-add) and against the f64 reference.
    fn agrees_with_the_host(spec: OptimizerSpec) {
        for fused in [true, false] {
            agrees_with_the_host_via(spec.clone(), fused);
        }
    }

    fn agrees_with_the_host_via(spec: OptimizerSpec, fused: bool) {
        let n = 37;
        let mut host_params: Vec<f32> = (0..n).map(|i| ((i * 13 % 11) as f32 - 5.0) * 0.07).collect();
        let mut reference: Vec<f64> = host_params.iter().map(|&v| v as f64).collect();
        let mut reference_state = vec![0.0f64; n];
        let mut host = optim::build(&spec, n, ShardSegments::single(n)).expect("host optimizer");
        let mut device = DeviceOptimizer::<F>::from_spec(&spec, n, &ShardSegments::single(n), &Default::default())
            .expect("device optimizer");
        let mut params = tensor(&host_params);
        for step in 0..5 {
            let grads: Vec<f32> = (0..n)
                .map(|i| (((i + step) * 7 % 13) as f32 - 6.0) * 0.05 + if i == 3 { 0.0 } else { 0.01 })
                .collect();
            host.step(&mut host_params, &grads, 0.01).expect("host step");
            reference_step(&spec, &mut reference, &grads, &mut reference_state, step == 0, 0.01);
            params = device.step_via(params, tensor(&grads), 0.01, fused);
        }
        let got = values(params);
        let scale = reference.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&reference).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= 1e-6 * scale,
                "{} (fused {fused}): element {i}: {g} against the f64 reference {w}",
                device.name()
            );
        }
        let scale = host_params.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&host_params).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * scale,
                "{}: element {i}: {g} against {w}",
                device.name()
            );
        }
        assert_eq!(device.name(), host.name());
        assert_eq!(device.step_count(), host.step_count());
        let host_state = host.state();
        let device_state = device.state();
        assert_eq!(
            device_state.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            host_state.iter().map(|(n, _)| *n).collect::<Vec<_>>()
        );
        for ((name, d), (_, h)) in device_state.into_iter().zip(host_state) {
            for (g, w) in values(d.clone()).iter().zip(h) {
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "{name}: {g} against {w}");
            }
        }
    }

    #[test]
    fn sgd_with_and_without_momentum_and_nesterov_follows_the_host_kernel() {
        agrees_with_the_host(OptimizerSpec::Sgd(SgdSpec {
            weight_decay: 0.1,
            ..SgdSpec::default()
        }));
        agrees_with_the_host(OptimizerSpec::Sgd(SgdSpec {
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            ..SgdSpec::default()
        }));
        agrees_with_the_host(OptimizerSpec::Sgd(SgdSpec {
            momentum: 0.9,
            nesterov: true,
            ..SgdSpec::default()
        }));
    }

    #[test]
    fn lion_follows_the_host_kernel() {
        agrees_with_the_host(OptimizerSpec::Lion(LionSpec {
            weight_decay: 0.1,
            ..LionSpec::default()
        }));
    }
}
