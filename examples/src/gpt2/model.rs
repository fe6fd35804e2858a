//! The model a run starts from: a preset, or a HuggingFace checkpoint directory.

use super::TrainError;
use burn::tensor::backend::Backend;
use std::path::PathBuf;
use zero_models::{Gpt2, Gpt2Config};

/// Where the weights come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A randomly initialised preset (`tiny`, `gpt2`, ...).
    Preset(String),
    /// A HuggingFace GPT-2 directory (config.json + model.safetensors).
    Pretrained(PathBuf),
}

impl ModelSource {
    /// Builds the model on `device`.
    pub fn build<B: Backend>(&self, device: &B::Device) -> Result<(Gpt2<B>, Gpt2Config), TrainError> {
        match self {
            ModelSource::Preset(name) => {
                let config = Gpt2Config::preset(name).map_err(|e| TrainError::Model(e.to_string()))?;
                Ok((config.init(device), config))
            }
            ModelSource::Pretrained(dir) => {
                Gpt2::load_pretrained(dir, device).map_err(|e| TrainError::Model(e.to_string()))
            }
        }
    }
}
