//! The flat-buffer model: where every parameter lives, on every rank, at every world size.
//!
//! Parameters are visited in one deterministic order and laid out, one after another, in flat
//! groups. A *sharded* group is padded to a multiple of `world_size × alignment` elements and cut
//! into equal contiguous shards: rank `r` owns shard `r`. A *replicated* group is owned whole by
//! every rank (plain data parallelism, or ZeRO-3's small persistent parameters).
//!
//! The layout is a pure function of the parameter shapes, the grouping and the world size, so any
//! rank can compute any other rank's layout, and a checkpoint written at one world size can be
//! re-cut for another.

use std::ops::Range;

/// Name and shape of one parameter.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamSpec {
    /// Dotted module path, e.g. `blocks.3.attn.c_attn.weight`.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// How a group is distributed over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Placement {
    /// Cut into `world_size` equal shards; rank `r` owns shard `r`.
    Sharded,
    /// Every rank owns the whole group.
    Replicated,
}

/// One flat buffer: consecutive parameters, padded.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FlatGroup {
    /// Indices into [`PartitionLayout::params`], in layout order.
    pub params: Vec<usize>,
    /// Offset of each parameter in the flat buffer (same order as `params`).
    pub offsets: Vec<usize>,
    /// Elements used by parameters.
    pub numel: usize,
    /// Elements including padding: a multiple of `world_size × alignment` for sharded groups.
    pub padded: usize,
    /// Sharded or replicated.
    pub placement: Placement,
}

/// The part of one parameter that falls into one rank's owned range of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index into [`PartitionLayout::params`].
    pub param: usize,
    /// Range inside the rank's owned slice of the group.
    pub local: Range<usize>,
    /// Range inside the parameter's flattened elements.
    pub in_param: Range<usize>,
}

/// Where a parameter lives: its group and its offset in the group's flat buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamPlace {
    /// Index into [`PartitionLayout::groups`].
    pub group: usize,
    /// Offset in the group's flat buffer.
    pub offset: usize,
}

/// Every parameter's place in flat groups, for one world size.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PartitionLayout {
    /// All parameters, in visit order.
    pub params: Vec<ParamSpec>,
    /// The flat groups.
    pub groups: Vec<FlatGroup>,
    /// Number of ranks the sharded groups are cut for.
    pub world_size: usize,
    /// Shard lengths are multiples of this many elements.
    pub alignment: usize,
}

/// Builds a [`PartitionLayout`] group by group.
#[derive(Debug)]
pub struct LayoutBuilder {
    layout: PartitionLayout,
}

impl LayoutBuilder {
    /// A builder for `params` (in visit order), cut for `world_size` ranks.
    pub fn new(params: Vec<ParamSpec>, world_size: usize, alignment: usize) -> Self {
        assert!(world_size > 0, "world size must be positive");
        LayoutBuilder {
            layout: PartitionLayout {
                params,
                groups: Vec::new(),
                world_size,
                alignment: alignment.max(1),
            },
        }
    }

    /// Adds one group holding the given parameters (indices, in layout order); returns its index.
    /// An empty list adds nothing and returns `None`.
    pub fn group(&mut self, params: Vec<usize>, placement: Placement) -> Option<usize> {
        if params.is_empty() {
            return None;
        }
        let mut offsets = Vec::with_capacity(params.len());
        let mut numel = 0;
        for &p in &params {
            offsets.push(numel);
            numel += self.layout.params[p].numel();
        }
        let padded = match placement {
            Placement::Sharded => {
                let unit = self.layout.world_size * self.layout.alignment;
                numel.div_ceil(unit).max(1) * unit
            }
            Placement::Replicated => numel,
        };
        self.layout.groups.push(FlatGroup {
            params,
            offsets,
            numel,
            padded,
            placement,
        });
        Some(self.layout.groups.len() - 1)
    }

    /// Adds the parameters as consecutive groups of about `bucket_elements` elements each: a
    /// parameter never straddles two groups, and a parameter larger than a bucket gets a group
    /// of its own. Returns the indices of the new groups.
    pub fn buckets(&mut self, params: &[usize], bucket_elements: usize, placement: Placement) -> Vec<usize> {
        let mut added = Vec::new();
        let mut current = Vec::new();
        let mut size = 0;
        for &p in params {
            let n = self.layout.params[p].numel();
            if !current.is_empty() && size + n > bucket_elements {
                added.extend(self.group(std::mem::take(&mut current), placement));
                size = 0;
            }
            current.push(p);
            size += n;
        }
        added.extend(self.group(current, placement));
        added
    }

    /// The finished layout. Panics if a parameter was placed twice or not at all (a bug in the
    /// caller's grouping, not a user error).
    pub fn finish(self) -> PartitionLayout {
        let mut seen = vec![0u32; self.layout.params.len()];
        for g in &self.layout.groups {
            for &p in &g.params {
                seen[p] += 1;
            }
        }
        assert!(
            seen.iter().all(|&c| c == 1),
            "every parameter must be in exactly one group"
        );
        self.layout
    }
}

impl PartitionLayout {
    /// Where each parameter lives, indexed like [`PartitionLayout::params`].
    pub fn places(&self) -> Vec<ParamPlace> {
        let mut places = vec![ParamPlace { group: 0, offset: 0 }; self.params.len()];
        for (gi, g) in self.groups.iter().enumerate() {
            for (&p, &offset) in g.params.iter().zip(&g.offsets) {
                places[p] = ParamPlace { group: gi, offset };
            }
        }
        places
    }

    /// Length of the slice of `group` that one rank owns.
    pub fn owned_len(&self, group: usize) -> usize {
        let g = &self.groups[group];
        match g.placement {
            Placement::Sharded => g.padded / self.world_size,
            Placement::Replicated => g.padded,
        }
    }

    /// The range of `group`'s flat buffer that `rank` owns.
    pub fn owned_range(&self, group: usize, rank: usize) -> Range<usize> {
        let g = &self.groups[group];
        match g.placement {
            Placement::Sharded => {
                let len = g.padded / self.world_size;
                rank * len..(rank + 1) * len
            }
            Placement::Replicated => 0..g.padded,
        }
    }

    /// The pieces of parameters inside `rank`'s owned range of `group` (padding excluded).
    pub fn segments(&self, group: usize, rank: usize) -> Vec<Segment> {
        let g = &self.groups[group];
        let owned = self.owned_range(group, rank);
        let mut out = Vec::new();
        for (&p, &offset) in g.params.iter().zip(&g.offsets) {
            let n = self.params[p].numel();
            let start = offset.max(owned.start);
            let end = (offset + n).min(owned.end);
            if start < end {
                out.push(Segment {
                    param: p,
                    local: start - owned.start..end - owned.start,
                    in_param: start - offset..end - offset,
                });
            }
        }
        out
    }

    /// Total parameter elements (no padding).
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }

    /// Elements `rank` owns over all groups (padding included).
    pub fn owned_numel(&self) -> usize {
        (0..self.groups.len()).map(|g| self.owned_len(g)).sum()
    }

    /// Largest padded group: the biggest buffer a gather or a reduction materialises.
    pub fn max_group_padded(&self) -> usize {
        self.groups.iter().map(|g| g.padded).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(numels: &[usize]) -> Vec<ParamSpec> {
        numels
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec {
                name: format!("p{i}"),
                shape: vec![n],
            })
            .collect()
    }

    #[test]
    fn shards_cover_every_element_exactly_once() {
        for world in 1..=5 {
            let mut b = LayoutBuilder::new(specs(&[7, 13, 1, 100]), world, 4);
            b.buckets(&[0, 1, 2, 3], 25, Placement::Sharded);
            let layout = b.finish();
            for (gi, g) in layout.groups.iter().enumerate() {
                assert_eq!(g.padded % (world * 4), 0);
                let mut covered = vec![0u8; g.numel];
                for rank in 0..world {
                    assert_eq!(layout.owned_range(gi, rank).len(), layout.owned_len(gi));
                    for s in layout.segments(gi, rank) {
                        let start = g.offsets[g.params.iter().position(|&p| p == s.param).unwrap()];
                        for i in s.in_param.clone() {
                            covered[start + i] += 1;
                        }
                        assert_eq!(s.local.len(), s.in_param.len());
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "world {world} group {gi}");
            }
        }
    }

    #[test]
    fn buckets_never_split_a_parameter() {
        let mut b = LayoutBuilder::new(specs(&[10, 10, 30, 5, 5]), 2, 1);
        let groups = b.buckets(&[0, 1, 2, 3, 4], 20, Placement::Sharded);
        let layout = b.finish();
        assert_eq!(groups.len(), 3);
        assert_eq!(layout.groups[0].params, vec![0, 1]);
        assert_eq!(layout.groups[1].params, vec![2]);
        assert_eq!(layout.groups[2].params, vec![3, 4]);
        let places = layout.places();
        assert_eq!(places[4], ParamPlace { group: 2, offset: 5 });
    }

    #[test]
    fn replicated_groups_are_owned_whole() {
        let mut b = LayoutBuilder::new(specs(&[3, 5]), 4, 8);
        b.group(vec![0], Placement::Replicated);
        b.group(vec![1], Placement::Sharded);
        let layout = b.finish();
        assert_eq!(layout.owned_range(0, 3), 0..3);
        assert_eq!(layout.owned_len(1), 8);
        assert_eq!(layout.segments(0, 2).len(), 1);
        // rank 1 owns elements 8..16 of the sharded group: all padding.
        assert!(layout.segments(1, 1).is_empty());
    }
}
