//! Tensor-parallel GPT-2 against the full model.
//!
//! Reference: zero-models' `Gpt2` in one thread (tensor-parallel size 1), on the same weights
//! and batch. Each tensor-parallel rank's logits, loss and gradients must equal the reference's
//! slice (the reference's gradients, written into a copy of the model and sliced by the same
//! `TpGpt2::from_full`, whose slicing tests/tp_layers.rs pins down independently), to fp32
//! rounding. Training the split model is tests/tp_training.rs.

use crate::tp_support;
use tp_support::*;
use zero_burn::params::take_grads;
use zero_core::comm::{TcpGroup, TcpOptions};
use zero_core::parallel::{ParallelLayout, RankGroups};
use zero_models::tp::{TpGpt2, TpGroup};
use zero_test_support::{assert_close, max_relative_error};

/// What one tensor-parallel rank computes on the test batch: its tensor-parallel index, its
/// logits, the loss, its gradients, and the reference's gradients sliced for it.
type RankRun = (usize, Vec<f32>, f32, Vec<Vec<f32>>, Vec<Vec<f32>>);

fn run_tp_rank(groups: &RankGroups, want_grads: &[Vec<f32>]) -> RankRun {
    let device = Default::default();
    let group = TpGroup::new(groups.tensor.clone());
    let model = TpGpt2::from_full(&full_model(&device), group.clone()).unwrap();
    let batch = tokens(0, 0..3, &device);
    let logits = model.forward(batch.clone());
    let loss = model.loss(batch.clone(), batch);
    let mut grads = loss.backward();
    group.check().unwrap();
    let mut got = Vec::new();
    take_grads::<B, _>(&model, &mut grads, |_, g| got.push(g.expect("a gradient")));
    // The expected slice, cut by this rank from the reference's gradients.
    let want = values(&TpGpt2::from_full(&model_from(want_grads, &device), group).unwrap());
    let logits: Vec<f32> = zero_burn::params::tensor_to_vec(logits);
    (groups.coords.tensor, logits, loss.into_scalar(), got, want)
}

/// The full model's logits, loss and gradients on the test batch.
fn full_run() -> (Vec<f32>, f32, Vec<Vec<f32>>) {
    let device = Default::default();
    let full = full_model(&device);
    let batch = tokens(0, 0..3, &device);
    let logits = full.forward(batch.clone());
    let loss = full.loss(batch.clone(), batch);
    let mut grads = loss.backward();
    let grads_flat = gradients(&full, &mut grads);
    (zero_burn::params::tensor_to_vec(logits), loss.into_scalar(), grads_flat)
}

fn check_ranks(tp: usize, results: Vec<RankRun>, want_logits: &[f32], want_loss: f32) {
    for (rank, logits, loss, got_grads, want_grads) in results {
        let local = VOCAB / tp;
        // Columns rank·local.. of every row of the reference's [3, SEQ, VOCAB] logits.
        let want: Vec<f32> = want_logits
            .chunks(VOCAB)
            .flat_map(|row| row[rank * local..(rank + 1) * local].to_vec())
            .collect();
        assert_close(&format!("tp {tp} rank {rank}: logits"), &logits, &want, 1e-5);
        assert!(
            (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
            "tp {tp} rank {rank}: loss {loss} vs {want_loss}"
        );
        let label = format!("tp {tp} rank {rank}: gradients");
        let err = max_relative_error(&label, &got_grads, &want_grads);
        eprintln!("{label}: max relative error {err:e}");
        assert_close(&label, &got_grads, &want_grads, 1e-5);
    }
}

#[test]
fn logits_loss_and_gradients_match_the_full_model_at_tp_2_and_4() {
    let (want_logits, want_loss, want_grads) = full_run();
    for tp in [2, 4] {
        let results = on_layout(1, tp, |groups| run_tp_rank(&groups, &want_grads));
        check_ranks(tp, results, &want_logits, want_loss);
    }
}

#[test]
fn tensor_parallel_over_tcp_subgroups_matches_the_full_model() {
    // World of 4 processes' worth of ranks (threads here) over TCP, data 2 × tensor 2: the
    // tensor groups are subgroups with connections of their own.
    let (want_logits, want_loss, want_grads) = full_run();
    let layout = ParallelLayout::new(2, 2).unwrap();
    let port = zero_core::launch::free_port().unwrap();
    let options = TcpOptions {
        timeout: std::time::Duration::from_secs(30),
        ..TcpOptions::default()
    };
    let results: Vec<RankRun> = std::thread::scope(|s| {
        let want_grads = &want_grads;
        let handles: Vec<_> = (0..4)
            .map(|r| {
                s.spawn(move || {
                    let world = TcpGroup::connect(r, 4, "127.0.0.1", port, options).unwrap();
                    let groups = layout.tcp(world).unwrap();
                    run_tp_rank(&groups, want_grads)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    check_ranks(2, results, &want_logits, want_loss);
}

/// bf16 logits split over 2 tensor ranks: the vocab-parallel loss is f32 and equals the
/// cross-entropy of the same (bf16-rounded) logits computed whole in f32 (`log_softmax`, the
/// targets' entries averaged), as the whole model's loss is; its gradient reaches the bf16
/// logits. Summed in bf16 the loss kept about 3 digits.
#[test]
fn the_vocab_parallel_loss_is_f32_for_bf16_logits() {
    use burn::tensor::activation::log_softmax;
    use burn::tensor::{DType, Int, Tensor, TensorData};
    let (rows, vocab) = (5, VOCAB);
    let values: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 37 % 101) as f32 * 0.173).sin() * 6.0)
        .collect();
    let targets: Vec<i64> = (0..rows).map(|r| ((r * 11 + 3) % vocab) as i64).collect();
    let device = Default::default();
    let whole = Tensor::<B, 2>::from_data(TensorData::new(values.clone(), [rows, vocab]), &device).cast(DType::BF16);
    let rounded = whole.clone().cast(DType::F32);
    let log_probs: Vec<f32> = zero_burn::params::tensor_to_vec(log_softmax(rounded, 1).reshape([rows * vocab]));
    let want: f32 = -targets
        .iter()
        .enumerate()
        .map(|(r, &t)| log_probs[r * vocab + t as usize])
        .sum::<f32>()
        / rows as f32;
    let results = on_layout(1, 2, |groups| {
        let group = TpGroup::new(groups.tensor.clone());
        let local = vocab / 2;
        let start = groups.coords.tensor * local;
        let device = Default::default();
        let logits = Tensor::<B, 2>::from_data(TensorData::new(values.clone(), [rows, vocab]), &device)
            .cast(DType::BF16)
            .narrow(1, start, local)
            .detach()
            .require_grad();
        let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets.clone(), [rows]), &device);
        let loss = zero_models::tp::vocab_parallel_cross_entropy(logits.clone(), targets, start, vocab, &group);
        let dtype = loss.dtype();
        let grads = loss.backward();
        let grad = logits.grad(&grads).expect("a gradient for the logits");
        group.check().unwrap();
        (dtype, loss.into_scalar(), grad.dtype())
    });
    for (dtype, loss, grad_dtype) in results {
        assert_eq!(dtype, DType::F32);
        assert_eq!(grad_dtype, DType::BF16, "the gradient arrives in the logits' dtype");
        assert!((loss - want).abs() <= 1e-6 * want.abs(), "loss {loss} vs {want}");
    }
}
