//! Rotary position embeddings (Su et al., 2021) as transformers applies them to the Llama
//! family: `x · cos + rotate_half(x) · sin`, the angles `position × inv_freq` in f32; and the
//! rotary keys of `config.json` (`rope_theta`, `rope_scaling` or `rope_parameters`) they come
//! from.

use burn::prelude::*;
use burn::tensor::DType;
use serde_json::{Map, Value};

use super::config::{as_f64, as_usize, invalid, Keys, LlamaConfig};
use super::error::LlamaConfigError;

/// transformers' `rope_theta` when a file gives none.
const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// The rotary embedding of one attention layer: its inverse frequencies (`head_dim / 2`, from
/// [`super::LlamaConfig::rope_inv_freq`]). Positions are `0..seq` of the sequence attended over.
#[derive(Debug, Clone, PartialEq)]
pub struct RotaryEmbedding {
    /// `1 / theta^(2i / head_dim)`, rescaled for `rope_type: "llama3"`.
    pub inv_freq: Vec<f32>,
}

impl RotaryEmbedding {
    /// `cos` and `sin` of every position's angles, `[seq, head_dim]` each (the `head_dim / 2`
    /// angles twice over, as transformers concatenates them), in `dtype`. Computed in f32 on the
    /// device, whatever the model's dtype, as transformers does.
    pub fn cos_sin<B: Backend>(&self, seq: usize, dtype: DType, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let half = self.inv_freq.len();
        let positions: Vec<f32> = (0..seq).map(|p| p as f32).collect();
        let positions = Tensor::<B, 2>::from_data(TensorData::new(positions, [seq, 1]), (device, DType::F32));
        let inv_freq =
            Tensor::<B, 2>::from_data(TensorData::new(self.inv_freq.clone(), [1, half]), (device, DType::F32));
        let angles = positions.mul(inv_freq);
        let angles = Tensor::cat(vec![angles.clone(), angles], 1);
        (angles.clone().cos().cast(dtype), angles.sin().cast(dtype))
    }
}

/// `x · cos + rotate_half(x) · sin` for `x` `[batch, heads, seq, head_dim]` and `cos`, `sin`
/// `[seq, head_dim]`; `rotate_half` maps the halves `(x1, x2)` of the last axis to `(-x2, x1)`.
pub fn apply_rotary<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 2>, sin: &Tensor<B, 2>) -> Tensor<B, 4> {
    let [_, _, _, head_dim] = x.dims();
    let half = head_dim / 2;
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone().unsqueeze::<4>() + rotated * sin.clone().unsqueeze::<4>()
}

/// Llama 3.1's rescaling of the rotary frequencies (`rope_type: "llama3"`): wavelengths longer
/// than `original_max_position_embeddings / low_freq_factor` are stretched by `factor`, those
/// shorter than `original_max_position_embeddings / high_freq_factor` kept, those between
/// interpolated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// The stretch of the low frequencies (8 for Llama 3.1, 32 for Llama 3.2).
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are stretched.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length of pre-training (8192 for Llama 3).
    pub original_max_position_embeddings: usize,
}

impl LlamaConfig {
    /// The rotary embedding's inverse frequencies, `head_dim / 2` of them, computed in f32 as
    /// transformers computes them (`1 / theta^(2i / head_dim)`, then Llama 3's rescaling).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim;
        let base = self.rope_theta as f32;
        let inv_freq = (0..dim).step_by(2).map(|i| 1.0 / base.powf(i as f32 / dim as f32));
        match &self.rope_scaling {
            None => inv_freq.collect(),
            Some(s) => inv_freq.map(|f| llama3_scaled(s, f)).collect(),
        }
    }
}

/// One inverse frequency rescaled as transformers' `_compute_llama3_parameters` does.
fn llama3_scaled(s: &Llama3RopeScaling, inv_freq: f32) -> f32 {
    let old_context = s.original_max_position_embeddings as f64;
    let low_freq_wavelen = old_context / s.low_freq_factor;
    let high_freq_wavelen = old_context / s.high_freq_factor;
    let f = f64::from(inv_freq);
    let wavelen = 2.0 * std::f64::consts::PI / f;
    let scaled = if wavelen > low_freq_wavelen { f / s.factor } else { f };
    if wavelen < high_freq_wavelen || wavelen > low_freq_wavelen {
        return scaled as f32;
    }
    let smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    ((1.0 - smooth) * scaled / s.factor + smooth * scaled) as f32
}

pub(super) fn check_llama3(s: &Llama3RopeScaling) -> Result<(), LlamaConfigError> {
    let positive_finite = |v: f64| v.is_finite() && v > 0.0;
    for (key, value) in [
        ("rope_scaling.factor", s.factor),
        ("rope_scaling.low_freq_factor", s.low_freq_factor),
        ("rope_scaling.high_freq_factor", s.high_freq_factor),
    ] {
        if !positive_finite(value) {
            return Err(invalid(key, &Value::from(value), "a positive number"));
        }
    }
    if s.high_freq_factor <= s.low_freq_factor {
        return Err(invalid(
            "rope_scaling.high_freq_factor",
            &Value::from(s.high_freq_factor),
            &format!("more than low_freq_factor = {}", s.low_freq_factor),
        ));
    }
    if s.original_max_position_embeddings == 0 {
        return Err(invalid(
            "rope_scaling.original_max_position_embeddings",
            &Value::from(0),
            "a positive integer",
        ));
    }
    Ok(())
}

/// Reads the rotary parameters as transformers 5 standardizes them: the dict is `rope_scaling`
/// (older files) or else `rope_parameters`; its type is `rope_type` (or the older `type`),
/// `"default"` when absent; `rope_theta` comes from the dict, else the top-level key, else
/// 10000. Refuses every type but `default` and `llama3`, and a partial rotary factor.
pub(super) fn read_rope(
    keys: &mut Keys,
    max_position_embeddings: usize,
) -> Result<(f64, Option<Llama3RopeScaling>), LlamaConfigError> {
    let scaling = keys.take("rope_scaling");
    let parameters = keys.take("rope_parameters");
    let top_theta = keys.take("rope_theta");
    let top_partial = keys.take("partial_rotary_factor");
    let top_original = keys.map.get("original_max_position_embeddings").cloned();
    let (dict_key, dict) = match (scaling, parameters) {
        (Some(v), _) => ("rope_scaling", Some(v)),
        (None, Some(v)) => ("rope_parameters", Some(v)),
        (None, None) => ("rope_scaling", None),
    };
    let dict = match dict {
        None => Map::new(),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(invalid(
                dict_key,
                &other,
                "an object such as {\"rope_type\": \"llama3\", ...}",
            ))
        }
    };
    if let Some((layer_type, _)) = dict.iter().find(|(_, v)| v.is_object()) {
        return Err(LlamaConfigError::Invalid {
            key: format!("{dict_key}.{layer_type}"),
            value: "an object".to_string(),
            valid: "one set of rope parameters for every layer (per-layer-type parameters are not supported)"
                .to_string(),
        });
    }
    let field = |name: &str| format!("{dict_key}.{name}");
    let (type_key, rope_type) = match (dict.get("rope_type"), dict.get("type")) {
        (Some(v), _) => (field("rope_type"), Some(v)),
        (None, Some(v)) => (field("type"), Some(v)),
        (None, None) => (field("rope_type"), None),
    };
    let rope_type = match rope_type {
        None | Some(Value::Null) => "default".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(invalid(&type_key, other, "a string: \"default\" or \"llama3\"")),
    };
    let theta = match dict.get("rope_theta").filter(|v| !v.is_null()) {
        Some(v) => as_f64(&field("rope_theta"), v)?,
        None => top_theta
            .map(|v| as_f64("rope_theta", &v))
            .transpose()?
            .unwrap_or(DEFAULT_ROPE_THETA),
    };
    let partial = match dict.get("partial_rotary_factor").filter(|v| !v.is_null()) {
        Some(v) => Some((field("partial_rotary_factor"), v.clone())),
        None => top_partial.map(|v| ("partial_rotary_factor".to_string(), v)),
    };
    if let Some((key, value)) = partial {
        if as_f64(&key, &value)? != 1.0 {
            return Err(invalid(
                &key,
                &value,
                "1.0 (the rotary embedding turns every feature of a head)",
            ));
        }
    }
    match rope_type.as_str() {
        "default" => Ok((theta, None)),
        "llama3" => {
            let required = |name: &str| -> Result<f64, LlamaConfigError> {
                match dict.get(name).filter(|v| !v.is_null()) {
                    Some(v) => as_f64(&field(name), v),
                    None => Err(LlamaConfigError::Invalid {
                        key: field(name),
                        value: "missing".to_string(),
                        valid: "a number, required by rope_type \"llama3\"".to_string(),
                    }),
                }
            };
            let original_key = field("original_max_position_embeddings");
            let original = match dict.get("original_max_position_embeddings").filter(|v| !v.is_null()) {
                Some(v) => as_usize(&original_key, v)?,
                None => match top_original.filter(|v| !v.is_null()) {
                    Some(v) => as_usize("original_max_position_embeddings", &v)?,
                    None => max_position_embeddings,
                },
            };
            let scaling = Llama3RopeScaling {
                factor: required("factor")?,
                low_freq_factor: required("low_freq_factor")?,
                high_freq_factor: required("high_freq_factor")?,
                original_max_position_embeddings: original,
            };
            Ok((theta, Some(scaling)))
        }
        other => Err(LlamaConfigError::UnsupportedRope {
            key: type_key,
            value: other.to_string(),
        }),
    }
}
