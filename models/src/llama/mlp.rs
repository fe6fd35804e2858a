//! The Llama family's SwiGLU feed-forward network.

use burn::module::Module;
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::activation::silu;

use super::config::LlamaConfig;
use super::init::normal_linear;

/// `down_proj(silu(gate_proj(x)) ⊙ up_proj(x))` (transformers' `LlamaMLP`). The gate and up
/// projections are column-parallel candidates, the down projection a row-parallel one.
#[derive(Module, Debug)]
pub struct LlamaMlp<B: Backend> {
    /// Gate projection, weight `[hidden_size, intermediate_size]`.
    pub gate_proj: Linear<B>,
    /// Up projection, weight `[hidden_size, intermediate_size]`.
    pub up_proj: Linear<B>,
    /// Down projection, weight `[intermediate_size, hidden_size]`.
    pub down_proj: Linear<B>,
}

impl<B: Backend> LlamaMlp<B> {
    /// A randomly initialized MLP (weights N(0, initializer_range²), zero biases where the
    /// config has them), as transformers initializes it.
    pub fn new(config: &LlamaConfig, device: &B::Device) -> Self {
        let (h, i, std, bias) = (
            config.hidden_size,
            config.intermediate_size,
            config.initializer_range,
            config.mlp_has_bias(),
        );
        Self {
            gate_proj: normal_linear(h, i, bias, std, device),
            up_proj: normal_linear(h, i, bias, std, device),
            down_proj: normal_linear(i, h, bias, std, device),
        }
    }

    /// Applies the network to `x` `[batch, seq, hidden_size]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = silu(self.gate_proj.forward(x.clone()));
        self.down_proj.forward(gate * self.up_proj.forward(x))
    }
}
