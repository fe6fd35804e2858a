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

/// The tiny HuggingFace GPT-2 fixture directory (`models/tests/fixtures/gpt2-tiny`).
pub fn fixture_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/gpt2-tiny")
}

/// The tiny fixture's shape (models/tests/fixtures/gpt2-tiny/config.json), for `zero estimate`.
pub fn fixture_shape() -> zero_core::estimate::Gpt2Shape {
    zero_core::estimate::Gpt2Shape {
        vocab: 512,
        n_positions: 32,
        n_embd: 64,
        n_layer: 2,
        n_head: 4,
        n_inner: 256,
    }
}

/// A copy of the tiny GPT-2 fixture in `dir` whose first value of the (F32) tensor `tensor` is
/// `value`: NaN or an infinity makes a model whose loss is not finite. Returns `dir`.
pub fn fixture_model_with_value(dir: &Path, tensor: &str, value: f32) -> PathBuf {
    let from = fixture_model();
    std::fs::create_dir_all(dir).expect("model dir");
    std::fs::copy(from.join("config.json"), dir.join("config.json")).expect("copy config.json");
    let mut bytes = std::fs::read(from.join("model.safetensors")).expect("read model.safetensors");
    // safetensors: an 8-byte little-endian header length, a JSON header giving each tensor's
    // byte range in the data that follows.
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    let entry = header
        .get(tensor)
        .or_else(|| header.get(format!("transformer.{tensor}")))
        .unwrap_or_else(|| panic!("no tensor {tensor} in the fixture"));
    assert_eq!(entry["dtype"], "F32", "{tensor}");
    let start = 8 + header_len + entry["data_offsets"][0].as_u64().expect("offset") as usize;
    bytes[start..start + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(dir.join("model.safetensors"), bytes).expect("write model.safetensors");
    dir.to_path_buf()
}

/// `steps` steps of the tiny GPT-2 fixture (`models/tests/fixtures/gpt2-tiny`) on the fixture
/// token batch (sequences of 16), `nproc` rank threads, seed 0, on the CPU, quietly, under the
/// config at `config`; nothing saved or loaded.
pub fn fixture_args(config: &Path, steps: u64, nproc: usize) -> TrainArgs {
    TrainArgs {
        config: config.to_path_buf(),
        model: Some(fixture_model()),
        preset: None,
        data: None,
        tokens: Some(fixture("train_tokens.json")),
        seq_len: None,
        steps,
        nproc,
        seed: Some(0),
        metrics: None,
        save: None,
        save_every: None,
        save_total_limit: None,
        load: None,
        discard_later_tags: false,
        backend: "cpu".into(),
        collectives: "auto".into(),
        quiet: true,
        set: Vec::new(),
    }
}

/// The shipped example config (ZeRO-3, AdamW, WarmupDecayLR).
pub fn shipped_config() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/gpt2-tiny-zero3.json")
}

/// `gpt2 train` of the tiny preset under the shipped config on 2 rank threads, with short
/// sequences (the step time, not the schedule, depends on them), quietly, plus `extra`.
pub fn train_shipped(steps: u64, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gpt2"))
        .args([
            "train",
            "--quiet",
            "--preset",
            "tiny",
            "--seq-len",
            "16",
            "--nproc",
            "2",
        ])
        .arg("--config")
        .arg(shipped_config())
        .args(["--steps", &steps.to_string()])
        .args(extra)
        .env("ZERO_COMM_TIMEOUT_SECS", "30")
        .output()
        .expect("run gpt2")
}
