//! How a model's parameters are laid out over the ranks at stages 0-2, and the broadcast that
//! gives every rank rank 0's starting values: shared by [`crate::ZeroOptimizer`] and the engines.

use crate::error::ZeroError;
use crate::settings::{EngineSettings, Stage};
use zero_core::comm::{FlatBuffer, ProcessGroup};
use zero_core::partition::{LayoutBuilder, ParamSpec, PartitionLayout, Placement};

/// `specs` (in visit order) in buckets of about `reduce_bucket_size`, replicated at stage 0 and
/// sharded at stages 1-2, except the parameters of `units` (disjoint ranges, each a sharded
/// `ZeroModule`'s parameters): each unit is a sharded group of its own. A bucket holds
/// parameters that train (`trains`, by spec) or ones that do not, never both: a group of frozen
/// parameters is neither reduced nor stepped, and needs no optimizer state.
pub(crate) fn stage_layout(
    specs: Vec<ParamSpec>,
    units: &[std::ops::Range<usize>],
    trains: &[bool],
    alignment: usize,
    settings: &EngineSettings,
    world: usize,
) -> PartitionLayout {
    let bucketed: Vec<usize> = (0..specs.len())
        .filter(|i| !units.iter().any(|u| u.contains(i)))
        .collect();
    let placement = if settings.stage == Stage::Zero0 {
        Placement::Replicated
    } else {
        Placement::Sharded
    };
    let trains = |i: &usize| trains.get(*i).copied().unwrap_or(true);
    let (trained, frozen): (Vec<usize>, Vec<usize>) = bucketed.into_iter().partition(trains);
    let mut builder = LayoutBuilder::new(specs, world, alignment);
    // The parameters that train, then those that do not, each in visit order.
    builder.buckets(&trained, settings.reduce_bucket_size.max(1), placement);
    builder.buckets(&frozen, settings.reduce_bucket_size.max(1), placement);
    for unit in units {
        builder.group(unit.clone().collect(), Placement::Sharded);
    }
    builder.finish()
}

/// Rank 0's values of every parameter, on every rank (one broadcast per group), except the
/// groups marked in `own` (by group), which keep this rank's values.
pub(crate) fn broadcast_values(
    mut values: Vec<Vec<f32>>,
    layout: &PartitionLayout,
    comm: &dyn ProcessGroup,
    own: &[bool],
) -> Result<Vec<Vec<f32>>, ZeroError> {
    if comm.world_size() == 1 {
        return Ok(values);
    }
    for (g, _) in layout.groups.iter().zip(own).filter(|(_, &own)| !own) {
        let mut flat = Vec::with_capacity(g.numel);
        for &p in &g.params {
            flat.extend_from_slice(&values[p]);
        }
        let mut buf = FlatBuffer::F32(flat);
        comm.broadcast(&mut buf, 0)?;
        let flat = buf.into_f32();
        for (&p, &offset) in g.params.iter().zip(&g.offsets) {
            let n = values[p].len();
            values[p].copy_from_slice(&flat[offset..offset + n]);
        }
    }
    Ok(values)
}
