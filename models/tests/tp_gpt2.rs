//! Tensor-parallel GPT-2 against the full model.
//!
//! Reference: zero-models' `Gpt2` in one thread (tensor-parallel size 1), on the same weights
//! and batch. Each tensor-parallel rank's logits, loss and gradients must equal the reference's
//! slice (the reference's gradients, written into a copy of the model and sliced by the same
//! `TpGpt2::from_full`, whose slicing tests/tp_layers.rs pins down independently), to fp32
//! rounding. Training the split model is tests/tp_training.rs.

mod tp_support;

use tp_support::*;
use zero_burn::params::take_grads;
use zero_core::comm::{TcpGroup, TcpOptions};
use zero_core::parallel::{ParallelLayout, RankGroups};
use zero_models::tp::{TpGpt2, TpGroup};

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
        let err = max_relative_error(&[logits], &[want]);
        assert!(err < 1e-5, "tp {tp} rank {rank}: logits differ by {err:e}");
        assert!(
            (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
            "tp {tp} rank {rank}: loss {loss} vs {want_loss}"
        );
        let err = max_relative_error(&got_grads, &want_grads);
        eprintln!("tp {tp} rank {rank}: gradients max relative error {err:e}");
        assert!(err < 1e-5, "tp {tp} rank {rank}: gradients differ by {err:e}");
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
