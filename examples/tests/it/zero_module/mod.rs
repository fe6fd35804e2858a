//! The harness of the `ZeroModule` GPT-2 tests: the fixture's `ShardedGpt2` trained in Burn's
//! own loop with `zero_burn::initialize` on rank threads, the one-process reference (the plain
//! `Gpt2` and Burn's AdamW, clipped by the global norm as torch clips), and the configs of the
//! matrix.

#![allow(dead_code)]

use crate::support::*;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::prelude::*;
use std::sync::Arc;
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::config::DeepSpeedConfig;
use zero_models::gpt2::{Gpt2, ShardedGpt2};

pub type B = Autodiff<Flex, BalancedCheckpointing>;
pub type Batch = Vec<Vec<u32>>;

/// The tiny HuggingFace GPT-2 fixture.
pub fn fixture_gpt2() -> Gpt2<B> {
    Gpt2::<B>::load_pretrained(fixture_model(), &Default::default())
        .expect("the fixture loads")
        .0
}

pub fn tokens(rows: &[Vec<u32>]) -> Tensor<B, 2, Int> {
    let (n, seq) = (rows.len(), rows[0].len());
    let flat: Vec<i64> = rows.iter().flatten().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(flat, [n, seq]), &Default::default())
}

/// `body(rank, group)` on `world` rank threads; the results in rank order.
pub fn on_ranks<T: Send>(world: usize, body: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync) -> Vec<T> {
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
pub fn parts(model: &ShardedGpt2<B>) -> Vec<Vec<f32>> {
    let mut parts = vec![unit_values(&model.embed)];
    parts.extend(model.blocks.iter().map(unit_values));
    let mut ln_f = Vec::new();
    zero_burn::params::read_values::<B, _>(&model.ln_f, |_, v| ln_f.extend(v));
    parts.push(ln_f);
    parts
}

/// A unit's flat vector (whole, or this rank's shard), as a Burn record of the unit carries it:
/// under `offload_param` the parameter itself holds a placeholder (NaNs) and the values are in
/// its store, which the record reads.
fn unit_values<M: Module<B> + burn::module::ModuleDisplay>(unit: &zero_burn::sharded::ZeroModule<B, M>) -> Vec<f32> {
    let shard = unit.clone().into_record().shard;
    shard.val().into_data().convert::<f32>().to_vec::<f32>().expect("f32")
}

/// What one rank saw: each step's loss (mean over its micro-batches) and gradient norm, and
/// its parts at the end.
pub struct RankRun {
    pub losses: Vec<f64>,
    pub norms: Vec<f64>,
    /// Whether each step was skipped (fp16 overflow).
    pub skipped: Vec<bool>,
    pub parts: Vec<Vec<f32>>,
    /// The optimizer's memory report after the last step.
    pub memory: zero_burn::MemoryReport,
}

/// `steps` steps of the fixture's `ShardedGpt2` on `world` ranks from the config `config`,
/// each step the whole `batch`: rank r takes its `micro * gas` rows, `gas` micro-batches of
/// `micro`, the loss divided by `gas` (and scaled by the optimizer: fp16) before backward, the
/// gradients summed by Burn's accumulator.
pub fn train_zero(config: &str, world: usize, micro: usize, gas: usize, batch: &Batch, steps: usize) -> Vec<RankRun> {
    train_zero_between(config, world, micro, gas, batch, steps, RunOptions::default())
}

/// Where a run starts from and saves to (`ZeroOptimizer`'s sharded checkpoints), and how the
/// optimizer keeps its state.
#[derive(Clone, Copy, Default)]
pub struct RunOptions<'a> {
    pub load: Option<&'a std::path::Path>,
    pub save: Option<&'a std::path::Path>,
    /// `Some(false)`: the state in host buffers (the fused CPU step) without offload; `None`:
    /// `initialize`'s choice, tensors on the model's device.
    pub tensors: Option<bool>,
    /// Each rank resumes from its own model and its optimizer's Burn record (index = rank).
    pub records_in: Option<&'a [Saved]>,
    /// Each rank leaves its model and its optimizer's Burn record here (index = rank).
    pub records_out: Option<&'a std::sync::Mutex<Vec<Option<Saved>>>>,
    /// Each micro-batch's gradients from `zero_burn::checkpointed_grads` with this setting
    /// (as `gpt2 train` under an `activation_checkpointing` section) instead of `backward`.
    pub checkpointed: Option<&'a zero_burn::ActivationCheckpointing>,
}

/// A rank's model record and `ZeroOptimizer::to_record`, written by a Burn recorder (bytes: the
/// loading run gets tensors of its own).
#[derive(Clone)]
pub struct Saved {
    pub model: Vec<u8>,
    pub optim: Vec<u8>,
}

/// [`train_zero`] resumed from `options.load` (the steps are then those after it) and saved to
/// `options.save` at the end.
pub fn train_zero_between(
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
                if let Some(setting) = options.checkpointed {
                    let scale = (optim.scale_for_backward() / gas as f64) as f32;
                    let (value, grads) =
                        zero_burn::checkpointed_grads(&model, &(t.clone(), t), setting, scale).expect("checkpointed");
                    loss_sum += value as f64;
                    accumulator.accumulate(&model, grads);
                    continue;
                }
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
pub fn put_together(runs: &[RankRun], lens: &[usize]) -> Vec<Vec<f32>> {
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

/// 24 sequences of 16 tokens (24 splits over 1-4 ranks times accumulation 1 or 2).
pub fn matrix_batch() -> Batch {
    (0..24)
        .map(|r| (0..16).map(|c| ((r * 37 + c * 11 + r * c) % 509) as u32).collect())
        .collect()
}

pub const EPS: f32 = 1e-4;
pub const LR: f64 = 1e-3;
pub const STEPS: usize = 5;

/// The reference: the plain fixture model on one process, Burn's AdamW over the whole batch,
/// the gradients scaled by torch's `clip_grad_norm_` rule at `clip` (0: none). Its parts as
/// [`parts`] reads them.
pub fn one_process(batch: &Batch, clip: f64) -> Vec<Vec<f32>> {
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
pub fn clip_by_global_norm(model: &Gpt2<B>, grads: &mut GradientsParams, clip: f64) {
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

pub fn matrix_config(stage: u8, world: usize, gas: usize, clip: f64) -> String {
    matrix_config_offload(stage, world, gas, clip, false)
}

/// [`matrix_config`], with the optimizer's state in host memory when `offload`.
pub fn matrix_config_offload(stage: u8, world: usize, gas: usize, clip: f64, offload: bool) -> String {
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
