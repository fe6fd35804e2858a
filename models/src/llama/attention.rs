//! Grouped-query causal self-attention with rotary embeddings: the one attention of the Llama
//! family, with Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorm as options.

use burn::module::Module;
use burn::nn::{Linear, RmsNorm};
use burn::prelude::*;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;

use super::config::LlamaConfig;
use super::init::{normal_linear, rms_norm};
use super::rope::{apply_rotary, RotaryEmbedding};

/// transformers' `LlamaAttention` (and Qwen2's, Qwen3's, Mistral's): queries from
/// `num_attention_heads` heads, keys and values from `num_key_value_heads` heads each shared by
/// `num_attention_heads / num_key_value_heads` query heads, the rotary embedding on queries and
/// keys, causal softmax attention scaled by `1 / sqrt(head_dim)`, then `o_proj`.
///
/// The four projections are plain linears: q/k/v are column-parallel candidates (split by
/// head), `o_proj` a row-parallel one.
#[derive(Module, Debug)]
pub struct LlamaAttention<B: Backend> {
    /// Query projection, weight `[hidden_size, num_attention_heads * head_dim]`.
    pub q_proj: Linear<B>,
    /// Key projection, weight `[hidden_size, num_key_value_heads * head_dim]`.
    pub k_proj: Linear<B>,
    /// Value projection, weight `[hidden_size, num_key_value_heads * head_dim]`.
    pub v_proj: Linear<B>,
    /// Output projection, weight `[num_attention_heads * head_dim, hidden_size]`.
    pub o_proj: Linear<B>,
    /// Qwen3's RMSNorm over each query head, before the rotary embedding.
    pub q_norm: Option<RmsNorm<B>>,
    /// Qwen3's RMSNorm over each key head, before the rotary embedding.
    pub k_norm: Option<RmsNorm<B>>,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads.
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// The rotary embedding of queries and keys.
    pub rotary: RotaryEmbedding,
    /// The longest sequence the config's sliding window lets attend causally to every earlier
    /// position (see [`LlamaConfig::attention_window`]).
    pub window: Option<usize>,
}

impl<B: Backend> LlamaAttention<B> {
    /// A randomly initialized attention layer (weights N(0, initializer_range²), zero biases,
    /// unit norms).
    pub fn new(config: &LlamaConfig, device: &B::Device) -> Self {
        let (h, std) = (config.hidden_size, config.initializer_range);
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let qkv_bias = config.qkv_bias();
        Self::from_parts(
            config,
            [
                normal_linear(h, q, qkv_bias, std, device),
                normal_linear(h, kv, qkv_bias, std, device),
                normal_linear(h, kv, qkv_bias, std, device),
                normal_linear(q, h, config.o_bias(), std, device),
            ],
            config
                .qk_norm()
                .then(|| [0, 1].map(|_| rms_norm(config.head_dim, config.rms_norm_eps, device))),
        )
    }

    /// The attention layer with the given projections `[q, k, v, o]` and, for Qwen3, the
    /// `[q_norm, k_norm]` norms.
    pub fn from_parts(config: &LlamaConfig, projections: [Linear<B>; 4], norms: Option<[RmsNorm<B>; 2]>) -> Self {
        let [q_proj, k_proj, v_proj, o_proj] = projections;
        let (q_norm, k_norm) = match norms {
            Some([q, k]) => (Some(q), Some(k)),
            None => (None, None),
        };
        Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            rotary: RotaryEmbedding {
                inv_freq: config.rope_inv_freq(),
            },
            window: config.attention_window(),
        }
    }

    /// Attends over `x` `[batch, seq, hidden_size]` (positions `0..seq`), each position seeing
    /// itself and the positions before it; returns the same shape.
    ///
    /// # Panics
    ///
    /// If `seq` exceeds the config's sliding window, which this implementation does not apply
    /// (check it at the edge with [`LlamaConfig::check_sequence`]).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        if let Some(window) = self.window {
            assert!(
                seq <= window,
                "{}",
                super::LlamaConfigError::SequenceBeyondWindow { seq, window }
            );
        }
        let (heads, kv_heads, head_dim) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // [batch, seq, heads * head_dim] -> [batch, seq, heads, head_dim]; the norm (Qwen3)
        // runs over each head, then heads move before positions.
        let split = |t: Tensor<B, 3>, n: usize, norm: &Option<RmsNorm<B>>| {
            let t = t.reshape([batch, seq, n, head_dim]);
            let t = match norm {
                Some(norm) => norm.forward(t),
                None => t,
            };
            t.swap_dims(1, 2)
        };
        let query = split(self.q_proj.forward(x.clone()), heads, &self.q_norm);
        let key = split(self.k_proj.forward(x.clone()), kv_heads, &self.k_norm);
        let value = split(self.v_proj.forward(x), kv_heads, &None);

        let (cos, sin) = self.rotary.cos_sin::<B>(seq, query.dtype(), &query.device());
        let query = apply_rotary(query, &cos, &sin);
        let key = apply_rotary(key, &cos, &sin);
        let key = repeat_kv(key, heads / kv_heads);
        let value = repeat_kv(value, heads / kv_heads);

        let options = AttentionModuleOptions {
            scale: Some(1.0 / (head_dim as f64).sqrt()),
            softcap: None,
            is_causal: true,
        };
        let context = attention(query, key, value, None, None, options);
        let context = context.swap_dims(1, 2).reshape([batch, seq, heads * head_dim]);
        self.o_proj.forward(context)
    }
}

/// Each of the `kv_heads` heads of `x` `[batch, kv_heads, seq, head_dim]` repeated `groups`
/// times in place (transformers' `repeat_kv`): head `h` of the result is head `h / groups`.
fn repeat_kv<B: Backend>(x: Tensor<B, 4>, groups: usize) -> Tensor<B, 4> {
    if groups == 1 {
        return x;
    }
    let [batch, kv_heads, seq, head_dim] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([batch, kv_heads, groups, seq, head_dim])
        .reshape([batch, kv_heads * groups, seq, head_dim])
}
