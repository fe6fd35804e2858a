//! Cross-entropy over logits whose vocabulary is split across the tensor-parallel group, without
//! ever gathering the vocabulary (Megatron-LM's vocab-parallel cross-entropy).

use super::collectives::{reduce_from_tp, TpBackend};
use super::group::TpGroup;
use crate::gpt2::IGNORE_INDEX;
use burn::prelude::*;
use zero_core::comm::ReduceOp;

/// Mean cross-entropy of `logits` `[rows, vocab / tp]` (this rank's columns, which start at
/// token id `vocab_start`) against `targets` `[rows]`, leaving out targets equal to
/// [`IGNORE_INDEX`]. Every rank returns the same loss, shape `[1]`.
///
/// Per row: the maximum over the whole vocabulary is all-reduced first (a constant for the
/// gradient, as the loss does not depend on it), then the sum of `exp(z - max)` and the target's
/// shifted logit, each a partial sum over the rank's columns, are summed over the group through
/// `g`. The loss is `log Σ exp(z - max) - (z_target - max)`. Backward needs no communication:
/// each rank's logits receive `softmax - onehot` for its own columns.
pub fn vocab_parallel_cross_entropy<B: TpBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    vocab_start: usize,
    group: &TpGroup,
) -> Tensor<B, 1> {
    let [rows, local_vocab] = logits.dims();
    let row_max = logits.clone().detach().max_dim(1);
    let row_max = group.all_reduce_tensor(row_max, ReduceOp::Max, "cross-entropy max");
    let shifted = logits - row_max;

    let sum_exp = reduce_from_tp(shifted.clone().exp().sum_dim(1), group);

    let start = vocab_start as i64;
    let end = (vocab_start + local_vocab) as i64;
    let outside = targets
        .clone()
        .lower_elem(start)
        .bool_or(targets.clone().greater_equal_elem(end));
    let local = targets.clone().sub_scalar(start).mask_fill(outside.clone(), 0);
    let picked = shifted.gather(1, local.unsqueeze_dim(1)) * outside.bool_not().float().unsqueeze_dim(1);
    let target_logit = reduce_from_tp(picked, group);

    let per_row = (sum_exp.log() - target_logit).reshape([rows]);
    let weights = targets.not_equal_elem(IGNORE_INDEX).float();
    (per_row * weights.clone()).sum() / weights.sum()
}
