//! The Llama family's weight initialization (transformers' `_init_weights`): linear and
//! embedding weights N(0, initializer_range²), zero biases, unit RMSNorms.

use burn::module::Param;
use burn::nn::{Embedding, Linear, RmsNorm, RmsNormConfig};
use burn::prelude::*;
use burn::tensor::Distribution;

/// A `[d_input, d_output]` linear layer (Burn's layout: PyTorch's `[out, in]` transposed) with
/// weights drawn from N(0, std²), and a zero bias when `bias`.
pub(crate) fn normal_linear<B: Backend>(
    d_input: usize,
    d_output: usize,
    bias: bool,
    std: f64,
    device: &B::Device,
) -> Linear<B> {
    let weight = Tensor::random([d_input, d_output], Distribution::Normal(0.0, std), device);
    Linear {
        weight: Param::from_tensor(weight),
        bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_output], device))),
    }
}

/// An embedding table of `[rows, dim]` drawn from N(0, std²).
pub(crate) fn normal_embedding<B: Backend>(rows: usize, dim: usize, std: f64, device: &B::Device) -> Embedding<B> {
    let weight = Tensor::random([rows, dim], Distribution::Normal(0.0, std), device);
    Embedding {
        weight: Param::from_tensor(weight),
    }
}

/// An RMSNorm over `dim` features with unit scale and the given epsilon.
pub(crate) fn rms_norm<B: Backend>(dim: usize, epsilon: f64, device: &B::Device) -> RmsNorm<B> {
    RmsNormConfig::new(dim).with_epsilon(epsilon).init(device)
}
