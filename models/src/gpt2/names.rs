//! The mapping between the model's parameters and HuggingFace's tensor names.
//!
//! HuggingFace's `Conv1D` stores its weight as `[in, out]`, the layout of Burn's `Linear`, so
//! every tensor maps over unchanged; LayerNorm's `weight`/`bias` are Burn's `gamma`/`beta`.

use std::collections::HashMap;

use burn::module::Param;
use burn::nn::{Embedding, LayerNorm, Linear};
use burn::prelude::*;

use super::attention::Gpt2Attention;
use super::block::Gpt2Block;
use super::config::Gpt2Config;
use super::error::CheckpointError;
use super::init::layer_norm;
use super::mlp::Gpt2Mlp;
use super::model::Gpt2;

/// The prefix `GPT2LMHeadModel` puts before the backbone's tensor names.
pub const HF_PREFIX: &str = "transformer.";

/// Suffixes of one block's parameters, in the order Burn's module visitor meets them.
const BLOCK_PARAMS: [&str; 12] = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
];

impl Gpt2Config {
    /// Every parameter's HuggingFace name (without [`HF_PREFIX`]) and shape, in the order
    /// Burn's module visitor walks [`Gpt2`]: wte, wpe, each block's (ln_1, attn.c_attn,
    /// attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj; weight before bias), ln_f.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let d = self.n_embd;
        let inner = self.inner_size();
        let mut params = vec![
            ("wte.weight".to_string(), vec![self.vocab_size, d]),
            ("wpe.weight".to_string(), vec![self.n_positions, d]),
        ];
        for layer in 0..self.n_layer {
            let shapes: [Vec<usize>; 12] = [
                vec![d],
                vec![d],
                vec![d, 3 * d],
                vec![3 * d],
                vec![d, d],
                vec![d],
                vec![d],
                vec![d],
                vec![d, inner],
                vec![inner],
                vec![inner, d],
                vec![d],
            ];
            for (suffix, shape) in BLOCK_PARAMS.iter().zip(shapes) {
                params.push((format!("h.{layer}.{suffix}"), shape));
            }
        }
        params.push(("ln_f.weight".to_string(), vec![d]));
        params.push(("ln_f.bias".to_string(), vec![d]));
        params
    }
}

impl<B: Backend> Gpt2<B> {
    /// Every parameter's name as `GPT2LMHeadModel` saves it (`transformer.h.0.attn.c_attn.weight`
    /// ...) with its shape, in the order Burn's module visitor walks the model; the tied LM head
    /// is not listed.
    pub fn param_names(&self) -> Vec<(String, Vec<usize>)> {
        self.hf_tensors()
            .into_iter()
            .map(|(name, tensor)| (format!("{HF_PREFIX}{name}"), tensor.shape.to_vec()))
            .collect()
    }

    /// Every parameter's HuggingFace name (without prefix) and current value, in visitor order.
    pub fn hf_tensors(&self) -> Vec<(String, TensorData)> {
        let mut out = Vec::new();
        out.push(("wte.weight".to_string(), self.wte.weight.val().into_data()));
        out.push(("wpe.weight".to_string(), self.wpe.weight.val().into_data()));
        for (layer, block) in self.blocks.iter().enumerate() {
            out.extend(block_hf_tensors(block, layer));
        }
        layer_norm_hf_tensors(&mut out, "ln_f", &self.ln_f);
        out
    }

    /// Builds a model from tensors keyed by HuggingFace name (without prefix), whose names and
    /// shapes the caller has checked against [`Gpt2Config::param_shapes`]. Tensors are taken out
    /// of the map.
    pub(crate) fn from_hf_tensors(
        config: &Gpt2Config,
        tensors: &mut HashMap<String, TensorData>,
        device: &B::Device,
    ) -> Result<Self, CheckpointError> {
        let mut take = TensorSource { tensors, device };
        let mut model = Gpt2 {
            wte: Embedding {
                weight: take.param("wte.weight")?,
            },
            wpe: Embedding {
                weight: take.param("wpe.weight")?,
            },
            blocks: Vec::with_capacity(config.n_layer),
            ln_f: take.layer_norm("ln_f", config)?,
        };
        for layer in 0..config.n_layer {
            let p = format!("h.{layer}.");
            // Taken in visitor order, so a failure names the first tensor a reader would miss.
            let ln_1 = take.layer_norm(&format!("{p}ln_1"), config)?;
            let attn = Gpt2Attention::from_linears(
                config,
                layer,
                take.linear(&format!("{p}attn.c_attn"))?,
                take.linear(&format!("{p}attn.c_proj"))?,
            );
            let ln_2 = take.layer_norm(&format!("{p}ln_2"), config)?;
            let mlp = Gpt2Mlp::from_linears(
                config,
                take.linear(&format!("{p}mlp.c_fc"))?,
                take.linear(&format!("{p}mlp.c_proj"))?,
            );
            model.blocks.push(Gpt2Block { ln_1, attn, ln_2, mlp });
        }
        Ok(model)
    }
}

fn push_linear<B: Backend>(out: &mut Vec<(String, TensorData)>, name: &str, linear: &Linear<B>) {
    out.push((format!("{name}.weight"), linear.weight.val().into_data()));
    if let Some(bias) = &linear.bias {
        out.push((format!("{name}.bias"), bias.val().into_data()));
    }
}

/// Block `layer`'s parameters by HuggingFace name (without prefix), in visitor order.
pub(crate) fn block_hf_tensors<B: Backend>(block: &Gpt2Block<B>, layer: usize) -> Vec<(String, TensorData)> {
    let prefix = format!("h.{layer}.");
    let mut out = Vec::with_capacity(BLOCK_PARAMS.len());
    layer_norm_hf_tensors(&mut out, &format!("{prefix}ln_1"), &block.ln_1);
    push_linear(&mut out, &format!("{prefix}attn.c_attn"), &block.attn.c_attn);
    push_linear(&mut out, &format!("{prefix}attn.c_proj"), &block.attn.c_proj);
    layer_norm_hf_tensors(&mut out, &format!("{prefix}ln_2"), &block.ln_2);
    push_linear(&mut out, &format!("{prefix}mlp.c_fc"), &block.mlp.c_fc);
    push_linear(&mut out, &format!("{prefix}mlp.c_proj"), &block.mlp.c_proj);
    out
}

pub(crate) fn layer_norm_hf_tensors<B: Backend>(out: &mut Vec<(String, TensorData)>, name: &str, norm: &LayerNorm<B>) {
    out.push((format!("{name}.weight"), norm.gamma.val().into_data()));
    if let Some(beta) = &norm.beta {
        out.push((format!("{name}.bias"), beta.val().into_data()));
    }
}

/// Hands out parameters from a map of checked tensors.
struct TensorSource<'a, B: Backend> {
    tensors: &'a mut HashMap<String, TensorData>,
    device: &'a B::Device,
}

impl<B: Backend> TensorSource<'_, B> {
    fn param<const D: usize>(&mut self, name: &str) -> Result<Param<Tensor<B, D>>, CheckpointError> {
        let data = self.tensors.remove(name).ok_or_else(|| CheckpointError::TensorData {
            key: name.to_string(),
            reason: "not among the loaded tensors".to_string(),
        })?;
        if data.shape.len() != D {
            return Err(CheckpointError::TensorData {
                key: name.to_string(),
                reason: format!("rank {} where {D} is needed", data.shape.len()),
            });
        }
        Ok(Param::from_tensor(Tensor::from_data(data, self.device)))
    }

    fn linear(&mut self, name: &str) -> Result<Linear<B>, CheckpointError> {
        Ok(Linear {
            weight: self.param(&format!("{name}.weight"))?,
            bias: Some(self.param(&format!("{name}.bias"))?),
        })
    }

    fn layer_norm(&mut self, name: &str, config: &Gpt2Config) -> Result<LayerNorm<B>, CheckpointError> {
        // LayerNorm's epsilon is private to Burn: build one from its config, then set the weights.
        let mut norm = layer_norm(config.n_embd, config.layer_norm_epsilon, self.device);
        norm.gamma = self.param(&format!("{name}.weight"))?;
        norm.beta = Some(self.param(&format!("{name}.bias"))?);
        Ok(norm)
    }
}
