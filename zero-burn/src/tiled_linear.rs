//! A linear layer cut into tiles (DeepSpeed's `TiledLinear`), so that stage 3 can gather one
//! tile at a time instead of the whole weight.
//!
//! `y = x·W + b` with `W` `[d_input, d_output]` (Burn's `Linear` layout) is cut into
//! `in_splits × out_splits` tiles `W[i][j]`, each its own parameter:
//! `y[:, out_j] = Σ_i x[:, in_i] · W[i][j] + b[out_j]`, the bias slice living in the tile
//! `(0, j)`. The sum runs in the order of `i`; its rounding differs from the untiled product's
//! only by the order of the additions.
//!
//! Two ways to use it:
//! - [`TiledLinear`] is a Burn module with the `Linear` forward: put it in a unit (every tile
//!   is then gathered with the unit).
//! - [`TiledLinear::into_sharded`] makes each tile a `ZeroModule` of its own
//!   ([`ShardedTiledLinear`]): stage 3 cuts every tile over the ranks and its forward gathers,
//!   uses and (under `BalancedCheckpointing`) frees one tile at a time. The largest gather is
//!   then one tile, `1 / (in_splits × out_splits)` of the weight.

use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::ZeroError;
use crate::sharded::{ShardBackend, ZeroModule};

/// The shape of a [`TiledLinear`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiledLinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// Tiles along the input features (at most `d_input`).
    pub in_splits: usize,
    /// Tiles along the output features (at most `d_output`).
    pub out_splits: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
}

/// One tile: `acc[:, out] += x[:, in] · weight (+ bias)`.
#[derive(Module, Debug)]
pub struct LinearTile<B: Backend> {
    /// `W[in_start.., out_start..]`, `[in_len, out_len]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `b[out_start..]` (tiles of the first input split only).
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// First input feature of the tile.
    pub in_start: usize,
    /// First output feature of the tile.
    pub out_start: usize,
}

/// A linear layer stored as `in_splits × out_splits` tiles, each its own parameter.
#[derive(Module, Debug)]
pub struct TiledLinear<B: Backend> {
    /// The tiles, input split major: tile `(i, j)` is `tiles[i * out_splits + j]`.
    pub tiles: Vec<LinearTile<B>>,
    /// Output features.
    pub d_output: usize,
    /// Tiles along the output features.
    pub out_splits: usize,
}

/// A [`TiledLinear`] whose tiles are each a `ZeroModule` (see the module documentation).
#[derive(Module, Debug)]
pub struct ShardedTiledLinear<B: Backend> {
    /// The tiles, input split major: tile `(i, j)` is `tiles[i * out_splits + j]`.
    pub tiles: Vec<ZeroModule<B, LinearTile<B>>>,
    /// Output features.
    pub d_output: usize,
    /// Tiles along the output features.
    pub out_splits: usize,
}

/// Cuts `0..n` into `splits` contiguous ranges whose lengths differ by at most one, the longer
/// first: the `(start, len)` of each.
fn split(n: usize, splits: usize) -> Vec<(usize, usize)> {
    let splits = splits.clamp(1, n.max(1));
    let (base, extra) = (n / splits, n % splits);
    let mut start = 0;
    (0..splits)
        .map(|k| {
            let len = base + usize::from(k < extra);
            let range = (start, len);
            start += len;
            range
        })
        .collect()
}

impl TiledLinearConfig {
    /// A configuration of `in_splits × out_splits` tiles, with a bias.
    pub fn new(d_input: usize, d_output: usize, in_splits: usize, out_splits: usize) -> Self {
        Self {
            d_input,
            d_output,
            in_splits,
            out_splits,
            bias: true,
        }
    }

    /// Randomly initialized as Burn's `LinearConfig` initializes the whole layer (Kaiming
    /// uniform with the whole layer's fan-in), tile by tile. Tiles are lazy: their values are
    /// drawn when first used.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TiledLinear<B> {
        let init = Initializer::KaimingUniform {
            gain: 1.0 / 3.0f64.sqrt(),
            fan_out_only: false,
        };
        let (fan_in, fan_out) = (Some(self.d_input), Some(self.d_output));
        let ins = split(self.d_input, self.in_splits);
        let outs = split(self.d_output, self.out_splits);
        let mut tiles = Vec::with_capacity(ins.len() * outs.len());
        for (i, &(in_start, in_len)) in ins.iter().enumerate() {
            for &(out_start, out_len) in &outs {
                tiles.push(LinearTile {
                    weight: init.init_with([in_len, out_len], fan_in, fan_out, device),
                    bias: (self.bias && i == 0).then(|| init.init_with([out_len], fan_in, fan_out, device)),
                    in_start,
                    out_start,
                });
            }
        }
        TiledLinear {
            tiles,
            d_output: self.d_output,
            out_splits: outs.len(),
        }
    }
}

impl<B: Backend> TiledLinear<B> {
    /// The tiles of an existing `Linear`, holding copies of its values (new parameters).
    pub fn from_linear(linear: &Linear<B>, in_splits: usize, out_splits: usize) -> Self {
        let weight = linear.weight.val();
        let [d_input, d_output] = weight.dims();
        let outs = split(d_output, out_splits);
        let mut tiles = Vec::new();
        for (i, (in_start, in_len)) in split(d_input, in_splits).into_iter().enumerate() {
            for &(out_start, out_len) in &outs {
                let w = weight
                    .clone()
                    .slice([in_start..in_start + in_len, out_start..out_start + out_len])
                    .detach();
                let bias = match (&linear.bias, i) {
                    (Some(b), 0) => Some(Param::from_tensor(b.val().narrow(0, out_start, out_len).detach())),
                    _ => None,
                };
                tiles.push(LinearTile {
                    weight: Param::from_tensor(w),
                    bias,
                    in_start,
                    out_start,
                });
            }
        }
        TiledLinear {
            tiles,
            d_output,
            out_splits: outs.len(),
        }
    }

    /// The untiled `Linear` with the same values (new parameters).
    pub fn to_linear(&self) -> Linear<B> {
        let rows: Vec<Tensor<B, 2>> = self
            .tiles
            .chunks(self.out_splits)
            .map(|row| Tensor::cat(row.iter().map(|t| t.weight.val()).collect(), 1))
            .collect();
        let biases: Vec<Tensor<B, 1>> = self.tiles[..self.out_splits]
            .iter()
            .filter_map(|t| t.bias.as_ref().map(|b| b.val()))
            .collect();
        Linear {
            weight: Param::from_tensor(Tensor::cat(rows, 0).detach()),
            bias: (!biases.is_empty()).then(|| Param::from_tensor(Tensor::cat(biases, 0).detach())),
        }
    }

    /// `x · W + b` for `x` `[..., d_input]`, as `Linear::forward`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let tiles = self.tiles.iter().map(|t| Ok::<_, ZeroError>(t.clone()));
        tiled_forward(tiles, self.out_splits, x).unwrap_or_else(|_| unreachable!("tiles held whole cannot fail"))
    }

    /// Each tile a `ZeroModule` of its own (whole until `shard_units`, or
    /// `zero_burn::initialize` at stage 3, cuts it).
    pub fn into_sharded(self) -> ShardedTiledLinear<B>
    where
        B: ShardBackend,
    {
        ShardedTiledLinear {
            tiles: self.tiles.into_iter().map(ZeroModule::new).collect(),
            d_output: self.d_output,
            out_splits: self.out_splits,
        }
    }

    /// Elements of the largest tile (weight and bias): the most a stage-3 gather of one tile
    /// brings in.
    pub fn largest_tile_elements(&self) -> usize {
        self.tiles
            .iter()
            .map(|t| t.weight.shape().num_elements() + t.bias.as_ref().map_or(0, |b| b.shape().num_elements()))
            .max()
            .unwrap_or(0)
    }
}

impl<B: Backend> LinearTile<B> {
    /// `x[..., in] · weight (+ bias)`: the tile's share of its output columns.
    pub fn partial<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let [in_len, _] = self.weight.dims();
        let x = x.narrow(D - 1, self.in_start, in_len);
        burn::tensor::module::linear(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }
}

impl<B: ShardBackend> ShardedTiledLinear<B> {
    /// `x · W + b` for `x` `[..., d_input]`, as `Linear::forward`, each tile gathered for its
    /// one product. Fails when a gather fails (a peer lost, a collective out of order).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, ZeroError> {
        let tiles = self.tiles.iter().map(|t| t.unshard(&x));
        tiled_forward(tiles, self.out_splits, x.clone())
    }

    /// The tiles whole, as a [`TiledLinear`] (every tile gathered).
    pub fn gathered(&self) -> Result<TiledLinear<B>, ZeroError> {
        Ok(TiledLinear {
            tiles: self.tiles.iter().map(ZeroModule::gathered).collect::<Result<_, _>>()?,
            d_output: self.d_output,
            out_splits: self.out_splits,
        })
    }
}

/// `x · W + b` from `tiles` in input-split-major order, `out_splits` of them per input split:
/// each output column block the sum over the input splits, in their order.
fn tiled_forward<B: Backend, const D: usize>(
    tiles: impl Iterator<Item = Result<LinearTile<B>, ZeroError>>,
    out_splits: usize,
    x: Tensor<B, D>,
) -> Result<Tensor<B, D>, ZeroError> {
    let mut columns: Vec<Option<Tensor<B, D>>> = vec![None; out_splits];
    for (k, tile) in tiles.enumerate() {
        let part = tile?.partial(x.clone());
        let column = &mut columns[k % out_splits];
        *column = Some(match column.take() {
            Some(sum) => sum + part,
            None => part,
        });
    }
    Ok(Tensor::cat(columns.into_iter().flatten().collect(), D - 1))
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn splits_cover_the_range_evenly() {
        assert_eq!(split(10, 3), vec![(0, 4), (4, 3), (7, 3)]);
        assert_eq!(split(4, 4), vec![(0, 1), (1, 1), (2, 1), (3, 1)]);
        // More splits than features: one feature per tile.
        assert_eq!(split(2, 5), vec![(0, 1), (1, 1)]);
        assert_eq!(split(7, 1), vec![(0, 7)]);
    }
}
