//! The optimizers of the device state: Adam/AdamW ([`DeviceAdam`]), SGD and Lion on flat fp32
//! device tensors, with the host kernels' arithmetic (zero_core::optim) in Burn tensor ops.
//! LAMB, whose trust ratio needs each parameter's norms summed over the ranks, runs on the host.

use super::adam::{check_shard, load_buffer, DeviceAdam};
use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use zero_core::optim::{self, LionSpec, OptimizerSpec, SgdSpec, ShardSegments};

/// Whether `spec` has a device implementation (all but LAMB).
pub(crate) fn on_device(spec: &OptimizerSpec) -> bool {
    !matches!(spec, OptimizerSpec::Lamb(_))
}

/// One flat shard's optimizer on the device.
#[derive(Debug)]
pub(crate) enum DeviceOptimizer<B: Backend> {
    Adam(DeviceAdam<B>),
    Sgd(DeviceSgd<B>),
    Lion(DeviceLion<B>),
}

impl<B: Backend> DeviceOptimizer<B> {
    /// The optimizer `spec` names, for a shard of `len` elements on `device`, with zeroed
    /// state. Fails for an invalid setting (the host optimizer's checks) and for LAMB.
    pub(crate) fn from_spec(spec: &OptimizerSpec, len: usize, device: &B::Device) -> Result<Self, ZeroError> {
        // The host optimizer's validation, on an empty shard.
        optim::build(spec, 0, ShardSegments::single(0)).map_err(|e| ZeroError::Optimizer(e.to_string()))?;
        let zeros = || Tensor::<B, 1>::zeros([len], (device, DType::F32));
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
            OptimizerSpec::Lamb(_) => {
                return Err(ZeroError::Config(
                    "optimizer.type LAMB has no device implementation: its state lives in host memory".into(),
                ))
            }
        })
    }

    /// The optimizer's name in checkpoints, as the host optimizer's.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            DeviceOptimizer::Adam(a) => a.name(),
            DeviceOptimizer::Sgd(_) => "sgd",
            DeviceOptimizer::Lion(_) => "lion",
        }
    }

    /// Steps taken.
    pub(crate) fn step_count(&self) -> u64 {
        match self {
            DeviceOptimizer::Adam(a) => a.step_count(),
            DeviceOptimizer::Sgd(s) => s.step,
            DeviceOptimizer::Lion(l) => l.step,
        }
    }

    /// The state tensors by PyTorch's names.
    pub(crate) fn state(&self) -> Vec<(&'static str, &Tensor<B, 1>)> {
        match self {
            DeviceOptimizer::Adam(a) => a.state(),
            DeviceOptimizer::Sgd(s) => s.buffer.iter().map(|b| ("momentum_buffer", b)).collect(),
            DeviceOptimizer::Lion(l) => vec![("exp_avg", &l.exp_avg)],
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
        }
    }

    /// Fails unless `params` and `grads` are fp32 shards of this optimizer's length: what
    /// [`DeviceOptimizer::step`] checks before it changes anything.
    pub(crate) fn check(&self, params: &Tensor<B, 1>, grads: &Tensor<B, 1>) -> Result<(), ZeroError> {
        check_shard(self.name(), self.len(), params, grads)
    }

    /// One update of the fp32 `params` from the fp32 `grads` at learning rate `lr`; returns the
    /// new parameters.
    pub(crate) fn step(
        &mut self,
        params: Tensor<B, 1>,
        grads: Tensor<B, 1>,
        lr: f64,
    ) -> Result<Tensor<B, 1>, ZeroError> {
        self.check(&params, &grads)?;
        Ok(match self {
            DeviceOptimizer::Adam(a) => a.step(params, grads, lr)?,
            DeviceOptimizer::Sgd(s) => s.step(params, grads, lr),
            DeviceOptimizer::Lion(l) => l.step(params, grads, lr),
        })
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

impl<B: Backend> DeviceSgd<B> {
    fn step(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64) -> Tensor<B, 1> {
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
    fn step(&mut self, params: Tensor<B, 1>, grads: Tensor<B, 1>, lr: f64) -> Tensor<B, 1> {
        let (b1, c1) = (self.spec.betas.0 as f32, (1.0 - self.spec.betas.0) as f32);
        let (b2, c2) = (self.spec.betas.1 as f32, (1.0 - self.spec.betas.1) as f32);
        let scale = (1.0 - lr * self.spec.weight_decay) as f32;
        let m = std::mem::replace(&mut self.exp_avg, Tensor::zeros([0], (&params.device(), DType::F32)));
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

    /// Five steps of the device optimizer and of the host kernel (the reference) from the same
    /// values: the same parameters and state to 1e-6 relative (the host may fuse a multiply-add).
    fn agrees_with_the_host(spec: OptimizerSpec) {
        let n = 37;
        let mut host_params: Vec<f32> = (0..n).map(|i| ((i * 13 % 11) as f32 - 5.0) * 0.07).collect();
        let mut host = optim::build(&spec, n, ShardSegments::single(n)).expect("host optimizer");
        let mut device = DeviceOptimizer::<F>::from_spec(&spec, n, &Default::default()).expect("device optimizer");
        let mut params = tensor(&host_params);
        for step in 0..5 {
            let grads: Vec<f32> = (0..n)
                .map(|i| (((i + step) * 7 % 13) as f32 - 6.0) * 0.05 + if i == 3 { 0.0 } else { 0.01 })
                .collect();
            host.step(&mut host_params, &grads, 0.01).expect("host step");
            params = device.step(params, tensor(&grads), 0.01).expect("device step");
        }
        let got = values(params);
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

    #[test]
    fn lamb_is_refused_on_the_device() {
        let e = DeviceOptimizer::<F>::from_spec(&OptimizerSpec::Lamb(Default::default()), 4, &Default::default())
            .expect_err("LAMB has no device implementation");
        assert!(e.to_string().contains("LAMB"), "{e}");
    }
}
