//! GPT-2 trained in Burn's own loop with `zero_burn::initialize`: the zoo's `ShardedGpt2`
//! (embeddings, tied to the LM head, and every block a `ZeroModule`), `ZeroOptimizer`, Burn's
//! `GradientsAccumulator`, ranks as threads under `Autodiff<Flex, BalancedCheckpointing>`.
//!
//! References:
//! - PyTorch: tools/gpt2_train_reference.py's trajectory (examples/tests/fixtures/
//!   train_reference.json: torch.optim.AdamW and clip_grad_norm_ on the tiny HuggingFace
//!   checkpoint and the fixture batch), each step's loss to 1e-5 and gradient norm to 1e-4.
//! - One process: the plain `Gpt2` trained by Burn's own AdamW over the whole batch, the
//!   gradients clipped by their global norm in the test (torch's rule), every unit's parameters
//!   after 5 steps to 1e-6 of the largest.

mod support;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::prelude::*;
use std::sync::Arc;
use support::*;
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::config::DeepSpeedConfig;
use zero_models::gpt2::{Gpt2, ShardedGpt2};

type B = Autodiff<Flex, BalancedCheckpointing>;
type Batch = Vec<Vec<u32>>;

/// The tiny HuggingFace GPT-2 fixture.
fn fixture_gpt2() -> Gpt2<B> {
    Gpt2::<B>::load_pretrained(fixture_model(), &Default::default())
        .expect("the fixture loads")
        .0
}

fn tokens(rows: &[Vec<u32>]) -> Tensor<B, 2, Int> {
    let (n, seq) = (rows.len(), rows[0].len());
    let flat: Vec<i64> = rows.iter().flatten().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(flat, [n, seq]), &Default::default())
}

/// `body(rank, group)` on `world` rank threads; the results in rank order.
fn on_ranks<T: Send>(world: usize, body: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync) -> Vec<T> {
    let groups = ThreadGroup::new_group(world).expect("thread group");
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let body = &body;
                s.spawn(move || body(rank, group))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Each unit's flat vector (whole, or this rank's shard) in the model's order, then `ln_f`'s
/// parameters.
fn parts(model: &ShardedGpt2<B>) -> Vec<Vec<f32>> {
    let values = |p: &Param<Tensor<B, 1>>| p.val().into_data().convert::<f32>().to_vec::<f32>().expect("f32");
    let mut parts = vec![values(model.embed.shard())];
    parts.extend(model.blocks.iter().map(|b| values(b.shard())));
    let mut ln_f = Vec::new();
    zero_burn::params::read_values::<B, _>(&model.ln_f, |_, v| ln_f.extend(v));
    parts.push(ln_f);
    parts
}

/// What one rank saw: each step's loss (mean over its micro-batches) and gradient norm, and
/// its parts at the end.
struct RankRun {
    losses: Vec<f64>,
    norms: Vec<f64>,
    /// Whether each step was skipped (fp16 overflow).
    skipped: Vec<bool>,
    parts: Vec<Vec<f32>>,
    /// The optimizer's memory report after the last step.
    memory: zero_burn::MemoryReport,
}

/// `steps` steps of the fixture's `ShardedGpt2` on `world` ranks from the config `config`,
/// each step the whole `batch`: rank r takes its `micro * gas` rows, `gas` micro-batches of
/// `micro`, the loss divided by `gas` (and scaled by the optimizer: fp16) before backward, the
/// gradients summed by Burn's accumulator.
fn train_zero(config: &str, world: usize, micro: usize, gas: usize, batch: &Batch, steps: usize) -> Vec<RankRun> {
    train_zero_between(config, world, micro, gas, batch, steps, RunOptions::default())
}

/// Where a run starts from and saves to (`ZeroOptimizer`'s sharded checkpoints), and how the
/// optimizer keeps its state.
#[derive(Clone, Copy, Default)]
struct RunOptions<'a> {
    load: Option<&'a std::path::Path>,
    save: Option<&'a std::path::Path>,
    /// `Some(false)`: the state in host buffers (the fused CPU step) without offload; `None`:
    /// `initialize`'s choice, tensors on the model's device.
    tensors: Option<bool>,
    /// Each rank resumes from its own model and its optimizer's Burn record (index = rank).
    records_in: Option<&'a [Saved]>,
    /// Each rank leaves its model and its optimizer's Burn record here (index = rank).
    records_out: Option<&'a std::sync::Mutex<Vec<Option<Saved>>>>,
}

/// A rank's model record and `ZeroOptimizer::to_record`, written by a Burn recorder (bytes: the
/// loading run gets tensors of its own).
#[derive(Clone)]
struct Saved {
    model: Vec<u8>,
    optim: Vec<u8>,
}

/// [`train_zero`] resumed from `options.load` (the steps are then those after it) and saved to
/// `options.save` at the end.
fn train_zero_between(
    config: &str,
    world: usize,
    micro: usize,
    gas: usize,
    batch: &Batch,
    steps: usize,
    options: RunOptions,
) -> Vec<RankRun> {
    // Tensors unless host buffers are asked for or the optimizer is offloaded.
    let tensors = options.tensors.unwrap_or(true) && !config.contains("offload_optimizer");
    let config = DeepSpeedConfig::from_str(config, "ds_config.json")
        .expect("valid config")
        .config;
    on_ranks(world, |rank, group| {
        let (mut model, mut optim) =
            zero_burn::initialize(&config, fixture_gpt2().into_sharded(), group).expect("initialize");
        if let Some(t) = options.tensors {
            optim = optim.with_tensor_state(t);
        }
        if let Some(dir) = options.load {
            model = optim.load_checkpoint(dir, None, model).expect("load").0;
        }
        let recorder = burn::record::BinBytesRecorder::<burn::record::FullPrecisionSettings>::default();
        if let Some(saved) = options.records_in {
            let record = burn::record::Recorder::<B>::load(&recorder, saved[rank].model.clone(), &Default::default())
                .expect("read the model record");
            model = model.load_record(record);
            let record = burn::record::Recorder::<B>::load(&recorder, saved[rank].optim.clone(), &Default::default())
                .expect("read the optimizer record");
            optim = optim.load_record(record);
        }
        let mut lr = optim.lr_scheduler();
        let mine = &batch[rank * micro * gas..(rank + 1) * micro * gas];
        let (mut losses, mut norms, mut skipped) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..steps {
            let mut accumulator = GradientsAccumulator::new();
            let mut loss_sum = 0.0;
            for chunk in mine.chunks(micro) {
                let t = tokens(chunk);
                let loss = model.loss(t.clone(), t).expect("forward");
                loss_sum += loss.clone().into_scalar() as f64;
                let scaled = optim.scale_loss(loss.div_scalar(gas as f32));
                let grads = GradientsParams::from_grads(scaled.backward(), &model);
                accumulator.accumulate(&model, grads);
            }
            model = optim.step(
                burn::optim::lr_scheduler::LrScheduler::step(&mut lr),
                model,
                accumulator.grads(),
            );
            losses.push(loss_sum / gas as f64);
            let report = optim.last_step().expect("a step");
            norms.push(report.grad_norm);
            skipped.push(report.skipped);
        }
        if let Some(dir) = options.save {
            optim.save_checkpoint(dir, None, &serde_json::json!({})).expect("save");
        }
        if let Some(out) = options.records_out {
            let optim = burn::record::Recorder::<B>::record(&recorder, optim.to_record(), ()).expect("record");
            let model =
                burn::record::Recorder::<B>::record(&recorder, model.clone().into_record(), ()).expect("record");
            out.lock().expect("records")[rank] = Some(Saved { model, optim });
        }
        assert_eq!(optim.tensor_state(), Some(tensors), "where the optimizer's state lives");
        RankRun {
            losses,
            norms,
            skipped,
            parts: parts(&model),
            memory: optim.memory(),
        }
    })
}

/// The ranks' parts put together: each unit's shards in rank order cut to the unit's length
/// (`lens`); replicated parts (a unit kept whole, `ln_f`) from rank 0, after checking that every
/// rank holds the same.
fn put_together(runs: &[RankRun], lens: &[usize]) -> Vec<Vec<f32>> {
    lens.iter()
        .enumerate()
        .map(|(u, &len)| {
            if runs[0].parts[u].len() == len {
                for (rank, run) in runs.iter().enumerate() {
                    assert_eq!(
                        run.parts[u], runs[0].parts[u],
                        "replicated part {u} differs on rank {rank}"
                    );
                }
                runs[0].parts[u].clone()
            } else {
                runs.iter().flat_map(|r| r.parts[u].clone()).take(len).collect()
            }
        })
        .collect()
}

#[test]
fn stage_3_through_initialize_follows_pytorch_step_by_step() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_reference.json")).expect("fixture"))
            .expect("json");
    let want_losses: Vec<f64> = serde_json::from_value(reference["losses"].clone()).expect("losses");
    let want_norms: Vec<f64> = serde_json::from_value(reference["grad_norms"].clone()).expect("norms");
    let batch: Batch =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_tokens.json")).expect("tokens")).expect("json");
    let config = std::fs::read_to_string(fixture("train_config.json")).expect("config");
    // The fixture's config: 8 sequences, micro-batch 1, accumulation 2, clipping at 1, stage 3.
    let runs = train_zero(&config, 4, 1, 2, &batch, want_losses.len());
    let whole = parts(&fixture_gpt2().into_sharded());
    for (u, part) in whole.iter().enumerate().take(whole.len() - 1) {
        assert!(
            runs[0].parts[u].len() < part.len(),
            "unit {u} is sharded over the 4 ranks"
        );
    }
    for step in 0..want_losses.len() {
        let loss = runs.iter().map(|r| r.losses[step]).sum::<f64>() / runs.len() as f64;
        let err = (loss - want_losses[step]).abs() / want_losses[step];
        assert!(
            err < 1e-5,
            "step {step}: loss {loss} against PyTorch's {} ({err:e})",
            want_losses[step]
        );
        for (rank, run) in runs.iter().enumerate() {
            let norm = run.norms[step];
            let err = (norm - want_norms[step]).abs() / want_norms[step];
            assert!(
                err < 1e-4,
                "step {step}, rank {rank}: gradient norm {norm} against PyTorch's {} ({err:e})",
                want_norms[step]
            );
        }
    }
}

/// 24 sequences of 16 tokens (24 splits over 1-4 ranks times accumulation 1 or 2).
fn matrix_batch() -> Batch {
    (0..24)
        .map(|r| (0..16).map(|c| ((r * 37 + c * 11 + r * c) % 509) as u32).collect())
        .collect()
}

const EPS: f32 = 1e-4;
const LR: f64 = 1e-3;
const STEPS: usize = 5;

/// The reference: the plain fixture model on one process, Burn's AdamW over the whole batch,
/// the gradients scaled by torch's `clip_grad_norm_` rule at `clip` (0: none). Its parts as
/// [`parts`] reads them.
fn one_process(batch: &Batch, clip: f64) -> Vec<Vec<f32>> {
    let mut model = fixture_gpt2();
    let mut optim = AdamWConfig::new().with_epsilon(EPS).with_weight_decay(0.01).init();
    for _ in 0..STEPS {
        let t = tokens(batch);
        let mut grads = GradientsParams::from_grads(model.loss(t.clone(), t).backward(), &model);
        if clip > 0.0 {
            clip_by_global_norm(&model, &mut grads, clip);
        }
        model = optim.step(LR, model, grads);
    }
    parts(&model.into_sharded())
}

/// torch's `clip_grad_norm_`: every gradient times `clip / (norm + 1e-6)` when that is below 1.
fn clip_by_global_norm(model: &Gpt2<B>, grads: &mut GradientsParams, clip: f64) {
    struct Norm<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor<B> for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.get::<Flex, D>(param.id) {
                let v = g.into_data().to_vec::<f32>().expect("f32");
                self.1 += v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
            }
        }
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.remove::<Flex, D>(param.id) {
                self.0.register(param.id, g.mul_scalar(self.1));
            }
        }
    }
    let mut norm = Norm(grads, 0.0);
    model.visit(&mut norm);
    let coef = clip / (norm.1.sqrt() + 1e-6);
    if coef < 1.0 {
        model.visit(&mut Scale(grads, coef as f32));
    }
}

/// max |got - want| / max |want|.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

fn matrix_config(stage: u8, world: usize, gas: usize, clip: f64) -> String {
    matrix_config_offload(stage, world, gas, clip, false)
}

/// [`matrix_config`], with the optimizer's state in host memory when `offload`.
fn matrix_config_offload(stage: u8, world: usize, gas: usize, clip: f64, offload: bool) -> String {
    let offload = if offload {
        r#", "offload_optimizer": {"device": "cpu"}"#
    } else {
        ""
    };
    format!(
        r#"{{"train_batch_size": 24, "train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": {gas},
        "gradient_clipping": {clip},
        "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "eps": {EPS}, "weight_decay": 0.01}}}},
        "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0{offload}}}}}"#,
        micro = 24 / (world * gas)
    )
}

/// Stages 0-3 × worlds 1-4 × accumulation 1 and 2 × clipping at 0.5 (every step clips) or none,
/// the optimizer's state as tensors (initialize's choice), in host buffers (forced here) and
/// offloaded (`offload_optimizer`): every unit equal to one process's Burn AdamW after 5 steps.
#[test]
fn every_stage_world_accumulation_and_clipping_equals_one_process() {
    let batch = matrix_batch();
    for clip in [0.0, 0.5] {
        let want = one_process(&batch, clip);
        let lens: Vec<usize> = want.iter().map(Vec::len).collect();
        for stage in 0..=3u8 {
            for world in 1..=4 {
                for (gas, offload, tensors) in [
                    (1, false, None),
                    (2, false, None),
                    (1, true, None),
                    (1, false, Some(false)),
                    (2, false, Some(false)),
                ] {
                    let micro = 24 / (world * gas);
                    let config = matrix_config_offload(stage, world, gas, clip, offload);
                    let options = RunOptions {
                        tensors,
                        ..RunOptions::default()
                    };
                    let runs = train_zero_between(&config, world, micro, gas, &batch, STEPS, options);
                    if clip > 0.0 {
                        assert!(
                            runs[0].norms.iter().all(|&n| n > clip),
                            "every step clips: {:?}",
                            runs[0].norms
                        );
                    }
                    // Stage 2 cuts the units too (each rank's parameter and gradient is its
                    // shard; the whole vector is kept between steps).
                    let sharded = runs[0].parts[0].len() < lens[0];
                    assert_eq!(
                        sharded,
                        stage >= 2 && world > 1,
                        "stage {stage}, world {world}: units sharded"
                    );
                    for (u, (got, want)) in put_together(&runs, &lens).iter().zip(&want).enumerate() {
                        let err = relative_error(got, want);
                        assert!(
                            err < 1e-6,
                            "stage {stage}, world {world}, accumulation {gas}, clip {clip}, offload {offload}, tensors \
                             {tensors:?}: unit {u} off by {err:e}"
                        );
                    }
                }
            }
        }
    }
}

/// The collectives of the units run in one order on every rank: 50 steps at stage 3 on 4 ranks
/// finish without a collective mismatch (each rank's group checks every call's op and size
/// against its peers'), and, since blocks of one size could trade places unnoticed by that
/// check, every step's loss follows a run on 1 rank over the same batches (which has no order
/// to get wrong) to 1e-3.
#[test]
fn fifty_steps_on_4_ranks_keep_one_collective_order() {
    const STEPS: usize = 50;
    let batch: Batch =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_tokens.json")).expect("tokens")).expect("json");
    let config = |world: usize| {
        format!(
            r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": {}, "gradient_accumulation_steps": 2,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0}}}}"#,
            4 / world
        )
    };
    let one = train_zero(&config(1), 1, 4, 2, &batch, STEPS);
    let four = train_zero(&config(4), 4, 1, 2, &batch, STEPS);
    for step in 0..STEPS {
        let want = one[0].losses[step];
        let got = four.iter().map(|r| r.losses[step]).sum::<f64>() / 4.0;
        let err = (got - want).abs() / want;
        assert!(
            err < 1e-3,
            "step {step}: loss {got} on 4 ranks against {want} on 1 ({err:e})"
        );
    }
    assert!(one[0].losses[STEPS - 1] < 0.5 * one[0].losses[0], "the run trained");
}

/// bf16 and fp16 (fp32 masters; fp16 with DeepSpeed's dynamic loss scale from 2^16, whose
/// first steps overflow and are skipped on every rank) follow the fp32 loss curve at stage 3 on
/// 2 ranks. Reference: the same run in fp32; each 16-bit step is compared with the fp32 step
/// taken after as many applied updates (the batch is the same every step), to 2% of the initial
/// loss, as the engines' precision test does.
#[test]
fn bf16_and_fp16_follow_the_fp32_loss_curve_at_stage_3() {
    const STEPS: usize = 12;
    let batch: Batch =
        serde_json::from_str(&std::fs::read_to_string(fixture("train_tokens.json")).expect("tokens")).expect("json");
    let config = |precision: &str| {
        format!(
            r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}}, {precision}
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0}}}}"#
        )
    };
    let mean = |runs: &[RankRun]| -> Vec<f64> {
        (0..STEPS)
            .map(|s| runs.iter().map(|r| r.losses[s]).sum::<f64>() / runs.len() as f64)
            .collect()
    };
    let fp32_runs = train_zero(&config(""), 2, 4, 1, &batch, STEPS);
    assert!(fp32_runs[0].skipped.iter().all(|s| !s), "fp32 skips nothing");
    let fp32 = mean(&fp32_runs);
    assert!(fp32[STEPS - 1] < 0.9 * fp32[0], "fp32 trains: {fp32:?}");
    // Each precision with the state as tensors (initialize's choice) and in host buffers.
    for (name, precision, tensors) in [
        ("bf16", r#""bf16": {"enabled": true},"#, None),
        ("fp16", r#""fp16": {"enabled": true},"#, None),
        ("bf16 host buffers", r#""bf16": {"enabled": true},"#, Some(false)),
        ("fp16 host buffers", r#""fp16": {"enabled": true},"#, Some(false)),
    ] {
        let options = RunOptions {
            tensors,
            ..RunOptions::default()
        };
        let runs = train_zero_between(&config(precision), 2, 4, 1, &batch, STEPS, options);
        for run in &runs[1..] {
            assert_eq!(run.skipped, runs[0].skipped, "{name}: every rank skips the same steps");
        }
        let curve = mean(&runs);
        let mut applied = 0;
        let mut worst = 0f64;
        for (step, loss) in curve.iter().enumerate() {
            worst = worst.max((loss - fp32[applied]).abs());
            if !runs[0].skipped[step] {
                applied += 1;
            }
        }
        let skipped = STEPS - applied;
        if name.starts_with("fp16") {
            assert!(skipped > 0, "fp16 from 2^16 overflows at first");
        } else {
            assert_eq!(skipped, 0, "bf16 has no loss scale to overflow");
        }
        assert!(skipped < STEPS / 2, "{name}: {skipped} of {STEPS} steps skipped");
        assert!(
            worst < 0.02 * fp32[0],
            "{name}: loss curve {curve:?} strays from fp32 {fp32:?} by {worst}"
        );
        assert!(curve[STEPS - 1] < 0.95 * curve[0], "{name} trains: {curve:?}");
        let whole = parts(&fixture_gpt2().into_sharded())[1].len();
        assert!(runs[0].parts[1].len() < whole, "{name}: the blocks are sharded");
        println!(
            "{name}: {skipped} steps skipped, worst deviation {:.3}% of the initial loss",
            100.0 * worst / fp32[0]
        );
    }
}

/// A checkpoint of `ShardedGpt2` saved at stage 3 on 2 ranks is the model's: it resumes at
/// stage 3 on 4 ranks, stage 1 on 1 and stage 0 on 3, each then following the uninterrupted
/// stage-3 run on 2 ranks (the reference) to 1e-5 of the largest weight; and `zero to-fp32`
/// with its GPT-2 naming gives HuggingFace's tensors, which the zoo's HuggingFace loader reads
/// back as the trained weights exactly.
#[test]
fn a_stage_3_checkpoint_resumes_at_any_stage_and_world_and_exports_huggingface_names() {
    use zero_core::checkpoint::{to_fp32, Checkpoint, NameMap};
    let batch = matrix_batch();
    let lens: Vec<usize> = parts(&fixture_gpt2().into_sharded()).iter().map(Vec::len).collect();
    let config = |stage, world| matrix_config(stage, world, 1, 0.5);
    let uninterrupted = put_together(&train_zero(&config(3, 2), 2, 12, 1, &batch, 4), &lens);

    let dir = tempfile::tempdir().expect("tempdir");
    let saved = dir.path().join("ckpt");
    // Saved by host buffers, loaded by the state as tensors: one format.
    let save = RunOptions {
        save: Some(&saved),
        tensors: Some(false),
        ..Default::default()
    };
    let first = put_together(&train_zero_between(&config(3, 2), 2, 12, 1, &batch, 2, save), &lens);
    let load = RunOptions {
        load: Some(&saved),
        ..Default::default()
    };
    for (stage, world) in [(3u8, 4usize), (1, 1), (0, 3)] {
        let runs = train_zero_between(&config(stage, world), world, 24 / world, 1, &batch, 2, load);
        for (u, (got, want)) in put_together(&runs, &lens).iter().zip(&uninterrupted).enumerate() {
            let err = relative_error(got, want);
            assert!(
                err < 1e-5,
                "resumed at stage {stage} on {world} ranks: unit {u} off by {err:e}"
            );
        }
    }

    // The checkpoint names every weight as the unwrapped model does.
    let checkpoint = Checkpoint::open(&saved, None).expect("open");
    let hf = NameMap::gpt2_huggingface();
    let names: Vec<String> = checkpoint
        .meta
        .layout
        .params
        .iter()
        .map(|p| hf.apply(&p.name).expect("kept"))
        .collect();
    let (_, model_config) = Gpt2::<B>::load_pretrained(fixture_model(), &Default::default()).expect("fixture");
    let want: Vec<String> = model_config
        .param_shapes()
        .into_iter()
        .map(|(name, _)| format!("transformer.{name}"))
        .collect();
    assert_eq!(names, want);

    let out = dir.path().join("hf");
    to_fp32(&checkpoint, &out, None, &|n| hf.apply(n)).expect("to-fp32");
    std::fs::copy(fixture_model().join("config.json"), out.join("config.json")).expect("config");
    let exported = Gpt2::<B>::load_pretrained(&out, &Default::default())
        .expect("a HuggingFace directory")
        .0;
    assert_eq!(
        parts(&exported.into_sharded()),
        first,
        "the exported weights are the trained ones"
    );
}

/// Burn's own way to save an optimizer: each rank's model and `ZeroOptimizer::to_record`
/// through a Burn recorder, loaded into a fresh `initialize` at stage 3 (the units' shards, in
/// either state) and trained on: the run that never stopped, exactly.
#[test]
fn a_stage_3_burn_record_resumes_exactly() {
    let batch = matrix_batch();
    let lens: Vec<usize> = parts(&fixture_gpt2().into_sharded()).iter().map(Vec::len).collect();
    let config = matrix_config(3, 2, 1, 0.5);
    let uninterrupted = put_together(&train_zero(&config, 2, 12, 1, &batch, 4), &lens);
    for tensors in [true, false] {
        let out = std::sync::Mutex::new(vec![None, None]);
        let first = RunOptions {
            tensors: Some(tensors),
            records_out: Some(&out),
            ..Default::default()
        };
        train_zero_between(&config, 2, 12, 1, &batch, 2, first);
        let saved: Vec<Saved> = out
            .into_inner()
            .expect("records")
            .into_iter()
            .map(|s| s.expect("saved"))
            .collect();
        let resume = RunOptions {
            tensors: Some(tensors),
            records_in: Some(&saved),
            ..Default::default()
        };
        let resumed = put_together(&train_zero_between(&config, 2, 12, 1, &batch, 2, resume), &lens);
        assert_eq!(resumed, uninterrupted, "tensors {tensors}: resumed from Burn records");
    }
}

/// The memory report of stage 3 on 2 ranks is ZeRO's accounting of what each rank holds
/// (reference: the model's own shapes): its shard of every unit and `ln_f` whole as parameters,
/// fp32 masters and AdamW's two moments of what it owns, and one unit gathered whole at a
/// time under `BalancedCheckpointing` (padded to the ranks), plus what may be in flight beside
/// it: fewer elements than the prefetch budget (here one transformer block) before the last unit
/// started, so the budget and the largest other unit.
#[test]
fn the_stage_3_memory_report_counts_each_ranks_shards_and_the_largest_unit_gathered() {
    let batch = matrix_batch();
    let whole = parts(&fixture_gpt2().into_sharded());
    let (units, ln_f) = whole.split_at(whole.len() - 1);
    let padded = |u: &Vec<f32>| 2 * zero_burn::sharded::shard_len(u.len(), 2);
    let block = padded(&units[1]);
    let config = matrix_config(3, 2, 1, 0.0).replace(
        r#""stage3_param_persistence_threshold": 0"#,
        &format!(r#""stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": {block}"#),
    );
    let runs = train_zero(&config, 2, 12, 1, &batch, 1);
    let shards: usize = units.iter().map(|u| zero_burn::sharded::shard_len(u.len(), 2)).sum();
    let largest = units.iter().map(padded).max().unwrap();
    let all: usize = units.iter().map(padded).sum();
    assert!(all - largest > block, "more than one block besides the largest unit");
    // For each unit in use: the budget and the largest other unit may be in flight, never more
    // than all the others.
    let sizes: Vec<usize> = units.iter().map(padded).collect();
    let most = sizes
        .iter()
        .enumerate()
        .map(|(i, &u)| {
            let other = sizes
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, &v)| v)
                .max()
                .unwrap();
            u + (block + other).min(all - u)
        })
        .max()
        .unwrap();
    for (rank, run) in runs.iter().enumerate() {
        let m = &run.memory;
        assert_eq!(m.parameters.current, 4 * (shards + ln_f[0].len()), "rank {rank}: {m:?}");
        assert_eq!(m.gathered.current, 4 * most, "rank {rank}: {m:?}");
        // ln_f's masters are sharded too (stage 3 shards what is not a unit as stage 2 does).
        assert!(m.master_weights.current >= 4 * shards, "rank {rank}: {m:?}");
        assert!(
            m.master_weights.current < 4 * (shards + ln_f[0].len()),
            "rank {rank}: {m:?}"
        );
        assert_eq!(
            m.optimizer_state.current,
            2 * m.master_weights.current,
            "rank {rank}: AdamW's two moments"
        );
    }
}
