//! Errors of the engine: each says what went wrong and what to change.

use zero_core::comm::CommError;

/// What can go wrong while setting up or running the ZeRO engine.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// A collective failed (a peer died, timed out, or called another op).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The configuration cannot be used with this model or world size.
    #[error("configuration: {0}")]
    Config(String),
    /// The model does not fit what the configuration asks for.
    #[error("model: {0}")]
    Model(String),
    /// The training loop called the engine out of order.
    #[error("usage: {0}")]
    Usage(String),
    /// The optimizer rejected its state or inputs.
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// A checkpoint could not be saved, read or verified (the error names the file).
    #[error(transparent)]
    Checkpoint(#[from] zero_core::checkpoint::CheckpointError),
}
