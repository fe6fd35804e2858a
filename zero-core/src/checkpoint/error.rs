//! What can go wrong with a checkpoint: every error names the file and what is wrong with it.

use std::path::PathBuf;

/// A checkpoint could not be written, read, verified or converted.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file or directory could not be read or written.
    #[error("{path}: {action}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`create`, `read`, `rename`, ...).
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A file the metadata lists is not there.
    #[error("{path}: missing (the checkpoint metadata lists it; was the save interrupted or the file removed?)")]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// A file has another length than the metadata records.
    #[error("{path}: {actual} bytes, but the metadata records {expected} (truncated or replaced)")]
    Length {
        /// The file.
        path: PathBuf,
        /// Length recorded in the metadata.
        expected: u64,
        /// Length on disk.
        actual: u64,
    },
    /// A file's bytes do not match their recorded checksum.
    #[error("{path}: checksum mismatch in bytes {start}..{end} (crc32 {actual:08x}, metadata records {expected:08x}): the file is corrupt")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// First byte of the checked range.
        start: u64,
        /// End of the checked range.
        end: u64,
        /// Recorded checksum.
        expected: u32,
        /// Checksum of the bytes on disk.
        actual: u32,
    },
    /// The metadata file cannot be parsed or contradicts itself.
    #[error("{path}: invalid checkpoint metadata: {detail}")]
    Metadata {
        /// The metadata file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A shard file does not hold what the metadata says it holds.
    #[error("{path}: does not match the checkpoint metadata: {detail}")]
    ShardMismatch {
        /// The shard file.
        path: PathBuf,
        /// What differs.
        detail: String,
    },
    /// The checkpoint was written for another model (other parameter names or shapes).
    #[error("{path}: checkpoint is of another model: {detail}")]
    OtherModel {
        /// The metadata file.
        path: PathBuf,
        /// The first difference found.
        detail: String,
    },
    /// `latest` names no tag, or a tag is not a usable directory name.
    #[error("{path}: {detail}")]
    Tag {
        /// The `latest` file or the checkpoint directory.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The caller asked for something the checkpoint cannot give or hold.
    #[error("checkpoint: {0}")]
    Usage(String),
    /// Another rank failed while this one succeeded; its error is in its own report.
    #[error("rank {rank} failed to {action} the checkpoint (see that rank's error); nothing was changed on this rank")]
    PeerFailed {
        /// The first rank that failed.
        rank: usize,
        /// `save` or `load`.
        action: &'static str,
    },
    /// A collective failed during save or load.
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
}

impl CheckpointError {
    /// An I/O error on `path` while doing `action`; a missing file becomes [`CheckpointError::Missing`].
    pub(crate) fn io(path: impl Into<PathBuf>, action: &'static str, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound && action == "open" {
            CheckpointError::Missing { path }
        } else {
            CheckpointError::Io { path, action, source }
        }
    }
}
