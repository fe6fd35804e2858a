//! A token embedding whose vocabulary is split across the tensor-parallel group, usable as a
//! tied output layer.

use super::collectives::{copy_to_tp, reduce_from_tp, TpBackend};
use super::group::TpGroup;
use super::linear::check_divisible;
use super::TpLoadError;
use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::prelude::*;
use burn::tensor::module::embedding;

/// An embedding table `[vocab, dim]` whose rows are split across the ranks: rank `r` holds
/// token ids `r · vocab / tp .. (r + 1) · vocab / tp`.
///
/// A lookup lets each rank embed the tokens it holds (zeros elsewhere) and sums the results over
/// the group through `g`. As an output layer ([`logits`](Self::logits)) each rank computes the
/// logits of its own tokens, which [`vocab_parallel_cross_entropy`](super::vocab_parallel_cross_entropy)
/// takes without gathering the vocabulary.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// This rank's rows, `[vocab / tp, dim]`.
    pub weight: Param<Tensor<B, 2>>,
    /// The first token id this rank holds.
    pub vocab_start: usize,
    /// The tensor-parallel group.
    pub group: TpGroup,
}

impl<B: TpBackend> VocabParallelEmbedding<B> {
    /// This rank's rows of the full `table`.
    pub fn from_full(table: &Embedding<B>, group: TpGroup) -> Result<Self, TpLoadError> {
        let [vocab, _] = table.weight.dims();
        check_divisible("the vocabulary", vocab, group.size())?;
        let rows = vocab / group.size();
        let vocab_start = group.rank() * rows;
        Ok(VocabParallelEmbedding {
            weight: Param::from_tensor(table.weight.val().narrow(0, vocab_start, rows).detach()),
            vocab_start,
            group,
        })
    }

    /// Number of token ids this rank holds.
    pub fn local_vocab(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Embeds `tokens` `[batch, seq]`: `[batch, seq, dim]`, replicated on every rank.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let (local, outside) = self.localize(tokens);
        let keep = outside.bool_not().float().unsqueeze_dim::<3>(2);
        let partial = embedding(self.weight.val(), local) * keep;
        reduce_from_tp(partial, &self.group)
    }

    /// Logits of this rank's tokens, `h · W_rᵀ`: `[..., vocab / tp]` from replicated `h`
    /// `[..., dim]` (which passes through `f`).
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
