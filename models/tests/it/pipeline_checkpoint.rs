//! Checkpoints of a pipelined GPT-2: save after step 2, resume into fresh engines, train to
//! step 4, and compare with the uninterrupted run; consolidate the checkpoint into the whole
//! model's weights.
//!
//! References: the uninterrupted pipeline run of the same layout (resuming must be bit for
//! bit), and zero-models' single `Gpt2` trained by `ZeroOptimizer` on one process for the
//! consolidated weights (same initial weights, same micro-batches, same SGD; equal to fp32
//! rounding, as the pipeline itself is in `pipeline_gpt2.rs`).

use crate::pipeline_support;
use burn::prelude::*;
use pipeline_support::{micro_batch, B};
use std::collections::HashMap;
use std::path::Path;
use zero_burn::params::{describe, read_values};
use zero_burn::pipeline::{PartitionMethod, PipelineEngine, PipelineModule};
use zero_burn::{EngineSettings, Stage};
use zero_core::checkpoint::{to_fp32, Checkpoint, SINGLE_FILE};
use zero_core::comm::ThreadGroup;
use zero_core::parallel::ParallelLayout;
use zero_models::gpt2::{Gpt2, Gpt2Config, Gpt2Layer};
use zero_test_support::{max_abs, max_abs_diff};

fn config() -> Gpt2Config {
    pipeline_support::config(3)
}

fn full_model(device: &Device<B>) -> Gpt2<B> {
    pipeline_support::full_model(&config(), device)
}

const MICRO: usize = 2;

fn settings(micro_batches: usize, stage: Stage) -> EngineSettings {
    pipeline_support::sgd_settings(micro_batches, stage)
}

/// Per rank: its stage's first layer, its layers' weights (per layer, per parameter), and the
/// losses of the steps run.
type RankOutcome = (usize, Vec<Vec<Vec<f32>>>, Vec<f32>);

/// Runs PP `stages` × DP `data` from step `from` to `to`: loading `load` first, saving into
/// `save` after step `save_at`.
fn run(
    data: usize,
    stages: usize,
    stage: Stage,
    from: usize,
    to: usize,
    load: Option<&Path>,
    save: Option<(&Path, usize)>,
) -> Vec<RankOutcome> {
    let groups = ParallelLayout::with_pipeline(data, 1, stages)
        .unwrap()
        .threads()
        .unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|groups| {
                s.spawn(move || {
                    let device = Default::default();
                    let layers = full_model(&device).into_pipeline_layers();
                    let module = PipelineModule::from_layers::<B>(
                        layers,
                        stages,
                        PartitionMethod::Uniform,
                        groups.coords.pipeline,
                    )
                    .unwrap();
                    let first = module.range.start;
                    let mut engine =
                        PipelineEngine::<B, Gpt2Layer<B>>::new(settings(MICRO, stage), module, &groups).unwrap();
                    if let Some(dir) = load {
                        let client = engine.load_checkpoint(dir, None).unwrap();
                        assert_eq!(client["step"], from, "the client state comes back");
                        assert_eq!(engine.global_step(), from as u64, "the step count comes back");
                    }
                    let d = groups.coords.data;
                    let mut losses = Vec::new();
                    for step in from..to {
                        let batches: Vec<_> = (0..MICRO).map(|m| micro_batch(step, d * MICRO + m, &device)).collect();
                        losses.push(engine.train_batch(&batches).unwrap().loss);
                        if let Some((dir, at)) = save {
                            if step + 1 == at {
                                engine
                                    .save_checkpoint(dir, None, &serde_json::json!({ "step": at }))
                                    .unwrap();
                            }
                        }
                    }
                    let weights = engine
                        .layers()
                        .iter()
                        .map(|layer| {
                            let mut params = Vec::new();
                            read_values::<B, _>(layer, |_, v| params.push(v));
                            params
                        })
                        .collect();
                    (first, weights, losses)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The single model trained for `steps` on one process over the same global batches.
fn single_process(data: usize, steps: usize) -> HashMap<String, Vec<f32>> {
    let device = Default::default();
    let group = ThreadGroup::new_group(1).unwrap().remove(0);
    let m = data * MICRO;
    let (_, _, model) = pipeline_support::zero_optimizer_run(
        settings(m, Stage::Zero0),
        full_model(&device),
        group,
        steps,
        |step, micro| micro_batch(step, micro, &device),
    );
    let names: Vec<String> = describe::<B, _>(&model).into_iter().map(|(_, s)| s.name).collect();
    let mut out = HashMap::new();
    read_values::<B, _>(&model, |i, v| {
        out.insert(names[i].clone(), v);
    });
    out
}

fn check(data: usize, stages: usize, stage: Stage) {
    let label = format!("PP {stages} × DP {data} ({stage:?})");
    let dir = tempfile::tempdir().unwrap();
    let whole = run(data, stages, stage, 0, 4, None, Some((dir.path(), 2)));
    let resumed = run(data, stages, stage, 2, 4, Some(dir.path()), None);
    for ((first, w_whole, l_whole), (first_r, w_resumed, l_resumed)) in whole.iter().zip(&resumed) {
        assert_eq!(first, first_r);
        assert_eq!(
            &l_whole[2..],
            &l_resumed[..],
            "{label}: losses of steps 3 and 4 after resuming"
        );
        assert!(
            w_whole == w_resumed,
            "{label}: the stage from layer {first} ends with other weights after resuming"
        );
    }

    // Consolidated (what `zero to-fp32` writes) against the single process after 2 steps.
    let ckpt = Checkpoint::open(dir.path(), None).unwrap();
    assert_eq!(ckpt.meta.world_size, data, "{label}: one shard file per data rank");
    ckpt.verify().unwrap();
    let out = dir.path().join("fp32");
    to_fp32(&ckpt, &out, None, &|n| Some(n.to_string())).unwrap();
    let bytes = std::fs::read(out.join(SINGLE_FILE)).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let want = single_process(data, 2);
    let got = |name: &str| -> Vec<f32> {
        let t = file
            .tensor(name)
            .unwrap_or_else(|_| panic!("{label}: no `{name}` in the consolidated file"));
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    for (name, w) in &want {
        let what = format!("{label}: `{name}` against one process");
        let (scale, diff) = (max_abs(&what, w), max_abs_diff(&what, &got(name), w));
        assert!(diff <= 1e-5 * scale.max(1.0), "{what}: differs by {diff:e}");
    }
    assert_eq!(
        got("lm_head.weight"),
        got("wte.weight"),
        "{label}: the head's tied copy equals wte"
    );
    assert_eq!(
        file.names().len(),
        want.len() + 1,
        "{label}: the model's tensors and the tied head copy"
    );
}

#[test]
fn two_stages_resume_bit_for_bit_and_consolidate() {
    check(1, 2, Stage::Zero0);
}

#[test]
fn two_stages_times_two_data_ranks_resume_bit_for_bit_and_consolidate() {
    check(2, 2, Stage::Zero1);
}

/// Stage 2's layout (the tied copies in groups of their own) saves and resumes the same way.
#[test]
fn two_stages_times_two_data_ranks_under_zero_2_resume_bit_for_bit_and_consolidate() {
    check(2, 2, Stage::Zero2);
}

/// The checkpoint is the whole model's, so another cut resumes it: saved by PP 2, resumed by
/// PP 4 and PP 3 (the same data: one data rank). Reference: the uninterrupted PP 2 run; equal to fp32 rounding (the
/// global norm's partial sums meet in another grouping, so the clipping factor may differ in
/// its last bits).
#[test]
fn a_two_stage_checkpoint_resumes_on_other_cuts() {
    let dir = tempfile::tempdir().unwrap();
    let whole = run(1, 2, Stage::Zero1, 0, 4, None, Some((dir.path(), 2)));
    let mut want: Vec<Vec<Vec<f32>>> = Vec::new();
    for (first, layers, _) in &whole {
        for (i, l) in layers.iter().enumerate() {
            if want.len() <= first + i {
                want.resize(first + i + 1, Vec::new());
            }
            want[first + i] = l.clone();
        }
    }
    let want_losses = &whole[0].2[2..];
    for (data, stages) in [(1, 4), (1, 3)] {
        let resumed = run(data, stages, Stage::Zero1, 2, 4, Some(dir.path()), None);
        let mut seen = vec![false; want.len()];
        for (first, layers, losses) in &resumed {
            assert_eq!(losses.len(), want_losses.len(), "PP {stages} × DP {data}: steps");
            for (got, w) in losses.iter().zip(want_losses) {
                assert!(
                    (got - w).abs() <= 1e-5 * w.abs(),
                    "PP {stages} × DP {data}: loss {got} vs {w}"
                );
            }
            for (i, layer) in layers.iter().enumerate() {
                let what = format!("PP {stages} × DP {data}: layer {}", first + i);
                let diff = max_abs_diff(&what, layer, &want[first + i]);
                assert!(diff <= 1e-5, "{what} differs by {diff:e}");
                seen[first + i] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "every layer was resumed");
    }
}

/// Stage 0 keeps whole replicas: data rank 0's file holds every group, data rank 1 sends none.
#[test]
fn two_stages_times_two_data_ranks_under_zero_0_resume_bit_for_bit_and_consolidate() {
    check(2, 2, Stage::Zero0);
}
