//! Writing a HuggingFace checkpoint directory one shard at a time, whatever the architecture:
//! the shards come from an iterator, and each is written and dropped before the next is made, so
//! a model never has to be whole in memory to be written.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use burn::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

use super::error::CheckpointError;
use super::safetensors::{CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE};

/// One shard's tensors, keyed by HuggingFace name without the architecture's prefix.
pub(crate) type Shard = Vec<(String, TensorData)>;

/// `tensors` in order, grouped into shards of at most `max_shard_bytes` of f32 each (a tensor
/// larger than that gets a shard of its own), so that the writer knows the shard count its file
/// names carry.
pub(crate) fn pack_shards(tensors: Vec<(String, TensorData)>, max_shard_bytes: usize) -> Vec<Shard> {
    let mut shards: Vec<Shard> = vec![Vec::new()];
    let mut shard_bytes = 0usize;
    for (name, data) in tensors {
        let bytes = data.num_elements() * std::mem::size_of::<f32>();
        if !shards[shards.len() - 1].is_empty() && shard_bytes + bytes > max_shard_bytes {
            shards.push(Vec::new());
            shard_bytes = 0;
        }
        let current = shards.len() - 1;
        shards[current].push((name, data));
        shard_bytes += bytes;
    }
    shards
}

/// Writes `config_json` as `config.json` and `count` safetensors shards (one
/// `model.safetensors` when `count` is 1, else `model-0000i-of-0000n.safetensors` and the index
/// transformers reads), each tensor stored as `prefix` + its name. Every tensor's name and shape
/// is checked against `expected` (the config's parameters) before its shard is written, and the
/// set against the whole model before the index is, so the directory always loads back.
pub(crate) fn write_hf_dir(
    dir: &Path,
    config_json: &str,
    mut expected: HashMap<String, Vec<usize>>,
    prefix: &str,
    count: usize,
    shards: impl Iterator<Item = Result<Shard, CheckpointError>>,
) -> Result<(), CheckpointError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CheckpointError::Io { path, source }
    };
    fs::create_dir_all(dir).map_err(io(dir))?;
    let config_path = dir.join(CONFIG_FILE);
    fs::write(&config_path, config_json.as_bytes()).map_err(io(&config_path))?;

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
            named.push((format!("{prefix}{name}"), data.shape.to_vec(), bytes));
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
