//! One pre-RMSNorm decoder layer: the unit the ZeRO engine runs, re-gathers and recomputes.

use burn::module::Module;
use burn::nn::RmsNorm;
use burn::prelude::*;

use super::attention::LlamaAttention;
use super::config::LlamaConfig;
use super::init::rms_norm;
use super::mlp::LlamaMlp;

/// transformers' `LlamaDecoderLayer`: `h = x + self_attn(input_layernorm(x))`, then
/// `h + mlp(post_attention_layernorm(h))`.
///
/// It depends on nothing outside itself (the rotary embedding is its attention's), so it can be
/// built, run and differentiated alone.
#[derive(Module, Debug)]
pub struct LlamaDecoderLayer<B: Backend> {
    /// RMSNorm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Causal grouped-query self-attention.
    pub self_attn: LlamaAttention<B>,
    /// RMSNorm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
    /// SwiGLU feed-forward network.
    pub mlp: LlamaMlp<B>,
}

impl<B: Backend> LlamaDecoderLayer<B> {
    /// A randomly initialized layer.
    pub fn new(config: &LlamaConfig, device: &B::Device) -> Self {
        let (h, eps) = (config.hidden_size, config.rms_norm_eps);
        Self {
            input_layernorm: rms_norm(h, eps, device),
            self_attn: LlamaAttention::new(config, device),
            post_attention_layernorm: rms_norm(h, eps, device),
            mlp: LlamaMlp::new(config, device),
        }
    }

    /// Maps hidden states `[batch, seq, hidden_size]` to the next layer's input, same shape.
    ///
    /// # Panics
    ///
    /// If `seq` exceeds the config's sliding window ([`LlamaConfig::check_sequence`]).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = x.clone() + self.self_attn.forward(self.input_layernorm.forward(x));
        h.clone() + self.mlp.forward(self.post_attention_layernorm.forward(h))
    }
}
