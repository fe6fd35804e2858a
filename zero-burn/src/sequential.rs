//! A chain declared as a list of layers: the `nn.Sequential` of zero-burn.
//!
//! [`ChainModel`] asks a model to say how it splits into ends and blocks. For a model that is
//! just layers applied one after the other, [`Sequential`] says it once for all: every layer is
//! a block (so activation checkpointing keeps one activation per segment of layers), the ends
//! hold nothing, and the loss is a [`SequentialLoss`] chosen by type ([`CrossEntropy`],
//! [`MeanSquaredError`], or your own). With each layer a [`ZeroModule`] (itself a
//! [`SequentialLayer`]), stage 3 gathers one layer at a time.
//!
//! ```
//! # use burn::backend::{Autodiff, Flex};
//! # use burn::optim::{GradientsParams, Optimizer};
//! # use burn::prelude::*;
//! # use zero_core::{comm::ThreadGroup, config::DeepSpeedConfig};
//! use zero_burn::sequential::{CrossEntropy, Layer, Sequential};
//! use zero_burn::sharded::ZeroModule;
//! # type B = Autodiff<Flex, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;
//! # let device = Default::default();
//! # let config = DeepSpeedConfig::from_str(
//! #     r#"{"train_batch_size": 4, "zero_optimization": {"stage": 3},
//! #         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"#,
//! #     "ds_config.json",
//! # )
//! # .unwrap()
//! # .config;
//! # let group = ThreadGroup::new_group(1).unwrap().remove(0);
//! # let (inputs, labels) = (Tensor::<B, 2>::ones([4, 784], &device), Tensor::<B, 1, Int>::zeros([4], &device));
//! let layers = vec![Layer::linear(784, 128, &device), Layer::relu(), Layer::linear(128, 10, &device)];
//! let model: Sequential<B, ZeroModule<B, Layer<B>>, CrossEntropy> =
//!     Sequential::new(layers.into_iter().map(ZeroModule::new).collect());
//! let (mut model, mut optim) = zero_burn::initialize(&config, model, group)?;
//! let batch = (inputs, labels);
//! let loss = model.loss(&batch);
//! let before = loss.clone().into_scalar();
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! model = optim.step(0.1, model, grads);
//! assert!(model.loss(&batch).into_scalar() < before);
//! # Ok::<(), zero_burn::ZeroError>(())
//! ```
//!
//! [`Layer`] covers the usual building blocks; a model with layers of its own implements
//! [`SequentialLayer`] for an enum of them (`#[derive(Module)]` works on enums).

use crate::chain::ChainModel;
use crate::sharded::{ShardBackend, ZeroModule};
use burn::module::{Module, ModuleDisplay};
use burn::nn::activation::Activation;
use burn::nn::loss::{CrossEntropyLossConfig, MseLoss, Reduction};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};
use core::marker::PhantomData;

/// One layer of a [`Sequential`]: a pure function from activation to activation.
///
/// Pure means no state kept between calls and no randomness: activation checkpointing runs a
/// layer again in backward and expects the same values (so no dropout here).
pub trait SequentialLayer<B: Backend>: Module<B> + ModuleDisplay {
    /// Applies the layer.
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2>;
}

/// How a [`Sequential`] turns its last layer's output and the batch's target into the loss.
///
/// A loss is a stateless type chosen by the model's type, for any backend.
pub trait SequentialLoss: Default + Clone + Send + Sync + core::fmt::Debug + 'static {
    /// What the batch carries beside the input.
    type Target<B: Backend>: Clone + Send;
    /// The loss, a one-element tensor.
    fn loss<B: Backend>(output: Tensor<B, 2>, target: &Self::Target<B>) -> Tensor<B, 1>;
}

/// Softmax cross-entropy against class indices (`[batch]` integers), averaged over the batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrossEntropy;

impl SequentialLoss for CrossEntropy {
    type Target<B: Backend> = Tensor<B, 1, Int>;
    fn loss<B: Backend>(logits: Tensor<B, 2>, target: &Tensor<B, 1, Int>) -> Tensor<B, 1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, target.clone())
    }
}

/// Mean squared error against a target of the output's shape.
#[derive(Clone, Copy, Debug, Default)]
pub struct MeanSquaredError;

impl SequentialLoss for MeanSquaredError {
    type Target<B: Backend> = Tensor<B, 2>;
    fn loss<B: Backend>(output: Tensor<B, 2>, target: &Tensor<B, 2>) -> Tensor<B, 1> {
        MseLoss::new().forward(output, target.clone(), Reduction::Mean)
    }
}

/// Layers applied in order, then a loss: a [`ChainModel`] whose blocks are the layers.
///
/// The batch is `(input, target)`. Parameter-free layers (activations) are blocks too; at stage
/// 3 they gather nothing.
#[derive(Module, Debug)]
pub struct Sequential<B: Backend, L: Module<B>, Loss: SequentialLoss> {
    /// The layers, in order.
    pub layers: Vec<L>,
    #[module(skip)]
    loss: Loss,
    backend: PhantomData<B>,
}

impl<B: Backend, L: SequentialLayer<B>, Loss: SequentialLoss> Sequential<B, L, Loss> {
    /// The layers, in the order they run.
    pub fn new(layers: Vec<L>) -> Self {
        Self {
            layers,
            loss: Loss::default(),
            backend: PhantomData,
        }
    }

    /// Runs every layer: the model's output for `x`, without the loss.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.layers.iter().fold(x, |h, layer| layer.forward(h))
    }

    /// The loss of a batch.
    pub fn loss(&self, batch: &(Tensor<B, 2>, Loss::Target<B>)) -> Tensor<B, 1> {
        Loss::loss(self.forward(batch.0.clone()), &batch.1)
    }
}

impl<B, L, Loss> ChainModel<B> for Sequential<B, L, Loss>
where
    B: AutodiffBackend,
    L: SequentialLayer<B>,
    Loss: SequentialLoss,
{
    type Batch = (Tensor<B, 2>, Loss::Target<B>);
    type Hidden = Tensor<B, 2>;
    type Ends = PhantomData<B>;
    type Block = L;

    fn into_parts(self) -> (PhantomData<B>, Vec<L>) {
        (PhantomData, self.layers)
    }
    fn from_parts(_: PhantomData<B>, layers: Vec<L>) -> Self {
        Self::new(layers)
    }
    fn embed(_: &PhantomData<B>, batch: &Self::Batch) -> Tensor<B, 2> {
        batch.0.clone()
    }
    fn block_forward(layer: &L, x: Tensor<B, 2>) -> Tensor<B, 2> {
        layer.forward(x)
    }
    fn head_loss(_: &PhantomData<B>, h: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        Loss::loss(h, &batch.1)
    }
}

/// The common layers, for [`Sequential`] models that need nothing else.
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Layer<B: Backend> {
    /// `y = x Wᵀ + b`.
    Linear(Linear<B>),
    /// An element-wise activation (Burn's [`Activation`]: ReLU, GELU, tanh, sigmoid, ...).
    Activation(Activation<B>),
    /// Layer normalisation over the last dimension.
    LayerNorm(LayerNorm<B>),
}

impl<B: Backend> Layer<B> {
    /// A linear layer `d_in → d_out` with bias, Burn's default initialisation.
    pub fn linear(d_in: usize, d_out: usize, device: &B::Device) -> Self {
        Layer::Linear(LinearConfig::new(d_in, d_out).init(device))
    }
    /// ReLU.
    pub fn relu() -> Self {
        Layer::Activation(Activation::Relu(burn::nn::Relu::new()))
    }
    /// GELU.
    pub fn gelu() -> Self {
        Layer::Activation(Activation::Gelu(burn::nn::Gelu::new()))
    }
    /// tanh.
    pub fn tanh() -> Self {
        Layer::Activation(Activation::Tanh(burn::nn::Tanh::new()))
    }
    /// Layer normalisation over `d` features.
    pub fn layer_norm(d: usize, device: &B::Device) -> Self {
        Layer::LayerNorm(LayerNormConfig::new(d).init(device))
    }
}

impl<B: Backend> SequentialLayer<B> for Layer<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Layer::Linear(layer) => layer.forward(x),
            Layer::Activation(layer) => layer.forward(x),
            Layer::LayerNorm(layer) => layer.forward(x),
        }
    }
}

/// A layer held as a ZeRO unit: gathered for its forward (stage 3), its gradient reduce-scattered
/// in backward.
///
/// # Panics
/// When the gather fails (a dead or diverging peer, named in the message): a layer's forward
/// returns no error.
impl<B: ShardBackend, L: SequentialLayer<B>> SequentialLayer<B> for ZeroModule<B, L> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self.unshard(&x) {
            Ok(layer) => layer.forward(x),
            Err(e) => panic!("ZeRO stage 3: gathering a layer failed: {e}"),
        }
    }
}
