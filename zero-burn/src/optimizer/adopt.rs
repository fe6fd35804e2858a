//! Values set in the module between steps: the units `ZeroModule::modify` changed become the
//! optimizer's fp32 masters before the next update (the optimizer's moments are kept).

use super::state::State;
use super::view::{Holding, ModuleView};
use crate::device::flat::read_flat;
use crate::error::ZeroError;
use burn::module::{AutodiffModule, ParamId};
use burn::tensor::backend::AutodiffBackend;
use std::ops::Range;

/// Writes the values `module` holds for the units whose flat parameters are `modified` into
/// `state`'s masters on `rank`: a cut unit's shard is its group's owned masters; a unit held
/// whole writes the owned pieces of each of its parameters.
pub(super) fn adopt<B: AutodiffBackend, M: AutodiffModule<B>>(
    state: &mut State,
    view: &ModuleView,
    module: &M,
    modified: &[ParamId],
    rank: usize,
) -> Result<(), ZeroError> {
    let held: Vec<usize> = modified
        .iter()
        .filter_map(|id| view.ids.iter().position(|i| i == id))
        .collect();
    if held.is_empty() {
        return Ok(());
    }
    // (group, offset in the owned range, source: the held float parameter and the range of its
    // flat values to write there).
    let mut writes: Vec<(usize, usize, usize, Range<usize>)> = Vec::new();
    for &i in &held {
        match &view.held[i] {
            Holding::Shard { group, .. } => writes.push((*group, 0, i, 0..view.layout.owned_len(*group))),
            Holding::Whole(params) => {
                // The unit's flat vector is its parameters one after the other.
                let mut at = 0;
                for p in params.clone() {
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
            Holding::Param(_) | Holding::Nothing => {}
        }
    }
    match state {
        State::Host(core) => {
            let mut flat: Vec<Vec<f32>> = Vec::new();
            crate::params::try_read_values::<B, M>(module, |_, v| flat.push(v))?;
            for (group, start, i, from) in writes {
                core.write_masters(group, start, &flat[i][from])?;
            }
        }
        state @ State::Device(_) => {
            let state = state.device::<B::InnerBackend>()?;
            let flat = read_flat::<B, M>(module)?;
            for (group, start, i, from) in writes {
                let values = flat[i].clone().narrow(0, from.start, from.len());
                state.write_masters(group, start, values)?;
            }
        }
    }
    Ok(())
}
