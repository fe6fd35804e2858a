//! Burn's `Learner` with `ZeroOptimizer`, ranks as threads, against the same `Learner` with
//! Burn's own AdamW on one process over the whole global batch (the reference: no ZeRO code in
//! it). Every rank must end each run with the reference's weights, at stages 0-2, worlds 2 and
//! 4, with and without the `Learner`'s gradient accumulation.

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use burn_train::metric::LossMetric;
use burn_train::{Learner, SupervisedTraining};
use zero_burn::params::read_values;
use zero_core::comm::ThreadGroup;
use zero_core::config::DeepSpeedConfig;
use zero_examples::learner::{example, train_rank, ExampleBatcher, Quiet, RankRun, Regressor};
use zero_test_support::{assert_close, max_abs_diff};

type B = Autodiff<Flex>;

const GLOBAL: usize = 16;
const BATCHES: usize = 6;
const EPOCHS: usize = 2;
const LR: f64 = 1e-2;
/// Adam's epsilon: large enough that the update does not divide rounding noise by ~0 (the
/// reductions sum in another order than one process).
const EPS: f64 = 1e-4;

fn values(model: &Regressor<Flex>) -> Vec<f32> {
    let mut out = Vec::new();
    read_values::<Flex, _>(model, |_, v| out.extend(v));
    out
}

/// One process, Burn's AdamW, micro-batches of `world · micro` examples (micro-batch m of a
/// global batch holds every rank's micro-batch m, in rank order) accumulated `accumulation` at a
/// time, as the ranks' gradients are averaged.
fn reference(world: usize, accumulation: usize, dir: &std::path::Path) -> Vec<f32> {
    let per = GLOBAL / world;
    let micro = per / accumulation;
    let order: Vec<_> = (0..BATCHES)
        .flat_map(|b| {
            (0..accumulation).flat_map(move |m| {
                (0..world).flat_map(move |r| (0..micro).map(move |k| b * GLOBAL + r * per + m * micro + k))
            })
        })
        .map(example)
        .collect();
    let train = DataLoaderBuilder::new(ExampleBatcher)
        .batch_size(world * micro)
        .build(InMemDataset::new(order));
    let valid = DataLoaderBuilder::new(ExampleBatcher)
        .batch_size(world * micro)
        .build(InMemDataset::new((0..GLOBAL).map(example).collect()));
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metric_train_numeric(LossMetric::new())
        .num_epochs(EPOCHS)
        .renderer(Quiet)
        .with_application_logger(None);
    if accumulation > 1 {
        training = training.grads_accumulation(accumulation);
    }
    let optim = AdamWConfig::new()
        .with_epsilon(EPS as f32)
        .with_weight_decay(0.01)
        .init();
    let learner = Learner::new(Regressor::<B>::new(&Default::default()), optim, LR);
    values(&training.launch(learner).model)
}

/// The ranks' config. No clipping: Burn's AdamW clips each tensor on its own, ZeRO by the global
/// norm (DeepSpeed's default, 1.0, when the key is absent).
fn config(stage: u8, micro: usize) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_batch_size": {GLOBAL}, "train_micro_batch_size_per_gpu": {micro}, "gradient_clipping": 0,
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 100}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "eps": {EPS}, "weight_decay": 0.01}}}}}}"#
    );
    DeepSpeedConfig::from_str(&text, "test config").expect("valid").config
}

#[test]
fn learner_with_zero_optimizer_trains_like_burns_adamw_on_one_process() {
    let dir = tempfile::tempdir().unwrap();
    for (world, accumulation) in [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)] {
        let want = reference(
            world,
            accumulation,
            &dir.path().join(format!("ref-{world}-{accumulation}")),
        );
        let untrained = values(&Regressor::new(&Default::default()));
        let moved = max_abs_diff("the reference against the untrained model", &want, &untrained);
        assert!(moved > 1e-2, "the reference must train (largest change {moved})");
        for stage in 0..=2u8 {
            let config = config(stage, GLOBAL / world / accumulation);
            let groups = ThreadGroup::new_group(world).unwrap();
            let got: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .enumerate()
                    .map(|(rank, group)| {
                        let config = &config;
                        let rank_dir = dir.path().join(format!("zero-{world}-{accumulation}-{stage}-{rank}"));
                        s.spawn(move || {
                            let run = RankRun {
                                config,
                                lr: LR,
                                batches: BATCHES,
                                epochs: EPOCHS,
                                dir: &rank_dir,
                            };
                            values(&train_rank::<B>(rank, group, &run).expect("trains"))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, g) in got.iter().enumerate() {
                let label = format!("stage {stage}, world {world}, accumulation {accumulation}: rank {rank}");
                assert_close(&label, g, &want, 1e-6);
            }
        }
    }
}
