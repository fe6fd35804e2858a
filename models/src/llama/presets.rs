//! Named sizes of the Llama family (the published `config.json` values), tiny ones for tests,
//! and the parameter count of a configuration by formula.

use serde_json::Map;

use super::config::{LlamaConfig, LlamaFamily};
use super::error::LlamaConfigError;
use super::rope::Llama3RopeScaling;

/// The names [`LlamaConfig::preset`] accepts: the estimator's, whose shapes the tests hold
/// equal to these configurations.
pub const PRESET_NAMES: [&str; 13] = zero_core::estimate::LLAMA_PRESETS;

/// The most parameters a configuration may describe (2^50, as for GPT-2): every size computed
/// from them fits in 64 bits.
pub const MAX_PARAMS: u128 = 1 << 50;

/// Llama 3's vocabulary (tiktoken-based, 128,256 entries).
const LLAMA3_VOCAB: usize = 128256;
/// Qwen2/Qwen2.5/Qwen3's vocabulary size as their configs give it (151,936).
const QWEN_VOCAB: usize = 151936;
/// Mistral v0.3's vocabulary.
const MISTRAL_VOCAB: usize = 32768;

impl LlamaConfig {
    /// A configuration of `family` with the given sizes, `head_dim = hidden_size /
    /// num_attention_heads`, and transformers' defaults elsewhere (RMSNorm epsilon 1e-6, rope
    /// theta 10000 without scaling, no biases but Qwen2's, untied head, no sliding window).
    pub fn new(
        family: LlamaFamily,
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> Self {
        Self {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: hidden_size / num_attention_heads.max(1),
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            attention_bias: false,
            mlp_bias: false,
            tie_word_embeddings: false,
            hidden_act: "silu".to_string(),
            initializer_range: 0.02,
            sliding_window: None,
            use_sliding_window: false,
            max_window_layers: super::config::DEFAULT_MAX_WINDOW_LAYERS,
            extra: Map::new(),
        }
    }

    /// The preset of the given name, one of [`PRESET_NAMES`]:
    ///
    /// - `llama-tiny`, `qwen2-tiny`, `qwen3-tiny`, `mistral-tiny`: 2 layers, hidden 128, 4 heads
    ///   over 2 key/value heads, MLP 384, with the family's real vocabulary and options (so a
    ///   tokenizer of the family fits): test- and CPU-benchmark-sized, as GPT-2's `tiny`.
    /// - the published configurations of Llama 3.2 1B and 3B, Llama 3 8B, Llama 3.1 8B,
    ///   Qwen2.5 0.5B and 7B, Qwen3 0.6B and 8B, Mistral 7B v0.3.
    pub fn preset(name: &str) -> Result<Self, LlamaConfigError> {
        let llama3_scaling = |factor| {
            Some(Llama3RopeScaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })
        };
        let config = match name {
            "llama-tiny" => {
                let mut c = Self::new(LlamaFamily::Llama, LLAMA3_VOCAB, 128, 384, 2, 4, 2);
                c.rope_theta = 500000.0;
                c.rope_scaling = llama3_scaling(32.0);
                c.rms_norm_eps = 1e-5;
                c.tie_word_embeddings = true;
                c
            }
            "qwen2-tiny" => {
                let mut c = Self::new(LlamaFamily::Qwen2, QWEN_VOCAB, 128, 384, 2, 4, 2);
                c.rope_theta = 1000000.0;
                c.tie_word_embeddings = true;
                c
            }
            "qwen3-tiny" => {
                let mut c = Self::new(LlamaFamily::Qwen3, QWEN_VOCAB, 128, 384, 2, 4, 2);
                c.rope_theta = 1000000.0;
                c.tie_word_embeddings = true;
                c
            }
            "mistral-tiny" => {
                let mut c = Self::new(LlamaFamily::Mistral, MISTRAL_VOCAB, 128, 384, 2, 4, 2);
                c.rope_theta = 1000000.0;
                c.rms_norm_eps = 1e-5;
                c
            }
            "llama3.2-1b" | "llama3.2-3b" => {
                let (hidden, inter, layers, heads) = if name == "llama3.2-1b" {
                    (2048, 8192, 16, 32)
                } else {
                    (3072, 8192, 28, 24)
                };
                let mut c = Self::new(LlamaFamily::Llama, LLAMA3_VOCAB, hidden, inter, layers, heads, 8);
                c.max_position_embeddings = 131072;
                c.rope_theta = 500000.0;
                c.rope_scaling = llama3_scaling(32.0);
                c.rms_norm_eps = 1e-5;
                c.tie_word_embeddings = true;
                c
            }
            "llama3-8b" | "llama3.1-8b" => {
                let mut c = Self::new(LlamaFamily::Llama, LLAMA3_VOCAB, 4096, 14336, 32, 32, 8);
                c.rope_theta = 500000.0;
                c.rms_norm_eps = 1e-5;
                if name == "llama3.1-8b" {
                    c.max_position_embeddings = 131072;
                    c.rope_scaling = llama3_scaling(8.0);
                } else {
                    c.max_position_embeddings = 8192;
                }
                c
            }
            "qwen2.5-0.5b" | "qwen2.5-7b" => {
                let mut c = if name == "qwen2.5-0.5b" {
                    let mut c = Self::new(LlamaFamily::Qwen2, QWEN_VOCAB, 896, 4864, 24, 14, 2);
                    c.tie_word_embeddings = true;
                    c.max_position_embeddings = 32768;
                    c
                } else {
                    let mut c = Self::new(LlamaFamily::Qwen2, 152064, 3584, 18944, 28, 28, 4);
                    c.max_position_embeddings = 131072;
                    c
                };
                c.rope_theta = 1000000.0;
                c.sliding_window = Some(c.max_position_embeddings);
                c.max_window_layers = c.num_hidden_layers;
                c
            }
            "qwen3-0.6b" | "qwen3-8b" => {
                let mut c = if name == "qwen3-0.6b" {
                    let mut c = Self::new(LlamaFamily::Qwen3, QWEN_VOCAB, 1024, 3072, 28, 16, 8);
                    c.tie_word_embeddings = true;
                    c
                } else {
                    Self::new(LlamaFamily::Qwen3, QWEN_VOCAB, 4096, 12288, 36, 32, 8)
                };
                c.head_dim = 128;
                c.max_position_embeddings = 40960;
                c.rope_theta = 1000000.0;
                c.max_window_layers = c.num_hidden_layers;
                c
            }
            "mistral-7b" => {
                let mut c = Self::new(LlamaFamily::Mistral, MISTRAL_VOCAB, 4096, 14336, 32, 32, 8);
                c.max_position_embeddings = 32768;
                c.rope_theta = 1000000.0;
                c.rms_norm_eps = 1e-5;
                c
            }
            other => return Err(LlamaConfigError::UnknownPreset(other.to_string())),
        };
        Ok(config)
    }

    /// The shape `zero estimate` counts (zero-core's [`zero_core::estimate::LlamaShape`]).
    pub fn estimate_shape(&self) -> zero_core::estimate::LlamaShape {
        zero_core::estimate::LlamaShape {
            vocab: self.vocab_size as u64,
            hidden: self.hidden_size as u64,
            intermediate: self.intermediate_size as u64,
            layers: self.num_hidden_layers as u64,
            heads: self.num_attention_heads as u64,
            kv_heads: self.num_key_value_heads as u64,
            head_dim: self.head_dim as u64,
            qkv_bias: self.qkv_bias(),
            o_bias: self.o_bias(),
            mlp_bias: self.mlp_has_bias(),
            qk_norm: self.qk_norm(),
            tied: self.tie_word_embeddings,
        }
    }

    /// Number of trainable parameters, counted by formula without building the model (the LM
    /// head counts when untied). Sizes that [`validate`](Self::validate) refuses may give
    /// `u64::MAX`.
    pub fn num_params(&self) -> u64 {
        u64::try_from(self.params_u128()).unwrap_or(u64::MAX)
    }

    /// [`num_params`](Self::num_params) in saturating 128-bit arithmetic, for any sizes.
    pub(crate) fn params_u128(&self) -> u128 {
        let h = self.hidden_size as u128;
        let q = (self.num_attention_heads as u128).saturating_mul(self.head_dim as u128);
        let kv = (self.num_key_value_heads as u128).saturating_mul(self.head_dim as u128);
        let inter = self.intermediate_size as u128;
        let bias = |on: bool, n: u128| if on { n } else { 0 };
        let attention = h
            .saturating_mul(q.saturating_add(kv.saturating_mul(2)))
            .saturating_add(q.saturating_mul(h))
            .saturating_add(bias(self.qkv_bias(), q.saturating_add(kv.saturating_mul(2))))
            .saturating_add(bias(self.o_bias(), h))
            .saturating_add(bias(self.qk_norm(), (self.head_dim as u128).saturating_mul(2)));
        let mlp = h
            .saturating_mul(inter)
            .saturating_mul(3)
            .saturating_add(bias(self.mlp_has_bias(), inter.saturating_mul(2).saturating_add(h)));
        let layer = attention.saturating_add(mlp).saturating_add(h.saturating_mul(2));
        let embedding = (self.vocab_size as u128).saturating_mul(h);
        let head = if self.tie_word_embeddings { 0 } else { embedding };
        embedding
            .saturating_add(head)
            .saturating_add((self.num_hidden_layers as u128).saturating_mul(layer))
            .saturating_add(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference: `AutoModelForCausalLM.from_config(config).num_parameters()` in transformers
    // 5.24 (on the meta device) for each preset's published sizes.
    #[test]
    fn formula_matches_transformers_counts() {
        let want = [
            ("llama-tiny", 16_810_624),
            ("qwen2-tiny", 19_842_176),
            ("qwen3-tiny", 19_841_792),
            ("mistral-tiny", 8_782_464),
            ("llama3.2-1b", 1_235_814_400),
            ("llama3.2-3b", 3_212_749_824),
            ("llama3-8b", 8_030_261_248),
            ("llama3.1-8b", 8_030_261_248),
            ("qwen2.5-0.5b", 494_032_768),
            ("qwen2.5-7b", 7_615_616_512),
            ("qwen3-0.6b", 596_049_920),
            ("qwen3-8b", 8_190_735_360),
            ("mistral-7b", 7_248_023_552),
        ];
        assert_eq!(want.len(), PRESET_NAMES.len());
        for (name, count) in want {
            let config = LlamaConfig::preset(name).unwrap();
            config.validate().unwrap();
            assert_eq!(config.num_params(), count, "{name}");
        }
        let err = LlamaConfig::preset("llama4").unwrap_err().to_string();
        assert!(err.contains("llama4") && err.contains("qwen3-0.6b"), "{err}");
    }

    #[test]
    fn the_estimate_knows_every_preset_and_reads_its_config_json() {
        // Reference: this crate's config and count; zero-core's estimate has its own table and
        // config.json reader, which must agree.
        for name in PRESET_NAMES {
            let config = LlamaConfig::preset(name).unwrap();
            let shape = zero_core::estimate::LlamaShape::preset(name).expect(name);
            assert_eq!(shape, config.estimate_shape(), "{name}");
            assert_eq!(shape.num_params(), config.num_params(), "{name}");
            let read = zero_core::estimate::LlamaShape::from_config_json(&config.to_json_string()).unwrap();
            assert_eq!(read, shape, "{name}: from its config.json");
        }
        assert_eq!(zero_core::estimate::LLAMA_PRESETS, PRESET_NAMES);
    }

    #[test]
    fn presets_survive_config_json() {
        // What `init` writes is what a load reads back.
        for name in PRESET_NAMES {
            let config = LlamaConfig::preset(name).unwrap();
            let again = LlamaConfig::from_json_str(&config.to_json_string()).unwrap();
            assert_eq!(
                again.extra.get("architectures").cloned(),
                Some(serde_json::json!([config.family.architecture()]))
            );
            let mut again = again;
            again.extra.remove("architectures");
            assert_eq!(again, config, "{name}");
        }
    }
}
