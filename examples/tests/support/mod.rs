//! Shared by the trainer's tests: the fixtures, and the trainer's arguments for a run of the
//! tiny HuggingFace GPT-2 fixture on the fixture token batch.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use zero_examples::gpt2::TrainArgs;

/// A file of `examples/tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `steps` steps of the tiny GPT-2 fixture (`models/tests/fixtures/gpt2-tiny`) on the fixture
/// token batch (sequences of 16), `nproc` rank threads, seed 0, on the CPU, quietly, under the
/// config at `config`; nothing saved or loaded.
pub fn fixture_args(config: &Path, steps: u64, nproc: usize) -> TrainArgs {
    TrainArgs {
        config: config.to_path_buf(),
        model: Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/gpt2-tiny")),
        preset: None,
        data: None,
        tokens: Some(fixture("train_tokens.json")),
        seq_len: 16,
        steps,
        nproc,
        seed: 0,
        metrics: None,
        save: None,
        save_every: None,
        load: None,
        backend: "cpu".into(),
        quiet: true,
    }
}
