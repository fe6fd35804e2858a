//! Checkpoint state of every optimizer: restoring the named buffers and the step into a fresh
//! optimizer continues the run bit for bit (the reference is the uninterrupted run), and
//! malformed state is refused with an error that names the buffer.

use half::bf16;
use zero_core::optim::{build, AdamSpec, HalfCopy, LambSpec, LionSpec, OptimizerSpec, SgdSpec, ShardSegments};

fn specs() -> Vec<OptimizerSpec> {
    vec![
        OptimizerSpec::adam(),
        OptimizerSpec::adamw(),
        OptimizerSpec::Adam(AdamSpec {
            amsgrad: true,
            ..AdamSpec::adam()
        }),
        OptimizerSpec::Sgd(SgdSpec {
            momentum: 0.9,
            nesterov: true,
            ..SgdSpec::default()
        }),
        OptimizerSpec::Sgd(SgdSpec::default()),
        OptimizerSpec::Lamb(LambSpec::default()),
        OptimizerSpec::Lion(LionSpec::default()),
    ]
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2000) as f32 / 1000.0 - 1.0)
        .collect()
}

#[test]
fn restored_state_continues_the_run_exactly() {
    let n = 1001;
    for spec in specs() {
        let mut straight = build(&spec, n, ShardSegments::single(n)).unwrap();
        let mut p_straight = data(n, 1);
        let mut first = build(&spec, n, ShardSegments::single(n)).unwrap();
        let mut p_resumed = data(n, 1);
        for t in 0..3 {
            straight.step(&mut p_straight, &data(n, 10 + t), 1e-2).unwrap();
            first.step(&mut p_resumed, &data(n, 10 + t), 1e-2).unwrap();
        }
        let saved: Vec<(String, Vec<f32>)> = first
            .state()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_vec()))
            .collect();
        let step = first.step_count();
        assert_eq!(step, 3);
        assert_eq!(
            first.state_bytes(),
            saved.iter().map(|(_, v)| v.len() * 4).sum::<usize>()
        );
        let mut resumed = build(&spec, n, ShardSegments::single(n)).unwrap();
        let borrowed: Vec<(&str, &[f32])> = saved.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        resumed.load_state(step, &borrowed).unwrap();
        for t in 3..5 {
            straight.step(&mut p_straight, &data(n, 10 + t), 1e-2).unwrap();
            resumed.step(&mut p_resumed, &data(n, 10 + t), 1e-2).unwrap();
        }
        assert_eq!(p_straight, p_resumed, "{}", resumed.name());
        assert_eq!(resumed.step_count(), 5);
    }
}

#[test]
fn malformed_state_is_refused_and_named() {
    let n = 16;
    let mut adam = build(&OptimizerSpec::adamw(), n, ShardSegments::single(n)).unwrap();
    let good = vec![0.5_f32; n];
    let short = vec![0.5_f32; n - 1];

    let err = adam.load_state(1, &[("exp_avg", &good)]).unwrap_err();
    assert!(err.to_string().contains("`exp_avg_sq` is missing"), "{err}");

    let err = adam
        .load_state(1, &[("exp_avg", &good), ("exp_avg_sq", &short)])
        .unwrap_err();
    assert!(err.to_string().contains("exp_avg_sq` has 15 elements"), "{err}");

    let err = adam
        .load_state(
            1,
            &[("exp_avg", &good), ("exp_avg_sq", &good), ("momentum_buffer", &good)],
        )
        .unwrap_err();
    assert!(err.to_string().contains("`momentum_buffer` is not kept"), "{err}");

    // Nothing was written by the failed loads.
    assert_eq!(adam.step_count(), 0);
    assert!(adam.state().iter().all(|(_, b)| b.iter().all(|&x| x == 0.0)));

    let err = adam.step(&mut vec![0.0; n + 1], &vec![0.0; n + 1], 1e-3).unwrap_err();
    assert!(err.to_string().contains("params has 17 elements"), "{err}");
    assert_eq!(adam.step_count(), 0, "a refused step must not count");
}

#[test]
fn invalid_settings_are_refused() {
    let bad = OptimizerSpec::Adam(AdamSpec {
        betas: (1.0, 0.999),
        ..AdamSpec::adam()
    });
    let err = build(&bad, 4, ShardSegments::single(4)).unwrap_err();
    assert!(err.to_string().contains("betas[0]"), "{err}");
    let bad = OptimizerSpec::Sgd(SgdSpec {
        nesterov: true,
        ..SgdSpec::default()
    });
    assert!(build(&bad, 4, ShardSegments::single(4)).is_err());
}

#[test]
fn every_optimizer_writes_the_16_bit_copy() {
    let n = 70_001;
    for spec in specs() {
        let mut opt = build(&spec, n, ShardSegments::single(n)).unwrap();
        let mut p = data(n, 3);
        let mut out = vec![bf16::ZERO; n];
        opt.step_with_copy(&mut p, &data(n, 4), 1e-2, HalfCopy::Bf16(&mut out))
            .unwrap();
        assert!(
            p.iter().zip(&out).all(|(&p, &o)| o == bf16::from_f32(p)),
            "{}",
            opt.name()
        );
        assert_ne!(p, data(n, 3));
    }
}

/// Every optimizer with betas takes new ones (a momentum-cycling schedule's) and steps with
/// them: the same as one built with those betas, not as one with its own; SGD has none.
#[test]
fn momentum_can_be_cycled() {
    let n = 8;
    let cycled = (0.85, 0.99);
    let specs = [
        OptimizerSpec::adam(),
        OptimizerSpec::Lamb(LambSpec::default()),
        OptimizerSpec::Lion(LionSpec::default()),
    ];
    for spec in specs {
        let mut with_cycled = spec.clone();
        assert!(with_cycled.set_betas(cycled));
        assert_eq!(with_cycled.betas(), Some(cycled));
        let mut own = build(&spec, n, ShardSegments::single(n)).unwrap();
        let mut set = build(&spec, n, ShardSegments::single(n)).unwrap();
        let mut built = build(&with_cycled, n, ShardSegments::single(n)).unwrap();
        assert!(set.set_betas(cycled));
        let (mut po, mut ps, mut pb) = (data(n, 1), data(n, 1), data(n, 1));
        // Each gradient -0.01 times the last: Lion's sign of β1·m + (1 - β1)·g turns between
        // betas (0.9, 0.999) and (0.85, 0.99) at the second step.
        for t in 0..3 {
            let g: Vec<f32> = data(n, 5 + t as u32).iter().map(|x| x * (-0.01f32).powi(t)).collect();
            own.step(&mut po, &g, 1e-2).unwrap();
            set.step(&mut ps, &g, 1e-2).unwrap();
            built.step(&mut pb, &g, 1e-2).unwrap();
        }
        assert_eq!(ps, pb, "{}: set betas step as built ones", own.name());
        assert_ne!(ps, po, "{}: set betas are used", own.name());
    }
    let mut plain = build(&OptimizerSpec::Sgd(SgdSpec::default()), n, ShardSegments::single(n)).unwrap();
    assert!(!plain.set_betas((0.9, 0.99)));
}
