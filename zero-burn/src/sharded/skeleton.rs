//! A `ZeroModule`'s skeleton: its module with every float parameter emptied (structure and
//! ids kept), and filled again from the unit's flat parts for a forward.

use burn::module::{ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor};
use std::collections::VecDeque;

/// Replaces each float parameter by an empty tensor of its rank, keeping its id.
pub(super) struct Emptied;

impl<B: Backend> ModuleMapper<B> for Emptied {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let device = param.lazy_device();
        Param::initialized(param.id, Tensor::<B, D>::empty(vacant_shape::<D>(), &device))
    }
}

/// The shape of an empty parameter of rank `D`: `[0, 1, …, 1]`. Not `[0; D]`: Burn's CUDA
/// backend gives a tensor whose last dimension is 0 a zero row stride, and refuses to read,
/// copy or upload it (a Burn record of the model, any visitor reading every parameter), where
/// it reads and writes this one's no elements.
pub(crate) fn vacant_shape<const D: usize>() -> [usize; D] {
    let mut shape = [1; D];
    if let Some(first) = shape.first_mut() {
        *first = 0;
    }
    shape
}

/// Fills each float parameter, in visit order, with the next flat part in its recorded shape.
pub(super) struct Filled<B: Backend>(pub(super) VecDeque<(Tensor<B, 1>, Shape)>);

impl<B: Backend> ModuleMapper<B> for Filled<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        match self.0.pop_front() {
            Some((part, shape)) => Param::initialized(param.id, part.reshape(shape)),
            // The layout is recorded from this module's own parameters: one part per parameter.
            None => unreachable!("a ZeroModule's skeleton has more float parameters than its layout"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};

    /// A skeleton's parameters hold no element, and none has a last dimension of 0: Burn's CUDA
    /// backend pitches a tensor's rows by its last dimension, so a 0 there is a zero stride,
    /// which its reads and uploads refuse.
    #[test]
    fn skeleton_parameters_are_empty_with_a_nonzero_last_dimension() {
        assert_eq!(vacant_shape::<1>(), [0]);
        assert_eq!(vacant_shape::<2>(), [0, 1]);
        assert_eq!(vacant_shape::<4>(), [0, 1, 1, 1]);
        let linear: Linear<Flex> = LinearConfig::new(3, 2).init(&Default::default());
        let skeleton = linear.map(&mut Emptied);
        let weight = skeleton.weight.val().shape().to_vec();
        let bias = skeleton.bias.expect("a bias").val().shape().to_vec();
        assert_eq!((weight, bias), (vec![0, 1], vec![0]));
    }
}
