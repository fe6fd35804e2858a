//! A GPT-2 transformer block split across the tensor-parallel group: attention heads and the
//! MLP's inner features are divided among the ranks, LayerNorms are replicated.

use super::collectives::TpBackend;
use super::group::TpGroup;
use super::linear::{check_divisible, ColumnParallelLinear, RowParallelLinear};
use super::{fresh, TpLoadError};
use crate::gpt2::{Activation, Gpt2Attention, Gpt2Block, Gpt2Mlp};
use burn::module::Module;
use burn::nn::LayerNorm;
use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;

/// Causal self-attention with this rank's heads: `c_attn` column-parallel (its q, k and v
/// columns of those heads), `c_proj` row-parallel.
#[derive(Module, Debug)]
pub struct TpAttention<B: Backend> {
    /// This rank's q|k|v columns, `[n_embd, 3 * n_embd / tp]`.
    pub c_attn: ColumnParallelLinear<B>,
    /// Output projection, the rows of this rank's heads.
    pub c_proj: RowParallelLinear<B>,
    /// Heads on this rank (`n_head / tp`).
    pub local_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Factor the scores are multiplied with before the softmax.
    pub scale: f64,
}

/// The MLP with this rank's inner features: `c_fc` column-parallel, `c_proj` row-parallel.
#[derive(Module, Debug)]
pub struct TpMlp<B: Backend> {
    /// Expansion, `[n_embd, n_inner / tp]`.
    pub c_fc: ColumnParallelLinear<B>,
    /// Contraction, `[n_inner / tp, n_embd]`.
    pub c_proj: RowParallelLinear<B>,
    /// The activation between the two.
    pub activation: Activation,
}

/// A pre-LayerNorm transformer block over the tensor-parallel group: `x + attn(ln_1(x))`, then
/// `h + mlp(ln_2(h))`, with input and output replicated on every rank.
#[derive(Module, Debug)]
pub struct TpBlock<B: Backend> {
    /// LayerNorm before attention (replicated).
    pub ln_1: LayerNorm<B>,
    /// Attention over this rank's heads.
    pub attn: TpAttention<B>,
    /// LayerNorm before the MLP (replicated).
    pub ln_2: LayerNorm<B>,
    /// MLP over this rank's inner features.
    pub mlp: TpMlp<B>,
}

impl<B: TpBackend> TpAttention<B> {
    /// This rank's heads of `full`.
    pub fn from_full(full: &Gpt2Attention<B>, group: TpGroup) -> Result<Self, TpLoadError> {
        check_divisible("the attention heads", full.n_head, group.size())?;
        let [n_embd, _] = full.c_proj.weight.dims();
        let head_dim = n_embd / full.n_head;
        Ok(TpAttention {
            c_attn: ColumnParallelLinear::from_full(&full.c_attn, 3, group.clone())?,
            c_proj: RowParallelLinear::from_full(&full.c_proj, group.clone())?,
            local_heads: full.n_head / group.size(),
            head_dim,
            scale: full.scale,
        })
    }

    /// Attends over replicated `x` `[batch, seq, n_embd]`; the result is replicated too.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let width = self.local_heads * self.head_dim;
        let qkv = self.c_attn.forward(x);
        let heads = |part: Tensor<B, 3>| {
            part.reshape([batch, seq, self.local_heads, self.head_dim])
                .swap_dims(1, 2)
        };
        let query = heads(qkv.clone().narrow(2, 0, width));
        let key = heads(qkv.clone().narrow(2, width, width));
        let value = heads(qkv.narrow(2, 2 * width, width));
        let options = AttentionModuleOptions {
            scale: Some(self.scale),
            softcap: None,
            is_causal: true,
        };
        let context = attention(query, key, value, None, None, options);
        let context = context.swap_dims(1, 2).reshape([batch, seq, width]);
        self.c_proj.forward(context)
    }
}

impl<B: TpBackend> TpMlp<B> {
    /// This rank's inner features of `full`.
    pub fn from_full(full: &Gpt2Mlp<B>, group: TpGroup) -> Result<Self, TpLoadError> {
        Ok(TpMlp {
            c_fc: ColumnParallelLinear::from_full(&full.c_fc, 1, group.clone())?,
            c_proj: RowParallelLinear::from_full(&full.c_proj, group)?,
            activation: full.activation,
        })
    }

    /// Applies the network to replicated `x` `[batch, seq, n_embd]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = self.c_fc.forward(x);
        let h = match self.activation {
            Activation::GeluTanh => activation::gelu_approximate(h),
            Activation::GeluErf => activation::gelu(h),
            Activation::Relu => activation::relu(h),
        };
        self.c_proj.forward(h)
    }
}

impl<B: TpBackend> TpBlock<B> {
    /// This rank's part of `full`.
    pub fn from_full(full: &Gpt2Block<B>, group: TpGroup) -> Result<Self, TpLoadError> {
        Ok(TpBlock {
            ln_1: fresh(full.ln_1.clone()),
            attn: TpAttention::from_full(&full.attn, group.clone())?,
            ln_2: fresh(full.ln_2.clone()),
            mlp: TpMlp::from_full(&full.mlp, group)?,
        })
    }

    /// Maps replicated hidden states `[batch, seq, n_embd]` to the next block's input.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = x.clone() + self.attn.forward(self.ln_1.forward(x));
        h.clone() + self.mlp.forward(self.ln_2.forward(h))
    }
}
