//! GPT-2's position-wise feed-forward network.

use burn::module::Module;
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::activation;

use super::config::{Activation, Gpt2Config};
use super::init::normal_linear;

/// The feed-forward network of a block: `c_proj(act(c_fc(x)))`.
#[derive(Module, Debug)]
pub struct Gpt2Mlp<B: Backend> {
    /// Expansion, weight `[n_embd, n_inner]`.
    pub c_fc: Linear<B>,
    /// Contraction, weight `[n_inner, n_embd]`.
    pub c_proj: Linear<B>,
    /// The activation between the two.
    pub activation: Activation,
}

impl<B: Backend> Gpt2Mlp<B> {
    /// A randomly initialized MLP with GPT-2's initialization (the output projection's std
    /// scaled by `1 / sqrt(2 * n_layer)`).
    ///
    /// # Panics
    ///
    /// If the config's activation is not supported; [`Gpt2Config::validate`] rejects those.
    pub fn new(config: &Gpt2Config, device: &B::Device) -> Self {
        let d = config.n_embd;
        let inner = config.inner_size();
        let std = config.initializer_range;
        let proj_std = std / (2.0 * config.n_layer as f64).sqrt();
        Self::from_linears(
            config,
            normal_linear(d, inner, std, device),
            normal_linear(inner, d, proj_std, device),
        )
    }

    /// The MLP with the given layers and the config's activation.
    ///
    /// # Panics
    ///
    /// If the config's activation is not supported; [`Gpt2Config::validate`] rejects those.
    pub fn from_linears(config: &Gpt2Config, c_fc: Linear<B>, c_proj: Linear<B>) -> Self {
        Self {
            c_fc,
            c_proj,
            activation: config.activation().unwrap_or_else(|| {
                panic!(
                    "unsupported activation `{}`: validate the config first",
                    config.activation_function
                )
            }),
        }
    }

    /// Applies the network to `x` of shape `[batch, seq, n_embd]`.
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
