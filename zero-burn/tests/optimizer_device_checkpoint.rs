//! Checkpoints of the device engine: a run saved after 3 steps and resumed in fresh engines
//! ends where an uninterrupted 5-step run ends, and checkpoints move between the device and the
//! host engines.
//!
//! References: the uninterrupted run of the same engine (the resumed run must equal it bit for
//! bit: the same operations on the same values), and for the cross-engine cases the host
//! `ZeroEngine`'s own uninterrupted run, within device_engine.rs's tolerance (1e-5 of the largest
//! weight; the two engines' Adam and norm round differently, about 1e-7).

mod common;

use common::*;
use std::path::Path;
use std::sync::Arc;
use zero_burn::{DeviceCollective, DeviceEngine, HostStaged, PrecisionSettings, Stage, ZeroEngine};

const BLOCKS: usize = 3;
const GAS: usize = 2;

/// A fresh empty directory of this process (removed when dropped).
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("zero-burn-device-ckpt-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One engine of either kind (a test value, moved rarely: no need to box).
#[allow(clippy::large_enum_variant)]
enum Engine {
    Host(ZeroEngine<B, Net<B>>),
    Device(DeviceEngine<B, Net<B>>),
}

impl Engine {
    fn new(device_kind: bool, stage: Stage, group: Arc<dyn zero_core::comm::ProcessGroup>) -> Engine {
        let settings = small_bucket_settings(stage, GAS, 0.5, PrecisionSettings::default());
        let model = Net::<B>::new(&Default::default(), BLOCKS);
        if device_kind {
            let comm: Arc<dyn DeviceCollective<_>> = Arc::new(HostStaged::new(group));
            Engine::Device(DeviceEngine::new(settings, model, comm).expect("device engine"))
        } else {
            Engine::Host(ZeroEngine::new(settings, model, group).expect("host engine"))
        }
    }

    /// Steps `from..to` of the shared data, `world` ranks.
    fn train(&mut self, rank: usize, world: usize, from: usize, to: usize) {
        let device = Default::default();
        for step in from..to {
            for micro in 0..GAS {
                let (x, y) = batch::<B>(step, rows(rank, world, micro, GAS), &device);
                match self {
                    Engine::Host(e) => {
                        let loss = e.forward(|m| m.loss(x, y));
                        e.backward(loss).expect("backward");
                        e.step().expect("step");
                    }
                    Engine::Device(e) => {
                        let loss = e.forward(|m| m.loss(x, y));
                        e.backward(loss).expect("backward");
                        e.step().expect("step");
                    }
                }
            }
        }
    }

    fn save(&mut self, dir: &Path) {
        let client = serde_json::json!({ "next_step": 3 });
        match self {
            Engine::Host(e) => e.save_checkpoint(dir, None, &client).map(|_| ()),
            Engine::Device(e) => e.save_checkpoint(dir, None, &client).map(|_| ()),
        }
        .expect("save");
    }

    fn load(&mut self, dir: &Path) -> serde_json::Value {
        match self {
            Engine::Host(e) => e.load_checkpoint(dir, None),
            Engine::Device(e) => e.load_checkpoint(dir, None),
        }
        .expect("load")
    }

    fn values(&self) -> Vec<Vec<f32>> {
        match self {
            Engine::Host(e) => values::<B, _>(e.module()),
            Engine::Device(e) => values::<B, _>(e.module()),
        }
    }
}

/// Rank 0's weights after 5 steps: uninterrupted (`resume` None), or saved after 3 steps by an
/// engine of kind `saver` and finished by a fresh engine of kind `loader` (`true`: device).
fn run(world: usize, stage: Stage, saver: bool, resume: Option<bool>) -> Vec<Vec<f32>> {
    let dir = Scratch::new();
    let path = dir.0.clone();
    let runs = on_ranks(world, move |rank, group| {
        let mut engine = Engine::new(saver, stage, group.clone());
        match resume {
            None => engine.train(rank, world, 0, 5),
            Some(loader) => {
                engine.train(rank, world, 0, 3);
                engine.save(&path);
                drop(engine);
                let mut fresh = Engine::new(loader, stage, group);
                let client = fresh.load(&path);
                assert_eq!(client["next_step"], 3, "the client state comes back");
                fresh.train(rank, world, 3, 5);
                engine = fresh;
            }
        }
        engine.values()
    });
    runs.into_iter().next().expect("rank 0")
}

fn max_relative_difference(got: &[Vec<f32>], want: &[Vec<f32>]) -> f64 {
    let scale = want.iter().flatten().fold(0f64, |m, v| m.max(v.abs() as f64));
    let diff = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
    diff / scale
}

#[test]
fn device_engine_resumes_bit_for_bit() {
    for (world, stage) in [(1, Stage::Zero0), (2, Stage::Zero1), (2, Stage::Zero2)] {
        let want = run(world, stage, true, None);
        let got = run(world, stage, true, Some(true));
        assert_eq!(got, want, "world {world}, {stage:?}: resumed weights differ");
        // The run moved the weights: a resume that lost the state would not match by chance.
        let start = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
        assert!(max_relative_difference(&want, &start) > 1e-3);
    }
}

#[test]
fn checkpoints_move_between_the_device_and_host_engines() {
    for stage in [Stage::Zero1, Stage::Zero2] {
        let host = run(2, stage, false, None);
        let device = run(2, stage, true, None);
        let host_to_device = run(2, stage, false, Some(true));
        let device_to_host = run(2, stage, true, Some(false));
        let err = max_relative_difference(&host_to_device, &host);
        assert!(err < 1e-5, "{stage:?}: host checkpoint resumed on the device: {err:e}");
        let err = max_relative_difference(&device_to_host, &device);
        assert!(err < 1e-5, "{stage:?}: device checkpoint resumed on the host: {err:e}");
    }
}

#[test]
fn saving_between_accumulation_boundaries_is_refused() {
    let errors = on_ranks(1, |rank, group| {
        let mut engine = Engine::new(true, Stage::Zero1, group);
        let Engine::Device(e) = &mut engine else { unreachable!() };
        let (x, y) = batch::<B>(0, rows(rank, 1, 0, GAS), &Default::default());
        let loss = e.forward(|m| m.loss(x, y));
        e.backward(loss).expect("backward");
        let dir = Scratch::new();
        let err = e
            .save_checkpoint(&dir.0, None, &serde_json::Value::Null)
            .expect_err("half a step absorbed");
        err.to_string()
    });
    assert!(errors[0].contains("between accumulation boundaries"), "{}", errors[0]);
}
