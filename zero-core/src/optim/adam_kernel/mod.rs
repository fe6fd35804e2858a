//! The fused CPU Adam/AdamW step over flat fp32 buffers: the optimizer step of ZeRO-Offload.
//!
//! One pass over memory reads the parameter, gradient and both moments and writes the parameter
//! and both moments back (28 bytes per parameter), optionally writing the updated parameter as
//! bf16 or f16 in the same pass (2 more bytes) so that no second pass over the master weights is
//! needed to refresh the 16-bit model copy. The step is bound by memory bandwidth, so the work is
//! split into chunks that rayon spreads over its pool; inside a chunk the arithmetic runs on the
//! SIMD kernel that measures fastest on this CPU ([`Isa::fastest`], once per process), with a
//! portable loop as fallback.
//!
//! The arithmetic is PyTorch's (`torch.optim.Adam` / `AdamW`):
//! `m = β1·m + (1-β1)·g`, `v = β2·v + (1-β2)·g²`,
//! `p ← p·(1 - lr·wd_decoupled) - (lr/bc1) · m / (sqrt(v)/sqrt(bc2) + eps)`, with
//! `g ← g + wd_l2·p` first for Adam's L2 decay.

mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use rayon::prelude::*;

/// The 16-bit types of the copy-back, re-exported so callers need not depend on `half`.
pub use half::{bf16, f16};

use super::OptimError;

/// Elements per parallel chunk: 64 Ki f32 = 256 KiB per stream, large enough that scheduling
/// costs nothing next to the memory traffic, small enough to balance two to dozens of threads.
const CHUNK: usize = 1 << 16;

/// Elements of [`Isa::fastest`]'s measurement: 16 MiB a buffer, 64 MiB in all, past most
/// last-level caches, so that the step is timed as it runs on a real shard (from memory).
const MEASURE_ELEMENTS: usize = 1 << 22;

/// Timed rounds per kernel in [`Isa::fastest`] (after one warm-up); the best counts.
const MEASURE_ROUNDS: usize = 3;

/// An instruction set the Adam kernel can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust loop (what the compiler makes of it; NEON on aarch64 by auto-vectorisation).
    Scalar,
    /// x86-64 AVX2 with FMA and F16C, 8 lanes.
    Avx2,
    /// x86-64 AVX-512F, 16 lanes.
    Avx512,
}

impl Isa {
    /// The widest instruction set this CPU supports.
    pub fn detect() -> Isa {
        *Self::available().last().unwrap_or(&Isa::Scalar)
    }

    /// The instruction set whose kernel runs this CPU's Adam step fastest, measured once per
    /// process (on the calling rayon pool, over buffers larger than most caches): the widest
    /// is not always the fastest (a memory-bound step can lose on AVX-512 where the core splits
    /// 512-bit operations or lowers its clock). Only the SIMD kernels compete, and they give
    /// the same bits (their fused multiply-adds are the same operations in the same order), so
    /// the choice never changes a result; the portable loop, which rounds differently, runs only
    /// on a CPU without them.
    pub fn fastest() -> Isa {
        static FASTEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *FASTEST.get_or_init(|| Self::measure_fastest(MEASURE_ELEMENTS, MEASURE_ROUNDS).0)
    }

    /// Times every SIMD kernel this CPU runs on `elements` parameters, `rounds` times each after
    /// one warm-up, interleaved so that a change of load falls on all; returns the fastest and
    /// each kernel's best time in seconds. The portable loop alone when no SIMD kernel runs here.
    pub fn measure_fastest(elements: usize, rounds: usize) -> (Isa, Vec<(Isa, f64)>) {
        let simd: Vec<Isa> = Self::available().into_iter().filter(|&i| i != Isa::Scalar).collect();
        if simd.len() < 2 {
            let only = simd.first().copied().unwrap_or(Isa::Scalar);
            return (only, Vec::new());
        }
        let mut p = vec![0.5f32; elements];
        let g = vec![1e-3f32; elements];
        let mut m = vec![0.0f32; elements];
        let mut v = vec![0.0f32; elements];
        let s = AdamScalars::new(1e-4, 0.9, 0.999, 1e-8, 0.01, true, true, 1);
        let mut best = vec![f64::INFINITY; simd.len()];
        for round in 0..=rounds {
            for (k, &isa) in simd.iter().enumerate() {
                let start = std::time::Instant::now();
                // Lengths match and the ISA is supported: it cannot fail.
                let _ = adam_step(isa, &mut p, &g, &mut m, &mut v, HalfCopy::None, &s);
                let secs = start.elapsed().as_secs_f64();
                if round > 0 {
                    best[k] = best[k].min(secs);
                }
            }
        }
        let times: Vec<(Isa, f64)> = simd.iter().copied().zip(best).collect();
        let fastest = times
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(Isa::Scalar, |t| t.0);
        (fastest, times)
    }

    /// Every instruction set this CPU supports, narrowest first (always starts with `Scalar`).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// Whether this CPU can run the kernel for `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// A short name for logs and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512f",
        }
    }
}

/// Where the updated parameters are also written, rounded to nearest even, in the same pass.
#[derive(Debug)]
pub enum HalfCopy<'a> {
    /// No 16-bit copy.
    None,
    /// bfloat16 copy, one element per parameter.
    Bf16(&'a mut [bf16]),
    /// IEEE half copy, one element per parameter.
    F16(&'a mut [f16]),
}

impl HalfCopy<'_> {
    fn len(&self) -> Option<usize> {
        match self {
            HalfCopy::None => None,
            HalfCopy::Bf16(s) => Some(s.len()),
            HalfCopy::F16(s) => Some(s.len()),
        }
    }
}

/// The per-step constants of the Adam update, computed once per step from the hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    /// β1.
    pub beta1: f32,
    /// 1 - β1.
    pub one_minus_beta1: f32,
    /// β2.
    pub beta2: f32,
    /// 1 - β2.
    pub one_minus_beta2: f32,
    /// lr / (1 - β1^t), or lr without bias correction.
    pub step_size: f32,
    /// 1 / sqrt(1 - β2^t), or 1 without bias correction.
    pub inv_sqrt_bc2: f32,
    /// Added to the denominator after the square root (PyTorch's placement).
    pub eps: f32,
    /// L2 weight decay added to the gradient (Adam); 0 for AdamW.
    pub l2_decay: f32,
    /// Factor the parameter is multiplied by before the update: 1 - lr·wd for AdamW, 1 for Adam.
    pub param_scale: f32,
}

impl AdamScalars {
    /// The constants for step `step` (1-based: the first update is step 1).
    ///
    /// `decoupled` selects AdamW's decay (`p -= lr·wd·p` before the update) over Adam's L2 decay
    /// (`g += wd·p`). Like PyTorch, which computes them from Python floats, every derived constant
    /// (1 - β, lr / bc1, 1 - lr·wd) is computed in f64 and rounded to f32 once: `1 - 0.999f32`
    /// is 1.3e-5 (relative) away from `0.001f32`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
        bias_correction: bool,
        step: u64,
    ) -> Self {
        let (bc1, bc2) = if bias_correction {
            let t = step.min(i32::MAX as u64) as i32;
            (1.0 - beta1.powi(t), 1.0 - beta2.powi(t))
        } else {
            (1.0, 1.0)
        };
        let (l2_decay, param_scale) = if decoupled {
            (0.0, 1.0 - lr * weight_decay)
        } else {
            (weight_decay, 1.0)
        };
        AdamScalars {
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (lr / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: eps as f32,
            l2_decay: l2_decay as f32,
            param_scale: param_scale as f32,
        }
    }
}

/// The chunk-level kernel of one ISA. Slices are equally long; `out` is either empty or as long.
type ChunkFn = fn(&mut [f32], &[f32], &mut [f32], &mut [f32], OutBits<'_>, &AdamScalars);

/// A 16-bit output chunk as raw bits, so the ISA kernels handle one element type.
#[derive(Debug)]
pub(crate) enum OutBits<'a> {
    None,
    Bf16(&'a mut [u16]),
    F16(&'a mut [u16]),
}

fn chunk_fn(isa: Isa) -> ChunkFn {
    match isa {
        Isa::Scalar => scalar::adam_chunk,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::adam_chunk_avx2,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::adam_chunk_avx512,
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => scalar::adam_chunk,
    }
}

/// Checks the lengths of every buffer of a step against `params`.
fn check_lengths(
    params: usize,
    grads: usize,
    exp_avg: usize,
    exp_avg_sq: usize,
    out: Option<usize>,
) -> Result<(), OptimError> {
    let named = [
        ("grads", Some(grads)),
        ("exp_avg", Some(exp_avg)),
        ("exp_avg_sq", Some(exp_avg_sq)),
        ("16-bit parameter copy", out),
    ];
    for (what, len) in named {
        if let Some(actual) = len {
            if actual != params {
                return Err(OptimError::LengthMismatch {
                    what: what.to_string(),
                    expected: params,
                    actual,
                });
            }
        }
    }
    Ok(())
}

/// One fused Adam/AdamW step over flat buffers, in parallel on the current rayon pool.
///
/// `isa` must be supported by this CPU ([`Isa::is_supported`]); [`Isa::detect`] gives the best.
/// Run it inside `ThreadPool::install` to choose the number of threads.
pub fn adam_step(
    isa: Isa,
    params: &mut [f32],
    grads: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    out: HalfCopy<'_>,
    scalars: &AdamScalars,
) -> Result<(), OptimError> {
    if !isa.is_supported() {
        return Err(OptimError::UnsupportedIsa(isa.name()));
    }
    check_lengths(params.len(), grads.len(), exp_avg.len(), exp_avg_sq.len(), out.len())?;
    let kernel = chunk_fn(isa);
    let serial = params.len() <= CHUNK || rayon::current_num_threads() == 1;
    match out {
        HalfCopy::None => {
            if serial {
                kernel(params, grads, exp_avg, exp_avg_sq, OutBits::None, scalars);
            } else {
                params
                    .par_chunks_mut(CHUNK)
                    .zip(grads.par_chunks(CHUNK))
                    .zip(exp_avg.par_chunks_mut(CHUNK))
                    .zip(exp_avg_sq.par_chunks_mut(CHUNK))
                    .for_each(|(((p, g), m), v)| kernel(p, g, m, v, OutBits::None, scalars));
            }
        }
        HalfCopy::Bf16(o) => {
            let bits: &mut [u16] = bytemuck::cast_slice_mut(o);
            run_with_bits(kernel, serial, params, grads, exp_avg, exp_avg_sq, bits, true, scalars);
        }
        HalfCopy::F16(o) => {
            let bits: &mut [u16] = bytemuck::cast_slice_mut(o);
            run_with_bits(kernel, serial, params, grads, exp_avg, exp_avg_sq, bits, false, scalars);
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_with_bits(
    kernel: ChunkFn,
    serial: bool,
    params: &mut [f32],
    grads: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    bits: &mut [u16],
    bf16: bool,
    scalars: &AdamScalars,
) {
    fn wrap(o: &mut [u16], bf16: bool) -> OutBits<'_> {
        if bf16 {
            OutBits::Bf16(o)
        } else {
            OutBits::F16(o)
        }
    }
    if serial {
        kernel(params, grads, exp_avg, exp_avg_sq, wrap(bits, bf16), scalars);
    } else {
        params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(exp_avg.par_chunks_mut(CHUNK))
            .zip(exp_avg_sq.par_chunks_mut(CHUNK))
            .zip(bits.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), o)| kernel(p, g, m, v, wrap(o, bf16), scalars));
    }
}

/// One AMSGrad step (Adam keeping the running maximum of the second moment), in parallel.
///
/// Less common than plain Adam, so it runs the portable loop only.
#[allow(clippy::too_many_arguments)]
pub fn adam_amsgrad_step(
    params: &mut [f32],
    grads: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    max_exp_avg_sq: &mut [f32],
    scalars: &AdamScalars,
) -> Result<(), OptimError> {
    check_lengths(
        params.len(),
        grads.len(),
        exp_avg.len(),
        exp_avg_sq.len(),
        Some(max_exp_avg_sq.len()),
    )?;
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(exp_avg.par_chunks_mut(CHUNK))
        .zip(exp_avg_sq.par_chunks_mut(CHUNK))
        .zip(max_exp_avg_sq.par_chunks_mut(CHUNK))
        .for_each(|((((p, g), m), v), vmax)| scalar::amsgrad_chunk(p, g, m, v, vmax, scalars));
    Ok(())
}

/// Writes `src` into a 16-bit copy, rounded to nearest even, in parallel (for optimizers whose
/// step has no fused copy-back).
pub fn copy_to_half(src: &[f32], out: HalfCopy<'_>) -> Result<(), OptimError> {
    if let Some(actual) = out.len() {
        if actual != src.len() {
            return Err(OptimError::LengthMismatch {
                what: "16-bit parameter copy".to_string(),
                expected: src.len(),
                actual,
            });
        }
    }
    match out {
        HalfCopy::None => {}
        HalfCopy::Bf16(o) => o
            .par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, &s)| *o = bf16::from_f32(s))),
        HalfCopy::F16(o) => o
            .par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, &s)| *o = f16::from_f32(s))),
    }
    Ok(())
}
