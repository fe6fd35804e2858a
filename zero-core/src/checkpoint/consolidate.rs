//! Consolidated weights: every parameter whole, under its (possibly renamed) name, in a plain
//! safetensors file that any tool reads — from a checkpoint on disk (`zero to-fp32`), or from a
//! running engine's gathered groups (the 16-bit save of a stage-3 model).
//!
//! Both stream: the header is computed from the layout first, then one tensor at a time is
//! assembled and written, so the memory held is one tensor plus a read buffer per shard file,
//! never the model (a tensor the naming transposes, [`TensorLayout::Transposed`], is turned
//! into a second buffer of its size on its way out).

use super::error::CheckpointError;
use super::format::{CheckpointMeta, FileRecord};
use super::load::Checkpoint;
use super::names::{ExportedTensor, NameMap, TensorLayout, INTERNAL_NAMING};
use super::reader::ShardReader;
use super::reshard::param_sources;
use super::tensor_parallel::TensorParallelCheckpoint;
use super::writer::{HalfDtype, SafetensorsStream, TensorEntry};
use crate::partition::PartitionLayout;
use safetensors::tensor::Dtype;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// Name of the single consolidated file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the index of a sharded export (HuggingFace's convention).
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of the model's configuration beside the exported weights (HuggingFace's convention).
pub const CONFIG_FILE: &str = "config.json";

/// How an export names its tensors, and the model configuration that goes with those names.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportNaming {
    /// The naming's rules.
    pub names: NameMap,
    /// The model's configuration, to write as [`CONFIG_FILE`] beside the weights: the recorded
    /// one, when the export uses the naming it was recorded for.
    pub config: Option<serde_json::Value>,
}

impl ExportNaming {
    /// The naming of an export of the checkpoint described by `meta`: `requested` (a name of
    /// [`super::names::NAMINGS`]) when given, else the naming the checkpoint records
    /// ([`super::ModelRecord`]), else the engine's own names. The recorded configuration comes
    /// along only with the naming it belongs to, so `internal` (or another naming) exports
    /// bare weights.
    pub fn resolve(meta: &CheckpointMeta, requested: Option<&str>) -> Result<Self, CheckpointError> {
        let recorded = meta.model.as_ref();
        let naming = requested
            .or(recorded.map(|m| m.naming.as_str()))
            .unwrap_or(INTERNAL_NAMING);
        let names = NameMap::named(naming).map_err(|e| {
            CheckpointError::Usage(match requested {
                Some(_) => e,
                None => format!(
                    "the checkpoint `{}` records the naming of its model, but: {e}; choose one with --names",
                    meta.tag
                ),
            })
        })?;
        let config = recorded
            .filter(|m| m.naming == naming && naming != INTERNAL_NAMING)
            .map(|m| m.config.clone());
        Ok(ExportNaming { names, config })
    }
}

/// Writes `config` as `out_dir`/[`CONFIG_FILE`] (atomically); returns its path.
pub fn write_model_config(out_dir: &Path, config: &serde_json::Value) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(out_dir).map_err(|e| CheckpointError::io(out_dir, "create", e))?;
    let path = out_dir.join(CONFIG_FILE);
    let text = serde_json::to_vec_pretty(config)
        .map_err(|e| CheckpointError::Usage(format!("cannot serialise the model configuration: {e}")))?;
    super::atomic::write_file(&path, &text)?;
    Ok(path)
}

/// What [`to_fp32`] wrote.
#[derive(Clone, Debug)]
pub struct ConsolidateReport {
    /// The safetensors files, in order.
    pub files: Vec<PathBuf>,
    /// The index file, when the export is sharded.
    pub index: Option<PathBuf>,
    /// The model's configuration written beside the weights ([`export_fp32`] with a config).
    pub config: Option<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of values written.
    pub value_bytes: u64,
    /// Bytes of the largest tensor: about what the conversion holds in memory (twice that when
    /// the tensor is transposed on its way out).
    pub largest_tensor_bytes: u64,
}

/// The exported parameters, in layout order, with their new names and layouts; checks that no
/// two share a name, that a transposed one is 2-D, and that the renaming leaves at least one
/// (an empty weights file is never what was meant).
fn exported_params(
    layout: &PartitionLayout,
    names: &dyn Fn(&str) -> Option<ExportedTensor>,
) -> Result<Vec<(usize, ExportedTensor)>, CheckpointError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, p) in layout.params.iter().enumerate() {
        if let Some(new) = names(&p.name) {
            if !seen.insert(new.name.clone()) {
                return Err(CheckpointError::Usage(format!(
                    "two parameters are both named `{}` after renaming",
                    new.name
                )));
            }
            if new.layout == TensorLayout::Transposed && p.shape.len() != 2 {
                return Err(CheckpointError::Usage(format!(
                    "parameter `{}` (exported as `{}`) has shape {:?}, but the naming transposes it, which only a \
                     2-D tensor can be: the checkpoint holds another model than the naming's (choose another with \
                     --names)",
                    p.name, new.name, p.shape
                )));
            }
            out.push((i, new));
        }
    }
    if out.is_empty() {
        return Err(CheckpointError::Usage(format!(
            "the renaming rules leave none of the {} parameters to export (a `!PREFIX` rule drops every name \
             starting with PREFIX; `!` alone drops them all)",
            layout.params.len()
        )));
    }
    Ok(out)
}

/// Every shard file of `checkpoint`, opened, its length, header and tensors checked against the
/// metadata's layout (the check a load makes).
fn open_shards(checkpoint: &Checkpoint) -> Result<BTreeMap<usize, ShardReader>, CheckpointError> {
    (0..checkpoint.meta.world_size)
        .map(|rank| Ok((rank, checkpoint.open_shard(rank)?)))
        .collect()
}

/// Reads parameter `p` of `checkpoint`'s layout, whole over its data-parallel ranks, into
/// `values` (of its length).
fn read_param(
    checkpoint: &Checkpoint,
    readers: &mut BTreeMap<usize, ShardReader>,
    places: &[crate::partition::ParamPlace],
    p: usize,
    values: &mut [f32],
) -> Result<(), CheckpointError> {
    let layout = &checkpoint.meta.layout;
    for piece in param_sources(layout, places, p, 0..values.len(), 0) {
        let reader = readers.get_mut(&piece.file_rank).ok_or_else(|| {
            CheckpointError::Usage(format!("no shard file of rank {} in the checkpoint", piece.file_rank))
        })?;
        reader.read_f32(
            &super::format::master_tensor(piece.group),
            piece.src,
            &mut values[piece.dst],
        )?;
    }
    Ok(())
}

/// Parses a size in bytes: a count (`1000000`, `120e9`, `1_000_000`) with an optional unit,
/// B, KB, MB, GB, TB, PB, EB (powers of 1000) or KiB, MiB, GiB, TiB, PiB, EiB (powers of 1024),
/// in any case. Every size a tool takes (`zero to-fp32 --max-shard-size`, `zero estimate
/// --fit-host-memory`) is read here.
pub fn parse_size(text: &str) -> Result<u64, String> {
    const UNITS: [(&str, f64); 13] = [
        ("KIB", 1024.0),
        ("MIB", 1048576.0),
        ("GIB", 1073741824.0),
        ("TIB", 1099511627776.0),
        ("PIB", 1125899906842624.0),
        ("EIB", 1152921504606846976.0),
        ("KB", 1e3),
        ("MB", 1e6),
        ("GB", 1e9),
        ("TB", 1e12),
        ("PB", 1e15),
        ("EB", 1e18),
        ("B", 1.0),
    ];
    let clean = text.trim().replace(['_', ','], "");
    let upper = clean.to_ascii_uppercase();
    // The unit is the suffix (the longest that matches: `16EiB` is 16 EiB, not 16e and `iB`);
    // what precedes it is the number, exponent included (`120e9`).
    let (number, scale) = match UNITS.iter().find(|(unit, _)| upper.ends_with(unit)) {
        Some(&(unit, scale)) => (&clean[..clean.len() - unit.len()], scale),
        None => (clean.as_str(), 1.0),
    };
    if let Some(at) = number.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E') {
        return Err(format!(
            "{text}: unknown unit `{}` (B, KB, MB, GB, TB, PB, EB, KiB, MiB, GiB, TiB, PiB or EiB)",
            clean[at..].trim()
        ));
    }
    // Below 1.8e19 (2^64 is 1.845e19) the cast is exact enough; at or above it, it would
    // saturate.
    match number.trim().parse::<f64>().map(|v| v * scale) {
        Ok(bytes) if (1.0..1.8e19).contains(&bytes) => Ok(bytes as u64),
        Ok(bytes) if bytes >= 1.8e19 && bytes.is_finite() => Err(format!(
            "{text}: 1.8e19 bytes (about 16 EiB) or more, more than any machine holds"
        )),
        _ => Err(format!("{text}: expected a positive size such as 5GB, 128GiB or 120e9")),
    }
}

/// Writes the checkpoint's fp32 weights, whole, into `out_dir`: `model.safetensors`, or, when
/// they exceed `max_shard_bytes`, `model-0000i-of-0000n.safetensors` files and
/// `model.safetensors.index.json`. `names` renames or drops parameters (see
/// [`super::NameMap::apply`]; dropping every one is an error); each is written as stored. A
/// naming that also transposes tensors (`llama-hf`) goes through [`export_fp32`] with
/// [`NameMap::export`]. Nothing is written until every shard
/// file has been opened and checked against the metadata's layout as a load checks it, and
/// every chunk read is verified against the checkpoint's checksums. One tensor rank's part of a
/// tensor-parallel checkpoint is refused: [`to_fp32_tensor_parallel`] converts them together.
/// A conversion that fails leaves nothing it created ([`export_fp32`]).
pub fn to_fp32(
    checkpoint: &Checkpoint,
    out_dir: &Path,
    max_shard_bytes: Option<u64>,
    names: &dyn Fn(&str) -> Option<String>,
) -> Result<ConsolidateReport, CheckpointError> {
    export_fp32(
        Fp32Source::Checkpoint(checkpoint),
        out_dir,
        max_shard_bytes,
        &|n| names(n).map(ExportedTensor::as_stored),
        None,
    )
}

/// The checkpoint a conversion reads: one, or every tensor rank's of a tensor-parallel one.
#[derive(Clone, Copy, Debug)]
pub enum Fp32Source<'a> {
    /// A checkpoint of a model not split over tensor ranks.
    Checkpoint(&'a Checkpoint),
    /// A tensor-parallel checkpoint, whose split parameters are merged.
    TensorParallel(&'a TensorParallelCheckpoint),
}

/// [`to_fp32`] or [`to_fp32_tensor_parallel`] of `source`, each parameter named and laid out
/// as `names` says ([`NameMap::export`] of an [`ExportNaming`]'s names: a
/// [`TensorLayout::Transposed`] one is written `[cols, rows]`, turned as it streams out), with
/// the model's `config` (when given) written beside the weights as [`CONFIG_FILE`] in the same
/// step: every file is staged inside `out_dir` and moved into place once all are whole, so that
/// a conversion that fails leaves nothing it created (neither files nor the directories it made
/// for `out_dir`), and the files of an earlier export in `out_dir` as they were. What `zero
/// to-fp32` runs.
pub fn export_fp32(
    source: Fp32Source<'_>,
    out_dir: &Path,
    max_shard_bytes: Option<u64>,
    names: &dyn Fn(&str) -> Option<ExportedTensor>,
    config: Option<&serde_json::Value>,
) -> Result<ConsolidateReport, CheckpointError> {
    match source {
        Fp32Source::Checkpoint(c) => export_single(c, out_dir, max_shard_bytes, names, config),
        Fp32Source::TensorParallel(tp) => export_tensor_parallel(tp, out_dir, max_shard_bytes, names, config),
    }
}

fn export_single(
    checkpoint: &Checkpoint,
    out_dir: &Path,
    max_shard_bytes: Option<u64>,
    names: &dyn Fn(&str) -> Option<ExportedTensor>,
    config: Option<&serde_json::Value>,
) -> Result<ConsolidateReport, CheckpointError> {
    if let Some(tp) = checkpoint.meta.tensor_parallel.as_ref().filter(|tp| tp.size > 1) {
        let whole = checkpoint
            .tag_dir
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new(".."));
        return Err(CheckpointError::Usage(format!(
            "{} is tensor rank {} of {}: its split parameters are slices; convert {}, which holds every tensor \
             rank, and the slices are merged",
            checkpoint.tag_dir.display(),
            tp.rank,
            tp.size,
            whole.display()
        )));
    }
    let layout = &checkpoint.meta.layout;
    let params = exported_params(layout, names)?;
    // Checked before anything is written: a checkpoint the trainer would refuse is refused here
    // too, and leaves no partial output behind.
    let mut readers = open_shards(checkpoint)?;
    let places = layout.places();
    let tensors = params
        .into_iter()
        .map(|(p, exported)| PlannedTensor::new(p, exported, layout.params[p].shape.clone()))
        .collect();
    write_export(
        out_dir,
        max_shard_bytes,
        tensors,
        &mut |p, values| read_param(checkpoint, &mut readers, &places, p, values),
        config,
    )
}

/// [`to_fp32`] of a tensor-parallel checkpoint: every parameter whole, a split one merged from
/// each tensor rank's slice ([`super::merge_slices`]), a replicated one from tensor rank 0.
/// Holds one tensor and its slices at a time.
pub fn to_fp32_tensor_parallel(
    checkpoint: &TensorParallelCheckpoint,
    out_dir: &Path,
    max_shard_bytes: Option<u64>,
    names: &dyn Fn(&str) -> Option<String>,
) -> Result<ConsolidateReport, CheckpointError> {
    export_fp32(
        Fp32Source::TensorParallel(checkpoint),
        out_dir,
        max_shard_bytes,
        &|n| names(n).map(ExportedTensor::as_stored),
        None,
    )
}

fn export_tensor_parallel(
    checkpoint: &TensorParallelCheckpoint,
    out_dir: &Path,
    max_shard_bytes: Option<u64>,
    names: &dyn Fn(&str) -> Option<ExportedTensor>,
    config: Option<&serde_json::Value>,
) -> Result<ConsolidateReport, CheckpointError> {
    let first = &checkpoint.ranks[0];
    let layout = &first.meta.layout;
    let params = exported_params(layout, names)?;
    let mut readers = checkpoint
        .ranks
        .iter()
        .map(open_shards)
        .collect::<Result<Vec<_>, _>>()?;
    let places: Vec<_> = checkpoint.ranks.iter().map(|c| c.meta.layout.places()).collect();
    let tensors = params
        .into_iter()
        .map(|(p, exported)| Ok(PlannedTensor::new(p, exported, checkpoint.whole_shape(p)?)))
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    let splits = checkpoint.splits();
    let mut slices: Vec<Vec<f32>> = vec![Vec::new(); checkpoint.ranks.len()];
    let mut fill = |p: usize, values: &mut [f32]| {
        let param = &layout.params[p];
        let Some(split) = splits.get(&param.name) else {
            return read_param(first, &mut readers[0], &places[0], p, values);
        };
        for (t, slice) in slices.iter_mut().enumerate() {
            slice.clear();
            slice.resize(param.numel(), 0.0);
            read_param(&checkpoint.ranks[t], &mut readers[t], &places[t], p, slice)?;
        }
        let refs: Vec<&[f32]> = slices.iter().map(Vec::as_slice).collect();
        super::merge_slices(&refs, &param.shape, *split, values);
        Ok(())
    };
    write_export(out_dir, max_shard_bytes, tensors, &mut fill, config)
}

/// Fills a buffer with the values of the tensor of a layout index.
type FillTensor<'a> = dyn FnMut(usize, &mut [f32]) -> Result<(), CheckpointError> + 'a;

/// One tensor of an export: where its values come from, and how it goes out.
struct PlannedTensor {
    /// Its index in the layout.
    param: usize,
    /// Its exported name.
    name: String,
    /// Its exported shape.
    shape: Vec<usize>,
    /// `[rows, cols]` of the stored values when they go out transposed.
    transposed_from: Option<[usize; 2]>,
}

impl PlannedTensor {
    /// Parameter `param` of the (whole) stored `shape`, exported as `exported` says
    /// ([`exported_params`] checked that a transposed one is 2-D).
    fn new(param: usize, exported: ExportedTensor, shape: Vec<usize>) -> Self {
        let transposed_from = match (exported.layout, shape.as_slice()) {
            (TensorLayout::Transposed, &[rows, cols]) => Some([rows, cols]),
            _ => None,
        };
        let shape = match transposed_from {
            Some([rows, cols]) => vec![cols, rows],
            None => shape,
        };
        PlannedTensor {
            param,
            name: exported.name,
            shape,
            transposed_from,
        }
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// `out` (of `values`' length) becomes the transpose of `values`, a row-major `[rows, cols]`
/// matrix: row-major `[cols, rows]`. Walks tiles, so that a large matrix is read and written a
/// cache line at a time.
fn transpose_into(values: &[f32], [rows, cols]: [usize; 2], out: &mut [f32]) {
    const TILE: usize = 32;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    out[c * rows + r] = values[r * cols + c];
                }
            }
        }
    }
}

/// Writes `tensors` into `out_dir` in order, cut into files
/// of at most `max_shard_bytes` (a larger tensor gets a file of its own), each tensor's values
/// from `fill` into a buffer of its length, and `config` (the model's, as [`CONFIG_FILE`])
/// beside them.
///
/// Every file is written into a staging directory inside `out_dir` first and moved into place
/// only once all of them are whole, so that a conversion that fails (a damaged shard read half
/// way, a full disk) leaves nothing it created: its staged files go, and so do the directories
/// it made for `out_dir`; the files of an earlier export there stay as they were.
fn write_export(
    out_dir: &Path,
    max_shard_bytes: Option<u64>,
    tensors: Vec<PlannedTensor>,
    fill: &mut FillTensor<'_>,
    config: Option<&serde_json::Value>,
) -> Result<ConsolidateReport, CheckpointError> {
    let created = CreatedDirs::create(out_dir)?;
    let staging = out_dir.join(format!(".to-fp32.partial{}", std::process::id()));
    let staged = std::fs::create_dir(&staging)
        .map_err(|e| CheckpointError::io(&staging, "create", e))
        .and_then(|()| write_staged(&staging, max_shard_bytes, tensors, fill, config));
    let published = staged.and_then(|staged| publish_export(out_dir, &staging, staged));
    if published.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
        created.remove();
    }
    published
}

/// The directories [`CreatedDirs::create`] made on the way to one, deepest first: what a
/// failed export removes again, and nothing that was there before it.
struct CreatedDirs(Vec<PathBuf>);

impl CreatedDirs {
    /// Creates `dir` and the parents it lacks.
    fn create(dir: &Path) -> Result<Self, CheckpointError> {
        let mut missing = Vec::new();
        let mut at = Some(dir);
        while let Some(d) = at.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
            missing.push(d.to_path_buf());
            at = d.parent();
        }
        std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, "create", e))?;
        Ok(CreatedDirs(missing))
    }

    /// Removes the directories made, where they are empty again (one another process wrote into
    /// meanwhile stays).
    fn remove(self) {
        for d in self.0 {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// What [`write_staged`] wrote into the staging directory: the report (its paths in `out_dir`,
/// where the files go), and the file names to move there, in order.
struct StagedExport {
    report: ConsolidateReport,
    names: Vec<String>,
    /// The weight files of the export, as its index (or single file) names them.
    written: BTreeSet<String>,
    sharded: bool,
}

/// Writes the export's files into `staging`; see [`write_export`].
fn write_staged(
    staging: &Path,
    max_shard_bytes: Option<u64>,
    tensors: Vec<PlannedTensor>,
    fill: &mut FillTensor<'_>,
    config: Option<&serde_json::Value>,
) -> Result<StagedExport, CheckpointError> {
    let limit = max_shard_bytes.unwrap_or(u64::MAX);
    let mut shards: Vec<Vec<PlannedTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for tensor in tensors {
        let bytes = tensor.numel() as u64 * 4;
        if size > 0 && size + bytes > limit {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(last) = shards.last_mut() {
            last.push(tensor);
        }
    }
    let count = shards.len();
    let file_name = |i: usize| {
        if count == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        }
    };
    let mut report = ConsolidateReport {
        files: Vec::new(),
        index: None,
        config: None,
        tensors: 0,
        value_bytes: 0,
        largest_tensor_bytes: 0,
    };
    let mut names = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut values: Vec<f32> = Vec::new();
    let mut turned: Vec<f32> = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let entries: Vec<TensorEntry> = shard
            .iter()
            .map(|t| TensorEntry {
                name: t.name.clone(),
                dtype: Dtype::F32,
                shape: t.shape.clone(),
            })
            .collect();
        let mut stream = SafetensorsStream::create(&staging.join(file_name(i)), &entries, Some(format_metadata()))?;
        for tensor in shard {
            let n = tensor.numel();
            // One buffer (two for a transposed tensor), reused: it grows to the largest tensor
            // and no further.
            values.clear();
            values.resize(n, 0.0);
            fill(tensor.param, &mut values)?;
            match tensor.transposed_from {
                None => stream.write_f32(&values)?,
                Some(stored) => {
                    turned.clear();
                    turned.resize(n, 0.0);
                    transpose_into(&values, stored, &mut turned);
                    stream.write_f32(&turned)?;
                }
            }
            report.tensors += 1;
            report.value_bytes += n as u64 * 4;
            report.largest_tensor_bytes = report.largest_tensor_bytes.max(n as u64 * 4);
            weight_map.insert(tensor.name.clone(), file_name(i));
        }
        stream.finish()?;
        names.push(file_name(i));
    }
    if count > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": report.value_bytes },
            "weight_map": weight_map,
        });
        let text = serde_json::to_vec_pretty(&index).unwrap_or_default();
        super::atomic::write_file(&staging.join(INDEX_FILE), &text)?;
        names.push(INDEX_FILE.to_string());
    }
    if let Some(config) = config {
        write_model_config(staging, config)?;
        names.push(CONFIG_FILE.to_string());
    }
    Ok(StagedExport {
        report,
        names,
        written: (0..count).map(file_name).collect(),
        sharded: count > 1,
    })
}

/// Moves the staged files into `out_dir` (the weights, then the index, then the config), then
/// removes what an earlier export left there that would be read with them, and the staging
/// directory. Returns the report, its paths those in `out_dir`.
fn publish_export(out_dir: &Path, staging: &Path, staged: StagedExport) -> Result<ConsolidateReport, CheckpointError> {
    // What an earlier export left, read before this one replaces its index.
    let earlier = indexed_files(out_dir);
    let StagedExport {
        mut report,
        names,
        written,
        sharded,
    } = staged;
    for name in &names {
        let (from, to) = (staging.join(name), out_dir.join(name));
        std::fs::rename(&from, &to).map_err(|e| CheckpointError::io(&to, "move into place", e))?;
        if written.contains(name) {
            report.files.push(to);
        } else if name == INDEX_FILE {
            report.index = Some(to);
        } else {
            report.config = Some(to);
        }
    }
    super::atomic::sync_dir(out_dir)?;
    remove_earlier_export(out_dir, &earlier, &written, sharded)?;
    std::fs::remove_dir(staging).map_err(|e| CheckpointError::io(staging, "remove", e))?;
    Ok(report)
}

/// The weight files an index in `out_dir` names (an earlier sharded export): plain
/// `.safetensors` file names of the directory only, never a path out of it nor another kind of
/// file (an index naming itself or a config.json would have them removed).
fn indexed_files(out_dir: &Path) -> BTreeSet<String> {
    let Ok(text) = crate::files::read_to_string(&out_dir.join(INDEX_FILE), crate::files::SMALL) else {
        return BTreeSet::new();
    };
    let Ok(index) = serde_json::from_str::<serde_json::Value>(&text) else {
        return BTreeSet::new();
    };
    let Some(map) = index.get("weight_map").and_then(serde_json::Value::as_object) else {
        return BTreeSet::new();
    };
    map.values()
        .filter_map(serde_json::Value::as_str)
        .filter(|file| Path::new(file).file_name().is_some_and(|n| n == *file) && file.ends_with(".safetensors"))
        .map(String::from)
        .collect()
}

/// After an export into `out_dir` that wrote the files `written`, removes what an earlier export
/// left there that would be read with it or in its place: the shards its index named and this
/// export did not rewrite (another shard count leaves other names), a single
/// `model.safetensors` beside a new index (loaders take the single file first, so the old
/// weights would be read), or an index beside a new single file.
fn remove_earlier_export(
    out_dir: &Path,
    earlier: &BTreeSet<String>,
    written: &BTreeSet<String>,
    sharded: bool,
) -> Result<(), CheckpointError> {
    let remove = |path: &Path| match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(CheckpointError::io(path, "remove the earlier export", e))
        }
        _ => Ok(()),
    };
    for file in earlier.difference(written) {
        remove(&out_dir.join(file))?;
    }
    if sharded {
        remove(&out_dir.join(SINGLE_FILE))
    } else {
        remove(&out_dir.join(INDEX_FILE))
    }
}

/// The `__metadata__` HuggingFace's loaders expect of a PyTorch-style weights file.
fn format_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// A weights file written group by group from gathered values (a running engine's 16-bit or
/// fp32 export): every rank gathers each group in turn, and the writing rank passes the full
/// group to [`GroupExport::write_group`].
pub struct GroupExport {
    stream: SafetensorsStream,
    /// Per group, in order: (parameter, offset, elements) of each exported parameter.
    plan: Vec<Vec<(usize, usize)>>,
    next_group: usize,
    dtype: Option<HalfDtype>,
}

impl GroupExport {
    /// Creates the file at `path` for `layout`'s parameters (renamed or dropped by `names`),
    /// in `dtype` (`None`: f32).
    pub fn create(
        path: &Path,
        layout: &PartitionLayout,
        dtype: Option<HalfDtype>,
        names: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, CheckpointError> {
        let exported: HashMap<usize, String> = exported_params(layout, &|n| names(n).map(ExportedTensor::as_stored))?
            .into_iter()
            .map(|(p, exported)| (p, exported.name))
            .collect();
        let mut entries = Vec::new();
        let mut plan = Vec::with_capacity(layout.groups.len());
        for g in &layout.groups {
            let mut group = Vec::new();
            for (&p, &offset) in g.params.iter().zip(&g.offsets) {
                if let Some(name) = exported.get(&p) {
                    let spec = &layout.params[p];
                    entries.push(TensorEntry {
                        name: name.clone(),
                        dtype: dtype.map(HalfDtype::dtype).unwrap_or(Dtype::F32),
                        shape: spec.shape.clone(),
                    });
                    group.push((offset, spec.numel()));
                }
            }
            plan.push(group);
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, "create", e))?;
        }
        let stream = SafetensorsStream::create(path, &entries, Some(format_metadata()))?;
        Ok(GroupExport {
            stream,
            plan,
            next_group: 0,
            dtype,
        })
    }

    /// Writes the parameters of the next group from its full (gathered) values.
    pub fn write_group(&mut self, values: &[f32]) -> Result<(), CheckpointError> {
        let group = self
            .plan
            .get(self.next_group)
            .ok_or_else(|| CheckpointError::Usage("more groups written than the layout has".into()))?;
        for &(offset, n) in group {
            let v = values.get(offset..offset + n).ok_or_else(|| {
                CheckpointError::Usage(format!(
                    "group {} has {} values, too few",
                    self.next_group,
                    values.len()
                ))
            })?;
            match self.dtype {
                None => self.stream.write_f32(v)?,
                Some(d) => self.stream.write_half(v, d)?,
            }
        }
        self.next_group += 1;
        Ok(())
    }

    /// Finishes the file (every group must have been written).
    pub fn finish(self) -> Result<FileRecord, CheckpointError> {
        self.stream.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_into_turns_a_matrix_over_several_tiles() {
        // A 37 × 70 matrix crosses the 32-element tiles in both directions, with ragged edges.
        let (rows, cols) = (37, 70);
        let values: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut out = vec![0.0; rows * cols];
        transpose_into(&values, [rows, cols], &mut out);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(out[c * rows + r], values[r * cols + c], "({r}, {c})");
            }
        }
    }

    #[test]
    fn a_transposed_tensor_is_planned_in_its_turned_shape() {
        let t = PlannedTensor::new(
            3,
            ExportedTensor {
                name: "w".into(),
                layout: TensorLayout::Transposed,
            },
            vec![4, 6],
        );
        assert_eq!((t.shape.clone(), t.transposed_from), (vec![6, 4], Some([4, 6])));
        let s = PlannedTensor::new(0, ExportedTensor::as_stored("b".into()), vec![6]);
        assert_eq!((s.shape, s.transposed_from), (vec![6], None));
    }
}
