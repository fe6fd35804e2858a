//! The optimizer's state in host memory ([`EngineCore`]): with `offload_optimizer` (the fused
//! CPU optimizer, or NVMe), or an optimizer without a device implementation.

use super::view::{split_into, FlatGrad, Holding, ModuleView};
use crate::core::{EngineCore, StepReport};
use crate::error::ZeroError;
use crate::flat_state::GradFlow;
use crate::half_buffer;
use crate::memory::MemoryTracker;
use crate::params::{rewrite_data_some, tensor_to_vec};
use crate::settings::{EngineSettings, Stage};
use burn::module::{AutodiffModule, ParamId};
use burn::tensor::backend::AutodiffBackend;
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ProcessGroup};

/// The host state of `module` as `view` sees it, its sharded units' shards gathered once to
/// make their masters.
pub(super) fn build<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    view: ModuleView,
    settings: &EngineSettings,
    comm: Arc<dyn ProcessGroup>,
    memory: Arc<MemoryTracker>,
) -> Result<EngineCore, ZeroError> {
    let world = comm.world_size();
    let (mut values, mut shards) = view.read::<B, M>(module)?;
    let unit_groups = view.unit_groups();
    // A unit's whole parameters, from every rank's shard (each in turn, at the first step only).
    for (i, held) in view.held.iter().enumerate() {
        let Holding::Shard { params, group } = held else {
            continue;
        };
        let shard = shards.remove(&i).unwrap_or_default();
        view.check_shard(params, *group, shard.len())?;
        let shard = FlatBuffer::F32(shard);
        let whole = if world > 1 {
            comm.all_gather(shard)?.into_f32()
        } else {
            shard.into_f32()
        };
        split_into(&mut values, &view.layout, params.clone(), &whole);
    }
    let dtype = settings.precision.dtype;
    for v in &mut values {
        half_buffer::round_to(dtype, v);
    }
    let flow = if matches!(settings.stage, Stage::Zero2 | Stage::Zero3) {
        GradFlow::ReduceThenAccumulate
    } else {
        GradFlow::AccumulateThenReduce
    };
    let mut settings = settings.clone();
    settings.gradient_accumulation_steps = 1;
    // Offloaded parameter shards are the units' own (each unit keeps its store), not a copy
    // the state keeps beside the masters.
    settings.offload_param = crate::settings::ParamOffload::None;
    let trains = view.group_trains();
    EngineCore::new(
        view.layout,
        comm,
        settings,
        // A unit's gradient arrives reduced (its backward reduce-scattered it).
        |g| {
            if unit_groups.contains(&g) {
                GradFlow::ReduceThenAccumulate
            } else {
                flow
            }
        },
        |i| std::mem::take(&mut values[i]),
        memory,
        trains,
    )
}

/// One step of the host state: the gradients `take` hands out by parameter id are brought to
/// the host and absorbed, the update applied, and `module` given the new values.
pub(super) fn step<B: AutodiffBackend, M: AutodiffModule<B>>(
    core: &mut EngineCore,
    view: &ModuleView,
    lr: f64,
    module: M,
    loss_non_finite: bool,
    mut take: impl FnMut(ParamId) -> Option<FlatGrad<B>>,
    frozen: &[usize],
) -> Result<(M, StepReport), ZeroError> {
    // Burn's loop owns the schedule: use its learning rate for this step.
    core.settings.lr_schedule = Some(Arc::new(move |_| lr));
    // The last step's delayed update: the model takes its values before this step's begins.
    let module = settle_into::<B, M>(core, view, module)?;
    // The groups whose parameters train now (a part unfrozen since gets its state).
    let trains = view.group_trains();
    core.state.set_trains(trains.clone(), &core.memory);
    for (id, held) in view.ids.iter().zip(&view.held) {
        let grad = take(*id).map(tensor_to_vec);
        match held {
            Holding::Param(p) => core.absorb(*p, grad)?,
            Holding::Whole(params) => {
                let mut start = 0;
                for p in params.clone() {
                    let numel = view.layout.params[p].numel();
                    core.absorb(p, grad.as_ref().map(|g| g[start..start + numel].to_vec()))?;
                    start += numel;
                }
            }
            // A ZeroModule's shard: its gradient is this rank's slice, already averaged.
            Holding::Shard { group, .. } => {
                if let Some(grad) = grad {
                    core.absorb_owned(*group, &grad)?;
                }
            }
            Holding::Nothing => {}
        }
    }
    core.finish_micro_batch()?;
    if loss_non_finite {
        core.note_non_finite_loss();
    }
    if core.settings.delayed_update {
        // Everything that communicates is done; the update runs beside the next forward and
        // backward, and the next step (or `flush`) writes its values into the model.
        let report = core.update_delayed()?;
        core.owed = Some(crate::core::Owed {
            trains,
            frozen: frozen.to_vec(),
        });
        return Ok((module, report));
    }
    let report = core.update()?;
    // Parameters that do not train (`frozen`, visit order) keep the module's values.
    super::adopt::adopt_host::<B, M>(core, view, &module, frozen)?;
    let device = super::view::first_device::<B, M>(&module)?;
    // The groups that did not train keep the module's values as they are.
    let module = write_back::<B, M>(core, module, &device, &view.held, &trains)?;
    // The model holds the new values now: the state's copies of them go until the next step.
    core.state.release_param_copies(&core.memory);
    Ok((module, report))
}

/// Waits for a delayed update still running and gives `module` the values it owes it (the
/// parameters that did not train keeping the module's); `module` as it is when none is owed.
pub(super) fn settle_into<B: AutodiffBackend, M: AutodiffModule<B>>(
    core: &mut EngineCore,
    view: &ModuleView,
    module: M,
) -> Result<M, ZeroError> {
    core.settle()?;
    let Some(owed) = core.owed.take() else {
        return Ok(module);
    };
    super::adopt::adopt_host::<B, M>(core, view, &module, &owed.frozen)?;
    let device = super::view::first_device::<B, M>(&module)?;
    let module = write_back::<B, M>(core, module, &device, &view.held, &owed.trains)?;
    core.state.release_param_copies(&core.memory);
    Ok(module)
}

/// `module` with the state's values of the groups `groups` marks (by group): replicated
/// parameters whole (gathered where sharded), a unit kept whole as its flat vector, a unit's
/// shard this rank's slice of it. The parameters of the other groups keep theirs.
pub(super) fn write_back<B: AutodiffBackend, M: AutodiffModule<B>>(
    core: &EngineCore,
    module: M,
    device: &B::Device,
    held: &[Holding],
    groups: &[bool],
) -> Result<M, ZeroError> {
    let mut source = core.value_source();
    let mut error = None;
    let dtype = core.settings.precision.dtype;
    let wanted = |p: usize| groups.get(core.places[p].group).copied().unwrap_or(true);
    // An offloaded unit's new shard goes straight to its store, never to the device.
    let stores = crate::sharded::stores_in_place::<B, M>(&module);
    let module = rewrite_data_some(module, device, |i, shape| match &held[i] {
        Holding::Param(p) if !wanted(*p) => None,
        Holding::Param(p) => Some(source.take_data(*p)),
        Holding::Whole(params) if !params.clone().any(wanted) => None,
        Holding::Whole(params) => {
            let flat: Vec<f32> = params.clone().flat_map(|p| source.take(p)).collect();
            Some(half_buffer::f32_to_data(flat, shape, dtype))
        }
        Holding::Shard { group, .. } if !groups.get(*group).copied().unwrap_or(true) => None,
        Holding::Shard { group, .. } => {
            let len = core.state.layout.owned_len(*group);
            let shard = core.shard_buffer(*group).unwrap_or_else(|e| {
                error.get_or_insert(e);
                half_buffer::zeros(dtype, len)
            });
            let data = half_buffer::into_data(shard, len, vec![len]);
            match stores.get(i).cloned().flatten() {
                Some(store) => {
                    if let Err(e) = store.write(data) {
                        error.get_or_insert(e);
                    }
                    None
                }
                None => Some(data),
            }
        }
        // A `ZeroModule` skeleton's parameter: kept (an empty upload of its shape fails on CUDA,
        // see `params::write_data_some`).
        Holding::Nothing => None,
    });
    source.finish()?;
    match error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

/// Tells `core` that its parameters are split over `tensor` as `split` says: its gradient norm
/// becomes the whole model's (a split parameter counts on every tensor rank, a replicated one on
/// tensor rank 0, the partial sums added over the data-parallel ranks (`data`), then the tensor
/// ranks), LAMB's per-tensor norms add over the tensor ranks too, an overflow on any rank of
/// either skips the step on all, and its checkpoints record the rank and the splits.
pub(super) fn split_over_tensor_ranks(
    core: &mut EngineCore,
    data: &Arc<dyn ProcessGroup>,
    tensor: &zero_core::comm::SharedGroup,
    split: &super::SplitRule,
) {
    let record = super::tensor_record(&core.state.layout, tensor, split);
    core.state.tensor_norms = Some(crate::agreement::TensorNorms::new(
        tensor.clone(),
        &core.state.layout,
        |p| record.splits.contains_key(&core.state.layout.params[p].name),
    ));
    let counted = core
        .state
        .layout
        .params
        .iter()
        .map(|p| record.splits.contains_key(&p.name) || tensor.rank() == 0)
        .collect();
    core.grad_norm = Some(crate::agreement::counted_grad_norm(
        counted,
        data.rank(),
        vec![data.clone(), tensor.clone()],
    ));
    // Every tensor rank skips an overflowed step with its data ranks, or none does: a tensor
    // rank that stepped beside one that skipped would hold slices of another model.
    core.overflow = Some(crate::agreement::Agreement::data_and_tensor(
        data.clone(),
        tensor.clone(),
    ));
    core.tensor_parallel = Some(record);
}
