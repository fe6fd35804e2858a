//! `zero estimate`'s stage-3 live gather against the engine's own count.
//!
//! Reference: `zero_core::estimate::Gpt2Shape::largest_gather` (the ends plus the largest block
//! when the ends stay gathered between their uses, the default), in fp32 bytes, against the peak
//! of gathered bytes the engine recorded over a training step. Every parameter is sharded
//! (persistence threshold 0) and nothing is prefetched, so the two count the same thing; the
//! engine's groups are padded to the world size, hence the 1% slack.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Int, Tensor, TensorData};
use zero_burn::{ChainEngine, EngineSettings, Stage};
use zero_core::comm::{SharedGroup, ThreadGroup};
use zero_core::estimate::Gpt2Shape;
use zero_core::optim::OptimizerSpec;
use zero_models::Gpt2Config;

type B = Autodiff<Flex>;

fn gathered_peak(config: &Gpt2Config, max_reuse_distance: usize) -> usize {
    let groups = ThreadGroup::new_group(2).expect("group");
    let handles: Vec<_> = groups
        .into_iter()
        .map(|group| {
            let config = config.clone();
            std::thread::spawn(move || {
                let device = Default::default();
                let mut s = EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw());
                s.param_persistence_threshold = 0;
                s.overlap_comm = false;
                s.max_reuse_distance = max_reuse_distance;
                let mut engine = ChainEngine::new(s, config.init::<B>(&device), group as SharedGroup).expect("engine");
                let ids: Vec<i64> = (0..16).map(|i| (i * 7) % config.vocab_size as i64).collect();
                let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, 8]), &device);
                let loss = engine.forward((tokens.clone(), tokens)).expect("forward");
                engine.backward(loss).expect("backward");
                engine.step().expect("step");
                engine.memory().gathered.peak
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank")).max().unwrap_or(0)
}

#[test]
fn the_estimated_live_gather_is_what_the_engine_holds() {
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
    let want = shape.largest_gather() as f64 * 4.0;
    assert_eq!(
        shape.largest_gather(),
        shape.ends_params() + shape.block_params(),
        "ends kept"
    );
    let got = gathered_peak(&config, 1_000_000_000) as f64;
    assert!((got - want).abs() <= 0.01 * want, "engine {got} bytes, estimate {want}");
    // With every part released after use, the peak is the larger part alone, below the estimate.
    let released = gathered_peak(&config, 0) as f64;
    let larger = shape.ends_params().max(shape.block_params()) as f64 * 4.0;
    assert!(
        (released - larger).abs() <= 0.01 * larger,
        "released: {released} vs {larger}"
    );
}
