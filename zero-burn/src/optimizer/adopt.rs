//! Values set in the module, not by the update: the units `ZeroModule::modify` changed become
//! the optimizer's fp32 masters before the next update (the optimizer's moments are kept), and
//! the parameters that do not train (frozen, or a BatchNorm's running statistics) keep the
//! module's values through every update.

use super::state::State;
use super::view::{Holding, ModuleView};
use crate::core::EngineCore;
use crate::device::flat::read_flat;
use crate::device::state::DeviceState;
use crate::error::ZeroError;
use burn::module::{AutodiffModule, ParamId};
use burn::tensor::backend::AutodiffBackend;
use std::ops::Range;

/// A write of module values into the masters: (group, offset in the owned range, the held
/// float parameter, the range of its flat values to write there).
type Write = (usize, usize, usize, Range<usize>);

/// Writes the values `module` holds for the units whose flat parameters are `modified` into
/// `state`'s masters (this rank's): a cut unit's shard is its group's owned masters; a unit held
/// whole writes the owned pieces of each of its parameters.
pub(super) fn adopt<B: AutodiffBackend, M: AutodiffModule<B>>(
    state: &mut State,
    view: &ModuleView,
    module: &M,
    modified: &[ParamId],
) -> Result<(), ZeroError> {
    let held: Vec<usize> = modified
        .iter()
        .filter_map(|id| view.ids.iter().position(|i| i == id))
        .collect();
    match state {
        State::Host(core) => adopt_host::<B, M>(core, view, module, &held),
        state @ State::Device(_) => adopt_device::<B, M>(state.device::<B::InnerBackend>()?, view, module, &held),
    }
}

/// Writes the values `module` holds in its float parameters `held` (visit order) into the host
/// state's masters (this rank's).
pub(super) fn adopt_host<B: AutodiffBackend, M: AutodiffModule<B>>(
    core: &mut EngineCore,
    view: &ModuleView,
    module: &M,
    held: &[usize],
) -> Result<(), ZeroError> {
    let writes = writes(view, held, core.comm.rank());
    if writes.is_empty() {
        return Ok(());
    }
    // Only the parameters written are read (the rest of the model is not copied).
    let mut flat: std::collections::HashMap<usize, Vec<f32>> = std::collections::HashMap::new();
    crate::params::read_values_of::<B, M>(module, Some(held), |i, v| {
        flat.insert(i, v);
    })?;
    // One write per group (a swapped group is read and written back once).
    let mut by_group: std::collections::BTreeMap<usize, Vec<(usize, &[f32])>> = Default::default();
    for (group, start, i, from) in writes {
        let values = flat
            .get(&i)
            .ok_or_else(|| ZeroError::Model(format!("float parameter {i} of the module was not read")))?;
        by_group.entry(group).or_default().push((start, &values[from]));
    }
    for (group, writes) in by_group {
        core.write_masters(group, &writes)?;
    }
    Ok(())
}

/// [`adopt_host`] for the device state.
pub(super) fn adopt_device<B: AutodiffBackend, M: AutodiffModule<B>>(
    state: &mut DeviceState<B::InnerBackend>,
    view: &ModuleView,
    module: &M,
    held: &[usize],
) -> Result<(), ZeroError> {
    let writes = writes(view, held, state.rank());
    if writes.is_empty() {
        return Ok(());
    }
    let flat = read_flat::<B, M>(module)?;
    // One write per group: its masters are put together once, not copied for every piece.
    let mut by_group: std::collections::BTreeMap<usize, Vec<_>> = Default::default();
    for (group, start, i, from) in writes {
        let values = flat[i].clone().narrow(0, from.start, from.len());
        by_group.entry(group).or_default().push((start, values));
    }
    for (group, writes) in by_group {
        state.write_masters(group, writes)?;
    }
    Ok(())
}

/// Where the values of the module's float parameters `held` go in the masters of `rank`.
fn writes(view: &ModuleView, held: &[usize], rank: usize) -> Vec<Write> {
    let mut writes = Vec::new();
    for &i in held {
        let params = match &view.held[i] {
            Holding::Shard { group, .. } => {
                writes.push((*group, 0, i, 0..view.layout.owned_len(*group)));
                continue;
            }
            Holding::Whole(params) => params.clone(),
            Holding::Param(p) => *p..*p + 1,
            Holding::Nothing => continue,
        };
        // A unit's flat vector is its parameters one after the other.
        let mut at = 0;
        for p in params {
            for (g, group) in view.layout.groups.iter().enumerate() {
                if !group.params.contains(&p) {
                    continue;
                }
                for seg in view.layout.segments(g, rank).into_iter().filter(|s| s.param == p) {
                    let from = at + seg.in_param.start..at + seg.in_param.end;
                    writes.push((g, seg.local.start, i, from));
                }
            }
            at += view.layout.params[p].numel();
        }
    }
    writes
}
