//! LAMB and Lion against float64 implementations of their published formulas written here, and
//! sharded LAMB (parameters cut across ranks, partial norms summed as an all-reduce would)
//! against the same model on one rank.

use zero_core::optim::HalfCopy;
use zero_core::optim::{
    build, LambSpec, LambVariant, LionSpec, NormPartials, OptimizerSpec, Segment, ShardOptimizer, ShardSegments,
};

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

/// Three parameter tensors laid out back to back, as a flat buffer.
const SIZES: [usize; 3] = [10, 7, 13];

fn spec() -> LambSpec {
    LambSpec {
        weight_decay: 0.01,
        max_coeff: 10.0,
        min_coeff: 0.01,
        ..LambSpec::default()
    }
}

/// LAMB in float64 on whole tensors: the reference. `Paper` follows You et al. (bias-corrected
/// moments inside the update); `DeepSpeed` follows DeepSpeed's FusedLamb CUDA kernel (raw
/// moments in the update and the trust ratio, lr·sqrt(bc2)/bc1 as the step size).
fn lamb_f64(variant: LambVariant, params: &mut [f64], m: &mut [f64], v: &mut [f64], grads: &[f64], lr: f64, t: i32) {
    let s = spec();
    let (b1, b2) = s.betas;
    let mut offset = 0;
    for &n in &SIZES {
        let r = offset..offset + n;
        let mut u = vec![0.0; n];
        for (k, i) in r.clone().enumerate() {
            m[i] = b1 * m[i] + (1.0 - b1) * grads[i];
            v[i] = b2 * v[i] + (1.0 - b2) * grads[i] * grads[i];
            u[k] = match variant {
                LambVariant::Paper => {
                    let mh = m[i] / (1.0 - b1.powi(t));
                    let vh = v[i] / (1.0 - b2.powi(t));
                    mh / (vh.sqrt() + s.eps) + s.weight_decay * params[i]
                }
                LambVariant::DeepSpeed => m[i] / (v[i].sqrt() + s.eps) + s.weight_decay * params[i],
            };
        }
        let wn = params[r.clone()].iter().map(|x| x * x).sum::<f64>().sqrt();
        let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
        let ratio = if wn > 0.0 && un > 0.0 {
            (wn / un).clamp(s.min_coeff, s.max_coeff)
        } else {
            1.0
        };
        let step_size = match variant {
            LambVariant::Paper => lr,
            LambVariant::DeepSpeed => lr * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t)),
        };
        for (k, i) in r.enumerate() {
            params[i] -= step_size * ratio * u[k];
        }
        offset += n;
    }
}

fn whole_segments() -> ShardSegments {
    let mut segments = Vec::new();
    let mut offset = 0;
    for (id, &n) in SIZES.iter().enumerate() {
        segments.push(Segment {
            param_id: id,
            range: offset..offset + n,
        });
        offset += n;
    }
    ShardSegments {
        num_params: SIZES.len(),
        segments,
    }
}

/// The segments of rank `rank`'s shard when the flat buffer (padded to a multiple of `world`)
/// is cut into `world` equal shards.
fn shard_segments(world: usize, rank: usize) -> (std::ops::Range<usize>, ShardSegments) {
    let total: usize = SIZES.iter().sum();
    let shard = total.div_ceil(world);
    let (lo, hi) = (rank * shard, (rank + 1) * shard);
    let mut segments = Vec::new();
    let mut offset = 0;
    for (id, &n) in SIZES.iter().enumerate() {
        let (s, e) = (offset.max(lo), (offset + n).min(hi));
        if s < e {
            segments.push(Segment {
                param_id: id,
                range: s - lo..e - lo,
            });
        }
        offset += n;
    }
    (
        lo..hi,
        ShardSegments {
            num_params: SIZES.len(),
            segments,
        },
    )
}

#[test]
fn lamb_matches_a_float64_reference_per_tensor_in_both_forms() {
    let total: usize = SIZES.iter().sum();
    let mut finals = Vec::new();
    for variant in [LambVariant::Paper, LambVariant::DeepSpeed] {
        let mut p = random(total, 1);
        let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let (mut m64, mut v64) = (vec![0.0; total], vec![0.0; total]);
        let spec = LambSpec { variant, ..spec() };
        let mut opt = build(&OptimizerSpec::Lamb(spec), total, whole_segments()).unwrap();
        assert!(opt.needs_cross_rank_norms());
        for t in 1..=5 {
            let g: Vec<f32> = random(total, 10 + t as u64).iter().map(|x| x * 0.1).collect();
            let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            opt.step(&mut p, &g, 0.01).unwrap();
            lamb_f64(variant, &mut p64, &mut m64, &mut v64, &g64, 0.01, t);
        }
        for i in 0..total {
            assert!(
                (p[i] as f64 - p64[i]).abs() <= 1e-6 * p64[i].abs().max(0.05),
                "{variant:?} p[{i}] = {} vs f64 {}",
                p[i],
                p64[i]
            );
        }
        finals.push(p);
    }
    // The two forms really differ (else the test could not tell them apart).
    assert_ne!(finals[0], finals[1]);
}

#[test]
fn sharded_lamb_with_summed_partials_equals_one_rank() {
    let total: usize = SIZES.iter().sum();
    let p0 = random(total, 2);
    let mut single = p0.clone();
    let mut one = build(&OptimizerSpec::Lamb(spec()), total, whole_segments()).unwrap();
    for world in [2usize, 3, 4] {
        let shard_len = total.div_ceil(world);
        let mut shards: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                let mut s = vec![0.0; shard_len];
                for (k, i) in (r * shard_len..(r + 1) * shard_len).enumerate() {
                    if i < total {
                        s[k] = p0[i];
                    }
                }
                s
            })
            .collect();
        let mut opts: Vec<Box<dyn ShardOptimizer>> = (0..world)
            .map(|r| build(&OptimizerSpec::Lamb(spec()), shard_len, shard_segments(world, r).1).unwrap())
            .collect();
        let mut reference = p0.clone();
        let mut ref_opt = build(&OptimizerSpec::Lamb(spec()), total, whole_segments()).unwrap();
        for t in 1..=4u64 {
            let g = random(total, 20 + t);
            ref_opt.step(&mut reference, &g, 0.02).unwrap();
            let shard_grads: Vec<Vec<f32>> = (0..world)
                .map(|r| {
                    (r * shard_len..(r + 1) * shard_len)
                        .map(|i| if i < total { g[i] } else { 0.0 })
                        .collect()
                })
                .collect();
            // Phase 1 on every rank, then the all-reduce (sum), then phase 2.
            let mut totals = NormPartials::zeros(SIZES.len());
            let partials: Vec<NormPartials> = (0..world)
                .map(|r| opts[r].begin_step(&shards[r], &shard_grads[r]).unwrap())
                .collect();
            for part in &partials {
                totals.add_assign(part);
            }
            for r in 0..world {
                opts[r]
                    .finish_step(&mut shards[r], &shard_grads[r], 0.02, &totals, HalfCopy::None)
                    .unwrap();
            }
            // Local norms alone would give a different answer: the test can tell.
            if t == 1 && world == 2 {
                assert_ne!(partials[0], totals);
            }
        }
        let gathered: Vec<f32> = shards.concat();
        for i in 0..total {
            assert!(
                (gathered[i] - reference[i]).abs() <= 1e-6 * reference[i].abs().max(1e-2),
                "world {world} p[{i}] = {} vs one rank {}",
                gathered[i],
                reference[i]
            );
        }
        // Padding stays zero.
        assert!(gathered[total..].iter().all(|&x| x == 0.0));
    }
    one.step(&mut single, &random(total, 21), 0.02).unwrap();
    assert_ne!(single, p0);
}

#[test]
fn lamb_phases_out_of_order_are_errors() {
    let mut opt = build(&OptimizerSpec::Lamb(spec()), 30, whole_segments()).unwrap();
    let mut p = random(30, 3);
    let g = random(30, 4);
    let err = opt
        .finish_step(&mut p, &g, 0.1, &NormPartials::zeros(3), HalfCopy::None)
        .unwrap_err();
    assert!(err.to_string().contains("before begin_step"), "{err}");
    let partials = opt.begin_step(&p, &g).unwrap();
    assert_eq!(partials.num_params(), 3);
    assert!(opt.begin_step(&p, &g).is_err());
    let err = opt
        .finish_step(&mut p, &g, 0.1, &NormPartials::zeros(2), HalfCopy::None)
        .unwrap_err();
    assert!(err.to_string().contains("expected 6"), "{err}");
}

#[test]
fn overlapping_segments_are_rejected() {
    let segments = ShardSegments {
        num_params: 2,
        segments: vec![
            Segment {
                param_id: 0,
                range: 0..6,
            },
            Segment {
                param_id: 1,
                range: 5..9,
            },
        ],
    };
    let err = build(&OptimizerSpec::Lamb(spec()), 10, segments).unwrap_err();
    assert!(err.to_string().contains("overlaps"), "{err}");
}

/// Lion in float64 (the paper's update): the reference.
fn lion_f64(p: &mut [f64], m: &mut [f64], g: &[f64], lr: f64, wd: f64, b1: f64, b2: f64) {
    for i in 0..p.len() {
        let c = b1 * m[i] + (1.0 - b1) * g[i];
        p[i] = p[i] * (1.0 - lr * wd) - lr * c.signum() * (c != 0.0) as i32 as f64;
        m[i] = b2 * m[i] + (1.0 - b2) * g[i];
    }
}

#[test]
fn lion_matches_a_float64_reference() {
    let n = 200_001; // more than one parallel chunk
    let spec = LionSpec {
        lr: 1e-4,
        betas: (0.9, 0.99),
        weight_decay: 0.1,
    };
    let mut p = random(n, 5);
    let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    let mut m64 = vec![0.0; n];
    let mut opt = build(&OptimizerSpec::Lion(spec.clone()), n, ShardSegments::single(n)).unwrap();
    for t in 0..5 {
        let mut g = random(n, 50 + t);
        g[0] = 0.0; // sign(0) = 0 on the first step
        let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
        opt.step(&mut p, &g, 1e-3).unwrap();
        lion_f64(&mut p64, &mut m64, &g64, 1e-3, 0.1, 0.9, 0.99);
    }
    for i in 0..n {
        assert!(
            (p[i] as f64 - p64[i]).abs() <= 1e-6 * p64[i].abs().max(0.01),
            "p[{i}] = {} vs f64 {}",
            p[i],
            p64[i]
        );
    }
    assert_eq!(opt.state()[0].0, "exp_avg");
}

/// A tensor spanning many parallel chunks: the partial ‖p‖² equals a float64 sum, and the result
/// does not depend on the number of threads (chunk sums are added in a fixed order).
#[test]
fn large_lamb_segments_are_exact_and_independent_of_thread_count() {
    let n = 300_007;
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut opt = build(&OptimizerSpec::Lamb(spec()), n, ShardSegments::single(n)).unwrap();
            let mut p = random(n, 8);
            let g = random(n, 9);
            let partials = opt.begin_step(&p, &g).unwrap();
            let w2: f64 = random(n, 8).iter().map(|&x| (x as f64) * (x as f64)).sum();
            assert!(((partials.weight_sq(0) as f64) - w2).abs() <= 1e-6 * w2);
            opt.finish_step(&mut p, &g, 0.01, &partials, HalfCopy::None).unwrap();
            (partials, p)
        })
    };
    let (a, pa) = run(1);
    let (b, pb) = run(3);
    assert_eq!(a, b);
    assert_eq!(pa, pb);
    assert_ne!(pa, random(n, 8));
}
