//! The GPT-2 trainer: `gpt2 train | score | generate | init`.

mod data;
mod error;
mod generate;
mod init;
mod metrics;
mod model;
mod monitor;
mod score;
mod tensorboard;
mod timers;
mod train;

pub use data::{DataSource, TokenBatch};
pub use error::TrainError;
pub use generate::{generate, GenerateArgs};
pub use init::{init, InitArgs};
pub use monitor::{CsvMonitor, Monitors};
pub use score::{score, ScoreArgs};
pub use tensorboard::EventWriter;
pub use timers::{Breakdown, CommClock, StepTimers, TimedGroup};
pub use train::{train, StepRecord, TrainArgs, TrainSummary};

/// The machine's memory (`MemTotal` of /proc/meminfo), where the system says.
pub(crate) fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
