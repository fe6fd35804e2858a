//! A small chain model, deterministic data, and a harness that runs one closure per rank thread.

#![allow(dead_code)]

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use std::sync::Arc;
use zero_burn::params::{describe, read_values, write_values};
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::{ChainModel, ZeroError};
use zero_core::comm::{ProcessGroup, ThreadGroup};

pub mod counting;

pub type B = Autodiff<Flex>;

/// Input projection and head.
#[derive(Module, Debug)]
pub struct Ends<B: Backend> {
    pub input: Linear<B>,
    pub head: Linear<B>,
}

/// A residual MLP block: 187 parameters at hidden 12, inner 7 (not a multiple of 2, 3 or 4).
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub up: Linear<B>,
    pub down: Linear<B>,
}

/// in 5 → hidden 12 → 3 residual blocks → out 3; mean squared error.
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    pub ends: Ends<B>,
    pub blocks: Vec<Block<B>>,
}

pub const IN: usize = 5;
pub const HIDDEN: usize = 12;
pub const OUT: usize = 3;
pub const GLOBAL_BATCH: usize = 24;

impl<B: Backend> Block<B> {
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        x.clone() + self.down.forward(self.up.forward(x).tanh())
    }
}

impl<B: Backend> Net<B> {
    /// Deterministic weights (a smooth function of the parameter index and element index).
    pub fn new(device: &B::Device, blocks: usize) -> Self {
        let net = Net {
            ends: Ends {
                input: LinearConfig::new(IN, HIDDEN).init(device),
                head: LinearConfig::new(HIDDEN, OUT).init(device),
            },
            blocks: (0..blocks)
                .map(|_| Block {
                    up: LinearConfig::new(HIDDEN, 7).init(device),
                    down: LinearConfig::new(7, HIDDEN).init(device),
                })
                .collect(),
        };
        let sizes: Vec<usize> = describe::<B, _>(&net).iter().map(|(_, s)| s.numel()).collect();
        write_values(net, device, true, |i| {
            (0..sizes[i])
                .map(|k| 0.3 * ((i * 131 + k * 7) as f32 * 0.37).sin())
                .collect()
        })
    }

    pub fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let mut h = self.ends.input.forward(x);
        for b in &self.blocks {
            h = b.forward(h);
        }
        let out = self.ends.head.forward(h);
        (out - y).powi_scalar(2).mean()
    }
}

impl<B: AutodiffBackend> ChainModel<B> for Net<B> {
    type Batch = (Tensor<B, 2>, Tensor<B, 2>);
    type Hidden = Tensor<B, 2>;
    type Ends = Ends<B>;
    type Block = Block<B>;

    fn into_parts(self) -> (Ends<B>, Vec<Block<B>>) {
        (self.ends, self.blocks)
    }
    fn from_parts(ends: Ends<B>, blocks: Vec<Block<B>>) -> Self {
        Net { ends, blocks }
    }
    fn embed(ends: &Ends<B>, batch: &Self::Batch) -> Tensor<B, 2> {
        ends.input.forward(batch.0.clone())
    }
    fn block_forward(block: &Block<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        block.forward(x)
    }
    fn head_loss(ends: &Ends<B>, h: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        (ends.head.forward(h) - batch.1.clone()).powi_scalar(2).mean()
    }
}

/// [`Net`] with each block a `ZeroModule` (the ends replicated): the same weights, parameter
/// names and loss, and the same chain for `checkpointed_grads`. Blocks are whole until
/// `initialize_settings` cuts them.
#[derive(Module, Debug)]
pub struct UnitNet<B: Backend> {
    pub ends: Ends<B>,
    pub blocks: Vec<ZeroModule<B, Block<B>>>,
}

impl<B: ShardBackend> UnitNet<B> {
    /// `net`'s weights, each block a unit.
    pub fn of(net: Net<B>) -> Self {
        UnitNet {
            ends: net.ends,
            blocks: net.blocks.into_iter().map(ZeroModule::new).collect(),
        }
    }

    /// `Net::new`'s weights, each block a unit.
    pub fn new(device: &B::Device, blocks: usize) -> Self {
        Self::of(Net::new(device, blocks))
    }

    /// `Net::loss`, each block gathered for its forward.
    pub fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let mut h = self.ends.input.forward(x);
        for b in &self.blocks {
            h = b.unshard(&h).expect("gather").forward(h);
        }
        (self.ends.head.forward(h) - y).powi_scalar(2).mean()
    }

    /// The parameters in `Net`'s order, each block gathered whole (from the inner backend's
    /// copy: its gathers leave no autodiff graph behind). Every rank calls it together.
    pub fn weights(&self) -> Vec<Vec<f32>>
    where
        B: AutodiffBackend,
        B::InnerBackend: ShardBackend,
    {
        let model = self.valid();
        let mut out = values(&model.ends);
        for b in &model.blocks {
            read_values::<B::InnerBackend, _>(&b.gathered().expect("gather"), |_, v| out.push(v));
        }
        out
    }
}

impl<B: AutodiffBackend + ShardBackend> ChainModel<B> for UnitNet<B> {
    type Batch = (Tensor<B, 2>, Tensor<B, 2>);
    type Hidden = Tensor<B, 2>;
    type Ends = Ends<B>;
    type Block = ZeroModule<B, Block<B>>;

    fn into_parts(self) -> (Ends<B>, Vec<Self::Block>) {
        (self.ends, self.blocks)
    }
    fn from_parts(ends: Ends<B>, blocks: Vec<Self::Block>) -> Self {
        UnitNet { ends, blocks }
    }
    fn embed(ends: &Ends<B>, batch: &Self::Batch) -> Tensor<B, 2> {
        Net::embed(ends, batch)
    }
    fn block_forward(block: &Self::Block, x: Tensor<B, 2>) -> Tensor<B, 2> {
        block.unshard(&x).expect("gather").forward(x)
    }
    fn try_block_forward(block: &Self::Block, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ZeroError> {
        Ok(block.unshard(&x)?.forward(x))
    }
    fn head_loss(ends: &Ends<B>, h: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        Net::head_loss(ends, h, batch)
    }
}

/// The memory tests' backend: a unit's gathered weights freed after each use.
pub type Balanced = Autodiff<Flex, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;

/// Every rank's memory report and `tensor_state()` after one step of a [`UnitNet`] of `blocks`
/// blocks from `initialize_settings(settings)` on `world` rank threads (each rank on two rows
/// of the batch, in the compute dtype); the step must be applied.
pub fn unit_net_reports(
    settings: &zero_burn::EngineSettings,
    world: usize,
    blocks: usize,
) -> Vec<(zero_burn::MemoryReport, Option<bool>)> {
    on_ranks(world, |rank, group| {
        let device = Default::default();
        let units: zero_burn::sharded::UnitComm<Flex> = Arc::new(zero_burn::HostStaged::new(group.clone()));
        let (model, mut optim) = zero_burn::initialize_settings(
            settings.clone(),
            UnitNet::<Balanced>::new(&device, blocks),
            group,
            units,
        )
        .expect("initialize");
        let (x, y) = batch::<Balanced>(0, rank * 2..rank * 2 + 2, &device);
        let dtype = settings.precision.dtype.burn();
        let loss = model.loss(x.cast(dtype), y.cast(dtype));
        let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
        optim.try_step(1e-3, model, grads).expect("step");
        assert!(!optim.last_step().expect("a step").skipped);
        (optim.memory(), optim.tensor_state())
    })
}

/// Rank 0's report of [`unit_net_reports`].
pub fn unit_net_report(settings: &zero_burn::EngineSettings, world: usize, blocks: usize) -> zero_burn::MemoryReport {
    unit_net_reports(settings, world, blocks).remove(0).0
}

/// Rows `rows` of the deterministic global batch of step `step`.
pub fn batch<B: Backend>(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let n = rows.len();
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|r| (0..IN).map(move |c| ((r * 17 + c * 5 + step * 3) as f32 * 0.21).cos()))
        .collect();
    let y: Vec<f32> = rows
        .flat_map(|r| (0..OUT).map(move |c| ((r * 11 + c * 3 + step) as f32 * 0.13).sin()))
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [n, IN]), device),
        Tensor::from_data(TensorData::new(y, [n, OUT]), device),
    )
}

/// Runs `f(rank, group)` on `world` threads; returns the results in rank order.
pub fn on_ranks<T: Send>(world: usize, f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync) -> Vec<T> {
    let groups = ThreadGroup::new_group(world).expect("thread group");
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                let f = &f;
                s.spawn(move || f(rank, g as Arc<dyn ProcessGroup>))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Every parameter's values, flattened, in visit order.
pub fn values<B: Backend, M: Module<B>>(m: &M) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    zero_burn::params::read_values::<B, M>(m, |_, v| out.push(v));
    out
}

/// Parameters of one residual block of [`Net`].
pub const BLOCK_ELEMENTS: usize = HIDDEN * 7 + 7 + 7 * HIDDEN + HIDDEN;

/// Ψ of [`Net`] with `blocks` blocks (no padding).
pub fn psi(blocks: usize) -> usize {
    let ends = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT;
    ends + blocks * BLOCK_ELEMENTS
}

/// Asserts that the engine's figure `got` is within 5 % plus `slack` bytes of the formula's.
pub fn within(label: &str, got: usize, want: f64, slack: f64) {
    let tolerance = 0.05 * want + slack;
    assert!(
        (got as f64 - want).abs() <= tolerance,
        "{label}: engine reports {got} bytes, the formula gives {want:.0} (tolerance {tolerance:.0})"
    );
}

/// AdamW (lr `lr`, betas 0.9/0.999, weight decay 0.01) with eps 1e-4: see exactness.rs for why
/// not 1e-8.
pub fn adamw_eps4(lr: f64) -> zero_core::optim::OptimizerSpec {
    zero_core::optim::OptimizerSpec::Adam(zero_core::optim::AdamSpec {
        lr,
        betas: (0.9, 0.999),
        eps: 1e-4,
        weight_decay: 0.01,
        decoupled_weight_decay: true,
        bias_correction: true,
        amsgrad: false,
    })
}

/// Burn's own AdamW as [`adamw_eps4`] sets ours (what it steps: only parameters with a
/// gradient, its state made at a parameter's first one).
pub fn burn_adamw_eps4() -> burn::optim::AdamWConfig {
    burn::optim::AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-4)
        .with_weight_decay(0.01)
}

/// This rank's rows of micro-batch `micro` of the global batch: split in order across the
/// ranks, then across the `gas` micro-batches.
pub fn rows(rank: usize, world: usize, micro: usize, gas: usize) -> std::ops::Range<usize> {
    let per_rank = GLOBAL_BATCH / world;
    let per_micro = per_rank / gas;
    let start = rank * per_rank + micro * per_micro;
    start..start + per_micro
}

/// The learning rate of [`small_bucket_settings`].
pub const SMALL_BUCKET_LR: f64 = 0.01;

/// AdamW (lr [`SMALL_BUCKET_LR`], eps 1e-4) with accumulation, clipping and buckets of about
/// 100 elements, so that stages 1-2 reduce several groups per step.
pub fn small_bucket_settings(
    stage: zero_burn::Stage,
    gas: usize,
    clip: f64,
    precision: zero_burn::PrecisionSettings,
) -> zero_burn::EngineSettings {
    let mut s = zero_burn::EngineSettings::new(stage, adamw_eps4(SMALL_BUCKET_LR));
    s.gradient_accumulation_steps = gas;
    s.gradient_clipping = clip;
    s.reduce_bucket_size = 100;
    s.precision = precision;
    s
}
