//! What the pipeline tests share: a small GPT-2 with deterministic weights and deterministic
//! token batches (no random generator, so every rank thread builds the same model and data).

#![allow(dead_code)]

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Device, ElementConversion, Int, Tensor, TensorData};
use zero_burn::params::{describe, write_values};
use zero_burn::{EngineSettings, Stage};
use zero_core::optim::{OptimizerSpec, SgdSpec};
use zero_models::gpt2::{Gpt2, Gpt2Config};

pub type B = Autodiff<Flex>;

/// Vocabulary of the test models.
pub const VOCAB: usize = 48;
/// Tokens per row.
pub const SEQ: usize = 7;
/// Rows per micro-batch.
pub const ROWS: usize = 2;

/// A GPT-2 of `layers` blocks, hidden 16, 4 heads, 16 positions.
pub fn config(layers: usize) -> Gpt2Config {
    Gpt2Config::new(VOCAB, 16, 16, layers, 4)
}

/// `config`'s model with deterministic weights (layer-norm gains near 1, the rest near 0).
pub fn full_model(config: &Gpt2Config, device: &Device<B>) -> Gpt2<B> {
    let model = config.init::<B>(device);
    let specs = describe::<B, _>(&model);
    write_values(model, device, true, |i| {
        let (name, n) = (&specs[i].1.name, specs[i].1.numel());
        let gamma = name.contains("ln_") && name.ends_with("gamma");
        let (base, scale) = if gamma { (1.0, 0.1) } else { (0.0, 0.3) };
        (0..n)
            .map(|k| base + scale * ((i * 131 + k * 7) as f32 * 0.37).sin())
            .collect()
    })
}

/// Micro-batch `micro` (of the global batch) of step `step`: tokens and labels.
pub fn micro_batch(step: usize, micro: usize, device: &Device<B>) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let ids: Vec<i64> = (0..ROWS)
        .flat_map(|r| {
            let row = micro * ROWS + r;
            (0..SEQ).map(move |t| ((row * 31 + t * 17 + step * 5 + row * t) % VOCAB) as i64)
        })
        .collect();
    let t = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [ROWS, SEQ]), device);
    (t.clone(), t)
}

/// SGD with momentum (lr 0.2, momentum 0.9, weight decay 0.01), `micro_batches` per step,
/// clipped at 0.5 (small enough to clip every step: the clipping must use the whole model's
/// norm). Not Adam: the attention's key bias has an exactly-zero gradient in exact arithmetic,
/// and Adam turns its rounding noise (different in any two summation orders) into full-size
/// updates of random sign; SGD keeps noise as noise. Its momentum buffer is state a checkpoint
/// must carry.
pub fn sgd_settings(micro_batches: usize, stage: Stage) -> EngineSettings {
    let mut s = EngineSettings::new(
        stage,
        OptimizerSpec::Sgd(SgdSpec {
            lr: 0.2,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.01,
            nesterov: false,
        }),
    );
    s.gradient_accumulation_steps = micro_batches;
    s.gradient_clipping = 0.5;
    s
}

/// One rank of a reference run without a pipeline: `model` trained in Burn's own loop by
/// `ZeroOptimizer` over `group` (through `zero_burn::initialize_settings`, which casts the model
/// to the compute dtype), each step accumulating `settings.gradient_accumulation_steps`
/// micro-batches `batch(step, m)` with Burn's `GradientsAccumulator`, the loss scaled by the
/// optimizer (fp16). Returns each step's report and mean loss, and the trained model.
pub fn zero_optimizer_run(
    settings: EngineSettings,
    model: Gpt2<B>,
    group: std::sync::Arc<dyn zero_core::comm::ProcessGroup>,
    steps: usize,
    batch: impl Fn(usize, usize) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>),
) -> (Vec<zero_burn::StepReport>, Vec<f32>, Gpt2<B>) {
    use burn::optim::lr_scheduler::LrScheduler;
    use burn::optim::{GradientsAccumulator, GradientsParams};
    let micro = settings.gradient_accumulation_steps;
    let units: zero_burn::sharded::UnitComm<Flex> = std::sync::Arc::new(zero_burn::HostStaged::new(group.clone()));
    let (mut model, mut optim) = zero_burn::initialize_settings(settings, model, group, units).expect("initialize");
    let mut lr = optim.lr_scheduler();
    let (mut reports, mut losses) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let mut accumulator = GradientsAccumulator::new();
        let mut sum = 0.0;
        for m in 0..micro {
            let (tokens, labels) = batch(step, m);
            let loss = model.loss(tokens, labels);
            let value = loss.clone().into_scalar().elem::<f32>();
            optim.note_loss(value as f64);
            sum += value;
            let scaled = optim.scale_loss(loss.div_scalar(micro as f32));
            accumulator.accumulate(&model, GradientsParams::from_grads(scaled.backward(), &model));
        }
        model = optim.try_step(lr.step(), model, accumulator.grads()).expect("step");
        reports.push(optim.last_step().expect("a step"));
        losses.push(sum / micro as f32);
    }
    (reports, losses, model)
}
