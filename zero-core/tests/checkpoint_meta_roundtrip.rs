//! The metadata file reads back as exactly what was written, whatever the floats in it: every
//! f64 (the scheduler's `lr_next`, the loss scale, numbers inside the RNG and client state)
//! survives the write-then-parse round trip bit for bit, so the checksum recorded at save time
//! agrees with the content at load time. Reference: the values themselves, compared by bits.
//!
//! Non-finite numbers have no JSON form: saving one is refused, naming the field, before
//! anything is written.

mod checkpoint_support;

use checkpoint_support::*;
use serde_json::{json, Value};
use std::path::Path;
use zero_core::checkpoint::{self, CheckpointMeta, FileRecord, OptimizerRecord, SaveRequest};
use zero_core::loss_scaler::LossScalerState;
use zero_core::lr_schedule::LrScheduleSpec;

/// splitmix64: a tiny deterministic generator, so a failure replays from its case number.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A finite f64 from one of the families that trip decimal round trips.
    fn float(&mut self) -> f64 {
        let r = self.next();
        let sign = if r & 1 == 1 { -1.0 } else { 1.0 };
        match (r >> 1) % 9 {
            // Any finite bit pattern.
            0 => loop {
                let x = f64::from_bits(self.next());
                if x.is_finite() {
                    return x;
                }
            },
            // Subnormals, down to the smallest.
            1 => sign * f64::from_bits(self.next() & ((1 << 52) - 1)).max(f64::from_bits(1)),
            // Within a few thousand ulps of the largest finite value.
            2 => sign * f64::from_bits(f64::MAX.to_bits() - self.next() % 4096),
            // Fixed awkward values.
            3 => [
                1.0 / 3.0,
                0.1 + 0.2,
                -0.0,
                0.0,
                f64::MIN_POSITIVE,
                f64::EPSILON,
                f64::MAX,
                f64::MIN,
                2.0f64.powi(-1074),
                9007199254740993.0,
                3e-3,
                1e-8,
            ][(self.next() % 12) as usize],
            // A finite f32, widened (what a caller's f32 becomes in JSON).
            4 => loop {
                let x = f32::from_bits(self.next() as u32);
                if x.is_finite() {
                    return x as f64;
                }
            },
            // Learning-rate-like: a log warm-up or a linear decay of a small peak.
            5 => {
                let i = (self.next() % 10_000) as f64;
                3e-3 * (i + 1.0).ln() / 20f64.ln()
            }
            6 => 3e-3 * (300.0 - (self.next() % 300) as f64) / 280.0,
            // A short decimal divided by a power of ten.
            7 => sign * (self.next() % 1_000_000_007) as f64 / 10f64.powi((self.next() % 30) as i32),
            // Arbitrary magnitudes with full mantissas.
            _ => sign * f64::from_bits((self.next() >> 12) | (((self.next() % 2046) + 1) << 52)),
        }
    }
}

/// A world-`world` metadata with the given floats; file records are plausible but unchecked
/// (only the metadata's own round trip is under test).
fn meta(world: usize, lr_next: Option<f64>, scale: f64, rng: Value, client: Value) -> CheckpointMeta {
    let layout = layout(specs(""), world, 2);
    CheckpointMeta {
        format_version: 1,
        tag: "t".into(),
        stage: 2,
        world_size: world,
        global_step: 7,
        skipped_steps: 0,
        params: CheckpointMeta::param_records(&layout),
        layout,
        optimizer: OptimizerRecord {
            name: "adamw".into(),
            step: 7,
            state_names: vec!["exp_avg".into(), "exp_avg_sq".into()],
            param_steps: Vec::new(),
        },
        lr_next,
        loss_scaler: Some(LossScalerState {
            cur_scale: scale,
            cur_iter: 7,
            last_overflow_iter: -1,
            cur_hysteresis: 2,
            skipped_steps: 0,
        }),
        rng: Some(rng),
        client_state: client,
        model: None,
        tensor_parallel: None,
        files: (0..world)
            .map(|r| FileRecord {
                name: format!("rank_{r:05}.safetensors"),
                bytes: 100,
                crc32: 0xdead_beef,
                chunk_bytes: 4 << 20,
                chunk_crc32: vec![0xdead_beef],
            })
            .collect(),
        meta_crc32: None,
    }
}

/// Every number of `v` as (path, bits), so that -0.0 and 0.0 differ and so do off-by-an-ulp values.
fn number_bits(v: &Value, path: String, out: &mut Vec<(String, String)>) {
    match v {
        Value::Number(n) => out.push((
            path,
            match n.as_f64() {
                Some(f) if n.is_f64() => format!("f64 {:016x}", f.to_bits()),
                _ => format!("int {n}"),
            },
        )),
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                number_bits(x, format!("{path}[{i}]"), out);
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                number_bits(x, format!("{path}.{k}"), out);
            }
        }
        _ => {}
    }
}

/// Seals `m`, parses it back, and checks that every float came back with the same bits.
fn round_trip(case: &str, m: &CheckpointMeta) {
    let path = Path::new("zero_meta.json");
    let bytes = m
        .to_bytes()
        .unwrap_or_else(|e| panic!("{case}: finite values must seal: {e}"));
    let back = CheckpointMeta::from_bytes(path, &bytes)
        .unwrap_or_else(|e| panic!("{case}: the sealed metadata must verify: {e}"));
    assert_eq!(
        back.lr_next.map(f64::to_bits),
        m.lr_next.map(f64::to_bits),
        "{case}: lr_next"
    );
    let scale = |x: &CheckpointMeta| x.loss_scaler.map(|s| s.cur_scale.to_bits());
    assert_eq!(scale(&back), scale(m), "{case}: loss_scaler.cur_scale");
    for (name, a, b) in [
        ("rng", back.rng.as_ref(), m.rng.as_ref()),
        ("client_state", Some(&back.client_state), Some(&m.client_state)),
    ] {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        if let (Some(a), Some(b)) = (a, b) {
            number_bits(a, name.into(), &mut x);
            number_bits(b, name.into(), &mut y);
        }
        assert_eq!(x, y, "{case}: {name}");
    }
    assert_eq!(&back.layout, &m.layout, "{case}: layout");
}

#[test]
fn random_floats_round_trip_and_verify() {
    const CASES: u64 = 3000;
    let mut g = Rng(0x5eed);
    for case in 0..CASES {
        let lr = g.float();
        let scale = g.float();
        let rng = json!({ "seed": g.next(), "state": [g.float(), g.float(), g.float()] });
        let client = json!({
            "data_position": g.next() >> 11,
            "loss": g.float(),
            "history": { "losses": [g.float(), g.float()], "lr": g.float() },
        });
        let world = 1 + (case % 4) as usize;
        round_trip(&format!("case {case}"), &meta(world, Some(lr), scale, rng, client));
    }
}

#[test]
fn every_lr_of_the_shipped_schedule_round_trips() {
    // The shipped example config's WarmupDecayLR, at every step of its 300, and beyond.
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs/gpt2-tiny-zero3.json");
    let config: Value = serde_json::from_slice(&std::fs::read(&config).expect("shipped config")).expect("JSON");
    let spec: LrScheduleSpec = serde_json::from_value(config["scheduler"].clone()).expect("scheduler section");
    let schedule = spec.build(3e-3).expect("schedule");
    for step in 0..400 {
        let lr = schedule.lr_at(step);
        round_trip(
            &format!("step {step}, lr {lr:e}"),
            &meta(2, Some(lr), 65536.0, json!(null), json!({ "lr": lr })),
        );
    }
}

#[test]
fn non_finite_values_are_refused_at_save_naming_the_field() {
    let cases: [(&str, Option<f64>, f64); 4] = [
        ("lr_next", Some(f64::NAN), 1.0),
        ("lr_next", Some(f64::INFINITY), 1.0),
        ("lr_next", Some(f64::NEG_INFINITY), 1.0),
        ("loss_scaler.cur_scale", Some(1e-3), f64::INFINITY),
    ];
    for (field, lr, scale) in cases {
        let m = meta(1, lr, scale, json!(null), json!({}));
        let err = m
            .to_bytes()
            .expect_err("a non-finite value has no JSON form")
            .to_string();
        assert!(err.contains(field), "the error must name `{field}`: {err}");

        // Through the save itself: nothing is published, `latest` is not written.
        let dir = scratch(&format!("nonfinite-{}", field.replace('.', "-")));
        let d = dir.clone();
        let errors = on_ranks(2, move |rank, comm| {
            let layout = layout(specs(""), 2, 2);
            let bufs: Vec<Vec<f32>> = (0..layout.groups.len())
                .map(|g| owned(&layout, g, rank, 1, 0))
                .collect();
            let request = SaveRequest {
                layout: &layout,
                groups: bufs
                    .iter()
                    .map(|b| checkpoint::GroupShard {
                        master: b,
                        state: vec![],
                    })
                    .collect(),
                stage: 2,
                global_step: 1,
                skipped_steps: 0,
                optimizer_name: "sgd".into(),
                optimizer_step: 1,
                group_steps: Vec::new(),
                lr_next: lr,
                loss_scaler: Some(LossScalerState {
                    cur_scale: scale,
                    cur_iter: 1,
                    last_overflow_iter: -1,
                    cur_hysteresis: 2,
                    skipped_steps: 0,
                }),
                rng: None,
                client_state: json!({}),
                model: None,
                tensor_parallel: None,
                tensor_ranks: None,
                lineage: None,
                options: Default::default(),
            };
            checkpoint::save(comm.as_ref(), &d, "t", &request)
                .err()
                .map(|e| e.to_string())
        });
        for (rank, e) in errors.iter().enumerate() {
            let e = e
                .as_deref()
                .unwrap_or_else(|| panic!("rank {rank}: the save must fail"));
            assert!(e.contains(field), "rank {rank}'s error must name `{field}`: {e}");
        }
        assert!(!dir.join("t").exists(), "a refused save publishes no tag");
        assert!(!dir.join("latest").exists(), "a refused save writes no `latest`");
        std::fs::remove_dir_all(&dir).ok();
    }
}
