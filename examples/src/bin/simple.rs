//! The smallest complete use of zero-burn: DeepSpeed's SimpleModel (Linear 784→128, ReLU,
//! Linear 128→10) on synthetic data, under the ZeRO stage given on the command line (0-2; stage
//! 3 needs a ChainModel, see the gpt2 example), with 2 ranks as threads.
//!
//! `cargo run --release -p zero-examples --bin simple -- 2`

use burn::backend::{Autodiff, Flex};
use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use zero_core::config::DeepSpeedConfig;

type B = Autodiff<Flex>;

#[derive(Module, Debug)]
struct SimpleModel<B: Backend> {
    fc1: Linear<B>,
    relu: Relu,
    fc2: Linear<B>,
}

impl<B: Backend> SimpleModel<B> {
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let logits = self.fc2.forward(self.relu.forward(self.fc1.forward(x)));
        CrossEntropyLossConfig::new().init(&logits.device()).forward(logits, y)
    }
}

fn main() {
    let stage: u8 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let text = format!(
        r#"{{"train_batch_size": 32, "gradient_accumulation_steps": 1, "zero_optimization": {{"stage": {stage}}},
            "optimizer": {{"type": "Adam", "params": {{"lr": 1e-2}}}}}}"#
    );
    let config = DeepSpeedConfig::from_str(&text, "inline config")
        .expect("valid config")
        .config;
    let losses = zero_examples::ranks::run_ranks(2, move |rank, group| {
        // ---- user code: the same on every rank ----
        let device = Default::default();
        let model = SimpleModel {
            fc1: LinearConfig::new(784, 128).init::<B>(&device),
            relu: Relu,
            fc2: LinearConfig::new(128, 10).init(&device),
        };
        let mut engine = zero_burn::initialize(&config, model, group).expect("engine");
        let mut last = 0.0;
        for step in 0..50 {
            // Synthetic data: the label is the index of the largest of the first 10 inputs.
            let x = Tensor::<B, 2>::random([16, 784], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
            let y = x.clone().slice([0..16, 0..10]).argmax(1).reshape([16]);
            let loss = engine.forward(|m| m.loss(x, y));
            last = engine.backward(loss).expect("backward");
            engine.step().expect("step");
            if rank == 0 && step % 10 == 0 {
                println!("stage {stage} step {step}: loss {last:.4}");
            }
        }
        last
    });
    println!("final losses by rank: {:?}", losses.expect("ranks ran"));
}
