//! Parity with PyTorch: five steps of torch.optim (Adam, AdamW, AMSGrad, SGD with Nesterov, with
//! dampening, plain), recorded by tools/optim_reference.py into a committed fixture, replayed
//! through the shard optimizers. Regenerate with `python3 tools/optim_reference.py`.

use serde_json::Value;
use zero_core::optim::{build, AdamSpec, Isa, OptimizerSpec, SgdSpec, ShardOptimizer, ShardSegments};

const FIXTURE: &str = include_str!("fixtures/optim/torch_reference.json");

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn spec_of(case: &Value) -> OptimizerSpec {
    let h = &case["hyper"];
    let f = |k: &str, d: f64| h.get(k).and_then(Value::as_f64).unwrap_or(d);
    let betas = h.get("betas").map(|b| {
        let b = floats(b);
        (b[0] as f64, b[1] as f64)
    });
    match case["optimizer"].as_str().unwrap() {
        name @ ("Adam" | "AdamW") => {
            let base = if name == "Adam" {
                AdamSpec::adam()
            } else {
                AdamSpec::adamw()
            };
            let betas = h["betas"].as_array().unwrap();
            OptimizerSpec::Adam(AdamSpec {
                betas: (betas[0].as_f64().unwrap(), betas[1].as_f64().unwrap()),
                eps: f("eps", base.eps),
                weight_decay: f("weight_decay", base.weight_decay),
                amsgrad: h.get("amsgrad").and_then(Value::as_bool).unwrap_or(false),
                ..base
            })
        }
        "SGD" => {
            let _ = betas;
            OptimizerSpec::Sgd(SgdSpec {
                momentum: f("momentum", 0.0),
                dampening: f("dampening", 0.0),
                weight_decay: f("weight_decay", 0.0),
                nesterov: h.get("nesterov").and_then(Value::as_bool).unwrap_or(false),
                ..SgdSpec::default()
            })
        }
        other => panic!("fixture names an optimizer this test does not map: {other}"),
    }
}

/// Within 1e-6 relative to the larger of the value and `scale` (the largest magnitude the value
/// had: where an update nearly cancels the parameter, PyTorch's fused multiply-adds and ours may
/// round differently by an ulp of the operand, and that difference stays).
fn assert_close(what: &str, got: &[f32], want: &[f32], scale: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let tol = 1e-6 * b.abs().max(scale[i].abs()).max(1e-3);
        assert!((a - b).abs() <= tol, "{what}[{i}]: {a} vs torch {b}");
    }
}

fn replay(isa: Option<Isa>) {
    let doc: Value = serde_json::from_str(FIXTURE).expect("fixture is JSON");
    let params0 = floats(&doc["params0"]);
    let grads: Vec<Vec<f32>> = doc["grads"].as_array().unwrap().iter().map(floats).collect();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 6, "fixture lost cases");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let spec = spec_of(case);
        let n = params0.len();
        let mut opt: Box<dyn ShardOptimizer> = match (&spec, isa) {
            (OptimizerSpec::Adam(s), Some(isa)) => Box::new(
                zero_core::optim::Adam::new(s.clone(), n)
                    .unwrap()
                    .with_isa(isa)
                    .unwrap(),
            ),
            _ => build(&spec, n, ShardSegments::single(n)).unwrap(),
        };
        let mut p = params0.clone();
        let mut largest = vec![0.0_f32; n];
        let lrs = case["lrs"].as_array().unwrap();
        let trajectory = case["params_after_step"].as_array().unwrap();
        for (step, (lr, want)) in lrs.iter().zip(trajectory).enumerate() {
            for (l, x) in largest.iter_mut().zip(&p) {
                *l = l.max(x.abs());
            }
            opt.step(&mut p, &grads[step], lr.as_f64().unwrap()).unwrap();
            assert_close(&format!("{name} step {}", step + 1), &p, &floats(want), &largest);
        }
        assert_eq!(opt.step_count(), lrs.len() as u64);
        let state = opt.state();
        let final_state = case["final_state"].as_object().unwrap();
        assert_eq!(state.len(), final_state.len(), "{name}: state buffers");
        for (key, want) in final_state {
            let (_, got) = state
                .iter()
                .find(|(k, _)| k == key)
                .unwrap_or_else(|| panic!("{name}: no state `{key}`"));
            assert_close(&format!("{name} {key}"), got, &floats(want), got);
        }
    }
}

#[test]
fn shard_optimizers_follow_torch_optim_for_five_steps() {
    replay(None);
}

#[test]
fn every_adam_kernel_follows_torch_optim() {
    for isa in Isa::available() {
        replay(Some(isa));
    }
}
