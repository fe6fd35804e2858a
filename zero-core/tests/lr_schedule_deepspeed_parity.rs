//! Every schedule against DeepSpeed's own `deepspeed.runtime.lr_schedules` (deepspeed 0.19.8),
//! recorded by tools/lr_schedule_reference.py: the rate and the optimizer's betas before the
//! first scheduler step and after each step, for non-default params (OneCycle, cycling the
//! momentum, sets β2 to [`CYCLED_BETA2`] too). The config sections are parsed from the same
//! JSON the reference was built from, so the test also covers the config names and defaults.
//! Regenerate with `python3 tools/lr_schedule_reference.py`.

use serde_json::{json, Value};
use zero_core::lr_schedule::{LrScheduleSpec, LrScheduler, SchedulerState, CYCLED_BETA2};

const FIXTURE: &str = include_str!("fixtures/lr_schedule/deepspeed_reference.json");

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-12)
}

#[test]
fn schedules_match_deepspeed_step_by_step() {
    let doc: Value = serde_json::from_str(FIXTURE).unwrap();
    let optimizer_lr = doc["optimizer_lr"].as_f64().unwrap();
    let optimizer_beta1 = doc["optimizer_beta1"].as_f64().unwrap();
    let optimizer_beta2 = doc["optimizer_beta2"].as_f64().unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 11, "fixture lost cases");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let section = json!({"type": case["type"], "params": case["params"]});
        let spec: LrScheduleSpec =
            serde_json::from_value(section).unwrap_or_else(|e| panic!("{name}: config section does not parse: {e}"));
        let mut sched = LrScheduler::new(spec.build(optimizer_lr).unwrap());
        let lrs = case["lrs"].as_array().unwrap();
        let beta1s = case["beta1"].as_array().unwrap();
        let beta2s = case["beta2"].as_array().unwrap();
        assert_eq!(lrs.len(), beta2s.len(), "{name}");
        for (k, ((lr, beta1), beta2)) in lrs.iter().zip(beta1s).zip(beta2s).enumerate() {
            let (want_lr, want_beta1, want_beta2) =
                (lr.as_f64().unwrap(), beta1.as_f64().unwrap(), beta2.as_f64().unwrap());
            assert!(
                close(sched.lr(), want_lr),
                "{name} after {k} steps: lr {} vs deepspeed {want_lr}",
                sched.lr()
            );
            // Without a cycled momentum the optimizer keeps its own betas.
            let beta1 = sched.momentum().unwrap_or(optimizer_beta1);
            let beta2 = sched.momentum().map_or(optimizer_beta2, |_| CYCLED_BETA2);
            assert!(
                close(beta1, want_beta1),
                "{name} after {k} steps: beta1 {beta1} vs deepspeed {want_beta1}"
            );
            assert!(
                close(beta2, want_beta2),
                "{name} after {k} steps: beta2 {beta2} vs deepspeed {want_beta2}"
            );
            sched.step();
        }
    }
}

#[test]
fn scheduler_state_round_trips() {
    let spec: LrScheduleSpec = serde_json::from_value(json!({
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": 100, "warmup_num_steps": 10}
    }))
    .unwrap();
    let mut a = LrScheduler::new(spec.build(1e-3).unwrap());
    for _ in 0..17 {
        a.step();
    }
    let saved = serde_json::to_string(&a.state()).unwrap();
    let mut b = LrScheduler::new(spec.build(1e-3).unwrap());
    assert_ne!(a.lr(), b.lr());
    b.load_state(serde_json::from_str::<SchedulerState>(&saved).unwrap());
    assert_eq!(a.lr(), b.lr());
    assert_eq!(b.state().last_batch_iteration, 16);
}

#[test]
fn missing_and_invalid_params_are_named() {
    let spec: LrScheduleSpec = serde_json::from_value(json!({"type": "WarmupCosineLR", "params": {}})).unwrap();
    let err = spec.build(1e-3).unwrap_err();
    assert!(err.to_string().contains("`total_num_steps`"), "{err}");
    let spec: LrScheduleSpec =
        serde_json::from_value(json!({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}})).unwrap();
    assert!(spec.build(1e-3).unwrap_err().to_string().contains("cycle_max_lr"));
    let spec: LrScheduleSpec =
        serde_json::from_value(json!({"type": "WarmupLR", "params": {"warmup_num_steps": 0}})).unwrap();
    assert!(spec.build(1e-3).unwrap_err().to_string().contains("warmup_num_steps"));
    let unknown =
        serde_json::from_value::<LrScheduleSpec>(json!({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}));
    assert!(unknown.is_err());
}
