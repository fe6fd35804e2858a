//! What can go wrong in a collective, said so that the user knows which rank to look at.

/// A failed collective. Every variant names the op and, where one is to blame, the rank.
// Clone: a poisoned group hands the original cause to every later call. Serialize: the TCP
// backend tells its peers why it aborted, so that they report the same cause.
#[derive(Clone, Debug, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum CommError {
    /// Ranks disagreed on which collective comes next.
    #[error(
        "collective mismatch at sequence number {seq}: rank {rank} called `{op}` but rank {peer} called `{peer_op}`"
    )]
    Mismatch {
        /// Sequence number (0-based, per group) of the collective.
        seq: u64,
        /// The rank reporting the error.
        rank: usize,
        /// The op this rank called.
        op: String,
        /// The rank that disagreed.
        peer: usize,
        /// The op the peer called.
        peer_op: String,
    },
    /// Ranks passed buffers of different lengths or dtypes to the same collective.
    #[error("collective `{op}` #{seq}: rank {rank} passed {detail}; rank {peer} passed {peer_detail}")]
    ShapeMismatch {
        /// Sequence number of the collective.
        seq: u64,
        /// The op.
        op: String,
        /// The reporting rank.
        rank: usize,
        /// Its buffer, described (length and dtype).
        detail: String,
        /// The disagreeing rank.
        peer: usize,
        /// The peer's buffer, described.
        peer_detail: String,
    },
    /// Ranks called the same collective for different things (two units of the model): the
    /// ranks reached the model's units in a different order.
    #[error("collective `{op}` #{seq}: rank {rank} passed {subject} but rank {peer} passed {peer_subject}")]
    SubjectMismatch {
        /// Sequence number of the collective.
        seq: u64,
        /// The op.
        op: String,
        /// The reporting rank.
        rank: usize,
        /// What it passed (e.g. `unit 3`).
        subject: String,
        /// The disagreeing rank.
        peer: usize,
        /// What the peer passed.
        peer_subject: String,
    },
    /// A peer died, closed its connection or failed its own collective.
    #[error("collective `{op}` #{seq}: rank {peer} is gone ({reason})")]
    PeerLost {
        /// Sequence number of the collective.
        seq: u64,
        /// The op.
        op: String,
        /// The lost rank.
        peer: usize,
        /// What was observed.
        reason: String,
    },
    /// A peer did not reach the collective within the timeout.
    #[error(
        "collective `{op}` #{seq}: timed out after {seconds:.1} s waiting for rank {peer} (is it hung or much slower?)"
    )]
    Timeout {
        /// Sequence number of the collective.
        seq: u64,
        /// The op.
        op: String,
        /// The rank waited for.
        peer: usize,
        /// The timeout that expired.
        seconds: f64,
    },
    /// The arguments cannot be valid on any rank (a length not divisible by the world size, a
    /// root out of range).
    #[error("collective `{op}`: {message}")]
    InvalidArgument {
        /// The op.
        op: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// The backend's library (CUDA, NCCL) failed during a collective.
    #[error("collective `{op}` #{seq}: {message}")]
    Backend {
        /// The op.
        op: String,
        /// Sequence number of the collective.
        seq: u64,
        /// What the library reported.
        message: String,
    },
    /// Setting the group up failed (rendezvous, environment).
    #[error("process group setup: {0}")]
    Setup(String),
    /// The group was shut down (or its worker stopped) before the collective completed.
    #[error("collective `{op}`: the process group was shut down")]
    Shutdown {
        /// The op.
        op: String,
    },
}
