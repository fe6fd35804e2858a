//! What the `ZeroModule` tests share: a model that is not a chain (three linear units, a skip
//! connection across them) as units and as plain layers, its data, rank threads handing each
//! rank the units' collective, and the error measure.

#![allow(dead_code)]

use crate::common;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use std::sync::Arc;
use zero_burn::params::write_values;
use zero_burn::sharded::{ShardBackend, UnitComm, ZeroModule};
use zero_burn::HostStaged;

/// The model with every linear layer a `ZeroModule`.
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    pub units: Vec<ZeroModule<B, Linear<B>>>,
}

impl<B: ShardBackend> Net<B> {
    /// The units whole, as a model written for Burn builds them.
    pub fn whole(device: &B::Device) -> Self {
        Net {
            units: units::<B>(device).into_iter().map(ZeroModule::new).collect(),
        }
    }

    /// Every unit cut over `comm`'s ranks.
    pub fn new(comm: UnitComm<B::Collective>, device: &B::Device) -> Self {
        zero_burn::sharded::shard_units(Self::whole(device), comm, 0).unwrap()
    }

    /// `loss`'s model, each unit gathered for its one forward.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let u1 = self.units[0].unshard(&x).unwrap();
        let h1 = relu(u1.forward(x));
        let u2 = self.units[1].unshard(&h1).unwrap();
        let h2 = relu(u2.forward(h1.clone()));
        let s = h2 + h1;
        let u3 = self.units[2].unshard(&s).unwrap();
        u3.forward(s)
    }

    pub fn loss(&self, x: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
        (self.forward(x) - target).powf_scalar(2.0).mean()
    }
}

pub const ROWS: usize = 8;
pub const SIZES: [(usize, usize); 3] = [(4, 6), (6, 6), (6, 3)];

/// The three units with weights from a fixed formula.
pub fn units<B: burn::tensor::backend::Backend>(device: &B::Device) -> Vec<Linear<B>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(u, &(i, o))| {
            write_values(LinearConfig::new(i, o).init(device), device, true, |p| {
                let n = if p == 0 { i * o } else { o };
                (0..n)
                    .map(|k| 0.5 * ((k * 7 + u * 131 + p * 17) as f32 * 0.37).sin())
                    .collect()
            })
        })
        .collect()
}

pub fn rows<B: burn::tensor::backend::Backend>(
    range: std::ops::Range<usize>,
    cols: usize,
    salt: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let n = range.len();
    let values: Vec<f32> = range
        .flat_map(|r| (0..cols).map(move |c| ((r * 11 + c * 3 + salt) as f32 * 0.43).cos()))
        .collect();
    Tensor::from_data(TensorData::new(values, [n, cols]), device)
}

/// The model: h1 = relu(u1 x), h2 = relu(u2 h1), y = u3 (h2 + h1); loss = mean squared error.
pub fn forward<B: Backend>(u: &[Linear<B>], x: Tensor<B, 2>) -> Tensor<B, 2> {
    let h1 = relu(u[0].forward(x));
    let h2 = relu(u[1].forward(h1.clone()));
    u[2].forward(h2 + h1)
}

pub fn loss<B: Backend>(u: &[Linear<B>], x: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
    (forward(u, x) - target).powf_scalar(2.0).mean()
}

/// `body(rank, comm)` on `world` rank threads, `comm` the units' collective over the rank's
/// group; the results in rank order.
pub fn on_ranks<T: Send>(world: usize, body: impl Fn(usize, UnitComm<burn::backend::Flex>) -> T + Sync) -> Vec<T> {
    common::on_ranks(world, |rank, group| body(rank, Arc::new(HostStaged::new(group))))
}

/// What one rank saw in [`train_net`]: per step the loss of its first micro-batch (bits), its
/// units gathered whole after the run (bits), where the parameter bytes were after the last
/// step (device, host, NVMe), and whether the optimizer's state was tensors.
#[derive(Clone, Debug)]
pub struct NetRun {
    pub losses: Vec<u32>,
    pub units: Vec<Vec<u32>>,
    pub params_placed: [usize; 3],
    pub tensor_state: Option<bool>,
}

/// [`Net`] from `initialize_settings` on `world` rank threads, trained over `steps` (the
/// optimizer's LR schedule), each step `micro` micro-batches of the rank's rows accumulated by
/// Burn's `GradientsAccumulator` (inputs in the compute dtype, the loss through `scale_loss`);
/// the checkpoint `load` loaded first and one saved into `save` after the last step.
pub fn train_net(
    settings: &zero_burn::EngineSettings,
    world: usize,
    micro: usize,
    steps: std::ops::Range<usize>,
    load: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Vec<NetRun> {
    use burn::module::AutodiffModule;
    use burn::optim::{GradientsAccumulator, GradientsParams};
    use burn::tensor::ElementConversion;
    type AB = burn::backend::Autodiff<burn::backend::Flex>;
    on_ranks(world, |rank, comm| {
        let device = Default::default();
        let group =
            zero_burn::DeviceCollective::<burn::backend::Flex>::host_group(comm.as_ref()).expect("a host group");
        let dtype = settings.precision.dtype.burn();
        let (mut model, mut optim) =
            zero_burn::initialize_settings(settings.clone(), Net::<AB>::whole(&device), group, comm)
                .expect("initialize");
        if let Some(dir) = load {
            model = optim.load_checkpoint(dir, None, model).expect("load").0;
        }
        let mut lr = optim.lr_scheduler();
        let per = ROWS / world / micro;
        let (mut losses, mut params_placed) = (Vec::new(), [0; 3]);
        for step in steps.clone() {
            let mut accumulator = GradientsAccumulator::new();
            for m in 0..micro {
                let start = (rank * micro + m) * per;
                let mine = start..start + per;
                let x = rows::<AB>(mine.clone(), 4, step, &device).cast(dtype);
                let loss = model.loss(x, rows::<AB>(mine, 3, 5 + step, &device).cast(dtype));
                if m == 0 {
                    losses.push(loss.clone().into_scalar().elem::<f32>().to_bits());
                }
                let grads = optim.scale_loss(loss.div_scalar(micro as f32)).backward();
                accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
            }
            let rate = burn::optim::lr_scheduler::LrScheduler::step(&mut lr);
            model = optim.try_step(rate, model, accumulator.grads()).expect("step");
            let p = optim.memory().locations.parameters;
            params_placed = [p.device, p.host, p.nvme];
        }
        if let Some(dir) = save {
            optim
                .save_checkpoint(dir, None, &serde_json::Value::Null)
                .expect("save");
        }
        // From the inner backend's copy: its gathers leave no autodiff graph holding the units.
        let units = model
            .valid()
            .units
            .iter()
            .map(|u| {
                let mut v = Vec::new();
                zero_burn::params::read_values::<burn::backend::Flex, _>(&u.gathered().expect("gather"), |_, p| {
                    v.extend(p.iter().map(|x| x.to_bits()))
                });
                v
            })
            .collect();
        NetRun {
            losses,
            units,
            params_placed,
            tensor_state: optim.tensor_state(),
        }
    })
}

/// Asserts that a run stopped after `first` and resumed as `second` is `whole`, the run
/// without the stop, in every bit: every rank's losses, then its units.
pub fn assert_resumed(label: &str, first: &[NetRun], second: &[NetRun], whole: &[NetRun]) {
    for (rank, ((a, b), w)) in first.iter().zip(second).zip(whole).enumerate() {
        let losses: Vec<u32> = a.losses.iter().chain(&b.losses).copied().collect();
        assert_eq!(losses, w.losses, "{label}: rank {rank}'s losses");
        assert_eq!(b.units, w.units, "{label}: rank {rank}'s weights");
    }
}

/// The offload tests' settings for [`train_net`]: AdamW with a schedule (a resume that lost its
/// position would use the wrong rate), every unit cut at stage 3 (the default threshold would
/// keep these small ones whole), the optimizer and parameters placed as given.
pub fn offload_settings(
    stage: zero_burn::Stage,
    precision: zero_burn::PrecisionSettings,
    optimizer: zero_burn::OptimizerOffload,
    params: zero_burn::ParamOffload,
) -> zero_burn::EngineSettings {
    use zero_core::optim::{AdamSpec, OptimizerSpec};
    let mut s = zero_burn::EngineSettings::new(
        stage,
        OptimizerSpec::Adam(AdamSpec {
            lr: 0.01,
            eps: 1e-4,
            weight_decay: 0.01,
            ..AdamSpec::adamw()
        }),
    );
    s.lr_schedule = Some(Arc::new(|step| 0.01 / (1.0 + step as f64)));
    s.precision = precision;
    s.offload_optimizer = optimizer;
    s.offload_param = params;
    s.param_persistence_threshold = 0;
    s
}

/// An empty scratch directory `name` of test `test`, unique to this process.
pub fn scratch(test: &str, name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-{test}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
