//! Reading and writing HuggingFace GPT-2 checkpoints: a directory with `config.json` and either
//! `model.safetensors` or shards listed by `model.safetensors.index.json`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use safetensors::SafeTensors;

use crate::hf::safetensors::CONFIG_FILE;
use crate::hf::safetensors::{
    read_header, read_stored, read_to_string, refuse_training_checkpoint, to_f32_data, weight_files, StoredTensor,
};

use super::config::Gpt2Config;
use super::error::{CheckpointError, Gpt2ConfigError};
use super::hf_writer::write_hf_dir;
use super::model::Gpt2;
use super::names::HF_PREFIX;
use crate::hf::writer::pack_shards;

/// The tied head's name; accepted when equal to `wte.weight`, never written.
const LM_HEAD: &str = "lm_head.weight";

impl<B: Backend> Gpt2<B> {
    /// Loads a HuggingFace GPT-2 checkpoint directory onto `device`.
    ///
    /// Tensor names may carry the `transformer.` prefix or not; a stored `lm_head.weight` must
    /// equal `wte.weight`; the attention-mask buffers older checkpoints store (`h.N.attn.bias`,
    /// `h.N.attn.masked_bias`) are skipped. F32, F16, BF16 and F64 tensors are read. Any missing
    /// or unknown tensor is an error that lists them all.
    pub fn load_pretrained(dir: impl AsRef<Path>, device: &B::Device) -> Result<(Self, Gpt2Config), CheckpointError> {
        let dir = dir.as_ref();
        let config = read_config(dir)?;

        let (files, reported_path) = weight_files(dir)?;
        // Every tensor is checked to lie within its file before a file is read whole.
        headers(&config, dir, &files)?;
        let expected: HashMap<String, Vec<usize>> = config.param_shapes().into_iter().collect();
        let mut loaded: HashMap<String, TensorData> = HashMap::with_capacity(expected.len());
        let mut unexpected = Vec::new();
        let mut lm_head: Option<(PathBuf, TensorData)> = None;

        for path in files {
            let io = |source| CheckpointError::Io {
                path: path.clone(),
                source,
            };
            // A regular file whose length its header was checked against.
            let len = fs::metadata(&path).map_err(io)?.len();
            let bytes = zero_core::files::read(&path, len).map_err(io)?;
            let file = SafeTensors::deserialize(&bytes).map_err(|source| CheckpointError::Safetensors {
                path: path.clone(),
                source,
            })?;
            for (stored_name, view) in file.iter() {
                let name = stored_name.strip_prefix(HF_PREFIX).unwrap_or(stored_name);
                if name == LM_HEAD {
                    lm_head = Some((path.clone(), to_f32_data(&path, name, &view)?));
                    continue;
                }
                if is_mask_buffer(name) {
                    continue;
                }
                let Some(shape) = expected.get(name) else {
                    unexpected.push(stored_name.to_string());
                    continue;
                };
                if view.shape() != shape.as_slice() {
                    return Err(CheckpointError::ShapeMismatch {
                        path: path.clone(),
                        key: stored_name.to_string(),
                        expected: shape.clone(),
                        found: view.shape().to_vec(),
                    });
                }
                let data = to_f32_data(&path, stored_name, &view)?;
                if loaded.insert(name.to_string(), data).is_some() {
                    return Err(CheckpointError::DuplicateKey {
                        path: path.clone(),
                        key: stored_name.to_string(),
                    });
                }
            }
        }

        let mut missing: Vec<String> = expected
            .keys()
            .filter(|name| !loaded.contains_key(*name))
            .cloned()
            .collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            missing.sort();
            unexpected.sort();
            return Err(CheckpointError::KeyMismatch {
                path: reported_path,
                missing,
                unexpected,
            });
        }
        if let Some((path, head)) = lm_head {
            let tied = loaded.get("wte.weight").is_some_and(|wte| wte == &head);
            if !tied {
                return Err(CheckpointError::UntiedHead { path });
            }
        }

        let model = Self::from_hf_tensors(&config, &mut loaded, device)?;
        Ok((model, config))
    }

    /// Writes the model as a HuggingFace checkpoint directory (created if needed):
    /// `config.json` and one `model.safetensors` with F32 tensors named as `GPT2LMHeadModel`
    /// names them, the tied head left out, as `save_pretrained` does.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>, config: &Gpt2Config) -> Result<(), CheckpointError> {
        self.save_pretrained_sharded(dir, config, usize::MAX)
    }

    /// Like [`save_pretrained`](Self::save_pretrained), but splits the weights into shards of at
    /// most `max_shard_bytes` each (a tensor larger than that gets a shard of its own) listed
    /// by `model.safetensors.index.json`, the layout transformers writes for large models. With
    /// a single shard, writes `model.safetensors` and no index.
    pub fn save_pretrained_sharded(
        &self,
        dir: impl AsRef<Path>,
        config: &Gpt2Config,
        max_shard_bytes: usize,
    ) -> Result<(), CheckpointError> {
        let dir = dir.as_ref();
        self.check_matches(config, &dir.join(CONFIG_FILE))?;
        let shards = pack_shards(self.hf_tensors(), max_shard_bytes);
        let count = shards.len();
        write_hf_dir(dir, config, count, shards.into_iter().map(Ok))
    }
}

impl<B: Backend> Gpt2<B> {
    /// Checks that `config` describes this model's parameters, so that a checkpoint is never
    /// written with a config.json that cannot load it back.
    fn check_matches(&self, config: &Gpt2Config, config_path: &Path) -> Result<(), CheckpointError> {
        let expected = config.param_shapes();
        let actual: Vec<(String, Vec<usize>)> = self
            .hf_tensors()
            .into_iter()
            .map(|(name, data)| (name, data.shape.to_vec()))
            .collect();
        let expected_names: HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        let actual_names: HashSet<&str> = actual.iter().map(|(n, _)| n.as_str()).collect();
        if expected_names != actual_names {
            let mut missing: Vec<String> = expected_names
                .difference(&actual_names)
                .map(|n| n.to_string())
                .collect();
            let mut unexpected: Vec<String> = actual_names
                .difference(&expected_names)
                .map(|n| n.to_string())
                .collect();
            missing.sort();
            unexpected.sort();
            return Err(CheckpointError::KeyMismatch {
                path: config_path.to_path_buf(),
                missing,
                unexpected,
            });
        }
        for ((name, shape), (_, expected_shape)) in actual.iter().zip(&expected) {
            if shape != expected_shape {
                return Err(CheckpointError::ShapeMismatch {
                    path: config_path.to_path_buf(),
                    key: name.clone(),
                    expected: expected_shape.clone(),
                    found: shape.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Whether `name` (without prefix) is one of the causal-mask buffers older GPT-2 checkpoints
/// store next to the parameters.
fn is_mask_buffer(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("h.") else {
        return false;
    };
    let Some((layer, buffer)) = rest.split_once('.') else {
        return false;
    };
    layer.parse::<usize>().is_ok() && (buffer == "attn.bias" || buffer == "attn.masked_bias")
}

impl Gpt2Config {
    /// The `config.json` of a HuggingFace GPT-2 directory, checked against the shapes its
    /// weight files' headers give (no weight is read): a config that contradicts its weights
    /// (another model's, or one edited) is [`CheckpointError::ConfigContradictsWeights`],
    /// naming the field, before a run holds the data or its flags against a wrong size.
    pub fn from_pretrained_dir(dir: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = dir.as_ref();
        let config = read_config(dir)?;
        let (files, _) = weight_files(dir)?;
        headers(&config, dir, &files)?;
        Ok(config)
    }
}

/// The tensors of every file in `files`, each checked to lie within its file ([`read_header`]),
/// and then the config checked against them: the sizes their shapes give
/// ([`check_config_sizes`]), then their bytes ([`room_for`]). A truncated file is named as such
/// before its size is held against the config.
fn headers(config: &Gpt2Config, dir: &Path, files: &[PathBuf]) -> Result<Vec<StoredTensor>, CheckpointError> {
    let mut all = Vec::new();
    for path in files {
        all.extend(read_header(path)?);
    }
    check_config_sizes(config, &dir.join(CONFIG_FILE), &all)?;
    room_for(config, dir, files)?;
    Ok(all)
}

/// Refuses a config whose sizes the tensors' shapes contradict, naming the first such field:
/// `n_embd` and `vocab_size` by `wte.weight` (`[vocab_size, n_embd]`), `n_positions` by
/// `wpe.weight` (`[n_positions, n_embd]`), `n_layer` by the blocks `h.{i}` stored, `n_inner` by
/// `h.0.mlp.c_fc.weight` (`[n_embd, n_inner]`). A tensor that is missing, or of another rank,
/// is left to the load's own checks, which list every missing and unexpected tensor.
fn check_config_sizes(config: &Gpt2Config, path: &Path, tensors: &[StoredTensor]) -> Result<(), CheckpointError> {
    let find = |name: &str| {
        tensors
            .iter()
            .find(|t| t.stored_name.strip_prefix(HF_PREFIX).unwrap_or(&t.stored_name) == name)
    };
    let file_name = |t: &StoredTensor| {
        t.path
            .file_name()
            .map_or_else(|| t.path.display().to_string(), |n| n.to_string_lossy().into_owned())
    };
    let contradiction = |field: &'static str, value: usize, implied: usize, evidence: String| {
        Err(CheckpointError::ConfigContradictsWeights {
            path: path.to_path_buf(),
            field,
            value,
            implied,
            evidence,
        })
    };
    let shaped = |name: &str, axis: usize| {
        find(name).filter(|t| t.shape.len() == 2).map(|t| {
            (
                t.shape[axis],
                format!("`{}` in {} is {:?}", t.stored_name, file_name(t), t.shape),
            )
        })
    };
    let by_shape = [
        ("n_embd", config.n_embd, shaped("wte.weight", 1)),
        ("vocab_size", config.vocab_size, shaped("wte.weight", 0)),
        ("n_positions", config.n_positions, shaped("wpe.weight", 0)),
    ];
    for (field, value, weights) in by_shape {
        if let Some((implied, evidence)) = weights.filter(|(implied, _)| *implied != value) {
            return contradiction(field, value, implied, evidence);
        }
    }
    // The blocks stored: `h.{i}.` names, mask buffers included (they too say a block is there).
    let blocks: BTreeMap<usize, &StoredTensor> = tensors
        .iter()
        .filter_map(|t| {
            let name = t.stored_name.strip_prefix(HF_PREFIX).unwrap_or(&t.stored_name);
            let (index, _) = name.strip_prefix("h.")?.split_once('.')?;
            Some((index.parse::<usize>().ok()?, t))
        })
        .collect();
    if let Some((&last, tensor)) = blocks.last_key_value() {
        // Blocks h.0 to h.{last}, every one there, and another count than the config's (a gap
        // among them is a missing or a stray tensor, which the load lists).
        let stored = last + 1;
        if blocks.len() == stored && stored != config.n_layer {
            return contradiction(
                "n_layer",
                config.n_layer,
                stored,
                format!("{} holds blocks h.0 to h.{last}", file_name(tensor)),
            );
        }
    }
    if let Some((implied, evidence)) = shaped("h.0.mlp.c_fc.weight", 1).filter(|(n, _)| *n != config.inner_size()) {
        let field = if config.n_inner.is_some() {
            "n_inner"
        } else {
            "n_inner (null: 4 × n_embd)"
        };
        return contradiction(field, config.inner_size(), implied, evidence);
    }
    Ok(())
}

/// Refuses a config that describes more parameters than `files` can hold (2 bytes each, the
/// smallest dtype read), before anything of the model's size is built from it.
fn room_for(config: &Gpt2Config, dir: &Path, files: &[PathBuf]) -> Result<(), CheckpointError> {
    let mut bytes = 0u64;
    for path in files {
        let meta = fs::metadata(path).map_err(|source| CheckpointError::Io {
            path: path.clone(),
            source,
        })?;
        bytes = bytes.saturating_add(meta.len());
    }
    let params = config.num_params();
    if params.saturating_mul(2) > bytes {
        return Err(CheckpointError::Config {
            path: dir.join(CONFIG_FILE),
            source: Gpt2ConfigError::MoreThanTheWeights { params, bytes },
        });
    }
    Ok(())
}

fn read_config(dir: &Path) -> Result<Gpt2Config, CheckpointError> {
    let config_path = dir.join(CONFIG_FILE);
    refuse_training_checkpoint(dir, &config_path)?;
    let json = read_to_string(&config_path)?;
    Gpt2Config::from_json_str(&json).map_err(|source| CheckpointError::Config {
        path: config_path,
        source,
    })
}

/// A checkpoint's tensors, checked against its config and located by file and offset, none of
/// them read: [`TensorIndex::read`] reads one tensor at a time, holding nothing else. What the
/// partitioned load reads from.
#[derive(Debug)]
pub(crate) struct TensorIndex {
    tensors: HashMap<String, StoredTensor>,
}

impl TensorIndex {
    /// Reads the config and the safetensors headers of a checkpoint directory and checks the
    /// tensors as [`Gpt2::load_pretrained`] does (names, shapes, the tied head).
    pub(crate) fn open(dir: &Path) -> Result<(Self, Gpt2Config), CheckpointError> {
        let config = read_config(dir)?;
        let (files, reported_path) = weight_files(dir)?;
        let stored_tensors = headers(&config, dir, &files)?;
        let expected: HashMap<String, Vec<usize>> = config.param_shapes().into_iter().collect();
        let mut tensors = HashMap::with_capacity(expected.len());
        let mut unexpected = Vec::new();
        let mut lm_head = None;
        for stored in stored_tensors {
            let name = stored
                .stored_name
                .strip_prefix(HF_PREFIX)
                .unwrap_or(&stored.stored_name)
                .to_string();
            if name == LM_HEAD {
                lm_head = Some(stored);
                continue;
            }
            if is_mask_buffer(&name) {
                continue;
            }
            let Some(shape) = expected.get(&name) else {
                unexpected.push(stored.stored_name.clone());
                continue;
            };
            if &stored.shape != shape {
                return Err(CheckpointError::ShapeMismatch {
                    path: stored.path.clone(),
                    key: stored.stored_name.clone(),
                    expected: shape.clone(),
                    found: stored.shape.clone(),
                });
            }
            let (path, key) = (stored.path.clone(), stored.stored_name.clone());
            if tensors.insert(name, stored).is_some() {
                return Err(CheckpointError::DuplicateKey { path, key });
            }
        }
        let mut missing: Vec<String> = expected.keys().filter(|n| !tensors.contains_key(*n)).cloned().collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            missing.sort();
            unexpected.sort();
            return Err(CheckpointError::KeyMismatch {
                path: reported_path,
                missing,
                unexpected,
            });
        }
        let index = TensorIndex { tensors };
        if let Some(head) = lm_head {
            // Two embedding-sized tensors for the moment of the check, as a whole load holds.
            let tied = index.read("wte.weight")? == read_stored(&head)?;
            if !tied {
                return Err(CheckpointError::UntiedHead { path: head.path });
            }
        }
        Ok((index, config))
    }

    /// One tensor (HuggingFace name without prefix), read from its file and widened to f32.
    pub(crate) fn read(&self, name: &str) -> Result<TensorData, CheckpointError> {
        let stored = self.tensors.get(name).ok_or_else(|| CheckpointError::TensorData {
            key: name.to_string(),
            reason: "not in the checkpoint".to_string(),
        })?;
        read_stored(stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognizes_mask_buffers_only() {
        assert!(is_mask_buffer("h.11.attn.bias"));
        assert!(is_mask_buffer("h.0.attn.masked_bias"));
        assert!(!is_mask_buffer("h.0.attn.c_attn.bias"));
        assert!(!is_mask_buffer("h.x.attn.bias"));
        assert!(!is_mask_buffer("ln_f.bias"));
    }
}
