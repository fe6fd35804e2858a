//! What the tensor-parallel GPT-2 tests share: a small GPT-2 with deterministic weights and
//! token batches (no random generator, so every rank thread builds the same model and data),
//! the comparison of weights, and the rank threads of a data × tensor layout.

#![allow(dead_code)]

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use zero_burn::params::{describe, read_values, take_grads, write_values};
use zero_core::parallel::{ParallelLayout, RankGroups};
use zero_models::gpt2::{Gpt2, Gpt2Config};

pub type B = Autodiff<Flex>;

pub const VOCAB: usize = 48;
pub const EMBD: usize = 16;
pub const HEADS: usize = 4;
pub const LAYERS: usize = 2;
pub const SEQ: usize = 7;

pub fn config() -> Gpt2Config {
    Gpt2Config::new(VOCAB, 16, EMBD, LAYERS, HEADS)
}

/// The full model with deterministic weights (no random generator: every thread builds the
/// same one). LayerNorm scales stay near one, everything else is a smooth pseudo-random pattern.
pub fn full_model(device: &Device<B>) -> Gpt2<B> {
    full_model_of(&config(), device)
}

/// [`full_model`] of another shape.
pub fn full_model_of(config: &Gpt2Config, device: &Device<B>) -> Gpt2<B> {
    let model = config.init::<B>(device);
    let specs = describe::<B, _>(&model);
    write_values(model, device, true, |i| {
        let (name, n) = (&specs[i].1.name, specs[i].1.numel());
        let scale = if name.contains("ln_") && name.ends_with("gamma") {
            0.1
        } else {
            0.3
        };
        let base = if name.contains("ln_") && name.ends_with("gamma") {
            1.0
        } else {
            0.0
        };
        (0..n)
            .map(|k| base + scale * ((i * 131 + k * 7) as f32 * 0.37).sin())
            .collect()
    })
}

/// Token ids `[rows, SEQ]` of step `step`, rows `rows` of the global batch.
pub fn tokens(step: usize, rows: std::ops::Range<usize>, device: &Device<B>) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = rows
        .clone()
        .flat_map(|r| (0..SEQ).map(move |t| ((r * 31 + t * 17 + step * 5) % VOCAB) as i64))
        .collect();
    Tensor::from_data(TensorData::new(ids, [rows.len(), SEQ]), device)
}

pub fn values<M: Module<B>>(m: &M) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    read_values::<B, _>(m, |_, v| out.push(v));
    out
}

/// Runs `f` on one thread per rank of the layout.
pub fn on_layout<T: Send>(data: usize, tensor: usize, f: impl Fn(RankGroups) -> T + Sync) -> Vec<T> {
    let ranks = ParallelLayout::new(data, tensor).unwrap().threads().unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks.into_iter().map(|g| s.spawn(move || f(g))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A full model holding `flat` (one vector per parameter, in visit order): weights, or
/// gradients to be sliced like weights.
pub fn model_from(flat: &[Vec<f32>], device: &Device<B>) -> Gpt2<B> {
    write_values(config().init::<B>(device), device, false, |i| flat[i].clone())
}

/// The reference's gradients, one vector per parameter.
pub fn gradients(model: &Gpt2<B>, grads: &mut <B as AutodiffBackend>::Gradients) -> Vec<Vec<f32>> {
    let mut flat = Vec::new();
    take_grads::<B, _>(model, grads, |_, g| {
        flat.push(g.expect("every parameter has a gradient"))
    });
    flat
}
