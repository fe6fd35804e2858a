//! Named GPT-2 sizes, and the parameter count of a configuration by formula.

use super::config::Gpt2Config;
use super::error::Gpt2ConfigError;

/// The names [`Gpt2Config::preset`] accepts.
pub const PRESET_NAMES: [&str; 6] = ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-10b"];

/// GPT-2's BPE vocabulary size (r50k_base).
pub const GPT2_VOCAB_SIZE: usize = 50257;

impl Gpt2Config {
    /// A 2-layer model with hidden size 128, 4 heads and GPT-2's vocabulary (6,960,768
    /// parameters): small enough for tests and CPU benchmarks, with the real embedding cost.
    pub fn tiny() -> Self {
        Self::new(GPT2_VOCAB_SIZE, 1024, 128, 2, 4)
    }

    /// GPT-2 small: 12 layers, hidden 768, 12 heads (124M parameters).
    pub fn gpt2() -> Self {
        Self::new(GPT2_VOCAB_SIZE, 1024, 768, 12, 12)
    }

    /// GPT-2 medium: 24 layers, hidden 1024, 16 heads (355M parameters).
    pub fn gpt2_medium() -> Self {
        Self::new(GPT2_VOCAB_SIZE, 1024, 1024, 24, 16)
    }

    /// GPT-2 large: 36 layers, hidden 1280, 20 heads (774M parameters).
    pub fn gpt2_large() -> Self {
        Self::new(GPT2_VOCAB_SIZE, 1024, 1280, 36, 20)
    }

    /// GPT-2 XL: 48 layers, hidden 1600, 25 heads (1.56B parameters).
    pub fn gpt2_xl() -> Self {
        Self::new(GPT2_VOCAB_SIZE, 1024, 1600, 48, 25)
    }

    /// The 10B GPT-2 of the ZeRO-Offload paper: 50 layers, hidden 4096, 32 heads.
    pub fn gpt2_10b() -> Self {
        Self::new(GPT2_VOCAB_SIZE, 1024, 4096, 50, 32)
    }

    /// The preset of the given name: one of [`PRESET_NAMES`], or a shape `gpt2-<layers>x<hidden>`
    /// (e.g. `gpt2-40x4096`, what `zero estimate --fit-host-memory` prints), with heads of 128
    /// when the hidden size is a multiple of 128, else of 64.
    pub fn preset(name: &str) -> Result<Self, Gpt2ConfigError> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "gpt2" => Ok(Self::gpt2()),
            "gpt2-medium" => Ok(Self::gpt2_medium()),
            "gpt2-large" => Ok(Self::gpt2_large()),
            "gpt2-xl" => Ok(Self::gpt2_xl()),
            "gpt2-10b" => Ok(Self::gpt2_10b()),
            other => match zero_core::estimate::Gpt2Shape::preset(other) {
                Some(shape) => Ok(Self::new(
                    shape.vocab as usize,
                    shape.n_positions as usize,
                    shape.n_embd as usize,
                    shape.n_layer as usize,
                    shape.n_head as usize,
                )),
                None => Err(Gpt2ConfigError::UnknownPreset(other.to_string())),
            },
        }
    }

    /// Number of trainable parameters, counted by formula without building the model. The LM
    /// head is tied to the token embedding and so adds nothing. Sizes that
    /// [`validate`](Self::validate) refuses may give `u64::MAX`.
    pub fn num_params(&self) -> u64 {
        u64::try_from(self.params_u128()).unwrap_or(u64::MAX)
    }

    /// [`num_params`](Self::num_params) in saturating 128-bit arithmetic, for any sizes.
    pub(crate) fn params_u128(&self) -> u128 {
        let d = self.n_embd as u128;
        let inner = self.n_inner.map_or(d.saturating_mul(4), |n| n as u128);
        let layer_norm = d.saturating_mul(2);
        let attention = d
            .saturating_mul(d)
            .saturating_mul(4)
            .saturating_add(d.saturating_mul(4));
        let mlp = d
            .saturating_mul(inner)
            .saturating_mul(2)
            .saturating_add(inner)
            .saturating_add(d);
        let block = layer_norm
            .saturating_mul(2)
            .saturating_add(attention)
            .saturating_add(mlp);
        let embeddings = (self.vocab_size as u128 + self.n_positions as u128).saturating_mul(d);
        embeddings
            .saturating_add((self.n_layer as u128).saturating_mul(block))
            .saturating_add(layer_norm)
    }
}

/// The most parameters a configuration may describe (2^50, about 10^15): far more than any
/// model trained, and few enough that every size computed from them fits in 64 bits.
pub const MAX_PARAMS: u128 = 1 << 50;

#[cfg(test)]
mod tests {
    use super::*;

    // Reference: `GPT2LMHeadModel(GPT2Config(...)).num_parameters()` in transformers 5.23 (tied
    // head, built on the meta device) for every preset.
    #[test]
    fn formula_matches_published_counts() {
        assert_eq!(Gpt2Config::tiny().num_params(), 6_960_768);
        assert_eq!(Gpt2Config::gpt2().num_params(), 124_439_808);
        assert_eq!(Gpt2Config::gpt2_medium().num_params(), 354_823_168);
        assert_eq!(Gpt2Config::gpt2_large().num_params(), 774_030_080);
        assert_eq!(Gpt2Config::gpt2_xl().num_params(), 1_557_611_200);
        assert_eq!(Gpt2Config::gpt2_10b().num_params(), 10_279_047_168);
    }

    #[test]
    fn presets_by_name_are_valid() {
        for name in PRESET_NAMES {
            let config = Gpt2Config::preset(name).unwrap();
            config.validate().unwrap();
        }
        assert_eq!(Gpt2Config::preset("gpt2-xl").unwrap().n_head, 25);
        assert!(matches!(
            Gpt2Config::preset("gpt3"),
            Err(Gpt2ConfigError::UnknownPreset(_))
        ));
    }

    #[test]
    fn shaped_names_build_the_shape_the_estimate_counts() {
        // Reference: the estimate's own parameter formula, and the 10B preset's published shape.
        let c = Gpt2Config::preset("gpt2-3x256").unwrap();
        assert_eq!((c.n_layer, c.n_embd, c.n_head), (3, 256, 2));
        let shape = zero_core::estimate::Gpt2Shape::preset("gpt2-3x256").unwrap();
        assert_eq!(c.num_params(), shape.num_params());
        assert_eq!(
            Gpt2Config::preset("gpt2-50x4096").unwrap().num_params(),
            Gpt2Config::gpt2_10b().num_params()
        );
        assert!(Gpt2Config::preset("gpt2-3x100").is_err());
    }
}
