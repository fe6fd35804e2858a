//! `Sequential`: a model declared as a list of layers, each a `ZeroModule` (the activations'
//! with no parameter at all), trains under every stage (through `initialize_settings` and `ZeroOptimizer` in Burn's own
//! loop; at stage 3 one layer gathered at a time) exactly as the same layers do in plain Burn.
//!
//! Reference: plain Burn on one thread (`Sequential::loss` of the plain layers on the whole
//! global batch, Burn's own AdamW), independent of ZeroOptimizer. Parameters after 4 steps agree
//! to 1e-6 relative. Only rank 0 starts from the reference's weights; the other ranks start from
//! Burn's random initialisation, so the test also checks that `initialize_settings` starts every
//! rank from rank 0's. Adam's eps is 1e-4 for the reason given in exactness.rs.

use crate::common;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use common::{adamw_eps4, on_ranks, values, B};
use std::sync::Arc;
use zero_burn::params::{describe, read_values, write_values};
use zero_burn::sequential::{CrossEntropy, Layer, MeanSquaredError, Sequential, SequentialLoss};
use zero_burn::sharded::{UnitComm, ZeroModule};
use zero_burn::{EngineSettings, HostStaged, Stage};
use zero_core::optim::OptimizerSpec;
use zero_test_support::{assert_close, max_relative_error};

const STEPS: usize = 4;
const LR: f64 = 0.01;
const ROWS: usize = 8;
const IN: usize = 12;
const OUT: usize = 5;

type Model<L> = Sequential<B, Layer<B>, L>;

/// [`Model`] as ZeRO trains it: every layer a `ZeroModule` (the parameter-free ones hold
/// nothing and gather nothing).
type Units<L> = Sequential<B, ZeroModule<B, Layer<B>>, L>;

/// Linear → ReLU → LayerNorm → Linear → GELU → Linear: parameter-free blocks between
/// parameter blocks, so stage 3 gathers nothing for some of them.
fn model<L: SequentialLoss>(deterministic: bool) -> Model<L> {
    let device = Default::default();
    let m = Model::<L>::new(vec![
        Layer::linear(IN, 16, &device),
        Layer::relu(),
        Layer::layer_norm(16, &device),
        Layer::linear(16, 16, &device),
        Layer::gelu(),
        Layer::linear(16, OUT, &device),
    ]);
    if !deterministic {
        return m;
    }
    let sizes: Vec<usize> = describe::<B, _>(&m).iter().map(|(_, s)| s.numel()).collect();
    write_values(m, &device, true, |i| {
        (0..sizes[i])
            .map(|k| 0.4 * ((i * 97 + k * 13) as f32 * 0.29).sin())
            .collect()
    })
}

fn inputs(step: usize, rows: std::ops::Range<usize>) -> Tensor<B, 2> {
    let n = rows.len();
    let x: Vec<f32> = rows
        .flat_map(|r| (0..IN).map(move |c| ((r * 19 + c * 7 + step * 5) as f32 * 0.23).cos()))
        .collect();
    Tensor::from_data(TensorData::new(x, [n, IN]), &Default::default())
}

/// A batch for each loss: class labels for cross-entropy, a smooth target for MSE.
trait Targets: SequentialLoss {
    fn target(step: usize, rows: std::ops::Range<usize>) -> Self::Target<B>;
}
impl Targets for CrossEntropy {
    fn target(step: usize, rows: std::ops::Range<usize>) -> Tensor<B, 1, Int> {
        let n = rows.len();
        let y: Vec<i64> = rows.map(|r| ((r * 3 + step) % OUT) as i64).collect();
        Tensor::from_data(TensorData::new(y, [n]), &Default::default())
    }
}
impl Targets for MeanSquaredError {
    fn target(step: usize, rows: std::ops::Range<usize>) -> Tensor<B, 2> {
        let n = rows.len();
        let y: Vec<f32> = rows
            .flat_map(|r| (0..OUT).map(move |c| ((r * 5 + c * 11 + step) as f32 * 0.17).sin()))
            .collect();
        Tensor::from_data(TensorData::new(y, [n, OUT]), &Default::default())
    }
}

fn adamw() -> OptimizerSpec {
    adamw_eps4(LR)
}

fn reference<L: Targets>() -> Vec<Vec<f32>> {
    let mut m = model::<L>(true);
    let mut optim = AdamWConfig::new().with_epsilon(1e-4).with_weight_decay(0.01).init();
    for step in 0..STEPS {
        let batch = (inputs(step, 0..ROWS), L::target(step, 0..ROWS));
        let grads = GradientsParams::from_grads(m.loss(&batch).backward(), &m);
        m = optim.step(LR, m, grads);
    }
    values::<B, _>(&m)
}

/// Rank 0's parameters (each layer gathered whole, in [`Model`]'s order) after `STEPS` steps of
/// [`Units`] from `initialize_settings` at `stage` on `world` ranks, each rank on its slice of
/// the batch.
fn run<L: Targets>(stage: Stage, world: usize) -> Vec<Vec<f32>> {
    let results = on_ranks(world, move |rank, group| {
        let mut settings = EngineSettings::new(stage, adamw());
        settings.gradient_clipping = 0.0;
        settings.param_persistence_threshold = 0;
        let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(group.clone()));
        let layers = model::<L>(rank == 0).layers.into_iter().map(ZeroModule::new).collect();
        let (mut m, mut optim) =
            zero_burn::initialize_settings(settings, Units::<L>::new(layers), group, units).expect("initialize");
        let per_rank = ROWS / world;
        for step in 0..STEPS {
            let rows = rank * per_rank..(rank + 1) * per_rank;
            let batch = (inputs(step, rows.clone()), L::target(step, rows));
            let grads = GradientsParams::from_grads(m.loss(&batch).backward(), &m);
            m = optim.try_step(LR, m, grads).expect("step");
        }
        // The inner backend's copy: its gathers leave no autodiff graph behind.
        let mut out = Vec::new();
        for layer in &m.valid().layers {
            read_values::<burn::backend::Flex, _>(&layer.gathered().expect("gather"), |_, v| out.push(v));
        }
        out
    });
    results.into_iter().next().unwrap_or_default()
}

fn check<L: Targets>(label: &str) {
    let want = reference::<L>();
    // A run that did not train would not match by accident.
    let initial = values::<B, _>(&model::<L>(true));
    assert!(
        max_relative_error(&format!("{label}: the initial weights"), &initial, &want) > 1e-3,
        "{label}: the reference did not train"
    );
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1, 2, 4] {
            let got = run::<L>(stage, world);
            assert_close(&format!("{label}, stage {stage:?}, world {world}"), &got, &want, 1e-6);
        }
    }
}

#[test]
fn sequential_cross_entropy_matches_plain_burn_at_every_stage() {
    check::<CrossEntropy>("cross-entropy");
}

#[test]
fn sequential_mse_matches_plain_burn_at_every_stage() {
    check::<MeanSquaredError>("mse");
}

#[test]
fn sequential_forward_is_the_layers_in_order() {
    // Reference: the same Burn layers called by hand.
    let m = model::<CrossEntropy>(true);
    let x = inputs(0, 0..3);
    let mut h = x.clone();
    for layer in &m.layers {
        h = match layer {
            Layer::Linear(l) => l.forward(h),
            Layer::Activation(a) => a.forward(h),
            Layer::LayerNorm(n) => n.forward(h),
        };
    }
    let got = m.forward(x).into_data().to_vec::<f32>().expect("f32");
    assert_eq!(got, h.into_data().to_vec::<f32>().expect("f32"));
}
