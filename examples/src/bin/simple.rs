//! The smallest complete use of zero-burn: DeepSpeed's SimpleModel (Linear 784→128, ReLU,
//! Linear 128→10) on synthetic data, with 2 ranks as threads, under the ZeRO stage given on the
//! command line (0, 1, 2 or 3; default 3).
//!
//! `cargo run -p zero-examples --bin simple -- 3`
//!
//! Stage 3 gathers parameters part by part, so the model says how it chains: its input layer
//! (with the ReLU) is the chain's *ends*, the output layer its one *block*, and the loss its
//! head. That is the `ChainModel` impl below; the rest is an ordinary Burn training loop.

use burn::backend::{Autodiff, Flex};
use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::{activation::relu, backend::AutodiffBackend};
use zero_burn::{initialize_chain, ChainModel};
use zero_core::config::DeepSpeedConfig;

type B = Autodiff<Flex>;

// ---- user code ----
#[derive(Module, Debug)]
struct SimpleModel<B: Backend> {
    fc1: Linear<B>,
    fc2: Vec<Linear<B>>,
}

impl<B: AutodiffBackend> ChainModel<B> for SimpleModel<B> {
    type Batch = (Tensor<B, 2>, Tensor<B, 1, Int>);
    type Hidden = Tensor<B, 2>;
    type Ends = Linear<B>;
    type Block = Linear<B>;
    fn into_parts(self) -> (Linear<B>, Vec<Linear<B>>) {
        (self.fc1, self.fc2)
    }
    fn from_parts(fc1: Linear<B>, fc2: Vec<Linear<B>>) -> Self {
        SimpleModel { fc1, fc2 }
    }
    fn embed(fc1: &Linear<B>, batch: &Self::Batch) -> Tensor<B, 2> {
        relu(fc1.forward(batch.0.clone()))
    }
    fn block_forward(fc2: &Linear<B>, h: Tensor<B, 2>) -> Tensor<B, 2> {
        fc2.forward(h)
    }
    fn head_loss(_: &Linear<B>, logits: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.1.clone())
    }
}

fn train(config: &DeepSpeedConfig, rank: usize, group: zero_core::comm::SharedGroup) -> f32 {
    let device = Default::default();
    let model = SimpleModel {
        fc1: LinearConfig::new(784, 128).init::<B>(&device),
        fc2: vec![LinearConfig::new(128, 10).init(&device)],
    };
    let mut engine = initialize_chain(config, model, group, &Default::default()).expect("engine");
    let mut loss = 0.0;
    for step in 0..60 {
        // Synthetic data: the label is the index of the largest of the first 10 inputs.
        let x = Tensor::<B, 2>::random([16, 784], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
        let y = x.clone().slice([0..16, 0..10]).argmax(1).reshape([16]);
        let pending = engine.forward((x, y)).expect("forward");
        loss = engine.backward(pending).expect("backward");
        engine.step().expect("step");
        if rank == 0 && step % 10 == 0 {
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
    let losses = zero_examples::ranks::run_ranks(2, move |rank, group| train(&config, rank, group));
    println!("final losses by rank: {:?}", losses.expect("ranks ran"));
}
