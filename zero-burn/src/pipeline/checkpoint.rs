//! Saving and restoring a pipeline: one checkpoint of the whole model, in the project's sharded
//! format, that `zero to-fp32` consolidates like any other, that a pipeline of the same cut (at
//! any data-parallel size) resumes from bit for bit, and that another cut, or a run without a
//! pipeline, resumes too (the parameters matched by name: `CheckpointMeta::param_sources`).
//!
//! Every stage's layout is laid end to end into the whole model's layout (the stages' parameters
//! carry the model's own names, see [`PipeLayer::param_name`]). The ranks of stage 0 write the
//! files: data rank `r` of stage 0 writes `rank_r` with the slices that data rank `r` of every
//! stage owns, which reach it over its pipeline group, one stage after the other. So the files
//! are those a single data-parallel job over the whole model would write, and for the length of
//! a save a stage-0 rank holds the other stages' slices of its data rank too.
//!
//! A load needs no traffic of values: every rank reads its own stage's slices from the files
//! that hold them. Every step of both is agreed over the whole world, so a failure on one rank
//! fails every rank, and a failed load leaves every engine as it was.
//!
//! With tensor parallelism inside the stages, each tensor rank holds other slices under the
//! same names: the ranks of tensor index `t` save and load as above under `tensor_rank_{t}` of
//! the directory, recording how each parameter is cut, as a tensor-parallel run without a
//! pipeline does; `zero to-fp32` merges the slices. State offloaded to NVMe is read from and
//! written to the swap files, as an engine without a pipeline does.

use super::engine::PipelineEngine;
use super::layer::PipeLayer;
use crate::error::ZeroError;
use burn::tensor::backend::AutodiffBackend;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use zero_core::checkpoint::format::shard_holds;
use zero_core::checkpoint::reshard::plan_rank;
use zero_core::checkpoint::{
    self, agree, Checkpoint, CheckpointError, CheckpointMeta, GroupShard, LoadedGroup, SaveOptions, SaveRequest, Saved,
    TensorParallelRecord, TensorSplit,
};
use zero_core::comm::{FlatBuffer, ProcessGroup};
use zero_core::partition::PartitionLayout;

/// The whole model's layout, stage after stage, at the data-parallel size.
struct WholeLayout {
    layout: PartitionLayout,
    /// Per stage, its groups' indices in `layout`.
    groups: Vec<Range<usize>>,
}

impl<B: AutodiffBackend, L: PipeLayer<B>> PipelineEngine<B, L> {
    /// Saves the whole pipeline under `dir/tag` (tag None: `global_step{N}`) and points
    /// `dir/latest` at it; every rank of every stage calls this, after a step. `client_state`
    /// comes back from [`Self::load_checkpoint`]. Returns the tag directory. A directory
    /// holding tags of another trajectory is refused, as `ZeroOptimizer::save_checkpoint`
    /// refuses it.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
    ) -> Result<PathBuf, ZeroError> {
        self.save_checkpoint_with(dir, tag, client_state, SaveOptions::default())
            .map(|saved| saved.tag_dir)
    }

    /// [`Self::save_checkpoint`], with what the save does with the directory's other tags
    /// ([`SaveOptions`]). Returns the tag directory and, on world rank 0, the tags removed.
    pub fn save_checkpoint_with(
        &self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
        options: SaveOptions,
    ) -> Result<Saved, ZeroError> {
        let dir = dir.as_ref();
        let tag = tag
            .map(str::to_string)
            .unwrap_or_else(|| format!("global_step{}", self.core.global_step));
        self.ready_for("save_checkpoint")?;
        let split = self.tensor.size > 1;
        agree(self.world.as_ref(), "save", checkpoint::check_same_kind(dir, split))?;
        let whole = whole_layout(&self.core.state.layout, self.pipeline_group.as_ref())?;
        let tensor_parallel = if split {
            Some(TensorParallelRecord {
                splits: whole_splits(&self.tensor.splits, self.pipeline_group.as_ref())?,
                ..self.tensor.clone()
            })
        } else {
            None
        };
        let dir = &self.own_dir(dir);
        let data_rank = self.core.comm.rank();
        let names: Vec<&str> = self
            .core
            .state
            .groups
            .first()
            .map(|g| g.optimizer.inner.state().iter().map(|(n, _)| *n).collect())
            .unwrap_or_default();
        // What each stage sends: its held groups' masters and optimizer buffers, in order.
        let held_len = |s: usize| -> usize {
            whole.groups[s]
                .clone()
                .filter(|&g| shard_holds(&whole.layout, g, data_rank))
                .map(|g| whole.layout.owned_len(g) * (1 + names.len()))
                .sum()
        };
        // State offloaded to NVMe is read back from the swap file; every rank learns whether
        // every rank could.
        let saved = self
            .core
            .saved_state(self.world.as_ref(), &format!("stage {}", self.stage))?;
        let mut own = Vec::with_capacity(held_len(self.stage));
        for j in 0..self.core.state.groups.len() {
            if !shard_holds(&self.core.state.layout, j, data_rank) {
                continue;
            }
            let shard = self.core.group_shard(&saved, j)?;
            if shard.state.len() != names.len() {
                return Err(ZeroError::Optimizer(format!(
                    "stage {}: group {j} has {} optimizer buffers, group 0 has {}",
                    self.stage,
                    shard.state.len(),
                    names.len()
                )));
            }
            own.extend_from_slice(shard.master);
            for (_, b) in shard.state {
                own.extend_from_slice(b);
            }
        }
        let mut slices: Vec<Vec<f32>> = Vec::with_capacity(self.stages);
        for s in 0..self.stages {
            if s == self.stage {
                slices.push(if self.stage == 0 {
                    std::mem::take(&mut own)
                } else {
                    Vec::new()
                });
                if s != 0 {
                    let mut buf = FlatBuffer::F32(std::mem::take(&mut own));
                    self.pipeline_group.broadcast(&mut buf, s)?;
                }
            } else if s != 0 {
                let mut buf = FlatBuffer::F32(vec![0.0; held_len(s)]);
                self.pipeline_group.broadcast(&mut buf, s)?;
                slices.push(if self.stage == 0 { buf.into_f32() } else { Vec::new() });
            } else {
                slices.push(Vec::new());
            }
        }

        let outcome = if self.stage == 0 {
            let empty: &[f32] = &[];
            let mut groups = Vec::with_capacity(whole.layout.groups.len());
            for (s, range) in whole.groups.iter().enumerate() {
                let mut at = 0;
                for g in range.clone() {
                    if !shard_holds(&whole.layout, g, data_rank) {
                        groups.push(GroupShard {
                            master: empty,
                            state: names.iter().map(|&n| (n, empty)).collect(),
                        });
                        continue;
                    }
                    let len = whole.layout.owned_len(g);
                    let mut take = || {
                        let part = slices[s].get(at..at + len).unwrap_or(empty);
                        at += len;
                        part
                    };
                    let master = take();
                    let state = names.iter().map(|&n| (n, take())).collect();
                    groups.push(GroupShard { master, state });
                }
            }
            let first = self.core.state.groups.first().map(|g| &g.optimizer.inner);
            let request = SaveRequest {
                layout: &whole.layout,
                groups,
                stage: self.core.settings.stage.number(),
                global_step: self.core.global_step,
                skipped_steps: self.core.skipped_steps,
                optimizer_name: first.map(|o| o.name().to_string()).unwrap_or_default(),
                optimizer_step: first.map(|o| o.step_count()).unwrap_or(0),
                // A pipeline stage's groups all train: one count.
                group_steps: Vec::new(),
                lr_next: Some(
                    self.core
                        .settings
                        .lr_at(self.core.global_step - self.core.skipped_steps),
                ),
                loss_scaler: self.core.scaler.as_ref().map(|s| s.state()),
                rng: None,
                client_state: client_state.clone(),
                model: self.core.settings.model.clone(),
                tensor_parallel,
                // Stage 0's ranks of every tensor rank save at once.
                tensor_ranks: self.core.settings.tensor_parallel_group.as_deref(),
                lineage: Some(&self.core.lineage),
                options,
            };
            checkpoint::save(self.core.comm.as_ref(), dir, &tag, &request)
        } else {
            Ok(Saved {
                tag_dir: dir.join(&tag),
                ..Saved::default()
            })
        };
        Ok(agree(self.world.as_ref(), "save", outcome)?)
    }

    /// Restores the pipeline from `dir/tag` (tag None: the one `dir/latest` names), saved by a
    /// pipeline of the same cut at any data-parallel size and ZeRO stage; returns the client
    /// state. Every rank reads only its own stage's slices; on error every engine is as it was.
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
    ) -> Result<serde_json::Value, ZeroError> {
        let dir = dir.as_ref();
        self.ready_for("load_checkpoint")?;
        agree(
            self.world.as_ref(),
            "load",
            checkpoint::check_tensor_degree(dir, tag, self.tensor.size),
        )?;
        let whole = whole_layout(&self.core.state.layout, self.pipeline_group.as_ref())?;
        let data_rank = self.core.comm.rank();
        let mine = whole.groups[self.stage].clone();
        let read = read_stage(&self.own_dir(dir), tag, &whole.layout, mine.clone(), data_rank);
        let read = agree(self.world.as_ref(), "load", read);
        let (meta, loaded) = read?;
        // The optimizers are rebuilt (into the swap file, with NVMe offload) and the state
        // replaced only when every rank of every stage succeeded.
        let client_state = self.core.load_groups_over(meta, loaded, self.world.as_ref())?;
        self.refresh_layers()?;
        Ok(client_state)
    }

    /// Whether this rank can take part in a save or load, agreed over the world so that every
    /// rank stops together when one cannot.
    fn ready_for(&self, what: &str) -> Result<(), ZeroError> {
        let ready = if self.core.micro_steps != 0 {
            Err(format!(
                "{what} in the middle of a step ({} micro-batches absorbed): call it between train_batch calls",
                self.core.micro_steps
            ))
        } else {
            Ok(())
        };
        let ready = ready.map_err(|m| CheckpointError::Usage(format!("stage {}: {m}", self.stage)));
        Ok(agree(
            self.world.as_ref(),
            if what.starts_with("save") { "save" } else { "load" },
            ready,
        )?)
    }
}

impl<B: AutodiffBackend, L: PipeLayer<B>> PipelineEngine<B, L> {
    /// Where this rank's tensor index saves and loads under `dir`: `dir` itself without tensor
    /// parallelism, `tensor_rank_{t}` of it with.
    fn own_dir(&self, dir: &Path) -> PathBuf {
        if self.tensor.size > 1 {
            checkpoint::tensor_rank_dir(dir, self.tensor.rank)
        } else {
            dir.to_path_buf()
        }
    }
}

/// Every stage's split parameters (over the pipeline group), by name: the whole model's.
fn whole_splits(
    own: &BTreeMap<String, TensorSplit>,
    pipeline: &dyn ProcessGroup,
) -> Result<BTreeMap<String, TensorSplit>, ZeroError> {
    let bytes = serde_json::to_vec(own).map_err(|e| ZeroError::Usage(format!("the stage's splits as JSON: {e}")))?;
    let mut whole = BTreeMap::new();
    for (s, part) in gather_bytes(pipeline, &bytes)?.iter().enumerate() {
        let splits: BTreeMap<String, TensorSplit> = serde_json::from_slice(part)
            .map_err(|e| ZeroError::Usage(format!("stage {s}'s tensor splits arrived unreadable: {e}")))?;
        whole.extend(splits);
    }
    Ok(whole)
}

/// Reads data rank `rank`'s owned slices of the groups `mine` of `whole` from the checkpoint.
fn read_stage(
    dir: &Path,
    tag: Option<&str>,
    whole: &PartitionLayout,
    mine: Range<usize>,
    rank: usize,
) -> Result<(CheckpointMeta, Vec<LoadedGroup>), CheckpointError> {
    let ckpt = Checkpoint::open(dir, tag)?;
    let sources = ckpt.meta.param_sources(&ckpt.meta_path(), &whole.params)?;
    let plan = plan_rank(&ckpt.meta.layout, whole, rank, Some(&sources));
    let mut readers = BTreeMap::new();
    for p in plan[mine.clone()].iter().flatten() {
        if let std::collections::btree_map::Entry::Vacant(slot) = readers.entry(p.file_rank) {
            slot.insert(ckpt.open_shard(p.file_rank)?);
        }
    }
    let names = &ckpt.meta.optimizer.state_names;
    let mut out = Vec::with_capacity(mine.len());
    for g in mine {
        let len = whole.owned_len(g);
        let mut group = LoadedGroup {
            master: vec![0.0; len],
            state: names.iter().map(|n| (n.clone(), vec![0.0; len])).collect(),
        };
        let kinds = std::iter::once((None, &mut group.master))
            .chain(group.state.iter_mut().map(|(n, b)| (Some(n.as_str()), b)));
        for (kind, buf) in kinds {
            for p in &plan[g] {
                let reader = readers
                    .get_mut(&p.file_rank)
                    .ok_or_else(|| CheckpointError::Usage(format!("no reader for rank {}'s file", p.file_rank)))?;
                let tensor = match kind {
                    None => checkpoint::format::master_tensor(p.group),
                    Some(name) => checkpoint::format::state_tensor(p.group, name),
                };
                reader.read_f32(&tensor, p.src.clone(), &mut buf[p.dst.clone()])?;
            }
        }
        out.push(group);
    }
    Ok((ckpt.meta, out))
}

/// Every stage's layout, over the pipeline group, laid end to end.
fn whole_layout(own: &PartitionLayout, pipeline: &dyn ProcessGroup) -> Result<WholeLayout, ZeroError> {
    let bytes = serde_json::to_vec(own).map_err(|e| ZeroError::Usage(format!("the stage's layout as JSON: {e}")))?;
    let mut whole = PartitionLayout {
        params: Vec::new(),
        groups: Vec::new(),
        world_size: own.world_size,
        alignment: own.alignment,
    };
    let mut ranges = Vec::new();
    for (s, part) in gather_bytes(pipeline, &bytes)?.iter().enumerate() {
        let layout: PartitionLayout = serde_json::from_slice(part)
            .map_err(|e| ZeroError::Usage(format!("stage {s}'s layout arrived unreadable: {e}")))?;
        if layout.world_size != own.world_size {
            return Err(ZeroError::Usage(format!(
                "stage {s} has {} data-parallel ranks, this stage {}",
                layout.world_size, own.world_size
            )));
        }
        let shift = whole.params.len();
        let start = whole.groups.len();
        whole.params.extend(layout.params);
        whole.groups.extend(layout.groups.into_iter().map(|mut g| {
            for p in &mut g.params {
                *p += shift;
            }
            g
        }));
        ranges.push(start..whole.groups.len());
    }
    Ok(WholeLayout {
        layout: whole,
        groups: ranges,
    })
}

/// Every rank's bytes, on every rank (small: a layout).
fn gather_bytes(group: &dyn ProcessGroup, bytes: &[u8]) -> Result<Vec<Vec<u8>>, ZeroError> {
    if group.world_size() == 1 {
        return Ok(vec![bytes.to_vec()]);
    }
    // Lengths and bytes travel as f32, exact below 2^24.
    if bytes.len() >= 1 << 24 {
        return Err(ZeroError::Usage(format!(
            "a stage's layout takes {} bytes as JSON, more than can be exchanged",
            bytes.len()
        )));
    }
    let lens = group.all_gather(FlatBuffer::F32(vec![bytes.len() as f32]))?.into_f32();
    let max = lens.iter().fold(1usize, |m, &l| m.max(l as usize));
    let mut mine: Vec<f32> = bytes.iter().map(|&b| f32::from(b)).collect();
    mine.resize(max, 0.0);
    let all = group.all_gather(FlatBuffer::F32(mine))?.into_f32();
    Ok(all
        .chunks(max)
        .zip(lens)
        .map(|(c, l)| c[..l as usize].iter().map(|&v| v as u8).collect())
        .collect())
}
