//! The smallest complete use of zero-burn: DeepSpeed's SimpleModel (Linear 784→128, ReLU,
//! Linear 128→10) on synthetic data, with 2 ranks as threads, under the ZeRO stage given on the
//! command line (0, 1, 2 or 3; default 3).
//!
//! `cargo run -p zero-examples --bin simple -- 3`
//!
//! The model is written for Burn; ZeRO is its two layers wrapped in `ZeroModule` (each then
//! reached with `unshard` for its forward) and `zero_burn::initialize` giving the model and the
//! optimizer for Burn's own loop. At stage 3 `fc1` lives as each rank's half; `fc2` (1290
//! parameters, under the config's default `stage3_param_persistence_threshold`) stays whole.
//! Everything between the markers is what a user writes.

use zero_examples::ranks::run_ranks;

// ---- user code ----
use burn::backend::{autodiff::checkpoint::strategy::BalancedCheckpointing, Autodiff, Flex};
use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig};
use burn::optim::{lr_scheduler::LrScheduler, GradientsParams, Optimizer};
use burn::{
    prelude::*,
    tensor::activation::relu,
    tensor::Distribution::{Normal, Uniform},
};
use zero_burn::{sharded::ZeroModule, ZeroError};
use zero_core::{comm::SharedGroup, config::DeepSpeedConfig};

/// Stage 3 frees each gathered layer after its forward under Burn's balanced checkpointing.
type Train = Autodiff<Flex, BalancedCheckpointing>;

#[derive(Module, Debug)]
struct SimpleModel<B: Backend> {
    fc1: ZeroModule<B, Linear<B>>,
    fc2: ZeroModule<B, Linear<B>>,
}

impl SimpleModel<Train> {
    fn new(device: &Device<Train>) -> Self {
        SimpleModel {
            fc1: ZeroModule::new(LinearConfig::new(784, 128).init(device)),
            fc2: ZeroModule::new(LinearConfig::new(128, 10).init(device)),
        }
    }

    fn forward(&self, x: Tensor<Train, 2>) -> Result<Tensor<Train, 2>, ZeroError> {
        let h = relu(self.fc1.unshard(&x)?.forward(x));
        Ok(self.fc2.unshard(&h)?.forward(h))
    }
}

fn train(config: &DeepSpeedConfig, rank: usize, group: SharedGroup) -> f32 {
    let device = Default::default();
    let (mut model, mut optim) = zero_burn::initialize(config, SimpleModel::new(&device), group).expect("initialize");
    let mut lr = optim.lr_scheduler();
    let cross_entropy = CrossEntropyLossConfig::new().init(&device);
    let mut loss = f32::NAN;
    for step in 1..=100 {
        // Synthetic data: an input of class y is noise with its y-th element lifted by 5.
        let y = Tensor::<Train, 1, Int>::random([16], Uniform(0.0, 10.0), &device);
        let x = Tensor::<Train, 2>::random([16, 784], Normal(0.0, 1.0), &device) + y.clone().one_hot(784).float() * 5;
        let logits = model.forward(x).expect("forward");
        let batch_loss = cross_entropy.forward(logits, y);
        loss = batch_loss.clone().into_scalar();
        let grads = GradientsParams::from_grads(batch_loss.backward(), &model);
        model = optim.step(lr.step(), model, grads);
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
    let parsed = DeepSpeedConfig::from_str(&text, "inline config").expect("valid config");
    parsed.warnings.iter().for_each(|w| eprintln!("warning: {w}"));
    let config = parsed.config;
    println!("SimpleModel, ZeRO stage {stage}, 2 ranks");
    let losses = run_ranks(2, move |rank, group| train(&config, rank, group));
    println!("final losses by rank: {:?}", losses.expect("ranks ran"));
}
