//! Flat buffers in the compute dtype: gradient accumulators, 16-bit parameter shards, and the
//! conversions between them, f32 and Burn's `TensorData`.
//!
//! Every 16-bit value is produced by one round-to-nearest-even from an f32; sums are formed in
//! f32 and rounded once, like the collectives' reduction kernels. What the optimizer's step does to
//! whole buffers (accumulating, rounding, converting) runs in parallel chunks
//! ([`zero_core::passes`]).

use crate::settings::ComputeDtype;
use burn::tensor::{Shape, TensorData};
use half::{bf16, f16};
use rayon::prelude::*;
use zero_core::comm::{DType, FlatBuffer};
use zero_core::passes::{narrow, CHUNK};

/// A zero-filled buffer of `len` elements of `dtype`.
pub(crate) fn zeros(dtype: ComputeDtype, len: usize) -> FlatBuffer {
    FlatBuffer::zeros(dtype.flat(), len)
}

/// `acc[i] += values[i]`, summed in f32 and rounded once to the buffer's dtype.
pub(crate) fn add_into(acc: &mut FlatBuffer, values: &[f32]) {
    fn add<T: Send>(acc: &mut [T], values: &[f32], f: impl Fn(&mut T, f32) + Sync) {
        acc.par_chunks_mut(CHUNK)
            .zip(values.par_chunks(CHUNK))
            .for_each(|(a, v)| a.iter_mut().zip(v).for_each(|(a, &v)| f(a, v)));
    }
    match acc {
        FlatBuffer::F32(a) => add(a, values, |a, v| *a += v),
        FlatBuffer::BF16(a) => add(a, values, |a, v| *a = bf16::from_f32(a.to_f32() + v)),
        FlatBuffer::F16(a) => add(a, values, |a, v| *a = f16::from_f32(a.to_f32() + v)),
    }
}

/// The buffer in `dtype` (a move when it already is).
pub(crate) fn convert(buf: FlatBuffer, dtype: DType) -> FlatBuffer {
    if buf.dtype() == dtype {
        return buf;
    }
    match buf {
        FlatBuffer::F32(v) => FlatBuffer::from_f32(&v, dtype),
        other => FlatBuffer::from_f32(&other.into_f32(), dtype),
    }
}

/// Rounds f32 values to what `dtype` can hold (in place; nothing to do for f32).
pub(crate) fn round_to(dtype: ComputeDtype, values: &mut [f32]) {
    match dtype {
        ComputeDtype::F32 => {}
        ComputeDtype::Bf16 => values
            .par_chunks_mut(CHUNK)
            .for_each(|c| c.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32())),
        ComputeDtype::F16 => values
            .par_chunks_mut(CHUNK)
            .for_each(|c| c.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32())),
    }
}

/// Elements `range` of `buf` as a tensor's data of `shape`, in the buffer's dtype.
pub(crate) fn slice_data(buf: &FlatBuffer, range: std::ops::Range<usize>, shape: impl Into<Shape>) -> TensorData {
    match buf {
        FlatBuffer::F32(v) => TensorData::new(v[range].to_vec(), shape),
        FlatBuffer::BF16(v) => TensorData::new(v[range].to_vec(), shape),
        FlatBuffer::F16(v) => TensorData::new(v[range].to_vec(), shape),
    }
}

/// The first `len` elements of `buf` as a tensor's data of `shape`, in the buffer's dtype: what
/// [`slice_data`] gives for `0..len`, moved rather than copied.
pub(crate) fn into_data(buf: FlatBuffer, len: usize, shape: impl Into<Shape>) -> TensorData {
    match buf {
        FlatBuffer::F32(mut v) => {
            v.truncate(len);
            TensorData::new(v, shape)
        }
        FlatBuffer::BF16(mut v) => {
            v.truncate(len);
            TensorData::new(v, shape)
        }
        FlatBuffer::F16(mut v) => {
            v.truncate(len);
            TensorData::new(v, shape)
        }
    }
}

/// f32 values as a tensor's data of `shape` in `dtype` (rounded to nearest even).
pub(crate) fn f32_to_data(values: Vec<f32>, shape: impl Into<Shape>, dtype: ComputeDtype) -> TensorData {
    match dtype {
        ComputeDtype::F32 => TensorData::new(values, shape),
        ComputeDtype::Bf16 => TensorData::new(narrow::<bf16>(&values), shape),
        ComputeDtype::F16 => TensorData::new(narrow::<f16>(&values), shape),
    }
}

/// Writes f32 values into a 16-bit (or f32) buffer from `start`, rounded to nearest even.
pub(crate) fn write_rounded(buf: &mut FlatBuffer, start: usize, values: &[f32]) {
    let end = start + values.len();
    match buf {
        FlatBuffer::F32(v) => v[start..end].copy_from_slice(values),
        FlatBuffer::BF16(v) => v[start..end]
            .iter_mut()
            .zip(values)
            .for_each(|(d, &s)| *d = half::bf16::from_f32(s)),
        FlatBuffer::F16(v) => v[start..end]
            .iter_mut()
            .zip(values)
            .for_each(|(d, &s)| *d = half::f16::from_f32(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bit_accumulation_rounds_once_per_add() {
        // Reference: the f32 sum rounded to bf16 by the `half` crate after each addition.
        let mut acc = zeros(ComputeDtype::Bf16, 3);
        add_into(&mut acc, &[1.0, 1e-3, -2.5]);
        add_into(&mut acc, &[1.0 / 256.0, 1e-3, 0.75]);
        let want: Vec<f32> = [(1.0f32, 1.0 / 256.0), (1e-3, 1e-3), (-2.5, 0.75)]
            .iter()
            .map(|&(a, b)| bf16::from_f32(bf16::from_f32(a).to_f32() + b).to_f32())
            .collect();
        assert_eq!(acc.into_f32(), want);
        // 1 + 2^-8 is not a bf16: the sum rounds back to 1 (ties to even).
        let mut acc = zeros(ComputeDtype::Bf16, 1);
        add_into(&mut acc, &[1.0]);
        add_into(&mut acc, &[1.0 / 256.0]);
        assert_eq!(acc.into_f32(), vec![1.0]);
    }

    /// Reference: the same sums and roundings element by element, over more than one parallel
    /// chunk and a ragged end.
    #[test]
    fn whole_buffer_passes_match_the_element_by_element_ones() {
        let n = 2 * CHUNK + 5;
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.013).cos() * 3.0).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.007).sin() * 1e-2).collect();
        for dtype in [ComputeDtype::F32, ComputeDtype::Bf16, ComputeDtype::F16] {
            let round = |x: f32| match dtype {
                ComputeDtype::F32 => x,
                ComputeDtype::Bf16 => bf16::from_f32(x).to_f32(),
                ComputeDtype::F16 => f16::from_f32(x).to_f32(),
            };
            let mut acc = zeros(dtype, n);
            add_into(&mut acc, &a);
            add_into(&mut acc, &b);
            let want: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| round(round(x) + y)).collect();
            assert_eq!(acc.into_f32(), want, "{dtype:?} accumulation");
            let mut rounded = a.clone();
            round_to(dtype, &mut rounded);
            assert_eq!(
                rounded,
                a.iter().map(|&x| round(x)).collect::<Vec<_>>(),
                "{dtype:?} rounding"
            );
            let data = f32_to_data(a.clone(), vec![n], dtype);
            let back = crate::params::data_to_vec(data);
            assert_eq!(back, a.iter().map(|&x| round(x)).collect::<Vec<_>>(), "{dtype:?} data");
        }
    }

    #[test]
    fn rounding_and_tensor_data_agree_with_the_dtype() {
        let mut v = vec![0.1f32, 70000.0, -3.0];
        round_to(ComputeDtype::F16, &mut v);
        assert_eq!(v[1], f32::INFINITY, "70000 is beyond fp16's range");
        assert_eq!(v[2], -3.0);
        assert_ne!(v[0], 0.1);
        let data = f32_to_data(vec![1.0, 2.0, 3.0, 4.0], vec![2, 2], ComputeDtype::Bf16);
        assert_eq!(data.dtype, burn::tensor::DType::BF16);
        let buf = FlatBuffer::from_f32(&[5.0, 6.0, 7.0], DType::F16);
        assert_eq!(into_data(buf.clone(), 2, vec![2]), slice_data(&buf, 0..2, vec![2]));
        let data = slice_data(&buf, 1..3, vec![2]);
        assert_eq!(data.dtype, burn::tensor::DType::F16);
        assert_eq!(
            data.convert::<f32>().into_vec::<f32>().unwrap_or_default(),
            vec![6.0, 7.0]
        );
    }
}
