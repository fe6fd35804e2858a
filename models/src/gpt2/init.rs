//! GPT-2's weight initialization, shared by the modules' constructors.

use burn::module::Param;
use burn::nn::{Embedding, LayerNorm, LayerNormConfig, Linear};
use burn::prelude::*;
use burn::tensor::Distribution;

/// A `[d_input, d_output]` linear layer with weights drawn from N(0, std²) and a zero bias, as
/// HuggingFace initializes GPT-2's Conv1D layers (which store the same `[in, out]` layout).
pub(crate) fn normal_linear<B: Backend>(d_input: usize, d_output: usize, std: f64, device: &B::Device) -> Linear<B> {
    let weight = Tensor::random([d_input, d_output], Distribution::Normal(0.0, std), device);
    Linear {
        weight: Param::from_tensor(weight),
        bias: Some(Param::from_tensor(Tensor::zeros([d_output], device))),
    }
}

/// An embedding table of `[rows, dim]` drawn from N(0, std²).
pub(crate) fn normal_embedding<B: Backend>(rows: usize, dim: usize, std: f64, device: &B::Device) -> Embedding<B> {
    let weight = Tensor::random([rows, dim], Distribution::Normal(0.0, std), device);
    Embedding {
        weight: Param::from_tensor(weight),
    }
}

/// A LayerNorm with unit scale, zero shift and the given epsilon.
pub(crate) fn layer_norm<B: Backend>(dim: usize, epsilon: f64, device: &B::Device) -> LayerNorm<B> {
    LayerNormConfig::new(dim).with_epsilon(epsilon).init(device)
}
