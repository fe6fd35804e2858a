//! Re-cutting a checkpoint for another world size or stage: which bytes of which old shard
//! file fill which part of a rank's new owned slices.
//!
//! Both layouts are pure functions of the parameter shapes, the grouping and the world size,
//! so the plan needs no communication: a parameter's elements sit at `offset + i` of its old
//! group, that group is cut into equal shards (or held whole by rank 0's file when replicated),
//! and each piece of a new segment is read from the one old shard that holds it.

use crate::partition::{ParamPlace, PartitionLayout, Placement};
use std::ops::Range;

/// A run of elements to copy from an old shard file into a destination buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Rank whose shard file holds the elements.
    pub file_rank: usize,
    /// Group of the old layout (names the tensor in that file).
    pub group: usize,
    /// Element range in the old rank's owned slice of the group.
    pub src: Range<usize>,
    /// Element range in the destination.
    pub dst: Range<usize>,
}

/// Where elements `in_param` of parameter `param` live in the `old` layout; the destination
/// ranges start at `dst_start`.
pub fn param_sources(
    old: &PartitionLayout,
    old_places: &[ParamPlace],
    param: usize,
    in_param: Range<usize>,
    dst_start: usize,
) -> Vec<Piece> {
    let place = old_places[param];
    let group = &old.groups[place.group];
    let start = place.offset + in_param.start;
    let end = place.offset + in_param.end;
    match group.placement {
        Placement::Replicated => {
            vec![Piece {
                file_rank: 0,
                group: place.group,
                src: start..end,
                dst: dst_start..dst_start + (end - start),
            }]
        }
        Placement::Sharded => {
            let len = old.owned_len(place.group);
            let mut out = Vec::new();
            let mut at = start;
            while at < end {
                let rank = at / len;
                let stop = end.min((rank + 1) * len);
                let dst = dst_start + (at - start);
                out.push(Piece {
                    file_rank: rank,
                    group: place.group,
                    src: at - rank * len..stop - rank * len,
                    dst: dst..dst + (stop - at),
                });
                at = stop;
            }
            out
        }
    }
}

/// For every group of the `new` layout, the pieces that fill `rank`'s owned slice of it
/// (padding is left out: it stays zero). `sources[p]` is the `old` parameter that the `new`
/// parameter `p` is read from ([`CheckpointMeta::param_sources`](super::CheckpointMeta::param_sources),
/// which checks the shapes); `None`: the same index.
pub fn plan_rank(
    old: &PartitionLayout,
    new: &PartitionLayout,
    rank: usize,
    sources: Option<&[usize]>,
) -> Vec<Vec<Piece>> {
    let old_places = old.places();
    let source = |p: usize| sources.and_then(|s| s.get(p).copied()).unwrap_or(p);
    (0..new.groups.len())
        .map(|g| {
            let mut pieces: Vec<Piece> = Vec::new();
            for seg in new.segments(g, rank) {
                for piece in param_sources(
                    old,
                    &old_places,
                    source(seg.param),
                    seg.in_param.clone(),
                    seg.local.start,
                ) {
                    // Consecutive parameters usually stay consecutive: one read instead of many.
                    match pieces.last_mut() {
                        Some(last)
                            if last.file_rank == piece.file_rank
                                && last.group == piece.group
                                && last.src.end == piece.src.start
                                && last.dst.end == piece.dst.start =>
                        {
                            last.src.end = piece.src.end;
                            last.dst.end = piece.dst.end;
                        }
                        _ => pieces.push(piece),
                    }
                }
            }
            pieces
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::{LayoutBuilder, ParamSpec};

    fn layout(world: usize, bucket: usize, placement: Placement) -> PartitionLayout {
        let specs: Vec<ParamSpec> = [7usize, 13, 1, 100, 9]
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec {
                name: format!("p{i}"),
                shape: vec![n],
            })
            .collect();
        let mut b = LayoutBuilder::new(specs, world, 4);
        b.buckets(&[0, 1, 2, 3, 4], bucket, placement);
        b.finish()
    }

    /// Every rank's old shards, filled with the element's global parameter id (param * 1000 + i).
    fn old_shards(old: &PartitionLayout) -> Vec<Vec<Vec<f32>>> {
        (0..old.world_size)
            .map(|r| {
                (0..old.groups.len())
                    .map(|g| {
                        let mut v = vec![-1.0f32; old.owned_len(g)];
                        for s in old.segments(g, r) {
                            for (l, i) in s.local.zip(s.in_param) {
                                v[l] = (s.param * 1000 + i) as f32;
                            }
                        }
                        v
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_new_slice_is_rebuilt_from_the_old_shards() {
        // Reference: the new slices computed directly from the parameter ids.
        for (old_world, old_place) in [
            (1, Placement::Sharded),
            (3, Placement::Sharded),
            (2, Placement::Replicated),
        ] {
            for new_world in 1..=4 {
                let old = layout(old_world, 25, old_place);
                let new = layout(new_world, 40, Placement::Sharded);
                let shards = old_shards(&old);
                for rank in 0..new_world {
                    let plan = plan_rank(&old, &new, rank, None);
                    for (g, pieces) in plan.iter().enumerate() {
                        let mut got = vec![0.0f32; new.owned_len(g)];
                        for p in pieces {
                            got[p.dst.clone()].copy_from_slice(&shards[p.file_rank][p.group][p.src.clone()]);
                        }
                        let mut want = vec![0.0f32; new.owned_len(g)];
                        for s in new.segments(g, rank) {
                            for (l, i) in s.local.zip(s.in_param) {
                                want[l] = (s.param * 1000 + i) as f32;
                            }
                        }
                        assert_eq!(
                            got, want,
                            "old world {old_world} {old_place:?} → new world {new_world}, rank {rank}, group {g}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn same_layout_reads_each_group_in_one_piece() {
        let l = layout(2, 1000, Placement::Sharded);
        let plan = plan_rank(&l, &l, 1, None);
        assert_eq!(plan.len(), 1);
        assert_eq!(plan[0].len(), 1, "a contiguous slice must be one read: {:?}", plan[0]);
        assert_eq!(plan[0][0].file_rank, 1);
    }
}
