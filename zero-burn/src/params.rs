//! Moving parameter values and gradients between Burn modules and flat host buffers.
//!
//! Every function visits the module's float parameters in Burn's visit order, which is the order
//! of the partition layout: the i-th float parameter visited is `layout.params[i]`.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Shape, Tensor, TensorData};
use zero_core::partition::ParamSpec;

/// The float parameters of a module: ids and specs (name, shape), in visit order. Lazy
/// parameters are described without being materialised.
pub fn describe<B: Backend, M: Module<B>>(module: &M) -> Vec<(ParamId, ParamSpec)> {
    struct Describe {
        path: Vec<String>,
        out: Vec<(ParamId, ParamSpec)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Describe {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let name = if self.path.is_empty() {
                format!("param{}", self.out.len())
            } else {
                self.path.join(".")
            };
            self.out.push((
                param.id,
                ParamSpec {
                    name,
                    shape: param.lazy_shape().to_vec(),
                },
            ));
        }
    }
    let mut v = Describe {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut v);
    v.out
}

/// Calls `sink(index, values)` with each float parameter's values (flattened, f32), in visit
/// order. A lazy parameter is materialised for the call only if the module holds it lazily. A
/// `ZeroModule` shard offloaded by `offload_param` is read from where it is kept.
///
/// # Panics
/// If an offloaded shard cannot be read back (an I/O error of its file):
/// [`try_read_values`] returns that error instead.
pub fn read_values<B: Backend, M: Module<B>>(module: &M, sink: impl FnMut(usize, Vec<f32>)) {
    if let Err(e) = try_read_values::<B, M>(module, sink) {
        panic!("{e}");
    }
}

/// [`read_values`], returning the error of an offloaded shard that cannot be read back (the
/// values handed to `sink` after it are those of the other parameters).
pub fn try_read_values<B: Backend, M: Module<B>>(
    module: &M,
    sink: impl FnMut(usize, Vec<f32>),
) -> Result<(), crate::ZeroError> {
    read_values_of::<B, M>(module, None, sink)
}

/// [`try_read_values`] of the float parameters `wanted` (visit order) alone, or of all.
pub(crate) fn read_values_of<B: Backend, M: Module<B>>(
    module: &M,
    wanted: Option<&[usize]>,
    mut sink: impl FnMut(usize, Vec<f32>),
) -> Result<(), crate::ZeroError> {
    struct Read<'a, 'w, F> {
        index: usize,
        wanted: Option<&'w [usize]>,
        sink: &'a mut F,
        error: Option<crate::ZeroError>,
    }
    impl<B: Backend, F: FnMut(usize, Vec<f32>)> ModuleVisitor<B> for Read<'_, '_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.wanted.is_some_and(|w| !w.contains(&self.index)) {
                self.index += 1;
                return;
            }
            let value = param.val();
            let numel = value.shape().num_elements();
            let values = match crate::sharded::stored_values(param.id, &value, numel) {
                Some(Ok(data)) => data_to_vec(data),
                Some(Err(e)) => {
                    self.error.get_or_insert(crate::ZeroError::Model(format!(
                        "reading an offloaded ZeroModule shard: {e}"
                    )));
                    Vec::new()
                }
                None => tensor_to_vec(value),
            };
            (self.sink)(self.index, values);
            self.index += 1;
        }
    }
    let mut read = Read {
        index: 0,
        wanted,
        sink: &mut sink,
        error: None,
    };
    module.visit(&mut read);
    match read.error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Whether each float parameter (visit order) trains: `require_grad` is on (off for a frozen
/// parameter and for running statistics, which Burn shows as parameters).
pub fn trains<B: Backend, M: Module<B>>(module: &M) -> Vec<bool> {
    struct Flags(Vec<bool>);
    impl<B: Backend> ModuleVisitor<B> for Flags {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.is_require_grad());
        }
    }
    let mut flags = Flags(Vec::new());
    module.visit(&mut flags);
    flags.0
}

/// Replaces every float parameter's value with `source(index)` (the parameter's flattened
/// values), keeping its id. The new tensors are f32 and record gradients when `require_grad` is
/// set. Lazy parameters are replaced without being materialised.
pub fn write_values<B: Backend, M: Module<B>>(
    module: M,
    device: &B::Device,
    require_grad: bool,
    mut source: impl FnMut(usize) -> Vec<f32>,
) -> M {
    write_data(module, device, require_grad, |i, shape| {
        TensorData::new(source(i), shape)
    })
}

/// [`write_values`] from tensor data: each parameter takes the dtype of its data (bf16 data
/// makes a bf16 parameter). `source(index, shape)` gives the data of the parameter's shape.
pub fn write_data<B: Backend, M: Module<B>>(
    module: M,
    device: &B::Device,
    require_grad: bool,
    mut source: impl FnMut(usize, Shape) -> TensorData,
) -> M {
    write_data_some(module, device, require_grad, |i, shape| Some(source(i, shape)))
}

/// [`write_data`] where `source` may give `None`: that parameter is kept as it is.
pub fn write_data_some<B: Backend, M: Module<B>>(
    module: M,
    device: &B::Device,
    require_grad: bool,
    source: impl FnMut(usize, Shape) -> Option<TensorData>,
) -> M {
    write_with(module, device, Some(require_grad), source)
}

/// [`write_data_some`] keeping each parameter's own `require_grad`: the optimizer's write-back,
/// which leaves a frozen parameter frozen (as Burn's optimizers do).
pub(crate) fn rewrite_data_some<B: Backend, M: Module<B>>(
    module: M,
    device: &B::Device,
    source: impl FnMut(usize, Shape) -> Option<TensorData>,
) -> M {
    write_with(module, device, None, source)
}

/// Writes `source`'s data into the float parameters; `require_grad`: set it on every new
/// tensor, or (`None`) keep each parameter's.
fn write_with<B: Backend, M: Module<B>>(
    module: M,
    device: &B::Device,
    require_grad: Option<bool>,
    mut source: impl FnMut(usize, Shape) -> Option<TensorData>,
) -> M {
    struct Write<'a, F, B: Backend> {
        index: usize,
        source: &'a mut F,
        device: &'a B::Device,
        require_grad: Option<bool>,
    }
    impl<B: Backend, F: FnMut(usize, Shape) -> Option<TensorData>> ModuleMapper<B> for Write<'_, F, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let shape = param.lazy_shape();
            let require_grad = self.require_grad.unwrap_or_else(|| param.is_require_grad());
            let data = (self.source)(self.index, shape);
            self.index += 1;
            let Some(data) = data else { return param };
            let dtype = data.dtype;
            // No upload of an empty tensor: Burn's CUDA backend gives a shape with a zero in it
            // (a `ZeroModule` skeleton's [0, 0]) a zero stride, and the driver copy refuses it.
            let mut tensor = if data.num_elements() == 0 {
                Tensor::<B, D>::empty(data.shape.clone(), (self.device, dtype))
            } else {
                Tensor::<B, D>::from_data(data, (self.device, dtype))
            };
            if require_grad {
                tensor = tensor.require_grad();
            }
            Param::initialized(param.id, tensor)
        }
    }
    module.map(&mut Write {
        index: 0,
        source: &mut source,
        device,
        require_grad,
    })
}

/// The module with every float parameter replaced by a lazy, never-materialised placeholder of
/// the same id and shape: a skeleton that [`write_values`] fills when the part is needed.
pub fn skeleton<B: Backend, M: Module<B>>(module: M) -> M {
    struct Skeleton;
    impl<B: Backend> ModuleMapper<B> for Skeleton {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let shape = param.lazy_shape();
            let device = param.lazy_device();
            let init_shape = shape.clone();
            // Only reached if user code reads a skeleton directly: zeros, never stale weights.
            Param::uninitialized(
                param.id,
                move |device, _| Tensor::zeros(init_shape.clone(), device),
                device,
                false,
                shape,
            )
        }
    }
    module.map(&mut Skeleton)
}

/// The module with every float parameter replaced by a new autodiff leaf over the same values
/// (no copy): its gradients are recorded apart from the original parameters'.
pub fn fresh_leaves<B: AutodiffBackend, M: Module<B>>(module: M) -> M {
    struct Fresh;
    impl<B: AutodiffBackend> ModuleMapper<B> for Fresh {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, Tensor::from_inner(tensor.inner()).require_grad(), mapper)
        }
    }
    module.map(&mut Fresh)
}

/// Calls `sink(index, gradient)` for each float parameter in visit order, taking the gradient out
/// of `grads` (None if the parameter took no part in the loss).
pub fn take_grads<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &mut B::Gradients,
    mut sink: impl FnMut(usize, Option<Vec<f32>>),
) {
    struct Take<'a, F, B: AutodiffBackend> {
        index: usize,
        grads: &'a mut B::Gradients,
        sink: &'a mut F,
    }
    impl<B: AutodiffBackend, F: FnMut(usize, Option<Vec<f32>>)> ModuleVisitor<B> for Take<'_, F, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = param.val().grad_remove(self.grads).map(tensor_to_vec);
            (self.sink)(self.index, grad);
            self.index += 1;
        }
    }
    module.visit(&mut Take {
        index: 0,
        grads,
        sink: &mut sink,
    });
}

/// The flattened f32 values of a tensor of any float dtype.
pub fn tensor_to_vec<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    // Not read when empty (a `ZeroModule` skeleton's parameter): Burn's CUDA backend would copy
    // it with a kernel over no blocks, which the driver refuses.
    if tensor.shape().num_elements() == 0 {
        return Vec::new();
    }
    data_to_vec(tensor.into_data())
}

/// The flattened f32 values of tensor data of any float dtype.
pub fn data_to_vec(data: TensorData) -> Vec<f32> {
    // 16-bit data widened in parallel chunks (Burn's `convert` goes element by element).
    let widened = match data.dtype {
        burn::tensor::DType::BF16 => data.as_slice::<half::bf16>().ok().map(zero_core::passes::widen),
        burn::tensor::DType::F16 => data.as_slice::<half::f16>().ok().map(zero_core::passes::widen),
        _ => None,
    };
    // `convert` guarantees the dtype, so this cannot fail.
    widened.unwrap_or_else(|| data.convert::<f32>().into_vec::<f32>().unwrap_or_default())
}

/// A 1-D tensor holding `values`.
pub fn vec_to_tensor<B: Backend>(values: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::nn::{Linear, LinearConfig};

    type B = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        first: Linear<B>,
        second: Linear<B>,
    }

    #[test]
    fn describe_read_write_round_trip() {
        let device = Default::default();
        let m = Two::<B> {
            first: LinearConfig::new(3, 2).init(&device),
            second: LinearConfig::new(2, 5).with_bias(false).init(&device),
        };
        let specs = describe::<B, _>(&m);
        let names: Vec<_> = specs.iter().map(|(_, s)| s.name.clone()).collect();
        assert_eq!(names, ["first.weight", "first.bias", "second.weight"]);
        assert_eq!(specs[2].1.shape, vec![2, 5]);

        let m = write_values::<B, _>(m, &device, true, |i| {
            (0..specs[i].1.numel()).map(|k| (i * 100 + k) as f32).collect()
        });
        let mut seen = Vec::new();
        read_values::<B, _>(&m, |i, v| seen.push((i, v)));
        assert_eq!(seen[1], (1, vec![100.0, 101.0]));
        assert_eq!(seen[2].1.len(), 10);
        assert_eq!(describe::<B, _>(&m)[0].0, specs[0].0, "ids survive a write");
    }
}
