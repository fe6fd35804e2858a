//! What [`ZeroOptimizer`] writes to and reads from files: the sharded checkpoint, and the
//! whole model's weights.

use super::state::State;
use super::view::first_device;
use super::{device, host, ZeroOptimizer};
use crate::error::ZeroError;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;

impl ZeroOptimizer {
    /// Saves the optimizer's state (every rank's fp32 master shard and optimizer buffers, the
    /// step count) under `dir/tag` (tag None: `global_step{N}`), in the sharded checkpoint
    /// format; every rank calls this after a step. The module's weights are the masters
    /// rounded, so this is the whole training state. Returns the tag directory.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
    ) -> Result<std::path::PathBuf, ZeroError> {
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_ref() {
            Some(State::Host(core)) => core.save_checkpoint(dir.as_ref(), tag, client_state),
            Some(State::Device(state)) => state.save_checkpoint(dir.as_ref(), tag, client_state),
            None => Err(ZeroError::Usage(
                "ZeroOptimizer::save_checkpoint before the first step: the state is built at the first step".into(),
            )),
        }
    }

    /// Writes the whole model's weights to one safetensors file from rank 0, gathered group by
    /// group from the fp32 masters (never the whole model in one rank's memory beyond the
    /// file's writer): `dtype` None is f32; `names` renames or drops parameters (their names in
    /// the layout; e.g. `NameMap::apply` for HuggingFace's). Every rank calls it, after a step.
    pub fn save_weights(
        &self,
        path: impl AsRef<std::path::Path>,
        dtype: Option<zero_core::checkpoint::HalfDtype>,
        names: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ZeroError> {
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_ref() {
            Some(State::Host(core)) => core.save_weights(path.as_ref(), dtype, names),
            Some(State::Device(state)) => state.save_weights(path.as_ref(), dtype, names),
            None => Err(ZeroError::Usage(
                "ZeroOptimizer::save_weights before the first step: the state is built at the first step".into(),
            )),
        }
    }

    /// DeepSpeed's `save_16bit_model` (`stage3_gather_16bit_weights_on_model_save`): the whole
    /// model in 16 bits, under its layout names ([`ZeroOptimizer::save_weights`]).
    pub fn save_16bit_model(
        &self,
        path: impl AsRef<std::path::Path>,
        dtype: zero_core::checkpoint::HalfDtype,
    ) -> Result<(), ZeroError> {
        self.save_weights(path, Some(dtype), &|name| Some(name.to_string()))
    }

    /// Restores the state saved by [`ZeroOptimizer::save_checkpoint`] (or by an engine, at any
    /// world size and stage) for `module`, and returns the module with the restored weights
    /// and the client state. Every file is verified before anything changes.
    pub fn load_checkpoint<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        module: M,
    ) -> Result<(M, serde_json::Value), ZeroError> {
        // The checkpoint supersedes a record loaded and not yet applied.
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let view = self.ensure_state::<B, M>(&mut guard, &module)?;
        match guard.as_mut().unwrap_or_else(|| unreachable!("just built")) {
            State::Host(core) => {
                let client = core.load_checkpoint(dir.as_ref(), tag)?;
                let device = first_device::<B, M>(&module)?;
                Ok((host::write_back::<B, M>(core, module, &device, &view.held)?, client))
            }
            state @ State::Device(_) => {
                let state = state.device::<B::InnerBackend>()?;
                view.check_unchanged(&state.layout)?;
                let client = state.load_checkpoint(dir.as_ref(), tag)?;
                Ok((device::write_back::<B, M>(state, module, &view)?, client))
            }
        }
    }
}
