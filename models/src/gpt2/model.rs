//! The GPT-2 language model as an explicit chain: embedding → blocks → head.

use burn::module::Module;
use burn::nn::{Embedding, LayerNorm};
use burn::prelude::*;

use super::block::Gpt2Block;
use super::config::Gpt2Config;
use super::init::{layer_norm, normal_embedding};

pub(crate) use crate::loss::shifted_cross_entropy;
pub use crate::loss::IGNORE_INDEX;

/// GPT-2 with its language-modelling head tied to the token embedding.
///
/// The forward pass is exposed as the three stages a training engine can drive one by one:
/// [`embed`](Self::embed), each of [`blocks`](Self::blocks), then
/// [`head_logits`](Self::head_logits) or [`head_loss`](Self::head_loss). [`forward`](Self::forward)
/// and [`loss`](Self::loss) run the whole chain. No dropout is applied, so a forward pass is
/// deterministic and equal to HuggingFace's `GPT2LMHeadModel` in eval mode.
///
/// ```
/// use burn::backend::Flex;
/// use burn::prelude::*;
/// use zero_models::gpt2::Gpt2Config;
///
/// let device = Default::default();
/// let config = Gpt2Config::new(64, 16, 32, 2, 4);
/// let model = config.init::<Flex>(&device);
/// let tokens = Tensor::<Flex, 2, Int>::from_ints([[1, 2, 3, 4]], &device);
/// let loss = model.loss(tokens.clone(), tokens);
/// assert!(loss.into_scalar() > 0.0);
/// ```
#[derive(Module, Debug)]
pub struct Gpt2<B: Backend> {
    /// Token embedding `[vocab_size, n_embd]`, also the LM head's weight.
    pub wte: Embedding<B>,
    /// Learned position embedding `[n_positions, n_embd]`.
    pub wpe: Embedding<B>,
    /// The transformer blocks (HuggingFace's `h`).
    pub blocks: Vec<Gpt2Block<B>>,
    /// The final LayerNorm, applied by the head.
    pub ln_f: LayerNorm<B>,
}

impl Gpt2Config {
    /// A randomly initialized model with GPT-2's initialization: weights N(0, initializer_range²),
    /// residual output projections scaled by `1 / sqrt(2 * n_layer)`, zero biases, unit
    /// LayerNorms.
    ///
    /// # Panics
    ///
    /// If the configuration is invalid; check it with [`validate`](Self::validate) first when
    /// it comes from outside.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Gpt2<B> {
        if let Err(error) = self.validate() {
            panic!("cannot build GPT-2: {error}");
        }
        let d = self.n_embd;
        Gpt2 {
            wte: normal_embedding(self.vocab_size, d, self.initializer_range, device),
            wpe: normal_embedding(self.n_positions, d, self.initializer_range, device),
            blocks: (0..self.n_layer)
                .map(|layer| Gpt2Block::new(self, layer, device))
                .collect(),
            ln_f: layer_norm(d, self.layer_norm_epsilon, device),
        }
    }
}

impl<B: Backend> Gpt2<B> {
    /// Token plus position embeddings of `tokens` `[batch, seq]`: hidden states
    /// `[batch, seq, n_embd]`, the first block's input.
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

    /// The transformer blocks in order; each maps `[batch, seq, n_embd]` to the same shape.
    pub fn blocks(&self) -> &[Gpt2Block<B>] {
        &self.blocks
    }

    /// Runs every block on the embedded hidden states.
    pub fn run_blocks(&self, mut h: Tensor<B, 3>) -> Tensor<B, 3> {
        for block in &self.blocks {
            h = block.forward(h);
        }
        h
    }

    /// The head: final LayerNorm, then logits `h · wteᵀ` of shape `[batch, seq, vocab_size]`.
    pub fn head_logits(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, hidden] = h.dims();
        let h = self.ln_f.forward(h).reshape([batch * seq, hidden]);
        let wte = self.wte.weight.val();
        let [vocab, _] = wte.dims();
        h.matmul(wte.transpose()).reshape([batch, seq, vocab])
    }

    /// The head's loss with HuggingFace's `labels` semantics: `labels` `[batch, seq]` is aligned
    /// with the input tokens (usually equal to them), position `t` predicts `labels[t + 1]`, and
    /// labels equal to [`IGNORE_INDEX`] are left out. Returns the mean cross-entropy over the
    /// counted positions, shape `[1]` (NaN when none is counted, as in PyTorch).
    ///
    /// Logits of the last position, which predict nothing, are never computed.
    pub fn head_loss(&self, h: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, seq, _] = h.dims();
        if seq < 2 {
            // Nothing to predict: PyTorch's mean over zero elements.
            return Tensor::from_floats([f32::NAN], &h.device());
        }
        let logits = self.head_logits(h.narrow(1, 0, seq - 1));
        let targets = labels.narrow(1, 1, seq - 1);
        shifted_cross_entropy(logits, targets, batch * (seq - 1))
    }

    /// Logits `[batch, seq, vocab_size]` of `tokens` `[batch, seq]`: the whole chain.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.head_logits(self.run_blocks(self.embed(tokens)))
    }

    /// Mean next-token cross-entropy of `tokens` against `labels` (see
    /// [`head_loss`](Self::head_loss)): HuggingFace's `GPT2LMHeadModel(input_ids,
    /// labels=labels).loss`.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.head_loss(self.run_blocks(self.embed(tokens)), labels)
    }
}
