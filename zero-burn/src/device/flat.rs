//! Moving parameters and gradients between a Burn module and flat device tensors, without
//! leaving the device.
//!
//! Parameters are visited in Burn's order, the order of the partition layout (as in
//! [`crate::params`], which does the same through host vectors).

use crate::error::ZeroError;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Shape, Tensor};

/// Every float parameter's value, flattened, on its device (the autodiff wrapper removed); a
/// `ZeroModule` shard offloaded by `offload_param` read from where it is kept and uploaded.
pub(crate) fn read_flat<B: AutodiffBackend, M: Module<B>>(
    module: &M,
) -> Result<Vec<Tensor<B::InnerBackend, 1>>, ZeroError> {
    struct Read<B: AutodiffBackend>(Vec<Tensor<B::InnerBackend, 1>>, Option<ZeroError>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Read<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let n = value.shape().num_elements();
            let stored = crate::sharded::stored_values(param.id, &value, n);
            let inner = value.inner();
            let device = inner.device();
            // A `ZeroModule` skeleton's parameter holds no value: not reshaped, which could
            // copy it with a kernel over no elements (see [`zeros`]).
            let flat = if n == 0 {
                zeros(0, inner.dtype(), &device)
            } else {
                inner.reshape([n])
            };
            self.0.push(match stored {
                None => flat,
                Some(Ok(data)) => {
                    let dtype = data.dtype;
                    Tensor::from_data(data, (&device, dtype))
                }
                Some(Err(e)) => {
                    self.1.get_or_insert(e);
                    flat
                }
            });
        }
    }
    let mut r = Read::<B>(Vec::new(), None);
    module.visit(&mut r);
    match r.1 {
        Some(e) => Err(e),
        None => Ok(r.0),
    }
}

/// Replaces every float parameter's value with `source(index, shape)` (a flat tensor of the
/// parameter's element count), reshaped, as a new autodiff leaf; ids are kept. A parameter for
/// which `source` gives `None` stays as it is.
pub(crate) fn write_flat<B: AutodiffBackend, M: Module<B>>(
    module: M,
    mut source: impl FnMut(usize, &Shape) -> Option<Tensor<B::InnerBackend, 1>>,
) -> M {
    struct Write<'a, F> {
        index: usize,
        source: &'a mut F,
    }
    impl<B: AutodiffBackend, F: FnMut(usize, &Shape) -> Option<Tensor<B::InnerBackend, 1>>> ModuleMapper<B>
        for Write<'_, F>
    {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let shape = param.lazy_shape();
            let flat = (self.source)(self.index, &shape);
            self.index += 1;
            let Some(flat) = flat else { return param };
            let dims: [usize; D] = shape.dims::<D>();
            // Each parameter keeps its own `require_grad` (a frozen one stays frozen).
            let tensor = Tensor::<B, D>::from_inner(flat.reshape(dims)).set_require_grad(param.is_require_grad());
            Param::initialized(param.id, tensor)
        }
    }
    module.map(&mut Write {
        index: 0,
        source: &mut source,
    })
}

/// `len` zeros. An empty tensor is made without a kernel: Burn's CUDA backend fills (and copies)
/// even an empty tensor with a kernel launched over no blocks, which the driver refuses
/// (`CUDA_ERROR_INVALID_VALUE`), failing the step. No tensor of this crate's device paths
/// should reach a kernel empty.
pub(crate) fn zeros<B: Backend>(len: usize, dtype: DType, device: &B::Device) -> Tensor<B, 1> {
    if len == 0 {
        Tensor::empty([0], (device, dtype))
    } else {
        Tensor::zeros([len], (device, dtype))
    }
}

/// `t`'s value, with a one-element uninitialized tensor on its device left in its place, so
/// that the value taken is the only handle to its buffer and the backend may update it in place.
/// The stand-in is not empty (see [`zeros`]); `empty` allocates and launches nothing.
pub(crate) fn take<B: Backend>(t: &mut Tensor<B, 1>) -> Tensor<B, 1> {
    let stand_in = Tensor::empty([1], (&t.device(), t.dtype()));
    std::mem::replace(t, stand_in)
}

/// The concatenation of `parts` (already in `dtype`) followed by zeros up to `padded` elements.
pub(crate) fn flatten<B: Backend>(
    mut parts: Vec<Tensor<B, 1>>,
    padded: usize,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, 1> {
    // Empty parts are left out of the concatenation, which would copy each with a kernel.
    parts.retain(|p| p.dims()[0] > 0);
    let used: usize = parts.iter().map(|p| p.dims()[0]).sum();
    if padded > used {
        parts.push(Tensor::zeros([padded - used], (device, dtype)));
    }
    match parts.len() {
        0 => zeros(0, dtype, device),
        1 => parts.remove(0),
        _ => Tensor::cat(parts, 0),
    }
}
