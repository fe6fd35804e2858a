//! GPT-2 over a tensor-parallel group, and its chain for the ZeRO engine.

use super::block::TpBlock;
use super::collectives::TpBackend;
use super::cross_entropy::vocab_parallel_cross_entropy;
use super::embedding::VocabParallelEmbedding;
use super::group::TpGroup;
use super::{fresh, TpLoadError};
use crate::gpt2::{Gpt2, Gpt2Batch};
use burn::module::Module;
use burn::nn::{Embedding, LayerNorm};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::params::describe;
use zero_burn::{ChainModel, TensorSplit};

/// GPT-2 with every layer split Megatron-style over a tensor-parallel group: `wte`
/// vocab-parallel and tied to the LM head (vocab-parallel logits and cross-entropy), each
/// block's heads and MLP features split, `wpe` and the LayerNorms replicated.
///
/// Every rank of the group runs the same forward on the same batch and gets the same hidden
/// states and loss; each holds and trains only its slice of the split weights. Built from a
/// full [`Gpt2`] with [`TpGpt2::from_full`], each rank slicing its part.
///
/// ZeRO over the data-parallel group: `ZeroOptimizer::with_tensor_parallel(tensor_group,
/// model.tensor_splits())`, whose global norm (clipping) then covers the whole model.
#[derive(Module, Debug)]
pub struct TpGpt2<B: Backend> {
    /// Token embedding, this rank's vocabulary rows; also the LM head.
    pub wte: VocabParallelEmbedding<B>,
    /// Position embedding (replicated).
    pub wpe: Embedding<B>,
    /// The transformer blocks.
    pub blocks: Vec<TpBlock<B>>,
    /// The final LayerNorm (replicated).
    pub ln_f: LayerNorm<B>,
}

impl<B: TpBackend> TpGpt2<B> {
    /// This rank's part of `full`. The number of heads and the MLP's inner size must be
    /// multiples of the group's size; the vocabulary is padded when it is not one.
    pub fn from_full(full: &Gpt2<B>, group: TpGroup) -> Result<Self, TpLoadError> {
        Ok(TpGpt2 {
            wte: VocabParallelEmbedding::from_full(&full.wte, group.clone())?,
            wpe: fresh(full.wpe.clone()),
            blocks: full
                .blocks
                .iter()
                .map(|b| TpBlock::from_full(b, group.clone()))
                .collect::<Result<_, _>>()?,
            ln_f: fresh(full.ln_f.clone()),
        })
    }

    /// The tensor-parallel group.
    pub fn group(&self) -> &TpGroup {
        &self.wte.group
    }

    /// Token plus position embeddings of `tokens` `[batch, seq]`, replicated.
    ///
    /// # Panics
    ///
    /// If `seq` exceeds `n_positions`.
    pub fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [_, seq] = tokens.dims();
        let [n_positions, _] = self.wpe.weight.dims();
        assert!(
            seq <= n_positions,
            "sequence length {seq} exceeds the model's n_positions {n_positions}"
        );
        let positions = self.wpe.weight.val().narrow(0, 0, seq).unsqueeze::<3>();
        self.wte.forward(tokens) + positions
    }

    /// Runs every block.
    pub fn run_blocks(&self, mut h: Tensor<B, 3>) -> Tensor<B, 3> {
        for block in &self.blocks {
            h = block.forward(h);
        }
        h
    }

    /// Final LayerNorm, then this rank's logits `[batch, seq, vocab / tp]` (token ids from
    /// `wte.vocab_start`).
    pub fn head_logits(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        self.wte.logits(self.ln_f.forward(h))
    }

    /// The loss of [`Gpt2::head_loss`] (HuggingFace's `labels` semantics), through the
    /// vocab-parallel cross-entropy; the same on every rank.
    pub fn head_loss(&self, h: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, seq, _] = h.dims();
        if seq < 2 {
            return Tensor::from_floats([f32::NAN], &h.device());
        }
        let logits = self.head_logits(h.narrow(1, 0, seq - 1));
        let [_, _, local_vocab] = logits.dims();
        let rows = batch * (seq - 1);
        let targets = labels.narrow(1, 1, seq - 1).reshape([rows]);
        vocab_parallel_cross_entropy(
            logits.reshape([rows, local_vocab]),
            targets,
            self.wte.vocab_start,
            self.wte.vocab,
            self.group(),
        )
    }

    /// This rank's logits of `tokens`: the whole chain.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.head_logits(self.run_blocks(self.embed(tokens)))
    }

    /// Mean next-token cross-entropy (see [`Gpt2::loss`]).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.head_loss(self.run_blocks(self.embed(tokens)), labels)
    }
}

impl<B: AutodiffBackend + TpBackend> ChainModel<B> for TpGpt2<B> {
    type Batch = Gpt2Batch<B>;
    type Hidden = Tensor<B, 3>;
    /// The model without its blocks: `wte` (this rank's rows), `wpe`, `ln_f`.
    type Ends = TpGpt2<B>;
    type Block = TpBlock<B>;

    fn into_parts(mut self) -> (TpGpt2<B>, Vec<TpBlock<B>>) {
        let blocks = std::mem::take(&mut self.blocks);
        (self, blocks)
    }

    fn from_parts(mut ends: TpGpt2<B>, blocks: Vec<TpBlock<B>>) -> Self {
        ends.blocks = blocks;
        ends
    }

    fn embed(ends: &TpGpt2<B>, batch: &Self::Batch) -> Tensor<B, 3> {
        ends.embed(batch.0.clone())
    }

    fn block_forward(block: &TpBlock<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        block.forward(x)
    }

    fn head_loss(ends: &TpGpt2<B>, h: Tensor<B, 3>, batch: &Self::Batch) -> Tensor<B, 1> {
        ends.head_loss(h, batch.1.clone())
    }
}

/// The parameters of a block split over the tensor group, by index in visit order, and how
/// each is cut: the column-parallel `c_attn` and `c_fc` (weights and biases) and the
/// row-parallel projections' weights (their biases are added once, replicated).
pub(crate) fn tensor_split_params<B: Backend>(block: &TpBlock<B>) -> Vec<(usize, TensorSplit)> {
    describe::<B, _>(block)
        .iter()
        .enumerate()
        .filter_map(|(i, (_, spec))| Some((i, block_split(&spec.name)?)))
        .collect()
}

/// How `wte`'s vocabulary rows are cut over `tp` ranks: evenly, or padded past `vocab` when it
/// does not split evenly.
pub(crate) fn wte_split(vocab: usize, tp: usize) -> TensorSplit {
    if vocab.is_multiple_of(tp.max(1)) {
        TensorSplit::along(0)
    } else {
        TensorSplit::padded(0, vocab)
    }
}

/// How a block's parameter (`name` its path inside the block or the model) is split, `None`
/// where every rank holds it whole: the column-parallel `c_attn` (its output axis, in 3 blocks
/// q|k|v) and `c_fc`; the row-parallel projections' weights (their input axis).
fn block_split(name: &str) -> Option<TensorSplit> {
    let column = name.contains("c_attn") || name.contains("c_fc");
    if !(column || (name.contains("c_proj") && name.ends_with("weight"))) {
        return None;
    }
    // Burn's Linear weight is [input, output]; a bias is [output].
    let output = if name.ends_with("weight") { 1 } else { 0 };
    Some(if name.contains("c_attn") {
        TensorSplit::blocks(output, 3)
    } else if name.contains("c_fc") {
        TensorSplit::along(output)
    } else {
        TensorSplit::along(0)
    })
}

/// How the parameter of the tensor-parallel GPT-2 named `name` (its module path, as `describe`
/// and `ZeroOptimizer`'s layout name it: `wte.` in [`TpGpt2`], `embed.wte.` in its sharded form)
/// is split over `tp` ranks, `None` where every rank holds it whole: `wte` as [`wte_split`], a
/// block's as [`block_split`].
fn tensor_split(name: &str, vocab: usize, tp: usize) -> Option<TensorSplit> {
    if name.starts_with("wte.") || name.starts_with("embed.wte.") {
        return Some(wte_split(vocab, tp));
    }
    if name.starts_with("blocks.") {
        block_split(name)
    } else {
        None
    }
}

/// The rule of [`tensor_split`] for a model of `vocab` tokens over `tp` ranks.
pub(crate) fn tensor_split_rule(
    vocab: usize,
    tp: usize,
) -> impl Fn(&str) -> Option<TensorSplit> + Send + Sync + 'static {
    move |name| tensor_split(name, vocab, tp)
}

impl<B: Backend> TpGpt2<B> {
    /// How each parameter (by its module path) is split over the tensor group, for this model's
    /// vocabulary and group: the rule `ZeroOptimizer::with_tensor_parallel` takes.
    pub fn tensor_splits(&self) -> impl Fn(&str) -> Option<TensorSplit> + Send + Sync + 'static {
        tensor_split_rule(self.wte.vocab, self.wte.group.size())
    }
}
