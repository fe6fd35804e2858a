//! The parallel layout of a job: how its ranks are arranged along the data, tensor and pipeline
//! axes, and the process groups that follow from that arrangement.
//!
//! Ranks are numbered with the tensor axis fastest, then data, then pipeline (Megatron-LM's
//! order): `rank = (pipeline · data_size + data) · tensor_size + tensor`. The ranks of one
//! tensor-parallel group are therefore neighbours, which puts the most talkative group on one
//! host whenever a host runs a multiple of `tensor_size` ranks.
//!
//! Along each axis, the ranks that differ only in their coordinate on that axis form a group;
//! a rank's index in that group is its coordinate on the axis. ZeRO shards over the data group
//! only, tensor parallelism communicates over the tensor group, and a pipeline stage's neighbours
//! are found along the pipeline axis.

use crate::comm::{CommError, ProcessGroup, SharedGroup, TcpGroup, ThreadGroup};
use std::sync::Arc;

/// An axis of the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Data parallelism: replicas (ZeRO-sharded) that see different batches.
    Data,
    /// Tensor parallelism: ranks that split each layer's weights.
    Tensor,
    /// Pipeline parallelism: ranks that hold different layers.
    Pipeline,
}

impl Axis {
    /// Every axis, in the order [`ParallelLayout::groups_of`] results are usually wanted.
    pub const ALL: [Axis; 3] = [Axis::Data, Axis::Tensor, Axis::Pipeline];

    fn name(self) -> &'static str {
        match self {
            Axis::Data => "data",
            Axis::Tensor => "tensor",
            Axis::Pipeline => "pipeline",
        }
    }
}

/// A layout that cannot exist.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LayoutError {
    /// An axis of size zero.
    #[error("the {axis} axis has size 0; every axis needs at least one rank")]
    EmptyAxis {
        /// The axis (`data`, `tensor` or `pipeline`).
        axis: &'static str,
    },
    /// The layout does not multiply out to the world it is applied to.
    #[error(
        "a layout of data {data} × tensor {tensor} × pipeline {pipeline} needs {needed} ranks, \
         but the world group has {world}"
    )]
    WorldSize {
        /// Data-parallel size.
        data: usize,
        /// Tensor-parallel size.
        tensor: usize,
        /// Pipeline-parallel size.
        pipeline: usize,
        /// Their product.
        needed: usize,
        /// The world group's size.
        world: usize,
    },
    /// A rank outside the layout.
    #[error("rank {rank} is not below the layout's world size {world}")]
    RankOutOfRange {
        /// The rank asked about.
        rank: usize,
        /// The layout's world size.
        world: usize,
    },
    /// Building a group failed.
    #[error("building the {axis} group of rank {rank}: {source}")]
    Comm {
        /// The axis of the group (`world` for the world group itself).
        axis: &'static str,
        /// The world rank that failed.
        rank: usize,
        /// The communication error.
        source: CommError,
    },
}

/// A rank's position along each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coords {
    /// Index in the data-parallel group.
    pub data: usize,
    /// Index in the tensor-parallel group.
    pub tensor: usize,
    /// Pipeline stage.
    pub pipeline: usize,
}

impl Coords {
    /// The coordinate on `axis`.
    pub fn on(&self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.data,
            Axis::Tensor => self.tensor,
            Axis::Pipeline => self.pipeline,
        }
    }
}

/// The sizes of the axes, and the arithmetic between world ranks and coordinates.
///
/// ```
/// use zero_core::parallel::{Axis, ParallelLayout};
///
/// let layout = ParallelLayout::new(2, 2).unwrap(); // data 2 × tensor 2
/// assert_eq!(layout.world_size(), 4);
/// assert_eq!(layout.members(Axis::Tensor, 3).unwrap(), vec![2, 3]);
/// assert_eq!(layout.members(Axis::Data, 3).unwrap(), vec![1, 3]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParallelLayout {
    data: usize,
    tensor: usize,
    pipeline: usize,
}

impl ParallelLayout {
    /// `data × tensor` ranks, one pipeline stage.
    pub fn new(data: usize, tensor: usize) -> Result<Self, LayoutError> {
        Self::with_pipeline(data, tensor, 1)
    }

    /// `data × tensor × pipeline` ranks.
    pub fn with_pipeline(data: usize, tensor: usize, pipeline: usize) -> Result<Self, LayoutError> {
        for (axis, size) in [(Axis::Data, data), (Axis::Tensor, tensor), (Axis::Pipeline, pipeline)] {
            if size == 0 {
                return Err(LayoutError::EmptyAxis { axis: axis.name() });
            }
        }
        Ok(ParallelLayout { data, tensor, pipeline })
    }

    /// The size of `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.data,
            Axis::Tensor => self.tensor,
            Axis::Pipeline => self.pipeline,
        }
    }

    /// Number of ranks of the whole job.
    pub fn world_size(&self) -> usize {
        self.data * self.tensor * self.pipeline
    }

    /// Where world rank `rank` sits.
    pub fn coords(&self, rank: usize) -> Result<Coords, LayoutError> {
        self.check_rank(rank)?;
        Ok(Coords {
            tensor: rank % self.tensor,
            data: (rank / self.tensor) % self.data,
            pipeline: rank / (self.tensor * self.data),
        })
    }

    /// The world rank at `coords`, or `None` if a coordinate is out of range.
    pub fn rank_at(&self, coords: Coords) -> Option<usize> {
        let inside = Axis::ALL.iter().all(|&axis| coords.on(axis) < self.size(axis));
        inside.then(|| (coords.pipeline * self.data + coords.data) * self.tensor + coords.tensor)
    }

    /// The world ranks of `rank`'s group along `axis`, in group-rank order (index `i` is the
    /// member whose coordinate on `axis` is `i`).
    pub fn members(&self, axis: Axis, rank: usize) -> Result<Vec<usize>, LayoutError> {
        let at = self.coords(rank)?;
        Ok((0..self.size(axis))
            .filter_map(|i| {
                let mut c = at;
                match axis {
                    Axis::Data => c.data = i,
                    Axis::Tensor => c.tensor = i,
                    Axis::Pipeline => c.pipeline = i,
                }
                self.rank_at(c)
            })
            .collect())
    }

    /// Every group along `axis`, ordered by its first member: a partition of the world.
    pub fn groups_of(&self, axis: Axis) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = (0..self.world_size())
            .filter_map(|r| self.members(axis, r).ok())
            .collect();
        groups.sort();
        groups.dedup();
        groups
    }

    /// Which of [`groups_of`](Self::groups_of)`(axis)` holds `rank`.
    pub fn group_index(&self, axis: Axis, rank: usize) -> Result<usize, LayoutError> {
        let members = self.members(axis, rank)?;
        Ok(self.groups_of(axis).iter().position(|g| *g == members).unwrap_or(0))
    }

    fn check_rank(&self, rank: usize) -> Result<(), LayoutError> {
        let world = self.world_size();
        if rank >= world {
            return Err(LayoutError::RankOutOfRange { rank, world });
        }
        Ok(())
    }

    fn check_world(&self, world: usize) -> Result<(), LayoutError> {
        if world != self.world_size() {
            return Err(LayoutError::WorldSize {
                data: self.data,
                tensor: self.tensor,
                pipeline: self.pipeline,
                needed: self.world_size(),
                world,
            });
        }
        Ok(())
    }

    /// The groups of every rank of a job whose ranks are threads of this process: one
    /// [`ThreadGroup`] for the world and one per group along each axis, all built up front.
    /// Index `r` of the result belongs to world rank `r`; move each to its thread.
    pub fn threads(&self) -> Result<Vec<RankGroups>, LayoutError> {
        let comm = |axis: &'static str| move |source| LayoutError::Comm { axis, rank: 0, source };
        let world = ThreadGroup::new_group(self.world_size()).map_err(comm("world"))?;
        // Per axis, per world rank: its handle in its group along that axis.
        let mut per_axis: Vec<Vec<Option<SharedGroup>>> = Vec::new();
        for axis in Axis::ALL {
            let mut handles: Vec<Option<SharedGroup>> = vec![None; self.world_size()];
            for members in self.groups_of(axis) {
                let group = ThreadGroup::new_group(members.len()).map_err(comm(axis.name()))?;
                for (&member, handle) in members.iter().zip(group) {
                    handles[member] = Some(handle as SharedGroup);
                }
            }
            per_axis.push(handles);
        }
        // Per world rank, its handle in each pipeline subgroup, in `pipeline_partitions` order.
        let mut stage_handles: Vec<Vec<Option<SharedGroup>>> = Vec::new();
        for partition in self.pipeline_partitions() {
            let mut handles: Vec<Option<SharedGroup>> = vec![None; self.world_size()];
            for members in partition {
                let group = ThreadGroup::new_group(members.len()).map_err(comm("pipeline"))?;
                for (&member, handle) in members.iter().zip(group) {
                    handles[member] = Some(handle as SharedGroup);
                }
            }
            stage_handles.push(handles);
        }
        world
            .into_iter()
            .enumerate()
            .map(|(rank, world)| {
                let mut take = |i: usize| {
                    per_axis[i][rank].take().ok_or(LayoutError::Comm {
                        axis: Axis::ALL[i].name(),
                        rank,
                        source: CommError::Setup("no group was built for this rank".into()),
                    })
                };
                let handles: Vec<SharedGroup> = stage_handles
                    .iter_mut()
                    .map(|h| {
                        h[rank].take().ok_or(LayoutError::Comm {
                            axis: "pipeline",
                            rank,
                            source: CommError::Setup("no pipeline subgroup was built for this rank".into()),
                        })
                    })
                    .collect::<Result<_, _>>()?;
                let coords = self.coords(rank)?;
                Ok(RankGroups {
                    layout: *self,
                    coords,
                    data: take(0)?,
                    tensor: take(1)?,
                    pipeline: take(2)?,
                    world: world as SharedGroup,
                    stage: self.stage_groups(coords, handles),
                })
            })
            .collect()
    }

    /// This rank's groups when the ranks are processes joined in the TCP group `world`.
    ///
    /// Every rank of `world` must call this with the same layout: the subgroups are set up by
    /// a collective over `world` (see [`TcpGroup::split`]), each with its own connections.
    pub fn tcp(&self, world: TcpGroup) -> Result<RankGroups, LayoutError> {
        self.check_world(world.world_size())?;
        let rank = world.rank();
        let coords = self.coords(rank)?;
        let split = |axis: Axis| -> Result<SharedGroup, LayoutError> {
            let group = world.split(&self.groups_of(axis)).map_err(|source| LayoutError::Comm {
                axis: axis.name(),
                rank,
                source,
            })?;
            Ok(Arc::new(group))
        };
        // The same order on every rank: each split is a collective over the world group.
        let data = split(Axis::Data)?;
        let tensor = split(Axis::Tensor)?;
        let pipeline = split(Axis::Pipeline)?;
        let handles = self
            .pipeline_partitions()
            .iter()
            .map(|partition| {
                let group = world.split(partition).map_err(|source| LayoutError::Comm {
                    axis: "pipeline",
                    rank,
                    source,
                })?;
                Ok(Arc::new(group) as SharedGroup)
            })
            .collect::<Result<Vec<_>, LayoutError>>()?;
        Ok(RankGroups {
            layout: *self,
            coords,
            data,
            tensor,
            pipeline,
            world: Arc::new(world),
            stage: self.stage_groups(coords, handles),
        })
    }

    /// The partitions of the world behind [`StageGroups`], in this order: for each adjacent pair
    /// of stages `(s, s + 1)`, the activation channel then the gradient channel (each a 2-rank
    /// group per data and tensor index, sender first for activations, receiver first for
    /// gradients — both list stage `s` first); then the tied group (first and last stage); then
    /// the model group (every stage and tensor rank of one data index). Ranks left out of a
    /// partition's pairs sit alone, so that each is a partition (what [`TcpGroup::split`] needs).
    fn pipeline_partitions(&self) -> Vec<Vec<Vec<usize>>> {
        let p = self.pipeline;
        let pairs = |a: usize, b: usize| -> Vec<Vec<usize>> {
            let mut groups = Vec::new();
            let mut paired = vec![false; self.world_size()];
            for data in 0..self.data {
                for tensor in 0..self.tensor {
                    let at = |pipeline| self.rank_at(Coords { data, tensor, pipeline });
                    if let (Some(x), Some(y)) = (at(a), at(b)) {
                        paired[x] = true;
                        paired[y] = true;
                        groups.push(vec![x, y]);
                    }
                }
            }
            groups.extend((0..self.world_size()).filter(|&r| !paired[r]).map(|r| vec![r]));
            groups
        };
        let mut out = Vec::new();
        for s in 0..p.saturating_sub(1) {
            out.push(pairs(s, s + 1));
            out.push(pairs(s, s + 1));
        }
        if p > 1 {
            out.push(pairs(0, p - 1));
        }
        let model: Vec<Vec<usize>> = (0..self.data)
            .map(|data| {
                (0..self.pipeline)
                    .flat_map(|pipeline| (0..self.tensor).map(move |tensor| (pipeline, tensor)))
                    .filter_map(|(pipeline, tensor)| self.rank_at(Coords { data, tensor, pipeline }))
                    .collect()
            })
            .collect();
        out.push(model);
        out
    }

    /// Picks this rank's [`StageGroups`] out of its handles in the pipeline partitions (in
    /// [`pipeline_partitions`](Self::pipeline_partitions) order).
    fn stage_groups(&self, coords: Coords, handles: Vec<SharedGroup>) -> StageGroups {
        let p = self.pipeline;
        let s = coords.pipeline;
        let mut handles = handles.into_iter();
        let mut activations = Vec::new();
        let mut gradients = Vec::new();
        for _ in 0..p.saturating_sub(1) {
            activations.extend(handles.next());
            gradients.extend(handles.next());
        }
        let tied = if p > 1 { handles.next() } else { None };
        let model = handles.next();
        let pick = |list: &Vec<SharedGroup>, pair: Option<usize>| pair.and_then(|i| list.get(i).cloned());
        let has_tied = p > 1 && (s == 0 || s == p - 1);
        StageGroups {
            stage: s,
            stages: p,
            send_next: pick(&activations, (s + 1 < p).then_some(s)),
            recv_prev: pick(&activations, s.checked_sub(1)),
            send_prev: pick(&gradients, s.checked_sub(1)),
            recv_next: pick(&gradients, (s + 1 < p).then_some(s)),
            tied: if has_tied { tied } else { None },
            model,
        }
    }
}

/// What a pipeline stage talks over besides its data and tensor groups: one 2-rank channel per
/// neighbour and direction (in each, the lower stage is rank 0), the tied group of the first
/// and last stage, and the model group.
#[derive(Clone, Debug)]
pub struct StageGroups {
    /// This rank's stage.
    pub stage: usize,
    /// Number of stages.
    pub stages: usize,
    /// Activations to stage `stage + 1` (none on the last stage).
    pub send_next: Option<SharedGroup>,
    /// Activations from stage `stage - 1` (none on the first stage).
    pub recv_prev: Option<SharedGroup>,
    /// Gradients to stage `stage - 1` (none on the first stage).
    pub send_prev: Option<SharedGroup>,
    /// Gradients from stage `stage + 1` (none on the last stage).
    pub recv_next: Option<SharedGroup>,
    /// The first and last stage (rank 0: the first), which both hold the tied weights; only on
    /// those two stages, and only with more than one stage.
    pub tied: Option<SharedGroup>,
    /// Every stage and tensor rank of this rank's data-parallel index, in world-rank order: the
    /// group over which the pieces of one model replica's gradient norm are summed.
    pub model: Option<SharedGroup>,
}

/// One rank's process groups under a [`ParallelLayout`].
#[derive(Clone, Debug)]
pub struct RankGroups {
    /// The layout they follow.
    pub layout: ParallelLayout,
    /// Where this rank sits.
    pub coords: Coords,
    /// Every rank of the job.
    pub world: SharedGroup,
    /// The ranks that hold the same weights and see different data: what ZeRO shards over.
    pub data: SharedGroup,
    /// The ranks that split each layer's weights.
    pub tensor: SharedGroup,
    /// The ranks that hold the other pipeline stages.
    pub pipeline: SharedGroup,
    /// The pipeline stage's channels, tied group and model group.
    pub stage: StageGroups,
}

impl RankGroups {
    /// The group along `axis`.
    pub fn along(&self, axis: Axis) -> &SharedGroup {
        match axis {
            Axis::Data => &self.data,
            Axis::Tensor => &self.tensor,
            Axis::Pipeline => &self.pipeline,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: the rank formula written out by hand for 2 × 3 × 2.
    #[test]
    fn coords_round_trip_tensor_fastest() {
        let layout = ParallelLayout::with_pipeline(2, 3, 2).unwrap();
        assert_eq!(layout.world_size(), 12);
        for rank in 0..12 {
            let c = layout.coords(rank).unwrap();
            assert_eq!(c.tensor, rank % 3);
            assert_eq!(c.data, (rank / 3) % 2);
            assert_eq!(c.pipeline, rank / 6);
            assert_eq!(layout.rank_at(c), Some(rank));
        }
        assert!(layout.coords(12).is_err());
    }

    #[test]
    fn groups_partition_the_world() {
        let layout = ParallelLayout::with_pipeline(2, 2, 2).unwrap();
        assert_eq!(
            layout.groups_of(Axis::Tensor),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            layout.groups_of(Axis::Data),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            layout.groups_of(Axis::Pipeline),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        for axis in Axis::ALL {
            let mut all: Vec<usize> = layout.groups_of(axis).concat();
            all.sort();
            assert_eq!(all, (0..8).collect::<Vec<_>>());
        }
        assert_eq!(layout.group_index(Axis::Data, 5).unwrap(), 3);
    }

    /// Reference: the pairs written out by hand for data 2 × pipeline 3.
    #[test]
    fn pipeline_partitions_pair_neighbours() {
        let layout = ParallelLayout::with_pipeline(2, 1, 3).unwrap();
        let parts = layout.pipeline_partitions();
        // Two pairs of neighbours × two directions, the tied group, the model group.
        assert_eq!(parts.len(), 6);
        assert_eq!(parts[0], vec![vec![0, 2], vec![1, 3], vec![4], vec![5]]);
        assert_eq!(parts[2], vec![vec![2, 4], vec![3, 5], vec![0], vec![1]]);
        assert_eq!(parts[4], vec![vec![0, 4], vec![1, 5], vec![2], vec![3]]);
        assert_eq!(parts[5], vec![vec![0, 2, 4], vec![1, 3, 5]]);
    }

    /// A stage's channels connect it to its neighbours, in both directions.
    #[test]
    fn stage_channels_carry_to_the_neighbour() {
        let layout = ParallelLayout::with_pipeline(1, 1, 3).unwrap();
        let ranks = layout.threads().unwrap();
        assert!(ranks[0].stage.recv_prev.is_none() && ranks[2].stage.send_next.is_none());
        assert!(ranks[1].stage.tied.is_none() && ranks[0].stage.tied.is_some());
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let s = g.stage.stage;
                    let mut got = Vec::new();
                    if let Some(c) = &g.stage.send_next {
                        let mut b = crate::comm::FlatBuffer::F32(vec![s as f32 + 1.0]);
                        c.broadcast(&mut b, 0).unwrap();
                    }
                    if let Some(c) = &g.stage.recv_prev {
                        let mut b = crate::comm::FlatBuffer::F32(vec![0.0]);
                        c.broadcast(&mut b, 0).unwrap();
                        got.push(b.into_f32()[0]);
                    }
                    if let Some(c) = &g.stage.model {
                        let mut b = crate::comm::FlatBuffer::F32(vec![1.0]);
                        c.all_reduce(&mut b, crate::comm::ReduceOp::Sum).unwrap();
                        got.push(b.into_f32()[0]);
                    }
                    got
                })
            })
            .collect();
        let got: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(got, vec![vec![3.0], vec![1.0, 3.0], vec![2.0, 3.0]]);
    }

    #[test]
    fn empty_axis_is_rejected() {
        assert_eq!(ParallelLayout::new(0, 2), Err(LayoutError::EmptyAxis { axis: "data" }));
    }
}
