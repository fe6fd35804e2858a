//! Flat typed buffers: what collectives move.

use half::{bf16, f16};

/// Element type of a flat buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// An owned flat buffer of one of the communication dtypes.
#[derive(Clone, Debug, PartialEq)]
pub enum FlatBuffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
}

/// A borrowed flat buffer.
#[derive(Clone, Copy, Debug)]
pub enum BufferRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
}

/// A mutably borrowed flat buffer.
#[derive(Debug)]
pub enum BufferMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
}

impl FlatBuffer {
    /// A zero-filled buffer.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => FlatBuffer::F32(vec![0.0; len]),
            // Filled now: a zeroed allocation, faulted in page by page later, made the offloaded
            // step slower (BENCHMARKS.md, "The offloaded optimizer step's passes in parallel").
            DType::F16 => FlatBuffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => FlatBuffer::BF16(vec![bf16::ZERO; len]),
        }
    }

    /// The f32 values converted to `dtype` (rounded to nearest even for 16-bit types).
    pub fn from_f32(values: &[f32], dtype: DType) -> Self {
        match dtype {
            DType::F32 => FlatBuffer::F32(values.to_vec()),
            DType::F16 => FlatBuffer::F16(crate::passes::narrow(values)),
            DType::BF16 => FlatBuffer::BF16(crate::passes::narrow(values)),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            FlatBuffer::F32(_) => DType::F32,
            FlatBuffer::F16(_) => DType::F16,
            FlatBuffer::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            FlatBuffer::F32(v) => v.len(),
            FlatBuffer::F16(v) => v.len(),
            FlatBuffer::BF16(v) => v.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// The values widened to f32 (a copy for 16-bit types, a move for f32).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            FlatBuffer::F32(v) => v,
            FlatBuffer::F16(v) => crate::passes::widen(&v),
            FlatBuffer::BF16(v) => crate::passes::widen(&v),
        }
    }

    /// A borrowed view.
    pub fn as_ref(&self) -> BufferRef<'_> {
        match self {
            FlatBuffer::F32(v) => BufferRef::F32(v),
            FlatBuffer::F16(v) => BufferRef::F16(v),
            FlatBuffer::BF16(v) => BufferRef::BF16(v),
        }
    }

    /// The elements as a `Vec<T>` when `T` is this buffer's element type.
    pub(crate) fn into_vec<T: crate::comm::reduce::Element>(self) -> Option<Vec<T>> {
        if self.dtype() != T::DTYPE {
            return None;
        }
        match self {
            FlatBuffer::F32(v) => bytemuck::allocation::try_cast_vec(v).ok(),
            FlatBuffer::F16(v) => bytemuck::allocation::try_cast_vec(v).ok(),
            FlatBuffer::BF16(v) => bytemuck::allocation::try_cast_vec(v).ok(),
        }
    }

    /// Only the elements of `range`, moved to the front of the same allocation, which is then
    /// shrunk: no fresh pages are touched, unlike a new buffer of the range's length.
    pub(crate) fn keep_range(self, range: std::ops::Range<usize>) -> FlatBuffer {
        fn keep<T: Copy>(mut v: Vec<T>, range: std::ops::Range<usize>) -> Vec<T> {
            let n = range.len();
            v.copy_within(range, 0);
            v.truncate(n);
            v.shrink_to_fit();
            v
        }
        match self {
            FlatBuffer::F32(v) => FlatBuffer::F32(keep(v, range)),
            FlatBuffer::F16(v) => FlatBuffer::F16(keep(v, range)),
            FlatBuffer::BF16(v) => FlatBuffer::BF16(keep(v, range)),
        }
    }

    /// Copies `src` into this buffer if both have the same dtype and length; false (and nothing
    /// copied) otherwise.
    pub fn copy_from(&mut self, src: &FlatBuffer) -> bool {
        match (self, src) {
            (FlatBuffer::F32(d), FlatBuffer::F32(s)) if d.len() == s.len() => d.copy_from_slice(s),
            (FlatBuffer::F16(d), FlatBuffer::F16(s)) if d.len() == s.len() => d.copy_from_slice(s),
            (FlatBuffer::BF16(d), FlatBuffer::BF16(s)) if d.len() == s.len() => d.copy_from_slice(s),
            _ => return false,
        }
        true
    }

    /// A mutable view.
    pub fn as_mut(&mut self) -> BufferMut<'_> {
        match self {
            FlatBuffer::F32(v) => BufferMut::F32(v),
            FlatBuffer::F16(v) => BufferMut::F16(v),
            FlatBuffer::BF16(v) => BufferMut::BF16(v),
        }
    }
}
