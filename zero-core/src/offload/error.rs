//! What can go wrong when state is swapped to and from a file.

use std::path::PathBuf;

/// An offload error, naming the file and the operation.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// Creating, reading or writing the swap file failed.
    #[error("{op} {path} at byte {offset}: {source}")]
    Io {
        /// What was being done (`create`, `read`, `write`).
        op: &'static str,
        /// The swap file.
        path: PathBuf,
        /// Byte offset of the failed access (0 for `create`).
        offset: u64,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// A slice does not match the region or chunk it is copied to or from.
    #[error("{what}: {actual} elements given, {expected} expected")]
    Length {
        /// Which slice.
        what: String,
        /// Elements the region or chunk holds.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// `buffer_count` was 0.
    #[error("offload needs at least one host buffer (buffer_count is 0)")]
    NoBuffers,
    /// An I/O thread of the stream panicked.
    #[error("the swap {0} thread panicked")]
    ThreadPanicked(&'static str),
    /// The computation on a chunk failed; the stream stopped.
    #[error("chunk {chunk}: {message}")]
    Compute {
        /// The chunk index.
        chunk: usize,
        /// The computation's error, as text.
        message: String,
    },
}
