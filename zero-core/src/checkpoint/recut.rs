//! Re-cutting a state that every rank holds in memory (its own owned slices, as a Burn record
//! keeps them) for another layout over the same ranks: another stage or grouping, no files.
//!
//! The plan is [`reshard`](super::reshard)'s, with ranks in place of shard files: an old sharded
//! group is all-gathered (master, then each optimizer buffer, one group at a time, so the peak
//! is one old group whole) and each rank copies out the pieces of its new slices; an old
//! replicated group is every rank's own. A different world size cannot be re-cut this way (the
//! old ranks' slices are not all present): that is what the sharded checkpoint is for.

use super::collective::agree;
use super::format::CheckpointMeta;
use super::load::LoadedGroup;
use super::reshard::plan_rank;
use super::CheckpointError;
use crate::comm::{FlatBuffer, ProcessGroup};
use crate::partition::{PartitionLayout, Placement};
use std::path::Path;

/// Every rank: its owned slices of `layout`'s groups, from `mine`, the owned slices of the state
/// `meta` describes that rank `from_rank` held (saved over the same ranks). All ranks succeed or
/// all fail; `what` names the state in errors.
pub fn recut(
    comm: &dyn ProcessGroup,
    what: &str,
    meta: &CheckpointMeta,
    from_rank: usize,
    mine: Vec<LoadedGroup>,
    layout: &PartitionLayout,
) -> Result<Vec<LoadedGroup>, CheckpointError> {
    let checked = check(comm, what, meta, from_rank, &mine, layout);
    agree(comm, "load", checked)?;
    if meta.layout == *layout {
        return Ok(mine);
    }
    let rank = comm.rank();
    let old = &meta.layout;
    let sources = meta.param_sources(Path::new(what), &layout.params)?;
    let plan = plan_rank(old, layout, rank, Some(&sources));
    let names = &meta.optimizer.state_names;
    let mut out: Vec<LoadedGroup> = (0..layout.groups.len())
        .map(|g| {
            let len = layout.owned_len(g);
            LoadedGroup {
                master: vec![0.0; len],
                state: names.iter().map(|n| (n.clone(), vec![0.0; len])).collect(),
            }
        })
        .collect();
    for (og, own) in mine.into_iter().enumerate() {
        let owned = old.owned_len(og);
        // Buffer 0 is the master, then the optimizer's buffers in `names` order.
        let buffers = std::iter::once(own.master).chain(own.state.into_iter().map(|(_, b)| b));
        for (kind, buffer) in buffers.enumerate() {
            // Every rank gathers the same groups in the same order: the layouts are the same
            // on every rank.
            let whole = match old.groups[og].placement {
                Placement::Sharded => comm.all_gather(FlatBuffer::F32(buffer))?.into_f32(),
                Placement::Replicated => buffer,
            };
            for (g, pieces) in plan.iter().enumerate() {
                let dst = match kind {
                    0 => &mut out[g].master,
                    k => &mut out[g].state[k - 1].1,
                };
                for p in pieces.iter().filter(|p| p.group == og) {
                    let at = match old.groups[og].placement {
                        Placement::Sharded => p.file_rank * owned,
                        Placement::Replicated => 0,
                    };
                    dst[p.dst.clone()].copy_from_slice(&whole[at + p.src.start..at + p.src.end]);
                }
            }
        }
    }
    Ok(out)
}

/// That `mine` is a full set of owned slices of `meta`'s layout at this world size (a group's
/// optimizer buffers all there, or none), and that `layout` holds the same parameters.
fn check(
    comm: &dyn ProcessGroup,
    what: &str,
    meta: &CheckpointMeta,
    from_rank: usize,
    mine: &[LoadedGroup],
    layout: &PartitionLayout,
) -> Result<(), CheckpointError> {
    let world = comm.world_size();
    if meta.world_size != world || meta.layout.world_size != world {
        return Err(CheckpointError::Usage(format!(
            "{what} was made by one of {} ranks and this run has {world}: it is re-cut only over the same ranks; \
             save and load a sharded checkpoint to change the world size",
            meta.world_size
        )));
    }
    if from_rank != comm.rank() {
        return Err(CheckpointError::Usage(format!(
            "{what} holds rank {from_rank}'s slices and was handed to rank {}: each rank loads the record it made",
            comm.rank()
        )));
    }
    meta.param_sources(Path::new(what), &layout.params)?;
    if mine.len() != meta.layout.groups.len() {
        return Err(CheckpointError::Usage(format!(
            "{what} holds {} groups where its layout has {}",
            mine.len(),
            meta.layout.groups.len()
        )));
    }
    for (g, group) in mine.iter().enumerate() {
        let len = meta.layout.owned_len(g);
        if group.master.len() != len {
            return Err(CheckpointError::Usage(format!(
                "{what}: group {g} holds {} master elements where rank {} owns {len}",
                group.master.len(),
                comm.rank()
            )));
        }
        // No buffers: an optimizer state not made yet (parameters that have not trained).
        let names = group.state.iter().map(|(n, _)| n);
        if !group.state.is_empty() && !names.eq(meta.optimizer.state_names.iter()) {
            return Err(CheckpointError::Usage(format!(
                "{what}: group {g}'s optimizer buffers are not the {:?} its description names",
                meta.optimizer.state_names
            )));
        }
        if let Some((name, b)) = group.state.iter().find(|(_, b)| b.len() != len) {
            return Err(CheckpointError::Usage(format!(
                "{what}: group {g}'s `{name}` holds {} elements where the master holds {len}",
                b.len()
            )));
        }
    }
    Ok(())
}
