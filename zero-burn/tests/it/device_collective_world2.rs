//! `HostStaged`, the device collective of the CPU path, at world size 2 on two rank threads:
//! every collective it offers (all_reduce and reduce_scatter with each reduction, all_gather,
//! all_gather_start, broadcast from each root, all_reduce_scalars with each reduction), in each
//! dtype, on Flex tensors.
//!
//! The NCCL tests run at world size 1, where sum, mean and max are all the identity. Here the
//! two ranks hold different values, chosen so that each reduction's result differs from either
//! rank's input and from every other reduction's (checked below, so that the test keeps telling
//! them apart). Reference: the results computed here in f64. Every input, sum and half is a
//! multiple of 1/8 below 8 in magnitude, exact in f32, f16 and bf16, so the results must equal
//! the reference exactly.

use crate::common;
use burn::backend::Flex;
use burn::tensor::{DType, Tensor, TensorData};
use zero_burn::{DeviceCollective, HostStaged};
use zero_core::comm::ReduceOp;
use zero_test_support::max_abs_diff;

type F = Flex;

const WORLD: usize = 2;
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// Rank `rank`'s values: the larger of the two is rank 0's at some places and rank 1's at
/// others, and some sums are below both inputs (negative values).
fn input(rank: usize) -> Vec<f64> {
    match rank {
        0 => vec![1.5, -2.0, 0.75, -0.5, 3.0, -1.25, 0.25, 2.5],
        _ => vec![-0.5, 1.0, 2.25, -1.5, -2.0, 0.5, 1.75, -3.5],
    }
}

/// The reduction `op` of both ranks' values, in f64.
fn reduced(op: ReduceOp) -> Vec<f64> {
    let (a, b) = (input(0), input(1));
    a.iter()
        .zip(&b)
        .map(|(&x, &y)| match op {
            ReduceOp::Sum => x + y,
            ReduceOp::Avg => (x + y) / WORLD as f64,
            ReduceOp::Max => x.max(y),
        })
        .collect()
}

fn tensor(values: &[f64], dtype: DType) -> Tensor<F, 1> {
    let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    Tensor::<F, 1>::from_data(TensorData::new(v, [values.len()]), &Default::default()).cast(dtype)
}

/// A result's values, after checking that it kept `dtype`.
fn read(what: &str, t: Tensor<F, 1>, dtype: DType) -> Vec<f64> {
    assert_eq!(t.dtype(), dtype, "{what}: the result keeps the input's dtype");
    let values = t.into_data().convert::<f32>().into_vec::<f32>().expect("f32 values");
    values.into_iter().map(f64::from).collect()
}

fn assert_exact(what: &str, got: &[f64], want: &[f64]) {
    let diff = max_abs_diff(what, got, want);
    assert_eq!(diff, 0.0, "{what}: {got:?} against the reference {want:?}");
}

/// Runs `f(rank, collective)` on one thread per rank; the results in rank order.
fn on_ranks<T: Send>(f: impl Fn(usize, HostStaged) -> T + Sync) -> Vec<T> {
    common::on_ranks(WORLD, |rank, group| f(rank, HostStaged::new(group)))
}

#[test]
fn the_inputs_tell_every_reduction_apart() {
    let results: Vec<(ReduceOp, Vec<f64>)> = OPS.iter().map(|&op| (op, reduced(op))).collect();
    for (op, r) in &results {
        for rank in 0..WORLD {
            assert_ne!(r, &input(rank), "{op:?} equals rank {rank}'s input");
        }
        for (other, s) in &results {
            if other != op {
                assert_ne!(r, s, "{op:?} equals {other:?}");
            }
        }
    }
    // Each half too, as reduce_scatter hands them out.
    let half = input(0).len() / WORLD;
    for rank in 0..WORLD {
        let shard = |v: Vec<f64>| v[rank * half..(rank + 1) * half].to_vec();
        for (op, r) in &results {
            assert_ne!(shard(r.clone()), shard(input(rank)), "{op:?}: shard {rank}");
            for (other, s) in &results {
                if other != op {
                    assert_ne!(shard(r.clone()), shard(s.clone()), "{op:?} and {other:?}: shard {rank}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_sums_averages_and_takes_the_max_across_two_ranks() {
    for dtype in DTYPES {
        let out = on_ranks(|rank, c| {
            OPS.map(|op| {
                let what = format!("{dtype:?} all_reduce {op:?}, rank {rank}");
                let t = DeviceCollective::<F>::all_reduce(&c, tensor(&input(rank), dtype), op).expect("all_reduce");
                (what.clone(), read(&what, t, dtype), reduced(op))
            })
        });
        for (what, got, want) in out.iter().flatten() {
            assert_exact(what, got, want);
        }
    }
}

#[test]
fn reduce_scatter_hands_each_rank_its_half_of_every_reduction() {
    for dtype in DTYPES {
        let out = on_ranks(|rank, c| {
            OPS.map(|op| {
                let what = format!("{dtype:?} reduce_scatter {op:?}, rank {rank}");
                let t =
                    DeviceCollective::<F>::reduce_scatter(&c, tensor(&input(rank), dtype), op).expect("reduce_scatter");
                let want = reduced(op);
                let half = want.len() / WORLD;
                (
                    what.clone(),
                    read(&what, t, dtype),
                    want[rank * half..(rank + 1) * half].to_vec(),
                )
            })
        });
        for (what, got, want) in out.iter().flatten() {
            assert_exact(what, got, want);
        }
    }
}

#[test]
fn all_gather_and_its_started_form_concatenate_in_rank_order() {
    let want: Vec<f64> = (0..WORLD).flat_map(input).collect();
    for dtype in DTYPES {
        let out = on_ranks(|rank, c| {
            let now = DeviceCollective::<F>::all_gather(&c, tensor(&input(rank), dtype)).expect("all_gather");
            let started = DeviceCollective::<F>::all_gather_start(&c, tensor(&input(rank), dtype));
            let later = started.wait().expect("all_gather_start");
            let what = |how: &str| format!("{dtype:?} {how}, rank {rank}");
            [
                (what("all_gather"), read(&what("all_gather"), now, dtype)),
                (what("all_gather_start"), read(&what("all_gather_start"), later, dtype)),
            ]
        });
        for (what, got) in out.iter().flatten() {
            assert_exact(what, got, &want);
        }
    }
}

#[test]
fn broadcast_hands_every_rank_the_roots_tensor() {
    for dtype in DTYPES {
        for root in 0..WORLD {
            let out = on_ranks(|rank, c| {
                let what = format!("{dtype:?} broadcast from {root}, rank {rank}");
                let t = DeviceCollective::<F>::broadcast(&c, tensor(&input(rank), dtype), root).expect("broadcast");
                (what.clone(), read(&what, t, dtype))
            });
            for (what, got) in &out {
                assert_exact(what, got, &input(root));
            }
        }
    }
}

#[test]
fn all_reduce_scalars_reduces_with_every_op() {
    let out = on_ranks(|rank, c| {
        OPS.map(|op| {
            let mut values: Vec<f32> = input(rank).iter().map(|&x| x as f32).collect();
            DeviceCollective::<F>::all_reduce_scalars(&c, &mut values, op).expect("all_reduce_scalars");
            let what = format!("all_reduce_scalars {op:?}, rank {rank}");
            (what, values.into_iter().map(f64::from).collect::<Vec<_>>(), reduced(op))
        })
    });
    for (what, got, want) in out.iter().flatten() {
        assert_exact(what, got, want);
    }
}
