//! Cross-entropy over logits whose vocabulary is split across the tensor-parallel group, without
//! ever gathering the vocabulary (Megatron-LM's vocab-parallel cross-entropy).

use super::collectives::{reduce_from_tp, TpBackend};
use super::group::TpGroup;
use crate::gpt2::IGNORE_INDEX;
use burn::prelude::*;
use zero_core::comm::ReduceOp;

/// Mean cross-entropy of `logits` `[rows, local]` (this rank's columns, which start at token id
/// `vocab_start`) against `targets` `[rows]`, leaving out targets equal to [`IGNORE_INDEX`] and
/// the columns of ids at or past `vocab` (a padded vocabulary's). Every rank returns the same
/// loss, shape `[1]`, in f32 whatever the logits' dtype.
///
/// Per row: the maximum over the whole vocabulary is all-reduced first (a constant for the
/// gradient, as the loss does not depend on it), then the sum of `exp(z - max)` and the target's
/// shifted logit, each a partial sum over the rank's columns, are summed over the group through
/// `g`. The loss is `log Σ exp(z - max) - (z_target - max)`. Backward needs no communication:
/// each rank's logits receive `softmax - onehot` for its own columns (0 for padding).
pub fn vocab_parallel_cross_entropy<B: TpBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    vocab_start: usize,
    vocab: usize,
    group: &TpGroup,
) -> Tensor<B, 1> {
    // In f32 whatever the logits' dtype, as the whole model's loss (and HuggingFace's) is: a
    // bf16 or fp16 sum over the vocabulary would round the loss to a few digits and skew its
    // gradient.
    let logits = logits.cast(burn::tensor::DType::F32);
    let [rows, local_vocab] = logits.dims();
    // The columns of real tokens: all of them unless the vocabulary was padded into this rank.
    let real = vocab.saturating_sub(vocab_start).min(local_vocab);
    let padding = (real < local_vocab).then(|| {
        let ids = Tensor::<B, 1, Int>::arange(0..local_vocab as i64, &logits.device());
        ids.greater_equal_elem(real as i64)
            .unsqueeze_dim::<2>(0)
            .expand([rows, local_vocab])
    });
    let detached = logits.clone().detach();
    let detached = match &padding {
        Some(pad) => detached.mask_fill(pad.clone(), f32::NEG_INFINITY),
        None => detached,
    };
    let row_max = group.all_reduce_tensor(detached.max_dim(1), ReduceOp::Max, "cross-entropy max");
    let shifted = logits - row_max;

    let exp = shifted.clone().exp();
    let exp = match padding {
        Some(pad) => exp.mask_fill(pad, 0.0),
        None => exp,
    };
    let sum_exp = reduce_from_tp(exp.sum_dim(1), group);

    let start = vocab_start as i64;
    let end = (vocab_start + local_vocab) as i64;
    let outside = targets
        .clone()
        .lower_elem(start)
        .bool_or(targets.clone().greater_equal_elem(end));
    let local = targets.clone().sub_scalar(start).mask_fill(outside.clone(), 0);
    // Masks in f32, not the backend's default float (a 16-bit run may make that its own).
    let dtype = shifted.dtype();
    let picked = shifted.gather(1, local.unsqueeze_dim(1)) * outside.bool_not().float().cast(dtype).unsqueeze_dim(1);
    let target_logit = reduce_from_tp(picked, group);

    let per_row = (sum_exp.log() - target_logit).reshape([rows]);
    let weights = targets.not_equal_elem(IGNORE_INDEX).float().cast(dtype);
    (per_row * weights.clone()).sum() / weights.sum()
}
