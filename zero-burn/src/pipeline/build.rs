//! Building one pipeline stage's engine: its layers' parameters named as the whole model's and
//! laid out as one ZeRO flat state over the data-parallel group, the initial values agreed
//! (data rank 0's, the tied keys' first copy), the global norm's counting rule, the channels to
//! the neighbouring stages.

use super::channel::Channel;
use super::engine::PipelineEngine;
use super::layer::PipeLayer;
use super::module::PipelineModule;
use crate::core::EngineCore;
use crate::error::ZeroError;
use crate::flat_state::GradFlow;
use crate::half_buffer;
use crate::memory::MemoryTracker;
use crate::params::{describe, read_values, write_data};
use crate::settings::{EngineSettings, Stage};
use burn::tensor::backend::AutodiffBackend;
use std::collections::BTreeMap;
use std::sync::Arc;
use zero_core::checkpoint::TensorParallelRecord;
use zero_core::comm::{FlatBuffer, SharedGroup};
use zero_core::parallel::{Axis, RankGroups};
use zero_core::partition::{LayoutBuilder, ParamSpec, Placement};

impl<B: AutodiffBackend, L: PipeLayer<B>> PipelineEngine<B, L> {
    /// The engine of this rank's stage. `module` must be the stage of `groups.coords.pipeline`
    /// of `groups.layout`'s pipeline size. The data-parallel rank 0's weights are broadcast over
    /// the data group, and the first stage's tied weights to the last stage's copies.
    pub fn new(settings: EngineSettings, module: PipelineModule<L>, groups: &RankGroups) -> Result<Self, ZeroError> {
        if settings.stage == Stage::Zero3 {
            return Err(ZeroError::Config(
                "zero_optimization.stage 3 with pipeline parallelism: stage 3 gathers every layer's weights for each \
                 forward and backward, and the 1F1B schedule interleaves the micro-batches' forwards and backwards, \
                 so each layer would be gathered twice per micro-batch for weights that a stage holds for its own \
                 layers only anyway; DeepSpeed's pipeline engine refuses it too. Use stage 0, 1 or 2"
                    .into(),
            ));
        }
        let stages = groups.layout.size(Axis::Pipeline);
        let stage = groups.coords.pipeline;
        if module.stage != stage || module.stages != stages {
            return Err(ZeroError::Usage(format!(
                "the module is stage {} of {} but this rank is stage {stage} of {stages}",
                module.stage, module.stages
            )));
        }
        let (first, last) = (module.is_first(), module.is_last());
        let mut layers = module.layers;
        let device =
            layers.iter().flat_map(|l| l.devices()).next().ok_or_else(|| {
                ZeroError::Model(format!("stage {stage}'s layers have no parameters (no device found)"))
            })?;

        // Parameters, layer by layer, named by the layer's index in the whole model.
        let mut specs: Vec<ParamSpec> = Vec::new();
        let mut params_of = Vec::new();
        for (i, layer) in layers.iter().enumerate() {
            let start = specs.len();
            specs.extend(describe::<B, _>(layer).into_iter().map(|(_, s)| ParamSpec {
                name: layer.param_name(module.range.start + i, &s.name),
                ..s
            }));
            params_of.push((start..specs.len()).collect::<Vec<_>>());
        }
        let mut tied: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, layer) in layers.iter().enumerate() {
            for t in layer.tied() {
                let p = *params_of[i].get(t.param).ok_or_else(|| {
                    ZeroError::Model(format!(
                        "layer {} ties parameter {} as `{}` but has {} parameters",
                        module.range.start + i,
                        t.param,
                        t.key,
                        params_of[i].len()
                    ))
                })?;
                tied.entry(t.key).or_default().push(p);
            }
        }
        let tied_group = groups.stage.tied.clone();
        if !tied.is_empty() && stages > 1 && tied_group.is_none() {
            return Err(ZeroError::Model(format!(
                "stage {stage} holds tied weights ({:?}) but only the first and last stage may",
                tied.keys().collect::<Vec<_>>()
            )));
        }

        let data = groups.data.clone();
        let dp = data.world_size();
        let mut builder = LayoutBuilder::new(specs, dp, settings.alignment);
        let all: Vec<usize> = (0..params_of.iter().map(Vec::len).sum()).collect();
        let placement = if settings.stage == Stage::Zero0 {
            Placement::Replicated
        } else {
            Placement::Sharded
        };
        let bucket = settings.reduce_bucket_size.max(1);
        // Stage 2 reduce-scatters each micro-batch's gradients as they come. The tied copies
        // live in groups of their own, laid out by key: when each stage holds one copy of each
        // key, the first and the last stage's tied groups are cut alike, so a data rank's
        // reduced shards of them hold the same elements and are summed over the tied group as
        // they are. Otherwise (copies sharing a stage) the tied groups accumulate whole.
        let mut whole_groups = Vec::new();
        let mut tied_shards = Vec::new();
        if settings.stage == Stage::Zero2 {
            let tied_params: Vec<usize> = tied.values().flatten().copied().collect();
            let rest: Vec<usize> = all.iter().copied().filter(|p| !tied_params.contains(p)).collect();
            builder.buckets(&rest, bucket, placement);
            if !tied_params.is_empty() {
                let added = builder.buckets(&tied_params, bucket, placement);
                if stages > 1 && tied_group.is_some() && tied.values().all(|c| c.len() == 1) {
                    tied_shards = added;
                } else {
                    whole_groups = added;
                }
            }
        } else {
            builder.buckets(&all, bucket, placement);
        }
        let layout = builder.finish();
        let stage_2 = settings.stage == Stage::Zero2;

        // Initial values: the layers', then data rank 0's, then the tied keys' first copy.
        let mut values: Vec<Vec<f32>> = Vec::with_capacity(layout.params.len());
        for layer in &layers {
            read_values::<B, _>(layer, |_, v| values.push(v));
        }
        if dp > 1 {
            let mut buf = FlatBuffer::F32(values.concat());
            data.broadcast(&mut buf, 0)?;
            split_into(&buf.into_f32(), &mut values);
        }
        for (key, copies) in &tied {
            let mut source = values[copies[0]].clone();
            if let Some(group) = &tied_group {
                let mut buf = FlatBuffer::F32(source);
                group.broadcast(&mut buf, 0)?;
                source = buf.into_f32();
            }
            for &c in copies {
                if values[c].len() != source.len() {
                    return Err(ZeroError::Model(format!(
                        "the copies of tied weight `{key}` differ in size ({} and {} elements)",
                        source.len(),
                        values[c].len()
                    )));
                }
                values[c].copy_from_slice(&source);
            }
        }
        let dtype = settings.precision.dtype;
        for v in &mut values {
            half_buffer::round_to(dtype, v);
        }
        layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, layer)| {
                write_data(layer, &device, true, |j, shape| {
                    half_buffer::f32_to_data(values[params_of[i][j]].clone(), shape, dtype)
                })
            })
            .collect();

        let memory = Arc::new(MemoryTracker::default());
        memory.add_parameters(layout.numel() * dtype.size());
        let mut core = EngineCore::new(
            layout,
            data.clone(),
            settings,
            |g| {
                if stage_2 && !whole_groups.contains(&g) {
                    GradFlow::ReduceThenAccumulate
                } else {
                    GradFlow::AccumulateThenReduce
                }
            },
            |i| std::mem::take(&mut values[i]),
            memory,
            Vec::new(),
        )?;
        // The norm counts each parameter once: the slices of a tensor-split parameter on every
        // tensor rank, a replicated one on tensor rank 0; a tied key on the first stage holding
        // it, its first copy.
        let mut split = vec![false; core.state.layout.params.len()];
        let mut tensor = TensorParallelRecord {
            rank: groups.coords.tensor,
            size: groups.layout.size(Axis::Tensor),
            splits: BTreeMap::new(),
        };
        for (layer, params) in layers.iter().zip(&params_of) {
            for (i, how) in layer.tensor_split() {
                if let Some(&p) = params.get(i) {
                    split[p] = true;
                    tensor.splits.insert(core.state.layout.params[p].name.clone(), how);
                }
            }
        }
        let mut counted: Vec<bool> = split.iter().map(|&s| s || groups.coords.tensor == 0).collect();
        for copies in tied.values() {
            for (k, &c) in copies.iter().enumerate() {
                counted[c] = counted[c] && k == 0 && (tied_group.is_none() || stage == 0);
            }
        }
        core.grad_norm = Some(crate::agreement::counted_grad_norm(
            counted,
            data.rank(),
            vec![groups.world.clone()],
        ));
        // fp16's overflow (and a non-finite gradient under bf16 or fp32) is decided over the
        // whole world: every stage skips the step together, or fails together at once.
        core.overflow = Some(crate::agreement::Agreement::over(groups.world.clone()));
        // LAMB's per-tensor norms: a split tensor's add over its slices on the stage's tensor
        // ranks.
        core.state.tensor_norms = Some(crate::agreement::TensorNorms::new(
            groups.tensor.clone(),
            &core.state.layout,
            |p| split[p],
        ));

        let channel = |g: &Option<SharedGroup>, send: bool, what: String| -> Result<Option<Channel>, ZeroError> {
            g.clone()
                .map(|g| {
                    if send {
                        Channel::sender(g, what)
                    } else {
                        Channel::receiver(g, what)
                    }
                })
                .transpose()
        };
        let s = groups.stage.clone();
        Ok(PipelineEngine {
            layers,
            first,
            last,
            stage,
            stages,
            params_of,
            tied,
            core,
            send_next: channel(
                &s.send_next,
                true,
                format!("activations from stage {stage} to {}", stage + 1),
            )?,
            recv_prev: channel(
                &s.recv_prev,
                false,
                format!("activations from stage {} to {stage}", stage.wrapping_sub(1)),
            )?,
            send_prev: channel(
                &s.send_prev,
                true,
                format!("gradients from stage {stage} to {}", stage.wrapping_sub(1)),
            )?,
            recv_next: channel(
                &s.recv_next,
                false,
                format!("gradients from stage {} to {stage}", stage + 1),
            )?,
            tied_group,
            pipeline_group: groups.pipeline.clone(),
            tied_shards,
            world: groups.world.clone(),
            tensor,
            device,
            timeline: Vec::new(),
        })
    }
}

/// Cuts `flat` back into the lengths of `values`.
fn split_into(flat: &[f32], values: &mut [Vec<f32>]) {
    let mut at = 0;
    for v in values {
        let n = v.len();
        v.copy_from_slice(&flat[at..at + n]);
        at += n;
    }
}
