//! Saving and restoring the host state ([`EngineCore`]): `save_checkpoint` / `load_checkpoint`
//! of a [`crate::ZeroOptimizer`] whose state is in host memory, and the consolidated 16-bit save
//! of a running optimizer.
//!
//! The format, the crash-safe order of writes, the checksums and the re-cutting for another
//! world size or stage are `zero_core::checkpoint`'s; this file hands it the engine's flat state
//! (each group's owned fp32 masters and optimizer buffers) and puts what it reads back in place.
//!
//! With the state offloaded to NVMe, the save reads the masters and optimizer buffers back from
//! the swap file chunk by chunk and the load writes them into it; the files are those of an
//! in-memory engine, so a checkpoint moves freely between offloaded and in-memory training.
//! The shard writer and reader take whole slices, so for the length of a save or load the
//! rank's fp32 state is in host memory once (what an in-memory engine holds all the time).
//!
//! Resuming is exact: the masters, every optimizer buffer and step count, and the engine's step
//! (hence the learning-rate schedule's position) are restored bit for bit, and the accumulators
//! are empty at a boundary, so a resumed run computes what the uninterrupted run would have.
//!
//! ```ignore
//! optim.save_checkpoint("ckpt", None, &serde_json::json!({ "batch": 1200 }))?;
//! // ... later, at any world size and stage:
//! let (model, client_state) = optim.load_checkpoint("ckpt", None, model)?; // tag None: `latest`
//! ```

use crate::core::EngineCore;
use crate::error::ZeroError;
use crate::optimizer_bridge::OptimizerFactory;
use std::path::Path;
use zero_core::checkpoint::{
    self, agree, CheckpointError, GroupExport, GroupShard, HalfDtype, LoadedGroup, SaveOptions, SaveRequest, Saved,
};
use zero_core::comm::ProcessGroup;

/// Each group's master and optimizer buffers read back from the swap file for a save (`None`
/// for a group whose state is in memory): [`EngineCore::saved_state`].
pub(crate) struct SavedState(Vec<Option<Vec<Vec<f32>>>>);

/// What a rank rebuilt from a loaded checkpoint, once every rank knows that every rank
/// succeeded (so that all ranks replace their state, or none does); otherwise this rank's
/// error, or the error naming the rank that failed.
pub(crate) fn all_ranks_or_none<T>(comm: &dyn ProcessGroup, rebuilt: Result<T, ZeroError>) -> Result<T, ZeroError> {
    all_ranks_or_none_of(comm, "load", rebuilt)
}

/// [`all_ranks_or_none`] for `action` (`load`, `initialize`), as errors name it.
pub(crate) fn all_ranks_or_none_of<T>(
    comm: &dyn ProcessGroup,
    action: &'static str,
    rebuilt: Result<T, ZeroError>,
) -> Result<T, ZeroError> {
    let failed = rebuilt.as_ref().err().map(|e| e.to_string());
    let agreed = agree(
        comm,
        action,
        match failed {
            Some(m) => Err(CheckpointError::Usage(m)),
            None => Ok(()),
        },
    );
    match (rebuilt, agreed) {
        (Ok(o), Ok(())) => Ok(o),
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(e.into()),
    }
}

impl EngineCore {
    fn require_boundary(&self, what: &str) -> Result<(), ZeroError> {
        if self.micro_steps != 0 {
            return Err(ZeroError::Usage(format!(
                "{what} between accumulation boundaries ({} of {} micro-batches absorbed): call it after step()",
                self.micro_steps, self.settings.gradient_accumulation_steps
            )));
        }
        Ok(())
    }

    /// Every rank writes its shard; rank 0 the metadata and `latest`, then removes what
    /// `options` asks. Returns the tag directory and what was removed.
    pub(crate) fn save_checkpoint(
        &self,
        dir: &Path,
        tag: Option<&str>,
        client_state: &serde_json::Value,
        options: SaveOptions,
    ) -> Result<Saved, ZeroError> {
        self.require_boundary("save_checkpoint")?;
        let tag = tag
            .map(str::to_string)
            .unwrap_or_else(|| format!("global_step{}", self.global_step));
        self.with_request(client_state, options, |request| {
            Ok(checkpoint::save(self.comm.as_ref(), dir, &tag, request)?)
        })
    }

    /// This rank's owned slices and their description, in memory (the optimizer's record).
    pub(crate) fn rank_state(&self) -> Result<(checkpoint::CheckpointMeta, Vec<LoadedGroup>), ZeroError> {
        self.require_boundary("to_record")?;
        self.with_request(&serde_json::Value::Null, SaveOptions::default(), |request| {
            let meta = checkpoint::describe(request, self.comm.world_size(), "record")?;
            Ok((meta, request.groups.iter().map(GroupShard::copied).collect()))
        })
    }

    /// The state a save writes, with NVMe offload read back from the swap file chunk by chunk,
    /// group by group (the checkpoint is the same as an in-memory engine's). Every rank of
    /// `over` learns whether every rank could before any rank writes; `who` names this rank in
    /// the error (`rank 3`, `stage 1`).
    pub(crate) fn saved_state(&self, over: &dyn ProcessGroup, who: &str) -> Result<SavedState, ZeroError> {
        let swapped = (0..self.state.groups.len())
            .map(|gi| self.state.read_swapped_group(gi))
            .collect::<Result<Vec<_>, ZeroError>>()
            .map_err(|e| CheckpointError::Usage(format!("{who}: {e}")));
        Ok(SavedState(agree(over, "save", swapped)?))
    }

    /// Group `gi`'s owned master and optimizer buffers, by name: read back in `saved` (NVMe
    /// offload), else those in memory.
    pub(crate) fn group_shard<'a>(&'a self, saved: &'a SavedState, gi: usize) -> Result<GroupShard<'a>, ZeroError> {
        let g = &self.state.groups[gi];
        let names = g.optimizer.inner.state().into_iter().map(|(name, _)| name);
        Ok(match &saved.0[gi] {
            // No optimizer state yet: the save writes zeros.
            None if g.optimizer.is_dormant() => GroupShard {
                master: &g.master,
                state: Vec::new(),
            },
            None => GroupShard {
                master: &g.master,
                state: g.optimizer.inner.state(),
            },
            Some(buffers) => {
                if buffers.len() != 1 + names.len() {
                    return Err(ZeroError::Optimizer(format!(
                        "group {gi}'s swap file holds {} buffers, the optimizer has {}",
                        buffers.len().saturating_sub(1),
                        names.len()
                    )));
                }
                GroupShard {
                    master: &buffers[0],
                    state: names.zip(buffers[1..].iter().map(Vec::as_slice)).collect(),
                }
            }
        })
    }

    /// `f` of what a save of this state is: the layout, each group's owned slices
    /// ([`EngineCore::saved_state`]), the scalar state, the run's tags and `options`.
    fn with_request<R>(
        &self,
        client_state: &serde_json::Value,
        options: SaveOptions,
        f: impl FnOnce(&SaveRequest<'_>) -> Result<R, ZeroError>,
    ) -> Result<R, ZeroError> {
        let first = self.state.groups.first().map(|g| &g.optimizer.inner);
        // A group that has not trained yet (frozen) has taken no step: each group's count, and
        // the most of them.
        let group_steps: Vec<u64> = self
            .state
            .groups
            .iter()
            .map(|g| g.optimizer.inner.step_count())
            .collect();
        let saved = self.saved_state(self.comm.as_ref(), &format!("rank {}", self.comm.rank()))?;
        let groups = (0..self.state.groups.len())
            .map(|gi| self.group_shard(&saved, gi))
            .collect::<Result<Vec<_>, ZeroError>>()?;
        let request = SaveRequest {
            layout: &self.state.layout,
            groups,
            stage: self.settings.stage.number(),
            global_step: self.global_step,
            skipped_steps: self.skipped_steps,
            optimizer_name: first.map(|o| o.name().to_string()).unwrap_or_default(),
            optimizer_step: group_steps.iter().copied().max().unwrap_or(0),
            group_steps,
            lr_next: Some(self.settings.lr_at(self.global_step - self.skipped_steps)),
            // The engine keeps neither a loss scaler nor a random generator of its own yet.
            loss_scaler: self.scaler.as_ref().map(|s| s.state()),
            rng: None,
            client_state: client_state.clone(),
            model: self.settings.model.clone(),
            tensor_parallel: self.tensor_parallel.clone(),
            tensor_ranks: self.settings.tensor_parallel_group.as_deref(),
            lineage: Some(&self.lineage),
            options,
        };
        f(&request)
    }

    /// Reads this rank's new owned slices (from any world size and stage), rebuilds the
    /// optimizers from them, and only when every rank succeeded replaces the state. Returns the
    /// client state.
    pub(crate) fn load_checkpoint(&mut self, dir: &Path, tag: Option<&str>) -> Result<serde_json::Value, ZeroError> {
        self.require_boundary("load_checkpoint")?;
        let (meta, groups) = checkpoint::load(self.comm.as_ref(), dir, tag, &self.state.layout)?;
        self.load_groups(meta, groups)
    }

    /// Rebuilds the optimizers from this rank's owned slices of the current layout (`groups`,
    /// described by `meta`) and, only when every rank succeeded, replaces the state. Returns the
    /// client state.
    pub(crate) fn load_groups(
        &mut self,
        meta: checkpoint::CheckpointMeta,
        groups: Vec<LoadedGroup>,
    ) -> Result<serde_json::Value, ZeroError> {
        let comm = self.comm.clone();
        self.load_groups_over(meta, groups, comm.as_ref())
    }

    /// [`EngineCore::load_groups`], the state replaced only when every rank of `over` succeeded
    /// (a pipeline's whole world, whose stages are engines of their own).
    pub(crate) fn load_groups_over(
        &mut self,
        meta: checkpoint::CheckpointMeta,
        groups: Vec<LoadedGroup>,
        over: &dyn ProcessGroup,
    ) -> Result<serde_json::Value, ZeroError> {
        self.require_boundary("load")?;
        let rank = self.comm.rank();
        let factory = OptimizerFactory {
            spec: self.settings.optimizer.clone(),
        };
        let layout = &self.state.layout;
        let swapped = self.state.swapped();
        // Each group's steps: 0 for one whose parameters had not trained when saved (in
        // memory its optimizer stays dormant until its first gradient, as before the save).
        let steps = meta.group_steps(layout);
        let rebuilt = (|| {
            let mut optimizers = Vec::with_capacity(groups.len());
            for (gi, g) in groups.iter().enumerate() {
                let restoring = |e: String| {
                    ZeroError::Optimizer(format!("restoring group {gi} from the checkpoint `{}`: {e}", meta.tag))
                };
                let mut opt = if swapped {
                    factory.build_chunked(gi)?
                } else if steps[gi] > 0 || !self.state.tracks_trains() {
                    factory.build(layout, gi, rank)?
                } else {
                    factory.build_dormant()?
                };
                if opt.inner.name() != meta.optimizer.name {
                    return Err(ZeroError::Config(format!(
                        "the checkpoint's optimizer is `{}` but the engine's is `{}`",
                        meta.optimizer.name,
                        opt.inner.name()
                    )));
                }
                if opt.is_dormant() {
                    optimizers.push((opt, None));
                    continue;
                }
                // A record of a group without optimizer state holds no buffers: zeros.
                let state = g.state_or_zeros(opt.inner.state().into_iter().map(|(name, _)| name));
                if !swapped {
                    let buffers: Vec<(&str, &[f32])> = state.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
                    opt.inner
                        .load_state(steps[gi], &buffers)
                        .map_err(|e| restoring(e.to_string()))?;
                    optimizers.push((opt, None));
                    continue;
                }
                // Swapped: the buffers go to the swap file in the chunk optimizer's order.
                let mut order = Vec::new();
                for (name, _) in opt.inner.state() {
                    let (_, buffer) = state
                        .iter()
                        .find(|(n, _)| n == name)
                        .ok_or_else(|| restoring(format!("no `{name}` buffer in the checkpoint")))?;
                    if buffer.len() != g.master.len() {
                        return Err(restoring(format!(
                            "`{name}` has {} elements, the masters {}",
                            buffer.len(),
                            g.master.len()
                        )));
                    }
                    order.push(name);
                }
                opt.set_swapped_steps(steps[gi]);
                optimizers.push((opt, Some(order)));
            }
            Ok(optimizers)
        })();
        let optimizers = all_ranks_or_none(over, rebuilt)?;
        for (gi, (loaded, (optimizer, order))) in groups.into_iter().zip(optimizers).enumerate() {
            // The buffers moved out of what was loaded, in the swap file's order (zeros for a
            // group that held none).
            let state = order.map(|names| {
                let mut buffers = loaded.state;
                let n = loaded.master.len();
                names
                    .iter()
                    .map(|name| match buffers.iter().position(|(b, _)| b == name) {
                        Some(i) => std::mem::take(&mut buffers[i].1),
                        None => vec![0.0; n],
                    })
                    .collect()
            });
            self.state
                .restore_group(gi, loaded.master, optimizer, state, &self.memory)?;
        }
        self.state.reset_accumulators();
        self.micro_steps = 0;
        self.global_step = meta.global_step;
        self.skipped_steps = meta.skipped_steps;
        self.lineage.loaded_at(meta.global_step);
        if let (Some(scaler), Some(state)) = (self.scaler.as_mut(), meta.loss_scaler) {
            scaler.load_state(state);
        }
        Ok(meta.client_state)
    }

    /// Gathers group after group and lets rank 0 write the whole weights (`dtype` None: f32).
    pub(crate) fn save_weights(
        &self,
        path: &Path,
        dtype: Option<HalfDtype>,
        names: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ZeroError> {
        let writer = self.comm.rank() == 0;
        let mut export = if writer {
            Some(GroupExport::create(path, &self.state.layout, dtype, names))
        } else {
            None
        };
        for g in 0..self.state.layout.groups.len() {
            // Every rank takes part in every gather, even after rank 0 failed to write, so that
            // the collectives stay matched; the failure is reported once all are done.
            let values = self.gather_group(g)?;
            let failed = match &mut export {
                Some(Ok(e)) => e.write_group(&values).err(),
                _ => None,
            };
            if let Some(err) = failed {
                export = Some(Err(err));
            }
        }
        let outcome = match export {
            Some(Ok(e)) => e.finish().map(|_| ()),
            Some(Err(e)) => Err(e),
            None => Ok(()),
        };
        Ok(agree(self.comm.as_ref(), "save", outcome)?)
    }
}
