//! The dynamic loss scaler against DeepSpeed's own DynamicLossScaler (deepspeed 0.19.8): fixed
//! overflow sequences under several settings, the scale and remaining hysteresis after every
//! update, and the error at the minimum scale, recorded by tools/loss_scaler_reference.py.
//! Regenerate with `python3 tools/loss_scaler_reference.py`.

use serde_json::Value;
use zero_core::loss_scaler::{LossScaleError, LossScaler, LossScalerConfig, ScaleDecision};

const FIXTURE: &str = include_str!("fixtures/loss_scaler/deepspeed_trace.json");

#[test]
fn dynamic_scaler_follows_deepspeed_trace() {
    let doc: Value = serde_json::from_str(FIXTURE).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4, "fixture lost cases");
    let mut errors_seen = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        // The fixture's config uses the `fp16` section's key names.
        let config: LossScalerConfig = serde_json::from_value(case["config"].clone()).unwrap();
        let mut scaler = LossScaler::new(config).unwrap();
        let overflows = case["overflows"].as_array().unwrap();
        let trace = case["trace"].as_array().unwrap();
        let mut skipped = 0;
        for (k, (overflow, want)) in overflows.iter().zip(trace).enumerate() {
            let overflow = overflow.as_bool().unwrap();
            let got = scaler.update(overflow);
            if want.get("error").is_some() {
                match got {
                    Err(LossScaleError::OverflowAtMinimumScale { step, scale }) => {
                        assert_eq!(step, k as u64, "{name}: error step");
                        assert_eq!(scale, scaler.scale());
                        errors_seen += 1;
                    }
                    other => panic!("{name} update {k}: DeepSpeed raised, we returned {other:?}"),
                }
                break;
            }
            let decision = got.unwrap_or_else(|e| panic!("{name} update {k}: {e}"));
            let expected = if overflow {
                ScaleDecision::Skip
            } else {
                ScaleDecision::Apply
            };
            assert_eq!(decision, expected, "{name} update {k}");
            skipped += overflow as u64;
            assert_eq!(
                scaler.scale(),
                want["scale"].as_f64().unwrap(),
                "{name} update {k}: scale"
            );
            assert_eq!(
                scaler.state().cur_hysteresis as u64,
                want["hysteresis"].as_u64().unwrap(),
                "{name} update {k}: hysteresis"
            );
        }
        assert_eq!(scaler.skipped_steps(), skipped, "{name}: skipped steps");
    }
    assert_eq!(errors_seen, 3, "the fixture's three runs into the minimum scale");
}

#[test]
fn state_round_trips_through_json() {
    let mut a = LossScaler::new(LossScalerConfig {
        loss_scale_window: 3,
        ..Default::default()
    })
    .unwrap();
    for overflow in [false, true, true, false, false, false, false, true] {
        a.update(overflow).unwrap();
    }
    let saved = serde_json::to_string(&a.state()).unwrap();
    let mut b = LossScaler::new(LossScalerConfig {
        loss_scale_window: 3,
        ..Default::default()
    })
    .unwrap();
    b.load_state(serde_json::from_str(&saved).unwrap());
    assert_eq!(a, b);
    for overflow in [false, false, false, false, true] {
        assert_eq!(a.update(overflow), b.update(overflow));
    }
    assert_eq!(a.scale(), b.scale());
    assert_ne!(a.scale(), 65536.0);
}
