//! A Burn model of a dependent's own, trained with ZeRO stage 3 by zero-burn: a two-layer
//! regressor whose layers are `ZeroModule`s, two ranks as threads of one process, Burn's loop.

use burn::backend::{autodiff::checkpoint::strategy::BalancedCheckpointing, Autodiff, Flex};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::{activation::gelu, Distribution};
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::ZeroError;
use zero_core::comm::{SharedGroup, ThreadGroup};
use zero_core::config::DeepSpeedConfig;

/// The backend: Burn's CPU backend under autodiff, whose balanced checkpointing lets stage 3
/// free each gathered layer after its forward and gather it again in backward.
pub type Train = Autodiff<Flex, BalancedCheckpointing>;

/// `y = W2 · gelu(W1 · x)`, each layer a unit that stage 3 cuts over the ranks.
#[derive(Module, Debug)]
pub struct Regressor<B: ShardBackend> {
    hidden: ZeroModule<B, Linear<B>>,
    out: ZeroModule<B, Linear<B>>,
}

impl<B: ShardBackend> Regressor<B> {
    /// A randomly initialized regressor of `inputs` features.
    pub fn new(inputs: usize, width: usize, device: &B::Device) -> Self {
        Regressor {
            hidden: ZeroModule::new(LinearConfig::new(inputs, width).init(device)),
            out: ZeroModule::new(LinearConfig::new(width, 1).init(device)),
        }
    }
}

impl Regressor<Train> {
    fn forward(&self, x: Tensor<Train, 2>) -> Result<Tensor<Train, 2>, ZeroError> {
        let h = gelu(self.hidden.unshard(&x)?.forward(x));
        Ok(self.out.unshard(&h)?.forward(h))
    }
}

/// What one rank saw: its loss before each step, and the whole weights it ended with.
#[derive(Debug)]
pub struct RankRun {
    /// The rank's loss on its own batch, before each step.
    pub losses: Vec<f32>,
    /// The first layer's whole weight after the last step, gathered from every rank's shard.
    pub hidden_weight: Vec<f32>,
}

const CONFIG: &str = r#"{
    "train_batch_size": 32,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}
}"#;

/// Trains the regressor `steps` steps at ZeRO stage 3 over `ranks` rank threads; each rank
/// learns `y = sum(x)` on a batch of its own. Returns each rank's run, in rank order.
pub fn train(ranks: usize, steps: usize) -> Result<Vec<RankRun>, ZeroError> {
    let parsed = DeepSpeedConfig::from_str(CONFIG, "ds_config.json").map_err(|e| ZeroError::Config(e.to_string()))?;
    let groups = ThreadGroup::new_group(ranks)?;
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let config = parsed.config.clone();
            std::thread::spawn(move || train_rank(&config, rank, group, steps))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(ZeroError::Config("a rank thread panicked".into())))
        })
        .collect()
}

fn train_rank(config: &DeepSpeedConfig, rank: usize, group: SharedGroup, steps: usize) -> Result<RankRun, ZeroError> {
    let device = Default::default();
    // Every rank builds the model; `initialize` makes rank 0's weights everyone's.
    let model = Regressor::<Train>::new(8, 32, &device);
    let (mut model, mut optim) = zero_burn::initialize(config, model, group)?;
    Train::seed(&device, 1 + rank as u64);
    let x = Tensor::<Train, 2>::random([16, 8], Distribution::Normal(0.0, 1.0), &device);
    let y = x.clone().sum_dim(1);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let loss = MseLoss::new().forward(model.forward(x.clone())?, y.clone(), Reduction::Mean);
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.01, model, grads);
    }
    let hidden_weight = model
        .hidden
        .gathered()?
        .weight
        .val()
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| ZeroError::Config(format!("{e:?}")))?;
    Ok(RankRun { losses, hidden_weight })
}
