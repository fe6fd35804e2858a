//! Adam and AdamW over a flat fp32 shard on CUDA as one kernel: each thread reads its element's
//! parameter, gradient and both moments once and writes the parameter and both moments back
//! (28 bytes a parameter, the step's memory floor), in place in the tensors' own buffers. The
//! chain of Burn tensor ops it replaces reads and writes the shard about ten times.
//!
//! The arithmetic is the host's fused SIMD kernel's (`zero_core::optim::adam_kernel`, the fused
//! scalar loop): the same f32 constants ([`AdamScalars`]) and the same fused multiply-adds in the
//! same order; CUDA's `sqrt` and division are correctly rounded (NVRTC's defaults), so the two
//! should agree bit for bit, and the CUDA test holds them to one ulp.
//!
//! Burn's CUDA backends reach here as the inner backend of the model: `CubeBackend` over CUDA
//! (its float tensors are `CubeTensor`s) and `Fusion` over it (`burn::backend::Cuda`, whose
//! tensors are resolved to their buffers first, as the NCCL collectives do). The kernel is an
//! ordinary cubecl launch on the tensors' client, so it is ordered with the backend's other work
//! on its stream: no host synchronisation.

use super::nccl::CudaBuffers;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use burn_fusion::{Fusion, FusionTensor};
use cubecl::prelude::*;
use std::any::{Any, TypeId};
use zero_core::optim::adam_kernel::AdamScalars;

/// Threads per cube: one element each.
const CUBE_THREADS: u32 = 256;

/// One Adam/AdamW step of element `ABSOLUTE_POS`: `g ← g·grad_scale + l2_decay·p`, the moments,
/// and `p ← p·param_scale − step_size · m / (sqrt(v)·inv_sqrt_bc2 + eps)`, each multiply-add
/// fused as the host's SIMD lanes fuse it.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adam_kernel(
    params: &mut Array<f32>,
    grads: &Array<f32>,
    exp_avg: &mut Array<f32>,
    exp_avg_sq: &mut Array<f32>,
    grad_scale: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    step_size: f32,
    inv_sqrt_bc2: f32,
    eps: f32,
    l2_decay: f32,
    param_scale: f32,
) {
    let i = ABSOLUTE_POS;
    if i < params.len() {
        let p = params[i];
        let g = fma(l2_decay, p, grads[i] * grad_scale);
        let m = fma(beta1, exp_avg[i], one_minus_beta1 * g);
        let v = fma(beta2, exp_avg_sq[i], one_minus_beta2 * g * g);
        let denom = fma(f32::sqrt(v), inv_sqrt_bc2, eps);
        params[i] = fma(-step_size, m / denom, p * param_scale);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

/// The unfused backend that resolves and registers fused tensors (the element types only name
/// the backend's defaults; a buffer keeps its own dtype).
type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// Whether `I`'s float tensors are Burn's CUDA tensors (fused or not).
pub(crate) fn is_cuda<I: Backend>() -> bool {
    let t = TypeId::of::<I::FloatTensorPrimitive>();
    t == TypeId::of::<CubeTensor<CudaRuntime>>() || t == TypeId::of::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>()
}

/// `t`'s CUDA buffer, and whether it came from a fused tensor; `None` for another backend.
fn to_cube<I: Backend>(t: Tensor<I, 1>) -> Option<(CubeTensor<CudaRuntime>, bool)> {
    let primitive: Box<dyn Any> = Box::new(t.into_primitive().tensor());
    match primitive.downcast::<CubeTensor<CudaRuntime>>() {
        Ok(cube) => Some((*cube, false)),
        Err(other) => {
            let fused = *other.downcast::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>().ok()?;
            Some((<Fusion<Cube> as CudaBuffers>::to_cube(fused), true))
        }
    }
}

/// A buffer back as a tensor of `I` (fused again where it came from a fused tensor).
fn from_cube<I: Backend>(cube: CubeTensor<CudaRuntime>, fused: bool) -> Option<Tensor<I, 1>> {
    let primitive: Box<dyn Any> = if fused {
        Box::new(<Fusion<Cube> as CudaBuffers>::from_cube(cube))
    } else {
        Box::new(cube)
    };
    let primitive = *primitive.downcast::<I::FloatTensorPrimitive>().ok()?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(primitive)))
}

/// Whether the kernel may write `t` in place: fp32, contiguous, and the only handle to its
/// buffer.
fn writable(t: &CubeTensor<CudaRuntime>) -> bool {
    t.dtype == DType::F32 && t.is_contiguous() && t.handle.can_mut()
}

/// One fused step of `params` (with `exp_avg`, `exp_avg_sq`) from `grads` times `grad_scale`,
/// in place: the new parameters and moments. `Err` gives the four tensors back untouched where
/// the kernel cannot run on them (not CUDA tensors, not fp32, not contiguous, or a buffer shared
/// with another tensor), for the tensor-op path to take.
#[allow(clippy::type_complexity)]
pub(crate) fn adam_step<I: Backend>(
    params: Tensor<I, 1>,
    grads: Tensor<I, 1>,
    exp_avg: Tensor<I, 1>,
    exp_avg_sq: Tensor<I, 1>,
    s: &AdamScalars,
    grad_scale: f32,
) -> Result<(Tensor<I, 1>, Tensor<I, 1>, Tensor<I, 1>), [Tensor<I, 1>; 4]> {
    if !is_cuda::<I>() {
        return Err([params, grads, exp_avg, exp_avg_sq]);
    }
    let len = params.dims()[0];
    let lengths_match = [&grads, &exp_avg, &exp_avg_sq].iter().all(|t| t.dims()[0] == len);
    let dtypes = [&params, &grads, &exp_avg, &exp_avg_sq]
        .iter()
        .all(|t| t.dtype() == DType::F32);
    if !lengths_match || !dtypes {
        return Err([params, grads, exp_avg, exp_avg_sq]);
    }
    // Resolved to their buffers one by one; a tensor that turns out not writable goes back as
    // the backend's tensor (resolving a fused tensor has only run its queued operations).
    let unpack = |t: Tensor<I, 1>| to_cube::<I>(t).unwrap_or_else(|| unreachable!("checked: a CUDA tensor"));
    let (p, fused) = unpack(params);
    let (g, g_fused) = unpack(grads);
    let (m, m_fused) = unpack(exp_avg);
    let (v, v_fused) = unpack(exp_avg_sq);
    let back = |t: CubeTensor<CudaRuntime>, fused: bool| {
        from_cube::<I>(t, fused).unwrap_or_else(|| unreachable!("the tensor came from this backend"))
    };
    if !writable(&p) || !writable(&m) || !writable(&v) || !g.is_contiguous() {
        return Err([back(p, fused), back(g, g_fused), back(m, m_fused), back(v, v_fused)]);
    }
    if len > 0 {
        let client = p.client.clone();
        let cube_dim = CubeDim::new_1d(CUBE_THREADS);
        let cube_count = cubecl::calculate_cube_count_elemwise(&client, len, cube_dim);
        // SAFETY: every array is an fp32 buffer of `len` elements (checked above), and the kernel
        // touches element i < len only.
        unsafe {
            adam_kernel::launch(
                &client,
                cube_count,
                cube_dim,
                ArrayArg::from_raw_parts(p.handle.clone(), len),
                ArrayArg::from_raw_parts(g.handle.clone(), len),
                ArrayArg::from_raw_parts(m.handle.clone(), len),
                ArrayArg::from_raw_parts(v.handle.clone(), len),
                grad_scale,
                s.beta1,
                s.one_minus_beta1,
                s.beta2,
                s.one_minus_beta2,
                s.step_size,
                s.inv_sqrt_bc2,
                s.eps,
                s.l2_decay,
                s.param_scale,
            );
        }
    }
    drop(g);
    Ok((back(p, fused), back(m, m_fused), back(v, v_fused)))
}
