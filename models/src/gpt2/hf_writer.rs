//! Writing a HuggingFace GPT-2 directory one shard at a time: the shards come from an iterator,
//! and each is written and dropped before the next is made, so a model never has to be whole in
//! memory to be written. [`Gpt2::save_pretrained_sharded`](super::Gpt2::save_pretrained_sharded)
//! groups a model's tensors by size; [`Gpt2Config::write_random_pretrained`] makes the starting
//! checkpoint of a size that has no public weights, one transformer block per shard.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use burn::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

use super::block::Gpt2Block;
use super::checkpoint::{CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE};
use super::config::Gpt2Config;
use super::error::CheckpointError;
use super::init::{layer_norm, normal_embedding};
use super::names::{block_hf_tensors, layer_norm_hf_tensors, HF_PREFIX};

/// One shard's tensors, keyed by HuggingFace name without [`HF_PREFIX`].
pub(crate) type Shard = Vec<(String, TensorData)>;

/// Writes `config.json` and `count` safetensors shards (one `model.safetensors` when `count` is
/// 1, else `model-0000i-of-0000n.safetensors` and the index transformers reads). Every tensor's
/// name and shape is checked against `config` before its shard is written, and the set against
/// the whole model before the index is, so the directory always loads back.
pub(crate) fn write_hf_dir(
    dir: &Path,
    config: &Gpt2Config,
    count: usize,
    shards: impl Iterator<Item = Result<Shard, CheckpointError>>,
) -> Result<(), CheckpointError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CheckpointError::Io { path, source }
    };
    fs::create_dir_all(dir).map_err(io(dir))?;
    let config_path = dir.join(CONFIG_FILE);
    let json = config.to_json_string().map_err(|source| CheckpointError::Config {
        path: config_path.clone(),
        source,
    })?;
    fs::write(&config_path, json.as_bytes()).map_err(io(&config_path))?;

    let mut expected: HashMap<String, Vec<usize>> = config.param_shapes().into_iter().collect();
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0usize;
    let mut written = 0usize;
    for shard in shards {
        let shard = shard?;
        written += 1;
        let file_name = if count == 1 {
            WEIGHTS_FILE.to_string()
        } else {
            format!("model-{written:05}-of-{count:05}.safetensors")
        };
        let path = dir.join(&file_name);
        if written > count {
            return Err(CheckpointError::TensorData {
                key: file_name,
                reason: format!("more shards than the {count} announced"),
            });
        }
        let mut named = Vec::with_capacity(shard.len());
        for (name, data) in shard {
            match expected.remove(&name) {
                Some(shape) if shape == data.shape.to_vec() => {}
                Some(shape) => {
                    return Err(CheckpointError::ShapeMismatch {
                        path: config_path,
                        key: name,
                        expected: shape,
                        found: data.shape.to_vec(),
                    })
                }
                None => {
                    return Err(CheckpointError::KeyMismatch {
                        path: config_path,
                        missing: Vec::new(),
                        unexpected: vec![name],
                    })
                }
            }
            let values = data.to_vec::<f32>().map_err(|error| CheckpointError::TensorData {
                key: name.clone(),
                reason: format!("{error:?}"),
            })?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            named.push((format!("{HF_PREFIX}{name}"), data.shape.to_vec(), bytes));
        }
        let mut views = Vec::with_capacity(named.len());
        for (name, shape, bytes) in &named {
            let view =
                TensorView::new(Dtype::F32, shape.clone(), bytes).map_err(|source| CheckpointError::Safetensors {
                    path: path.clone(),
                    source,
                })?;
            views.push((name.as_str(), view));
            weight_map.insert(name.clone(), file_name.clone());
            total_size += bytes.len();
        }
        safetensors::serialize_to_file(views, metadata.clone(), &path)
            .map_err(|source| CheckpointError::Safetensors { path, source })?;
    }
    if !expected.is_empty() || written != count {
        let mut missing: Vec<String> = expected.into_keys().collect();
        missing.sort();
        return Err(CheckpointError::KeyMismatch {
            path: config_path,
            missing,
            unexpected: Vec::new(),
        });
    }

    // Whichever layout was not written must not be left over from an earlier save: a reader
    // takes `model.safetensors` before an index, and an index names files that may be gone.
    let index_path = dir.join(INDEX_FILE);
    let stale = if count > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": total_size },
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index).map_err(|source| CheckpointError::Json {
            path: index_path.clone(),
            source,
        })?;
        fs::write(&index_path, text.as_bytes()).map_err(io(&index_path))?;
        dir.join(WEIGHTS_FILE)
    } else {
        index_path
    };
    if stale.exists() {
        fs::remove_file(&stale).map_err(io(&stale))?;
    }
    Ok(())
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
