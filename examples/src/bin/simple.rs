//! The smallest complete use of zero-burn: DeepSpeed's SimpleModel (Linear 784→128, ReLU,
//! Linear 128→10) on synthetic data, with 2 ranks as threads, under the ZeRO stage given on the
//! command line (0, 1, 2 or 3; default 3).
//!
//! `cargo run -p zero-examples --bin simple -- 3`
//!
//! The model is a `Sequential`: each layer is a block the engine can gather on its own, which is
//! what stage 3 needs. Everything between the markers is what a user writes.

use zero_examples::ranks::run_ranks;

// ---- user code ----
use burn::backend::{Autodiff, Flex};
use burn::{
    prelude::*,
    tensor::Distribution::{Normal, Uniform},
};
use zero_burn::sequential::{CrossEntropy, Layer, Sequential};
use zero_core::{comm::SharedGroup, config::DeepSpeedConfig};
type B = Autodiff<Flex>;

fn train(config: &DeepSpeedConfig, rank: usize, group: SharedGroup) -> f32 {
    let device = Default::default();
    let (fc1, fc2) = (Layer::linear(784, 128, &device), Layer::linear(128, 10, &device));
    let model: Sequential<B, _, CrossEntropy> = Sequential::new(vec![fc1, Layer::relu(), fc2]);
    let mut engine = zero_burn::initialize_chain(config, model, group, &Default::default()).expect("engine");
    let mut loss = f32::NAN;
    for step in 1..=100 {
        // Synthetic data: an input of class y is noise with its y-th element lifted by 5.
        let y = Tensor::<B, 1, Int>::random([16], Uniform(0.0, 10.0), &device);
        let x = Tensor::<B, 2>::random([16, 784], Normal(0.0, 1.0), &device) + y.clone().one_hot(784).float() * 5;
        let pending = engine.forward((x, y)).expect("forward");
        loss = engine.backward(pending).expect("backward");
        engine.step().expect("step");
        if rank == 0 && step % 20 == 0 {
            println!("step {step}: loss {loss:.4}");
        }
    }
    loss
}
// ---- end of user code ----

fn main() {
    let stage: u8 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let text = format!(
        r#"{{"train_batch_size": 32, "zero_optimization": {{"stage": {stage}}},
            "optimizer": {{"type": "Adam", "params": {{"lr": 1e-2}}}}}}"#
    );
    let config = DeepSpeedConfig::from_str(&text, "inline config")
        .expect("valid config")
        .config;
    println!("SimpleModel, ZeRO stage {stage}, 2 ranks");
    let losses = run_ranks(2, move |rank, group| train(&config, rank, group));
    println!("final losses by rank: {:?}", losses.expect("ranks ran"));
}
