//! The mapping between the model's parameters and HuggingFace's tensor names and layouts.
//!
//! PyTorch's `nn.Linear` stores its weight as `[out, in]`, Burn's `Linear` as `[in, out]`: every
//! linear weight is transposed on the way in and out. Embeddings (`[vocab, hidden]`) and the
//! RMSNorms' `weight` (Burn's `gamma`) map over unchanged.

use std::collections::HashMap;

use burn::module::Param;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::*;

use super::attention::LlamaAttention;
use super::block::LlamaDecoderLayer;
use super::config::LlamaConfig;
use super::mlp::LlamaMlp;
use super::model::Llama;
use crate::hf::CheckpointError;

/// The token embedding's name.
pub(crate) const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// The final norm's name.
pub(crate) const NORM: &str = "model.norm.weight";
/// The untied LM head's name.
pub(crate) const LM_HEAD: &str = "lm_head.weight";

impl LlamaConfig {
    /// Every parameter's HuggingFace name and shape (PyTorch's layout: linears `[out, in]`) in
    /// the order Burn's module visitor walks [`Llama`]: the embedding, each layer's
    /// (input_layernorm, q/k/v/o projections with their biases, Qwen3's q_norm and k_norm,
    /// post_attention_layernorm, gate/up/down projections), the final norm, and `lm_head` when
    /// untied.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let mut params = vec![(EMBED_TOKENS.to_string(), vec![self.vocab_size, h])];
        for layer in 0..self.num_hidden_layers {
            params.extend(self.layer_param_shapes(layer));
        }
        params.push((NORM.to_string(), vec![h]));
        if !self.tie_word_embeddings {
            params.push((LM_HEAD.to_string(), vec![self.vocab_size, h]));
        }
        params
    }

    /// Layer `layer`'s parameters as [`param_shapes`](Self::param_shapes) lists them.
    pub(crate) fn layer_param_shapes(&self, layer: usize) -> Vec<(String, Vec<usize>)> {
        let (h, d, i) = (self.hidden_size, self.head_dim, self.intermediate_size);
        let q = self.num_attention_heads * d;
        let kv = self.num_key_value_heads * d;
        let p = format!("model.layers.{layer}.");
        let mut out = vec![(format!("{p}input_layernorm.weight"), vec![h])];
        let mut linear = |name: &str, d_in: usize, d_out: usize, bias: bool| {
            out.push((format!("{p}{name}.weight"), vec![d_out, d_in]));
            if bias {
                out.push((format!("{p}{name}.bias"), vec![d_out]));
            }
        };
        linear("self_attn.q_proj", h, q, self.qkv_bias());
        linear("self_attn.k_proj", h, kv, self.qkv_bias());
        linear("self_attn.v_proj", h, kv, self.qkv_bias());
        linear("self_attn.o_proj", q, h, self.o_bias());
        if self.qk_norm() {
            out.push((format!("{p}self_attn.q_norm.weight"), vec![d]));
            out.push((format!("{p}self_attn.k_norm.weight"), vec![d]));
        }
        out.push((format!("{p}post_attention_layernorm.weight"), vec![h]));
        let bias = self.mlp_has_bias();
        for (name, d_in, d_out) in [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)] {
            out.push((format!("{p}mlp.{name}.weight"), vec![d_out, d_in]));
            if bias {
                out.push((format!("{p}mlp.{name}.bias"), vec![d_out]));
            }
        }
        out
    }
}

impl<B: Backend> Llama<B> {
    /// Every parameter's name as transformers saves it (`model.layers.0.self_attn.q_proj.weight`
    /// ...) with its shape in PyTorch's layout, in the order Burn's module visitor walks the
    /// model; a tied LM head is not listed.
    pub fn param_names(&self) -> Vec<(String, Vec<usize>)> {
        self.hf_tensors()
            .into_iter()
            .map(|(name, tensor)| (name, tensor.shape.to_vec()))
            .collect()
    }

    /// Every parameter's HuggingFace name and current value in PyTorch's layout, in visitor
    /// order.
    pub fn hf_tensors(&self) -> Vec<(String, TensorData)> {
        let mut out = vec![(EMBED_TOKENS.to_string(), host(self.embed_tokens.weight.val()))];
        for (layer, block) in self.layers.iter().enumerate() {
            out.extend(layer_hf_tensors(block, layer));
        }
        out.push((NORM.to_string(), host(self.norm.gamma.val())));
        if let Some(head) = &self.lm_head {
            out.push((LM_HEAD.to_string(), host(head.weight.val().transpose())));
        }
        out
    }

    /// Builds a model from tensors keyed by HuggingFace name in PyTorch's layout, whose names
    /// and shapes the caller has checked against [`LlamaConfig::param_shapes`]. Tensors are
    /// taken out of the map.
    pub(crate) fn from_hf_tensors(
        config: &LlamaConfig,
        tensors: &mut HashMap<String, TensorData>,
        device: &B::Device,
    ) -> Result<Self, CheckpointError> {
        let mut take = |name: &str| {
            tensors.remove(name).ok_or_else(|| CheckpointError::TensorData {
                key: name.to_string(),
                reason: "not among the loaded tensors".to_string(),
            })
        };
        let embed_tokens = embedding(take(EMBED_TOKENS)?, device);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for layer in 0..config.num_hidden_layers {
            layers.push(layer_from_hf(config, layer, &mut take, device)?);
        }
        let norm = norm(config, take(NORM)?, device);
        let lm_head = match config.tie_word_embeddings {
            true => None,
            false => Some(linear(LM_HEAD, take(LM_HEAD)?, None, device)?),
        };
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}

/// Layer `layer` built from tensors handed out by `take` (HuggingFace name → PyTorch-layout
/// data), in visitor order, so that a failure names the first tensor a reader would miss.
pub(crate) fn layer_from_hf<B: Backend>(
    config: &LlamaConfig,
    layer: usize,
    take: &mut impl FnMut(&str) -> Result<TensorData, CheckpointError>,
    device: &B::Device,
) -> Result<LlamaDecoderLayer<B>, CheckpointError> {
    let p = format!("model.layers.{layer}.");
    let input_layernorm = norm(config, take(&format!("{p}input_layernorm.weight"))?, device);
    let qkv_bias = config.qkv_bias();
    let projections = [
        take_linear(take, &format!("{p}self_attn.q_proj"), qkv_bias, device)?,
        take_linear(take, &format!("{p}self_attn.k_proj"), qkv_bias, device)?,
        take_linear(take, &format!("{p}self_attn.v_proj"), qkv_bias, device)?,
        take_linear(take, &format!("{p}self_attn.o_proj"), config.o_bias(), device)?,
    ];
    let norms = if config.qk_norm() {
        let q = norm(config, take(&format!("{p}self_attn.q_norm.weight"))?, device);
        let k = norm(config, take(&format!("{p}self_attn.k_norm.weight"))?, device);
        Some([q, k])
    } else {
        None
    };
    let post_attention_layernorm = norm(config, take(&format!("{p}post_attention_layernorm.weight"))?, device);
    let bias = config.mlp_has_bias();
    let mlp = LlamaMlp {
        gate_proj: take_linear(take, &format!("{p}mlp.gate_proj"), bias, device)?,
        up_proj: take_linear(take, &format!("{p}mlp.up_proj"), bias, device)?,
        down_proj: take_linear(take, &format!("{p}mlp.down_proj"), bias, device)?,
    };
    Ok(LlamaDecoderLayer {
        input_layernorm,
        self_attn: LlamaAttention::from_parts(config, projections, norms),
        post_attention_layernorm,
        mlp,
    })
}

fn take_linear<B: Backend>(
    take: &mut impl FnMut(&str) -> Result<TensorData, CheckpointError>,
    name: &str,
    bias: bool,
    device: &B::Device,
) -> Result<Linear<B>, CheckpointError> {
    let weight = take(&format!("{name}.weight"))?;
    let bias = if bias {
        Some(take(&format!("{name}.bias"))?)
    } else {
        None
    };
    linear(name, weight, bias, device)
}

/// Layer `layer`'s parameters by HuggingFace name, in PyTorch's layout and visitor order.
pub(crate) fn layer_hf_tensors<B: Backend>(block: &LlamaDecoderLayer<B>, layer: usize) -> Vec<(String, TensorData)> {
    let p = format!("model.layers.{layer}.");
    let mut out = vec![(
        format!("{p}input_layernorm.weight"),
        host(block.input_layernorm.gamma.val()),
    )];
    let attn = &block.self_attn;
    for (name, linear) in [
        ("self_attn.q_proj", &attn.q_proj),
        ("self_attn.k_proj", &attn.k_proj),
        ("self_attn.v_proj", &attn.v_proj),
        ("self_attn.o_proj", &attn.o_proj),
    ] {
        push_linear(&mut out, &format!("{p}{name}"), linear);
    }
    for (name, norm) in [("self_attn.q_norm", &attn.q_norm), ("self_attn.k_norm", &attn.k_norm)] {
        if let Some(norm) = norm {
            out.push((format!("{p}{name}.weight"), host(norm.gamma.val())));
        }
    }
    out.push((
        format!("{p}post_attention_layernorm.weight"),
        host(block.post_attention_layernorm.gamma.val()),
    ));
    let mlp = &block.mlp;
    for (name, linear) in [
        ("mlp.gate_proj", &mlp.gate_proj),
        ("mlp.up_proj", &mlp.up_proj),
        ("mlp.down_proj", &mlp.down_proj),
    ] {
        push_linear(&mut out, &format!("{p}{name}"), linear);
    }
    out
}

fn push_linear<B: Backend>(out: &mut Vec<(String, TensorData)>, name: &str, linear: &Linear<B>) {
    out.push((format!("{name}.weight"), host(linear.weight.val().transpose())));
    if let Some(bias) = &linear.bias {
        out.push((format!("{name}.bias"), host(bias.val())));
    }
}

/// A parameter's values as f32 host data (a 16-bit model's widened), what a checkpoint stores.
pub(crate) fn host<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> TensorData {
    tensor.into_data().convert::<f32>()
}

/// The f32 data of the 2-D tensor `name` transposed (`[rows, cols]` → `[cols, rows]`), on the
/// host.
fn transposed(name: &str, data: TensorData) -> Result<TensorData, CheckpointError> {
    let [rows, cols] = [data.shape[0], data.shape[1]];
    let values = data.into_vec::<f32>().map_err(|e| CheckpointError::TensorData {
        key: name.to_string(),
        reason: format!("{e:?}"),
    })?;
    let mut out = vec![0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    Ok(TensorData::new(out, [cols, rows]))
}

/// The linear layer `name` from PyTorch-layout f32 data: weight `[out, in]` (transposed to
/// Burn's `[in, out]`) and bias `[out]`.
pub(crate) fn linear<B: Backend>(
    name: &str,
    weight: TensorData,
    bias: Option<TensorData>,
    device: &B::Device,
) -> Result<Linear<B>, CheckpointError> {
    Ok(Linear {
        weight: Param::from_tensor(Tensor::from_data(transposed(name, weight)?, device)),
        bias: bias.map(|b| Param::from_tensor(Tensor::from_data(b, device))),
    })
}

pub(crate) fn embedding<B: Backend>(weight: TensorData, device: &B::Device) -> Embedding<B> {
    Embedding {
        weight: Param::from_tensor(Tensor::from_data(weight, device)),
    }
}

/// An RMSNorm with the config's epsilon and the given scale.
pub(crate) fn norm<B: Backend>(config: &LlamaConfig, weight: TensorData, device: &B::Device) -> RmsNorm<B> {
    RmsNorm {
        gamma: Param::from_tensor(Tensor::from_data(weight, device)),
        epsilon: config.rms_norm_eps,
    }
}
