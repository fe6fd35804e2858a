//! The estimate against the ZeRO paper's example, hand-counted bytes per parameter, a simulated
//! prefetch schedule and transformers' parameter counts; and its errors.

use super::*;

/// The prefetch schedule over `order` (indices into `sizes`; a unit may come twice): at
/// each use, the gathers of the next uses are started while less than `budget` is in
/// flight; a unit already held (in use, or started) is not gathered again. The most held
/// is the unit in use and the distinct units in flight beside it.
fn simulated_peak(sizes: &[u64], order: &[usize], budget: u64) -> u64 {
    let (mut next, mut peak) = (0usize, 0u64);
    for (i, &unit) in order.iter().enumerate() {
        next = next.max(i + 1);
        let in_flight = |next: usize| {
            let mut ahead: Vec<usize> = order[i + 1..next].iter().copied().filter(|&u| u != unit).collect();
            ahead.sort_unstable();
            ahead.dedup();
            ahead.iter().map(|&u| sizes[u]).sum::<u64>()
        };
        while next < order.len() && in_flight(next) < budget {
            next += 1;
        }
        peak = peak.max(sizes[unit] + in_flight(next));
    }
    peak
}

/// Reference: the schedule simulated over pseudo-random unit lists (forward, then the
/// reversed order of backward) and budgets, each list in several orders. The bound holds
/// for every order, and a bound loose by more than the largest unit would be useless.
#[test]
fn the_prefetch_bound_holds_for_every_order_the_schedule_may_see() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    };
    for _ in 0..500 {
        let n = 1 + next(8) as usize;
        let units: Vec<u64> = (0..n).map(|_| 1 + next(100)).collect();
        let budget = next(250);
        let bound = gathered_with_prefetch(&units, budget);
        let largest = *units.iter().max().unwrap();
        let mut worst = 0;
        let mut order: Vec<usize> = (0..n).collect();
        for _ in 0..6 {
            let mut pass = order.clone();
            pass.extend(order.iter().rev());
            worst = worst.max(simulated_peak(&units, &pass, budget));
            order.rotate_left(1 + next(n as u64) as usize % n);
            order.swap(0, next(n as u64) as usize);
        }
        assert!(
            worst <= bound,
            "{units:?} budget {budget}: simulated {worst} > bound {bound}"
        );
        assert!(
            bound <= worst + largest + budget,
            "{units:?} budget {budget}: bound {bound}"
        );
        if budget == 0 {
            assert_eq!(bound, largest);
        }
    }
    // Two units of 10 with a large budget: the other is all there is to prefetch.
    assert_eq!(gathered_with_prefetch(&[10, 10], 100), 20);
}

/// Reference: GPT-2 small's units by hand, E = (50257 + 1024)·768 = 39 383 808 and a block
/// B = 7 087 872: with DeepSpeed's budget 5e7 the embeddings in use and blocks in flight
/// (started while fewer than 5e7 are: at most 5e7 + B), or a block with the budget and the
/// embeddings beside it, both E + 5e7 + B; without prefetch (or on one device) E alone. The
/// counted form equals the list of every unit.
#[test]
fn gpt2_gathers_one_unit_and_the_prefetch_budget() {
    let small = Gpt2Shape::preset("gpt2").unwrap();
    assert_eq!((small.embed_params(), small.block_params()), (39_383_808, 7_087_872));
    assert_eq!(
        small.gathered_at_once(DEFAULT_PREFETCH_BUCKET),
        39_383_808 + 50_000_000 + 7_087_872
    );
    assert_eq!(small.gathered_at_once(0), 39_383_808);
    let on = |devices| {
        small
            .input(&EstimateInput::new(0, 3, devices, Dtype::Bf16))
            .gathered_at_once
    };
    assert_eq!(on(1), Some(39_383_808));
    assert_eq!(on(8), Some(96_471_680));
    for name in GPT2_PRESETS {
        let shape = Gpt2Shape::preset(name).unwrap();
        let mut units = vec![shape.embed_params()];
        units.extend(std::iter::repeat_n(shape.block_params(), shape.n_layer as usize));
        for budget in [
            0,
            1,
            shape.block_params(),
            shape.embed_params() + 1,
            DEFAULT_PREFETCH_BUCKET,
            u64::MAX / 4,
        ] {
            assert_eq!(
                shape.gathered_at_once(budget),
                gathered_with_prefetch(&units, budget),
                "{name} budget {budget}"
            );
        }
    }
}

// Reference: the ZeRO paper's Figure 1 example, Ψ = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB,
// 16.6 GB, 1.9 GB per device.
#[test]
fn paper_example() {
    let psi = 7_500_000_000;
    let gb = |s: u8| {
        estimate(&EstimateInput::new(psi, s, 64, Dtype::Fp16))
            .unwrap()
            .per_device
            .total() as f64
            / 1e9
    };
    assert_eq!(gb(0), 120.0);
    assert!((gb(1) - 31.4).abs() < 0.05, "{}", gb(1));
    assert!((gb(2) - 16.6).abs() < 0.05, "{}", gb(2));
    assert!((gb(3) - 1.875).abs() < 0.001, "{}", gb(3));
}

/// Reference: what the optimizer's memory report counts for an fp32 run (BENCHMARKS.md's
/// "+ master" column: the masters are a copy beside the parameters).
#[test]
fn fp32_is_4_4_12() {
    let e = estimate(&EstimateInput::new(1000, 0, 1, Dtype::Fp32)).unwrap();
    assert_eq!(
        e.per_device,
        StateBytes {
            parameters: 4000,
            gradients: 4000,
            optimizer_state: 12000,
            gathered: 0
        }
    );
}

#[test]
fn offload_moves_the_optimizer_and_grad_shard_to_the_host() {
    let mut input = EstimateInput::new(800, 2, 4, Dtype::Bf16);
    input.offload_optimizer = Some(OffloadTarget::Cpu);
    let e = estimate(&input).unwrap();
    // The bf16 gradient shard stays on the device from backward until the step.
    assert_eq!(
        e.per_device,
        StateBytes {
            parameters: 1600,
            gradients: 400,
            ..Default::default()
        }
    );
    // 4 devices' shards: 12·800/4 optimizer + 4·800/4 fp32 grads each.
    assert_eq!(
        e.per_host,
        StateBytes {
            gradients: 3200,
            optimizer_state: 9600,
            ..Default::default()
        }
    );
    input.offload_optimizer = Some(OffloadTarget::Nvme);
    input.stage = 3;
    input.offload_param = Some(OffloadTarget::Nvme);
    let e = estimate(&input).unwrap();
    assert_eq!(e.per_device.total(), 400);
    assert_eq!(e.per_node_nvme.optimizer_state, 9600);
    assert_eq!(e.per_node_nvme.parameters, 1600);
    assert_eq!(e.per_host.gradients, 3200);
}

// Reference: the swap files of an fp32 gpt2-xl run with both offloads on NVMe
// (BENCHMARKS.md): 18,691,334,400 bytes of masters and moments (12Ψ) and 6,230,444,800
// bytes of parameter shards (4Ψ), Ψ = 1,557,611,200.
#[test]
fn fp32_offload_moves_masters_with_the_moments() {
    let psi = 1_557_611_200;
    let mut input = EstimateInput::new(psi, 3, 1, Dtype::Fp32);
    input.offload_optimizer = Some(OffloadTarget::Nvme);
    input.offload_param = Some(OffloadTarget::Nvme);
    let e = estimate(&input).unwrap();
    assert_eq!(e.per_node_nvme.optimizer_state, 18_691_334_400);
    assert_eq!(e.per_node_nvme.parameters, 6_230_444_800);
    // What stays on the device: the fp32 gradient shard, from backward until the step.
    assert_eq!(e.per_device.total(), 4 * psi);
    // Without offload the masters and moments stay on the device: 12 bytes.
    let plain = estimate(&EstimateInput::new(psi, 3, 1, Dtype::Fp32)).unwrap();
    assert_eq!(plain.per_device.optimizer_state, 12 * psi);
}

// Reference: GPT2LMHeadModel(GPT2Config(...)).num_parameters() in transformers (tied head).
#[test]
fn gpt2_presets_count_like_transformers() {
    let count = |n: &str| Gpt2Shape::preset(n).map(|s| s.num_params());
    assert_eq!(count("tiny"), Some(6_960_768));
    assert_eq!(count("gpt2"), Some(124_439_808));
    assert_eq!(count("gpt2-medium"), Some(354_823_168));
    assert_eq!(count("gpt2-large"), Some(774_030_080));
    assert_eq!(count("gpt2-xl"), Some(1_557_611_200));
    assert_eq!(count("gpt2-10b"), Some(10_279_047_168));
    assert_eq!(count("gpt3"), None);
}

#[test]
fn shaped_names_read_back_and_match_the_presets() {
    // The 10B preset is the shaped model of its depth and width.
    assert_eq!(Gpt2Shape::preset("gpt2-50x4096"), Gpt2Shape::preset("gpt2-10b"));
    let s = Gpt2Shape::preset("gpt2-7x1600").unwrap();
    assert_eq!((s.n_layer, s.n_embd, s.n_head), (7, 1600, 25));
    assert_eq!(Gpt2Shape::preset(&s.shaped_name()), Some(s));
    // Each shape has one name: no sign, no leading zero.
    for bad in [
        "gpt2-0x4096",
        "gpt2-4x100",
        "gpt2-4x",
        "gpt2-x64",
        "gpt3-4x64",
        "gpt2-+1x64",
        "gpt2-01x064",
    ] {
        assert_eq!(Gpt2Shape::preset(bad), None, "{bad}");
    }
}

#[test]
fn deepest_fitting_is_the_last_depth_under_the_limits() {
    // Reference: the estimate itself, one depth deeper must break a limit.
    let mut input = EstimateInput::new(0, 3, 1, Dtype::Bf16);
    input.offload_optimizer = Some(OffloadTarget::Cpu);
    let (host, device) = (128u64 << 30, 80u64 << 30);
    let best = Gpt2Shape::deepest_fitting(4096, &input, host, device).expect("some depth fits");
    let bytes = |layers: u64| {
        let shape = Gpt2Shape::shaped(layers, 4096).unwrap();
        estimate(&shape.input(&input)).unwrap()
    };
    let at = bytes(best.n_layer);
    assert!(at.per_host.total() <= host && at.per_device.total() <= device);
    let deeper = bytes(best.n_layer + 1);
    assert!(deeper.per_host.total() > host || deeper.per_device.total() > device);
    // 16 bytes of host state per parameter under 128 GiB: about 8.6B parameters.
    assert!(
        (8_000_000_000..8_600_000_000).contains(&best.num_params()),
        "{}",
        best.num_params()
    );
    assert!(matches!(
        Gpt2Shape::deepest_fitting(4096, &input, 1 << 30, device),
        Err(FitError::NothingFits { host_bytes, .. }) if host_bytes == bytes(1).per_host.total()
    ));
}

#[test]
fn a_limit_that_bounds_nothing_is_an_error_not_the_search_cap() {
    // Stage 3 without offload holds no model state in host memory: any host limit "fits"
    // every depth, so no depth may be claimed.
    let input = EstimateInput::new(0, 3, 1, Dtype::Bf16);
    assert_eq!(
        Gpt2Shape::deepest_fitting(4096, &input, 1024, u64::MAX),
        Err(FitError::Unbounded)
    );
    // A device limit bounds it.
    let shape = Gpt2Shape::deepest_fitting(4096, &input, 1024, 80 << 30).unwrap();
    assert!(shape.n_layer >= 1 && shape.num_params() < 80 << 30, "{shape:?}");
    assert_eq!(
        Gpt2Shape::deepest_fitting(100, &input, 1024, 1 << 30),
        Err(FitError::BadHidden(100))
    );
}

#[test]
fn counts_past_2_pow_64_are_errors_naming_the_input() {
    // 16 bytes × 2^60 parameters wrapped to 0 before.
    let e = estimate(&EstimateInput::new(1 << 60, 0, 1, Dtype::Bf16)).unwrap_err();
    assert!(
        matches!(e, EstimateError::Overflow { input: "params", value, .. } if value == 1 << 60),
        "{e}"
    );
    let mut input = EstimateInput::new(1 << 40, 3, 1 << 63, Dtype::Bf16);
    input.offload_optimizer = Some(OffloadTarget::Cpu);
    let e = estimate(&input).unwrap_err();
    assert!(
        matches!(
            e,
            EstimateError::Overflow {
                input: "gpus_per_node",
                ..
            }
        ),
        "{e}"
    );
    input.nodes = 3;
    let e = estimate(&input).unwrap_err();
    assert!(matches!(e, EstimateError::Overflow { input: "nodes", .. }), "{e}");
    // Sums are checked too: each part fits, their total does not.
    let e = estimate(&EstimateInput::new(u64::MAX / 14, 0, 1, Dtype::Bf16)).unwrap_err();
    assert!(matches!(e, EstimateError::Overflow { .. }), "{e}");
    // A GPT-2 shape whose count passes 2^64 does not exist.
    assert_eq!(Gpt2Shape::shaped(1, 1 << 40), None);
    assert_eq!(Gpt2Shape::shaped(u64::MAX, 4096), None);
    assert_eq!(Gpt2Shape::preset("gpt2-1x18446744073709551552"), None);
}
