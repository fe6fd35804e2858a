//! The GPT-2 trainer: `gpt2 train | score | generate`.

mod data;
mod error;
mod generate;
mod metrics;
mod model;
mod score;
mod train;

pub use data::{DataSource, TokenBatch};
pub use error::TrainError;
pub use generate::{generate, GenerateArgs};
pub use score::{score, ScoreArgs};
pub use train::{train, StepRecord, TrainArgs, TrainSummary};
