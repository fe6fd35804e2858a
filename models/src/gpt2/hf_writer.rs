//! Writing a HuggingFace GPT-2 directory one shard at a time: the shards come from an iterator,
//! and each is written and dropped before the next is made, so a model never has to be whole in
//! memory to be written. [`Gpt2::save_pretrained_sharded`](super::Gpt2::save_pretrained_sharded)
//! groups a model's tensors by size; [`Gpt2Config::write_random_pretrained`] makes the starting
//! checkpoint of a size that has no public weights, one transformer block per shard.

use std::collections::HashMap;
use std::path::Path;

use burn::prelude::*;

pub(crate) use crate::hf::writer::Shard;

use super::block::Gpt2Block;
use super::config::Gpt2Config;
use super::error::CheckpointError;
use super::init::{layer_norm, normal_embedding};
use super::names::{block_hf_tensors, layer_norm_hf_tensors, HF_PREFIX};
use crate::hf::CONFIG_FILE;

/// Writes `config.json` and `count` safetensors shards of GPT-2 ([`crate::hf::writer::write_hf_dir`]
/// with GPT-2's names, prefix and config).
pub(crate) fn write_hf_dir(
    dir: &Path,
    config: &Gpt2Config,
    count: usize,
    shards: impl Iterator<Item = Result<Shard, CheckpointError>>,
) -> Result<(), CheckpointError> {
    let json = config.to_json_string().map_err(|source| CheckpointError::Config {
        path: dir.join(CONFIG_FILE),
        source,
    })?;
    let expected: HashMap<String, Vec<usize>> = config.param_shapes().into_iter().collect();
    crate::hf::writer::write_hf_dir(dir, &json, expected, HF_PREFIX, count, shards)
}

impl Gpt2Config {
    /// Writes a randomly initialized GPT-2 of this configuration as a HuggingFace directory
    /// (`config.json`, one shard for the embeddings and one per transformer block, and the
    /// index), building one unit at a time: the most it holds is one block (or the embeddings),
    /// never the model. The initialization is [`init`](Self::init)'s; seed the backend first
    /// for a reproducible directory. `progress(done, units)` is called before each unit is
    /// drawn, with the units written so far.
    pub fn write_random_pretrained<B: Backend>(
        &self,
        dir: impl AsRef<Path>,
        device: &B::Device,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<(), CheckpointError> {
        self.validate().map_err(|e| CheckpointError::TensorData {
            key: CONFIG_FILE.into(),
            reason: e.to_string(),
        })?;
        let d = self.n_embd;
        let layers = self.n_layer;
        let shards = (0..=layers).map(|unit| -> Result<Shard, CheckpointError> {
            progress(unit, layers + 1);
            if unit == 0 {
                let wte = normal_embedding::<B>(self.vocab_size, d, self.initializer_range, device);
                let wpe = normal_embedding::<B>(self.n_positions, d, self.initializer_range, device);
                return Ok(vec![
                    ("wte.weight".to_string(), wte.weight.val().into_data()),
                    ("wpe.weight".to_string(), wpe.weight.val().into_data()),
                ]);
            }
            let layer = unit - 1;
            let mut shard = block_hf_tensors(&Gpt2Block::<B>::new(self, layer, device), layer);
            if layer + 1 == layers {
                let ln_f = layer_norm::<B>(d, self.layer_norm_epsilon, device);
                layer_norm_hf_tensors(&mut shard, "ln_f", &ln_f);
            }
            Ok(shard)
        });
        write_hf_dir(dir.as_ref(), self, layers + 1, shards)
    }
}
