//! GPT-2 as a list of pipeline layers: the embeddings, each transformer block, and the head.
//!
//! The LM head is tied to `wte`: the embedding layer and the head layer each hold a copy, tied
//! under the key `"wte"`, so the pipeline engine keeps them identical (their gradients summed
//! over the first and last stage) and the model trains exactly as the single `Gpt2` does.

use super::block::Gpt2Block;
use super::config::Gpt2Config;
use super::init::{layer_norm, normal_embedding};
use super::model::{shifted_cross_entropy, Gpt2};
use super::Gpt2Batch;
use burn::module::{Module, Param};
use burn::nn::{Embedding, LayerNorm};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::pipeline::{LayerSpec, PipeLayer, TiedWeight};

/// The key under which the embedding and the head share `wte`.
pub const TIED_WTE: &str = "wte";

/// Token and position embeddings: the pipeline's first layer.
#[derive(Module, Debug)]
pub struct Gpt2Embed<B: Backend> {
    /// Token embedding (tied to the head's copy).
    pub wte: Embedding<B>,
    /// Position embedding.
    pub wpe: Embedding<B>,
}

/// The final LayerNorm and the LM head on a copy of `wte`: the pipeline's last layer.
#[derive(Module, Debug)]
pub struct Gpt2Head<B: Backend> {
    /// The copy of the token embedding the logits are computed with (first, so it is
    /// parameter 0).
    pub wte: Embedding<B>,
    /// The final LayerNorm.
    pub ln_f: LayerNorm<B>,
}

/// One layer of GPT-2 cut for a pipeline.
// A stage holds a handful of layers, each a few tensor handles: boxing the block buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Gpt2Layer<B: Backend> {
    /// The embeddings (first layer).
    Embed(Gpt2Embed<B>),
    /// A transformer block.
    Block(Gpt2Block<B>),
    /// The final LayerNorm and LM head (last layer).
    Head(Gpt2Head<B>),
}

impl<B: Backend> Gpt2<B> {
    /// The model as pipeline layers: `[Embed, Block × n_layer, Head]`. The head gets a copy of
    /// `wte` (a parameter of its own, with the same values).
    pub fn into_pipeline_layers(self) -> Vec<Gpt2Layer<B>> {
        let head_wte = Embedding {
            weight: Param::from_tensor(self.wte.weight.val()),
        };
        let mut layers = vec![Gpt2Layer::Embed(Gpt2Embed {
            wte: self.wte,
            wpe: self.wpe,
        })];
        layers.extend(self.blocks.into_iter().map(Gpt2Layer::Block));
        layers.push(Gpt2Layer::Head(Gpt2Head {
            wte: head_wte,
            ln_f: self.ln_f,
        }));
        layers
    }
}

impl<B: Backend> Gpt2Embed<B> {
    /// Token plus position embeddings (see [`Gpt2::embed`]).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [_, seq] = tokens.dims();
        let [n_positions, _] = self.wpe.weight.dims();
        assert!(
            seq <= n_positions,
            "sequence length {seq} exceeds the model's n_positions {n_positions}"
        );
        let positions = self.wpe.weight.val().narrow(0, 0, seq).unsqueeze::<3>();
        self.wte.forward(tokens) + positions
    }
}

impl<B: Backend> Gpt2Head<B> {
    /// The loss of [`Gpt2::head_loss`] from the last block's output.
    pub fn loss(&self, h: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, seq, hidden] = h.dims();
        if seq < 2 {
            return Tensor::from_floats([f32::NAN], &h.device());
        }
        let n = seq - 1;
        let h = self.ln_f.forward(h.narrow(1, 0, n)).reshape([batch * n, hidden]);
        let wte = self.wte.weight.val();
        let [vocab, _] = wte.dims();
        let logits = h.matmul(wte.transpose()).reshape([batch, n, vocab]);
        shifted_cross_entropy(logits, labels.narrow(1, 1, n), batch * n)
    }
}

impl<B: AutodiffBackend> PipeLayer<B> for Gpt2Layer<B> {
    type Batch = Gpt2Batch<B>;
    type Hidden = Tensor<B, 3>;

    /// # Panics
    ///
    /// If this is not the embedding layer ([`Gpt2::into_pipeline_layers`] puts it first).
    fn input(&self, batch: &Self::Batch) -> Tensor<B, 3> {
        match self {
            Gpt2Layer::Embed(e) => e.forward(batch.0.clone()),
            _ => panic!("GPT-2's first pipeline layer must be the embedding"),
        }
    }

    /// # Panics
    ///
    /// If this is not a block.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Gpt2Layer::Block(b) => b.forward(x),
            _ => panic!("GPT-2's middle pipeline layers must be blocks"),
        }
    }

    /// # Panics
    ///
    /// If this is not the head layer ([`Gpt2::into_pipeline_layers`] puts it last).
    fn loss(&self, x: Tensor<B, 3>, batch: &Self::Batch) -> Tensor<B, 1> {
        match self {
            Gpt2Layer::Head(h) => h.loss(x, batch.1.clone()),
            _ => panic!("GPT-2's last pipeline layer must be the head"),
        }
    }

    fn tied(&self) -> Vec<TiedWeight> {
        match self {
            // `wte` is the first parameter visited in both.
            Gpt2Layer::Embed(_) | Gpt2Layer::Head(_) => vec![TiedWeight {
                key: TIED_WTE.into(),
                param: 0,
            }],
            Gpt2Layer::Block(_) => Vec::new(),
        }
    }

    /// The single [`Gpt2`]'s names (`wte.weight`, `blocks.3.attn…`, `ln_f.gamma`), so that a
    /// pipelined checkpoint consolidates into the whole model; the head's copy of `wte` is
    /// `lm_head.weight` (HuggingFace's name for the tied head, equal to `wte.weight`).
    fn param_name(&self, index: usize, visited: &str) -> String {
        let kind = match self {
            Gpt2Layer::Embed(_) => LayerKind::Embed,
            Gpt2Layer::Block(_) => LayerKind::Block,
            Gpt2Layer::Head(_) => LayerKind::Head,
        };
        kind.param_name(index, visited)
    }
}

/// Which of GPT-2's pipeline layers a layer is: what its parameters' names follow from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LayerKind {
    Embed,
    Block,
    Head,
}

impl LayerKind {
    /// The single model's name of the parameter Burn's visitor calls `visited` in the model's
    /// layer `index`: [`PipeLayer::param_name`] of GPT-2's layers, plain or tensor-parallel.
    pub(crate) fn param_name(self, index: usize, visited: &str) -> String {
        // Burn's visitor names the enum's variant first.
        let inner = visited.split_once('.').map_or(visited, |(_, rest)| rest);
        match self {
            LayerKind::Embed => inner.to_string(),
            LayerKind::Block => format!("blocks.{}.{inner}", index.saturating_sub(1)),
            LayerKind::Head => match inner.strip_prefix("wte.") {
                Some(rest) => format!("lm_head.{rest}"),
                None => inner.to_string(),
            },
        }
    }
}

/// Builds one GPT-2 pipeline layer with GPT-2's initialization (DeepSpeed's `LayerSpec`).
#[derive(Clone, Debug)]
pub struct Gpt2LayerSpec {
    /// The model's configuration.
    pub config: Gpt2Config,
    /// Which layer: 0 the embeddings, `1..=n_layer` the blocks, `n_layer + 1` the head.
    pub index: usize,
}

impl Gpt2LayerSpec {
    /// The specs of every layer of the model, in order.
    pub fn all(config: &Gpt2Config) -> Vec<Gpt2LayerSpec> {
        (0..config.n_layer + 2)
            .map(|index| Gpt2LayerSpec {
                config: config.clone(),
                index,
            })
            .collect()
    }
}

impl<B: Backend> LayerSpec<B> for Gpt2LayerSpec {
    type Layer = Gpt2Layer<B>;

    fn num_params(&self) -> usize {
        let c = &self.config;
        let d = c.n_embd;
        let inner = c.n_inner.unwrap_or(4 * d);
        if self.index == 0 {
            (c.vocab_size + c.n_positions) * d
        } else if self.index <= c.n_layer {
            // Two LayerNorms, attention (qkv and projection), MLP (in and out), with biases.
            4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
        } else {
            c.vocab_size * d + 2 * d
        }
    }

    /// The head's `wte` is drawn independently: the pipeline engine overwrites it with the
    /// embedding's copy at start.
    fn build(&self, device: &B::Device) -> Gpt2Layer<B> {
        let c = &self.config;
        let d = c.n_embd;
        if self.index == 0 {
            Gpt2Layer::Embed(Gpt2Embed {
                wte: normal_embedding(c.vocab_size, d, c.initializer_range, device),
                wpe: normal_embedding(c.n_positions, d, c.initializer_range, device),
            })
        } else if self.index <= c.n_layer {
            Gpt2Layer::Block(Gpt2Block::new(c, self.index - 1, device))
        } else {
            Gpt2Layer::Head(Gpt2Head {
                wte: normal_embedding(c.vocab_size, d, c.initializer_range, device),
                ln_f: layer_norm(d, c.layer_norm_epsilon, device),
            })
        }
    }
}
