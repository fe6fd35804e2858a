//! A scratch file of f32 elements accessed by position (pread/pwrite), removed when dropped.

use super::{OffloadError, SwapRegion};
use crate::comm::{DType, FlatBuffer};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A scratch file of f32 elements. Reads and writes are positional, so several threads may use
/// one file at once on disjoint ranges. The file is deleted when the value is dropped: it holds
/// state that checkpoints save by other means.
#[derive(Debug)]
pub struct SwapFile {
    file: File,
    path: PathBuf,
}

impl SwapFile {
    /// Creates a new file in `dir` (creating `dir` if needed), named `{stem}-{process}-{n}.swap`
    /// with a number no other swap file of this process has: ranks that share a data-parallel
    /// index (pipeline stages, tensor ranks, threads of one process) and jobs that share a
    /// directory each get their own file, and none replaces a file that is there.
    pub fn create(dir: &Path, stem: &str) -> Result<Self, OffloadError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{stem}-{}-{n}.swap", std::process::id()));
        let io = |source| OffloadError::Io {
            op: "create",
            path: path.clone(),
            offset: 0,
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io)?;
        Ok(SwapFile { file, path })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads `out.len()` elements starting at element `offset`.
    pub fn read_at(&self, offset: u64, out: &mut [f32]) -> Result<(), OffloadError> {
        let byte = offset * 4;
        self.file
            .read_exact_at(bytemuck::cast_slice_mut(out), byte)
            .map_err(|source| OffloadError::Io {
                op: "read",
                path: self.path.clone(),
                offset: byte,
                source,
            })
    }

    /// Writes `data` starting at element `offset`.
    pub fn write_at(&self, offset: u64, data: &[f32]) -> Result<(), OffloadError> {
        let byte = offset * 4;
        self.file
            .write_all_at(bytemuck::cast_slice(data), byte)
            .map_err(|source| OffloadError::Io {
                op: "write",
                path: self.path.clone(),
                offset: byte,
                source,
            })
    }

    /// Writes a flat buffer of any dtype from byte `byte` (a parameter shard in its own dtype).
    pub fn write_flat_at(&self, byte: u64, data: &FlatBuffer) -> Result<(), OffloadError> {
        let bytes: &[u8] = match data {
            FlatBuffer::F32(v) => bytemuck::cast_slice(v),
            FlatBuffer::F16(v) => bytemuck::cast_slice(v),
            FlatBuffer::BF16(v) => bytemuck::cast_slice(v),
        };
        self.write_bytes_at(byte, bytes)
    }

    /// Writes `bytes` from byte `byte`.
    pub fn write_bytes_at(&self, byte: u64, bytes: &[u8]) -> Result<(), OffloadError> {
        self.file.write_all_at(bytes, byte).map_err(|source| OffloadError::Io {
            op: "write",
            path: self.path.clone(),
            offset: byte,
            source,
        })
    }

    /// Fills `out` from byte `byte` (what [`SwapFile::write_bytes_at`] wrote).
    pub fn read_bytes_at(&self, byte: u64, out: &mut [u8]) -> Result<(), OffloadError> {
        self.file.read_exact_at(out, byte).map_err(|source| OffloadError::Io {
            op: "read",
            path: self.path.clone(),
            offset: byte,
            source,
        })
    }

    /// Reads `len` elements of `dtype` from byte `byte` (what [`SwapFile::write_flat_at`] wrote).
    pub fn read_flat_at(&self, byte: u64, dtype: DType, len: usize) -> Result<FlatBuffer, OffloadError> {
        let mut out = match dtype {
            DType::F32 => FlatBuffer::F32(vec![0.0; len]),
            DType::F16 => FlatBuffer::F16(vec![half::f16::ZERO; len]),
            DType::BF16 => FlatBuffer::BF16(vec![half::bf16::ZERO; len]),
        };
        let bytes: &mut [u8] = match &mut out {
            FlatBuffer::F32(v) => bytemuck::cast_slice_mut(v),
            FlatBuffer::F16(v) => bytemuck::cast_slice_mut(v),
            FlatBuffer::BF16(v) => bytemuck::cast_slice_mut(v),
        };
        self.read_bytes_at(byte, bytes)?;
        Ok(out)
    }

    /// Stores `buffers` (each `region.len` long, `region.width` of them) into `region`, chunk by
    /// chunk through one host buffer of a chunk's size.
    pub fn write_region(&self, region: &SwapRegion, buffers: &[&[f32]]) -> Result<(), OffloadError> {
        check_buffers(region, buffers.iter().map(|b| b.len()))?;
        let mut staging = Vec::with_capacity(region.chunk.min(region.len) * region.width);
        for c in 0..region.chunks() {
            let range = region.chunk_range(c);
            staging.clear();
            for b in buffers {
                staging.extend_from_slice(&b[range.clone()]);
            }
            self.write_at(region.chunk_offset(c), &staging)?;
        }
        Ok(())
    }

    /// Reads `region` back as `region.width` buffers of `region.len` elements.
    pub fn read_region(&self, region: &SwapRegion) -> Result<Vec<Vec<f32>>, OffloadError> {
        let mut out = vec![vec![0.0f32; region.len]; region.width];
        let mut staging = vec![0.0f32; region.chunk.min(region.len) * region.width];
        for c in 0..region.chunks() {
            let range = region.chunk_range(c);
            let n = range.len();
            let chunk = &mut staging[..n * region.width];
            self.read_at(region.chunk_offset(c), chunk)?;
            for (b, part) in out.iter_mut().zip(chunk.chunks_exact(n)) {
                b[range.clone()].copy_from_slice(part);
            }
        }
        Ok(out)
    }

    /// Flushes written data to the device (for bandwidth measurements that must not stop at
    /// the page cache).
    pub fn sync(&self) -> Result<(), OffloadError> {
        self.file.sync_data().map_err(|source| OffloadError::Io {
            op: "sync",
            path: self.path.clone(),
            offset: 0,
            source,
        })
    }
}

impl SwapFile {
    /// Flushes the file and asks the kernel to drop its cached pages, so that the next reads
    /// come from the device (benchmarks: a file smaller than memory would otherwise be read
    /// from the page cache).
    pub fn drop_cache(&self) -> Result<(), OffloadError> {
        self.sync()?;
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
        let rc = unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(OffloadError::Io {
                op: "fadvise",
                path: self.path.clone(),
                offset: 0,
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        Ok(())
    }
}

fn check_buffers(region: &SwapRegion, lens: impl Iterator<Item = usize>) -> Result<(), OffloadError> {
    let lens: Vec<usize> = lens.collect();
    if lens.len() != region.width {
        return Err(OffloadError::Length {
            what: "buffers of the region".into(),
            expected: region.width,
            actual: lens.len(),
        });
    }
    for (i, len) in lens.into_iter().enumerate() {
        if len != region.len {
            return Err(OffloadError::Length {
                what: format!("buffer {i} of the region"),
                expected: region.len,
                actual: len,
            });
        }
    }
    Ok(())
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        // Scratch state: a leftover file would only waste the disk.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two engines of one rank index in one directory (pipeline stages, tensor ranks) each get
    /// a file of their own: one's writes never reach the other's reads.
    #[test]
    fn files_of_one_stem_are_distinct() {
        let dir = std::env::temp_dir().join(format!("zero-swap-stem-{}", std::process::id()));
        let a = SwapFile::create(&dir, "zero_optimizer_rank0").expect("create a");
        let b = SwapFile::create(&dir, "zero_optimizer_rank0").expect("create b");
        assert_ne!(a.path(), b.path());
        let region = SwapRegion::new(0, 4, 1, 4);
        a.write_region(&region, &[&[1.0, 2.0, 3.0, 4.0]]).expect("write a");
        b.write_region(&region, &[&[-1.0, -2.0, -3.0, -4.0]]).expect("write b");
        assert_eq!(a.read_region(&region).expect("read a"), vec![vec![1.0, 2.0, 3.0, 4.0]]);
        let (pa, pb) = (a.path().to_path_buf(), b.path().to_path_buf());
        drop((a, b));
        assert!(!pa.exists() && !pb.exists(), "removed when dropped");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn region_round_trips_through_the_file() {
        let dir = std::env::temp_dir().join(format!("zero-swap-unit-{}", std::process::id()));
        let file = SwapFile::create(&dir, "rt").expect("create");
        let a: Vec<f32> = (0..11).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..11).map(|i| -(i as f32) * 0.5).collect();
        let region = SwapRegion::new(7, 11, 2, 4);
        file.write_region(&region, &[&a, &b]).expect("write");
        let back = file.read_region(&region).expect("read");
        assert_eq!(back, vec![a.clone(), b]);
        // Chunk 1 is stored interleaved: elements 4..8 of `a`, then of `b`.
        let mut chunk = vec![0.0; 8];
        file.read_at(region.chunk_offset(1), &mut chunk).expect("read chunk");
        assert_eq!(&chunk[..4], &a[4..8]);
        assert!(file.write_region(&region, &[&a]).is_err());
        // Flat buffers of every dtype come back as written, after the f32 region.
        let end = (region.offset + region.elements()) * 4;
        let h = FlatBuffer::BF16(a.iter().map(|&v| half::bf16::from_f32(v * 1.5)).collect());
        file.write_flat_at(end, &h).expect("write flat");
        let f = FlatBuffer::F16(a.iter().map(|&v| half::f16::from_f32(-v)).collect());
        file.write_flat_at(end + 22, &f).expect("write flat");
        assert_eq!(file.read_flat_at(end, DType::BF16, 11).expect("read flat"), h);
        assert_eq!(file.read_flat_at(end + 22, DType::F16, 11).expect("read flat"), f);
        assert_eq!(
            file.read_region(&region).expect("read")[0],
            a,
            "the region is untouched"
        );
        let path = file.path().to_path_buf();
        drop(file);
        assert!(!path.exists(), "the scratch file is removed on drop");
        let _ = std::fs::remove_dir(&dir);
    }
}
