//! Element-wise reduction kernels shared by the backends.
//!
//! Every reduction accumulates in f32, whatever the buffer's dtype, and rounds to the buffer's
//! dtype once, at the end: a 16-bit all-reduce over many ranks is then as exact as one rounding
//! of the f32 sum allows, instead of losing a bit per hop.

use super::{DType, ReduceOp};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements processed per block: small enough that the f32 accumulator stays in L1.
pub(crate) const BLOCK: usize = 2048;

/// An element type that collectives move.
pub(crate) trait Element: Copy + Send + Sync + bytemuck::Pod + 'static {
    /// The dtype tag.
    const DTYPE: DType;
    /// Widens `src` into `dst` (equal lengths).
    fn load(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` into `dst` (equal lengths), to nearest even.
    fn store(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// `acc[i] = acc[i] ⊕ x[i]`. Max uses `f32::max`: a NaN loses against a number.
#[inline]
pub(crate) fn combine(acc: &mut [f32], x: &[f32], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(*b)),
    }
}

/// `acc[i] = a[i] ⊕ b[i]`.
#[inline]
fn combine2(acc: &mut [f32], a: &[f32], b: &[f32], op: ReduceOp) {
    let it = acc.iter_mut().zip(a).zip(b);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => it.for_each(|((o, x), y)| *o = *x + *y),
        ReduceOp::Max => it.for_each(|((o, x), y)| *o = x.max(*y)),
    }
}

/// Applies what remains of `op` once every rank has been combined (the division of a mean).
#[inline]
pub(crate) fn finish(acc: &mut [f32], op: ReduceOp, world: usize) {
    if op == ReduceOp::Avg {
        let n = world as f32;
        acc.iter_mut().for_each(|a| *a /= n);
    }
}

/// Reduces `len` elements read through `inputs` (one pointer per rank, combined in rank order)
/// and writes the result through every pointer of `outputs`.
///
/// # Safety
/// Every input pointer must be valid for reads of `len` elements and every output for writes of
/// `len` elements for the whole call, and no other thread may access any of them meanwhile.
/// Outputs may be inputs: each block is read completely before it is written.
pub(crate) unsafe fn reduce_raw<T: Element>(inputs: &[*const T], outputs: &[*mut T], len: usize, op: ReduceOp) {
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    let mut start = 0;
    while start < len {
        let n = BLOCK.min(len - start);
        // SAFETY: in bounds by the caller's contract; the shared slices end before any output
        // slice below is created.
        let src = |j: usize| unsafe { std::slice::from_raw_parts(inputs[j].add(start), n) };
        let mut j = 0;
        if T::DTYPE == DType::F32 && inputs.len() >= 2 {
            // f32 needs no widening: the first two inputs are combined straight from memory, one
            // pass instead of a copy of each into the accumulator.
            let (a, b) = (
                bytemuck::cast_slice::<T, f32>(src(0)),
                bytemuck::cast_slice::<T, f32>(src(1)),
            );
            combine2(&mut acc[..n], a, b, op);
            j = 2;
        }
        for j in j..inputs.len() {
            if j == 0 {
                T::load(src(j), &mut acc[..n]);
            } else if T::DTYPE == DType::F32 {
                combine(&mut acc[..n], bytemuck::cast_slice::<T, f32>(src(j)), op);
            } else {
                T::load(src(j), &mut tmp[..n]);
                combine(&mut acc[..n], &tmp[..n], op);
            }
        }
        finish(&mut acc[..n], op, inputs.len());
        if let Some((&first, rest)) = outputs.split_first() {
            // SAFETY: as above.
            let dst = unsafe { std::slice::from_raw_parts_mut(first.add(start), n) };
            T::store(&acc[..n], dst);
            for &out in rest {
                // SAFETY: as above; distinct outputs do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(first.add(start), out.add(start), n) };
            }
        }
        start += n;
    }
}

/// Widens a whole slice to a new f32 vector.
pub(crate) fn widen<T: Element>(src: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; src.len()];
    T::load(src, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bit_sum_rounds_once() {
        // Reference: the f64 sum of the widened inputs, rounded once to f16. Four ranks each
        // adding 1/3 (as f16) overflow no bit of f32, so one rounding gives the nearest f16.
        let x = f16::from_f32(1.0 / 3.0);
        let inputs = vec![vec![x; 5]; 4];
        let ptrs: Vec<*const f16> = inputs.iter().map(|v| v.as_ptr()).collect();
        let mut out = vec![f16::ZERO; 5];
        unsafe { reduce_raw(&ptrs, &[out.as_mut_ptr()], 5, ReduceOp::Sum) };
        let want = f16::from_f64(4.0 * x.to_f64());
        assert!(out.iter().all(|&o| o == want), "{out:?} != {want}");
    }

    #[test]
    fn avg_and_max_in_place() {
        // Reference: elementwise mean and max computed in f64 below.
        let len = BLOCK + 7;
        let mut a: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..len).map(|i| (len - i) as f32).collect();
        let a0 = a.clone();
        let ptrs = [a.as_ptr(), b.as_ptr()];
        unsafe { reduce_raw(&ptrs, &[a.as_mut_ptr()], len, ReduceOp::Avg) };
        for i in 0..len {
            assert_eq!(a[i] as f64, (a0[i] as f64 + b[i] as f64) / 2.0);
        }
        let mut c = a0.clone();
        let ptrs = [c.as_ptr(), b.as_ptr()];
        unsafe { reduce_raw(&ptrs, &[c.as_mut_ptr()], len, ReduceOp::Max) };
        for i in 0..len {
            assert_eq!(c[i], a0[i].max(b[i]));
        }
    }
}
