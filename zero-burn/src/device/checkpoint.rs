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
use std::path::{Path, PathBuf};
use zero_core::checkpoint::{self, GroupShard, SaveRequest};

impl<I: Backend> DeviceState<I> {
    /// Saves the state under `dir/tag` (default tag `global_step{N}`), `client_state` in its
    /// metadata; every rank calls it after a step. Returns the tag directory.
    pub(crate) fn save_checkpoint(
        &self,
        dir: &Path,
        tag: Option<&str>,
        client_state: &serde_json::Value,
    ) -> Result<PathBuf, ZeroError> {
        let tag = tag
            .map(str::to_string)
            .unwrap_or_else(|| format!("global_step{}", self.global_step));
        let (masters, states): (Vec<_>, Vec<_>) = self
            .shards()
            .map(|(master, optimizer)| {
                let state: Vec<(&str, Vec<f32>)> = optimizer
                    .state()
                    .into_iter()
                    .map(|(name, t)| (name, tensor_to_vec(t.clone())))
                    .collect();
                (tensor_to_vec(master.clone()), state)
            })
            .unzip();
        let groups = masters
            .iter()
            .zip(&states)
            .map(|(master, state)| GroupShard {
                master,
                state: state.iter().map(|(name, v)| (*name, v.as_slice())).collect(),
            })
            .collect();
        let first = self.shards().next().map(|(_, o)| o);
        let request = SaveRequest {
            layout: &self.layout,
            groups,
            stage: self.settings.stage.number(),
            global_step: self.global_step,
            optimizer_name: first.map(|o| o.name().to_string()).unwrap_or_default(),
            optimizer_step: first.map(DeviceOptimizer::step_count).unwrap_or(0),
            lr_next: Some(self.settings.lr_at(self.global_step - self.skipped_steps)),
            loss_scaler: self.scaler_state(),
            rng: None,
            client_state: client_state.clone(),
            model: self.settings.model.clone(),
        };
        Ok(checkpoint::save(self.host_group().as_ref(), dir, &tag, &request)?)
    }

    /// Loads the checkpoint `dir/tag` (default: the tag in `dir/latest`), saved with either
    /// state at any world size and stage, and returns its client state. The state is replaced
    /// on every rank or on none.
    pub(crate) fn load_checkpoint(&mut self, dir: &Path, tag: Option<&str>) -> Result<serde_json::Value, ZeroError> {
        let group = self.host_group().clone();
        let (meta, loaded) = checkpoint::load(group.as_ref(), dir, tag, &self.layout)?;
        let device = self.device().clone();
        let rebuilt = (|| {
            let mut out = Vec::with_capacity(loaded.len());
            for (gi, g) in loaded.iter().enumerate() {
                let restoring = |e: ZeroError| {
                    ZeroError::Optimizer(format!("restoring group {gi} from the checkpoint `{}`: {e}", meta.tag))
                };
                let n = g.master.len();
                let mut optimizer = DeviceOptimizer::from_spec(&self.settings.optimizer, n, &device)?;
                if optimizer.name() != meta.optimizer.name {
                    return Err(ZeroError::Config(format!(
                        "the checkpoint's optimizer is `{}` but this one is `{}`",
                        meta.optimizer.name,
                        optimizer.name()
                    )));
                }
                optimizer
                    .load_state(meta.optimizer.step, &g.state, &device)
                    .map_err(restoring)?;
                let master = Tensor::from_data(TensorData::new(g.master.clone(), [n]), (&device, DType::F32));
                out.push((master, optimizer));
            }
            Ok(out)
        })();
        let groups = crate::checkpoint::all_ranks_or_none(group.as_ref(), rebuilt)?;
        self.restore(groups, meta.global_step, meta.loss_scaler);
        Ok(meta.client_state)
    }
}
