//! Reading and writing HuggingFace checkpoint directories of the Llama family: `config.json`
//! and either `model.safetensors` or shards listed by `model.safetensors.index.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::prelude::*;

use super::block::LlamaDecoderLayer;
use super::config::LlamaConfig;
use super::init::{normal_embedding, normal_linear, rms_norm};
use super::model::Llama;
use super::names::{host, layer_hf_tensors, EMBED_TOKENS, LM_HEAD, NORM};
use crate::hf::safetensors::{
    read_header, read_stored, read_to_string, refuse_training_checkpoint, weight_files, StoredTensor, CONFIG_FILE,
};
use crate::hf::writer::{pack_shards, write_hf_dir, Shard};
use crate::hf::CheckpointError;

impl<B: Backend> Llama<B> {
    /// Loads a HuggingFace directory of a Llama-family model (`config.json`'s `model_type`
    /// one of llama, qwen2, qwen3, mistral) onto `device`, as transformers'
    /// `AutoModelForCausalLM.from_pretrained` would.
    ///
    /// The weights are read tensor by tensor from `model.safetensors` or the shards of
    /// `model.safetensors.index.json`; F32, F16, BF16 and F64 are widened to f32. A stored
    /// `lm_head.weight` of a tied model must equal the embedding; the rotary `inv_freq` buffers
    /// older checkpoints store are skipped. Every missing or unexpected tensor is listed in one
    /// error; a tensor of another shape is named with both shapes.
    pub fn load_pretrained(dir: impl AsRef<Path>, device: &B::Device) -> Result<(Self, LlamaConfig), CheckpointError> {
        let (index, config) = LlamaCheckpoint::open(dir.as_ref())?;
        let mut tensors = HashMap::new();
        for (name, _) in config.param_shapes() {
            let data = index.read(&name)?;
            tensors.insert(name, data);
        }
        let model = Self::from_hf_tensors(&config, &mut tensors, device)?;
        Ok((model, config))
    }

    /// Writes the model as a HuggingFace directory (created if needed): `config.json` and one
    /// `model.safetensors` of F32 tensors named and laid out as transformers saves them (a tied
    /// head left out), which `from_pretrained` loads.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>, config: &LlamaConfig) -> Result<(), CheckpointError> {
        self.save_pretrained_sharded(dir, config, usize::MAX)
    }

    /// Like [`save_pretrained`](Self::save_pretrained), but splits the weights into shards of at
    /// most `max_shard_bytes` each (a tensor larger than that gets a shard of its own) listed by
    /// `model.safetensors.index.json`. With a single shard, writes `model.safetensors` and no
    /// index.
    pub fn save_pretrained_sharded(
        &self,
        dir: impl AsRef<Path>,
        config: &LlamaConfig,
        max_shard_bytes: usize,
    ) -> Result<(), CheckpointError> {
        let dir = dir.as_ref();
        let shards = pack_shards(self.hf_tensors(), max_shard_bytes);
        let count = shards.len();
        let expected = config.param_shapes().into_iter().collect();
        write_hf_dir(
            dir,
            &config.to_json_string(),
            expected,
            "",
            count,
            shards.into_iter().map(Ok),
        )
    }
}

impl LlamaConfig {
    /// Writes a randomly initialized model of this configuration as a HuggingFace directory
    /// (`config.json`, one shard for the embedding, one per decoder layer, one for an untied
    /// head, and the index), drawing one unit at a time: the most it holds is one unit, never
    /// the model. The initialization is [`init`](Self::init)'s, in its order; seed the backend
    /// first for a reproducible directory. `progress(done, units)` is called before each unit
    /// is drawn, with the units written so far.
    pub fn write_random_pretrained<B: Backend>(
        &self,
        dir: impl AsRef<Path>,
        device: &B::Device,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<(), CheckpointError> {
        let dir = dir.as_ref();
        self.validate().map_err(|source| CheckpointError::LlamaConfig {
            path: dir.join(CONFIG_FILE),
            source,
        })?;
        let (h, std) = (self.hidden_size, self.initializer_range);
        let layers = self.num_hidden_layers;
        let units = layers + 1 + usize::from(!self.tie_word_embeddings);
        let shards = (0..units).map(|unit| -> Result<Shard, CheckpointError> {
            progress(unit, units);
            if unit == 0 {
                let embed = normal_embedding::<B>(self.vocab_size, h, std, device);
                return Ok(vec![(EMBED_TOKENS.to_string(), host(embed.weight.val()))]);
            }
            if unit > layers {
                let head = normal_linear::<B>(h, self.vocab_size, false, std, device);
                return Ok(vec![(LM_HEAD.to_string(), host(head.weight.val().transpose()))]);
            }
            let layer = unit - 1;
            let mut shard = layer_hf_tensors(&LlamaDecoderLayer::<B>::new(self, device), layer);
            if layer + 1 == layers {
                let norm = rms_norm::<B>(h, self.rms_norm_eps, device);
                shard.push((NORM.to_string(), host(norm.gamma.val())));
            }
            Ok(shard)
        });
        let expected = self.param_shapes().into_iter().collect();
        write_hf_dir(dir, &self.to_json_string(), expected, "", units, shards)
    }

    /// The `config.json` of a HuggingFace directory of the Llama family, checked against the
    /// names and shapes its weight files' headers give (no weight is read).
    pub fn from_pretrained_dir(dir: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        Ok(LlamaCheckpoint::open(dir.as_ref())?.1)
    }

    /// Reads and validates a `config.json` file, naming the file in the error.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let path = path.as_ref();
        let json = read_to_string(path)?;
        Self::from_json_str(&json).map_err(|source| CheckpointError::LlamaConfig {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// A checkpoint's tensors, checked against its config (every parameter there, of its shape,
/// nothing else) and located by file and offset, none of them read: [`LlamaCheckpoint::read`]
/// reads one at a time. What the whole and the partitioned load read from.
#[derive(Debug)]
pub(crate) struct LlamaCheckpoint {
    tensors: HashMap<String, StoredTensor>,
}

impl LlamaCheckpoint {
    /// Reads the config and the safetensors headers of a checkpoint directory and checks the
    /// tensors against the config.
    pub(crate) fn open(dir: &Path) -> Result<(Self, LlamaConfig), CheckpointError> {
        let config_path = dir.join(CONFIG_FILE);
        refuse_training_checkpoint(dir, &config_path)?;
        let config = LlamaConfig::from_json_file(&config_path)?;
        let (files, reported_path) = weight_files(dir)?;
        let expected: HashMap<String, Vec<usize>> = config.param_shapes().into_iter().collect();
        let mut tensors = HashMap::with_capacity(expected.len());
        let mut unexpected = Vec::new();
        let mut tied_head: Option<StoredTensor> = None;
        for path in &files {
            for stored in read_header(path)? {
                let name = stored.stored_name.clone();
                if name.ends_with(".rotary_emb.inv_freq") {
                    continue;
                }
                if name == LM_HEAD && config.tie_word_embeddings {
                    tied_head = Some(stored);
                    continue;
                }
                let Some(shape) = expected.get(&name) else {
                    unexpected.push(name);
                    continue;
                };
                if &stored.shape != shape {
                    return Err(CheckpointError::ShapeMismatch {
                        path: stored.path.clone(),
                        key: name,
                        expected: shape.clone(),
                        found: stored.shape.clone(),
                    });
                }
                let path: PathBuf = stored.path.clone();
                if tensors.insert(name.clone(), stored).is_some() {
                    return Err(CheckpointError::DuplicateKey { path, key: name });
                }
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
        let index = Self { tensors };
        if let Some(head) = tied_head {
            let tied = index.read(EMBED_TOKENS)? == read_stored(&head)?;
            if !tied {
                return Err(CheckpointError::UntiedHead { path: head.path });
            }
        }
        Ok((index, config))
    }

    /// One tensor by HuggingFace name, read from its file and widened to f32.
    pub(crate) fn read(&self, name: &str) -> Result<TensorData, CheckpointError> {
        let stored = self.tensors.get(name).ok_or_else(|| CheckpointError::TensorData {
            key: name.to_string(),
            reason: "not in the checkpoint".to_string(),
        })?;
        read_stored(stored)
    }
}
