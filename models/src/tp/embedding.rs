//! A token embedding whose vocabulary is split across the tensor-parallel group, usable as a
//! tied output layer.

use super::collectives::{copy_to_tp, reduce_from_tp, TpBackend};
use super::group::TpGroup;
use super::TpLoadError;
use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::prelude::*;
use burn::tensor::module::embedding;

/// An embedding table `[vocab, dim]` whose rows are split across the ranks: rank `r` holds
/// token ids `r · rows .. (r + 1) · rows`, `rows` being `vocab / tp` rounded up. A vocabulary
/// that does not split evenly (GPT-2's 50257 tokens) is padded, as Megatron-LM pads it: the
/// last rows of the last rank(s) are zeros that no token looks up, whose logits the
/// cross-entropy leaves out, and which so never take a gradient.
///
/// A lookup lets each rank embed the tokens it holds (zeros elsewhere) and sums the results over
/// the group through `g`. As an output layer ([`logits`](Self::logits)) each rank computes the
/// logits of its own tokens, which [`vocab_parallel_cross_entropy`](super::vocab_parallel_cross_entropy)
/// takes without gathering the vocabulary.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// This rank's rows, `[rows, dim]`, padding included.
    pub weight: Param<Tensor<B, 2>>,
    /// The first token id this rank holds.
    pub vocab_start: usize,
    /// The whole vocabulary, without padding.
    pub vocab: usize,
    /// The tensor-parallel group.
    pub group: TpGroup,
}

impl<B: TpBackend> VocabParallelEmbedding<B> {
    /// This rank's rows of the full `table`, padded with zero rows to `vocab / tp` rounded up.
    pub fn from_full(table: &Embedding<B>, group: TpGroup) -> Result<Self, TpLoadError> {
        let [vocab, dim] = table.weight.dims();
        let rows = vocab.div_ceil(group.size().max(1));
        let vocab_start = group.rank() * rows;
        let real = vocab.saturating_sub(vocab_start).min(rows);
        let table = table.weight.val().detach();
        let mut parts = Vec::new();
        if real > 0 {
            parts.push(table.clone().narrow(0, vocab_start, real));
        }
        if real < rows {
            let zeros: Tensor<B, 2> = Tensor::zeros([rows - real, dim], &table.device());
            parts.push(zeros.cast(table.dtype()));
        }
        Ok(VocabParallelEmbedding {
            weight: Param::from_tensor(Tensor::cat(parts, 0).detach()),
            vocab_start,
            vocab,
            group,
        })
    }

    /// Rows every rank holds, padding included, for a vocabulary of `vocab` over `tp` ranks.
    pub fn rows_per_rank(vocab: usize, tp: usize) -> usize {
        vocab.div_ceil(tp.max(1))
    }

    /// Number of rows this rank holds, padding included.
    pub fn local_vocab(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Embeds `tokens` `[batch, seq]`: `[batch, seq, dim]`, replicated on every rank.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let (local, outside) = self.localize(tokens);
        let weight = self.weight.val();
        // In the weights' dtype (bf16, fp16 training), not the backend's default float.
        let keep = outside.bool_not().float().cast(weight.dtype()).unsqueeze_dim::<3>(2);
        let partial = embedding(weight, local) * keep;
        reduce_from_tp(partial, &self.group)
    }

    /// Logits of this rank's rows, `h · W_rᵀ`: `[..., rows]` from replicated `h` `[..., dim]`
    /// (which passes through `f`); a padding row's logit is 0, and not a token's.
    pub fn logits<const D: usize>(&self, h: Tensor<B, D>) -> Tensor<B, D> {
        let h = copy_to_tp(h, &self.group);
        h.matmul(self.weight.val().transpose().unsqueeze())
    }

    /// Token ids shifted to this rank's rows (0 where the rank does not hold the token), and
    /// where it does not.
    pub(crate) fn localize<const D: usize>(
        &self,
        tokens: Tensor<B, D, Int>,
    ) -> (Tensor<B, D, Int>, Tensor<B, D, Bool>) {
        let start = self.vocab_start as i64;
        let end = (self.vocab_start + self.local_vocab()) as i64;
        let outside = tokens
            .clone()
            .lower_elem(start)
            .bool_or(tokens.clone().greater_equal_elem(end));
        let local = tokens.sub_scalar(start).mask_fill(outside.clone(), 0);
        (local, outside)
    }
}
