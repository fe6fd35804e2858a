//! Shared by the comm tests: deterministic inputs, the f64 single-process reference, and the
//! matrix of collectives every backend must get right.

#![allow(dead_code)]

mod world;

#[allow(unused_imports)]
pub use world::{free_port, run_ranks};
use zero_core::comm::{DType, FlatBuffer, ProcessGroup, ReduceOp};

/// Buffer lengths that exercise uneven chunking (world sizes 2-4 divide none of 7 and 1001).
pub const LENS: [usize; 3] = [1, 7, 1001];
/// Every communication dtype.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
/// Every reduction.
pub const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// Collectives [`exercise`] runs: per dtype and length, all_reduce and reduce_scatter per op,
/// two all_gathers (a fresh and a reused output) and one broadcast; then four in
/// [`exercise_async`].
pub const EXERCISE_COUNT: usize = DTYPES.len() * LENS.len() * (2 * OPS.len() + 3) + 4;

/// Rank `rank`'s deterministic input: values in [-2, 2) on a 1/1024 grid, different for every
/// rank, element and salt.
pub fn input(rank: usize, len: usize, salt: u64) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let mut x = (rank as u64 + 1)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add((i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9))
                .wrapping_add(salt.wrapping_mul(0x94D0_49BB_1331_11EB));
            x ^= x >> 31;
            x = x.wrapping_mul(0xD6E8_FEB8_6659_FD93);
            x ^= x >> 32;
            (x % 4096) as f32 / 1024.0 - 2.0
        })
        .collect()
}

/// The input as the rank holds it (rounded to `dtype`), widened to f64.
pub fn held(rank: usize, len: usize, salt: u64, dtype: DType) -> Vec<f64> {
    FlatBuffer::from_f32(&input(rank, len, salt), dtype)
        .into_f32()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Relative precision of one rounding to `dtype`.
fn eps(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f64::powi(2.0, -23),
        DType::F16 => f64::powi(2.0, -10),
        DType::BF16 => f64::powi(2.0, -7),
    }
}

/// The reference: every rank's held values reduced in f64 (exact here), with the magnitude that
/// bounds the rounding error of each element.
pub fn reference(world: usize, len: usize, salt: u64, dtype: DType, op: ReduceOp) -> (Vec<f64>, Vec<f64>) {
    let all: Vec<Vec<f64>> = (0..world).map(|r| held(r, len, salt, dtype)).collect();
    let mut want = vec![0.0; len];
    let mut scale = vec![0.0; len];
    for i in 0..len {
        let column = all.iter().map(|v| v[i]);
        want[i] = match op {
            ReduceOp::Sum => column.clone().sum(),
            ReduceOp::Avg => column.clone().sum::<f64>() / world as f64,
            ReduceOp::Max => column.clone().fold(f64::NEG_INFINITY, f64::max),
        };
        let abs: f64 = column.map(f64::abs).sum();
        scale[i] = if op == ReduceOp::Avg { abs / world as f64 } else { abs };
    }
    (want, scale)
}

/// Asserts `got` equals the reference up to one rounding to its dtype (exactly, for Max).
pub fn assert_close(got: &FlatBuffer, want: &[f64], scale: &[f64], dtype: DType, op: ReduceOp, what: &str) {
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    assert_eq!(got.len(), want.len(), "{what}: length");
    let values = got.clone().into_f32();
    for i in 0..want.len() {
        // One rounding to the dtype plus f32 accumulation over at most 4 ranks.
        let tol = if op == ReduceOp::Max {
            0.0
        } else {
            (eps(dtype) + 1e-6) * scale[i]
        };
        let err = (values[i] as f64 - want[i]).abs();
        assert!(
            err <= tol,
            "{what}: element {i}: got {}, want {} (tolerance {tol})",
            values[i],
            want[i]
        );
    }
}

/// Runs every collective on every dtype and length against the reference; returns the number of
/// collectives run. Call on every rank of a group at once.
pub fn exercise(g: &dyn ProcessGroup) -> usize {
    let (rank, world) = (g.rank(), g.world_size());
    let mut salt = 0u64;
    let mut count = 0;
    for dtype in DTYPES {
        for len in LENS {
            for op in OPS {
                salt += 1;
                let what = format!("rank {rank}/{world} all_reduce {op:?} {dtype:?} len {len}");
                let mut buf = FlatBuffer::from_f32(&input(rank, len, salt), dtype);
                g.all_reduce(&mut buf, op).unwrap_or_else(|e| panic!("{what}: {e}"));
                let (want, scale) = reference(world, len, salt, dtype, op);
                assert_close(&buf, &want, &scale, dtype, op, &what);
                count += 1;

                salt += 1;
                let what = format!("rank {rank}/{world} reduce_scatter {op:?} {dtype:?} len {len}");
                let full = len * world;
                let buf = FlatBuffer::from_f32(&input(rank, full, salt), dtype);
                let out = g.reduce_scatter(buf, op).unwrap_or_else(|e| panic!("{what}: {e}"));
                let (want, scale) = reference(world, full, salt, dtype, op);
                let mine = rank * len..(rank + 1) * len;
                assert_close(&out, &want[mine.clone()], &scale[mine], dtype, op, &what);
                count += 1;
            }
            salt += 1;
            let what = format!("rank {rank}/{world} all_gather {dtype:?} len {len}");
            let shard = FlatBuffer::from_f32(&input(rank, len, salt), dtype);
            let out = g.all_gather(shard).unwrap_or_else(|e| panic!("{what}: {e}"));
            let want: Vec<f64> = (0..world).flat_map(|r| held(r, len, salt, dtype)).collect();
            assert_close(&out, &want, &vec![0.0; want.len()], dtype, ReduceOp::Max, &what);
            // Again into a reused output buffer holding stale values.
            let shard = FlatBuffer::from_f32(&input(rank, len, salt), dtype);
            let mut reused = FlatBuffer::from_f32(&vec![9.0; len * world], dtype);
            g.all_gather_into(shard, &mut reused)
                .unwrap_or_else(|e| panic!("{what} into: {e}"));
            assert_close(&reused, &want, &vec![0.0; want.len()], dtype, ReduceOp::Max, &what);
            count += 2;

            salt += 1;
            let root = (salt as usize) % world;
            let what = format!("rank {rank}/{world} broadcast from {root} {dtype:?} len {len}");
            let mut buf = FlatBuffer::from_f32(&input(rank, len, salt), dtype);
            g.broadcast(&mut buf, root).unwrap_or_else(|e| panic!("{what}: {e}"));
            let want = held(root, len, salt, dtype);
            assert_close(&buf, &want, &vec![0.0; len], dtype, ReduceOp::Max, &what);
            count += 1;
        }
    }
    count + exercise_async(g, salt)
}

/// Several collectives in flight at once, waited in reverse order, with a blocking barrier in
/// between: they must still complete in issue order with the right results.
fn exercise_async(g: &dyn ProcessGroup, salt: u64) -> usize {
    let (rank, world) = (g.rank(), g.world_size());
    let len = 1001;
    let a = g.all_reduce_async(
        FlatBuffer::from_f32(&input(rank, len, salt + 1), DType::BF16),
        ReduceOp::Sum,
    );
    let b = g.all_gather_async(FlatBuffer::from_f32(&input(rank, len, salt + 2), DType::F32));
    let c = g.reduce_scatter_async(
        FlatBuffer::from_f32(&input(rank, len * world, salt + 3), DType::F16),
        ReduceOp::Avg,
    );
    g.barrier().expect("barrier between async collectives");
    let c = c.wait().expect("async reduce_scatter");
    let b = b.wait().expect("async all_gather");
    let a = a.wait().expect("async all_reduce");
    let (want, scale) = reference(world, len, salt + 1, DType::BF16, ReduceOp::Sum);
    assert_close(&a, &want, &scale, DType::BF16, ReduceOp::Sum, "async all_reduce");
    let want: Vec<f64> = (0..world).flat_map(|r| held(r, len, salt + 2, DType::F32)).collect();
    assert_close(
        &b,
        &want,
        &vec![0.0; want.len()],
        DType::F32,
        ReduceOp::Max,
        "async all_gather",
    );
    let (want, scale) = reference(world, len * world, salt + 3, DType::F16, ReduceOp::Avg);
    let mine = rank * len..(rank + 1) * len;
    assert_close(
        &c,
        &want[mine.clone()],
        &scale[mine],
        DType::F16,
        ReduceOp::Avg,
        "async reduce_scatter",
    );
    4
}
