//! The Llama family's shapes for the estimate (Llama 3.x, Qwen2/Qwen2.5, Qwen3, Mistral): the
//! parameter count and the stage-3 units, from a preset name or a HuggingFace `config.json`.
//!
//! The counts follow the zoo's `zero_models::llama::LlamaConfig` (whose tests check the two
//! agree on every preset) and transformers' `num_parameters()`.

use super::{gathered_with_prefetch_counted, EstimateInput};
use serde::Serialize;
use serde_json::Value;

/// A Llama-family shape: what the parameter count and the stage-3 gathers depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LlamaShape {
    /// Vocabulary size.
    pub vocab: u64,
    /// Hidden size.
    pub hidden: u64,
    /// MLP inner size.
    pub intermediate: u64,
    /// Decoder layers.
    pub layers: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Size of one head.
    pub head_dim: u64,
    /// Biases on q, k and v (Qwen2; Llama and Qwen3 per `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama and Qwen3 per `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP (Llama per `mlp_bias`).
    pub mlp_bias: bool,
    /// Per-head q/k RMSNorms (Qwen3).
    pub qk_norm: bool,
    /// Whether the LM head is the token embedding.
    pub tied: bool,
}

/// The names [`LlamaShape::preset`] knows: the zoo's Llama-family presets.
pub const LLAMA_PRESETS: [&str; 13] = [
    "llama-tiny",
    "qwen2-tiny",
    "qwen3-tiny",
    "mistral-tiny",
    "llama3.2-1b",
    "llama3.2-3b",
    "llama3-8b",
    "llama3.1-8b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen3-0.6b",
    "qwen3-8b",
    "mistral-7b",
];

/// Why a `config.json` gives no Llama-family shape.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LlamaShapeError {
    /// The text is not a JSON object.
    #[error("config.json is not a JSON object: {0}")]
    Json(String),
    /// `model_type` names no family of the Llama architecture.
    #[error("model_type = {0} is not a Llama-family model (supported: llama, qwen2, qwen3, mistral)")]
    ModelType(String),
    /// A size is not a positive integer, or the heads do not divide as they must.
    #[error("{key} = {value}: {valid}")]
    Invalid {
        /// The key of config.json.
        key: &'static str,
        /// The value found.
        value: String,
        /// What is valid.
        valid: &'static str,
    },
}

impl LlamaShape {
    #[allow(clippy::too_many_arguments)]
    fn with(vocab: u64, hidden: u64, intermediate: u64, layers: u64, heads: u64, kv_heads: u64, tied: bool) -> Self {
        LlamaShape {
            vocab,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            tied,
        }
    }

    /// The preset of this name (one of [`LLAMA_PRESETS`]): the published sizes of each model,
    /// the same as the model zoo's.
    pub fn preset(name: &str) -> Option<Self> {
        let qwen2 = |s: Self| Self { qkv_bias: true, ..s };
        let qwen3 = |s: Self| Self {
            qk_norm: true,
            head_dim: 128,
            ..s
        };
        Some(match name {
            "llama-tiny" => Self::with(128256, 128, 384, 2, 4, 2, true),
            "qwen2-tiny" => qwen2(Self::with(151936, 128, 384, 2, 4, 2, true)),
            "qwen3-tiny" => Self {
                qk_norm: true,
                ..Self::with(151936, 128, 384, 2, 4, 2, true)
            },
            "mistral-tiny" => Self::with(32768, 128, 384, 2, 4, 2, false),
            "llama3.2-1b" => Self::with(128256, 2048, 8192, 16, 32, 8, true),
            "llama3.2-3b" => Self::with(128256, 3072, 8192, 28, 24, 8, true),
            "llama3-8b" | "llama3.1-8b" => Self::with(128256, 4096, 14336, 32, 32, 8, false),
            "qwen2.5-0.5b" => qwen2(Self::with(151936, 896, 4864, 24, 14, 2, true)),
            "qwen2.5-7b" => qwen2(Self::with(152064, 3584, 18944, 28, 28, 4, false)),
            "qwen3-0.6b" => qwen3(Self::with(151936, 1024, 3072, 28, 16, 8, true)),
            "qwen3-8b" => qwen3(Self::with(151936, 4096, 12288, 36, 32, 8, false)),
            "mistral-7b" => Self::with(32768, 4096, 14336, 32, 32, 8, false),
            _ => return None,
        })
    }

    /// The shape a HuggingFace `config.json` of the Llama family describes: `model_type`
    /// (llama, qwen2, qwen3, mistral) picks the family, whose transformers defaults fill the
    /// keys the file leaves out.
    pub fn from_config_json(text: &str) -> Result<Self, LlamaShapeError> {
        let value: Value = serde_json::from_str(text).map_err(|e| LlamaShapeError::Json(e.to_string()))?;
        let map = value
            .as_object()
            .ok_or_else(|| LlamaShapeError::Json("not an object".to_string()))?;
        let model_type = map.get("model_type").cloned().unwrap_or(Value::Null);
        let family = model_type.as_str().unwrap_or_default();
        // (vocab, hidden, intermediate, kv heads when missing (None: the query heads), head_dim)
        let defaults: (u64, u64, u64, Option<u64>, Option<u64>) = match family {
            "llama" => (32000, 4096, 11008, None, None),
            "qwen2" => (151936, 4096, 22016, Some(32), None),
            "qwen3" => (151936, 4096, 22016, Some(32), Some(128)),
            "mistral" => (32000, 4096, 14336, Some(8), None),
            _ => return Err(LlamaShapeError::ModelType(model_type.to_string())),
        };
        let get = |key: &'static str| -> Result<Option<u64>, LlamaShapeError> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if n > 0 => Ok(Some(n)),
                    _ => Err(LlamaShapeError::Invalid {
                        key,
                        value: v.to_string(),
                        valid: "a positive integer",
                    }),
                },
            }
        };
        let flag = |key: &str| map.get(key).and_then(Value::as_bool).unwrap_or(false);
        let vocab = get("vocab_size")?.unwrap_or(defaults.0);
        let hidden = get("hidden_size")?.unwrap_or(defaults.1);
        let intermediate = get("intermediate_size")?.unwrap_or(defaults.2);
        let layers = get("num_hidden_layers")?.unwrap_or(32);
        let heads = get("num_attention_heads")?.unwrap_or(32);
        let kv_heads = get("num_key_value_heads")?.or(defaults.3).unwrap_or(heads);
        if !heads.is_multiple_of(kv_heads) {
            return Err(LlamaShapeError::Invalid {
                key: "num_key_value_heads",
                value: kv_heads.to_string(),
                valid: "a divisor of num_attention_heads",
            });
        }
        let head_dim = match get("head_dim")?.or(defaults.4) {
            Some(d) => d,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => {
                return Err(LlamaShapeError::Invalid {
                    key: "hidden_size",
                    value: hidden.to_string(),
                    valid: "a multiple of num_attention_heads when head_dim is not given",
                })
            }
        };
        let attention_bias = flag("attention_bias");
        Ok(LlamaShape {
            vocab,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            qkv_bias: match family {
                "qwen2" => true,
                "mistral" => false,
                _ => attention_bias,
            },
            o_bias: matches!(family, "llama" | "qwen3") && attention_bias,
            mlp_bias: family == "llama" && flag("mlp_bias"),
            qk_norm: family == "qwen3",
            tied: flag("tie_word_embeddings"),
        })
    }

    /// Parameters of one decoder layer: two RMSNorms, the q/k/v/o projections (and their
    /// biases), Qwen3's q/k norms, the SwiGLU MLP. Counts that pass 2^64 saturate.
    pub fn layer_params(&self) -> u64 {
        let h = self.hidden;
        let q = self.heads.saturating_mul(self.head_dim);
        let kv = self.kv_heads.saturating_mul(self.head_dim);
        let qkv = q.saturating_add(kv.saturating_mul(2));
        let bias = |on: bool, n: u64| if on { n } else { 0 };
        h.saturating_mul(qkv)
            .saturating_add(q.saturating_mul(h))
            .saturating_add(bias(self.qkv_bias, qkv))
            .saturating_add(bias(self.o_bias, h))
            .saturating_add(bias(self.qk_norm, self.head_dim.saturating_mul(2)))
            .saturating_add(h.saturating_mul(self.intermediate).saturating_mul(3))
            .saturating_add(bias(
                self.mlp_bias,
                self.intermediate.saturating_mul(2).saturating_add(h),
            ))
            .saturating_add(h.saturating_mul(2))
    }

    /// Parameters of the token embedding (the zoo's first unit, which a tied head gathers
    /// again; an untied head is a unit of the same size).
    pub fn embed_params(&self) -> u64 {
        self.vocab.saturating_mul(self.hidden)
    }

    /// Parameters outside the layers: the embedding, the final norm and an untied head.
    pub fn ends_params(&self) -> u64 {
        let head = if self.tied { 0 } else { self.embed_params() };
        self.embed_params().saturating_add(self.hidden).saturating_add(head)
    }

    /// Trainable parameters (transformers' `num_parameters()`).
    pub fn num_params(&self) -> u64 {
        self.layers
            .saturating_mul(self.layer_params())
            .saturating_add(self.ends_params())
    }

    /// The most parameters stage 3 holds gathered at once for the zoo's `ShardedLlama` (the
    /// embedding, each layer and an untied head a unit, gathered one at a time; the final norm
    /// replicated), with a prefetch budget of `prefetch_bucket_size` elements (0: none).
    pub fn gathered_at_once(&self, prefetch_bucket_size: u64) -> u64 {
        let head = if self.tied { 0 } else { 1 };
        gathered_with_prefetch_counted(
            &[
                (self.embed_params(), 1),
                (self.layer_params(), self.layers),
                (self.embed_params(), head),
            ],
            prefetch_bucket_size,
        )
    }

    /// `base` (stage, cluster, offload, dtype, prefetch budget) for this model: its parameters,
    /// what stage 3 holds gathered at once (none on one data-parallel device), and its largest
    /// partitioned group. The zoo has no tensor-parallel plan for the family yet: the counts
    /// are the whole model's whatever `base.tensor_parallel` says.
    pub fn input(&self, base: &EstimateInput) -> EstimateInput {
        EstimateInput {
            params: self.num_params(),
            gathered_at_once: Some(self.gathered_at_once(match base.data_parallel() {
                Ok(w) if w > 1 => base.prefetch_bucket_size,
                _ => 0,
            })),
            largest_group: Some(self.layer_params().max(self.embed_params())),
            ..base.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference: `AutoModelForCausalLM.from_config(config).num_parameters()` in transformers
    // 5.24 on the meta device, for each model's published sizes.
    #[test]
    fn counts_match_transformers() {
        let want = [
            ("llama3.2-1b", 1_235_814_400u64),
            ("llama3.2-3b", 3_212_749_824),
            ("llama3-8b", 8_030_261_248),
            ("qwen2.5-0.5b", 494_032_768),
            ("qwen2.5-7b", 7_615_616_512),
            ("qwen3-0.6b", 596_049_920),
            ("qwen3-8b", 8_190_735_360),
            ("mistral-7b", 7_248_023_552),
            ("llama-tiny", 16_810_624),
            ("qwen2-tiny", 19_842_176),
            ("qwen3-tiny", 19_841_792),
            ("mistral-tiny", 8_782_464),
        ];
        for (name, count) in want {
            assert_eq!(LlamaShape::preset(name).map(|s| s.num_params()), Some(count), "{name}");
        }
        for name in LLAMA_PRESETS {
            assert!(LlamaShape::preset(name).is_some(), "{name}");
        }
        assert_eq!(LlamaShape::preset("gpt2"), None);
    }

    #[test]
    fn a_config_json_gives_the_preset_it_describes() {
        // Qwen3-0.6B's published config.json, trimmed to the keys the count reads.
        let qwen3 = r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "attention_bias": false, "tie_word_embeddings": true}"#;
        assert_eq!(
            LlamaShape::from_config_json(qwen3),
            Ok(LlamaShape::preset("qwen3-0.6b").unwrap())
        );
        let err = LlamaShape::from_config_json(r#"{"model_type": "gpt2"}"#).unwrap_err();
        assert!(err.to_string().contains("model_type = \"gpt2\""), "{err}");
        let err = LlamaShape::from_config_json(r#"{"model_type": "llama", "hidden_size": 0}"#).unwrap_err();
        assert!(err.to_string().contains("hidden_size = 0"), "{err}");
    }

    #[test]
    fn stage_3_gathers_the_largest_unit() {
        let untied = LlamaShape::preset("llama3-8b").unwrap();
        // Without prefetch, the largest unit: the 525M embedding (and head) over a 218M layer.
        assert_eq!(untied.gathered_at_once(0), untied.embed_params());
        assert!(untied.embed_params() > untied.layer_params());
        let input = untied.input(&EstimateInput::new(0, 3, 8, super::super::Dtype::Bf16));
        assert_eq!(input.params, 8_030_261_248);
        assert_eq!(input.largest_group, Some(untied.embed_params()));
    }
}
