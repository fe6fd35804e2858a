//! GPT-2's causal multi-head self-attention with a fused query/key/value projection.

use burn::module::Module;
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;

use super::config::Gpt2Config;
use super::init::normal_linear;

/// Causal self-attention: one linear layer `c_attn` projects the hidden state to queries, keys
/// and values at once (`[n_embd, 3 * n_embd]`, in that order), and `c_proj` maps the heads'
/// concatenated outputs back to the hidden size.
#[derive(Module, Debug)]
pub struct Gpt2Attention<B: Backend> {
    /// Fused query/key/value projection, weight `[n_embd, 3 * n_embd]`.
    pub c_attn: Linear<B>,
    /// Output projection, weight `[n_embd, n_embd]`.
    pub c_proj: Linear<B>,
    /// Number of heads.
    pub n_head: usize,
    /// Factor the scores `q · kᵀ` are multiplied with before the softmax.
    pub scale: f64,
}

impl<B: Backend> Gpt2Attention<B> {
    /// A randomly initialized attention layer for the block at index `layer`, with GPT-2's
    /// initialization (the output projection's std scaled by `1 / sqrt(2 * n_layer)`).
    pub fn new(config: &Gpt2Config, layer: usize, device: &B::Device) -> Self {
        let d = config.n_embd;
        let std = config.initializer_range;
        let proj_std = std / (2.0 * config.n_layer as f64).sqrt();
        Self::from_linears(
            config,
            layer,
            normal_linear(d, 3 * d, std, device),
            normal_linear(d, d, proj_std, device),
        )
    }

    /// The attention layer of block `layer` with the given projections.
    pub fn from_linears(config: &Gpt2Config, layer: usize, c_attn: Linear<B>, c_proj: Linear<B>) -> Self {
        Self {
            c_attn,
            c_proj,
            n_head: config.n_head,
            scale: config.attention_scale(layer),
        }
    }

    /// Attends over `x` of shape `[batch, seq, n_embd]`, each position seeing itself and the
    /// positions before it; returns the same shape.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, hidden] = x.dims();
        let head_dim = hidden / self.n_head;
        let qkv = self.c_attn.forward(x);
        let heads = |part: Tensor<B, 3>| part.reshape([batch, seq, self.n_head, head_dim]).swap_dims(1, 2);
        let query = heads(qkv.clone().narrow(2, 0, hidden));
        let key = heads(qkv.clone().narrow(2, hidden, hidden));
        let value = heads(qkv.narrow(2, 2 * hidden, hidden));
        let options = AttentionModuleOptions {
            scale: Some(self.scale),
            softcap: None,
            is_causal: true,
        };
        let context = attention(query, key, value, None, None, options);
        let context = context.swap_dims(1, 2).reshape([batch, seq, hidden]);
        self.c_proj.forward(context)
    }
}
