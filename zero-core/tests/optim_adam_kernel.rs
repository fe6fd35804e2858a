//! The fused Adam kernel on every instruction set this CPU has, against two references: the
//! portable scalar loop (each SIMD path must agree with it to within 2 ulp after one step) and a
//! float64 implementation of PyTorch's Adam/AdamW written here (within 1e-6 relative after
//! several steps). Odd lengths exercise the vector tails; lengths above one parallel chunk
//! exercise the threaded path.

use half::{bf16, f16};
use zero_core::optim::adam_kernel::{adam_step, AdamScalars, HalfCopy, Isa};

/// Deterministic pseudo-random floats in [-1, 1) (splitmix64).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The spacing of f32 values at magnitude `x` (one unit in the last place).
fn ulp(x: f32) -> f32 {
    let x = x.abs().max(f32::MIN_POSITIVE);
    f32::from_bits(x.to_bits() + 1) - x
}

struct State {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn state(n: usize, seed: u64) -> State {
    State {
        p: random(n, seed),
        g: random(n, seed + 1).iter().map(|x| x * 0.1).collect(),
        m: random(n, seed + 2).iter().map(|x| x * 0.01).collect(),
        v: random(n, seed + 3).iter().map(|x| x * x * 1e-3).collect(),
    }
}

const LENGTHS: [usize; 9] = [0, 1, 7, 8, 15, 17, 33, 1031, 200_003];

fn scalars(decoupled: bool) -> AdamScalars {
    AdamScalars::new(1e-2, 0.9, 0.999, 1e-8, 0.1, decoupled, true, 3)
}

/// The kernels' arithmetic with every multiply-add fused (`f32::mul_add` is correctly rounded
/// in software where the CPU has no FMA): what each SIMD lane computes.
fn fused_reference(st: &mut State, s: &AdamScalars) {
    for i in 0..st.p.len() {
        let g = s.l2_decay.mul_add(st.p[i], st.g[i]);
        st.m[i] = s.beta1.mul_add(st.m[i], s.one_minus_beta1 * g);
        st.v[i] = s.beta2.mul_add(st.v[i], s.one_minus_beta2 * g * g);
        let denom = st.v[i].sqrt().mul_add(s.inv_sqrt_bc2, s.eps);
        st.p[i] = (-s.step_size).mul_add(st.m[i] / denom, st.p[i] * s.param_scale);
    }
}

/// Every SIMD kernel equals the fused scalar loop to within one ulp (in practice bit for bit),
/// on body and tail. The portable loop rounds products separately, which on these deliberately
/// unrelated random moments (m/sqrt(v) ill-conditioned) is not comparable ulp by ulp; it is held
/// to the float64 reference from a real trajectory in the next test instead.
#[test]
fn simd_kernels_equal_the_fused_scalar_loop() {
    for isa in Isa::available().into_iter().filter(|&isa| isa != Isa::Scalar) {
        for &n in &LENGTHS {
            for decoupled in [false, true] {
                let s = scalars(decoupled);
                let before = state(n, 7);
                let mut reference = state(n, 7);
                fused_reference(&mut reference, &s);
                let mut got = state(n, 7);
                adam_step(isa, &mut got.p, &got.g, &mut got.m, &mut got.v, HalfCopy::None, &s).unwrap();
                for i in 0..n {
                    for (name, a, b) in [
                        ("param", got.p[i], reference.p[i]),
                        ("exp_avg", got.m[i], reference.m[i]),
                        ("exp_avg_sq", got.v[i], reference.v[i]),
                    ] {
                        assert!(
                            (a - b).abs() <= ulp(a.abs().max(b.abs())),
                            "{} n={n} decoupled={decoupled} {name}[{i}]: {a} vs fused scalar {b}",
                            isa.name()
                        );
                    }
                }
                // The kernel really updated something (a no-op would pass the comparison).
                if n > 0 {
                    assert_ne!(got.p, before.p);
                }
            }
        }
    }
}

/// PyTorch's Adam/AdamW in float64: the independent reference.
#[allow(clippy::too_many_arguments)]
fn adam_f64(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], lr: f64, wd: f64, decoupled: bool, step: i32) {
    let (b1, b2, eps) = (0.9_f64, 0.999_f64, 1e-8_f64);
    let bc1 = 1.0 - b1.powi(step);
    let bc2 = 1.0 - b2.powi(step);
    for i in 0..p.len() {
        let mut gi = g[i];
        if decoupled {
            p[i] *= 1.0 - lr * wd;
        } else {
            gi += wd * p[i];
        }
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let denom = v[i].sqrt() / bc2.sqrt() + eps;
        p[i] -= lr / bc1 * m[i] / denom;
    }
}

#[test]
fn every_isa_tracks_a_float64_reference_over_five_steps() {
    for isa in Isa::available() {
        for &n in &[1usize, 17, 1031, 200_003] {
            for decoupled in [false, true] {
                let start = state(n, 11);
                let (mut p, mut m, mut v) = (start.p.clone(), vec![0.0; n], vec![0.0; n]);
                let mut p64: Vec<f64> = start.p.iter().map(|&x| x as f64).collect();
                let mut largest = p64.iter().map(|x| x.abs()).collect::<Vec<_>>();
                let (mut m64, mut v64) = (vec![0.0; n], vec![0.0; n]);
                for step in 1..=5 {
                    let g = random(n, 100 + step);
                    let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                    let lr = 1e-2 * step as f64;
                    let s = AdamScalars::new(lr, 0.9, 0.999, 1e-8, 0.1, decoupled, true, step);
                    adam_step(isa, &mut p, &g, &mut m, &mut v, HalfCopy::None, &s).unwrap();
                    adam_f64(&mut p64, &g64, &mut m64, &mut v64, lr, 0.1, decoupled, step as i32);
                    for (l, x) in largest.iter_mut().zip(&p64) {
                        *l = l.max(x.abs());
                    }
                }
                for i in 0..n {
                    // Relative to the parameter's largest magnitude over the run, or the largest
                    // step (lr: Adam's normalised update is about lr) where the parameter stays
                    // near zero: the f32 rounding of those larger quantities remains.
                    let err = (p[i] as f64 - p64[i]).abs();
                    let scale = largest[i].max(0.05);
                    assert!(
                        err <= 1e-6 * scale,
                        "{} n={n} decoupled={decoupled} p[{i}] = {} vs f64 {}",
                        isa.name(),
                        p[i],
                        p64[i]
                    );
                    let err_v = (v[i] as f64 - v64[i]).abs();
                    assert!(
                        err_v <= 1e-6 * v64[i].abs() + 1e-12,
                        "v[{i}] = {} vs f64 {}",
                        v[i],
                        v64[i]
                    );
                }
            }
        }
    }
}

#[test]
fn fused_copy_back_rounds_to_nearest_even_on_every_isa() {
    for isa in Isa::available() {
        for &n in &LENGTHS {
            let s = scalars(true);
            let mut a = state(n, 3);
            let mut b16 = vec![bf16::ZERO; n];
            adam_step(isa, &mut a.p, &a.g, &mut a.m, &mut a.v, HalfCopy::Bf16(&mut b16), &s).unwrap();
            let mut b = state(n, 3);
            let mut h16 = vec![f16::ZERO; n];
            adam_step(isa, &mut b.p, &b.g, &mut b.m, &mut b.v, HalfCopy::F16(&mut h16), &s).unwrap();
            for i in 0..n {
                // half's conversions are the reference for round-to-nearest-even.
                assert_eq!(b16[i], bf16::from_f32(a.p[i]), "{} bf16 n={n} [{i}]", isa.name());
                assert_eq!(h16[i], f16::from_f32(b.p[i]), "{} f16 n={n} [{i}]", isa.name());
            }
            assert_eq!(a.p, b.p, "the copy-back must not change the fp32 result");
        }
    }
}

#[test]
fn copy_back_handles_ties_overflow_subnormals_and_nan() {
    // Parameters chosen so that a zero-gradient step with lr 0 leaves them unchanged and the
    // copy-back sees exactly these values.
    let specials: Vec<f32> = vec![
        1.0,
        f32::from_bits(0x3F80_8000), // exact bf16 tie, rounds down to even
        f32::from_bits(0x3F81_8000), // exact bf16 tie, rounds up to even
        f32::from_bits(0x3F80_8001), // just above a tie
        f32::MAX,                    // rounds to +inf in both 16-bit formats
        -f32::MAX,
        1e-40,   // f32 subnormal
        6.0e-8,  // f16 subnormal
        65520.0, // f16 overflow tie
        -0.0,
        f32::NAN,
        3.25159,
        -2.61828,
        1e-20,
        12345.678,
    ];
    let s = AdamScalars::new(0.0, 0.9, 0.999, 1e-8, 0.0, true, true, 1);
    for isa in Isa::available() {
        // Repeat so that every value sits in a SIMD lane and in a tail position.
        let p0: Vec<f32> = specials.iter().cycle().take(specials.len() * 5).copied().collect();
        let n = p0.len();
        let (g, mut m, mut v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let mut p = p0.clone();
        let mut b16 = vec![bf16::ZERO; n];
        adam_step(isa, &mut p, &g, &mut m, &mut v, HalfCopy::Bf16(&mut b16), &s).unwrap();
        let mut p = p0.clone();
        let mut h16 = vec![f16::ZERO; n];
        adam_step(isa, &mut p, &g, &mut m, &mut v, HalfCopy::F16(&mut h16), &s).unwrap();
        for i in 0..n {
            let x = p0[i];
            if x.is_nan() {
                assert!(b16[i].is_nan() && h16[i].is_nan(), "{} NaN at {i}", isa.name());
            } else {
                assert_eq!(b16[i].to_bits(), bf16::from_f32(x).to_bits(), "{} bf16 {x}", isa.name());
                assert_eq!(h16[i].to_bits(), f16::from_f32(x).to_bits(), "{} f16 {x}", isa.name());
            }
        }
    }
}

#[test]
fn mismatched_lengths_are_an_error_not_a_panic() {
    let s = scalars(true);
    let (mut p, g, mut m, mut v) = (vec![0.0; 8], vec![0.0; 7], vec![0.0; 8], vec![0.0; 8]);
    let err = adam_step(Isa::detect(), &mut p, &g, &mut m, &mut v, HalfCopy::None, &s).unwrap_err();
    assert!(err.to_string().contains("grads has 7 elements"), "{err}");
    let mut out = vec![bf16::ZERO; 9];
    let g = vec![0.0; 8];
    let err = adam_step(Isa::detect(), &mut p, &g, &mut m, &mut v, HalfCopy::Bf16(&mut out), &s).unwrap_err();
    assert!(err.to_string().contains("16-bit"), "{err}");
}

#[test]
fn thread_count_does_not_change_the_result() {
    let n = 300_001;
    let s = scalars(true);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut st = state(n, 5);
        pool.install(|| {
            adam_step(
                Isa::detect(),
                &mut st.p,
                &st.g,
                &mut st.m,
                &mut st.v,
                HalfCopy::None,
                &s,
            )
        })
        .unwrap();
        st.p
    };
    assert_eq!(run(1), run(3));
}

/// The engine runs the SIMD kernel that measures fastest (`Isa::fastest`), which is safe only
/// because every SIMD kernel gives the same bits: two ranks, or two runs, that measure
/// differently still compute the same step. Reference: the kernels against each other, bit for
/// bit, over a five-step trajectory with the 16-bit copy-back.
#[test]
fn the_simd_kernels_give_the_same_bits_so_the_measured_choice_changes_nothing() {
    let simd: Vec<Isa> = Isa::available().into_iter().filter(|&i| i != Isa::Scalar).collect();
    let chosen = Isa::fastest();
    assert!(chosen.is_supported(), "{}", chosen.name());
    if simd.is_empty() {
        assert_eq!(chosen, Isa::Scalar);
        return;
    }
    assert!(simd.contains(&chosen), "{} chosen among {simd:?}", chosen.name());
    let (measured, times) = Isa::measure_fastest(1 << 16, 1);
    assert!(simd.contains(&measured));
    if simd.len() > 1 {
        assert_eq!(times.len(), simd.len());
        assert!(times.iter().all(|(_, t)| t.is_finite() && *t > 0.0), "{times:?}");
    }
    let trajectory = |isa: Isa| {
        let mut st = state(200_003, 11);
        let mut out = vec![bf16::ZERO; st.p.len()];
        for step in 1..=5u64 {
            let s = AdamScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.01, true, true, step);
            adam_step(
                isa,
                &mut st.p,
                &st.g,
                &mut st.m,
                &mut st.v,
                HalfCopy::Bf16(&mut out),
                &s,
            )
            .unwrap();
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        (
            bits(&st.p),
            bits(&st.m),
            bits(&st.v),
            out.iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
        )
    };
    let first = trajectory(simd[0]);
    for &isa in &simd[1..] {
        assert!(trajectory(isa) == first, "{} and {} differ", isa.name(), simd[0].name());
    }
}
