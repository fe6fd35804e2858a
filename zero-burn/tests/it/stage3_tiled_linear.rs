//! TiledLinear: the tiled layer computes what the untiled `Linear` with the same weights
//! computes (forward and gradients), and with each tile a `ZeroModule` stage 3 gathers one tile
//! at a time.
//!
//! References: Burn's `Linear` with the same weights (forward and gradients); the same model
//! with a single 1 × 1 tile (the untiled layer) trained by the same optimizer.

use crate::common;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor, TensorData};
use common::{on_ranks, values, B as Ad};
use zero_burn::sharded::shard_units;
use zero_burn::{EngineSettings, ShardedTiledLinear, Stage, TiledLinear, TiledLinearConfig};
use zero_core::optim::{OptimizerSpec, SgdSpec};
use zero_test_support::{assert_close, max_abs, max_abs_diff, max_relative_error};

/// Fails, naming `what`, unless `got` has `want`'s shape and is within `tolerance` of it
/// (max |got - want| / max |want|).
fn assert_tensors_close<B: Backend, const D: usize>(what: &str, got: Tensor<B, D>, want: Tensor<B, D>, tolerance: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let read = |t: Tensor<B, D>| t.into_data().convert::<f32>().into_vec::<f32>().expect("f32 values");
    assert_close(what, &read(got), &read(want), tolerance);
}

fn random<const D: usize>(shape: [usize; D]) -> Tensor<Ad, D> {
    Tensor::random(shape, Distribution::Uniform(-1.0, 1.0), &Default::default())
}

/// The tiles' weight gradients put back together as the whole weight's gradient.
fn assembled_grad(
    tiled: &TiledLinear<Ad>,
    grads: &<Ad as AutodiffBackend>::Gradients,
    d_in: usize,
    d_out: usize,
) -> Tensor<<Ad as AutodiffBackend>::InnerBackend, 2> {
    let mut full = Tensor::zeros([d_in, d_out], &Default::default());
    for tile in &tiled.tiles {
        let g = tile.weight.grad(grads).expect("every tile gets a gradient");
        let [r, c] = g.dims();
        full = full.slice_assign(
            [tile.in_start..tile.in_start + r, tile.out_start..tile.out_start + c],
            g,
        );
    }
    full
}

#[test]
fn forward_and_gradients_equal_the_untiled_linear() {
    let (d_in, d_out) = (10, 7);
    for (in_splits, out_splits) in [(1, 1), (3, 2), (4, 4), (10, 7)] {
        let device = Default::default();
        let linear: Linear<Ad> = LinearConfig::new(d_in, d_out).init(&device);
        let tiled = TiledLinear::from_linear(&linear, in_splits, out_splits);
        assert_eq!(tiled.tiles.len(), in_splits * out_splits);

        // Forward, 2-D and 3-D inputs.
        let x = random([5, d_in]);
        let label = format!("{in_splits}x{out_splits}");
        assert_tensors_close(
            &format!("{label}: forward"),
            tiled.forward(x.clone()),
            linear.forward(x.clone()),
            1e-6,
        );
        let units = on_ranks(1, |_, comm| {
            let comm: zero_burn::sharded::UnitComm<Flex> = std::sync::Arc::new(zero_burn::HostStaged::new(comm));
            let sharded = shard_units(tiled.clone().into_sharded(), comm, 0).expect("cut");
            sharded.forward(x.clone()).expect("forward").into_data()
        });
        assert_tensors_close(
            &format!("{label}: the tiles as units"),
            Tensor::from_data(units[0].clone(), &device),
            linear.forward(x.clone()),
            1e-6,
        );
        let x3 = random([2, 3, d_in]);
        assert_tensors_close(
            &format!("{label}: 3-D forward"),
            tiled.forward(x3.clone()),
            linear.forward(x3),
            1e-6,
        );

        // Gradients of sum(y ⊙ r) for a fixed r: weight, bias and input.
        // Each graph gets its own input leaf, built from the values (not a clone of one
        // tensor), and what the first graph gives is read before the second is built.
        let r = random([5, d_out]);
        let xa = Tensor::<Ad, 2>::from_data(x.to_data(), &device).require_grad();
        let ga = (linear.forward(xa.clone()) * r.clone()).sum().backward();
        let want_w = linear.weight.grad(&ga).expect("weight grad");
        let want_b = linear.bias.as_ref().expect("bias").grad(&ga).expect("bias grad");
        let want_x = xa.grad(&ga).expect("input grad");
        let xb = Tensor::<Ad, 2>::from_data(x.to_data(), &device).require_grad();
        let gb = (tiled.forward(xb.clone()) * r).sum().backward();
        let got_w = assembled_grad(&tiled, &gb, d_in, d_out);
        assert_tensors_close(&format!("{label}: weight gradient"), got_w, want_w, 1e-6);
        let got_b = Tensor::cat(
            tiled.tiles[..tiled.out_splits]
                .iter()
                .map(|t| {
                    t.bias
                        .as_ref()
                        .expect("first split has the bias")
                        .grad(&gb)
                        .expect("bias grad")
                })
                .collect(),
            0,
        );
        assert_tensors_close(&format!("{label}: bias gradient"), got_b, want_b, 1e-6);
        let got_x = xb.grad(&gb).expect("input grad");
        assert_tensors_close(&format!("{label}: input gradient"), got_x, want_x, 1e-6);

        // Round trip to the untiled layer, exactly.
        let back = tiled.to_linear();
        assert_eq!(values::<Ad, _>(&back), values::<Ad, _>(&linear));
    }
}

#[test]
fn config_init_builds_the_tiles_with_the_layers_shape() {
    let tiled: TiledLinear<Ad> = TiledLinearConfig::new(9, 6, 2, 3).init(&Default::default());
    let linear = tiled.to_linear();
    assert_eq!(linear.weight.dims(), [9, 6]);
    assert_eq!(linear.bias.as_ref().map(|b| b.dims()), Some([6]));
    assert_eq!(tiled.largest_tile_elements(), 5 * 2 + 2);
    // Kaiming uniform with the whole layer's fan-in: |w| ≤ 1/sqrt(9).
    let max = linear.weight.val().abs().max().into_scalar();
    assert!(max <= 1.0 / 3.0 + 1e-6 && max > 0.0);
}

// ---- Each tile a unit ----

const D_IN: usize = 64;
const D_OUT: usize = 48;
const ROWS: usize = 8;

/// Under a checkpointing strategy a unit's gathered weights are freed after its use.
type Bal = Autodiff<Flex, BalancedCheckpointing>;

/// `head(tiled(x ⊙ scale))`, mean squared error; the scale and the head stay replicated.
#[derive(Module, Debug)]
struct TiledNet<B: Backend> {
    scale: Param<Tensor<B, 1>>,
    tiled: ShardedTiledLinear<B>,
    head: Linear<B>,
}

impl TiledNet<Bal> {
    fn loss(&self, x: Tensor<Bal, 2>, y: Tensor<Bal, 2>) -> Tensor<Bal, 1> {
        let h = self
            .tiled
            .forward(x * self.scale.val().unsqueeze::<2>())
            .expect("forward");
        (self.head.forward(h) - y).powi_scalar(2).mean()
    }
}

fn deterministic<const D: usize>(shape: [usize; D], salt: usize) -> Tensor<Bal, D> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|k| 0.2 * ((k * 7 + salt * 13) as f32 * 0.31).sin())
        .collect();
    Tensor::from_data(TensorData::new(v, shape), &Default::default())
}

fn net(in_splits: usize, out_splits: usize) -> TiledNet<Bal> {
    let device = Default::default();
    let mut linear: Linear<Bal> = LinearConfig::new(D_IN, D_OUT).init(&device);
    linear.weight = Param::from_tensor(deterministic([D_IN, D_OUT], 1));
    linear.bias = Some(Param::from_tensor(deterministic([D_OUT], 2)));
    let mut head: Linear<Bal> = LinearConfig::new(D_OUT, 1).init(&device);
    head.weight = Param::from_tensor(deterministic([D_OUT, 1], 3));
    head.bias = Some(Param::from_tensor(deterministic([1], 5)));
    TiledNet {
        scale: Param::from_tensor(deterministic([D_IN], 4) + 1.0),
        tiled: TiledLinear::from_linear(&linear, in_splits, out_splits).into_sharded(),
        head,
    }
}

/// Three SGD steps at stage 3 on 2 ranks through `initialize_settings` (every tile cut, the
/// scale and head under the persistence threshold): the losses, the layer's weight (untiled)
/// and what rank 0's memory report counts gathered at once.
fn train(in_splits: usize, out_splits: usize) -> (Vec<f32>, Vec<Vec<f32>>, usize) {
    let results = on_ranks(2, move |rank, group| {
        let mut s = EngineSettings::new(
            Stage::Zero3,
            OptimizerSpec::Sgd(SgdSpec {
                lr: 0.05,
                ..Default::default()
            }),
        );
        s.param_persistence_threshold = 100;
        // No prefetch: what is gathered at once is one unit.
        s.overlap_comm = false;
        let comm: zero_burn::sharded::UnitComm<Flex> = std::sync::Arc::new(zero_burn::HostStaged::new(group.clone()));
        let (mut model, mut optim) =
            zero_burn::initialize_settings(s, net(in_splits, out_splits), group, comm).expect("initialize");
        let mut losses = Vec::new();
        for step in 0..3 {
            let x = deterministic([ROWS, D_IN], 10 + step * 2 + rank);
            let y = deterministic([ROWS, 1], 11 + step * 2 + rank);
            let loss = model.loss(x, y);
            losses.push(loss.clone().into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.try_step(0.05, model, grads).expect("step");
        }
        let tiled = model.tiled.gathered().expect("gather");
        (
            losses,
            values::<Bal, _>(&tiled.to_linear()),
            optim.memory().gathered.current,
        )
    });
    // The loss each rank saw, averaged as the optimizer averages the gradients.
    let losses: Vec<f32> = (0..3)
        .map(|s| results.iter().map(|r| r.0[s]).sum::<f32>() / 2.0)
        .collect();
    let (_, weights, gathered) = results.into_iter().next().expect("rank 0");
    (losses, weights, gathered)
}

#[test]
fn stage_3_trains_tile_by_tile_like_the_untiled_layer_and_gathers_one_tile() {
    let (want_losses, want_weights, untiled) = train(1, 1);
    let (losses, weights, tiled) = train(4, 4);
    for (got, want) in losses.iter().zip(&want_losses) {
        assert!(((got - want) / want).abs() <= 1e-6, "loss {got} vs {want}");
    }
    let initial = values::<Bal, _>(&net(1, 1).tiled.gathered().expect("whole").to_linear());
    assert!(
        max_relative_error("the initial weights", &initial, &want_weights) > 1e-3,
        "the layer trained"
    );
    // Relative to the largest weight of the layer (the first parameter), over every parameter.
    let scale = max_abs("the untiled layer's weight", &want_weights[0]);
    let diff = max_abs_diff("the tiled layer's trained parameters", &weights, &want_weights);
    assert!(
        diff <= 1e-6 * scale,
        "trained parameters differ by {diff:e} (scale {scale})"
    );
    // The untiled layer is one unit of 64 × 48 + 48 = 3120 elements (3136 padded to 2 ranks ×
    // 16); a tile of the first input split 16 × 12 + 12 = 204 (224 padded), the largest.
    assert_eq!(untiled, 3136 * 4);
    assert_eq!(tiled, 224 * 4);
    eprintln!(
        "gathered at once, {D_IN}x{D_OUT} layer at stage 3, world 2: untiled {untiled} B, 4x4 tiles {tiled} B ({:.1}x less)",
        untiled as f64 / tiled as f64
    );
}
