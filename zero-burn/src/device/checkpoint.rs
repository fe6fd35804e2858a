//! Checkpoints of the device state, in the sharded format of the host state.
//!
//! The device state lays its parameters out as the host state does, so its checkpoints are the
//! same files: each rank writes its fp32 master shard and optimizer state (copied to the host for
//! the write), rank 0 the metadata. A checkpoint saved with either state loads into the other,
//! at another world size or stage, and `zero to-fp32` consolidates it.

use super::optim::DeviceOptimizer;
use super::state::DeviceState;
use crate::error::ZeroError;
use crate::params::tensor_to_vec;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use std::path::Path;
use zero_core::checkpoint::{self, CheckpointMeta, LoadedGroup, SaveOptions, SaveRequest, Saved};

impl<I: Backend> DeviceState<I> {
    /// Saves the state under `dir/tag` (default tag `global_step{N}`), `client_state` in its
    /// metadata, then removes what `options` asks; every rank calls it after a step. Returns
    /// the tag directory and what was removed.
    pub(crate) fn save_checkpoint(
        &self,
        dir: &Path,
        tag: Option<&str>,
        client_state: &serde_json::Value,
        options: SaveOptions,
    ) -> Result<Saved, ZeroError> {
        let tag = tag
            .map(str::to_string)
            .unwrap_or_else(|| format!("global_step{}", self.global_step));
        let groups = self.host_copy();
        let request = SaveRequest {
            lineage: Some(&self.lineage),
            options,
            ..self.request(&groups, client_state)
        };
        Ok(checkpoint::save(self.host_group().as_ref(), dir, &tag, &request)?)
    }

    /// Writes the whole model's weights from rank 0, group by group (every rank calls this):
    /// each group's masters gathered over the ranks where they are sharded, in `dtype` (None:
    /// f32), named (or dropped) by `names`. At most one group's values are in host memory.
    pub(crate) fn save_weights(
        &self,
        path: &Path,
        dtype: Option<checkpoint::HalfDtype>,
        names: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ZeroError> {
        let host = self.host_group().clone();
        let mut export = (host.rank() == 0).then(|| checkpoint::GroupExport::create(path, &self.layout, dtype, names));
        for (g, (master, _)) in self.shards().enumerate() {
            // Every rank takes part in every gather, even after rank 0 failed to write, so that
            // the collectives stay matched; the failure is reported once all are done.
            let whole = match self.layout.groups[g].placement {
                zero_core::partition::Placement::Sharded if self.comm_world() > 1 => self.gather(master.clone())?,
                _ => master.clone(),
            };
            if let Some(Ok(e)) = &mut export {
                if let Err(err) = e.write_group(&tensor_to_vec(whole)) {
                    export = Some(Err(err));
                }
            }
        }
        let outcome = match export {
            Some(Ok(e)) => e.finish().map(|_| ()),
            Some(Err(e)) => Err(e),
            None => Ok(()),
        };
        Ok(checkpoint::agree(host.as_ref(), "save", outcome)?)
    }

    /// This rank's owned slices and their description, in host memory (the optimizer's record).
    /// A group without optimizer state yet (its parameters have not trained) holds no buffers.
    pub(crate) fn rank_state(&self) -> Result<(CheckpointMeta, Vec<LoadedGroup>), ZeroError> {
        let groups = self.host_copy();
        let request = self.request(&groups, &serde_json::Value::Null);
        let meta = checkpoint::describe(&request, self.host_group().world_size(), "record")?;
        Ok((meta, groups))
    }

    /// Every group's master shard and optimizer buffers (none for a group without optimizer
    /// state), copied to the host.
    fn host_copy(&self) -> Vec<LoadedGroup> {
        self.shards()
            .map(|(master, optimizer)| LoadedGroup {
                master: tensor_to_vec(master.clone()),
                state: optimizer
                    .map(DeviceOptimizer::state)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(name, t)| (name.to_string(), tensor_to_vec(t.clone())))
                    .collect(),
            })
            .collect()
    }

    /// The settings' optimizer's name in checkpoints.
    fn optimizer_name(&self) -> Result<&'static str, ZeroError> {
        DeviceOptimizer::<I>::check_spec(&self.settings.optimizer)
    }

    /// What a save of `groups` (this state's, copied to the host) is.
    fn request<'a>(&'a self, groups: &'a [LoadedGroup], client_state: &serde_json::Value) -> SaveRequest<'a> {
        // A group made late (unfrozen since) has taken fewer steps, one without optimizer state
        // none: each group's count, and the most of them.
        let group_steps: Vec<u64> = self
            .shards()
            .map(|(_, o)| o.map_or(0, DeviceOptimizer::step_count))
            .collect();
        SaveRequest {
            layout: &self.layout,
            groups: groups.iter().map(LoadedGroup::as_shard).collect(),
            stage: self.settings.stage.number(),
            global_step: self.global_step,
            skipped_steps: self.skipped_steps,
            optimizer_name: self.optimizer_name().map(str::to_string).unwrap_or_default(),
            optimizer_step: group_steps.iter().copied().max().unwrap_or(0),
            group_steps,
            lr_next: Some(self.settings.lr_at(self.global_step - self.skipped_steps)),
            loss_scaler: self.scaler_state(),
            rng: None,
            client_state: client_state.clone(),
            model: self.settings.model.clone(),
            tensor_parallel: self.tensor_parallel(),
            tensor_ranks: self.settings.tensor_parallel_group.as_deref(),
            lineage: None,
            options: SaveOptions::default(),
        }
    }

    /// Loads the checkpoint `dir/tag` (default: the tag in `dir/latest`), saved with either
    /// state at any world size and stage, and returns its client state. The state is replaced
    /// on every rank or on none.
    pub(crate) fn load_checkpoint(&mut self, dir: &Path, tag: Option<&str>) -> Result<serde_json::Value, ZeroError> {
        let group = self.host_group().clone();
        let (meta, loaded) = checkpoint::load(group.as_ref(), dir, tag, &self.layout)?;
        self.load_groups(meta, loaded)
    }

    /// Rebuilds the state from this rank's owned slices of the current layout (`loaded`,
    /// described by `meta`) and, only when every rank succeeded, replaces it. Returns the client
    /// state.
    pub(crate) fn load_groups(
        &mut self,
        meta: CheckpointMeta,
        loaded: Vec<LoadedGroup>,
    ) -> Result<serde_json::Value, ZeroError> {
        let group = self.host_group().clone();
        let device = self.device().clone();
        // Each group's steps: 0 for one whose parameters had not trained when saved, whose
        // state is made at its first step, as before the save.
        let steps = meta.group_steps(&self.layout);
        let rebuilt = (|| {
            let name = self.optimizer_name()?;
            if name != meta.optimizer.name {
                return Err(ZeroError::Config(format!(
                    "the checkpoint's optimizer is `{}` but this one is `{name}`",
                    meta.optimizer.name,
                )));
            }
            let mut out = Vec::with_capacity(loaded.len());
            for (gi, g) in loaded.iter().enumerate() {
                let restoring = |e: ZeroError| {
                    ZeroError::Optimizer(format!("restoring group {gi} from the checkpoint `{}`: {e}", meta.tag))
                };
                let n = g.master.len();
                let optimizer = if steps[gi] > 0 {
                    let segments = crate::optimizer_bridge::shard_segments(&self.layout, gi, group.rank());
                    let mut optimizer = DeviceOptimizer::from_spec(&self.settings.optimizer, n, &segments, &device)?;
                    // A record of a group without optimizer state holds no buffers: zeros.
                    let names: Vec<&str> = optimizer.state().into_iter().map(|(name, _)| name).collect();
                    let buffers = g.state_or_zeros(names);
                    optimizer.load_state(steps[gi], &buffers, &device).map_err(restoring)?;
                    Some(optimizer)
                } else {
                    None
                };
                let master = Tensor::from_data(TensorData::new(g.master.clone(), [n]), (&device, DType::F32));
                out.push((master, optimizer));
            }
            Ok(out)
        })();
        let groups = crate::checkpoint::all_ranks_or_none(group.as_ref(), rebuilt)?;
        self.restore(groups, meta.global_step, meta.skipped_steps, meta.loss_scaler);
        Ok(meta.client_state)
    }
}
