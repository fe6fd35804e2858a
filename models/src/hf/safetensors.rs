//! Reading HuggingFace safetensors checkpoints, whatever the architecture: the weight files of a
//! directory (one `model.safetensors`, or shards listed by `model.safetensors.index.json`),
//! their headers checked against the files' lengths, and tensors widened to f32 one at a time.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use burn::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

use super::error::CheckpointError;

/// Name of the configuration file in a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";
/// Name of the single weights file.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Name of the shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors files of a checkpoint directory, and the path to name in key errors (the
/// index of a sharded checkpoint, else the single file).
pub(crate) fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, PathBuf), CheckpointError> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok((vec![single.clone()], single));
    }
    let index_path = dir.join(INDEX_FILE);
    if !index_path.is_file() {
        return Err(CheckpointError::NoWeights { dir: dir.to_path_buf() });
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = read_to_string(&index_path)?;
    let index: Index = serde_json::from_str(&text).map_err(|source| CheckpointError::Json {
        path: index_path.clone(),
        source,
    })?;
    let mut seen = HashSet::new();
    let mut files = Vec::new();
    for file in index.weight_map.values() {
        let plain = Path::new(file).file_name().is_some_and(|name| name == file.as_str());
        if !plain {
            return Err(CheckpointError::BadShardName {
                index: index_path,
                file: file.clone(),
            });
        }
        if seen.insert(file.clone()) {
            files.push(dir.join(file));
        }
    }
    files.sort();
    Ok((files, index_path))
}

/// Refuses a ZeRO training checkpoint (its `latest` tag file, or one tag's directory) given
/// where a model directory is expected, naming the `zero to-fp32` command that converts it.
pub(crate) fn refuse_training_checkpoint(dir: &Path, config_path: &Path) -> Result<(), CheckpointError> {
    if !config_path.exists() {
        let tag = dir.join(zero_core::checkpoint::META_FILE).is_file();
        let command = match (tag, dir.parent(), dir.file_name()) {
            (true, Some(parent), Some(name)) => Some(format!(
                "zero to-fp32 {} --tag {} OUT",
                // A bare tag name, given from inside the checkpoint directory.
                if parent.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    parent
                }
                .display(),
                name.to_string_lossy()
            )),
            _ if dir.join(zero_core::checkpoint::LATEST_FILE).is_file() => {
                Some(format!("zero to-fp32 {} OUT", dir.display()))
            }
            _ => None,
        };
        if let Some(command) = command {
            return Err(CheckpointError::TrainingCheckpoint {
                dir: dir.to_path_buf(),
                command,
            });
        }
    }
    Ok(())
}

/// Converts a stored float tensor to f32 `TensorData`.
pub(crate) fn to_f32_data(path: &Path, key: &str, view: &TensorView<'_>) -> Result<TensorData, CheckpointError> {
    bytes_to_f32_data(path, key, view.dtype(), view.shape().to_vec(), view.data())
}

/// Converts the little-endian bytes of a stored float tensor to f32 `TensorData`; refuses a
/// value that is not finite (or an f64 too large for f32).
pub(crate) fn bytes_to_f32_data(
    path: &Path,
    key: &str,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: &[u8],
) -> Result<TensorData, CheckpointError> {
    let values: Vec<f32> = match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(CheckpointError::UnsupportedDtype {
                path: path.to_path_buf(),
                key: key.to_string(),
                dtype: format!("{other:?}"),
            })
        }
    };
    if let Some(v) = values.iter().find(|v| !v.is_finite()) {
        return Err(CheckpointError::NonFinite {
            path: path.to_path_buf(),
            key: key.to_string(),
            value: v.to_string(),
        });
    }
    Ok(TensorData::new(values, shape))
}

/// One tensor of a checkpoint, located but not read.
#[derive(Clone, Debug)]
pub(crate) struct StoredTensor {
    pub(crate) path: PathBuf,
    /// The name in the file (with its prefix, if any).
    pub(crate) stored_name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    /// Offset of the first byte in the file.
    pub(crate) start: u64,
    /// Bytes.
    pub(crate) len: usize,
}

/// Reads one located tensor's bytes and converts them.
pub(crate) fn read_stored(stored: &StoredTensor) -> Result<TensorData, CheckpointError> {
    use std::io::{Read, Seek, SeekFrom};
    let io = |source| CheckpointError::Io {
        path: stored.path.clone(),
        source,
    };
    let mut file = zero_core::files::open(&stored.path).map_err(io)?;
    file.seek(SeekFrom::Start(stored.start)).map_err(io)?;
    // Read and widen in chunks, so that the tensor is held once, in f32, and not also as bytes.
    const CHUNK: usize = 1 << 20;
    // Whole-byte float types only reach here (the header check and the conversion refuse others).
    let width = (stored.dtype.bitsize() / 8).max(1);
    let mut values: Vec<f32> = Vec::with_capacity(stored.len / width);
    let mut bytes = vec![0u8; CHUNK.min(stored.len)];
    let mut left = stored.len;
    while left > 0 {
        let n = CHUNK.min(left);
        file.read_exact(&mut bytes[..n]).map_err(io)?;
        let chunk = bytes_to_f32_data(
            &stored.path,
            &stored.stored_name,
            stored.dtype,
            vec![n / width],
            &bytes[..n],
        )?;
        values.extend_from_slice(chunk.as_slice::<f32>().map_err(|e| CheckpointError::TensorData {
            key: stored.stored_name.clone(),
            reason: format!("{e:?}"),
        })?);
        left -= n;
    }
    Ok(TensorData::new(values, stored.shape.clone()))
}

/// The tensors a safetensors file holds, from its header alone (the 8-byte header length, then
/// the JSON header), each checked to lie within the file.
pub(crate) fn read_header(path: &Path) -> Result<Vec<StoredTensor>, CheckpointError> {
    use safetensors::SafeTensorError;
    use std::io::Read;
    /// Headers larger than this are refused, as the safetensors reader refuses them.
    const MAX_HEADER: u64 = 100_000_000;
    #[derive(serde::Deserialize)]
    struct Info {
        dtype: Dtype,
        shape: Vec<usize>,
        data_offsets: (usize, usize),
    }
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let format = |source| CheckpointError::Safetensors {
        path: path.to_path_buf(),
        source,
    };
    let mut file = zero_core::files::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| format(SafeTensorError::HeaderTooSmall))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER {
        return Err(format(SafeTensorError::HeaderTooLarge));
    }
    if 8 + header_len > file_len {
        return Err(CheckpointError::Truncated {
            path: path.to_path_buf(),
            what: "its header".into(),
            needed: 8 + header_len,
            len: file_len,
        });
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| format(SafeTensorError::InvalidHeaderDeserialization(e)))?;
    let data_start = 8 + header_len;
    let mut out = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        let info: Info =
            serde_json::from_value(value).map_err(|e| format(SafeTensorError::InvalidHeaderDeserialization(e)))?;
        let (begin, end) = info.data_offsets;
        let size = info
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|numel| numel.checked_mul(info.dtype.bitsize()))
            .map(|bits| bits.div_ceil(8));
        if end < begin || size != Some(end - begin) {
            let takes = size.map_or("more bytes than can be addressed".to_string(), |n| format!("{n} bytes"));
            return Err(CheckpointError::Tensor {
                path: path.to_path_buf(),
                key: name,
                detail: format!(
                    "dtype {:?} and shape {:?} take {takes}, but its data_offsets [{begin}, {end}] give {}",
                    info.dtype,
                    info.shape,
                    if end < begin {
                        "a negative length".to_string()
                    } else {
                        format!("{} bytes", end - begin)
                    }
                ),
            });
        }
        if data_start + end as u64 > file_len {
            return Err(CheckpointError::Truncated {
                path: path.to_path_buf(),
                what: format!("tensor `{name}`"),
                needed: data_start + end as u64,
                len: file_len,
            });
        }
        out.push(StoredTensor {
            path: path.to_path_buf(),
            stored_name: name,
            dtype: info.dtype,
            shape: info.shape,
            start: data_start + begin as u64,
            len: end - begin,
        });
    }
    Ok(out)
}

pub(crate) fn read_to_string(path: &Path) -> Result<String, CheckpointError> {
    zero_core::files::read_to_string(path, zero_core::files::SMALL).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })
}
