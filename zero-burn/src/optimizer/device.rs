//! The optimizer's state on the model's device ([`DeviceState`]): gradients flattened and
//! reduced as tensors, masters and moments stepped as tensors, the new values written into the
//! module as tensors. Nothing but a few scalars per step reaches the host.

use super::view::{first_device, FlatGrad, Holding, ModuleView};
use crate::core::StepReport;
use crate::device::flat::{flatten, read_flat, write_flat};
use crate::device::own_buffer;
use crate::device::state::DeviceState;
use crate::device::DeviceCollective;
use crate::error::ZeroError;
use crate::memory::MemoryTracker;
use crate::settings::EngineSettings;
use burn::module::{AutodiffModule, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};
use std::collections::HashMap;
use std::sync::Arc;
use zero_core::comm::ProcessGroup;

/// The inner backend of `B`.
type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// The device state of `module` as `view` sees it: each group's masters are the module's own
/// values (already in the compute dtype) in fp32, a sharded unit's straight from its shard.
pub(super) fn build<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    view: ModuleView,
    settings: &EngineSettings,
    comm: Arc<dyn DeviceCollective<Inner<B>>>,
    host: Arc<dyn ProcessGroup>,
    memory: Arc<MemoryTracker>,
) -> Result<DeviceState<Inner<B>>, ZeroError> {
    let device = first_device::<B, M>(module)?;
    let layout = &view.layout;
    let mut values: Vec<Option<FlatGrad<B>>> = vec![None; layout.params.len()];
    let mut shards: HashMap<usize, FlatGrad<B>> = HashMap::new();
    for (flat, held) in read_flat::<B, M>(module)?.into_iter().zip(&view.held) {
        match held {
            Holding::Param(p) => values[*p] = Some(flat),
            Holding::Whole(params) => cut_into(&mut values, &view, params.clone(), flat),
            Holding::Shard { params, group } => {
                view.check_shard(params, *group, flat.dims()[0])?;
                shards.insert(*group, flat);
            }
            Holding::Nothing => {}
        }
    }
    let rank = comm.rank();
    let mut missing = None;
    let state = DeviceState::new(
        settings.clone(),
        comm,
        host,
        view.layout.clone(),
        device.clone(),
        |g| {
            if let Some(shard) = shards.remove(&g) {
                return (crate::device::cast(shard, DType::F32), true);
            }
            let group = &layout.groups[g];
            let parts = group
                .params
                .iter()
                .map(|&p| match values[p].take() {
                    Some(v) => crate::device::cast(v, DType::F32),
                    None => {
                        missing.get_or_insert(p);
                        crate::device::flat::zeros(layout.params[p].numel(), DType::F32, &device)
                    }
                })
                .collect();
            let owned = layout.owned_range(g, rank);
            let master = flatten(parts, group.padded, DType::F32, &device).narrow(0, owned.start, owned.len());
            (master, false)
        },
        memory,
    )?;
    match missing {
        Some(p) => Err(ZeroError::Model(format!(
            "parameter `{}` was not found in the module",
            layout.params[p].name
        ))),
        None => Ok(state),
    }
}

/// Cuts a unit's flat vector into its layout parameters `params`.
fn cut_into<I: Backend>(
    values: &mut [Option<Tensor<I, 1>>],
    view: &ModuleView,
    params: std::ops::Range<usize>,
    flat: Tensor<I, 1>,
) {
    let mut start = 0;
    for p in params {
        let numel = view.layout.params[p].numel();
        values[p] = Some(flat.clone().narrow(0, start, numel));
        start += numel;
    }
}

/// One step of the device state: the gradients `take` hands out by parameter id are
/// flattened by group, reduced and applied, and `module` given the new values.
pub(super) fn step<B: AutodiffBackend, M: AutodiffModule<B>>(
    state: &mut DeviceState<Inner<B>>,
    view: &ModuleView,
    lr: f64,
    module: M,
    loss_non_finite: bool,
    mut take: impl FnMut(ParamId) -> Option<FlatGrad<B>>,
    frozen: &[usize],
) -> Result<(M, StepReport), ZeroError> {
    view.check_unchanged(&state.layout)?;
    let layout = &view.layout;
    let mut grads: Vec<Option<FlatGrad<B>>> = vec![None; layout.params.len()];
    let mut shards: HashMap<usize, FlatGrad<B>> = HashMap::new();
    for (id, held) in view.ids.iter().zip(&view.held) {
        let Some(grad) = take(*id) else { continue };
        match held {
            Holding::Param(p) => grads[*p] = Some(grad),
            Holding::Whole(params) => cut_into(&mut grads, view, params.clone(), grad),
            Holding::Shard { group, .. } => {
                shards.insert(*group, grad);
            }
            Holding::Nothing => {}
        }
    }
    let dtype = state.settings.precision.dtype.burn();
    let device = state.device().clone();
    let by_group = layout
        .groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            if let Some(shard) = shards.remove(&g) {
                return Some(shard);
            }
            if group.params.iter().all(|&p| grads[p].is_none()) {
                return None;
            }
            // A parameter that took no part in the loss has a zero gradient.
            let parts = group
                .params
                .iter()
                .map(|&p| match grads[p].take() {
                    Some(grad) => crate::device::cast(grad, dtype),
                    None => crate::device::flat::zeros(layout.params[p].numel(), dtype, &device),
                })
                .collect();
            Some(flatten(parts, group.padded, dtype, &device))
        })
        .collect();
    let trains = view.group_trains();
    let report = state.step(by_group, &trains, lr, loss_non_finite)?;
    // Parameters that do not train (`frozen`, visit order) keep the module's values.
    super::adopt::adopt_device::<B, M>(state, view, &module, frozen)?;
    // The groups that did not train keep the module's values as they are.
    Ok((write_back::<B, M>(state, module, view, &trains)?, report))
}

/// `module` with the state's values of the groups `groups` marks, as tensors on the device: a
/// parameter cut from its group's whole values, a unit kept whole as its parameters put
/// together, a unit's shard the rank's shard. The parameters of the other groups keep theirs.
pub(super) fn write_back<B: AutodiffBackend, M: AutodiffModule<B>>(
    state: &DeviceState<Inner<B>>,
    module: M,
    view: &ModuleView,
    groups: &[bool],
) -> Result<M, ZeroError> {
    let values = state.values(groups)?;
    // An offloaded unit's new shard goes to its store; the parameter keeps its placeholder.
    let stores = crate::sharded::stores_in_place::<B, M>(&module);
    let mut error = None;
    let places = view.layout.places();
    let layout = &view.layout;
    let device = state.device().clone();
    let dtype = state.settings.precision.dtype.burn();
    let param = |p: usize| {
        let place = places[p];
        let value = values[place.group].clone()?;
        Some(value.narrow(0, place.offset, layout.params[p].numel()))
    };
    let module = write_flat::<B, M>(module, |i, shape| {
        let value = match &view.held[i] {
            Holding::Param(p) => param(*p)?,
            Holding::Whole(params) => {
                let parts = params.clone().map(param).collect::<Option<Vec<_>>>()?;
                flatten(parts, shape.num_elements(), dtype, &device)
            }
            Holding::Shard { group, .. } => {
                let value = values[*group].clone()?;
                if let Some(store) = stores.get(i).cloned().flatten() {
                    if let Err(e) = store.write(value.into_data()) {
                        error.get_or_insert(e);
                    }
                    return None;
                }
                value
            }
            Holding::Nothing => return None,
        };
        Some(own_buffer(value))
    });
    match error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}
