//! The language-modelling loss every model of the zoo shares: HuggingFace's shifted next-token
//! cross-entropy, labels equal to [`IGNORE_INDEX`] left out.

use burn::prelude::*;
use burn::tensor::activation::log_softmax;

/// The label value HuggingFace's loss ignores (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// Mean cross-entropy of `logits` `[batch, n, vocab]` against `targets` `[batch, n]`, leaving out
/// targets equal to [`IGNORE_INDEX`].
pub(crate) fn shifted_cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    rows: usize,
) -> Tensor<B, 1> {
    let [_, _, vocab] = logits.dims();
    // The loss is computed in f32 whatever the model's dtype (as HuggingFace upcasts bf16/fp16
    // logits): a softmax over 50k entries in bf16 loses the small probabilities.
    let logits = logits.cast(burn::tensor::DType::F32);
    let log_probs = log_softmax(logits.reshape([rows, vocab]), 1);
    let targets = targets.reshape([rows]);
    let counted = targets.clone().not_equal_elem(IGNORE_INDEX);
    // Ignored rows gather any valid index, then are zeroed by the mask.
    let safe_targets = targets.mask_fill(counted.clone().bool_not(), 0);
    let picked = log_probs.gather(1, safe_targets.unsqueeze_dim(1)).reshape([rows]);
    // In f32 too: a mask made float takes the device's default float dtype, which a 16-bit
    // run may have set to its own.
    let weights = counted.float().cast(burn::tensor::DType::F32);
    let total = (picked * weights.clone()).sum().neg();
    total / weights.sum()
}
