//! `NcclDevice` on Burn's CUDA tensors, and `ZeroOptimizer`'s device state reducing through it
//! on the CUDA backend, at world size 1 on GPU 0: on `burn::backend::Cuda` (fused) and on the
//! unfused `CubeBackend` under it. Skipped, with a note, where no GPU or no NCCL
//! is found (build with `--features cuda`).
//!
//! References: for the collectives, the input values themselves (one rank: a sum, a mean, a
//! gather and a scatter are the identity), read back from the tensors Burn holds, so a wrong
//! pointer, offset, length or dtype shows; for the optimizer, its host state (`offload_optimizer`
//! cpu) on the same backend, data and Burn loop (the tolerance of optimizer_device_state.rs: 1e-5
//! of the largest weight).
#![cfg(feature = "cuda")]

#[path = "it/common/mod.rs"]
mod common;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use common::{adamw_eps4, batch, values, Net, GLOBAL_BATCH};
use std::sync::Arc;
use std::time::Duration;
use zero_burn::{CudaBuffers, DeviceCollective, EngineSettings, NcclDevice, OptimizerOffload, Stage, ZeroOptimizer};
use zero_core::comm::{NcclGroup, ProcessGroup, ReduceOp, TcpGroup, TcpOptions, ThreadGroup};
use zero_test_support::max_relative_error;

/// Burn's CUDA backend without fusion.
type Cube = burn_cubecl::CubeBackend<burn_cubecl::cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// Skips a test where there is no GPU or no NCCL, with the reason printed; fails instead under
/// `ZERO_REQUIRE_CUDA=1` (tools/gpu/run.sh), where a skip would hide a broken CUDA setup.
fn skip(why: String) {
    assert!(
        std::env::var_os("ZERO_REQUIRE_CUDA").is_none(),
        "ZERO_REQUIRE_CUDA is set: {why}"
    );
    eprintln!("skipped: {why}");
}

/// A one-rank NCCL group on GPU 0, or `None` (with the reason printed) where there is none.
fn single_rank() -> Option<Arc<NcclGroup>> {
    match std::panic::catch_unwind(cudarc::driver::CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => {}
        other => {
            skip(format!("no CUDA device found ({other:?})"));
            return None;
        }
    }
    let options = TcpOptions {
        timeout: Duration::from_secs(60),
        ..TcpOptions::default()
    };
    // World size 1 needs no rendezvous peer: the port is never opened.
    let ctrl = TcpGroup::connect(0, 1, "127.0.0.1", 1, options).expect("a one-rank TCP group");
    match NcclGroup::over(Arc::new(ctrl), 0, Duration::from_secs(60)) {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            skip(format!("NCCL is unusable here: {e}"));
            None
        }
    }
}

fn read<G: Backend>(t: Tensor<G, 1>) -> Vec<f32> {
    zero_burn::params::tensor_to_vec(t)
}

#[test]
fn collectives_on_burn_cuda_tensors_read_the_right_memory() {
    let Some(group) = single_rank() else { return };
    collectives_read_the_right_memory::<Cuda>(group.clone());
    collectives_read_the_right_memory::<Cube>(group);
}

fn collectives_read_the_right_memory<G: CudaBuffers>(group: Arc<NcclGroup>) {
    let device = CudaDevice::new(0);
    let nccl = NcclDevice::new(group, &device).expect("NCCL on GPU 0");
    let values: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin()).collect();
    let whole = Tensor::<G, 1>::from_data(TensorData::new(values.clone(), [1000]), &device);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let base = whole.clone().cast(dtype);
        let want = read(base.clone().narrow(0, 123, 512));
        // A view at an offset into a larger buffer, still held here (so not reduced in place).
        let view = base.clone().narrow(0, 123, 512);
        let summed = nccl.all_reduce(view.clone(), ReduceOp::Sum).expect("all_reduce");
        assert_eq!(summed.dtype(), dtype);
        assert_eq!(read(summed), want, "{dtype:?} all_reduce of a view");
        assert_eq!(read(view), want, "{dtype:?}: the input is intact");
        // A tensor whose last handle is given up (reduced in place).
        let owned = base.clone().narrow(0, 123, 512).mul_scalar(1.0);
        assert_eq!(read(nccl.all_reduce(owned, ReduceOp::Avg).expect("avg")), want);
        let shard = nccl
            .reduce_scatter(base.clone().narrow(0, 123, 512), ReduceOp::Avg)
            .expect("reduce_scatter");
        assert_eq!(read(shard), want, "{dtype:?} reduce_scatter");
        let gathered = nccl.all_gather(base.clone().narrow(0, 123, 512)).expect("all_gather");
        assert_eq!(read(gathered), want, "{dtype:?} all_gather");
    }
    let mut scalars = [1.5f32, -2.0];
    DeviceCollective::<G>::all_reduce_scalars(&nccl, &mut scalars, ReduceOp::Max).expect("scalars");
    assert_eq!(scalars, [1.5, -2.0]);
}

#[test]
fn device_state_on_cuda_through_nccl_matches_the_host_state() {
    let Some(group) = single_rank() else { return };
    device_state_matches_the_host_state::<Cuda>(group.clone());
    device_state_matches_the_host_state::<Cube>(group);
}

fn device_state_matches_the_host_state<G: CudaBuffers>(group: Arc<NcclGroup>) {
    let device = CudaDevice::new(0);
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        let mut settings = EngineSettings::new(stage, adamw_eps4(0.01));
        settings.gradient_clipping = 0.05;
        settings.reduce_bucket_size = 100;
        let nccl: Arc<dyn DeviceCollective<G>> =
            Arc::new(NcclDevice::new(group.clone(), &device).expect("NCCL on GPU 0"));
        let mut dev = ZeroOptimizer::new(settings.clone(), group.clone() as Arc<dyn ProcessGroup>)
            .expect("device optimizer")
            .with_collective(nccl);
        let mut host_settings = settings;
        host_settings.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
        let host_group = ThreadGroup::new_group(1).expect("group").remove(0) as Arc<dyn ProcessGroup>;
        let mut host = ZeroOptimizer::new(host_settings, host_group).expect("host optimizer");
        // Five steps of two micro-batches, each loss averaged over them, summed by Burn's
        // accumulator.
        let train = |optim: &mut ZeroOptimizer| {
            let mut model = Net::<Autodiff<G>>::new(&device, 3);
            for step in 0..5 {
                let mut accumulator = GradientsAccumulator::new();
                for micro in 0..2 {
                    let rows = micro * GLOBAL_BATCH / 2..(micro + 1) * GLOBAL_BATCH / 2;
                    let (x, y) = batch::<Autodiff<G>>(step, rows, &device);
                    let grads = model.loss(x, y).div_scalar(2.0).backward();
                    accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
                }
                model = optim.try_step(0.01, model, accumulator.grads()).expect("step");
            }
            values::<Autodiff<G>, _>(&model)
        };
        let got = train(&mut dev);
        let want = train(&mut host);
        assert_eq!(dev.tensor_state(), Some(true), "{stage:?}: the device state ran");
        assert_eq!(host.tensor_state(), Some(false), "{stage:?}: the host state ran");
        let err = max_relative_error(&format!("{}, {stage:?}", std::any::type_name::<G>()), &got, &want);
        println!("{}, {stage:?}: max relative error {err:e}", std::any::type_name::<G>());
        assert!(
            err < 1e-5,
            "{}, {stage:?}: max relative error {err:e}",
            std::any::type_name::<G>()
        );
        let initial = values::<Autodiff<G>, _>(&Net::<Autodiff<G>>::new(&device, 3));
        assert!(
            max_relative_error("the initial weights", &initial, &want) > 1e-2,
            "the reference trained"
        );
    }
}

/// A GPU or the reason there is none (skipped, or failed under `ZERO_REQUIRE_CUDA=1`).
fn has_gpu() -> bool {
    match std::panic::catch_unwind(cudarc::driver::CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => true,
        other => {
            skip(format!("no CUDA device found ({other:?})"));
            false
        }
    }
}

/// `DeviceAdam` on CUDA runs as one kernel over the shard (every step counted by
/// `fused_steps`), fused and unfused. Reference: zero-core's host kernel (the fused scalar
/// loop the SIMD kernels equal) on the same values over five steps, Adam and AdamW, on a shard
/// with a tail past the last full cube: within one ulp of the largest value per element.
#[test]
fn device_adam_on_cuda_is_one_kernel_equal_to_the_host_kernel() {
    if !has_gpu() {
        return;
    }
    device_adam_matches_the_host_kernel::<Cuda>();
    device_adam_matches_the_host_kernel::<Cube>();
}

fn device_adam_matches_the_host_kernel<G: CudaBuffers>() {
    use zero_burn::DeviceAdam;
    use zero_core::optim::adam_kernel::{adam_step, AdamScalars, HalfCopy, Isa};
    let device = CudaDevice::new(0);
    let n = 100_003;
    let values = |seed: u32, scale: f32| -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 20_001) as f32 / 10_000.0 - 1.0)
            .map(|x| x * scale)
            .collect()
    };
    for decoupled in [false, true] {
        let spec = zero_core::optim::AdamSpec {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled_weight_decay: decoupled,
            bias_correction: true,
            amsgrad: false,
        };
        let mut adam = DeviceAdam::<G>::new(spec.clone(), n, &device).expect("device Adam");
        let mut params = Tensor::<G, 1>::from_data(TensorData::new(values(1, 1.0), [n]), &device);
        let (mut p, mut m, mut v) = (values(1, 1.0), vec![0.0f32; n], vec![0.0f32; n]);
        for step in 1..=5u64 {
            let g = values(step as u32 + 7, 0.1);
            let grads = Tensor::<G, 1>::from_data(TensorData::new(g.clone(), [n]), &device);
            params = adam.step(params, grads, spec.lr).expect("step");
            let s = AdamScalars::new(spec.lr, 0.9, 0.999, 1e-8, 0.01, decoupled, true, step);
            let isa = Isa::available()
                .into_iter()
                .find(|&i| i != Isa::Scalar)
                .unwrap_or(Isa::Scalar);
            adam_step(isa, &mut p, &g, &mut m, &mut v, HalfCopy::None, &s).expect("host step");
        }
        assert_eq!(
            adam.fused_steps(),
            5,
            "decoupled {decoupled}: every step ran as the one kernel"
        );
        let got = read(params);
        let largest = p.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        let ulp = f32::from_bits(largest.to_bits() + 1) - largest;
        let worst = got.iter().zip(&p).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(
            worst <= ulp,
            "decoupled {decoupled}: CUDA Adam differs from the host kernel by {worst} (one ulp of the largest value: {ulp})"
        );
        assert!(
            got.iter().zip(values(1, 1.0)).any(|(a, b)| *a != b),
            "the kernel changed the parameters"
        );
    }
}
