//! What the trainer reports when it cannot go on.

use zero_burn::ZeroError;

/// A trainer failure, said for the user.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The config file could not be used.
    #[error("{0}")]
    Config(String),
    /// The data could not be read or does not fit the config.
    #[error("data: {0}")]
    Data(String),
    /// The model could not be built or loaded.
    #[error("model: {0}")]
    Model(String),
    /// The engine failed (a peer, the optimizer, a mismatch).
    #[error(transparent)]
    Engine(#[from] ZeroError),
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What happened.
        source: std::io::Error,
    },
}
