//! Units whose use depends on the data under activation checkpointing (`checkpointed_grads`):
//! a chain of mixture-of-experts blocks, each row routed by the sign of its own hidden value to
//! one of the block's two experts (each a `ZeroModule`), an expert with no rows on a rank
//! gathered with the empty input and left out of the block's output. Forward runs every block
//! without a graph; backward runs each segment again as its own graph, in which every unit's
//! reduce-scatter must still happen on every rank. Reference: the same model on one process over
//! the global batch, its units never cut, stepped by Burn's SGD without checkpointing.

use crate::common;
use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};
use std::sync::{Arc, Mutex};
use zero_burn::params::write_values;
use zero_burn::sharded::{ShardBackend, ZeroModule};
use zero_burn::{checkpointed_grads, ActivationCheckpointing, ChainModel, HostStaged, ZeroError};
use zero_core::config::DeepSpeedConfig;

type AB = Autodiff<Flex>;

const ROWS: usize = 8;
const IN: usize = 3;
const HIDDEN: usize = 5;
const BLOCKS: usize = 2;
const STEPS: usize = 4;
const LR: f64 = 0.2;
/// Rows whose first hidden value is above it go to expert 1.
const THRESHOLD: f32 = 0.0;

#[derive(Module, Debug)]
struct Ends<B: Backend> {
    input: Linear<B>,
    head: Linear<B>,
}

#[derive(Module, Debug)]
struct Moe<B: Backend> {
    experts: Vec<ZeroModule<B, Linear<B>>>,
}

#[derive(Module, Debug)]
struct Net<B: Backend> {
    ends: Ends<B>,
    blocks: Vec<Moe<B>>,
}

fn linear<B: Backend>(i: usize, o: usize, salt: usize, device: &B::Device) -> Linear<B> {
    write_values(LinearConfig::new(i, o).init(device), device, true, |p| {
        let n = if p == 0 { i * o } else { o };
        (0..n)
            .map(|k| 0.6 * ((k * 7 + salt * 131 + p * 17) as f32 * 0.37).sin())
            .collect()
    })
}

impl<B: ShardBackend> Net<B> {
    fn new(device: &B::Device) -> Self {
        Net {
            ends: Ends {
                input: linear(IN, HIDDEN, 0, device),
                head: linear(HIDDEN, 1, 1, device),
            },
            blocks: (0..BLOCKS)
                .map(|b| Moe {
                    experts: (0..2)
                        .map(|e| ZeroModule::new(linear(HIDDEN, HIDDEN, 2 + 2 * b + e, device)))
                        .collect(),
                })
                .collect(),
        }
    }
}

/// Rows `rows` of step `step`'s batch: inputs and targets.
fn batch<B: Backend>(rows: std::ops::Range<usize>, step: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let n = rows.len();
    // The last column leads the first block's routing: at steps 0 and 1 it sends one half of
    // the batch (one rank's rows) to one expert and the other half to the other.
    let value = move |r: usize, c: usize| {
        let wave = ((r * 11 + c * 3 + step * 5) as f32 * 0.43).cos();
        match (c, step) {
            (2, 0 | 1) if (r < ROWS / 2) == (step == 0) => 2.0 + 0.1 * wave,
            (2, 0 | 1) => -2.0 + 0.1 * wave,
            _ => wave,
        }
    };
    let x: Vec<f32> = rows.clone().flat_map(|r| (0..IN).map(move |c| value(r, c))).collect();
    let y: Vec<f32> = rows.map(|r| ((r * 7 + step) as f32 * 0.31).sin()).collect();
    (
        Tensor::from_data(TensorData::new(x, [n, IN]), device),
        Tensor::from_data(TensorData::new(y, [n, 1]), device),
    )
}

/// Which expert each row of `x` goes to: by the sign of its first hidden value.
fn routes<B: Backend>(x: &Tensor<B, 2>) -> Vec<usize> {
    let first: Vec<f32> = zero_burn::params::tensor_to_vec(x.clone().narrow(1, 0, 1).flatten::<1>(0, 1));
    first.iter().map(|&v| usize::from(v > THRESHOLD)).collect()
}

/// The routes of every block's forward: what the test checks gave an expert no rows in one
/// rank's half of the batch and some in the other's.
static SEEN: Mutex<Vec<Vec<usize>>> = Mutex::new(Vec::new());

/// x + relu(expert(x)) for each row through its own expert; an expert with no rows is still
/// gathered (with the empty input) and adds nothing.
fn block<B: ShardBackend>(moe: &Moe<B>, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ZeroError> {
    let route = routes(&x);
    let device = x.device();
    let mut y = x.clone();
    for (e, expert) in moe.experts.iter().enumerate() {
        let mine: Vec<i64> = (0..route.len()).filter(|&r| route[r] == e).map(|r| r as i64).collect();
        let n = mine.len();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(mine, [n]), &device);
        let xe = x.clone().select(0, index.clone());
        let out = relu(expert.unshard(&xe)?.forward(xe));
        if n > 0 {
            y = y.select_assign(0, index, out, IndexingUpdateOp::Add);
        }
    }
    SEEN.lock().expect("seen").push(route);
    Ok(y)
}

/// Squared error of the head's output, summed over the rows, divided by `per`.
fn head_loss<B: Backend>(ends: &Ends<B>, h: Tensor<B, 2>, y: &Tensor<B, 2>, per: usize) -> Tensor<B, 1> {
    (ends.head.forward(h) - y.clone())
        .powf_scalar(2.0)
        .sum()
        .div_scalar(per as f32)
}

impl<B: AutodiffBackend + ShardBackend> ChainModel<B> for Net<B> {
    /// Inputs, targets, and the rows a rank's loss is divided by.
    type Batch = (Tensor<B, 2>, Tensor<B, 2>, usize);
    type Hidden = Tensor<B, 2>;
    type Ends = Ends<B>;
    type Block = Moe<B>;
    fn into_parts(self) -> (Ends<B>, Vec<Moe<B>>) {
        (self.ends, self.blocks)
    }
    fn from_parts(ends: Ends<B>, blocks: Vec<Moe<B>>) -> Self {
        Net { ends, blocks }
    }
    fn embed(ends: &Ends<B>, batch: &Self::Batch) -> Tensor<B, 2> {
        ends.input.forward(batch.0.clone())
    }
    fn block_forward(moe: &Moe<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        block(moe, x).expect("a block")
    }
    fn try_block_forward(moe: &Moe<B>, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ZeroError> {
        block(moe, x)
    }
    fn head_loss(ends: &Ends<B>, h: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        head_loss(ends, h, &batch.1, batch.2)
    }
}

/// Every parameter's values, in visit order, units gathered whole.
fn values(net: &Net<Flex>) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let mut linear = |l: &Linear<Flex>| {
        let mut v = zero_burn::params::tensor_to_vec(l.weight.val().flatten::<1>(0, 1));
        v.extend(zero_burn::params::tensor_to_vec(l.bias.as_ref().expect("bias").val()));
        out.push(v);
    };
    linear(&net.ends.input);
    linear(&net.ends.head);
    for moe in &net.blocks {
        for expert in &moe.experts {
            linear(&expert.gathered().expect("gather"));
        }
    }
    out
}

fn one_process() -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut net = Net::<AB>::new(&device);
    let mut optim = SgdConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = batch::<AB>(0..ROWS, step, &device);
        let mut h = net.ends.input.forward(x);
        for moe in &net.blocks {
            h = block(moe, h).expect("a block");
        }
        let loss = head_loss(&net.ends, h, &y, ROWS);
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        net = optim.step(LR, net, grads);
    }
    values(&net.valid())
}

#[test]
fn experts_routed_by_the_data_under_activation_checkpointing() {
    let world = 2;
    let want = one_process();
    // The reference's routes (rows route one by one, so each rank's half routes as here): for
    // each expert, some block of some step gives it rows in one half and none in the other (the
    // later expert: a unit after the last one a rank's loss reached; the earlier: one reached
    // only through the chain).
    let seen = std::mem::take(&mut *SEEN.lock().expect("seen"));
    for e in 0..2 {
        let lopsided = seen.iter().any(|route| {
            let has = |half: &[usize]| half.contains(&e);
            has(&route[..ROWS / 2]) != has(&route[ROWS / 2..])
        });
        assert!(lopsided, "expert {e} is never routed rows by one rank only: {seen:?}");
    }
    let config = DeepSpeedConfig::from_str(
        &format!(
            r#"{{"train_batch_size": {ROWS}, "train_micro_batch_size_per_gpu": {}, "gradient_clipping": 0,
            "optimizer": {{"type": "SGD", "params": {{"lr": {LR}}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0}}}}"#,
            ROWS / world
        ),
        "chain.json",
    )
    .expect("config")
    .config;
    let per = ROWS / world;
    let got = common::on_ranks(world, |rank, group| {
        let device = Default::default();
        let collective = Arc::new(HostStaged::new(group.clone()));
        let (mut net, mut optim) = zero_burn::initialize_on(
            &config,
            Net::<AB>::new(&device),
            group,
            collective,
            &zero_burn::InitOptions::default(),
        )
        .expect("initialize");
        let setting = ActivationCheckpointing {
            number_checkpoints: Some(BLOCKS),
            ..Default::default()
        };
        for step in 0..STEPS {
            let (x, y) = batch::<AB>(rank * per..(rank + 1) * per, step, &device);
            let (_, grads) = checkpointed_grads(&net, &(x, y, per), &setting, 1.0).expect("grads");
            net = optim.try_step(LR, net, grads).expect("step");
        }
        values(&net.valid())
    });
    for (rank, got) in got.iter().enumerate() {
        let err = zero_test_support::max_abs_diff(&format!("rank {rank}"), got, &want);
        assert!(err < 1e-6, "rank {rank}: {err:e} off one process");
    }
}
