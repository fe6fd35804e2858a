//! The portable Adam loop. It is also the reference the SIMD kernels are tested against, and
//! their tail loop: with `FUSED` the multiply-adds are fused exactly as the SIMD lanes fuse them,
//! so a SIMD kernel gives bit-identical results on its tail and its body.

use half::{bf16, f16};

use super::{AdamScalars, OutBits};

/// `a·b + c`, fused (one rounding) when `FUSED`.
#[inline(always)]
fn mul_add<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// The update of one element: returns the new (p, m, v).
#[inline(always)]
pub(super) fn adam_element<const FUSED: bool>(p: f32, g: f32, m: f32, v: f32, s: &AdamScalars) -> (f32, f32, f32) {
    let g = mul_add::<FUSED>(s.l2_decay, p, g);
    let m = mul_add::<FUSED>(s.beta1, m, s.one_minus_beta1 * g);
    let v = mul_add::<FUSED>(s.beta2, v, s.one_minus_beta2 * g * g);
    let denom = mul_add::<FUSED>(v.sqrt(), s.inv_sqrt_bc2, s.eps);
    let p = mul_add::<FUSED>(-s.step_size, m / denom, p * s.param_scale);
    (p, m, v)
}

/// Runs the element update over equally long slices, writing the optional 16-bit copy.
#[inline(always)]
pub(super) fn adam_loop<const FUSED: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    out: OutBits<'_>,
    s: &AdamScalars,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    match out {
        OutBits::None => {
            for i in 0..n {
                (p[i], m[i], v[i]) = adam_element::<FUSED>(p[i], g[i], m[i], v[i], s);
            }
        }
        OutBits::Bf16(o) => {
            let o = &mut o[..n];
            for i in 0..n {
                (p[i], m[i], v[i]) = adam_element::<FUSED>(p[i], g[i], m[i], v[i], s);
                o[i] = bf16::from_f32(p[i]).to_bits();
            }
        }
        OutBits::F16(o) => {
            let o = &mut o[..n];
            for i in 0..n {
                (p[i], m[i], v[i]) = adam_element::<FUSED>(p[i], g[i], m[i], v[i], s);
                o[i] = f16::from_f32(p[i]).to_bits();
            }
        }
    }
}

/// The portable kernel: separate multiplies and adds (a software `fma` would be far slower on
/// CPUs without the instruction).
pub(super) fn adam_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], out: OutBits<'_>, s: &AdamScalars) {
    adam_loop::<false>(p, g, m, v, out, s);
}

/// AMSGrad: the denominator uses the running maximum of the second moment.
pub(super) fn amsgrad_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], vmax: &mut [f32], s: &AdamScalars) {
    let n = p.len();
    let (g, m, v, vmax) = (&g[..n], &mut m[..n], &mut v[..n], &mut vmax[..n]);
    for i in 0..n {
        let gi = s.l2_decay * p[i] + g[i];
        m[i] = s.beta1 * m[i] + s.one_minus_beta1 * gi;
        v[i] = s.beta2 * v[i] + s.one_minus_beta2 * gi * gi;
        vmax[i] = vmax[i].max(v[i]);
        let denom = vmax[i].sqrt() * s.inv_sqrt_bc2 + s.eps;
        p[i] = p[i] * s.param_scale - s.step_size * (m[i] / denom);
    }
}
