//! A safetensors file written as a stream: the header first (every tensor's name, dtype, shape
//! and offsets are known from the layout before any value is), then the values tensor after
//! tensor, so that at most one tensor is ever held in memory. The checksums of the file's
//! chunks are computed on the way out, so the file never has to be read back.
//!
//! The header is built and serialised with the `safetensors` crate (which also validates the
//! offsets); only the byte stream is ours, because the crate's writer needs every tensor's
//! bytes at hand and orders tensors its own way.

use super::atomic;
use super::error::CheckpointError;
use super::format::FileRecord;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Length of the chunks that get their own checksum, so that a reader can verify only the
/// bytes it reads.
pub const CHUNK_BYTES: u64 = 4 << 20;

/// A 16-bit floating-point format for exported weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfDtype {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl HalfDtype {
    /// The safetensors dtype.
    pub fn dtype(self) -> Dtype {
        match self {
            HalfDtype::Bf16 => Dtype::BF16,
            HalfDtype::F16 => Dtype::F16,
        }
    }
}

/// One tensor of a file to be written.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// Name in the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl TensorEntry {
    /// Bytes of the tensor's values.
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// CRC-32 of a whole file and of each of its [`CHUNK_BYTES`] chunks.
struct ChunkedCrc {
    whole: crc32fast::Hasher,
    chunk: crc32fast::Hasher,
    in_chunk: u64,
    chunks: Vec<u32>,
    total: u64,
}

impl ChunkedCrc {
    fn new() -> Self {
        ChunkedCrc {
            whole: crc32fast::Hasher::new(),
            chunk: crc32fast::Hasher::new(),
            in_chunk: 0,
            chunks: Vec::new(),
            total: 0,
        }
    }

    fn update(&mut self, mut bytes: &[u8]) {
        self.whole.update(bytes);
        self.total += bytes.len() as u64;
        while !bytes.is_empty() {
            let room = (CHUNK_BYTES - self.in_chunk) as usize;
            let take = room.min(bytes.len());
            self.chunk.update(&bytes[..take]);
            self.in_chunk += take as u64;
            bytes = &bytes[take..];
            if self.in_chunk == CHUNK_BYTES {
                let done = std::mem::replace(&mut self.chunk, crc32fast::Hasher::new());
                self.chunks.push(done.finalize());
                self.in_chunk = 0;
            }
        }
    }

    fn finish(mut self, name: String) -> FileRecord {
        if self.in_chunk > 0 {
            self.chunks.push(self.chunk.finalize());
        }
        FileRecord {
            name,
            bytes: self.total,
            crc32: self.whole.finalize(),
            chunk_bytes: CHUNK_BYTES,
            chunk_crc32: self.chunks,
        }
    }
}

/// A file written under a temporary name: removed when dropped unless it was renamed into place
/// (`kept`), so that a write that fails or is abandoned leaves nothing behind.
struct Temporary {
    path: PathBuf,
    kept: bool,
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes one safetensors file as a stream, under a temporary name until [`SafetensorsStream::finish`].
pub struct SafetensorsStream {
    path: PathBuf,
    tmp: Temporary,
    out: BufWriter<File>,
    crc: ChunkedCrc,
    data_len: u64,
    data_written: u64,
}

impl SafetensorsStream {
    /// Creates the file and writes the header for `tensors`, whose values must then be written
    /// in this order.
    pub fn create(
        path: &Path,
        tensors: &[TensorEntry],
        metadata: Option<HashMap<String, String>>,
    ) -> Result<Self, CheckpointError> {
        let mut at = 0usize;
        let mut infos = Vec::with_capacity(tensors.len());
        for t in tensors {
            let len = t.byte_len();
            infos.push((
                t.name.clone(),
                TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data_offsets: (at, at + len),
                },
            ));
            at += len;
        }
        let header = Metadata::new(metadata, infos).map_err(|e| {
            CheckpointError::Usage(format!("{}: cannot build the safetensors header: {e}", path.display()))
        })?;
        let mut json = serde_json::to_vec(&header)
            .map_err(|e| CheckpointError::Usage(format!("{}: cannot serialise the header: {e}", path.display())))?;
        // The format pads the header with spaces so that the data starts 8-byte aligned.
        while json.len() % 8 != 0 {
            json.push(b' ');
        }
        let (tmp, file) = atomic::create_temporary(path)?;
        let mut stream = SafetensorsStream {
            path: path.to_path_buf(),
            tmp: Temporary { path: tmp, kept: false },
            out: BufWriter::with_capacity(1 << 20, file),
            crc: ChunkedCrc::new(),
            data_len: at as u64,
            data_written: 0,
        };
        stream.raw(&(json.len() as u64).to_le_bytes())?;
        stream.raw(&json)?;
        Ok(stream)
    }

    fn raw(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        self.crc.update(bytes);
        self.out
            .write_all(bytes)
            .map_err(|e| CheckpointError::io(&self.tmp.path, "write", e))
    }

    /// Appends raw little-endian values of the current tensor(s).
    pub fn write_bytes(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        self.data_written += bytes.len() as u64;
        if self.data_written > self.data_len {
            return Err(CheckpointError::Usage(format!(
                "{}: more values written than the header announces ({} bytes)",
                self.path.display(),
                self.data_len
            )));
        }
        self.raw(bytes)
    }

    /// Appends f32 values.
    pub fn write_f32(&mut self, values: &[f32]) -> Result<(), CheckpointError> {
        if cfg!(target_endian = "little") {
            self.write_bytes(bytemuck::cast_slice(values))
        } else {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.write_bytes(&bytes)
        }
    }

    /// Appends f32 values rounded to a 16-bit format (round to nearest even).
    pub fn write_half(&mut self, values: &[f32], dtype: HalfDtype) -> Result<(), CheckpointError> {
        // Converted in pieces, so the temporary stays small whatever the tensor.
        for piece in values.chunks(1 << 16) {
            let bytes: Vec<u8> = match dtype {
                HalfDtype::Bf16 => piece
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
                HalfDtype::F16 => piece
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            };
            self.write_bytes(&bytes)?;
        }
        Ok(())
    }

    /// Checks that every announced value was written, flushes the file to disk, renames it to its
    /// final name and returns its checksums.
    pub fn finish(mut self) -> Result<FileRecord, CheckpointError> {
        if self.data_written != self.data_len {
            return Err(CheckpointError::Usage(format!(
                "{}: {} bytes of values written, the header announces {}",
                self.path.display(),
                self.data_written,
                self.data_len
            )));
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| CheckpointError::io(&self.tmp.path, "write", e.into_error()))?;
        atomic::commit(&self.tmp.path, file, &self.path)?;
        self.tmp.kept = true;
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(self.crc.finish(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(n: usize) -> Vec<TensorEntry> {
        vec![TensorEntry {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![n],
        }]
    }

    fn files_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A stream that fails, or is dropped before `finish`, leaves no temporary file; one that
    /// finishes leaves only its file.
    #[test]
    fn only_a_finished_stream_leaves_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");

        let mut abandoned = SafetensorsStream::create(&path, &entries(4), None).unwrap();
        abandoned.write_f32(&[1.0, 2.0]).unwrap();
        assert_eq!(files_in(dir.path()).len(), 1, "the temporary file while writing");
        drop(abandoned);
        assert!(files_in(dir.path()).is_empty(), "{:?}", files_in(dir.path()));

        let mut short = SafetensorsStream::create(&path, &entries(4), None).unwrap();
        short.write_f32(&[1.0]).unwrap();
        assert!(short.finish().is_err(), "fewer values than announced");
        assert!(files_in(dir.path()).is_empty(), "{:?}", files_in(dir.path()));

        let mut whole = SafetensorsStream::create(&path, &entries(2), None).unwrap();
        whole.write_f32(&[1.0, 2.0]).unwrap();
        whole.finish().unwrap();
        assert_eq!(files_in(dir.path()), ["model.safetensors"]);
    }
}
