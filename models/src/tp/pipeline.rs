//! Tensor-parallel GPT-2 as pipeline layers: tensor and pipeline parallelism together.
//!
//! Each layer is the tensor-parallel layer of [`TpGpt2`], so a stage's ranks along the tensor
//! axis split every layer of the stage. The head holds a copy of this rank's vocabulary rows of
//! `wte`, tied under [`TIED_WTE`](crate::gpt2::TIED_WTE) to the embedding's: the tied group of a
//! tensor rank joins the first and last stage of the same tensor index, which hold the same rows.

use super::block::TpBlock;
use super::collectives::TpBackend;
use super::cross_entropy::vocab_parallel_cross_entropy;
use super::embedding::VocabParallelEmbedding;
use super::model::TpGpt2;
use crate::gpt2::{Gpt2Batch, LayerKind, TIED_WTE};
use burn::module::{Module, Param};
use burn::nn::{Embedding, LayerNorm};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::pipeline::{PipeLayer, TiedWeight};
use zero_burn::TensorSplit;

/// Token (vocab-parallel) and position (replicated) embeddings: the first layer.
#[derive(Module, Debug)]
pub struct TpEmbed<B: Backend> {
    /// This rank's rows of the token embedding (tied to the head's copy).
    pub wte: VocabParallelEmbedding<B>,
    /// Position embedding (replicated).
    pub wpe: Embedding<B>,
}

/// The final LayerNorm and the vocab-parallel LM head: the last layer.
#[derive(Module, Debug)]
pub struct TpHead<B: Backend> {
    /// The copy of this rank's `wte` rows (first, so it is parameter 0).
    pub wte: VocabParallelEmbedding<B>,
    /// The final LayerNorm (replicated).
    pub ln_f: LayerNorm<B>,
}

/// One layer of tensor-parallel GPT-2 cut for a pipeline.
// A stage holds a handful of layers, each a few tensor handles: boxing the block buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum TpGpt2Layer<B: Backend> {
    /// The embeddings.
    Embed(TpEmbed<B>),
    /// A transformer block.
    Block(TpBlock<B>),
    /// The final LayerNorm and LM head.
    Head(TpHead<B>),
}

impl<B: TpBackend> TpGpt2<B> {
    /// The model as pipeline layers: `[Embed, Block × n_layer, Head]`; the head gets a copy of
    /// this rank's `wte` rows (a parameter of its own, same values).
    pub fn into_pipeline_layers(self) -> Vec<TpGpt2Layer<B>> {
        let head_wte = VocabParallelEmbedding {
            weight: Param::from_tensor(self.wte.weight.val().detach()),
            vocab_start: self.wte.vocab_start,
            vocab: self.wte.vocab,
            group: self.wte.group.clone(),
        };
        let mut layers = vec![TpGpt2Layer::Embed(TpEmbed {
            wte: self.wte,
            wpe: self.wpe,
        })];
        layers.extend(self.blocks.into_iter().map(TpGpt2Layer::Block));
        layers.push(TpGpt2Layer::Head(TpHead {
            wte: head_wte,
            ln_f: self.ln_f,
        }));
        layers
    }
}

impl<B: AutodiffBackend + TpBackend> PipeLayer<B> for TpGpt2Layer<B> {
    type Batch = Gpt2Batch<B>;
    type Hidden = Tensor<B, 3>;

    /// # Panics
    ///
    /// If this is not the embedding layer.
    fn input(&self, batch: &Self::Batch) -> Tensor<B, 3> {
        let TpGpt2Layer::Embed(e) = self else {
            panic!("tensor-parallel GPT-2's first pipeline layer must be the embedding");
        };
        let [_, seq] = batch.0.dims();
        let positions = e.wpe.weight.val().narrow(0, 0, seq).unsqueeze::<3>();
        e.wte.forward(batch.0.clone()) + positions
    }

    /// # Panics
    ///
    /// If this is not a block.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let TpGpt2Layer::Block(b) = self else {
            panic!("tensor-parallel GPT-2's middle pipeline layers must be blocks");
        };
        b.forward(x)
    }

    /// The loss of [`TpGpt2::head_loss`].
    ///
    /// # Panics
    ///
    /// If this is not the head layer.
    fn loss(&self, h: Tensor<B, 3>, batch: &Self::Batch) -> Tensor<B, 1> {
        let TpGpt2Layer::Head(head) = self else {
            panic!("tensor-parallel GPT-2's last pipeline layer must be the head");
        };
        let [rows, seq, _] = h.dims();
        if seq < 2 {
            return Tensor::from_floats([f32::NAN], &h.device());
        }
        let logits = head.wte.logits(head.ln_f.forward(h.narrow(1, 0, seq - 1)));
        let [_, _, local_vocab] = logits.dims();
        let n = rows * (seq - 1);
        let targets = batch.1.clone().narrow(1, 1, seq - 1).reshape([n]);
        vocab_parallel_cross_entropy(
            logits.reshape([n, local_vocab]),
            targets,
            head.wte.vocab_start,
            head.wte.vocab,
            &head.wte.group,
        )
    }

    fn tied(&self) -> Vec<TiedWeight> {
        match self {
            TpGpt2Layer::Embed(_) | TpGpt2Layer::Head(_) => vec![TiedWeight {
                key: TIED_WTE.into(),
                param: 0,
            }],
            TpGpt2Layer::Block(_) => Vec::new(),
        }
    }

    /// `wte`'s rows; in a block the column-parallel layers (weight and bias) and the
    /// row-parallel layers' weights. Position embedding, LayerNorms and row-parallel biases are
    /// replicated.
    fn tensor_split(&self) -> Vec<(usize, TensorSplit)> {
        let wte = |e: &VocabParallelEmbedding<B>| vec![(0, super::model::wte_split(e.vocab, e.group.size()))];
        match self {
            TpGpt2Layer::Embed(embed) => wte(&embed.wte),
            TpGpt2Layer::Head(head) => wte(&head.wte),
            TpGpt2Layer::Block(block) => super::model::tensor_split_params::<B>(block),
        }
    }

    /// The names of the single [`Gpt2`](crate::gpt2::Gpt2)'s pipeline layers
    /// ([`Gpt2Layer`](crate::gpt2::Gpt2Layer)), which are this model's too, so that a pipelined
    /// tensor-parallel checkpoint merges into the whole model.
    fn param_name(&self, index: usize, visited: &str) -> String {
        let kind = match self {
            TpGpt2Layer::Embed(_) => LayerKind::Embed,
            TpGpt2Layer::Block(_) => LayerKind::Block,
            TpGpt2Layer::Head(_) => LayerKind::Head,
        };
        kind.param_name(index, visited)
    }
}
