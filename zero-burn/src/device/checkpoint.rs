//! Checkpoints of the device engine, in the sharded format of the host engines.
//!
//! The device engine lays its parameters out as [`crate::ZeroEngine`] does, so its checkpoints
//! are the same files: each rank writes its fp32 master shard and Adam moments (copied to the
//! host for the write), rank 0 the metadata. A checkpoint saved by either engine loads into the
//! other, at another world size or stage, and `zero to-fp32` consolidates it.

use super::adam::DeviceAdam;
use super::engine::DeviceEngine;
use crate::error::ZeroError;
use crate::params::tensor_to_vec;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_core::checkpoint::{self, GroupShard, SaveRequest};
use zero_core::comm::ProcessGroup;

impl<B: AutodiffBackend, M: AutodiffModule<B>> DeviceEngine<B, M> {
    /// Saves a checkpoint under `dir/tag` (default tag `global_step{N}`), `client_state` in its
    /// metadata; every rank calls it, at an accumulation boundary. Returns the tag directory.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
    ) -> Result<PathBuf, ZeroError> {
        let group = self.checkpoint_group("save_checkpoint")?;
        let tag = tag
            .map(str::to_string)
            .unwrap_or_else(|| format!("global_step{}", self.global_step()));
        let (masters, states) = self.host_state();
        let groups = masters
            .iter()
            .zip(&states)
            .map(|(master, state)| GroupShard {
                master,
                state: state.iter().map(|(name, v)| (*name, v.as_slice())).collect(),
            })
            .collect();
        let first = self.optimizers().next();
        let request = SaveRequest {
            layout: self.layout(),
            groups,
            stage: self.settings().stage.number(),
            global_step: self.global_step(),
            optimizer_name: first.map(|o| o.name().to_string()).unwrap_or_default(),
            optimizer_step: first.map(DeviceAdam::step_count).unwrap_or(0),
            lr_next: Some(self.settings().lr_at(self.global_step())),
            loss_scaler: self.scaler_state(),
            rng: None,
            client_state: client_state.clone(),
            model: self.settings().model.clone(),
        };
        Ok(checkpoint::save(group.as_ref(), dir.as_ref(), &tag, &request)?)
    }

    /// Loads the checkpoint `dir/tag` (default: the tag in `dir/latest`), saved by this engine
    /// or a host engine at any world size and stage, and returns its client state. Every rank
    /// calls it, at an accumulation boundary; the state is replaced on every rank or on none.
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
    ) -> Result<serde_json::Value, ZeroError> {
        let group = self.checkpoint_group("load_checkpoint")?;
        let dir = dir.as_ref();
        let (meta, loaded) = checkpoint::load(group.as_ref(), dir, tag, self.layout())?;
        let device = self.device().clone();
        let rebuilt = (|| {
            let mut out = Vec::with_capacity(loaded.len());
            for (gi, g) in loaded.iter().enumerate() {
                let restoring = |e: ZeroError| {
                    ZeroError::Optimizer(format!("restoring group {gi} from the checkpoint `{}`: {e}", meta.tag))
                };
                let n = g.master.len();
                let mut optimizer = DeviceAdam::from_spec(&self.settings().optimizer, n, &device)?;
                if optimizer.name() != meta.optimizer.name {
                    return Err(ZeroError::Config(format!(
                        "the checkpoint's optimizer is `{}` but the engine's is `{}`",
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
        self.restore(groups, meta.global_step, meta.loss_scaler)?;
        Ok(meta.client_state)
    }

    /// The host group checkpoints travel over, at an accumulation boundary.
    fn checkpoint_group(&self, what: &str) -> Result<Arc<dyn ProcessGroup>, ZeroError> {
        let (absorbed, per_step) = self.micro_batches();
        if absorbed != 0 {
            return Err(ZeroError::Usage(format!(
                "{what} between accumulation boundaries ({absorbed} of {per_step} micro-batches absorbed): call it \
                 after step()"
            )));
        }
        self.collective().host_group().ok_or_else(|| {
            ZeroError::Usage(format!(
                "{what}: this engine's DeviceCollective has no host process group to write checkpoints over \
                 (HostStaged and NcclDevice have one)"
            ))
        })
    }

    /// Every group's fp32 master shard and optimizer state, copied to the host.
    #[allow(clippy::type_complexity)]
    fn host_state(&self) -> (Vec<Vec<f32>>, Vec<Vec<(&'static str, Vec<f32>)>>) {
        let masters = self.masters().map(|m| tensor_to_vec(m.clone())).collect();
        let states = self
            .optimizers()
            .map(|o| {
                o.state()
                    .into_iter()
                    .map(|(name, t)| (name, tensor_to_vec(t.clone())))
                    .collect()
            })
            .collect();
        (masters, states)
    }
}
