//! `offload_optimizer.delayed_update`: ZeRO-Offload's one-step delayed parameter update. Each
//! step returns the model with the previous step's update and leaves its own running on the
//! optimizer's threads beside the next forward and backward; `flush` gives the model the last.
//! The trajectory is not the undelayed one: step t's gradient is taken on the masters of update
//! t-2 (the first two steps both on the initial weights).
//!
//! Reference: Burn's own AdamW (an implementation independent of ours) on one thread over the
//! whole global batch, driven through that recurrence by the test: two copies of the model
//! sharing parameter ids, `shown` (what the delayed run's model holds) and `masters` (the
//! optimizer's trajectory); each step takes the gradient on `shown`, steps `masters` with it,
//! and `shown` becomes the masters as they were before that step. After every step the
//! delayed run's model must equal `shown`, and after `flush` the masters, to 1e-6 relative;
//! the undelayed reference must be visibly elsewhere (the delay really happened). At stages 1
//! and 2 on one and two ranks, and at stage 3 with the blocks as `ZeroModule`s; the state in
//! host memory and streamed from a swap file; a checkpoint saved mid-run holds the settled
//! masters; the settings refuse what cannot be delayed.

use crate::common;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use common::*;
use std::sync::Arc;
use zero_burn::params::read_values;
use zero_burn::sharded::UnitComm;
use zero_burn::{EngineSettings, HostStaged, OptimizerOffload, Stage, ZeroOptimizer};
use zero_test_support::{assert_close, max_relative_error};

const STEPS: usize = 5;
const LR: f64 = 0.01;
const BLOCKS: usize = 2;

fn settings(stage: Stage, offload: OptimizerOffload) -> EngineSettings {
    let mut s = EngineSettings::new(stage, adamw_eps4(LR));
    s.reduce_bucket_size = 100;
    // Every block is cut at stage 3 (the default threshold keeps units this small whole).
    s.param_persistence_threshold = 13;
    s.offload_optimizer = offload;
    s.delayed_update = true;
    s
}

/// The reference: what the delayed run's model holds after each step (`shown`), and the
/// masters after the last (what `flush` gives); also the undelayed run's final weights.
struct Reference {
    shown: Vec<Vec<Vec<f32>>>,
    masters: Vec<Vec<f32>>,
    undelayed: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    let device = Default::default();
    let initial = Net::<B>::new(&device, BLOCKS);
    let mut optim = burn_adamw_eps4().init();
    let (mut shown, mut masters) = (initial.clone(), initial.clone());
    let mut after_each = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(shown.loss(x, y).backward(), &shown);
        // The clones share parameter ids: the gradient taken on `shown` steps `masters`.
        let next = optim.step(LR, masters.clone(), grads);
        shown = masters;
        masters = next;
        after_each.push(values::<B, _>(&shown));
    }
    let mut model = initial;
    let mut optim = burn_adamw_eps4().init();
    for step in 0..STEPS {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.step(LR, model, grads);
    }
    Reference {
        shown: after_each,
        masters: values::<B, _>(&masters),
        undelayed: values::<B, _>(&model),
    }
}

/// The plain model (stages 1-2) in Burn's loop with the delayed optimizer: rank 0's weights
/// after each step and after `flush`.
fn run_plain(settings: EngineSettings, world: usize) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
    let mut runs = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let mut model = Net::<B>::new(&device, BLOCKS);
        let mut optim = ZeroOptimizer::new(settings.clone(), group).expect("optimizer");
        let mut after_each = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch::<B>(step, rows(rank, world, 0, 1), &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.try_step(LR, model, grads).expect("step");
            after_each.push(values::<B, _>(&model));
        }
        assert_eq!(optim.tensor_state(), Some(false), "the state is in host buffers");
        let model = optim.flush(model).expect("flush");
        // A second flush owes nothing more.
        let again = optim.flush(model.clone()).expect("flush again");
        assert_eq!(values::<B, _>(&again), values::<B, _>(&model));
        (after_each, values::<B, _>(&model))
    });
    for r in &runs[1..] {
        assert_eq!(r, &runs[0], "every rank holds the same weights");
    }
    runs.swap_remove(0)
}

/// [`run_plain`] over the model with its blocks as `ZeroModule`s from `initialize_settings`
/// (stage 3: each block cut over the ranks), each block gathered whole for the comparison.
fn run_units(settings: EngineSettings, world: usize) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
    let mut runs = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(group.clone()));
        let (mut model, mut optim) =
            zero_burn::initialize_settings(settings.clone(), UnitNet::<B>::new(&device, BLOCKS), group, units)
                .expect("initialize");
        let weights = |model: &UnitNet<B>| {
            let model = model.valid();
            let mut out = values(&model.ends);
            for b in &model.blocks {
                read_values::<burn::backend::Flex, _>(&b.gathered().expect("gather"), |_, v| out.push(v));
            }
            out
        };
        let mut after_each = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch::<B>(step, rows(rank, world, 0, 1), &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.try_step(LR, model, grads).expect("step");
            after_each.push(weights(&model));
        }
        let model = optim.flush(model).expect("flush");
        (after_each, weights(&model))
    });
    for r in &runs[1..] {
        assert_eq!(r, &runs[0], "every rank holds the same weights");
    }
    runs.swap_remove(0)
}

fn check(label: &str, (after_each, flushed): (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>), want: &Reference) {
    for (step, (got, shown)) in after_each.iter().zip(&want.shown).enumerate() {
        assert_close(&format!("{label}: the model after step {}", step + 1), got, shown, 1e-6);
    }
    assert_close(
        &format!("{label}: the model after flush"),
        &flushed,
        &want.masters,
        1e-6,
    );
    assert!(
        max_relative_error(&format!("{label}: the undelayed run"), &flushed, &want.undelayed) > 1e-4,
        "{label}: the delayed run ended where the undelayed one does"
    );
}

#[test]
fn delayed_update_follows_the_one_step_stale_recurrence_at_every_stage() {
    let want = reference();
    // The first step leaves the model as it was: its update is still running.
    let initial = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    assert_eq!(want.shown[0], initial);
    let cpu = OptimizerOffload::Cpu { threads: 2 };
    for (stage, world) in [(Stage::Zero1, 1), (Stage::Zero1, 2), (Stage::Zero2, 2)] {
        check(
            &format!("{stage:?}, world {world}"),
            run_plain(settings(stage, cpu.clone()), world),
            &want,
        );
    }
    check(
        "stage 3 units, world 2",
        run_units(settings(Stage::Zero3, cpu), 2),
        &want,
    );
}

#[test]
fn delayed_update_streams_from_the_swap_file_as_from_memory() {
    let want = reference();
    let dir = scratch("nvme");
    let nvme = OptimizerOffload::Nvme {
        path: dir.clone(),
        buffer_count: 2,
        chunk_elements: 29,
        threads: 1,
    };
    check(
        "nvme, stage 2, world 2",
        run_plain(settings(Stage::Zero2, nvme), 2),
        &want,
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-burn-delayed-update-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A checkpoint saved after step 3 (its update still running when the save is called) holds
/// the masters of that update: a run loading it starts from the weights `flush` would give
/// there. Its step count is 3.
#[test]
fn a_checkpoint_holds_the_settled_masters() {
    let dir = scratch("checkpoint");
    let device = Default::default();
    let world = 1;
    let (group,) = {
        let mut g = zero_core::comm::ThreadGroup::new_group(world).expect("group");
        (g.remove(0) as Arc<dyn zero_core::comm::ProcessGroup>,)
    };
    let s = settings(Stage::Zero2, OptimizerOffload::Cpu { threads: 1 });
    let mut model = Net::<B>::new(&device, BLOCKS);
    let mut optim = ZeroOptimizer::new(s.clone(), group.clone()).expect("optimizer");
    for step in 0..3 {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.try_step(LR, model, grads).expect("step");
    }
    optim
        .save_checkpoint(&dir, None, &serde_json::Value::Null)
        .expect("save");
    let flushed = values::<B, _>(&optim.flush(model).expect("flush"));
    let want = reference();
    let mut optim2 = ZeroOptimizer::new(s, group).expect("optimizer");
    let (loaded, _) = optim2
        .load_checkpoint(&dir, None, Net::<B>::new(&device, BLOCKS))
        .expect("load");
    assert_eq!(optim2.global_step(), 3);
    assert_eq!(
        values::<B, _>(&loaded),
        flushed,
        "the loaded model is the flushed one, bit for bit"
    );
    // Against the reference: the masters after three delayed updates are what `shown` holds
    // after step 4.
    assert_close("the checkpoint's masters", &flushed, &want.shown[3], 1e-6);
    // The loaded run steps on (nothing owed: the load wrote every group).
    let (x, y) = batch::<B>(3, 0..GLOBAL_BATCH, &device);
    let grads = GradientsParams::from_grads(loaded.loss(x, y).backward(), &loaded);
    let stepped = optim2.try_step(LR, loaded, grads).expect("a step after the load");
    assert_eq!(values::<B, _>(&stepped), flushed, "its own update is still running");
    let _ = std::fs::remove_dir_all(dir);
}

/// What cannot be delayed is refused with the key and what to do: the state on the device,
/// LAMB (its step communicates), from the config too.
#[test]
fn what_cannot_be_delayed_is_refused() {
    let device = Default::default();
    let group =
        zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0) as Arc<dyn zero_core::comm::ProcessGroup>;
    let model = Net::<B>::new(&device, BLOCKS);
    let (x, y) = batch::<B>(0, 0..GLOBAL_BATCH, &device);
    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
    let on_device = settings(Stage::Zero1, OptimizerOffload::None);
    let mut optim = ZeroOptimizer::new(on_device, group).expect("optimizer");
    let err = optim.try_step(LR, model, grads).map(|_| ()).unwrap_err().to_string();
    assert!(
        err.contains("delayed_update") && err.contains("offload_optimizer.device"),
        "{err}"
    );

    let config = |optimizer: &str| {
        format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "{optimizer}", "params": {{"lr": 0.01}}}},
               "zero_optimization": {{"stage": 2, "offload_optimizer": {{"device": "cpu", "delayed_update": true}}}}}}"#
        )
    };
    let resolve = |text: String| {
        let parsed = zero_core::config::DeepSpeedConfig::from_str(&text, "ds_config.json").expect("config");
        zero_burn::resolve(&parsed.config, 1, &Default::default()).expect("resolve")
    };
    let adamw = zero_burn::engine_settings(&resolve(config("AdamW"))).expect("settings");
    assert!(adamw.delayed_update);
    let err = zero_burn::engine_settings(&resolve(config("Lamb")))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("delayed_update") && err.contains("LAMB"), "{err}");
    let off = zero_burn::engine_settings(&resolve(config("AdamW").replace(", \"delayed_update\": true", "")))
        .expect("settings");
    assert!(!off.delayed_update, "off by default");
}
