//! The Llama-family language model as an explicit chain: embedding → decoder layers → head.

use burn::module::Module;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::*;

use super::block::LlamaDecoderLayer;
use super::config::LlamaConfig;
use super::init::{normal_embedding, normal_linear, rms_norm};
use crate::loss::shifted_cross_entropy;

/// A Llama-family decoder (transformers' `LlamaForCausalLM`, `Qwen2ForCausalLM`,
/// `Qwen3ForCausalLM`, `MistralForCausalLM`), written once for all four: what differs between
/// them is in [`LlamaConfig`].
///
/// The forward pass is exposed as the stages a training engine drives one by one:
/// [`embed`](Self::embed), each of [`layers`](Self::layers), then
/// [`head_logits`](Self::head_logits) or [`head_loss`](Self::head_loss). [`forward`](Self::forward)
/// and [`loss`](Self::loss) run the whole chain. No dropout is applied, so the model equals
/// transformers' in eval mode.
///
/// ```
/// use burn::backend::Flex;
/// use burn::prelude::*;
/// use zero_models::llama::{LlamaConfig, LlamaFamily};
///
/// let device = Default::default();
/// let config = LlamaConfig::new(LlamaFamily::Llama, 64, 32, 64, 2, 4, 2);
/// let model = config.init::<Flex>(&device);
/// let tokens = Tensor::<Flex, 2, Int>::from_ints([[1, 2, 3, 4]], &device);
/// let loss = model.loss(tokens.clone(), tokens);
/// assert!(loss.into_scalar() > 0.0);
/// ```
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// Token embedding `[vocab_size, hidden_size]` (HuggingFace's `model.embed_tokens`); also
    /// the LM head's weight when the embeddings are tied.
    pub embed_tokens: Embedding<B>,
    /// The decoder layers (`model.layers`).
    pub layers: Vec<LlamaDecoderLayer<B>>,
    /// The final RMSNorm (`model.norm`), applied by the head.
    pub norm: RmsNorm<B>,
    /// The LM head, weight `[hidden_size, vocab_size]`, no bias; `None` when tied to
    /// `embed_tokens`.
    pub lm_head: Option<Linear<B>>,
}

impl LlamaConfig {
    /// A randomly initialized model with transformers' initialization: weights
    /// N(0, initializer_range²), zero biases, unit norms.
    ///
    /// # Panics
    ///
    /// If the configuration is invalid; check it with [`validate`](Self::validate) first when
    /// it comes from outside.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Llama<B> {
        if let Err(error) = self.validate() {
            panic!("cannot build the {} model: {error}", self.family.model_type());
        }
        let h = self.hidden_size;
        Llama {
            embed_tokens: normal_embedding(self.vocab_size, h, self.initializer_range, device),
            layers: (0..self.num_hidden_layers)
                .map(|_| LlamaDecoderLayer::new(self, device))
                .collect(),
            norm: rms_norm(h, self.rms_norm_eps, device),
            lm_head: (!self.tie_word_embeddings)
                .then(|| normal_linear(h, self.vocab_size, false, self.initializer_range, device)),
        }
    }
}

impl<B: Backend> Llama<B> {
    /// The token embedding of `tokens` `[batch, seq]`: hidden states `[batch, seq,
    /// hidden_size]`, the first layer's input. (Positions enter in each attention, by rotation.)
    pub fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.embed_tokens.forward(tokens)
    }

    /// The decoder layers in order; each maps `[batch, seq, hidden_size]` to the same shape.
    pub fn layers(&self) -> &[LlamaDecoderLayer<B>] {
        &self.layers
    }

    /// Runs every layer on the embedded hidden states.
    pub fn run_layers(&self, mut h: Tensor<B, 3>) -> Tensor<B, 3> {
        for layer in &self.layers {
            h = layer.forward(h);
        }
        h
    }

    /// The head: final RMSNorm, then logits `[batch, seq, vocab_size]`.
    pub fn head_logits(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        head_logits(&self.norm, self.head_weight(), h)
    }

    /// What the logits are computed with: `lm_head`, or the embedding when tied.
    fn head_weight(&self) -> HeadWeight<'_, B> {
        match &self.lm_head {
            Some(head) => HeadWeight::Linear(head),
            None => HeadWeight::Tied(&self.embed_tokens),
        }
    }

    /// The head's loss with HuggingFace's `labels` semantics: `labels` `[batch, seq]` is aligned
    /// with the input tokens, position `t` predicts `labels[t + 1]`, labels equal to
    /// [`crate::gpt2::IGNORE_INDEX`] (-100) are left out. Returns the mean cross-entropy over
    /// the counted positions, shape `[1]` (NaN when none is counted, as in PyTorch).
    pub fn head_loss(&self, h: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        head_loss(&self.norm, self.head_weight(), h, labels)
    }

    /// Logits `[batch, seq, vocab_size]` of `tokens` `[batch, seq]`: the whole chain.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.head_logits(self.run_layers(self.embed(tokens)))
    }

    /// Mean next-token cross-entropy of `tokens` against `labels` (see
    /// [`head_loss`](Self::head_loss)): transformers' `model(input_ids, labels=labels).loss`.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.head_loss(self.run_layers(self.embed(tokens)), labels)
    }
}

/// The weight of the LM head: its own linear, or the token embedding it is tied to.
pub(crate) enum HeadWeight<'a, B: Backend> {
    /// An untied `lm_head`.
    Linear(&'a Linear<B>),
    /// The token embedding, used transposed.
    Tied(&'a Embedding<B>),
}

/// Logits of the head: `norm`, then `lm_head`, or `h · embed_tokensᵀ` when tied.
pub(crate) fn head_logits<B: Backend>(norm: &RmsNorm<B>, weight: HeadWeight<'_, B>, h: Tensor<B, 3>) -> Tensor<B, 3> {
    let h = norm.forward(h);
    match weight {
        HeadWeight::Linear(head) => head.forward(h),
        HeadWeight::Tied(embed_tokens) => {
            let [batch, seq, hidden] = h.dims();
            let weight = embed_tokens.weight.val();
            let [vocab, _] = weight.dims();
            h.reshape([batch * seq, hidden])
                .matmul(weight.transpose())
                .reshape([batch, seq, vocab])
        }
    }
}

/// The shifted loss of the head; the logits of the last position, which predict nothing, are
/// never computed.
pub(crate) fn head_loss<B: Backend>(
    norm: &RmsNorm<B>,
    weight: HeadWeight<'_, B>,
    h: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [batch, seq, _] = h.dims();
    if seq < 2 {
        return Tensor::from_floats([f32::NAN], &h.device());
    }
    let logits = head_logits(norm, weight, h.narrow(1, 0, seq - 1));
    shifted_cross_entropy(logits, labels.narrow(1, 1, seq - 1), batch * (seq - 1))
}
