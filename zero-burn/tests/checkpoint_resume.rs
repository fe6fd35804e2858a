//! Checkpoints of `ChainEngine` and of `ZeroOptimizer` (in Burn's loop): exact resume at every
//! stage, resharding to any world size and stage (and between the two), an engine or optimizer
//! left untouched by a damaged checkpoint, and the consolidated exports.
//!
//! References: for exact resume, the same run without the stop (losses and parameters must be
//! bit-identical); for resharding, the run at the new world size and stage from the start
//! (which tests/exactness.rs ties to a single process), within fp32 rounding (1e-6 relative).

mod common;

use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use common::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_burn::{ChainEngine, EngineSettings, Stage, ZeroOptimizer};
use zero_core::checkpoint::{to_fp32, Checkpoint, HalfDtype, NameMap};

const BLOCKS: usize = 3;

fn settings(stage: Stage, gas: usize) -> EngineSettings {
    let mut s = EngineSettings::new(stage, common::adamw_eps4(0.01));
    s.gradient_accumulation_steps = gas;
    s.reduce_bucket_size = 100;
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

/// Trains `steps` on a chain engine; returns this rank's micro-batch losses.
fn train_chain(
    e: &mut ChainEngine<B, Net<B>>,
    rank: usize,
    world: usize,
    gas: usize,
    steps: std::ops::Range<usize>,
) -> Vec<f32> {
    let device = Default::default();
    let mut losses = Vec::new();
    for step in steps {
        for micro in 0..gas {
            let loss = e
                .forward(batch::<B>(step, rows(rank, world, micro, gas), &device))
                .expect("forward");
            losses.push(e.backward(loss).expect("backward"));
            e.step().expect("step");
        }
    }
    losses
}

/// Trains steps `steps` of `model` with `optim` in Burn's loop, at the rates of the optimizer's
/// own schedule (`lr_scheduler`, whose position a loaded checkpoint restores); returns the model
/// and this rank's losses.
fn train_optimizer(
    optim: &mut ZeroOptimizer,
    mut model: Net<B>,
    rank: usize,
    world: usize,
    steps: std::ops::Range<usize>,
) -> (Net<B>, Vec<f32>) {
    let device = Default::default();
    let mut lr = optim.lr_scheduler();
    let mut losses = Vec::new();
    for step in steps {
        let (x, y) = batch::<B>(step, rows(rank, world, 0, 1), &device);
        let loss = model.loss(x, y);
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.try_step(lr.step(), model, grads).expect("step");
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
        let (model, _) = train_optimizer(&mut optim, model, rank, world, steps.clone());
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

/// (losses of every rank, parameters of rank 0) of a chain run: `0..stop` steps, then (when
/// `dir` is given) save, a fresh engine at `(world2, stage2)`, load, and `stop..total`.
#[allow(clippy::too_many_arguments)]
fn chain_run(
    stage: Stage,
    world: usize,
    gas: usize,
    stop: usize,
    total: usize,
    resume: Option<(PathBuf, Stage, usize)>,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let dir = resume.as_ref().map(|r| r.0.clone());
    // Phase 1 (or the whole uninterrupted run).
    let end = if resume.is_some() { stop } else { total };
    let out = on_ranks(world, move |rank, group| {
        let model = Net::<B>::new(&Default::default(), BLOCKS);
        let mut e = ChainEngine::new(settings(stage, gas), model, group).expect("engine");
        let losses = train_chain(&mut e, rank, world, gas, 0..end);
        if let Some(dir) = &dir {
            e.save_checkpoint(dir, None, &serde_json::json!({ "next_step": end }))
                .expect("save");
        }
        (losses, values::<B, _>(&e.module().expect("module")))
    });
    let Some((dir, stage2, world2)) = resume else {
        let (losses, params): (Vec<_>, Vec<_>) = out.into_iter().unzip();
        return (losses, params.into_iter().next().unwrap_or_default());
    };
    let first: Vec<Vec<f32>> = out.into_iter().map(|(l, _)| l).collect();
    let out = on_ranks(world2, move |rank, group| {
        let model = Net::<B>::new(&Default::default(), BLOCKS);
        let mut e = ChainEngine::new(settings(stage2, gas), model, group).expect("engine");
        let client = e.load_checkpoint(&dir, None).expect("load");
        assert_eq!(client["next_step"], stop, "client state");
        assert_eq!(e.global_step(), stop as u64);
        let losses = train_chain(&mut e, rank, world2, gas, stop..total);
        (losses, values::<B, _>(&e.module().expect("module")))
    });
    let (second, params): (Vec<_>, Vec<_>) = out.into_iter().unzip();
    let losses = if world2 == world {
        first
            .into_iter()
            .zip(second)
            .map(|(mut a, b)| {
                a.extend(b);
                a
            })
            .collect()
    } else {
        second
    };
    (losses, params.into_iter().next().unwrap_or_default())
}

#[test]
fn chain_engine_resumes_exactly_at_every_stage() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1, 3] {
            let dir = scratch(&format!("exact-{stage:?}-{world}"));
            let (want_losses, want) = chain_run(stage, world, 2, 3, 6, None);
            let (losses, got) = chain_run(stage, world, 2, 3, 6, Some((dir.clone(), stage, world)));
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
                let (mut model, mut losses) = train_optimizer(&mut optim, model, rank, world, 0..2);
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
                let (model, more) = train_optimizer(&mut optim, model, rank, world, 2..4);
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

/// `ZeroOptimizer` continues from a checkpoint saved at another world size and stage, by itself
/// or by `ChainEngine` at stage 3, where its own run at the new world size and stage from the
/// start ends.
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
    for (n, s, by_chain) in [
        (1, Stage::Zero0, false),
        (2, Stage::Zero2, false),
        (3, Stage::Zero1, false),
        (2, Stage::Zero3, true),
    ] {
        let dir = scratch(&format!("optimizer-reshard-{n}-{s:?}-{by_chain}"));
        if by_chain {
            let d = dir.clone();
            on_ranks(n, move |rank, group| {
                let mut e = ChainEngine::new(settings(s, 1), Net::<B>::new(&Default::default(), BLOCKS), group)
                    .expect("engine");
                train_chain(&mut e, rank, n, 1, 0..2);
                e.save_checkpoint(&d, None, &serde_json::json!({ "next_step": 2 }))
                    .expect("save");
            });
        } else {
            optimizer_run(s, n, 0..2, None, Some(dir.clone()));
        }
        for m in 1..=4 {
            for t in stages {
                let got = optimizer_run(t, m, 2..4, Some(dir.clone()), None);
                let want = &reference[&(m, t)];
                let err = max_relative_error(&got, want);
                let saver = if by_chain { "ChainEngine" } else { "ZeroOptimizer" };
                assert!(
                    err < 1e-6,
                    "saved by {saver} at world {n} {s:?}, resumed at world {m} {t:?}: relative error {err:e}"
                );
                assert!(
                    max_relative_error(&initial, want) > 1e-3,
                    "the reference must have trained"
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn reshards_between_any_world_sizes_and_stages() {
    let stages = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];
    // The runs at each (world, stage) from the start: the references.
    let mut reference = std::collections::BTreeMap::new();
    for m in 1..=4 {
        for t in stages {
            reference.insert((m, t), chain_run(t, m, 1, 2, 4, None).1);
        }
    }
    let initial = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    for n in 1..=4 {
        for s in stages {
            let dir = scratch(&format!("reshard-{n}-{s:?}"));
            // Save once at (n, s) after 2 steps…
            let d = dir.clone();
            on_ranks(n, move |rank, group| {
                let mut e = ChainEngine::new(settings(s, 1), Net::<B>::new(&Default::default(), BLOCKS), group)
                    .expect("engine");
                train_chain(&mut e, rank, n, 1, 0..2);
                e.save_checkpoint(&d, None, &serde_json::json!({ "next_step": 2 }))
                    .expect("save");
            });
            // …and continue at every (m, t).
            for m in 1..=4 {
                for t in stages {
                    let d = dir.clone();
                    let got = on_ranks(m, move |rank, group| {
                        let mut e = ChainEngine::new(settings(t, 1), Net::<B>::new(&Default::default(), BLOCKS), group)
                            .expect("engine");
                        e.load_checkpoint(&d, None).expect("load");
                        train_chain(&mut e, rank, m, 1, 2..4);
                        values::<B, _>(&e.module().expect("module"))
                    });
                    let want = &reference[&(m, t)];
                    let err = max_relative_error(&got[0], want);
                    assert!(
                        err < 1e-6,
                        "saved at world {n} {s:?}, resumed at world {m} {t:?}: relative error {err:e}"
                    );
                    assert!(
                        max_relative_error(&initial, want) > 1e-3,
                        "the reference must have trained"
                    );
                }
            }
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

#[test]
fn zero_optimizer_checkpoint_loads_into_stage_3() {
    let dir = scratch("optimizer-to-chain");
    optimizer_run(Stage::Zero2, 2, 0..2, None, Some(dir.clone()));
    let d = dir.clone();
    let got = on_ranks(3, move |rank, group| {
        let mut e = ChainEngine::new(
            settings(Stage::Zero3, 1),
            Net::<B>::new(&Default::default(), BLOCKS),
            group,
        )
        .expect("engine");
        e.load_checkpoint(&d, None)
            .expect("a ZeroOptimizer checkpoint loads into a ChainEngine");
        train_chain(&mut e, rank, 3, 1, 2..4);
        values::<B, _>(&e.module().expect("module"))
    });
    let want = chain_run(Stage::Zero3, 3, 1, 2, 4, None).1;
    let err = max_relative_error(&got[0], &want);
    assert!(err < 1e-6, "relative error {err:e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Flips one byte near the end of a file.
fn damage(path: &Path) {
    let mut bytes = std::fs::read(path).expect("read shard");
    let i = bytes.len() - 5;
    bytes[i] ^= 0x40;
    std::fs::write(path, bytes).expect("write shard");
}

#[test]
fn damaged_checkpoint_leaves_the_engine_as_it_was() {
    let dir = scratch("damaged");
    let d = dir.clone();
    let results = on_ranks(2, move |rank, group| {
        let mut e = ChainEngine::new(
            settings(Stage::Zero3, 1),
            Net::<B>::new(&Default::default(), BLOCKS),
            group,
        )
        .expect("engine");
        train_chain(&mut e, rank, 2, 1, 0..1);
        e.save_checkpoint(&d, Some("one"), &serde_json::Value::Null)
            .expect("save");
        train_chain(&mut e, rank, 2, 1, 1..2);
        let before = values::<B, _>(&e.module().expect("module"));
        if rank == 0 {
            damage(&d.join("one/rank_00001.safetensors"));
        }
        // Both ranks wait until the damage is done (a collective is a barrier).
        let _ = e.module().expect("module");
        let err = e
            .load_checkpoint(&d, Some("one"))
            .expect_err("a damaged checkpoint must not load")
            .to_string();
        let after = values::<B, _>(&e.module().expect("module"));
        (err, before == after, e.global_step())
    });
    let texts: Vec<&String> = results.iter().map(|r| &r.0).collect();
    assert!(
        texts
            .iter()
            .any(|t| t.contains("rank_00001.safetensors") && t.contains("checksum")),
        "{texts:?}"
    );
    for (_, unchanged, step) in &results {
        assert!(*unchanged, "the engine's weights changed on a failed load");
        assert_eq!(*step, 2);
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
        let (want, _) = train_optimizer(&mut straight, model(), rank, 2, 0..3);

        let mut optim = mk();
        let (trained, _) = train_optimizer(&mut optim, model(), rank, 2, 0..1);
        optim
            .save_checkpoint(&d, Some("one"), &serde_json::Value::Null)
            .expect("save");
        let (trained, _) = train_optimizer(&mut optim, trained, rank, 2, 1..2);
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
        let (got, _) = train_optimizer(&mut optim, trained, rank, 2, 2..3);
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

#[test]
fn exports_match_the_model_stage_3() {
    let dir = scratch("export");
    let d = dir.clone();
    let results = on_ranks(3, move |rank, group| {
        let mut e = ChainEngine::new(
            settings(Stage::Zero3, 1),
            Net::<B>::new(&Default::default(), BLOCKS),
            group,
        )
        .expect("engine");
        train_chain(&mut e, rank, 3, 1, 0..2);
        e.save_16bit_model(d.join("bf16/model.safetensors"), HalfDtype::Bf16)
            .expect("16-bit save");
        let map = NameMap {
            rules: vec![NameMap::parse_rule("ends.=").expect("rule")],
        };
        e.save_weights(d.join("f32/model.safetensors"), None, &|n| map.apply(n))
            .expect("f32 save");
        e.save_checkpoint(d.join("ckpt"), None, &serde_json::Value::Null)
            .expect("save");
        let names: Vec<String> = e.layout().params.iter().map(|p| p.name.clone()).collect();
        (names, values::<B, _>(&e.module().expect("module")))
    });
    let (names, want) = &results[0];
    let read = |path: PathBuf| {
        let bytes = std::fs::read(&path).expect("exported file");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
        st.tensors()
            .into_iter()
            .map(|(n, v)| (n, (v.dtype(), v.data().to_vec())))
            .collect::<std::collections::HashMap<_, _>>()
    };
    let bf16 = read(dir.join("bf16/model.safetensors"));
    let f32s = read(dir.join("f32/model.safetensors"));
    let c = Checkpoint::open(&dir.join("ckpt"), None).expect("open");
    to_fp32(&c, &dir.join("consolidated"), None, &|n| Some(n.to_string())).expect("to_fp32");
    let consolidated = read(dir.join("consolidated/model.safetensors"));
    assert_eq!(bf16.len(), names.len());
    for (name, values) in names.iter().zip(want) {
        // Reference: the model's own weights, rounded to bf16 by `half`.
        let expect_bf16: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        let expect_f32: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (dtype, bytes) = (&bf16[name].0, &bf16[name].1);
        assert_eq!(*dtype, safetensors::Dtype::BF16);
        assert_eq!(bytes, &expect_bf16, "{name} in the 16-bit export");
        let short = name.strip_prefix("ends.").unwrap_or(name);
        assert_eq!(f32s[short].1, expect_f32, "{short} in the renamed f32 export");
        assert_eq!(
            consolidated[name].1, expect_f32,
            "{name} consolidated from the checkpoint"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn saving_between_accumulation_boundaries_is_refused() {
    let dir = scratch("mid-accumulation");
    let d = dir.clone();
    let errors = on_ranks(2, move |rank, group| {
        let mut e = ChainEngine::new(
            settings(Stage::Zero2, 2),
            Net::<B>::new(&Default::default(), BLOCKS),
            group,
        )
        .expect("engine");
        let loss = e
            .forward(batch::<B>(0, rows(rank, 2, 0, 2), &Default::default()))
            .expect("forward");
        e.backward(loss).expect("backward");
        e.save_checkpoint(&d, None, &serde_json::Value::Null)
            .expect_err("half a step must not be saved")
            .to_string()
    });
    assert!(
        errors.iter().all(|e| e.contains("accumulation boundaries")),
        "{errors:?}"
    );
    assert!(!dir.join("latest").exists(), "nothing may be written");
    std::fs::remove_dir_all(&dir).ok();
}
