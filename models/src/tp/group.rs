//! The tensor-parallel group as the layers hold it, and tensors through its collectives.

use burn::prelude::*;
use burn::tensor::{FloatDType, TensorData};
use std::sync::{Arc, Mutex};
use zero_core::comm::{CommError, FlatBuffer, ReduceOp, SharedGroup};

/// A tensor-parallel collective failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("tensor-parallel rank {rank}: {op} failed: {source}")]
pub struct TpError {
    /// This rank's index in the tensor-parallel group.
    pub rank: usize,
    /// Which use of the group failed (`f backward`, `g forward`, ...).
    pub op: &'static str,
    /// What the group reported.
    pub source: CommError,
}

/// The tensor-parallel [`ProcessGroup`](zero_core::comm::ProcessGroup) every tensor-parallel
/// layer of a model shares, and the first failure seen on it.
///
/// Burn's forward and backward passes cannot return errors, so a failed collective does not
/// panic: its output is filled with NaN (so the loss shows it at once), the error is kept, and
/// [`TpGroup::check`] returns it. Later collectives still run (and fail fast on a poisoned
/// group), so the ranks never wait on each other forever.
#[derive(Clone)]
pub struct TpGroup {
    group: SharedGroup,
    failure: Arc<Mutex<Option<TpError>>>,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpGroup(rank {} of {})", self.group.rank(), self.group.world_size())
    }
}

impl TpGroup {
    /// Wraps the tensor-parallel group of this rank.
    pub fn new(group: SharedGroup) -> Self {
        TpGroup {
            group,
            failure: Arc::new(Mutex::new(None)),
        }
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Number of tensor-parallel ranks.
    pub fn size(&self) -> usize {
        self.group.world_size()
    }

    /// The underlying process group.
    pub fn group(&self) -> &SharedGroup {
        &self.group
    }

    /// The first collective that failed on this group, if any.
    pub fn check(&self) -> Result<(), TpError> {
        match self.failure.lock() {
            Ok(f) => f.clone().map_or(Ok(()), Err),
            // A panic while recording: the failure itself is lost, but not the fact.
            Err(_) => Err(TpError {
                rank: self.rank(),
                op: "recording a failure",
                source: CommError::Setup("a thread panicked while recording a failure".into()),
            }),
        }
    }

    /// All-reduces `values` in place; on failure records it and fills them with NaN.
    pub(crate) fn all_reduce_vec(&self, values: Vec<f32>, op: ReduceOp, what: &'static str) -> Vec<f32> {
        if self.size() == 1 {
            return values;
        }
        let len = values.len();
        let mut buffer = FlatBuffer::F32(values);
        match self.group.all_reduce(&mut buffer, op) {
            Ok(()) => buffer.into_f32(),
            Err(source) => {
                if let Ok(mut f) = self.failure.lock() {
                    f.get_or_insert(TpError {
                        rank: self.rank(),
                        op: what,
                        source,
                    });
                }
                vec![f32::NAN; len]
            }
        }
    }

    /// The element-wise all-reduction of a tensor over the group (no autodiff: the values).
    pub(crate) fn all_reduce_tensor<B: Backend, const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        op: ReduceOp,
        what: &'static str,
    ) -> Tensor<B, D> {
        if self.size() == 1 {
            return tensor;
        }
        let device = tensor.device();
        let shape = tensor.shape();
        let dtype = tensor.dtype();
        // Reduced in f32 and rounded once to the tensor's own dtype, as the comm layer does
        // for 16-bit buffers.
        let values = zero_burn::params::tensor_to_vec(tensor);
        let reduced = self.all_reduce_vec(values, op, what);
        let out = Tensor::<B, D>::from_data(TensorData::new(reduced, shape), &device);
        if out.dtype() == dtype {
            out
        } else {
            out.cast(FloatDType::from(dtype))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use zero_core::comm::ThreadGroup;

    /// Reference: the sum and the maximum written out for two ranks.
    #[test]
    fn tensors_reduce_over_the_group() {
        let ranks = ThreadGroup::new_group(2).unwrap();
        let out: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|g| {
                    let g = TpGroup::new(g.clone() as SharedGroup);
                    s.spawn(move || {
                        let r = g.rank() as f32;
                        let t = Tensor::<Flex, 2>::from_floats([[r, -r], [1.0, 2.0 * r]], &Default::default());
                        let sum = g.all_reduce_tensor(t.clone(), ReduceOp::Sum, "test");
                        let max = g.all_reduce_tensor(t, ReduceOp::Max, "test");
                        assert!(g.check().is_ok());
                        (sum.into_data().to_vec().unwrap(), max.into_data().to_vec().unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, max) in out {
            assert_eq!(sum, vec![1.0, -1.0, 2.0, 2.0]);
            assert_eq!(max, vec![1.0, 0.0, 1.0, 2.0]);
        }
    }

    /// A bf16 activation stays bf16: reference, the sum of two bf16-exact values.
    #[test]
    fn sixteen_bit_tensors_keep_their_dtype() {
        let ranks = ThreadGroup::new_group(2).unwrap();
        let out: Vec<(burn::tensor::DType, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|g| {
                    let g = TpGroup::new(g.clone() as SharedGroup);
                    s.spawn(move || {
                        let t =
                            Tensor::<Flex, 1>::from_floats([1.5, -0.25], &Default::default()).cast(FloatDType::BF16);
                        let sum = g.all_reduce_tensor(t, ReduceOp::Sum, "test");
                        (sum.dtype(), zero_burn::params::tensor_to_vec(sum))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (dtype, values) in out {
            assert_eq!(dtype, burn::tensor::DType::BF16);
            assert_eq!(values, vec![3.0, -0.5]);
        }
    }

    /// A peer that leaves makes the collective fail: NaN comes back and the error is kept.
    #[test]
    fn a_lost_peer_is_recorded_not_hung() {
        let mut ranks = ThreadGroup::with_timeout(2, std::time::Duration::from_secs(5)).unwrap();
        let survivor = TpGroup::new(ranks.remove(0) as SharedGroup);
        drop(ranks);
        let out = survivor.all_reduce_vec(vec![1.0, 2.0], ReduceOp::Sum, "g forward");
        assert!(out.iter().all(|v| v.is_nan()));
        let err = survivor.check().unwrap_err();
        assert_eq!(err.op, "g forward");
        assert_eq!(err.rank, 0);
    }
}
