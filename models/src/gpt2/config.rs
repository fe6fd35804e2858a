//! The GPT-2 hyper-parameters, read from and written to HuggingFace's `config.json`.

use serde::{Deserialize, Serialize};

use super::error::Gpt2ConfigError;

/// GPT-2's hyper-parameters, with HuggingFace's `GPT2Config` field names so that a
/// `config.json` written by `save_pretrained` deserializes into it directly.
///
/// Fields this implementation does not model (token ids, generation settings, ...) are kept in
/// [`extra`](Self::extra) so that loading and saving a checkpoint does not lose them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// Size of the vocabulary (rows of the token embedding `wte`, columns of the logits).
    pub vocab_size: usize,
    /// Longest sequence the learned position embedding `wpe` covers.
    pub n_positions: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// Inner size of the MLP; `None` means `4 * n_embd`.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// Activation of the MLP, HuggingFace's name for it.
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// Dropout on the residual branches. Carried for round trips; the model applies no dropout.
    #[serde(default = "default_dropout")]
    pub resid_pdrop: f64,
    /// Dropout on the embeddings. Carried for round trips; the model applies no dropout.
    #[serde(default = "default_dropout")]
    pub embd_pdrop: f64,
    /// Dropout on the attention probabilities. Carried for round trips; the model applies no
    /// dropout.
    #[serde(default = "default_dropout")]
    pub attn_pdrop: f64,
    /// Epsilon of every LayerNorm.
    #[serde(default = "default_layer_norm_epsilon")]
    pub layer_norm_epsilon: f64,
    /// Standard deviation of the normal initialization of weights.
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    /// Whether attention scores are divided by `sqrt(head_dim)`.
    #[serde(default = "default_true")]
    pub scale_attn_weights: bool,
    /// Whether attention scores of layer `i` are further divided by `i + 1`.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Whether the LM head shares the token embedding. Only `true` is supported.
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Every other field of `config.json`, kept verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn default_activation() -> String {
    "gelu_new".to_string()
}
fn default_dropout() -> f64 {
    0.1
}
fn default_layer_norm_epsilon() -> f64 {
    1e-5
}
fn default_initializer_range() -> f64 {
    0.02
}
fn default_true() -> bool {
    true
}

/// The MLP's activation function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// The tanh approximation of GELU (HuggingFace's `gelu_new`, also `gelu_pytorch_tanh`),
    /// the one GPT-2 was trained with.
    GeluTanh,
    /// GELU with the exact error function (HuggingFace's `gelu`).
    GeluErf,
    /// ReLU.
    Relu,
}

impl Activation {
    /// Parses HuggingFace's name of an activation.
    pub fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Some(Self::GeluTanh),
            "gelu" => Some(Self::GeluErf),
            "relu" => Some(Self::Relu),
            _ => None,
        }
    }
}

impl Gpt2Config {
    /// A configuration with the given sizes and GPT-2's defaults elsewhere (`gelu_new`, LayerNorm
    /// epsilon 1e-5, tied head).
    pub fn new(vocab_size: usize, n_positions: usize, n_embd: usize, n_layer: usize, n_head: usize) -> Self {
        Self {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: None,
            activation_function: default_activation(),
            resid_pdrop: default_dropout(),
            embd_pdrop: default_dropout(),
            attn_pdrop: default_dropout(),
            layer_norm_epsilon: default_layer_norm_epsilon(),
            initializer_range: default_initializer_range(),
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            tie_word_embeddings: true,
            extra: serde_json::Map::new(),
        }
    }

    /// Parses a HuggingFace `config.json` and validates it.
    pub fn from_json_str(json: &str) -> Result<Self, Gpt2ConfigError> {
        let config: Self = serde_json::from_str(json).map_err(Gpt2ConfigError::Json)?;
        config.validate()?;
        Ok(config)
    }

    /// Serializes to HuggingFace's `config.json` layout, adding the `model_type` and
    /// `architectures` fields transformers needs to pick the class when they are missing.
    pub fn to_json_string(&self) -> Result<String, Gpt2ConfigError> {
        serde_json::to_string_pretty(&self.to_json_value()?).map_err(Gpt2ConfigError::Json)
    }

    /// [`Self::to_json_string`]'s document as a JSON value.
    pub fn to_json_value(&self) -> Result<serde_json::Value, Gpt2ConfigError> {
        let mut value = serde_json::to_value(self).map_err(Gpt2ConfigError::Json)?;
        if let Some(map) = value.as_object_mut() {
            map.entry("model_type")
                .or_insert_with(|| serde_json::Value::from("gpt2"));
            map.entry("architectures")
                .or_insert_with(|| serde_json::json!(["GPT2LMHeadModel"]));
        }
        Ok(value)
    }

    /// What a checkpoint of this model records ([`zero_burn::EngineSettings::model`]) so that
    /// `zero to-fp32` exports it as a HuggingFace directory: HuggingFace's names for the
    /// parameters of [`super::Gpt2`] and [`super::ShardedGpt2`], and this `config.json`.
    pub fn model_record(&self) -> Result<zero_core::checkpoint::ModelRecord, Gpt2ConfigError> {
        Ok(zero_core::checkpoint::ModelRecord {
            naming: zero_core::checkpoint::GPT2_HF_NAMING.to_string(),
            config: self.to_json_value()?,
        })
    }

    /// Checks the sizes are consistent and every option is one this implementation computes
    /// exactly as HuggingFace does.
    pub fn validate(&self) -> Result<(), Gpt2ConfigError> {
        // First, so that nothing below computes with sizes that overflow.
        let params = self.params_u128();
        if params > super::presets::MAX_PARAMS {
            return Err(Gpt2ConfigError::TooLarge { params });
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_inner", self.inner_size()),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(Gpt2ConfigError::Zero { field });
            }
        }
        // `is_multiple_of` is newer than the workspace's rust-version (1.85).
        #[allow(clippy::manual_is_multiple_of)]
        let heads_divide = self.n_embd % self.n_head == 0;
        if !heads_divide {
            return Err(Gpt2ConfigError::HeadsDoNotDivideHidden {
                n_embd: self.n_embd,
                n_head: self.n_head,
            });
        }
        let positive_finite = |v: f64| v.is_finite() && v > 0.0;
        if !positive_finite(self.layer_norm_epsilon) {
            return Err(Gpt2ConfigError::OutOfRange {
                field: "layer_norm_epsilon",
                value: self.layer_norm_epsilon.to_string(),
                valid: "a positive number, such as 1e-5",
            });
        }
        for (field, p) in [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attn_pdrop", self.attn_pdrop),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(Gpt2ConfigError::OutOfRange {
                    field,
                    value: p.to_string(),
                    valid: "a dropout probability, at least 0 and below 1",
                });
            }
        }
        match self.extra.get("model_type").and_then(|v| v.as_str()) {
            Some(kind) if kind != "gpt2" => {
                return Err(Gpt2ConfigError::OutOfRange {
                    field: "model_type",
                    value: kind.to_string(),
                    valid: "this is a GPT-2 loader: \"gpt2\"",
                })
            }
            _ => {}
        }
        if Activation::from_hf_name(&self.activation_function).is_none() {
            return Err(Gpt2ConfigError::UnsupportedActivation(self.activation_function.clone()));
        }
        if !self.tie_word_embeddings {
            return Err(Gpt2ConfigError::UntiedHead);
        }
        Ok(())
    }

    /// Inner size of the MLP (`n_inner`, or `4 * n_embd` when unset).
    pub fn inner_size(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }

    /// Size of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// The MLP's activation, or `None` when the name is not one [`validate`](Self::validate)
    /// accepts.
    pub fn activation(&self) -> Option<Activation> {
        Activation::from_hf_name(&self.activation_function)
    }

    /// The factor attention scores of layer `layer` are multiplied with before the softmax.
    pub fn attention_scale(&self, layer: usize) -> f64 {
        let mut scale = 1.0;
        if self.scale_attn_weights {
            scale /= (self.head_dim() as f64).sqrt();
        }
        if self.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference: the config.json transformers writes for `GPT2Config()` (GPT-2 small), trimmed.
    const HF_GPT2_CONFIG: &str = r#"{
      "activation_function": "gelu_new",
      "architectures": ["GPT2LMHeadModel"],
      "attn_pdrop": 0.1,
      "bos_token_id": 50256,
      "embd_pdrop": 0.1,
      "eos_token_id": 50256,
      "initializer_range": 0.02,
      "layer_norm_epsilon": 1e-05,
      "model_type": "gpt2",
      "n_ctx": 1024,
      "n_embd": 768,
      "n_head": 12,
      "n_inner": null,
      "n_layer": 12,
      "n_positions": 1024,
      "resid_pdrop": 0.1,
      "scale_attn_weights": true,
      "vocab_size": 50257
    }"#;

    #[test]
    fn parses_hf_config_and_keeps_unknown_fields() {
        let config = Gpt2Config::from_json_str(HF_GPT2_CONFIG).unwrap();
        assert_eq!(config.n_embd, 768);
        assert_eq!(config.inner_size(), 3072);
        assert_eq!(config.head_dim(), 64);
        assert_eq!(config.activation(), Some(Activation::GeluTanh));
        assert_eq!(config.extra["bos_token_id"], 50256);

        let again = Gpt2Config::from_json_str(&config.to_json_string().unwrap()).unwrap();
        assert_eq!(again, config);
    }

    #[test]
    fn rejects_inconsistent_configs() {
        let mut config = Gpt2Config::new(100, 16, 30, 1, 4);
        assert!(matches!(
            config.validate(),
            Err(Gpt2ConfigError::HeadsDoNotDivideHidden { .. })
        ));
        config.n_head = 3;
        config.activation_function = "swish".into();
        assert!(matches!(
            config.validate(),
            Err(Gpt2ConfigError::UnsupportedActivation(_))
        ));
        config.activation_function = "gelu_new".into();
        config.tie_word_embeddings = false;
        assert!(matches!(config.validate(), Err(Gpt2ConfigError::UntiedHead)));
    }

    #[test]
    fn sizes_beyond_any_model_are_refused_without_overflow() {
        // 4 * n_embd and n_embd^2 overflow 64 bits here: an error, not a panic.
        let huge_width = Gpt2Config::new(100, 16, 1 << 62, 1, 1);
        assert!(matches!(huge_width.validate(), Err(Gpt2ConfigError::TooLarge { .. })));
        let deep = Gpt2Config::new(50257, 1024, 128, 1_000_000_000_000, 4);
        let err = deep.validate().unwrap_err().to_string();
        assert!(err.contains("n_layer") && err.contains("more than"), "{err}");
        let mut bad = Gpt2Config::new(100, 16, 32, 1, 4);
        bad.layer_norm_epsilon = -1.0;
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("layer_norm_epsilon = -1"));
        bad.layer_norm_epsilon = 1e-5;
        bad.attn_pdrop = 1.5;
        assert!(bad.validate().unwrap_err().to_string().contains("attn_pdrop"));
        bad.attn_pdrop = 0.1;
        bad.extra.insert("model_type".into(), "llama".into());
        assert!(bad.validate().unwrap_err().to_string().contains("model_type = llama"));
        bad.extra.insert("model_type".into(), "gpt2".into());
        assert!(bad.validate().is_ok());
        // GPT-2 10B is far inside the bound.
        assert!(Gpt2Config::gpt2_10b().validate().is_ok());
    }

    #[test]
    fn attention_scale_follows_options() {
        let mut config = Gpt2Config::new(100, 16, 64, 2, 4);
        assert_eq!(config.attention_scale(1), 0.25);
        config.scale_attn_by_inverse_layer_idx = true;
        assert_eq!(config.attention_scale(1), 0.125);
        config.scale_attn_weights = false;
        assert_eq!(config.attention_scale(0), 1.0);
    }
}
