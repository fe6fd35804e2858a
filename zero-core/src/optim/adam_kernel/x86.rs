//! AVX2 and AVX-512 Adam kernels. Each lane computes exactly what `scalar::adam_element` with
//! fused multiply-adds computes, and the tail that does not fill a vector runs that scalar code,
//! so a whole chunk matches the fused scalar loop bit for bit.

use std::arch::x86_64::*;

use super::scalar::adam_loop;
use super::{AdamScalars, OutBits};

/// AVX2 + FMA + F16C kernel, 8 lanes.
pub(super) fn adam_chunk_avx2(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    out: OutBits<'_>,
    s: &AdamScalars,
) {
    debug_assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    // SAFETY: this kernel is only selected after `Isa::Avx2.is_supported()` returned true, which
    // checks avx2, fma and f16c at run time.
    unsafe { adam_avx2(p, g, m, v, out, s) }
}

/// AVX-512F kernel, 16 lanes.
pub(super) fn adam_chunk_avx512(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    out: OutBits<'_>,
    s: &AdamScalars,
) {
    debug_assert!(is_x86_feature_detected!("avx512f"));
    // SAFETY: only selected after `Isa::Avx512.is_supported()` checked avx512f at run time.
    unsafe { adam_avx512(p, g, m, v, out, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn adam_avx2(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], mut out: OutBits<'_>, s: &AdamScalars) {
    const LANES: usize = 8;
    let n = p.len();
    assert!(g.len() >= n && m.len() >= n && v.len() >= n);
    let out_ptr: Option<*mut u16> = match &mut out {
        OutBits::None => None,
        OutBits::Bf16(o) | OutBits::F16(o) => {
            assert!(o.len() >= n);
            Some(o.as_mut_ptr())
        }
    };
    let is_bf16 = matches!(out, OutBits::Bf16(_));
    let (pp, gp, mp, vp) = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());

    let b1 = _mm256_set1_ps(s.beta1);
    let omb1 = _mm256_set1_ps(s.one_minus_beta1);
    let b2 = _mm256_set1_ps(s.beta2);
    let omb2 = _mm256_set1_ps(s.one_minus_beta2);
    let neg_step = _mm256_set1_ps(-s.step_size);
    let isb = _mm256_set1_ps(s.inv_sqrt_bc2);
    let eps = _mm256_set1_ps(s.eps);
    let l2 = _mm256_set1_ps(s.l2_decay);
    let pscale = _mm256_set1_ps(s.param_scale);

    let body = n - n % LANES;
    let mut i = 0;
    while i < body {
        // SAFETY: i + LANES <= n and every slice holds at least n elements (asserted above).
        unsafe {
            let pv = _mm256_loadu_ps(pp.add(i));
            let gv = _mm256_fmadd_ps(l2, pv, _mm256_loadu_ps(gp.add(i)));
            let mv = _mm256_fmadd_ps(b1, _mm256_loadu_ps(mp.add(i)), _mm256_mul_ps(omb1, gv));
            let g2 = _mm256_mul_ps(_mm256_mul_ps(omb2, gv), gv);
            let vv = _mm256_fmadd_ps(b2, _mm256_loadu_ps(vp.add(i)), g2);
            let denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), isb, eps);
            let pn = _mm256_fmadd_ps(neg_step, _mm256_div_ps(mv, denom), _mm256_mul_ps(pv, pscale));
            _mm256_storeu_ps(pp.add(i), pn);
            _mm256_storeu_ps(mp.add(i), mv);
            _mm256_storeu_ps(vp.add(i), vv);
            if let Some(o) = out_ptr {
                let half = if is_bf16 {
                    bf16_avx2(pn)
                } else {
                    _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(pn)
                };
                _mm_storeu_si128(o.add(i) as *mut __m128i, half);
            }
        }
        i += LANES;
    }
    let tail_out = match out {
        OutBits::None => OutBits::None,
        OutBits::Bf16(o) => OutBits::Bf16(&mut o[body..n]),
        OutBits::F16(o) => OutBits::F16(&mut o[body..n]),
    };
    adam_loop::<true>(
        &mut p[body..],
        &g[body..n],
        &mut m[body..n],
        &mut v[body..n],
        tail_out,
        s,
    );
}

/// f32 → bf16 bits, round to nearest even, NaN kept quiet (as `half::bf16::from_f32`).
#[target_feature(enable = "avx2")]
fn bf16_avx2(x: __m256) -> __m128i {
    let bits = _mm256_castps_si256(x);
    let high = _mm256_srli_epi32::<16>(bits);
    let lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    let biased = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    let rounded = _mm256_srli_epi32::<16>(biased);
    let quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Every lane is below 0x10000, so the saturating pack only narrows.
    _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r))
}

#[target_feature(enable = "avx512f")]
unsafe fn adam_avx512(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], mut out: OutBits<'_>, s: &AdamScalars) {
    const LANES: usize = 16;
    let n = p.len();
    assert!(g.len() >= n && m.len() >= n && v.len() >= n);
    let out_ptr: Option<*mut u16> = match &mut out {
        OutBits::None => None,
        OutBits::Bf16(o) | OutBits::F16(o) => {
            assert!(o.len() >= n);
            Some(o.as_mut_ptr())
        }
    };
    let is_bf16 = matches!(out, OutBits::Bf16(_));
    let (pp, gp, mp, vp) = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());

    let b1 = _mm512_set1_ps(s.beta1);
    let omb1 = _mm512_set1_ps(s.one_minus_beta1);
    let b2 = _mm512_set1_ps(s.beta2);
    let omb2 = _mm512_set1_ps(s.one_minus_beta2);
    let neg_step = _mm512_set1_ps(-s.step_size);
    let isb = _mm512_set1_ps(s.inv_sqrt_bc2);
    let eps = _mm512_set1_ps(s.eps);
    let l2 = _mm512_set1_ps(s.l2_decay);
    let pscale = _mm512_set1_ps(s.param_scale);

    let body = n - n % LANES;
    let mut i = 0;
    while i < body {
        // SAFETY: i + LANES <= n and every slice holds at least n elements (asserted above).
        unsafe {
            let pv = _mm512_loadu_ps(pp.add(i));
            let gv = _mm512_fmadd_ps(l2, pv, _mm512_loadu_ps(gp.add(i)));
            let mv = _mm512_fmadd_ps(b1, _mm512_loadu_ps(mp.add(i)), _mm512_mul_ps(omb1, gv));
            let g2 = _mm512_mul_ps(_mm512_mul_ps(omb2, gv), gv);
            let vv = _mm512_fmadd_ps(b2, _mm512_loadu_ps(vp.add(i)), g2);
            let denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), isb, eps);
            let pn = _mm512_fmadd_ps(neg_step, _mm512_div_ps(mv, denom), _mm512_mul_ps(pv, pscale));
            _mm512_storeu_ps(pp.add(i), pn);
            _mm512_storeu_ps(mp.add(i), mv);
            _mm512_storeu_ps(vp.add(i), vv);
            if let Some(o) = out_ptr {
                let half = if is_bf16 {
                    bf16_avx512(pn)
                } else {
                    _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(pn)
                };
                _mm256_storeu_si256(o.add(i) as *mut __m256i, half);
            }
        }
        i += LANES;
    }
    let tail_out = match out {
        OutBits::None => OutBits::None,
        OutBits::Bf16(o) => OutBits::Bf16(&mut o[body..n]),
        OutBits::F16(o) => OutBits::F16(&mut o[body..n]),
    };
    adam_loop::<true>(
        &mut p[body..],
        &g[body..n],
        &mut m[body..n],
        &mut v[body..n],
        tail_out,
        s,
    );
}

/// f32 → bf16 bits, round to nearest even, NaN kept quiet (as `half::bf16::from_f32`).
#[target_feature(enable = "avx512f")]
fn bf16_avx512(x: __m512) -> __m256i {
    let bits = _mm512_castps_si512(x);
    let high = _mm512_srli_epi32::<16>(bits);
    let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    let biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    let rounded = _mm512_srli_epi32::<16>(biased);
    let quiet_nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    let r = _mm512_mask_blend_epi32(is_nan, rounded, quiet_nan);
    _mm512_cvtepi32_epi16(r)
}
