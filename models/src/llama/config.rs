//! The Llama family's hyper-parameters, read from and written to HuggingFace's `config.json`.
//!
//! One configuration covers Llama 3.x, Qwen2/Qwen2.5, Qwen3 and Mistral: `model_type` picks the
//! family, whose transformers defaults fill the keys a file leaves out and whose fixed choices
//! (Qwen2's q/k/v bias, Qwen3's q/k norm) the model follows.

use serde_json::{Map, Value};

use super::error::LlamaConfigError;
use super::rope::Llama3RopeScaling;
use super::rope::{check_llama3, read_rope};

/// The `model_type` values [`LlamaConfig::from_json_str`] accepts.
pub const SUPPORTED_MODEL_TYPES: [&str; 4] = ["llama", "qwen2", "qwen3", "mistral"];

/// Which of transformers' classes the configuration describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2, 3.3): biases per `attention_bias` and
    /// `mlp_bias`.
    Llama,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on the q/k/v projections, none elsewhere.
    Qwen2,
    /// `Qwen3ForCausalLM`: an RMSNorm over each head of the queries and keys, biases per
    /// `attention_bias`, `head_dim` 128 unless given.
    Qwen3,
    /// `MistralForCausalLM`: no biases; a sliding window (see [`LlamaConfig::attention_window`]).
    Mistral,
}

impl LlamaFamily {
    /// The family of a `model_type`, if it is one of [`SUPPORTED_MODEL_TYPES`].
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "mistral" => Some(Self::Mistral),
            _ => None,
        }
    }

    /// HuggingFace's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Mistral => "mistral",
        }
    }

    /// The transformers class `config.json`'s `architectures` names.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Mistral => "MistralForCausalLM",
        }
    }

    /// Whether the family reads the sliding-window keys (`sliding_window`, and for Qwen
    /// `use_sliding_window` and `max_window_layers`).
    fn has_sliding_window(self) -> bool {
        !matches!(self, Self::Llama)
    }
}

/// The hyper-parameters of a Llama-family decoder, with HuggingFace's key names.
///
/// [`from_json_str`](Self::from_json_str) reads a `config.json` the way transformers does
/// (the family's defaults for missing keys; the rotary parameters from `rope_scaling` or
/// `rope_parameters`, and `rope_theta`); keys this implementation does not model (token ids,
/// `dtype`, ...) are kept in [`extra`](Self::extra) so that a load and a save lose nothing.
///
/// ```
/// use zero_models::llama::{LlamaConfig, LlamaFamily};
///
/// let config = LlamaConfig::from_json_str(
///     r#"{"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
///         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
/// )
/// .unwrap();
/// assert_eq!(config.family, LlamaFamily::Qwen3);
/// assert_eq!(config.head_dim, 128); // Qwen3's default, not hidden / heads
/// assert!(LlamaConfig::from_json_str(r#"{"model_type": "bert"}"#)
///     .unwrap_err()
///     .to_string()
///     .contains("model_type = \"bert\""));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// The architecture (`model_type`).
    pub family: LlamaFamily,
    /// Rows of the token embedding, columns of the logits.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Inner size of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Size of one head: `head_dim` when the file gives it, else the family's default
    /// (`hidden_size / num_attention_heads`; 128 for Qwen3).
    pub head_dim: usize,
    /// The context length the model was trained for. Carried (and used as the default of
    /// `original_max_position_embeddings`); the model does not refuse longer sequences.
    pub max_position_embeddings: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// The rotary embedding's base.
    pub rope_theta: f64,
    /// Llama 3's rescaling of the rotary frequencies, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Biases on the attention projections (Llama and Qwen3: q, k, v and o; read but unused by
    /// Qwen2, whose q/k/v always have one and o none, and by Mistral, which has none).
    pub attention_bias: bool,
    /// Biases on the MLP's projections (Llama only).
    pub mlp_bias: bool,
    /// Whether the LM head is the token embedding.
    pub tie_word_embeddings: bool,
    /// The MLP's activation; only `"silu"` (SwiGLU) is accepted.
    pub hidden_act: String,
    /// Standard deviation of the normal initialization of weights.
    pub initializer_range: f64,
    /// `sliding_window` as the file gives it (Mistral and Qwen; `None` for Llama, which has
    /// none). What the attention does with it: [`attention_window`](Self::attention_window).
    pub sliding_window: Option<usize>,
    /// Qwen's switch for the sliding window (off by default; `false` for the other families).
    pub use_sliding_window: bool,
    /// Qwen's first layer with a sliding window, when it is switched on.
    pub max_window_layers: usize,
    /// Every other key of `config.json`, kept verbatim.
    pub extra: Map<String, Value>,
}

/// The defaults transformers' config class of each family gives a key a file leaves out.
struct Defaults {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    sliding_window: Option<usize>,
}

fn defaults(family: LlamaFamily) -> Defaults {
    match family {
        LlamaFamily::Llama => Defaults {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 11008,
            num_key_value_heads: None,
            head_dim: None,
            max_position_embeddings: 2048,
            sliding_window: None,
        },
        LlamaFamily::Qwen2 | LlamaFamily::Qwen3 => Defaults {
            vocab_size: 151936,
            hidden_size: 4096,
            intermediate_size: 22016,
            num_key_value_heads: Some(32),
            head_dim: (family == LlamaFamily::Qwen3).then_some(128),
            max_position_embeddings: 32768,
            sliding_window: Some(4096),
        },
        LlamaFamily::Mistral => Defaults {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_key_value_heads: Some(8),
            head_dim: None,
            max_position_embeddings: 4096 * 32,
            sliding_window: Some(4096),
        },
    }
}

/// Qwen's `max_window_layers` when a file gives none (also what the other families carry).
pub(crate) const DEFAULT_MAX_WINDOW_LAYERS: usize = 28;

/// Takes typed values out of a `config.json` object, naming the key in every error.
pub(super) struct Keys {
    pub(super) map: Map<String, Value>,
}

pub(super) fn invalid(key: &str, value: &Value, valid: &str) -> LlamaConfigError {
    LlamaConfigError::Invalid {
        key: key.to_string(),
        value: value.to_string(),
        valid: valid.to_string(),
    }
}

pub(super) fn as_usize(key: &str, value: &Value) -> Result<usize, LlamaConfigError> {
    value
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| invalid(key, value, "a non-negative integer"))
}

pub(super) fn as_f64(key: &str, value: &Value) -> Result<f64, LlamaConfigError> {
    value.as_f64().ok_or_else(|| invalid(key, value, "a number"))
}

impl Keys {
    /// The value of `key`, taken out; `None` when missing or `null`.
    pub(super) fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key).filter(|v| !v.is_null())
    }

    fn usize_or(&mut self, key: &str, default: usize) -> Result<usize, LlamaConfigError> {
        self.take(key).map_or(Ok(default), |v| as_usize(key, &v))
    }

    fn opt_usize(&mut self, key: &str) -> Result<Option<usize>, LlamaConfigError> {
        self.take(key).map(|v| as_usize(key, &v)).transpose()
    }

    fn f64_or(&mut self, key: &str, default: f64) -> Result<f64, LlamaConfigError> {
        self.take(key).map_or(Ok(default), |v| as_f64(key, &v))
    }

    fn bool_or(&mut self, key: &str, default: bool) -> Result<bool, LlamaConfigError> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| invalid(key, &v, "true or false")),
        }
    }
}

impl LlamaConfig {
    /// Parses a HuggingFace `config.json` of one of [`SUPPORTED_MODEL_TYPES`] and validates it.
    ///
    /// The errors name the key and what is valid; [`crate::llama::Llama::load_pretrained`]
    /// adds the file.
    pub fn from_json_str(json: &str) -> Result<Self, LlamaConfigError> {
        let value: Value = serde_json::from_str(json).map_err(LlamaConfigError::Json)?;
        let Value::Object(map) = value else {
            return Err(invalid("config.json", &value, "a JSON object"));
        };
        Self::from_json_map(map)
    }

    /// [`from_json_str`](Self::from_json_str) on a parsed object.
    pub fn from_json_map(map: Map<String, Value>) -> Result<Self, LlamaConfigError> {
        let mut keys = Keys { map };
        let model_type = keys.take("model_type");
        let family = model_type
            .as_ref()
            .and_then(Value::as_str)
            .and_then(LlamaFamily::from_model_type)
            .ok_or_else(|| LlamaConfigError::UnsupportedModelType {
                found: model_type.map_or("null".to_string(), |v| v.to_string()),
            })?;
        let d = defaults(family);
        let vocab_size = keys.usize_or("vocab_size", d.vocab_size)?;
        let hidden_size = keys.usize_or("hidden_size", d.hidden_size)?;
        let intermediate_size = keys.usize_or("intermediate_size", d.intermediate_size)?;
        let num_hidden_layers = keys.usize_or("num_hidden_layers", 32)?;
        let num_attention_heads = keys.usize_or("num_attention_heads", 32)?;
        if num_attention_heads == 0 {
            return Err(invalid("num_attention_heads", &Value::from(0), "a positive integer"));
        }
        let num_key_value_heads = keys
            .opt_usize("num_key_value_heads")?
            .or(d.num_key_value_heads)
            .unwrap_or(num_attention_heads);
        let given_head_dim = keys.opt_usize("head_dim")?;
        let head_dim = match given_head_dim.or(d.head_dim) {
            Some(head_dim) => head_dim,
            None => {
                // `is_multiple_of` is newer than the workspace's rust-version (1.85).
                #[allow(clippy::manual_is_multiple_of)]
                let divides = hidden_size % num_attention_heads == 0;
                if !divides {
                    return Err(invalid(
                        "hidden_size",
                        &Value::from(hidden_size),
                        &format!(
                            "a multiple of num_attention_heads = {num_attention_heads} when head_dim is not given"
                        ),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        let max_position_embeddings = keys.usize_or("max_position_embeddings", d.max_position_embeddings)?;
        let rms_norm_eps = keys.f64_or("rms_norm_eps", 1e-6)?;
        let (rope_theta, rope_scaling) = read_rope(&mut keys, max_position_embeddings)?;
        let attention_bias = keys.bool_or("attention_bias", false)?;
        let mlp_bias = keys.bool_or("mlp_bias", false)?;
        let tie_word_embeddings = keys.bool_or("tie_word_embeddings", false)?;
        let hidden_act = match keys.take("hidden_act") {
            None => "silu".to_string(),
            Some(Value::String(s)) => s,
            Some(other) => return Err(invalid("hidden_act", &other, "the string \"silu\"")),
        };
        let initializer_range = keys.f64_or("initializer_range", 0.02)?;
        let (sliding_window, use_sliding_window, max_window_layers) = if family.has_sliding_window() {
            // A `null` window is no window, not the default.
            let window = match keys.map.remove("sliding_window") {
                None => d.sliding_window,
                Some(Value::Null) => None,
                Some(v) => Some(as_usize("sliding_window", &v)?),
            };
            let qwen = matches!(family, LlamaFamily::Qwen2 | LlamaFamily::Qwen3);
            let (use_window, first_layer) = if qwen {
                (
                    keys.bool_or("use_sliding_window", false)?,
                    keys.usize_or("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)?,
                )
            } else {
                (false, DEFAULT_MAX_WINDOW_LAYERS)
            };
            (window, use_window, first_layer)
        } else {
            (None, false, DEFAULT_MAX_WINDOW_LAYERS)
        };
        let config = Self {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            attention_bias,
            mlp_bias,
            tie_word_embeddings,
            hidden_act,
            initializer_range,
            sliding_window,
            use_sliding_window,
            max_window_layers,
            extra: keys.map,
        };
        config.validate()?;
        Ok(config)
    }

    /// Serializes to HuggingFace's `config.json` layout: [`extra`](Self::extra), then every
    /// modelled key (the rotary parameters as `rope_theta` and `rope_scaling`, which
    /// transformers 4 and 5 both read), and `architectures` when missing.
    pub fn to_json_value(&self) -> Value {
        let mut map = self.extra.clone();
        let mut put = |key: &str, value: Value| {
            map.insert(key.to_string(), value);
        };
        put("model_type", self.family.model_type().into());
        put("vocab_size", self.vocab_size.into());
        put("hidden_size", self.hidden_size.into());
        put("intermediate_size", self.intermediate_size.into());
        put("num_hidden_layers", self.num_hidden_layers.into());
        put("num_attention_heads", self.num_attention_heads.into());
        put("num_key_value_heads", self.num_key_value_heads.into());
        put("head_dim", self.head_dim.into());
        put("max_position_embeddings", self.max_position_embeddings.into());
        put("rms_norm_eps", self.rms_norm_eps.into());
        put("rope_theta", self.rope_theta.into());
        let scaling = match &self.rope_scaling {
            None => Value::Null,
            Some(s) => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
        };
        put("rope_scaling", scaling);
        put("attention_bias", self.attention_bias.into());
        put("mlp_bias", self.mlp_bias.into());
        put("tie_word_embeddings", self.tie_word_embeddings.into());
        put("hidden_act", self.hidden_act.clone().into());
        put("initializer_range", self.initializer_range.into());
        if self.family.has_sliding_window() {
            put("sliding_window", self.sliding_window.map_or(Value::Null, Value::from));
            if matches!(self.family, LlamaFamily::Qwen2 | LlamaFamily::Qwen3) {
                put("use_sliding_window", self.use_sliding_window.into());
                put("max_window_layers", self.max_window_layers.into());
            }
        }
        map.entry("architectures")
            .or_insert_with(|| serde_json::json!([self.family.architecture()]));
        Value::Object(map)
    }

    /// What a checkpoint of this model records ([`zero_burn::EngineSettings::model`], through
    /// `zero_burn::InitOptions::model`) so that `zero to-fp32` exports it as a HuggingFace
    /// directory: the `llama-hf` naming (HuggingFace's names for the parameters of
    /// [`super::Llama`] and [`super::ShardedLlama`], the linear weights transposed to PyTorch's
    /// `[out, in]`), and this `config.json` ([`to_json_value`](Self::to_json_value): its
    /// `model_type`, and `architectures` naming the family's transformers class).
    pub fn model_record(&self) -> zero_core::checkpoint::ModelRecord {
        zero_core::checkpoint::ModelRecord {
            naming: zero_core::checkpoint::LLAMA_HF_NAMING.to_string(),
            config: self.to_json_value(),
        }
    }

    /// [`to_json_value`](Self::to_json_value) as pretty-printed text.
    pub fn to_json_string(&self) -> String {
        // A `Value` always serializes.
        serde_json::to_string_pretty(&self.to_json_value()).unwrap_or_default()
    }

    /// Checks the sizes are consistent and every option is one this implementation computes
    /// exactly as transformers does.
    pub fn validate(&self) -> Result<(), LlamaConfigError> {
        let params = self.params_u128();
        if params > super::presets::MAX_PARAMS {
            return Err(LlamaConfigError::TooLarge { params });
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(invalid(key, &Value::from(0), "a positive integer"));
            }
        }
        #[allow(clippy::manual_is_multiple_of)]
        let groups_divide = self.num_attention_heads % self.num_key_value_heads == 0;
        if !groups_divide {
            return Err(invalid(
                "num_key_value_heads",
                &Value::from(self.num_key_value_heads),
                &format!("a divisor of num_attention_heads = {}", self.num_attention_heads),
            ));
        }
        #[allow(clippy::manual_is_multiple_of)]
        let even = self.head_dim % 2 == 0;
        if !even {
            return Err(invalid(
                "head_dim",
                &Value::from(self.head_dim),
                "an even number (the rotary embedding turns pairs of features)",
            ));
        }
        let positive_finite = |v: f64| v.is_finite() && v > 0.0;
        for (key, value) in [("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)] {
            if !positive_finite(value) {
                return Err(invalid(key, &Value::from(value), "a positive number"));
            }
        }
        if let Some(s) = &self.rope_scaling {
            check_llama3(s)?;
        }
        if self.hidden_act != "silu" {
            return Err(LlamaConfigError::UnsupportedActivation(self.hidden_act.clone()));
        }
        Ok(())
    }

    /// The sliding window the attention of some layer would apply, if any: Mistral's
    /// `sliding_window`; Qwen's when `use_sliding_window` is on and a layer at or past
    /// `max_window_layers` exists (or `layer_types` names a `"sliding_attention"`); never for
    /// Llama.
    ///
    /// Within the window every layer attends causally to all positions, which is what this
    /// implementation computes; a longer sequence is refused ([`check_sequence`](Self::check_sequence))
    /// rather than computed without the window.
    pub fn attention_window(&self) -> Option<usize> {
        match self.family {
            LlamaFamily::Llama => None,
            LlamaFamily::Mistral => self.sliding_window,
            LlamaFamily::Qwen2 | LlamaFamily::Qwen3 => {
                if !self.use_sliding_window {
                    return None;
                }
                let sliding_layer = match self.extra.get("layer_types").and_then(Value::as_array) {
                    Some(types) => types.iter().any(|t| t.as_str() == Some("sliding_attention")),
                    None => self.num_hidden_layers > self.max_window_layers,
                };
                self.sliding_window.filter(|_| sliding_layer)
            }
        }
    }

    /// Refuses a sequence of `seq` tokens that the attention's sliding window would cut
    /// ([`attention_window`](Self::attention_window)); what a trainer checks once, at the edge,
    /// against its sequence length. The forward pass panics with the same message.
    pub fn check_sequence(&self, seq: usize) -> Result<(), LlamaConfigError> {
        match self.attention_window() {
            Some(window) if seq > window => Err(LlamaConfigError::SequenceBeyondWindow { seq, window }),
            _ => Ok(()),
        }
    }

    /// Whether the q, k and v projections have biases (Qwen2 always; Llama and Qwen3 per
    /// `attention_bias`; Mistral never).
    pub fn qkv_bias(&self) -> bool {
        match self.family {
            LlamaFamily::Qwen2 => true,
            LlamaFamily::Llama | LlamaFamily::Qwen3 => self.attention_bias,
            LlamaFamily::Mistral => false,
        }
    }

    /// Whether the attention's output projection has a bias (Llama and Qwen3 per
    /// `attention_bias`).
    pub fn o_bias(&self) -> bool {
        match self.family {
            LlamaFamily::Llama | LlamaFamily::Qwen3 => self.attention_bias,
            LlamaFamily::Qwen2 | LlamaFamily::Mistral => false,
        }
    }

    /// Whether the MLP's projections have biases (Llama per `mlp_bias`).
    pub fn mlp_has_bias(&self) -> bool {
        self.family == LlamaFamily::Llama && self.mlp_bias
    }

    /// Whether queries and keys get an RMSNorm per head before the rotary embedding (Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.family == LlamaFamily::Qwen3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<LlamaConfig, String> {
        LlamaConfig::from_json_str(json).map_err(|e| e.to_string())
    }

    const SIZES: &str = r#""vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 4"#;

    #[test]
    fn model_type_picks_the_family_defaults() {
        // Reference: transformers 5.24's config classes (LlamaConfig num_key_value_heads None →
        // heads; Qwen2Config/Qwen3Config 32; MistralConfig 8; Qwen3Config head_dim 128).
        let llama = parse(&format!(r#"{{"model_type": "llama", {SIZES}}}"#)).unwrap();
        assert_eq!((llama.num_key_value_heads, llama.head_dim), (4, 8));
        assert!(!llama.qkv_bias() && !llama.tie_word_embeddings);
        let qwen2 = parse(&format!(
            r#"{{"model_type": "qwen2", {SIZES}, "num_key_value_heads": 2}}"#
        ))
        .unwrap();
        assert!(qwen2.qkv_bias() && !qwen2.o_bias());
        assert_eq!(qwen2.attention_window(), None, "use_sliding_window is off by default");
        let qwen3 = parse(&format!(
            r#"{{"model_type": "qwen3", {SIZES}, "num_key_value_heads": 4}}"#
        ))
        .unwrap();
        assert_eq!(qwen3.head_dim, 128);
        assert!(qwen3.qk_norm());
        let mistral = parse(&format!(
            r#"{{"model_type": "mistral", {SIZES}, "num_key_value_heads": 2}}"#
        ))
        .unwrap();
        assert_eq!(mistral.attention_window(), Some(4096));
        let unwindowed = parse(&format!(
            r#"{{"model_type": "mistral", {SIZES}, "num_key_value_heads": 2, "sliding_window": null}}"#
        ))
        .unwrap();
        assert_eq!(unwindowed.attention_window(), None);
    }

    #[test]
    fn refuses_what_it_does_not_compute_naming_the_key() {
        let err = parse(r#"{"model_type": "gpt2"}"#).unwrap_err();
        assert!(
            err.contains("model_type = \"gpt2\"") && err.contains("llama, qwen2, qwen3, mistral"),
            "{err}"
        );
        let err = parse(&format!(r#"{{{SIZES}}}"#)).unwrap_err();
        assert!(err.contains("model_type = null"), "{err}");
        let err = parse(&format!(
            r#"{{"model_type": "llama", {SIZES}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#
        ))
        .unwrap_err();
        assert!(
            err.contains("rope_scaling.rope_type = \"yarn\"") && err.contains("default, llama3"),
            "{err}"
        );
        let err = parse(&format!(
            r#"{{"model_type": "qwen2", {SIZES}, "rope_parameters": {{"type": "dynamic", "factor": 2.0}}}}"#
        ))
        .unwrap_err();
        assert!(err.contains("rope_parameters.type = \"dynamic\""), "{err}");
        let err = parse(&format!(
            r#"{{"model_type": "llama", {SIZES}, "rope_scaling": {{"rope_type": "llama3", "factor": 8.0}}}}"#
        ))
        .unwrap_err();
        assert!(err.contains("rope_scaling.low_freq_factor = missing"), "{err}");
        let err = parse(&format!(
            r#"{{"model_type": "mistral", {SIZES}, "num_key_value_heads": 2, "hidden_act": "gelu"}}"#
        ))
        .unwrap_err();
        assert!(err.contains("hidden_act = \"gelu\"") && err.contains("silu"), "{err}");
        let err = parse(&format!(
            r#"{{"model_type": "llama", {SIZES}, "num_key_value_heads": 3}}"#
        ))
        .unwrap_err();
        assert!(
            err.contains("num_key_value_heads = 3") && err.contains("divisor"),
            "{err}"
        );
        let err = parse(&format!(r#"{{"model_type": "llama", {SIZES}, "vocab_size": "many"}}"#)).unwrap_err();
        assert!(
            err.contains("vocab_size = \"many\"") && err.contains("integer"),
            "{err}"
        );
    }

    #[test]
    fn reads_legacy_and_current_rope_keys_alike() {
        let legacy = parse(&format!(
            r#"{{"model_type": "llama", {SIZES}, "rope_theta": 500000.0, "rope_scaling": {{"rope_type": "llama3",
            "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        let current = parse(&format!(
            r#"{{"model_type": "llama", {SIZES}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert_eq!(legacy, current);
        assert_eq!(legacy.rope_theta, 500000.0);
        assert_eq!(legacy.rope_scaling.unwrap().factor, 32.0);
        let again = parse(&legacy.to_json_string()).unwrap();
        let mut again = again;
        again.extra.remove("architectures");
        assert_eq!(again, legacy);
    }

    #[test]
    fn the_model_record_names_the_llama_naming_and_the_family_class() {
        // Reference: the `model_type` and `architectures` transformers writes in each family's
        // config.json.
        for (family, model_type, class) in [
            (LlamaFamily::Llama, "llama", "LlamaForCausalLM"),
            (LlamaFamily::Qwen2, "qwen2", "Qwen2ForCausalLM"),
            (LlamaFamily::Qwen3, "qwen3", "Qwen3ForCausalLM"),
            (LlamaFamily::Mistral, "mistral", "MistralForCausalLM"),
        ] {
            let record = LlamaConfig::new(family, 64, 32, 48, 1, 4, 2).model_record();
            assert_eq!(record.naming, "llama-hf");
            assert_eq!(record.config["model_type"], model_type);
            assert_eq!(record.config["architectures"], serde_json::json!([class]));
            let back = LlamaConfig::from_json_map(record.config.as_object().unwrap().clone()).unwrap();
            assert_eq!(back.family, family);
        }
    }

    #[test]
    fn a_sequence_past_the_sliding_window_is_refused() {
        let mut config = LlamaConfig::new(LlamaFamily::Mistral, 64, 32, 48, 1, 4, 2);
        config.sliding_window = Some(16);
        assert!(config.check_sequence(16).is_ok());
        let err = config.check_sequence(17).unwrap_err().to_string();
        assert!(err.contains("17") && err.contains("sliding_window = 16"), "{err}");
        config.family = LlamaFamily::Qwen2;
        assert!(
            config.check_sequence(17).is_ok(),
            "Qwen's window is off unless use_sliding_window"
        );
        config.use_sliding_window = true;
        config.max_window_layers = 1;
        assert!(
            config.check_sequence(17).is_ok(),
            "no layer at or past max_window_layers"
        );
        config.max_window_layers = 0;
        assert!(config.check_sequence(17).is_err());
    }
}
