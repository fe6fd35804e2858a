//! Parameters that do not train under `ZeroOptimizer`: frozen ones (`no_grad()`, a plain
//! parameter or a whole `ZeroModule`) keep their values and stay frozen while the rest trains,
//! at stages 0-3, with the state on the device, in host memory and on NVMe; a BatchNorm's
//! running statistics (which Burn shows as parameters) reach checkpoints and exports as the
//! forward left them; a unit frozen in part refuses its forward instead of training the frozen
//! part.
//!
//! Reference: plain Burn on one thread over the whole global batch, with the same parts frozen
//! and Burn's own AdamW (`burn::optim::AdamWConfig`, which steps only what has a gradient).

use crate::common;
use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use common::*;
use std::sync::Arc;
use zero_burn::sharded::{UnitComm, ZeroModule};
use zero_burn::{EngineSettings, HostStaged, OptimizerOffload, Stage};
use zero_test_support::assert_close;

const BLOCKS: usize = 3;
const STEPS: usize = 4;
const LR: f64 = 0.01;

/// `Net` with its input projection and its second block frozen.
fn frozen_net(device: &burn::tensor::Device<B>) -> Net<B> {
    let mut net = Net::<B>::new(device, BLOCKS);
    net.ends.input = net.ends.input.no_grad();
    net.blocks[1] = net.blocks[1].clone().no_grad();
    net
}

fn reference() -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut model = frozen_net(&device);
    let mut optim = burn_adamw_eps4().init();
    for step in 0..STEPS {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.step(LR, model, grads);
    }
    values::<B, _>(&model)
}

/// `STEPS` steps of `ZeroOptimizer` over `frozen_net` with each block a unit, on `world` rank
/// threads; rank 0's parameters in `Net`'s order, and whether the frozen parts stayed frozen.
fn train(settings: &EngineSettings, world: usize) -> (Vec<Vec<f32>>, bool) {
    on_ranks(world, |rank, group| {
        let device = Default::default();
        let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(group.clone()));
        let model = UnitNet::of(frozen_net(&device));
        let (mut model, mut optim) =
            zero_burn::initialize_settings(settings.clone(), model, group, units).expect("initialize");
        for step in 0..STEPS {
            let (x, y) = batch::<B>(step, rows(rank, world, 0, 1), &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.try_step(LR, model, grads).expect("step");
        }
        let still_frozen = !model.ends.input.weight.is_require_grad()
            && !model.blocks[1].shard().is_require_grad()
            && model.blocks[0].shard().is_require_grad()
            && model.ends.head.weight.is_require_grad();
        (model.weights(), still_frozen)
    })
    .remove(0)
}

#[test]
fn frozen_parameters_keep_their_values_and_the_rest_trains_as_burn_does() {
    let want = reference();
    let initial = values::<B, _>(&frozen_net(&Default::default()));
    // Visit order: input weight and bias, head weight and bias, then each block's four.
    let frozen = [0, 1, 8, 9, 10, 11];
    for i in frozen {
        assert_eq!(want[i], initial[i], "the reference keeps parameter {i}");
    }
    assert_ne!(want[4], initial[4], "the reference trains the first block");
    let swap = std::env::temp_dir().join(format!("zero-frozen-{}", std::process::id()));
    let nvme = OptimizerOffload::Nvme {
        path: swap.clone(),
        buffer_count: 2,
        chunk_elements: 29,
        threads: 1,
    };
    let cases = [
        (Stage::Zero0, 1, OptimizerOffload::None),
        (Stage::Zero0, 2, OptimizerOffload::None),
        (Stage::Zero1, 2, OptimizerOffload::None),
        (Stage::Zero2, 2, OptimizerOffload::None),
        (Stage::Zero3, 2, OptimizerOffload::None),
        (Stage::Zero2, 2, OptimizerOffload::Cpu { threads: 1 }),
        (Stage::Zero3, 2, nvme),
    ];
    for (stage, world, offload) in cases {
        let label = format!("{stage:?}, world {world}, {offload:?}");
        let mut settings = EngineSettings::new(stage, adamw_eps4(LR));
        settings.offload_optimizer = offload;
        let (got, still_frozen) = train(&settings, world);
        assert!(still_frozen, "{label}: the frozen parts stay frozen, the rest trains");
        for i in frozen {
            assert_eq!(got[i], initial[i], "{label}: frozen parameter {i} moved");
        }
        assert_close(&label, &got, &want, 1e-5);
    }
    let _ = std::fs::remove_dir_all(&swap);
}

/// A model with a BatchNorm between replicated linears and a unit.
#[derive(Module, Debug)]
struct BnNet<B: Backend> {
    input: Linear<B>,
    norm: BatchNorm<B>,
    block: ZeroModule<B, Block<B>>,
    head: Linear<B>,
}

impl BnNet<B> {
    fn new(device: &burn::tensor::Device<B>) -> Self {
        let net = Net::<B>::new(device, 1);
        BnNet {
            input: net.ends.input,
            norm: BatchNormConfig::new(HIDDEN).init(device),
            block: ZeroModule::new(net.blocks.into_iter().next().expect("a block")),
            head: net.ends.head,
        }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = self.norm.forward(self.input.forward(x));
        let h = self.block.unshard(&h).expect("gather").forward(h);
        (self.head.forward(h) - y).powi_scalar(2).mean()
    }
}

/// The running mean and variance as the model holds them (the last forward's update synced in).
fn running<B2: Backend>(norm: &BatchNorm<B2>) -> Vec<Vec<f32>> {
    [norm.running_mean.value_sync(), norm.running_var.value_sync()]
        .into_iter()
        .map(|t| t.into_data().to_vec::<f32>().expect("f32"))
        .collect()
}

#[test]
fn batch_norm_statistics_reach_checkpoints_and_exports() {
    let device = Default::default();
    // The reference: plain Burn, one process.
    let mut plain = BnNet::new(&device);
    let mut optim = burn_adamw_eps4().init();
    for step in 0..STEPS {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(plain.loss(x, y).backward(), &plain);
        plain = optim.step(LR, plain, grads);
    }
    let want = running(&plain.norm);
    assert_ne!(want[0], vec![0.0; HIDDEN], "the forward moved the running mean");
    let dir = std::env::temp_dir().join(format!("zero-frozen-bn-{}", std::process::id()));
    for stage in [Stage::Zero0, Stage::Zero1] {
        let dir = dir.join(format!("{stage:?}"));
        let settings = EngineSettings::new(stage, adamw_eps4(LR));
        on_ranks(1, |_, group| {
            let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(group.clone()));
            let (mut model, mut optim) =
                zero_burn::initialize_settings(settings.clone(), BnNet::new(&device), group.clone(), units.clone())
                    .expect("initialize");
            for step in 0..STEPS {
                let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
                let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                model = optim.try_step(LR, model, grads).expect("step");
            }
            let label = format!("{stage:?}");
            assert_close(&format!("{label}: in memory"), &running(&model.norm), &want, 1e-5);
            assert!(model.norm.gamma.is_require_grad(), "{label}: the norm's scale trains");
            optim
                .save_checkpoint(&dir, Some("t"), &serde_json::Value::Null)
                .expect("save");
            let export = dir.join("weights.safetensors");
            optim
                .save_weights(&export, None, &|name: &str| Some(name.to_string()))
                .expect("export");
            let (fresh, resumed) =
                zero_burn::initialize_settings(settings.clone(), BnNet::new(&device), group, units).expect("again");
            let (loaded, _) = resumed.load_checkpoint(&dir, Some("t"), fresh).expect("load");
            assert_close(&format!("{label}: loaded"), &running(&loaded.norm), &want, 1e-5);
            let bytes = std::fs::read(&export).expect("the export");
            let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
            let exported: Vec<f32> = tensors
                .tensor("norm.running_mean")
                .expect("norm.running_mean exported")
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_close(&format!("{label}: exported"), &[exported], &want[..1], 1e-5);
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A unit trains whole: one whose module has a frozen part (or a BatchNorm) refuses its forward
/// and names the part, instead of training it through the flat parameter.
#[test]
fn a_unit_frozen_in_part_refuses_its_forward() {
    let device = Default::default();
    let block = Net::<B>::new(&device, 1).blocks.remove(0);
    let partly = ZeroModule::new(Block {
        up: block.up.clone().no_grad(),
        down: block.down.clone(),
    });
    let x = Tensor::<B, 2>::zeros([2, HIDDEN], &device);
    let err = partly.unshard(&x).expect_err("a unit frozen in part");
    assert!(
        err.to_string().contains("up.weight") && err.to_string().contains("no_grad"),
        "{err}"
    );
    // Frozen whole, it is a frozen unit: its forward runs.
    let whole = ZeroModule::new(block.no_grad());
    assert!(!whole.shard().is_require_grad());
    whole.unshard(&x).expect("a unit frozen whole");
    // A BatchNorm inside a unit: its running statistics would be lost with each gathered copy.
    #[derive(Module, Debug)]
    struct Normed<B: Backend> {
        norm: BatchNorm<B>,
        fc: Linear<B>,
    }
    let normed = ZeroModule::new(Normed {
        norm: BatchNormConfig::new(HIDDEN).init(&device),
        fc: LinearConfig::new(HIDDEN, 2).init(&device),
    });
    let err = normed.unshard(&x).expect_err("running statistics in a unit");
    assert!(err.to_string().contains("norm.running_mean"), "{err}");
}
