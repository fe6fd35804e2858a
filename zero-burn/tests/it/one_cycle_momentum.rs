//! A config's OneCycle schedule cycles the optimizer's momentum under `ZeroOptimizer`, as
//! DeepSpeed's does: each step's betas are (the schedule's momentum, 0.99), with the device
//! state, the host state (`offload_optimizer` cpu) and the state streamed from a swap file
//! (`nvme`), at stages 0-3.
//!
//! Reference: plain Burn on one thread over the whole global batch, with AdamW computed in f64 by
//! this test, each step at the learning rate and betas that DeepSpeed's own OneCycle set on a
//! torch optimizer (zero-core's fixture from tools/lr_schedule_reference.py, deepspeed 0.19.8).
//! The run with the momentum left alone (`cycle_momentum` false) is checked against the same
//! reference with the optimizer's own betas, and the two references must differ by far more than
//! the tolerance, so a step that ignored the cycled betas could not pass.

use crate::common;
use burn::optim::{lr_scheduler::LrScheduler, GradientsParams};
use common::*;
use serde_json::{json, Value};
use std::path::Path;
use zero_burn::params::{take_grads, write_values};
use zero_test_support::{assert_close, max_relative_error};

const FIXTURE: &str = include_str!("../../../zero-core/tests/fixtures/lr_schedule/deepspeed_reference.json");
const BLOCKS: usize = 3;
const STEPS: usize = 8;
const EPS: f64 = 1e-4;
const WEIGHT_DECAY: f64 = 0.01;
const TOLERANCE: f64 = 1e-5;

/// The fixture's `one_cycle` case: its scheduler params and, for each optimizer step, the rate
/// and betas DeepSpeed's OneCycle had set for it.
fn deepspeed_one_cycle() -> (Value, Vec<(f64, f64, f64)>) {
    let doc: Value = serde_json::from_str(FIXTURE).expect("fixture");
    let case = doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == "one_cycle")
        .expect("the one_cycle case");
    let column = |key: &str| -> Vec<f64> {
        case[key]
            .as_array()
            .expect(key)
            .iter()
            .map(|v| v.as_f64().expect("a number"))
            .collect()
    };
    let (lrs, beta1, beta2) = (column("lrs"), column("beta1"), column("beta2"));
    let steps = (0..STEPS).map(|k| (lrs[k], beta1[k], beta2[k])).collect();
    (case["params"].clone(), steps)
}

/// One process, the whole batch, AdamW in f64 at each step's `(lr, β1, β2)` (torch.optim.AdamW's
/// update, bias correction from the step's own betas).
fn reference(steps: &[(f64, f64, f64)]) -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut model = Net::<B>::new(&device, BLOCKS);
    let mut params: Vec<Vec<f64>> = values::<B, _>(&model)
        .into_iter()
        .map(|v| v.into_iter().map(f64::from).collect())
        .collect();
    let mut m: Vec<Vec<f64>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut v = m.clone();
    for (k, &(lr, b1, b2)) in steps.iter().enumerate() {
        let t = (k + 1) as i32;
        let (x, y) = batch::<B>(k, 0..GLOBAL_BATCH, &device);
        let mut grads = model.loss(x, y).backward();
        let mut g: Vec<Vec<f32>> = vec![Vec::new(); params.len()];
        take_grads::<B, _>(&model, &mut grads, |i, grad| {
            g[i] = grad.expect("every parameter has a gradient")
        });
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for (i, p) in params.iter_mut().enumerate() {
            for (j, p) in p.iter_mut().enumerate() {
                let g = f64::from(g[i][j]);
                *p *= 1.0 - lr * WEIGHT_DECAY;
                m[i][j] = b1 * m[i][j] + (1.0 - b1) * g;
                v[i][j] = b2 * v[i][j] + (1.0 - b2) * g * g;
                *p -= lr / bc1 * m[i][j] / (v[i][j].sqrt() / bc2.sqrt() + EPS);
            }
        }
        let now: Vec<Vec<f32>> = params.iter().map(|p| p.iter().map(|&x| x as f32).collect()).collect();
        model = write_values(model, &device, true, |i| now[i].clone());
    }
    values::<B, _>(&model)
}

/// The DeepSpeed config: AdamW (betas 0.9/0.999, eps 1e-4) under OneCycle with `schedule`'s
/// params, no clipping, at `stage`, with `offload` as the optimizer's offload section.
fn config(stage: u8, world: usize, schedule: &Value, offload: Option<Value>) -> zero_core::config::DeepSpeedConfig {
    let mut zero = json!({"stage": stage});
    if let Some(offload) = offload {
        zero["offload_optimizer"] = offload;
    }
    let text = json!({
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH / world,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {
            "lr": 1e-3, "betas": [0.9, 0.999], "eps": EPS, "weight_decay": WEIGHT_DECAY}},
        "scheduler": {"type": "OneCycle", "params": schedule},
        "zero_optimization": zero,
    });
    zero_core::config::DeepSpeedConfig::from_value(text, "one_cycle.json")
        .expect("the config parses")
        .config
}

/// `STEPS` steps of Burn's loop with `ZeroOptimizer` from `config` on `world` rank threads, the
/// model's blocks `ZeroModule`s; the weights after them.
fn train(config: &zero_core::config::DeepSpeedConfig, world: usize) -> Vec<Vec<f32>> {
    on_ranks(world, |rank, group| {
        let device = Default::default();
        let (mut model, mut optim) =
            zero_burn::initialize(config, UnitNet::<B>::new(&device, BLOCKS), group).expect("initialize");
        let mut lr = optim.lr_scheduler();
        for step in 0..STEPS {
            let (x, y) = batch::<B>(step, rows(rank, world, 0, 1), &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.try_step(lr.step(), model, grads).expect("step");
        }
        model.weights()
    })
    .remove(0)
}

fn nvme(dir: &Path) -> Value {
    json!({"device": "nvme", "nvme_path": dir, "buffer_count": 2})
}

#[test]
fn one_cycle_cycles_the_betas_at_every_stage_and_state_place() {
    let (schedule, steps) = deepspeed_one_cycle();
    assert!(
        steps.windows(2).any(|w| w[0].1 != w[1].1),
        "the fixture's momentum changes over the steps"
    );
    let want = reference(&steps);
    let swap = std::env::temp_dir().join(format!("zero-one-cycle-{}", std::process::id()));
    let cases: [(u8, usize, Option<Value>, &str); 5] = [
        (0, 1, None, "device"),
        (1, 2, None, "device"),
        (2, 2, Some(json!({"device": "cpu"})), "cpu"),
        (3, 2, None, "device"),
        (3, 2, Some(nvme(&swap)), "nvme"),
    ];
    for (stage, world, offload, place) in cases {
        let got = train(&config(stage, world, &schedule, offload), world);
        assert_close(
            &format!("stage {stage}, world {world}, {place}"),
            &got,
            &want,
            TOLERANCE,
        );
    }
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn without_cycle_momentum_the_optimizer_keeps_its_betas() {
    let (mut schedule, steps) = deepspeed_one_cycle();
    schedule["cycle_momentum"] = json!(false);
    let own: Vec<(f64, f64, f64)> = steps.iter().map(|&(lr, _, _)| (lr, 0.9, 0.999)).collect();
    let want = reference(&own);
    let cycled = reference(&steps);
    let apart = max_relative_error("cycled against fixed betas", &cycled, &want);
    assert!(
        apart > 100.0 * TOLERANCE,
        "cycled and fixed betas give {apart:e} apart: the test could not tell them apart"
    );
    let got = train(&config(3, 2, &schedule, None), 2);
    assert_close("cycle_momentum false", &got, &want, TOLERANCE);
}
