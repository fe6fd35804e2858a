//! The held-out loss `gpt2 train` reports is scored a micro-batch at a time (a rank's share of
//! the held-out rows is its whole batch: at once, it would hold `gradient_accumulation_steps`
//! micro-batches' logits), and is still the mean over every held-out token. Reference: the same
//! model, untouched by a step at learning rate 0, scoring all the held-out rows in one forward
//! on one process.

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use std::path::{Path, PathBuf};
use zero_examples::gpt2::{train, DataSource, TrainArgs};
use zero_models::Gpt2Config;

const SEQ: usize = 16;
const SEED: u64 = 3;

/// A config whose step leaves the weights as they were (AdamW at lr 0), with micro-batches of
/// 2 and 4 of them per step on each of `data_ranks` data-parallel ranks.
fn config(dir: &Path, zero_stage: u64, pipeline_stages: usize, data_ranks: usize) -> PathBuf {
    let mut config = serde_json::json!({
        "train_batch_size": 8 * data_ranks,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": { "type": "AdamW", "params": { "lr": 0.0 } },
        "zero_optimization": { "stage": zero_stage, "stage3_param_persistence_threshold": 0 }
    });
    if pipeline_stages > 1 {
        config["pipeline"] = serde_json::json!({ "stages": pipeline_stages, "partition": "uniform" });
    }
    let path = dir.join(format!("z{zero_stage}_pp{pipeline_stages}.json"));
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

fn args(config: PathBuf, nproc: usize, data: Option<PathBuf>) -> TrainArgs {
    TrainArgs {
        config,
        model: None,
        preset: Some("tiny".into()),
        data,
        tokens: None,
        seq_len: Some(SEQ),
        steps: 1,
        nproc,
        seed: Some(SEED),
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

fn shipped_corpus() -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/shakespeare.txt"))
        .expect("the shipped corpus")
}

/// The held-out sequences of `text`, at most `count` of them.
fn held_out(text: &str, count: usize) -> Vec<Vec<u32>> {
    DataSource::from_text(text, "the text", SEQ, Gpt2Config::tiny().n_positions)
        .expect("data")
        .validation(count)
}

/// The mean next-token loss of the first `count` held-out sequences of `text`, in one forward
/// of the seeded tiny preset.
fn one_forward_loss(text: &str, count: usize) -> f64 {
    let config = Gpt2Config::tiny();
    let rows = held_out(text, count);
    let count = rows.len();
    let device = Default::default();
    <Flex as burn::tensor::backend::Backend>::seed(&device, SEED);
    let model = config.init::<Flex>(&device);
    let flat: Vec<i64> = rows.iter().flatten().map(|&t| t as i64).collect();
    let tokens = Tensor::<Flex, 2, Int>::from_data(TensorData::new(flat, [count, SEQ]), &device);
    model.loss(tokens.clone(), tokens).into_scalar() as f64
}

/// Trains one step on `text` (the shipped corpus when `None`) and compares the held-out loss
/// with one forward over the rows the run scored (a global batch's worth, or all there are).
fn check(zero_stage: u64, pipeline_stages: usize, nproc: usize, text: Option<&str>) {
    let data_ranks = nproc / pipeline_stages;
    let dir = tempfile::tempdir().unwrap();
    let data = text.map(|text| {
        let path = dir.path().join("text.txt");
        std::fs::write(&path, text).unwrap();
        path
    });
    let config = config(dir.path(), zero_stage, pipeline_stages, data_ranks);
    let summary = train(&args(config, nproc, data)).unwrap();
    let reported = summary.steps[0].valid_loss.expect("a held-out loss at the last step");
    let reference = one_forward_loss(text.unwrap_or(&shipped_corpus()), 8 * data_ranks);
    assert!(
        (reported - reference).abs() <= 1e-5 * reference.abs(),
        "stage {zero_stage}, {pipeline_stages} pipeline stages, {nproc} ranks: held-out loss {reported}, one \
         forward over all rows {reference}"
    );
}

#[test]
fn held_out_loss_in_micro_batches_is_the_mean_over_all_rows() {
    check(0, 1, 1, None);
}

#[test]
fn held_out_loss_over_sharded_ranks_is_the_mean_over_all_rows() {
    check(3, 1, 2, None);
}

#[test]
fn pipelined_held_out_loss_is_the_mean_over_all_rows() {
    check(0, 2, 2, None);
}

/// A text that holds 5 held-out sequences: micro-batches of 2, 2 and 1.
fn five_held_out_sequences() -> String {
    let corpus = shipped_corpus();
    let mut cut = 2000;
    loop {
        let text = &corpus[..corpus.floor_char_boundary(cut)];
        match held_out(text, usize::MAX).len() {
            n if n < 5 => cut += 200,
            5 => return text.to_string(),
            n => panic!("no prefix of the corpus holds exactly 5 held-out sequences (this one: {n})"),
        }
    }
}

#[test]
fn held_out_loss_weighs_a_short_last_micro_batch_by_its_rows() {
    check(0, 1, 1, Some(&five_held_out_sequences()));
}

#[test]
fn pipelined_held_out_loss_weighs_a_short_last_micro_batch_by_its_rows() {
    check(0, 2, 2, Some(&five_held_out_sequences()));
}
