//! What a pipelined model is made of: layers of one type, and the specs that build them.

use crate::chain::Hidden;
use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use zero_core::checkpoint::TensorSplit;

/// One layer of a pipelined model. All layers of a model share one type (an enum of the kinds
/// of layers, in Burn's style), so that any contiguous run of them can make a stage.
///
/// The role of a layer is its position: the model's first layer is only asked for
/// [`input`](Self::input), its last only for [`loss`](Self::loss), and the ones between only
/// for [`forward`](Self::forward). A model needs at least two layers.
pub trait PipeLayer<B: AutodiffBackend>: Module<B> {
    /// One micro-batch (inputs and targets). Every stage is handed the micro-batches; the first
    /// stage reads the inputs, the last the targets.
    type Batch;
    /// The activation passed from layer to layer and from stage to stage.
    type Hidden: PipeHidden<B>;

    /// The first layer: the hidden states of a micro-batch.
    fn input(&self, batch: &Self::Batch) -> Self::Hidden;
    /// A middle layer.
    fn forward(&self, x: Self::Hidden) -> Self::Hidden;
    /// The last layer: the micro-batch's loss (one element).
    fn loss(&self, x: Self::Hidden, batch: &Self::Batch) -> Tensor<B, 1>;
    /// The parameters of this layer that are copies of another layer's (GPT-2's `wte`, used by
    /// the embedding and the LM head). Every copy of one key starts from the first copy's
    /// values and is updated with the sum of all copies' gradients, so they stay identical.
    fn tied(&self) -> Vec<TiedWeight> {
        Vec::new()
    }
    /// Under tensor parallelism, the indices (in visit order) of this layer's parameters that
    /// are split over the tensor group, each tensor rank holding a different slice, and how
    /// each is cut (what a checkpoint records, so that `zero to-fp32` merges the slices). The
    /// others are taken as replicated over it, and the global gradient norm counts them once.
    fn tensor_split(&self) -> Vec<(usize, TensorSplit)> {
        Vec::new()
    }
    /// The name, in the whole model, of this layer's parameter that Burn's visitor calls
    /// `visited` (its path inside the layer), this layer being the model's layer `index`.
    /// Checkpoints carry these names, so a pipelined checkpoint consolidates into the model's
    /// own weights; a tied copy other than the first needs a name of its own. By default:
    /// `layers.{index}.{visited}`.
    fn param_name(&self, index: usize, visited: &str) -> String {
        format!("layers.{index}.{visited}")
    }
}

/// A parameter of a layer that is tied to parameters of other layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiedWeight {
    /// The name every copy shares (e.g. `"wte"`).
    pub key: String,
    /// The parameter's index among the layer's float parameters, in Burn's visit order.
    pub param: usize,
}

/// Builds one layer. A stage calls [`build`](Self::build) only for its own layers;
/// [`num_params`](Self::num_params) lets every stage agree on the cut without building.
pub trait LayerSpec<B: Backend> {
    /// The layer type built.
    type Layer;
    /// Number of parameter elements the layer will have.
    fn num_params(&self) -> usize;
    /// The layer, on `device`.
    fn build(&self, device: &B::Device) -> Self::Layer;
}

/// An activation that can cross a stage boundary: flattened to f32 values and a shape, and
/// rebuilt from them on the receiving side.
pub trait PipeHidden<B: AutodiffBackend>: Hidden<B> {
    /// The shape.
    fn dims(&self) -> Vec<usize>;
    /// The values, row-major, as f32.
    fn to_values(&self) -> Vec<f32>;
    /// An activation of `shape` and `dtype` from row-major f32 values.
    fn from_values(values: Vec<f32>, shape: Vec<usize>, dtype: DType, device: &B::Device) -> Self;
    /// The device it lives on.
    fn device_of(&self) -> B::Device;
    /// Zeros of the same shape (the gradient of an input that took no part in the loss).
    fn zeros_like(&self) -> Self;
}

impl<B: AutodiffBackend, const D: usize> PipeHidden<B> for Tensor<B, D> {
    fn dims(&self) -> Vec<usize> {
        self.shape().to_vec()
    }
    fn to_values(&self) -> Vec<f32> {
        crate::params::data_to_vec(self.clone().detach().into_data())
    }
    fn from_values(values: Vec<f32>, shape: Vec<usize>, dtype: DType, device: &B::Device) -> Self {
        let t: Tensor<B, D> = Tensor::from_data(TensorData::new(values, Shape::from(shape)), device);
        if dtype == DType::F32 {
            t
        } else {
            t.cast(dtype)
        }
    }
    fn device_of(&self) -> B::Device {
        self.device()
    }
    fn zeros_like(&self) -> Self {
        Tensor::zeros(self.shape(), &self.device())
    }
}
