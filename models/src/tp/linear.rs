//! Linear layers whose weight is split across the tensor-parallel group (Megatron-LM's column
//! and row parallelism). Weights use Burn's `[d_input, d_output]` layout.

use super::collectives::{copy_to_tp, reduce_from_tp, TpBackend};
use super::group::TpGroup;
use super::TpLoadError;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::prelude::*;

/// `y = x · W + b` with `W`'s output columns split across the ranks: rank `r` holds the columns
/// (and bias entries) of its chunk and returns its chunk of `y`, not gathered.
///
/// The input is replicated; it passes through `f` (identity forward, gradient all-reduced
/// backward), since every rank's chunk contributes to its gradient.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// This rank's columns, `[d_input, d_output / tp]`.
    pub weight: Param<Tensor<B, 2>>,
    /// This rank's bias entries, `[d_output / tp]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The tensor-parallel group.
    pub group: TpGroup,
}

/// `y = x · W + b` with `W`'s input rows split across the ranks: rank `r` takes its chunk of
/// `x`'s features (the output of a [`ColumnParallelLinear`]), and the partial products are
/// summed over the ranks through `g` (all-reduce forward, identity backward) before the
/// replicated bias is added.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// This rank's rows, `[d_input / tp, d_output]`.
    pub weight: Param<Tensor<B, 2>>,
    /// The whole bias, `[d_output]`, replicated.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The tensor-parallel group.
    pub group: TpGroup,
}

/// Column ranges `[start, start + len)` of a weight's output dimension that one rank holds,
/// one per piece: a fused projection (GPT-2's q|k|v) is split piece by piece.
pub(crate) fn rank_chunks(total: usize, pieces: usize, rank: usize, size: usize) -> Vec<(usize, usize)> {
    let piece = total / pieces;
    let chunk = piece / size;
    (0..pieces).map(|p| (p * piece + rank * chunk, chunk)).collect()
}

/// Checks that `dim` splits evenly over the group.
// `%` rather than `is_multiple_of`: the workspace supports Rust 1.85.
#[allow(clippy::manual_is_multiple_of)]
pub(crate) fn check_divisible(what: &str, dim: usize, size: usize) -> Result<(), TpLoadError> {
    if size == 0 || dim % size != 0 {
        return Err(TpLoadError::Indivisible {
            what: what.to_string(),
            dim,
            size,
        });
    }
    Ok(())
}

impl<B: TpBackend> ColumnParallelLinear<B> {
    /// This rank's part of the full `linear`, whose output holds `pieces` equal blocks (1 for a
    /// plain layer, 3 for a fused q|k|v projection), each split evenly across the group.
    pub fn from_full(linear: &Linear<B>, pieces: usize, group: TpGroup) -> Result<Self, TpLoadError> {
        let [_, d_out] = linear.weight.dims();
        check_divisible("a column-parallel layer's output", d_out, pieces * group.size())?;
        let chunks = rank_chunks(d_out, pieces, group.rank(), group.size());
        let weight = Tensor::cat(
            chunks
                .iter()
                .map(|&(start, len)| linear.weight.val().detach().narrow(1, start, len))
                .collect(),
            1,
        );
        let bias = linear.bias.as_ref().map(|b| {
            let parts = chunks
                .iter()
                .map(|&(start, len)| b.val().detach().narrow(0, start, len))
                .collect();
            Param::from_tensor(Tensor::cat(parts, 0).detach())
        });
        Ok(ColumnParallelLinear {
            // A leaf of its own: the slicing ops are not part of any graph.
            weight: Param::from_tensor(weight.detach()),
            bias,
            group,
        })
    }

    /// This rank's chunk of `x · W + b` for replicated `x` `[..., d_input]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let x = copy_to_tp(x, &self.group);
        linear(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }
}

impl<B: TpBackend> RowParallelLinear<B> {
    /// This rank's rows of the full `linear` (the input dimension split evenly across the group).
    pub fn from_full(linear: &Linear<B>, group: TpGroup) -> Result<Self, TpLoadError> {
        let [d_in, _] = linear.weight.dims();
        check_divisible("a row-parallel layer's input", d_in, group.size())?;
        let chunk = d_in / group.size();
        let weight = linear.weight.val().detach().narrow(0, group.rank() * chunk, chunk);
        Ok(RowParallelLinear {
            weight: Param::from_tensor(weight.detach()),
            bias: linear.bias.as_ref().map(|b| Param::from_tensor(b.val().detach())),
            group,
        })
    }

    /// `x · W + b` (replicated) from this rank's feature chunk `x` `[..., d_input / tp]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let partial = linear(x, self.weight.val(), None);
        let y = reduce_from_tp(partial, &self.group);
        match &self.bias {
            Some(b) => y + b.val().unsqueeze(),
            None => y,
        }
    }
}

/// `x · w + b` over the last dimension of `x`, any rank.
fn linear<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let y = x.matmul(weight.unsqueeze());
    match bias {
        Some(b) => y + b.unsqueeze(),
        None => y,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_projections_split_piece_by_piece() {
        // q|k|v of 8 columns each, rank 1 of 2: columns 4..8 of every piece.
        assert_eq!(rank_chunks(24, 3, 1, 2), vec![(4, 4), (12, 4), (20, 4)]);
        assert_eq!(rank_chunks(12, 1, 2, 4), vec![(6, 3)]);
        assert!(check_divisible("x", 10, 4).is_err());
        assert!(check_divisible("x", 12, 4).is_ok());
    }
}
