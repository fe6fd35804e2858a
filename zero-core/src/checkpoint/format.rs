//! The on-disk format: one directory per tag holding one safetensors shard per rank and one
//! metadata file, and a `latest` file next to the tag directories.
//!
//! ```text
//! DIR/latest                      the newest tag (written last)
//! DIR/TAG/zero_meta.json          CheckpointMeta (written by rank 0)
//! DIR/TAG/rank_00000.safetensors  rank 0's shard: per group `g{i}.master`, `g{i}.{state}`
//! DIR/TAG/rank_00001.safetensors  ...
//! ```
//!
//! A shard holds, for every group of the layout, the rank's owned slice of the fp32 master
//! weights and of each optimizer state buffer (`exp_avg`, `exp_avg_sq`, ...), as 1-D f32
//! tensors. Replicated groups are the same on every rank and are written by rank 0 only.

use super::error::CheckpointError;
use crate::loss_scaler::LossScalerState;
use crate::partition::{PartitionLayout, Placement};
use std::path::Path;

/// Version of the format written by this crate.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the metadata file inside a tag directory.
pub const META_FILE: &str = "zero_meta.json";
/// Name of the file naming the newest tag.
pub const LATEST_FILE: &str = "latest";

/// The shard file of `rank`.
pub fn shard_file_name(rank: usize) -> String {
    format!("rank_{rank:05}.safetensors")
}

/// Name of a group's master slice in a shard file.
pub fn master_tensor(group: usize) -> String {
    format!("g{group}.master")
}

/// Name of a group's optimizer state buffer in a shard file.
pub fn state_tensor(group: usize, state: &str) -> String {
    format!("g{group}.{state}")
}

/// Whether `rank`'s shard file holds `group` (replicated groups are written by rank 0 only).
pub fn shard_holds(layout: &PartitionLayout, group: usize, rank: usize) -> bool {
    layout.groups[group].placement == Placement::Sharded || rank == 0
}

/// Length and checksums of one file of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileRecord {
    /// File name, relative to the tag directory.
    pub name: String,
    /// Length in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the whole file.
    pub crc32: u32,
    /// Length of the chunks of `chunk_crc32` (the last may be shorter).
    pub chunk_bytes: u64,
    /// CRC-32 of each chunk, so a reader checks only what it reads.
    pub chunk_crc32: Vec<u32>,
}

/// One parameter as the checkpoint records it: for people and tools reading the metadata
/// (the loader uses [`CheckpointMeta::layout`], of which this is a flat view).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamRecord {
    /// Dotted module path.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Element type of the master weights (`F32`).
    pub dtype: String,
    /// Group index in the layout.
    pub group: usize,
    /// Offset in the group's flat buffer.
    pub offset: usize,
}

/// The optimizer's part of the metadata.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerRecord {
    /// `adam`, `adamw`, `sgd`, `lamb`, `lion`.
    pub name: String,
    /// Steps the optimizer has taken (PyTorch's `state["step"]`).
    pub step: u64,
    /// Names of the state buffers each shard holds per group.
    pub state_names: Vec<String>,
    /// Where the optimizer's parameters have taken different numbers of steps (a part frozen
    /// for a while: its state starts at its first gradient), the steps of each parameter, in
    /// layout order; empty when every one has taken `step`. Left out of the file when empty, so
    /// that a checkpoint saved before the field existed re-serialises to the bytes its checksum
    /// was computed over.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub param_steps: Vec<u64>,
}

impl CheckpointMeta {
    /// The optimizer steps each group of `layout` (the loading run's, holding the same
    /// parameters) has taken: the most any of its parameters took when saved (`param_steps`, or
    /// `optimizer.step` for all). 0: the group's optimizer state has not been made yet.
    pub fn group_steps(&self, layout: &PartitionLayout) -> Vec<u64> {
        let all = self.optimizer.step;
        // Each parameter's saved count, found as its values are (canonical names, tied copies).
        let sources = match self.optimizer.param_steps.len() == self.layout.params.len() {
            true => self.param_sources(Path::new("checkpoint"), &layout.params).ok(),
            false => None,
        };
        let step = |p: usize| match &sources {
            Some(s) => self.optimizer.param_steps[s[p]],
            None => all,
        };
        layout
            .groups
            .iter()
            .map(|g| g.params.iter().map(|&p| step(p)).max().unwrap_or(all))
            .collect()
    }
}

/// The model a checkpoint holds, as a model zoo records it when it saves: how its parameter
/// names become the names its users load, and its configuration in that form. With it,
/// `zero to-fp32` writes a directory the model's own tools read (for GPT-2, a HuggingFace
/// directory) without being told which model it is.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelRecord {
    /// A naming [`super::NameMap::named`] knows (the value `zero to-fp32 --names` takes), e.g.
    /// `gpt2-hf`.
    pub naming: String,
    /// The model's configuration file in that naming's format (for `gpt2-hf`, HuggingFace's
    /// `config.json`), written beside the exported weights.
    pub config: serde_json::Value,
}

/// How one parameter of a tensor-parallel model is cut over the tensor ranks: along `axis`,
/// which holds `pieces` equal blocks (3 for a fused q|k|v projection, 1 otherwise), each block
/// cut evenly over the ranks; rank `r` holds the `r`-th part of every block, in block order.
/// With `len`, the slices were padded at the end of the axis (a vocabulary that does not split
/// evenly): the whole parameter is the first `len` along it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorSplit {
    /// The dimension that is cut.
    pub axis: usize,
    /// The equal blocks along it, each cut over the ranks.
    pub pieces: usize,
    /// The whole parameter's size along `axis` when the slices hold padding past it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<usize>,
}

impl TensorSplit {
    /// Cut along `axis` in one block.
    pub fn along(axis: usize) -> Self {
        TensorSplit {
            axis,
            pieces: 1,
            len: None,
        }
    }

    /// Cut along `axis` in `pieces` blocks.
    pub fn blocks(axis: usize, pieces: usize) -> Self {
        TensorSplit {
            axis,
            pieces,
            len: None,
        }
    }

    /// Cut along `axis` in one block, the slices padded past the whole parameter's `len`.
    pub fn padded(axis: usize, len: usize) -> Self {
        TensorSplit {
            axis,
            pieces: 1,
            len: Some(len),
        }
    }
}

/// What a checkpoint of one tensor-parallel rank holds: that rank's part of a model split over
/// `size` tensor ranks (Megatron-style), under `tensor_rank_{rank}` of the checkpoint directory.
/// The parameters `splits` names are that rank's slices; every other one is whole on every
/// tensor rank.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorParallelRecord {
    /// This tensor rank.
    pub rank: usize,
    /// The tensor ranks the model is split over.
    pub size: usize,
    /// The split parameters, by name, and how each is cut.
    pub splits: std::collections::BTreeMap<String, TensorSplit>,
}

/// Everything about a checkpoint except the tensors.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CheckpointMeta {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// The tag (the directory's name).
    pub tag: String,
    /// ZeRO stage of the run that saved.
    pub stage: u8,
    /// Number of ranks that saved.
    pub world_size: usize,
    /// Optimizer steps taken by the engine.
    pub global_step: u64,
    /// Of those, the steps skipped (fp16 overflow): the learning-rate schedule's position is
    /// `global_step - skipped_steps`. Left out of the file when 0, so that a checkpoint saved
    /// before the field existed re-serialises to the bytes its checksum was computed over.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped_steps: u64,
    /// Every parameter, in layout order.
    pub params: Vec<ParamRecord>,
    /// The flat layout of the run that saved (at `world_size`).
    pub layout: PartitionLayout,
    /// The optimizer.
    pub optimizer: OptimizerRecord,
    /// The learning rate the scheduler gives the next step; the schedule's position is
    /// `global_step`.
    pub lr_next: Option<f64>,
    /// The dynamic loss scaler, when the run used one.
    pub loss_scaler: Option<LossScalerState>,
    /// Random-number generator state of the engine, when it keeps one.
    pub rng: Option<serde_json::Value>,
    /// What the training loop passed to save (its data position, ...), returned by load.
    pub client_state: serde_json::Value,
    /// The model, when the code that saved knew it. Left out of the file when `None`, so that
    /// the metadata of a checkpoint saved without it (every one before the field existed)
    /// re-serialises to the bytes its checksum was computed over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelRecord>,
    /// With tensor parallelism: which tensor rank saved, and how its parameters are split. Left
    /// out of the file when `None`, as `model` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<TensorParallelRecord>,
    /// The shard files, by rank.
    pub files: Vec<FileRecord>,
    /// CRC-32 of this metadata serialised with this field `None`.
    pub meta_crc32: Option<u32>,
}

impl CheckpointMeta {
    /// The per-parameter records of `layout`.
    pub fn param_records(layout: &PartitionLayout) -> Vec<ParamRecord> {
        let places = layout.places();
        layout
            .params
            .iter()
            .zip(places)
            .map(|(p, place)| ParamRecord {
                name: p.name.clone(),
                shape: p.shape.clone(),
                dtype: "F32".into(),
                group: place.group,
                offset: place.offset,
            })
            .collect()
    }

    /// CRC-32 of the metadata serialised with `meta_crc32` None: what `meta_crc32` records.
    pub(crate) fn content_crc(&self) -> u32 {
        let mut unsealed = self.clone();
        unsealed.meta_crc32 = None;
        // A reader recomputes the same bytes from what it parsed: serialising a struct of plain
        // values is deterministic, every float is finite ([`check_finite`]) and, with serde_json's
        // `float_roundtrip`, parses back to the very value that was written.
        let bytes = serde_json::to_vec(&unsealed).unwrap_or_default();
        crc32fast::hash(&bytes)
    }

    /// The metadata file's bytes, with its own checksum filled in; refuses a value that would
    /// not read back (a NaN or infinite float, which JSON cannot hold).
    pub fn to_bytes(&self) -> Result<Vec<u8>, CheckpointError> {
        check_finite(self.lr_next, self.loss_scaler.as_ref())?;
        let mut sealed = self.clone();
        sealed.meta_crc32 = Some(self.content_crc());
        serde_json::to_vec_pretty(&sealed)
            .map_err(|e| CheckpointError::Usage(format!("cannot serialise the checkpoint metadata: {e}")))
    }

    /// Parses and verifies a metadata file's bytes (`path` is for the error messages).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, CheckpointError> {
        let bad = |detail: String| CheckpointError::Metadata {
            path: path.to_path_buf(),
            detail,
        };
        let meta: CheckpointMeta = serde_json::from_slice(bytes).map_err(|e| bad(format!("not readable JSON: {e}")))?;
        if meta.format_version != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {} (this build reads version {FORMAT_VERSION})",
                meta.format_version
            )));
        }
        match meta.meta_crc32 {
            Some(recorded) if recorded == meta.content_crc() => {}
            Some(recorded) => {
                return Err(bad(format!(
                    "checksum mismatch (recorded {recorded:08x}, content {:08x}): the file was altered",
                    meta.content_crc()
                )))
            }
            None => return Err(bad("no meta_crc32".into())),
        }
        meta.validate().map_err(bad)?;
        Ok(meta)
    }

    /// Internal consistency: one file per rank, and a layout for the recorded world size that
    /// is exactly what the layout rule makes of the recorded shapes (each group's parameters
    /// back to back from offset 0, its size their sum, padded to the smallest multiple of
    /// `world × alignment`), with parameter records that agree with it. So a shape edited in
    /// the file (and the checksum re-sealed) is found here, by every reader, unless every size
    /// that follows from it was edited too, in which case the shard headers no longer match.
    fn validate(&self) -> Result<(), String> {
        if self.stage > 3 {
            return Err(format!("ZeRO stage {} (0 to 3)", self.stage));
        }
        // Steps the optimizer applied, and the skipped ones, are among the engine's steps.
        if self.optimizer.step > self.global_step || self.skipped_steps > self.global_step {
            return Err(format!(
                "the optimizer took {} steps and {} were skipped, of only {} (global_step)",
                self.optimizer.step, self.skipped_steps, self.global_step
            ));
        }
        if !self.optimizer.param_steps.is_empty() && self.optimizer.param_steps.len() != self.layout.params.len() {
            return Err(format!(
                "{} per-parameter optimizer step counts for {} parameters",
                self.optimizer.param_steps.len(),
                self.layout.params.len()
            ));
        }
        if self.optimizer.param_steps.iter().any(|&s| s > self.optimizer.step) {
            return Err(format!(
                "a parameter's optimizer step count is above the optimizer's {}",
                self.optimizer.step
            ));
        }
        if self.layout.alignment == 0 {
            return Err("the layout's alignment is 0".into());
        }
        if self.world_size == 0 || self.layout.world_size != self.world_size {
            return Err(format!(
                "world size {} but the layout is cut for {}",
                self.world_size, self.layout.world_size
            ));
        }
        if self.files.len() != self.world_size {
            return Err(format!(
                "{} shard files listed for world size {}",
                self.files.len(),
                self.world_size
            ));
        }
        let numels = self
            .layout
            .params
            .iter()
            .map(|p| {
                p.shape
                    .iter()
                    .try_fold(1usize, |n, &d| n.checked_mul(d))
                    .ok_or_else(|| format!("parameter `{}` has shape {:?}, too large to address", p.name, p.shape))
            })
            .collect::<Result<Vec<usize>, String>>()?;
        let mut seen = vec![0u32; self.layout.params.len()];
        for (gi, g) in self.layout.groups.iter().enumerate() {
            if g.params.len() != g.offsets.len() {
                return Err(format!(
                    "group {gi}: {} parameters but {} offsets",
                    g.params.len(),
                    g.offsets.len()
                ));
            }
            let mut end = 0usize;
            for (&p, &offset) in g.params.iter().zip(&g.offsets) {
                let (spec, numel) = self
                    .layout
                    .params
                    .get(p)
                    .zip(numels.get(p))
                    .ok_or_else(|| format!("group {gi} names parameter {p}"))?;
                if offset != end {
                    return Err(format!(
                        "group {gi}: parameter `{}` at offset {offset}, but the parameters before it end at {end} \
                         (the recorded shapes disagree with the layout)",
                        spec.name
                    ));
                }
                seen[p] += 1;
                end = end
                    .checked_add(*numel)
                    .ok_or_else(|| format!("group {gi}: sizes too large to address"))?;
            }
            let padded = match g.placement {
                Placement::Sharded => self
                    .world_size
                    .checked_mul(self.layout.alignment.max(1))
                    .and_then(|unit| end.div_ceil(unit).max(1).checked_mul(unit)),
                Placement::Replicated => Some(end),
            };
            if g.numel != end || Some(g.padded) != padded {
                return Err(format!(
                    "group {gi}: numel {} and padded {}, but its parameters' shapes make {end} elements, \
                     padded {} (the recorded shapes disagree with the layout)",
                    g.numel,
                    g.padded,
                    padded.map_or("beyond addressable".to_string(), |p| p.to_string())
                ));
            }
        }
        if let Some(p) = seen.iter().position(|&c| c != 1) {
            return Err(format!(
                "parameter `{}` is in {} groups",
                self.layout.params[p].name, seen[p]
            ));
        }
        if self.params != Self::param_records(&self.layout) {
            return Err("the parameter records disagree with the layout".into());
        }
        Ok(())
    }
}

/// Refuses the floats of the metadata that JSON cannot hold (NaN, infinities): written, they
/// would become `null` and the checkpoint would not read back. Named by their dotted field.
pub(crate) fn check_finite(lr_next: Option<f64>, loss_scaler: Option<&LossScalerState>) -> Result<(), CheckpointError> {
    let fields = [
        ("lr_next", lr_next),
        ("loss_scaler.cur_scale", loss_scaler.map(|s| s.cur_scale)),
    ];
    match fields.into_iter().find(|(_, v)| v.is_some_and(|v| !v.is_finite())) {
        Some((field, Some(value))) => Err(CheckpointError::NotFinite { field, value }),
        _ => Ok(()),
    }
}

/// The most bytes read from a checkpoint's metadata: it lists every parameter and file, a few
/// KiB for GPT-2; a file far longer is not metadata, and is refused instead of filling memory.
pub const MAX_META_BYTES: u64 = 256 << 20;

/// Checks that a tag can be a directory name of its own.
pub fn check_tag(dir: &Path, tag: &str) -> Result<(), CheckpointError> {
    let ok = !tag.is_empty()
        && tag != "."
        && tag != ".."
        && !tag.starts_with('.')
        && tag != LATEST_FILE
        && !tag.contains(['/', '\\', '\0'])
        && !tag.ends_with(".partial")
        && !tag.ends_with(".replaced");
    if ok {
        Ok(())
    } else {
        Err(CheckpointError::Tag {
            path: dir.to_path_buf(),
            detail: format!(
                "`{tag}` cannot be a tag: it must be a plain directory name (no `/`, no leading `.`, not `latest`)"
            ),
        })
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
