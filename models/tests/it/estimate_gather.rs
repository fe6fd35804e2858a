//! `zero estimate`'s stage-3 gathered term against what the training path counts.
//!
//! Reference: the memory report of `ZeroOptimizer` after a step of the zoo's `ShardedGpt2`
//! through `zero_burn::initialize` at stage 3 on 2 rank threads (the units as the zoo cuts them:
//! the embeddings and each block, padded to the ranks), against
//! `zero_core::estimate::Gpt2Shape::gathered_at_once` from the shape alone, in fp32 bytes, for
//! several prefetch budgets. Both apply one rule (`estimate::gathered_with_prefetch`, tested
//! against a simulated schedule in zero-core and against the gathers the schedule starts in
//! zero-burn/tests/it/sharded_prefetch.rs): what this test checks is that the estimate sees the
//! units the model is cut into. The groups are padded to the world size, hence the 1% slack.

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use zero_core::comm::{SharedGroup, ThreadGroup};
use zero_core::config::DeepSpeedConfig;
use zero_core::estimate::{Dtype, EstimateInput, Gpt2Shape};
use zero_models::Gpt2Config;

type B = Autodiff<Flex, BalancedCheckpointing>;

/// The gathered bytes `ZeroOptimizer` reports after one step, the most over the ranks.
fn reported(config: &Gpt2Config, prefetch: u64) -> usize {
    let json = format!(
        r#"{{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
        "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
            "overlap_comm": true, "stage3_prefetch_bucket_size": {prefetch}}}}}"#
    );
    let ds = DeepSpeedConfig::from_str(&json, "ds_config.json")
        .expect("config")
        .config;
    let groups = ThreadGroup::new_group(2).expect("group");
    let handles: Vec<_> = groups
        .into_iter()
        .map(|group| {
            let (config, ds) = (config.clone(), ds.clone());
            std::thread::spawn(move || {
                let device = Default::default();
                let model = config.init::<B>(&device).into_sharded();
                let (model, mut optim) = zero_burn::initialize(&ds, model, group as SharedGroup).expect("initialize");
                let ids: Vec<i64> = (0..16).map(|i| (i * 7) % config.vocab_size as i64).collect();
                let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, 8]), &device);
                let loss = model.loss(tokens.clone(), tokens).expect("forward");
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                let _model = optim.step(1e-3, model, grads);
                optim.memory().gathered.current
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank")).max().unwrap_or(0)
}

#[test]
fn the_estimated_gather_is_what_the_training_path_counts() {
    let config = Gpt2Config::new(300, 32, 32, 3, 4);
    let shape = Gpt2Shape {
        vocab: 300,
        n_positions: 32,
        n_embd: 32,
        n_layer: 3,
        n_head: 4,
        n_inner: 128,
    };
    assert_eq!(shape.num_params(), config.num_params(), "the shapes agree");
    let (embed, block) = (shape.embed_params(), shape.block_params());
    assert!(
        embed != block,
        "distinct unit sizes, so a unit mistaken for another shows"
    );
    // No prefetch, a budget below every unit, one block, and everything: each budget gives a
    // different bound here.
    let mut seen = Vec::new();
    for prefetch in [0, 1, block, 10 * (embed + block)] {
        let want = shape.gathered_at_once(prefetch) as f64 * 4.0;
        let got = reported(&config, prefetch) as f64;
        assert!(
            (got - want).abs() <= 0.01 * want,
            "budget {prefetch}: the training path counts {got} bytes, the estimate {want}"
        );
        seen.push(want as u64);
    }
    seen.dedup();
    assert_eq!(seen.len(), 4, "the budgets must give different bounds: {seen:?}");
    // What `zero estimate --preset` feeds the formulas on two devices: the same term.
    let input = shape.input(&EstimateInput {
        prefetch_bucket_size: block,
        ..EstimateInput::new(0, 3, 2, Dtype::Fp32)
    });
    assert_eq!(input.gathered_at_once, Some(shape.gathered_at_once(block)));
}
