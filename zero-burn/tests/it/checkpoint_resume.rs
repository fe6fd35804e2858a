//! Checkpoints of `ZeroOptimizer` in Burn's loop: exact resume at every stage, resharding to
//! any world size and stage, between a model of `ZeroModule`s and the plain model, and an
//! optimizer (and its model) left untouched by a damaged checkpoint.
//!
//! The models: the common `Net` under `ZeroOptimizer::new` (stages 0-2), and `UnitNet`, the
//! same with each block a `ZeroModule`, from `initialize_settings` (stages 0-3; at stage 3 each
//! block cut over the ranks). Both name their parameters alike, so their checkpoints load into
//! each other.
//!
//! References: for exact resume, the same run without the stop (losses and parameters must be
//! bit-identical); for resharding, the run at the new world size and stage from the start
//! (which tests/exactness.rs ties to a single process), within fp32 rounding (1e-6 relative).

use crate::common;
use burn::module::AutodiffModule;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{ElementConversion, Tensor};
use common::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_burn::params::{describe, write_values};
use zero_burn::sharded::UnitComm;
use zero_burn::{EngineSettings, HostStaged, Stage, ZeroOptimizer};
use zero_core::comm::ProcessGroup;
use zero_test_support::{assert_close, max_relative_error};

const BLOCKS: usize = 3;

fn settings(stage: Stage, gas: usize) -> EngineSettings {
    let mut s = EngineSettings::new(stage, common::adamw_eps4(0.01));
    s.gradient_accumulation_steps = gas;
    s.reduce_bucket_size = 100;
    // Every block (187 elements) of `UnitNet` is cut under stage 3 (the default threshold keeps
    // units this small whole).
    s.param_persistence_threshold = 13;
    s.prefetch_bucket_size = 400;
    // A schedule, so that a resume that lost its position would use the wrong rate.
    s.lr_schedule = Some(Arc::new(|step| 0.01 / (1.0 + step as f64)));
    s
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-burn-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A model the loop below trains.
trait Loss: AutodiffModule<B> {
    fn loss_of(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1>;
}

impl Loss for Net<B> {
    fn loss_of(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        self.loss(x, y)
    }
}

impl Loss for UnitNet<B> {
    fn loss_of(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        self.loss(x, y)
    }
}

/// `net`'s weights as a [`UnitNet`] and its `ZeroOptimizer`, from `initialize_settings` over
/// `group`.
fn init_units(settings: EngineSettings, group: Arc<dyn ProcessGroup>, net: Net<B>) -> (UnitNet<B>, ZeroOptimizer) {
    let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(group.clone()));
    zero_burn::initialize_settings(settings, UnitNet::of(net), group, units).expect("initialize")
}

/// `Net` with other weights than `Net::new`'s: a run resumed from them must take every weight
/// from the checkpoint.
fn other_weights(device: &burn::tensor::Device<B>) -> Net<B> {
    let sizes: Vec<usize> = describe::<B, _>(&Net::<B>::new(device, BLOCKS))
        .iter()
        .map(|(_, s)| s.numel())
        .collect();
    write_values(Net::<B>::new(device, BLOCKS), device, true, |i| {
        vec![0.5 + i as f32; sizes[i]]
    })
}

/// Trains steps `steps` of `model` with `optim` in Burn's loop, `gas` micro-batches accumulated
/// by Burn's `GradientsAccumulator` per step, at the rates of the optimizer's own schedule
/// (`lr_scheduler`, whose position a loaded checkpoint restores); returns the model and this
/// rank's micro-batch losses.
fn train<M: Loss>(
    optim: &mut ZeroOptimizer,
    mut model: M,
    rank: usize,
    world: usize,
    gas: usize,
    steps: std::ops::Range<usize>,
) -> (M, Vec<f32>) {
    let device = Default::default();
    let mut lr = optim.lr_scheduler();
    let mut losses = Vec::new();
    for step in steps {
        let mut accumulator = GradientsAccumulator::new();
        for micro in 0..gas {
            let (x, y) = batch::<B>(step, rows(rank, world, micro, gas), &device);
            let loss = model.loss_of(x, y);
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let grads = loss.div_scalar(gas as f32).backward();
            accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
        }
        model = optim.try_step(lr.step(), model, accumulator.grads()).expect("step");
    }
    (model, losses)
}

/// Parameters of rank 0 after `ZeroOptimizer` at `(world, stage)` trained steps `steps` from a
/// fresh model, loading `load` first when given (its client state must name `steps.start`) and
/// saving to `save` at the end; every rank must hold the same parameters.
fn optimizer_run(
    stage: Stage,
    world: usize,
    steps: std::ops::Range<usize>,
    load: Option<PathBuf>,
    save: Option<PathBuf>,
) -> Vec<Vec<f32>> {
    let results = on_ranks(world, move |rank, group| {
        let mut optim = ZeroOptimizer::new(settings(stage, 1), group).expect("optimizer");
        let mut model = Net::<B>::new(&Default::default(), BLOCKS);
        if let Some(dir) = &load {
            let (loaded, client) = optim.load_checkpoint(dir, None, model).expect("load");
            assert_eq!(client["next_step"], steps.start, "client state");
            assert_eq!(optim.global_step(), steps.start as u64);
            model = loaded;
        }
        let (model, _) = train(&mut optim, model, rank, world, 1, steps.clone());
        if let Some(dir) = &save {
            optim
                .save_checkpoint(dir, None, &serde_json::json!({ "next_step": steps.end }))
                .expect("save");
        }
        values::<B, _>(&model)
    });
    for r in &results[1..] {
        assert_eq!(r, &results[0], "every rank holds the same weights");
    }
    results.into_iter().next().unwrap_or_default()
}

/// (losses of every rank, parameters of rank 0) after [`UnitNet`] at `(world, stage)` trained
/// steps `steps` of `gas` micro-batches, loading `load` first when given (into a model of other
/// weights: everything must come from the checkpoint; its client state must name
/// `steps.start`) and saving to `save` at the end; every rank must hold the same parameters.
fn units_run(
    stage: Stage,
    world: usize,
    gas: usize,
    steps: std::ops::Range<usize>,
    load: Option<PathBuf>,
    save: Option<PathBuf>,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let results = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let start = if load.is_some() {
            other_weights(&device)
        } else {
            Net::<B>::new(&device, BLOCKS)
        };
        let (mut model, mut optim) = init_units(settings(stage, gas), group, start);
        if let Some(dir) = &load {
            let (loaded, client) = optim.load_checkpoint(dir, None, model).expect("load");
            assert_eq!(client["next_step"], steps.start, "client state");
            assert_eq!(optim.global_step(), steps.start as u64);
            model = loaded;
        }
        let (model, losses) = train(&mut optim, model, rank, world, gas, steps.clone());
        if let Some(dir) = &save {
            optim
                .save_checkpoint(dir, None, &serde_json::json!({ "next_step": steps.end }))
                .expect("save");
        }
        (losses, model.weights())
    });
    for (_, r) in &results[1..] {
        assert_eq!(r, &results[0].1, "every rank holds the same weights");
    }
    let (losses, mut params): (Vec<_>, Vec<_>) = results.into_iter().unzip();
    (losses, params.swap_remove(0))
}

/// Flips one byte near the end of a file.
fn damage(path: &Path) {
    let mut bytes = std::fs::read(path).expect("read shard");
    let i = bytes.len() - 5;
    bytes[i] ^= 0x40;
    std::fs::write(path, bytes).expect("write shard");
}

/// A model of `ZeroModule`s resumed by a fresh `initialize_settings` (from other weights) at
/// the same world size and stage continues bit for bit: stages 0-3, worlds 1 and 3, two
/// micro-batches per step.
#[test]
fn zero_modules_resume_exactly_at_every_stage() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1, 3] {
            let dir = scratch(&format!("exact-{stage:?}-{world}"));
            let (want_losses, want) = units_run(stage, world, 2, 0..6, None, None);
            let (mut losses, _) = units_run(stage, world, 2, 0..3, None, Some(dir.clone()));
            let (more, got) = units_run(stage, world, 2, 3..6, Some(dir.clone()), None);
            for (l, m) in losses.iter_mut().zip(more) {
                l.extend(m);
            }
            assert_eq!(
                losses, want_losses,
                "{stage:?} world {world}: losses of the resumed run"
            );
            assert_eq!(got, want, "{stage:?} world {world}: parameters must be bit-identical");
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

#[test]
fn zero_optimizer_resumes_exactly_stages_0_to_2() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        let world = 2;
        let dir = scratch(&format!("optimizer-{stage:?}"));
        let run = move |resume: bool| {
            let dir = dir.clone();
            on_ranks(world, move |rank, group| {
                let mk = |g| ZeroOptimizer::new(settings(stage, 1), g).expect("optimizer");
                let mut optim = mk(group.clone());
                let model = Net::<B>::new(&Default::default(), BLOCKS);
                let (mut model, mut losses) = train(&mut optim, model, rank, world, 1, 0..2);
                if resume {
                    optim
                        .save_checkpoint(&dir, Some("mid"), &serde_json::Value::Null)
                        .expect("save");
                    // A fresh optimizer and the model's initial weights: everything the rest of
                    // the run needs comes from the checkpoint.
                    optim = mk(group);
                    let fresh = Net::<B>::new(&Default::default(), BLOCKS);
                    model = optim.load_checkpoint(&dir, Some("mid"), fresh).expect("load").0;
                    assert_eq!(optim.global_step(), 2);
                }
                let (model, more) = train(&mut optim, model, rank, world, 1, 2..4);
                losses.extend(more);
                (losses, values::<B, _>(&model))
            })
        };
        assert_eq!(
            run(true),
            run(false),
            "{stage:?}: the resumed run must equal the uninterrupted one bit for bit"
        );
    }
}

/// `ZeroOptimizer` over the plain model continues from a checkpoint saved at another world size
/// and stage, by itself or by the model of `ZeroModule`s at stage 3, where its own run at the
/// new world size and stage from the start ends.
#[test]
fn zero_optimizer_reshards_between_world_sizes_and_stages() {
    let stages = [Stage::Zero0, Stage::Zero1, Stage::Zero2];
    let mut reference = std::collections::BTreeMap::new();
    for m in 1..=4 {
        for t in stages {
            reference.insert((m, t), optimizer_run(t, m, 0..4, None, None));
        }
    }
    let initial = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    for (n, s, by_units) in [
        (1, Stage::Zero0, false),
        (2, Stage::Zero2, false),
        (3, Stage::Zero1, false),
        (2, Stage::Zero3, true),
    ] {
        let dir = scratch(&format!("optimizer-reshard-{n}-{s:?}-{by_units}"));
        if by_units {
            units_run(s, n, 1, 0..2, None, Some(dir.clone()));
        } else {
            optimizer_run(s, n, 0..2, None, Some(dir.clone()));
        }
        for m in 1..=4 {
            for t in stages {
                let got = optimizer_run(t, m, 2..4, Some(dir.clone()), None);
                let want = &reference[&(m, t)];
                let saver = if by_units { "ZeroModules" } else { "the plain model" };
                let label = format!("saved by {saver} at world {n} {s:?}, resumed at world {m} {t:?}");
                assert_close(&label, &got, want, 1e-6);
                assert!(
                    max_relative_error(&format!("{label}: the initial weights"), &initial, want) > 1e-3,
                    "the reference must have trained"
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A model of `ZeroModule`s saved at any world size 1-4 and stage 0-3 continues at any other,
/// where its run at the new world size and stage from the start ends.
#[test]
fn zero_modules_reshard_between_any_world_sizes_and_stages() {
    let stages = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];
    // The runs at each (world, stage) from the start: the references.
    let mut reference = std::collections::BTreeMap::new();
    for m in 1..=4 {
        for t in stages {
            reference.insert((m, t), units_run(t, m, 1, 0..4, None, None).1);
        }
    }
    let initial = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    for n in 1..=4 {
        for s in stages {
            let dir = scratch(&format!("reshard-{n}-{s:?}"));
            // Save once at (n, s) after 2 steps…
            units_run(s, n, 1, 0..2, None, Some(dir.clone()));
            // …and continue at every (m, t).
            for m in 1..=4 {
                for t in stages {
                    let got = units_run(t, m, 1, 2..4, Some(dir.clone()), None).1;
                    let want = &reference[&(m, t)];
                    let label = format!("saved at world {n} {s:?}, resumed at world {m} {t:?}");
                    assert_close(&label, &got, want, 1e-6);
                    assert!(
                        max_relative_error(&format!("{label}: the initial weights"), &initial, want) > 1e-3,
                        "the reference must have trained"
                    );
                }
            }
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

/// The plain model's checkpoint (stage 2, world 2) loads into the model of `ZeroModule`s at
/// stage 3 on 3 ranks, each block cut there, and ends where that run from the start ends.
#[test]
fn zero_optimizer_checkpoint_loads_into_stage_3() {
    let dir = scratch("optimizer-to-units");
    optimizer_run(Stage::Zero2, 2, 0..2, None, Some(dir.clone()));
    let got = units_run(Stage::Zero3, 3, 1, 2..4, Some(dir.clone()), None).1;
    let want = units_run(Stage::Zero3, 3, 1, 0..4, None, None).1;
    assert_close(
        "saved by ZeroOptimizer at world 2 Zero2, resumed by ZeroModules at world 3 Zero3",
        &got,
        &want,
        1e-6,
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A model of `ZeroModule`s at stage 3 whose load fails on a damaged shard keeps its state: its
/// weights (gathered), the step count, and the run that goes on from it is bit for bit the run
/// that never tried the load.
#[test]
fn damaged_checkpoint_leaves_stage_3_as_it_was() {
    let dir = scratch("damaged");
    let d = dir.clone();
    let results = on_ranks(2, move |rank, group| {
        let mk = || {
            init_units(
                settings(Stage::Zero3, 1),
                group.clone(),
                Net::<B>::new(&Default::default(), BLOCKS),
            )
        };
        let (model, mut straight) = mk();
        let (want, _) = train(&mut straight, model, rank, 2, 1, 0..3);

        let (model, mut optim) = mk();
        let (trained, _) = train(&mut optim, model, rank, 2, 1, 0..1);
        optim
            .save_checkpoint(&d, Some("one"), &serde_json::Value::Null)
            .expect("save");
        let (trained, _) = train(&mut optim, trained, rank, 2, 1, 1..2);
        let before = trained.weights();
        if rank == 0 {
            damage(&d.join("one/rank_00001.safetensors"));
        }
        // Both ranks wait until the damage is done.
        group.barrier().expect("barrier");
        let err = optim
            .load_checkpoint(&d, Some("one"), trained.clone())
            .expect_err("a damaged checkpoint must not load")
            .to_string();
        let unchanged = trained.weights() == before;
        let step = optim.global_step();
        let (got, _) = train(&mut optim, trained, rank, 2, 1, 2..3);
        (err, unchanged, step, got.weights() == want.weights())
    });
    let texts: Vec<&String> = results.iter().map(|r| &r.0).collect();
    assert!(
        texts
            .iter()
            .any(|t| t.contains("rank_00001.safetensors") && t.contains("checksum")),
        "{texts:?}"
    );
    for (rank, (_, unchanged, step, same_run)) in results.iter().enumerate() {
        assert!(*unchanged, "rank {rank}: the weights changed on a failed load");
        assert_eq!(*step, 2, "rank {rank}: the step count changed on a failed load");
        assert!(
            *same_run,
            "rank {rank}: the run after a failed load is not the run without it"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A `ZeroOptimizer` whose load fails on a damaged shard keeps its state: its step count, and
/// the run that goes on from it is bit for bit the run that never tried the load.
#[test]
fn damaged_checkpoint_leaves_the_optimizer_as_it_was() {
    let dir = scratch("optimizer-damaged");
    let d = dir.clone();
    let results = on_ranks(2, move |rank, group| {
        let mk = || ZeroOptimizer::new(settings(Stage::Zero2, 1), group.clone()).expect("optimizer");
        let model = || Net::<B>::new(&Default::default(), BLOCKS);
        let mut straight = mk();
        let (want, _) = train(&mut straight, model(), rank, 2, 1, 0..3);

        let mut optim = mk();
        let (trained, _) = train(&mut optim, model(), rank, 2, 1, 0..1);
        optim
            .save_checkpoint(&d, Some("one"), &serde_json::Value::Null)
            .expect("save");
        let (trained, _) = train(&mut optim, trained, rank, 2, 1, 1..2);
        if rank == 0 {
            damage(&d.join("one/rank_00001.safetensors"));
        }
        // Both ranks wait until the damage is done.
        group.barrier().expect("barrier");
        let err = optim
            .load_checkpoint(&d, Some("one"), trained.clone())
            .expect_err("a damaged checkpoint must not load")
            .to_string();
        let step = optim.global_step();
        let (got, _) = train(&mut optim, trained, rank, 2, 1, 2..3);
        (err, values::<B, _>(&got) == values::<B, _>(&want), step)
    });
    let texts: Vec<&String> = results.iter().map(|r| &r.0).collect();
    assert!(
        texts
            .iter()
            .any(|t| t.contains("rank_00001.safetensors") && t.contains("checksum")),
        "{texts:?}"
    );
    for (rank, (_, unchanged, step)) in results.iter().enumerate() {
        assert_eq!(*step, 2, "rank {rank}: the step count changed on a failed load");
        assert!(
            *unchanged,
            "rank {rank}: the run after a failed load is not the run without it"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The tags of a checkpoint directory, by name.
fn tag_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = zero_core::checkpoint::tags(dir).into_iter().map(|t| t.tag).collect();
    names.sort();
    names
}

/// A run resumed from an older tag into the directory of the run that went on from it: its
/// save is refused on every rank, naming the later tags, and nothing is written (it used to
/// replace them one by one and leave the rest beside its `latest`); `save_checkpoint_with`
/// told to discard them publishes, then removes them, and says which; `keep_last` keeps the
/// newest tags. With the state in host memory (offload) and on the device.
#[test]
fn a_resumed_run_neither_replaces_nor_orphans_the_later_tags() {
    use zero_burn::{OptimizerOffload, SaveOptions};
    for offload in [OptimizerOffload::None, OptimizerOffload::Cpu { threads: 1 }] {
        let dir = scratch(&format!("trajectory-{offload:?}").replace([' ', '{', '}', ':'], ""));
        let mk = |group: Arc<dyn ProcessGroup>| {
            let mut s = settings(Stage::Zero2, 1);
            s.offload_optimizer = offload.clone();
            ZeroOptimizer::new(s, group).expect("optimizer")
        };
        let d = dir.clone();
        on_ranks(2, |rank, group| {
            let mut optim = mk(group);
            let mut model = Net::<B>::new(&Default::default(), BLOCKS);
            for step in 0..4 {
                model = train(&mut optim, model, rank, 2, 1, step..step + 1).0;
                optim
                    .save_checkpoint(&d, None, &serde_json::json!({}))
                    .expect("the first run's save");
            }
        });
        let latest = || std::fs::read_to_string(dir.join("latest")).expect("latest");
        let d = dir.clone();
        let outcomes = on_ranks(2, |rank, group| {
            let mut optim = mk(group);
            let model = Net::<B>::new(&Default::default(), BLOCKS);
            let (model, _) = optim.load_checkpoint(&d, Some("global_step2"), model).expect("load");
            let (model, _) = train(&mut optim, model, rank, 2, 1, 2..3);
            let refused = optim
                .save_checkpoint(&d, None, &serde_json::json!({}))
                .expect_err("among the later tags")
                .to_string();
            let untouched = (
                tag_names(&d),
                std::fs::read_to_string(d.join("latest")).expect("latest"),
            );
            let discard = SaveOptions {
                discard_later_tags: true,
                ..SaveOptions::default()
            };
            let saved = optim
                .save_checkpoint_with(&d, None, &serde_json::json!({}), discard)
                .expect("discarding");
            // Its own tags from here on: kept, two at most.
            let keep = SaveOptions {
                keep_last: std::num::NonZeroUsize::new(2),
                ..SaveOptions::default()
            };
            let (model, _) = train(&mut optim, model, rank, 2, 1, 3..4);
            let rotated = optim
                .save_checkpoint_with(&d, None, &serde_json::json!({}), keep)
                .expect("keeping two");
            drop(model);
            (refused, untouched, saved, rotated)
        });
        let names = |tags: &[zero_core::checkpoint::SavedTag]| tags.iter().map(|t| t.tag.clone()).collect::<Vec<_>>();
        for (rank, (refused, untouched, saved, _)) in outcomes.iter().enumerate() {
            assert!(
                refused.contains("global_step3, global_step4 (2 tags, steps 3 to 4)")
                    && refused.contains("saved after step 2")
                    && refused.contains("discard_later_tags"),
                "{offload:?} rank {rank}: {refused}"
            );
            assert_eq!(
                untouched.0,
                ["global_step1", "global_step2", "global_step3", "global_step4"]
            );
            assert_eq!(untouched.1, "global_step4", "latest unmoved by the refusal");
            assert_eq!(saved.tag_dir, dir.join("global_step3"));
            if rank == 0 {
                assert_eq!(names(&saved.discarded), ["global_step3", "global_step4"], "{offload:?}");
            }
        }
        let (_, _, _, rotated) = &outcomes[0];
        assert_eq!(names(&rotated.rotated), ["global_step1", "global_step2"], "{offload:?}");
        assert_eq!(tag_names(&dir), ["global_step3", "global_step4"]);
        assert_eq!(latest(), "global_step4");
        let meta = zero_core::checkpoint::Checkpoint::open(&dir, None)
            .expect("latest opens")
            .meta;
        assert_eq!(meta.global_step, 4);
        std::fs::remove_dir_all(&dir).ok();
    }
}
