//! TiledLinear: the tiled layer computes what the untiled `Linear` with the same weights
//! computes (forward and gradients), and as a chain of tiles stage 3 gathers one tile at a time.
//!
//! References: Burn's `Linear` with the same weights (forward and gradients); the same chain
//! with a single 1 × 1 tile (the untiled layer) trained by the same engine.

mod common;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor, TensorData};
use common::{on_ranks, values, B as Ad};
use zero_burn::{
    ChainEngine, ChainModel, EngineSettings, LinearTile, Stage, TileCarry, TiledLinear, TiledLinearConfig,
};
use zero_core::optim::{OptimizerSpec, SgdSpec};

/// max |a - b| / max |b|.
fn relative_error<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
    let scale = b.clone().abs().max().into_scalar().elem_f32();
    let diff = (a - b).abs().max().into_scalar().elem_f32();
    diff / scale
}

trait ElemF32 {
    fn elem_f32(self) -> f32;
}
impl<E: burn::tensor::ElementConversion> ElemF32 for E {
    fn elem_f32(self) -> f32 {
        self.elem::<f32>()
    }
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
        let e = relative_error(tiled.forward(x.clone()), linear.forward(x.clone()));
        assert!(e <= 1e-6, "{in_splits}x{out_splits}: forward differs by {e:e}");
        let mut carry = TileCarry::new(x.clone(), d_out);
        for tile in &tiled.tiles {
            carry = tile.forward_carry(carry);
        }
        let e = relative_error(carry.output(), linear.forward(x.clone()));
        assert!(
            e <= 1e-6,
            "{in_splits}x{out_splits}: tile-by-tile forward differs by {e:e}"
        );
        let x3 = random([2, 3, d_in]);
        let e = relative_error(tiled.forward(x3.clone()), linear.forward(x3));
        assert!(e <= 1e-6, "{in_splits}x{out_splits}: 3-D forward differs by {e:e}");

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
        assert!(
            relative_error(got_w, want_w) <= 1e-6,
            "{in_splits}x{out_splits}: weight gradient"
        );
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
        assert!(
            relative_error(got_b, want_b) <= 1e-6,
            "{in_splits}x{out_splits}: bias gradient"
        );
        let got_x = xb.grad(&gb).expect("input grad");
        assert!(
            relative_error(got_x, want_x) <= 1e-6,
            "{in_splits}x{out_splits}: input gradient"
        );

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

// ---- As a chain: one tile per block ----

const D_IN: usize = 64;
const D_OUT: usize = 48;
const ROWS: usize = 8;

/// An elementwise input scale and a one-output head: small enough to stay replicated.
#[derive(Module, Debug)]
struct TileEnds<B: Backend> {
    scale: Param<Tensor<B, 1>>,
    head: Linear<B>,
}

/// `head(tiled(x ⊙ scale))`, mean squared error, the tiles as blocks.
#[derive(Module, Debug)]
struct TiledNet<B: Backend> {
    ends: TileEnds<B>,
    tiles: Vec<LinearTile<B>>,
}

impl<B: AutodiffBackend> ChainModel<B> for TiledNet<B> {
    type Batch = (Tensor<B, 2>, Tensor<B, 2>);
    type Hidden = TileCarry<B>;
    type Ends = TileEnds<B>;
    type Block = LinearTile<B>;

    fn into_parts(self) -> (TileEnds<B>, Vec<LinearTile<B>>) {
        (self.ends, self.tiles)
    }
    fn from_parts(ends: TileEnds<B>, tiles: Vec<LinearTile<B>>) -> Self {
        TiledNet { ends, tiles }
    }
    fn embed(ends: &TileEnds<B>, batch: &Self::Batch) -> TileCarry<B> {
        TileCarry::new(batch.0.clone() * ends.scale.val().unsqueeze::<2>(), D_OUT)
    }
    fn block_forward(tile: &LinearTile<B>, carry: TileCarry<B>) -> TileCarry<B> {
        tile.forward_carry(carry)
    }
    fn head_loss(ends: &TileEnds<B>, carry: TileCarry<B>, batch: &Self::Batch) -> Tensor<B, 1> {
        (ends.head.forward(carry.output()) - batch.1.clone())
            .powi_scalar(2)
            .mean()
    }
}

fn deterministic<const D: usize>(shape: [usize; D], salt: usize) -> Tensor<Ad, D> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|k| 0.2 * ((k * 7 + salt * 13) as f32 * 0.31).sin())
        .collect();
    Tensor::from_data(TensorData::new(v, shape), &Default::default())
}

fn net(in_splits: usize, out_splits: usize) -> TiledNet<Ad> {
    let device = Default::default();
    let mut linear: Linear<Ad> = LinearConfig::new(D_IN, D_OUT).init(&device);
    linear.weight = Param::from_tensor(deterministic([D_IN, D_OUT], 1));
    linear.bias = Some(Param::from_tensor(deterministic([D_OUT], 2)));
    let mut head: Linear<Ad> = LinearConfig::new(D_OUT, 1).init(&device);
    head.weight = Param::from_tensor(deterministic([D_OUT, 1], 3));
    head.bias = Some(Param::from_tensor(deterministic([1], 5)));
    TiledNet {
        ends: TileEnds {
            scale: Param::from_tensor(deterministic([D_IN], 4) + 1.0),
            head,
        },
        tiles: TiledLinear::from_linear(&linear, in_splits, out_splits).into_tiles(),
    }
}

/// Three SGD steps at stage 3 on 2 ranks: the losses, the layer's weight (untiled) and the
/// gathered-memory peak of rank 0.
fn train(in_splits: usize, out_splits: usize) -> (Vec<f32>, Vec<Vec<f32>>, usize) {
    let results = on_ranks(2, move |rank, comm| {
        let mut s = EngineSettings::new(
            Stage::Zero3,
            OptimizerSpec::Sgd(SgdSpec {
                lr: 0.05,
                ..Default::default()
            }),
        );
        // The ends (≤ 64 elements each) stay replicated; every tile is sharded.
        s.param_persistence_threshold = 100;
        // No prefetch: the peak is what one part's gather holds.
        s.overlap_comm = false;
        let mut engine = ChainEngine::new(s, net(in_splits, out_splits), comm).expect("engine");
        let mut losses = Vec::new();
        for step in 0..3 {
            let x = deterministic([ROWS, D_IN], 10 + step * 2 + rank);
            let y = deterministic([ROWS, 1], 11 + step * 2 + rank);
            let loss = engine.forward((x, y)).expect("forward");
            losses.push(engine.backward(loss).expect("backward"));
            engine.step().expect("step");
        }
        let model = engine.module().expect("module");
        let tiled = TiledLinear {
            tiles: model.tiles,
            d_output: D_OUT,
            out_splits: out_splits.min(D_OUT),
        };
        (
            losses,
            values::<Ad, _>(&tiled.to_linear()),
            engine.memory().gathered.peak,
        )
    });
    results.into_iter().next().expect("rank 0")
}

#[test]
fn stage_3_trains_tile_by_tile_like_the_untiled_layer_and_gathers_one_tile() {
    let (want_losses, want_weights, untiled_peak) = train(1, 1);
    let (losses, weights, tiled_peak) = train(4, 4);
    for (got, want) in losses.iter().zip(&want_losses) {
        assert!(((got - want) / want).abs() <= 1e-6, "loss {got} vs {want}");
    }
    let scale = want_weights[0].iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (got, want) in weights.iter().zip(&want_weights) {
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() <= 1e-6 * scale, "trained weight {a} vs {b}");
        }
    }
    // Biases (≤ 48 elements) stay replicated. The untiled layer gathers the whole weight,
    // 64 × 48 = 3072 elements; a tile, 16 × 12 = 192 (both multiples of world × alignment).
    assert_eq!(untiled_peak, 3072 * 4);
    assert_eq!(tiled_peak, 192 * 4);
    eprintln!(
        "gathered-memory peak, {D_IN}x{D_OUT} layer at stage 3, world 2: untiled {untiled_peak} B, 4x4 tiles {tiled_peak} B ({:.1}x less)",
        untiled_peak as f64 / tiled_peak as f64
    );
}
