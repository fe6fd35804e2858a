//! Burn's own training loop, `burn_train`'s `Learner`, with ZeRO: one `Learner` per rank, each
//! with a `ZeroOptimizer` made from a DeepSpeed config and a data loader over its own slice of
//! every global batch. The `Learner` runs forward and backward and hands the gradients to the
//! optimizer; the optimizer averages them over the ranks (stage 0), or reduce-scatters them and
//! steps its shard of the fp32 masters and optimizer state (stages 1 and 2), and every rank
//! leaves the step with the same weights.
//!
//! What the user writes is a plain Burn model with `TrainStep` and `InferenceStep`, as for any
//! `Learner`; the learning rate is the `Learner`'s scheduler's (Burn's loop passes it to the
//! optimizer), not the config's.
//!
//! Checkpoints: `ZeroOptimizer`'s Burn `Record` is the rank's part of the sharded checkpoint
//! (its owned slices of the fp32 masters and optimizer state), so the `Learner`'s file
//! checkpointer (`with_file_checkpointer`) saves and resumes it, given a directory per rank (each
//! rank's record is its own); it reloads over the same number of ranks, at any stage.
//! `ZeroOptimizer::save_checkpoint` (the sharded directory, every rank) also reloads at another
//! world size. This model has no
//! `ZeroModule`, so stage 3 fails its first step saying so; fp16 does too, since the `Learner`
//! calls `backward()` on a loss that `ZeroOptimizer::scale_loss` has not scaled (bf16 works).

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_train::metric::LossMetric;
use burn_train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn_train::{InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep};
use std::path::Path;
use zero_burn::{ZeroError, ZeroOptimizer};
use zero_core::comm::SharedGroup;
use zero_core::config::DeepSpeedConfig;

/// Inputs per example.
pub const INPUTS: usize = 8;
/// Hidden units.
pub const HIDDEN: usize = 32;

/// A two-layer regression network.
#[derive(Module, Debug)]
pub struct Regressor<B: Backend> {
    fc1: Linear<B>,
    relu: Relu,
    fc2: Linear<B>,
}

impl<B: Backend> Regressor<B> {
    /// The network with weights from a fixed formula, the same on every rank (a real model would
    /// load a checkpoint, or draw on rank 0 and call [`ZeroOptimizer::synchronize`]).
    pub fn new(device: &B::Device) -> Self {
        let model = Regressor {
            fc1: LinearConfig::new(INPUTS, HIDDEN).init(device),
            relu: Relu::new(),
            fc2: LinearConfig::new(HIDDEN, 1).init(device),
        };
        let sizes = [INPUTS * HIDDEN, HIDDEN, HIDDEN, 1];
        zero_burn::params::write_values(model, device, true, |p| {
            (0..sizes[p])
                .map(|k| 0.4 * ((k * 7 + p * 131) as f32 * 0.37).sin())
                .collect()
        })
    }

    /// The prediction, `[batch, 1]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2.forward(self.relu.forward(self.fc1.forward(x)))
    }

    /// The mean squared error of a batch, with the prediction.
    pub fn forward_regression(&self, batch: Batch<B>) -> RegressionOutput<B> {
        let output = self.forward(batch.x);
        let loss = MseLoss::new().forward(output.clone(), batch.y.clone(), Reduction::Mean);
        RegressionOutput::new(loss, output, batch.y)
    }
}

impl<B: AutodiffBackend> TrainStep for Regressor<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<RegressionOutput<B>> {
        let item = self.forward_regression(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Regressor<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Batch<B>) -> RegressionOutput<B> {
        self.forward_regression(batch)
    }
}

/// One example: inputs and target.
#[derive(Clone, Debug)]
pub struct Example {
    /// The inputs.
    pub x: [f32; INPUTS],
    /// The target.
    pub y: f32,
}

/// Example `i` of the synthetic task: a smooth function of deterministic inputs.
pub fn example(i: usize) -> Example {
    let x: [f32; INPUTS] = std::array::from_fn(|j| ((i * 13 + j * 5) as f32 * 0.61).sin());
    let y = x
        .iter()
        .enumerate()
        .map(|(j, v)| (v * (j + 1) as f32).sin())
        .sum::<f32>()
        / INPUTS as f32;
    Example { x, y }
}

/// A batch: inputs `[n, INPUTS]` and targets `[n, 1]`.
#[derive(Clone, Debug)]
pub struct Batch<B: Backend> {
    /// The inputs.
    pub x: Tensor<B, 2>,
    /// The targets.
    pub y: Tensor<B, 2>,
}

/// Stacks examples into a [`Batch`].
#[derive(Clone, Default)]
pub struct ExampleBatcher;

impl<B: Backend> Batcher<B, Example, Batch<B>> for ExampleBatcher {
    fn batch(&self, items: Vec<Example>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|e| e.x).collect();
        let y: Vec<f32> = items.iter().map(|e| e.y).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, INPUTS]), device),
            y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
        }
    }
}

/// The examples rank `rank` of `world` sees, in order: its slice of each of `batches` global
/// batches of `global` examples (a batch of `global / world` per step on every rank).
pub fn rank_examples(rank: usize, world: usize, global: usize, batches: usize) -> Vec<Example> {
    let per = global / world;
    (0..batches)
        .flat_map(|b| (b * global + rank * per..b * global + (rank + 1) * per).map(example))
        .collect()
}

/// A renderer that shows nothing: the ranks' `Learner`s run side by side, and the caller prints.
pub struct Quiet;

impl MetricsRendererTraining for Quiet {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
    fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for Quiet {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRenderer for Quiet {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: burn_train::metric::MetricDefinition) {}
}

/// What one rank's run is given.
pub struct RankRun<'a> {
    /// The DeepSpeed config (batch sizes, ZeRO stage, optimizer).
    pub config: &'a DeepSpeedConfig,
    /// The learning rate the `Learner` passes to every step.
    pub lr: f64,
    /// Global batches per epoch.
    pub batches: usize,
    /// Epochs.
    pub epochs: usize,
    /// Where this rank's `Learner` writes its logs (one directory per rank).
    pub dir: &'a Path,
}

/// Trains a [`Regressor`] on rank `rank` with Burn's `Learner` and a `ZeroOptimizer` from
/// `run.config`; returns the trained model (the same on every rank).
pub fn train_rank<B: AutodiffBackend>(
    rank: usize,
    group: SharedGroup,
    run: &RankRun<'_>,
) -> Result<Regressor<B::InnerBackend>, ZeroError> {
    let world = group.world_size();
    let resolved = zero_burn::resolve(run.config, world, &Default::default())?;
    let global = resolved.train_batch_size as usize;
    let micro = resolved.micro_batch_size as usize;
    let accumulation = resolved.gradient_accumulation_steps as usize;
    let optimizer = ZeroOptimizer::new(zero_burn::engine_settings(&resolved)?, group)?;

    let device = B::Device::default();
    let train = DataLoaderBuilder::new(ExampleBatcher)
        .batch_size(micro)
        .build(InMemDataset::new(rank_examples(rank, world, global, run.batches)));
    let valid = DataLoaderBuilder::new(ExampleBatcher)
        .batch_size(micro)
        .build(InMemDataset::new(rank_examples(rank, world, global, 1)));
    let mut training = SupervisedTraining::new(run.dir, train, valid)
        .metric_train_numeric(LossMetric::new())
        .num_epochs(run.epochs)
        .renderer(Quiet)
        .with_application_logger(None);
    if accumulation > 1 {
        training = training.grads_accumulation(accumulation);
    }
    let learner = Learner::new(Regressor::<B>::new(&device), optimizer, run.lr);
    Ok(training.launch(learner).model)
}
