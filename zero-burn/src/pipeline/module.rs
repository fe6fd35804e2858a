//! The layers of one pipeline stage.

use super::layer::LayerSpec;
use super::partition::{partition_layers, PartitionMethod};
use crate::error::ZeroError;
use crate::params::describe;
use burn::module::Module;
use burn::tensor::backend::Backend;
use std::ops::Range;

/// One stage's share of a model given as a list of layers (DeepSpeed's `PipelineModule`).
///
/// ```ignore
/// let specs: Vec<Gpt2LayerSpec> = Gpt2LayerSpec::all(&config);
/// let module = PipelineModule::from_specs::<B, _>(&specs, stages, PartitionMethod::Parameters, stage, &device)?;
/// let engine = PipelineEngine::new(settings, module, &groups)?;
/// ```
#[derive(Clone, Debug)]
pub struct PipelineModule<L> {
    /// This stage's layers, in order.
    pub layers: Vec<L>,
    /// This stage.
    pub stage: usize,
    /// Number of stages.
    pub stages: usize,
    /// This stage's layers as indices into the model's layer list.
    pub range: Range<usize>,
    /// Number of layers of the whole model.
    pub num_layers: usize,
}

impl<L> PipelineModule<L> {
    /// Builds stage `stage`'s layers only, from the specs of the whole model.
    pub fn from_specs<B: Backend, S: LayerSpec<B, Layer = L>>(
        specs: &[S],
        stages: usize,
        method: PartitionMethod,
        stage: usize,
        device: &B::Device,
    ) -> Result<Self, ZeroError> {
        let sizes: Vec<usize> = specs.iter().map(LayerSpec::num_params).collect();
        let range = stage_range(&sizes, stages, method, stage)?;
        Ok(PipelineModule {
            layers: specs[range.clone()].iter().map(|s| s.build(device)).collect(),
            stage,
            stages,
            range,
            num_layers: specs.len(),
        })
    }

    /// Stage `stage`'s share of layers already built (e.g. cut from a loaded checkpoint); the
    /// other stages' layers are dropped.
    pub fn from_layers<B: Backend>(
        layers: Vec<L>,
        stages: usize,
        method: PartitionMethod,
        stage: usize,
    ) -> Result<Self, ZeroError>
    where
        L: Module<B>,
    {
        let sizes: Vec<usize> = layers
            .iter()
            .map(|l| describe::<B, _>(l).iter().map(|(_, s)| s.numel()).sum())
            .collect();
        let range = stage_range(&sizes, stages, method, stage)?;
        let num_layers = layers.len();
        Ok(PipelineModule {
            layers: layers.into_iter().skip(range.start).take(range.len()).collect(),
            stage,
            stages,
            range,
            num_layers,
        })
    }

    /// Whether this stage holds the model's first layer.
    pub fn is_first(&self) -> bool {
        self.range.start == 0
    }

    /// Whether this stage holds the model's last layer.
    pub fn is_last(&self) -> bool {
        self.range.end == self.num_layers
    }
}

fn stage_range(
    sizes: &[usize],
    stages: usize,
    method: PartitionMethod,
    stage: usize,
) -> Result<Range<usize>, ZeroError> {
    if sizes.len() < 2 {
        return Err(ZeroError::Model(
            "a pipelined model needs at least two layers (the first gives the input, the last the loss)".into(),
        ));
    }
    let parts = partition_layers(sizes, stages, method)?;
    parts
        .get(stage)
        .cloned()
        .ok_or_else(|| ZeroError::Usage(format!("stage {stage} is not below the number of stages {stages}")))
}
