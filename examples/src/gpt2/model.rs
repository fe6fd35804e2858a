//! The model a run starts from: a preset, or a HuggingFace checkpoint directory.

use super::data::DataSource;
use super::TrainError;
use burn::tensor::backend::Backend;
use std::path::PathBuf;
use zero_burn::params::{read_values, write_values};
use zero_burn::sharded::{ShardBackend, UnitComm};
use zero_core::comm::{FlatBuffer, ProcessGroup};
use zero_models::gpt2::ShardedGpt2;
use zero_models::{Gpt2, Gpt2Config};

/// Held while a rank thread seeds Burn's one generator and draws from it.
static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Where the weights come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A randomly initialised preset (`tiny`, `gpt2`, ...).
    Preset(String),
    /// A HuggingFace GPT-2 directory (config.json + model.safetensors).
    Pretrained(PathBuf),
}

impl ModelSource {
    /// Builds the model on `device` from the backend's generator seeded with `seed`. Rank
    /// threads share the backend's one generator: the seeding and the draws happen under one
    /// process-wide lock, so every rank (rank 0 above all, whose weights the engine broadcasts)
    /// draws the same weights, whatever the threads' timing.
    pub fn build_seeded<B: Backend>(&self, device: &B::Device, seed: u64) -> Result<(Gpt2<B>, Gpt2Config), TrainError> {
        let _one_at_a_time = INIT.lock().unwrap_or_else(|e| e.into_inner());
        B::seed(device, seed);
        self.build(device)
    }

    /// The model as a `ShardedGpt2` whose units of at least `min_numel` elements are cut over
    /// `comm`'s ranks unit by unit, so that no rank ever holds it whole (stage 3): a preset
    /// drawn from the generator seeded with `seed` under [`ModelSource::build_seeded`]'s lock
    /// (the same values as `build_seeded`, `into_sharded` and the cut), or a checkpoint read
    /// tensor by tensor.
    pub fn build_sharded_seeded<B: ShardBackend>(
        &self,
        device: &B::Device,
        seed: u64,
        comm: UnitComm<B::Collective>,
        min_numel: usize,
    ) -> Result<ShardedGpt2<B>, TrainError> {
        let model = |e: &dyn std::fmt::Display| TrainError::Model(e.to_string());
        match self {
            ModelSource::Preset(_) => {
                let config = self.config()?;
                let _one_at_a_time = INIT.lock().unwrap_or_else(|e| e.into_inner());
                B::seed(device, seed);
                config.init_sharded(device, comm, min_numel).map_err(|e| model(&e))
            }
            ModelSource::Pretrained(dir) => Gpt2::load_pretrained_sharded(dir, device, comm, min_numel)
                .map(|(m, _)| m)
                .map_err(|e| model(&e)),
        }
    }

    /// The model's shape, without its weights: the preset's, or the directory's config.json
    /// (checked against the shapes its weight files' headers give, so that a config.json of
    /// other sizes than its weights is named as such, not blamed on the data or the flags),
    /// so that the arguments can be checked against it before any work.
    pub fn config(&self) -> Result<Gpt2Config, TrainError> {
        match self {
            ModelSource::Preset(name) => Gpt2Config::preset(name).map_err(|e| TrainError::Model(e.to_string())),
            ModelSource::Pretrained(dir) => {
                Gpt2Config::from_pretrained_dir(dir).map_err(|e| TrainError::Model(e.to_string()))
            }
        }
    }

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

/// Whether the data (`what`, as errors name it: `--tokens batch.json`) fits the model's
/// vocabulary and positions.
pub fn check_data(data: &DataSource, what: &str, model_config: &Gpt2Config) -> Result<(), TrainError> {
    if data.max_token() as usize >= model_config.vocab_size {
        return Err(TrainError::Data(format!(
            "{what}: token id {} is outside the model's vocabulary of {}",
            data.max_token(),
            model_config.vocab_size
        )));
    }
    if data.seq_len() > model_config.n_positions {
        return Err(TrainError::Data(format!(
            "{what}: sequences of {} tokens exceed the model's n_positions {}",
            data.seq_len(),
            model_config.n_positions
        )));
    }
    Ok(())
}

/// `model` with world rank 0's weights.
pub fn same_weights_as_rank_0<B: Backend>(
    model: Gpt2<B>,
    world: &dyn ProcessGroup,
    device: &burn::tensor::Device<B>,
) -> Result<Gpt2<B>, TrainError> {
    if world.world_size() == 1 {
        return Ok(model);
    }
    let mut values: Vec<Vec<f32>> = Vec::new();
    read_values::<B, _>(&model, |_, v| values.push(v));
    let mut flat = FlatBuffer::F32(values.concat());
    world
        .broadcast(&mut flat, 0)
        .map_err(|e| TrainError::Engine(e.into()))?;
    let flat = flat.into_f32();
    let mut at = 0;
    Ok(write_values(model, device, true, |i| {
        let n = values[i].len();
        at += n;
        flat[at - n..at].to_vec()
    }))
}
