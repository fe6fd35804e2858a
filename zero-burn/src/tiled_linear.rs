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
//! - [`TiledLinear`] is a Burn module with the `Linear` forward: put it in a block (every tile
//!   is then gathered with the block).
//! - Its tiles ([`TiledLinear::into_tiles`]) are blocks of a chain on their own: each
//!   [`LinearTile`] maps a [`TileCarry`] (the input and the output being accumulated) to the
//!   next, so the engine gathers, runs and releases one tile at a time. The largest gather is
//!   then one tile, `1 / (in_splits × out_splits)` of the weight.

use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;

use crate::chain::Hidden;

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

/// The activation carried from tile to tile when the tiles are blocks of a chain: the layer's
/// input and its output accumulated so far.
#[derive(Clone, Debug)]
pub struct TileCarry<B: Backend> {
    /// The layer's input `[rows, d_input]`.
    pub x: Tensor<B, 2>,
    /// The layer's output so far `[rows, d_output]`.
    pub acc: Tensor<B, 2>,
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
        let mut columns = Vec::with_capacity(self.out_splits);
        for j in 0..self.out_splits {
            let mut sum: Option<Tensor<B, D>> = None;
            for tile in self.tiles.iter().skip(j).step_by(self.out_splits) {
                let part = tile.partial(x.clone());
                sum = Some(match sum {
                    Some(s) => s + part,
                    None => part,
                });
            }
            columns.extend(sum);
        }
        Tensor::cat(columns, D - 1)
    }

    /// The tiles in the order a chain runs them (input split major).
    pub fn into_tiles(self) -> Vec<LinearTile<B>> {
        self.tiles
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

    /// Adds the tile's share into the carried output (a chain block's forward).
    pub fn forward_carry(&self, carry: TileCarry<B>) -> TileCarry<B> {
        let [rows, _] = carry.acc.dims();
        let [_, out_len] = self.weight.dims();
        let columns = [0..rows, self.out_start..self.out_start + out_len];
        let part = self.partial(carry.x.clone());
        let updated = carry.acc.clone().slice(columns.clone()) + part;
        TileCarry {
            x: carry.x,
            acc: carry.acc.slice_assign(columns, updated),
        }
    }
}

impl<B: Backend> TileCarry<B> {
    /// The carry entering the first tile: the input and a zero output of `d_output` columns.
    pub fn new(x: Tensor<B, 2>, d_output: usize) -> Self {
        let [rows, _] = x.dims();
        let acc = Tensor::<B, 2>::zeros([rows, d_output], &x.device()).cast(x.dtype());
        Self { x, acc }
    }

    /// The layer's output after the last tile.
    pub fn output(self) -> Tensor<B, 2> {
        self.acc
    }
}

impl<B: AutodiffBackend> Hidden<B> for TileCarry<B> {
    fn leaf(&self) -> Self {
        Self {
            x: self.x.leaf(),
            acc: self.acc.leaf(),
        }
    }
    fn detached(&self) -> Self {
        Self {
            x: self.x.detached(),
            acc: self.acc.detached(),
        }
    }
    fn take_grad(&self, grads: &mut B::Gradients) -> Option<Self> {
        let x = self.x.take_grad(grads);
        let acc = self.acc.take_grad(grads);
        if x.is_none() && acc.is_none() {
            return None;
        }
        // A part that ignores one of the two (the head reads only the output) gives it zero.
        let zeros = |t: &Tensor<B, 2>| t.zeros_like().detach();
        Some(Self {
            x: x.unwrap_or_else(|| zeros(&self.x)),
            acc: acc.unwrap_or_else(|| zeros(&self.acc)),
        })
    }
    fn dot(self, seed: Self) -> Tensor<B, 1> {
        self.x.dot(seed.x) + self.acc.dot(seed.acc)
    }
    fn bytes(&self) -> usize {
        self.x.bytes() + self.acc.bytes()
    }
    fn to_host(&self) -> Vec<burn::tensor::TensorData> {
        vec![self.x.to_data(), self.acc.to_data()]
    }
    fn from_host(data: Vec<burn::tensor::TensorData>, device: &B::Device) -> Self {
        // `to_host` wrote the input, then the accumulator.
        let mut data = data.into_iter();
        let mut next = || Tensor::from_data(data.next().unwrap_or_else(|| unreachable!("two tensors")), device);
        let x = next();
        Self { x, acc: next() }
    }
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
