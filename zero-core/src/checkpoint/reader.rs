//! Reading a shard file: length and header checked on open, then values read by element range,
//! each chunk of the file verified against its recorded checksum the first time it is read.
//! Nothing a reader returns comes from an unverified chunk, and a reader holds one chunk in
//! memory, not the file.

use super::error::CheckpointError;
use super::format::FileRecord;
use safetensors::tensor::{Dtype, Metadata};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One shard file, open for verified reads.
pub struct ShardReader {
    path: PathBuf,
    file: File,
    record: FileRecord,
    header: Metadata,
    data_start: u64,
    /// The chunk last read and verified: its index and bytes.
    chunk: Option<(usize, Vec<u8>)>,
    /// Chunks already verified: read again, only the needed bytes are read, and not re-hashed.
    verified: Vec<bool>,
}

impl ShardReader {
    /// Opens `path`, checks its length against `record`, verifies and parses its header.
    pub fn open(path: &Path, record: &FileRecord) -> Result<Self, CheckpointError> {
        let file = crate::files::open(path).map_err(|e| CheckpointError::io(path, "open", e))?;
        let len = file.metadata().map_err(|e| CheckpointError::io(path, "stat", e))?.len();
        if len != record.bytes {
            return Err(CheckpointError::Length {
                path: path.to_path_buf(),
                expected: record.bytes,
                actual: len,
            });
        }
        if record.chunk_bytes == 0 || record.chunk_crc32.len() as u64 != record.bytes.div_ceil(record.chunk_bytes) {
            return Err(CheckpointError::Metadata {
                path: path.to_path_buf(),
                detail: format!("the record of {} has an inconsistent chunk list", record.name),
            });
        }
        let mut reader = ShardReader {
            path: path.to_path_buf(),
            file,
            record: record.clone(),
            header: Metadata::new(None, Vec::new()).map_err(|e| CheckpointError::Usage(e.to_string()))?,
            data_start: 0,
            chunk: None,
            verified: vec![false; record.chunk_crc32.len()],
        };
        let mut n = [0u8; 8];
        reader.read_verified(0..8, &mut n)?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) {
            return Err(reader.mismatch(format!("header length {n} exceeds the file")));
        }
        let mut header = vec![0u8; n as usize];
        reader.read_verified(8..8 + n, &mut header)?;
        let header: Metadata = serde_json::from_slice(&header)
            .map_err(|e| reader.mismatch(format!("unreadable safetensors header: {e}")))?;
        let data_start = 8 + n;
        if data_start + header.data_len() as u64 != len {
            return Err(reader.mismatch(format!(
                "header describes {} bytes of values, the file holds {}",
                header.data_len(),
                len - data_start
            )));
        }
        reader.header = header;
        reader.data_start = data_start;
        Ok(reader)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn mismatch(&self, detail: String) -> CheckpointError {
        CheckpointError::ShardMismatch {
            path: self.path.clone(),
            detail,
        }
    }

    /// Checks that the file holds exactly the 1-D f32 tensors `expected` (name, elements).
    pub fn check_tensors(&self, expected: &[(String, usize)]) -> Result<(), CheckpointError> {
        let present = self.header.tensors();
        for (name, len) in expected {
            let info = present
                .get(name)
                .ok_or_else(|| self.mismatch(format!("no tensor `{name}`")))?;
            if info.dtype != Dtype::F32 || info.shape != [*len] {
                return Err(self.mismatch(format!(
                    "tensor `{name}` is {:?} {:?}, the metadata's layout needs F32 [{len}]",
                    info.dtype, info.shape
                )));
            }
        }
        if present.len() != expected.len() {
            let extra = present.keys().find(|k| !expected.iter().any(|(n, _)| n == *k));
            return Err(self.mismatch(format!(
                "{} tensors where the layout needs {} (unexpected: {})",
                present.len(),
                expected.len(),
                extra.map(String::as_str).unwrap_or("?")
            )));
        }
        Ok(())
    }

    /// Reads elements `elems` of the f32 tensor `tensor` into `out`.
    pub fn read_f32(&mut self, tensor: &str, elems: Range<usize>, out: &mut [f32]) -> Result<(), CheckpointError> {
        let info = self
            .header
            .info(tensor)
            .ok_or_else(|| self.mismatch(format!("no tensor `{tensor}`")))?;
        let (start, end) = info.data_offsets;
        let (a, b) = (start + elems.start * 4, start + elems.end * 4);
        if info.dtype != Dtype::F32 || b > end || out.len() != elems.len() {
            return Err(self.mismatch(format!("tensor `{tensor}` has no f32 elements {elems:?}")));
        }
        let at = self.data_start;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut *out);
        self.read_verified(at + a as u64..at + b as u64, bytes)?;
        if cfg!(target_endian = "big") {
            for v in out.iter_mut() {
                *v = f32::from_bits(u32::from_le(v.to_bits()));
            }
        }
        Ok(())
    }

    /// Reads and verifies every chunk of the file.
    pub fn verify_all(&mut self) -> Result<(), CheckpointError> {
        for c in 0..self.record.chunk_crc32.len() {
            self.load_chunk(c)?;
        }
        Ok(())
    }

    /// Copies file bytes `range` into `out`, through verified chunks.
    fn read_verified(&mut self, range: Range<u64>, out: &mut [u8]) -> Result<(), CheckpointError> {
        let size = self.record.chunk_bytes;
        let mut at = range.start;
        let mut written = 0usize;
        while at < range.end {
            let c = (at / size) as usize;
            let chunk_end = ((c as u64 + 1) * size).min(self.record.bytes);
            let take = (range.end.min(chunk_end) - at) as usize;
            let cached = matches!(&self.chunk, Some((i, _)) if *i == c);
            if !cached && self.verified.get(c).copied().unwrap_or(false) {
                // Verified earlier (a file is read tensor by tensor, so chunks are revisited):
                // read just the bytes needed.
                self.file
                    .seek(SeekFrom::Start(at))
                    .map_err(|e| CheckpointError::io(&self.path, "seek", e))?;
                self.file
                    .read_exact(&mut out[written..written + take])
                    .map_err(|e| CheckpointError::io(&self.path, "read", e))?;
            } else {
                self.load_chunk(c)?;
                let chunk = self.chunk.as_ref().map(|(_, b)| b.as_slice()).unwrap_or(&[]);
                let from = (at - c as u64 * size) as usize;
                out[written..written + take].copy_from_slice(&chunk[from..from + take]);
            }
            written += take;
            at += take as u64;
        }
        Ok(())
    }

    /// Makes chunk `c` the cached chunk, reading and verifying it unless it already is.
    fn load_chunk(&mut self, c: usize) -> Result<(), CheckpointError> {
        if matches!(&self.chunk, Some((i, _)) if *i == c) {
            return Ok(());
        }
        let size = self.record.chunk_bytes;
        let start = c as u64 * size;
        let end = (start + size).min(self.record.bytes);
        let mut buf = match self.chunk.take() {
            Some((_, b)) => b,
            None => Vec::new(),
        };
        buf.resize((end - start) as usize, 0);
        self.file
            .seek(SeekFrom::Start(start))
            .map_err(|e| CheckpointError::io(&self.path, "seek", e))?;
        self.file
            .read_exact(&mut buf)
            .map_err(|e| CheckpointError::io(&self.path, "read", e))?;
        let actual = crc32fast::hash(&buf);
        let expected = self.record.chunk_crc32[c];
        if actual != expected {
            return Err(CheckpointError::Checksum {
                path: self.path.clone(),
                start,
                end,
                expected,
                actual,
            });
        }
        self.chunk = Some((c, buf));
        if let Some(v) = self.verified.get_mut(c) {
            *v = true;
        }
        Ok(())
    }
}
