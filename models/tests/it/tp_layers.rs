//! The tensor-parallel layers one by one, against plain Burn layers and a float64 computation.
//!
//! References: the slices of every rank put back together give the full weight (so
//! `from_full` cuts what Megatron's layout says); a column-parallel layer followed by a
//! row-parallel one equals the two full layers, values and input gradient; the vocab-parallel
//! embedding equals the full lookup; the vocab-parallel cross-entropy and its logit gradient
//! equal `log Σ exp - z_target` and `softmax - onehot` computed in f64.

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::nn::{Embedding, Linear};
use burn::prelude::*;
use zero_burn::params::tensor_to_vec;
use zero_core::parallel::ParallelLayout;
use zero_models::gpt2::IGNORE_INDEX;
use zero_models::tp::{
    vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear, TpGroup, VocabParallelEmbedding,
};
use zero_test_support::{max_abs, max_abs_diff};

type B = Autodiff<Flex>;

fn pattern(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|k| ((seed * 97 + k * 13) as f32 * 0.41).sin()).collect()
}

fn tensor2(rows: usize, cols: usize, seed: usize) -> Tensor<B, 2> {
    Tensor::from_data(
        TensorData::new(pattern(rows * cols, seed), [rows, cols]),
        &Default::default(),
    )
}

fn linear(d_in: usize, d_out: usize, seed: usize) -> Linear<B> {
    Linear {
        weight: Param::from_tensor(tensor2(d_in, d_out, seed)),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(pattern(d_out, seed + 1), [d_out]),
            &Default::default(),
        ))),
    }
}

/// Runs `f(tp group)` on one thread per tensor-parallel rank; results by rank.
fn on_tp<T: Send>(tp: usize, f: impl Fn(TpGroup) -> T + Sync) -> Vec<T> {
    let ranks = ParallelLayout::new(1, tp).unwrap().threads().unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|g| s.spawn(move || f(TpGroup::new(g.tensor.clone()))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Within 1e-5 of the larger of 1 and the reference's largest magnitude.
fn close(got: &[f32], want: &[f32], what: &str) {
    let (scale, diff) = (max_abs(what, want), max_abs_diff(what, got, want));
    assert!(
        diff <= 1e-5 * scale.max(1.0),
        "{what}: differs by {diff:e} (scale {scale})"
    );
}

#[test]
fn fused_qkv_columns_are_cut_piece_by_piece() {
    // A [2, 12] q|k|v projection over 2 ranks: rank r holds columns 2r..2r+2 of each piece.
    let full = linear(2, 12, 3);
    let whole = tensor_to_vec(full.weight.val());
    let slices = on_tp(2, |g| {
        tensor_to_vec(
            ColumnParallelLinear::from_full(&full_clone(&full), 3, g)
                .unwrap()
                .weight
                .val(),
        )
    });
    for (r, got) in slices.iter().enumerate() {
        let want: Vec<f32> = (0..2)
            .flat_map(|row| (0..3).flat_map(move |p| (0..2).map(move |c| (row, p * 4 + 2 * r + c))))
            .map(|(row, col)| whole[row * 12 + col])
            .collect();
        assert_eq!(got, &want, "rank {r}");
    }
}

fn full_clone(l: &Linear<B>) -> Linear<B> {
    l.clone()
}

#[test]
fn column_then_row_equals_the_full_layers_values_and_input_gradient() {
    for tp in [2, 4] {
        let fc = linear(6, 8, 1);
        let proj = linear(8, 6, 2);
        let x = tensor2(5, 6, 9).require_grad();
        let y = proj.forward(fc.forward(x.clone()).tanh());
        let seed = tensor2(5, 6, 4);
        let grads = (y.clone() * seed.clone()).sum().backward();
        let want_y = tensor_to_vec(y);
        let want_dx = tensor_to_vec(x.grad(&grads).unwrap());

        let got = on_tp(tp, |g| {
            let col = ColumnParallelLinear::from_full(&fc, 1, g.clone()).unwrap();
            let row = RowParallelLinear::from_full(&proj, g.clone()).unwrap();
            let x = tensor2(5, 6, 9).require_grad();
            let y = row.forward(col.forward(x.clone()).tanh());
            let grads = (y.clone() * tensor2(5, 6, 4)).sum().backward();
            g.check().unwrap();
            (tensor_to_vec(y), tensor_to_vec(x.grad(&grads).unwrap()))
        });
        for (r, (y, dx)) in got.iter().enumerate() {
            close(y, &want_y, &format!("tp {tp} rank {r} output"));
            close(dx, &want_dx, &format!("tp {tp} rank {r} input gradient"));
        }
    }
}

#[test]
fn vocab_parallel_lookup_equals_the_full_embedding() {
    let table = Embedding {
        weight: Param::from_tensor(tensor2(12, 3, 5)),
    };
    let ids = [[0i64, 5, 11, 6], [3, 3, 9, 2]];
    let want = tensor_to_vec(table.forward(Tensor::from_ints(ids, &Default::default())));
    // 12 rows over 3 ranks evenly, and over 5 ranks padded to 15 (rank 4 holds no token).
    for tp in [3, 5] {
        let got = on_tp(tp, |g| {
            let emb = VocabParallelEmbedding::from_full(&table, g).unwrap();
            assert_eq!(emb.local_vocab(), 12usize.div_ceil(tp));
            tensor_to_vec(emb.forward(Tensor::from_ints(ids, &Default::default())))
        });
        for (r, y) in got.iter().enumerate() {
            close(y, &want, &format!("tp {tp} rank {r}"));
        }
    }
}

/// Against float64, on an even vocabulary (8 over 2 ranks) and on padded ones (7 over 2 and 3
/// ranks: the last columns are padding, filled with a large logit that would dominate the
/// softmax if it were counted): the loss, and each rank's logit gradients, 0 on padding.
#[test]
fn vocab_parallel_cross_entropy_matches_float64() {
    for (vocab, tp) in [(8, 2), (7, 2), (7, 3)] {
        cross_entropy_against_float64(vocab, tp);
    }
}

fn cross_entropy_against_float64(vocab: usize, tp: usize) {
    let rows = 5;
    let logits = pattern(rows * vocab, 7).iter().map(|v| 3.0 * v).collect::<Vec<f32>>();
    let targets = [1i64, 6, IGNORE_INDEX, 4, 0];
    // Reference in f64: mean over counted rows of log Σ exp z - z_t; gradient (softmax - onehot)
    // / counted for counted rows, zero for ignored ones.
    let counted = targets.iter().filter(|&&t| t != IGNORE_INDEX).count() as f64;
    let mut want_loss = 0f64;
    let mut want_grad = vec![0f64; rows * vocab];
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE_INDEX {
            continue;
        }
        let z: Vec<f64> = logits[r * vocab..(r + 1) * vocab].iter().map(|&v| v as f64).collect();
        let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
        want_loss += (lse - z[t as usize]) / counted;
        for c in 0..vocab {
            let onehot = if c == t as usize { 1.0 } else { 0.0 };
            want_grad[r * vocab + c] = ((z[c] - lse).exp() - onehot) / counted;
        }
    }
    let local = vocab.div_ceil(tp);
    // Row r's column c of rank `rank`, or the padding's logit past the vocabulary.
    let column = |row: &[f32], c: usize| row.get(c).copied().unwrap_or(50.0);
    let got = on_tp(tp, |g| {
        let start = g.rank() * local;
        let mine: Vec<f32> = logits
            .chunks(vocab)
            .flat_map(|row| (start..start + local).map(|c| column(row, c)).collect::<Vec<_>>())
            .collect();
        let x = Tensor::<B, 2>::from_data(TensorData::new(mine, [rows, local]), &Default::default()).require_grad();
        let t = Tensor::<B, 1, Int>::from_ints(targets, &Default::default());
        let loss = vocab_parallel_cross_entropy(x.clone(), t, start, vocab, &g);
        let grads = loss.backward();
        g.check().unwrap();
        (loss.into_scalar(), tensor_to_vec(x.grad(&grads).unwrap()))
    });
    for (r, (loss, grad)) in got.iter().enumerate() {
        let label = format!("vocab {vocab} over {tp}, rank {r}");
        assert!(
            (*loss as f64 - want_loss).abs() < 1e-5,
            "{label}: loss {loss} vs {want_loss}"
        );
        let want: Vec<f32> = want_grad
            .chunks(vocab)
            .flat_map(|row| {
                (r * local..(r + 1) * local)
                    .map(|c| row.get(c).map_or(0.0, |&v| v as f32))
                    .collect::<Vec<_>>()
            })
            .collect();
        close(grad, &want, &format!("{label} logit gradient"));
    }
}
