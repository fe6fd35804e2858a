//! One pre-LayerNorm transformer block: the unit the ZeRO engine runs, re-gathers and recomputes.

use burn::module::Module;
use burn::nn::LayerNorm;
use burn::prelude::*;

use super::attention::Gpt2Attention;
use super::config::Gpt2Config;
use super::init::layer_norm;
use super::mlp::Gpt2Mlp;

/// A transformer block: `x + attn(ln_1(x))`, then `h + mlp(ln_2(h))`.
///
/// It depends on nothing outside itself, so it can be built, run and differentiated alone.
#[derive(Module, Debug)]
pub struct Gpt2Block<B: Backend> {
    /// LayerNorm before attention.
    pub ln_1: LayerNorm<B>,
    /// Causal self-attention.
    pub attn: Gpt2Attention<B>,
    /// LayerNorm before the MLP.
    pub ln_2: LayerNorm<B>,
    /// Feed-forward network.
    pub mlp: Gpt2Mlp<B>,
}

impl<B: Backend> Gpt2Block<B> {
    /// A randomly initialized block at index `layer` (which sets its attention scale when
    /// `scale_attn_by_inverse_layer_idx` is on).
    pub fn new(config: &Gpt2Config, layer: usize, device: &B::Device) -> Self {
        let d = config.n_embd;
        let eps = config.layer_norm_epsilon;
        Self {
            ln_1: layer_norm(d, eps, device),
            attn: Gpt2Attention::new(config, layer, device),
            ln_2: layer_norm(d, eps, device),
            mlp: Gpt2Mlp::new(config, device),
        }
    }

    /// Maps hidden states `[batch, seq, n_embd]` to the next block's input, same shape.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = x.clone() + self.attn.forward(self.ln_1.forward(x));
        h.clone() + self.mlp.forward(self.ln_2.forward(h))
    }
}
