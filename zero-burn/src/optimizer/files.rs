//! What [`ZeroOptimizer`] writes to and reads from files: the sharded checkpoint, and the
//! whole model's weights.

use super::state::State;
use super::view::first_device;
use super::{device, host, ZeroOptimizer};
use crate::error::ZeroError;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use zero_core::checkpoint::{SaveOptions, Saved};

impl ZeroOptimizer {
    /// Where this rank's files go under `dir`: with a tensor-parallel group, each tensor rank
    /// holds other slices of the model, so each has a directory of its own (`tensor_rank_{t}`),
    /// its data-parallel ranks writing there as without one.
    fn own_dir(&self, dir: &std::path::Path) -> std::path::PathBuf {
        match &self.settings.tensor_parallel_group {
            Some(t) if t.world_size() > 1 => dir.join(format!("tensor_rank_{}", t.rank())),
            _ => dir.to_path_buf(),
        }
    }

    /// With a tensor-parallel group, refuses a checkpoint `dir` holds that this run cannot take
    /// slice by slice ([`zero_core::checkpoint::check_tensor_degree`]).
    fn check_tensor_degree(&self, dir: &std::path::Path, tag: Option<&str>) -> Result<(), ZeroError> {
        let ranks = self
            .settings
            .tensor_parallel_group
            .as_ref()
            .map_or(1, |t| t.world_size());
        Ok(zero_core::checkpoint::check_tensor_degree(dir, tag, ranks)?)
    }

    /// Saves the optimizer's state (every rank's fp32 master shard and optimizer buffers, the
    /// step count) under `dir/tag` (tag None: `global_step{N}`), in the sharded checkpoint
    /// format; every rank calls this after a step. The module's weights are the masters
    /// rounded, so this is the whole training state. Returns the tag directory. With a
    /// tensor-parallel group, each tensor rank's state goes under `dir/tensor_rank_{t}`.
    ///
    /// A directory holding tags of another trajectory (saved after the step this optimizer's
    /// state was loaded at, by a run it does not continue: a run resumed from an older tag into
    /// the directory of the run that went on from it) is refused, naming them, before anything
    /// is written; [`ZeroOptimizer::save_checkpoint_with`] can discard them instead.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
    ) -> Result<std::path::PathBuf, ZeroError> {
        self.save_checkpoint_with(dir, tag, client_state, SaveOptions::default())
            .map(|saved| saved.tag_dir)
    }

    /// [`ZeroOptimizer::save_checkpoint`], with what the save does with the directory's other
    /// tags ([`SaveOptions`]): discard another trajectory's once this tag is published, keep
    /// only the newest `keep_last` (HuggingFace's `save_total_limit`). Returns the tag
    /// directory and, on rank 0, the tags removed.
    pub fn save_checkpoint_with(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
        options: SaveOptions,
    ) -> Result<Saved, ZeroError> {
        let split = self
            .settings
            .tensor_parallel_group
            .as_ref()
            .is_some_and(|t| t.world_size() > 1);
        zero_core::checkpoint::check_same_kind(dir.as_ref(), split)?;
        let dir = self.own_dir(dir.as_ref());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = guard.as_mut() {
            state.settle()?;
        }
        match guard.as_ref() {
            Some(State::Host(core)) => core.save_checkpoint(&dir, tag, client_state, options),
            Some(State::Device(state)) => state.save_checkpoint(&dir, tag, client_state, options),
            None => Err(ZeroError::Usage(
                "ZeroOptimizer::save_checkpoint before the first step: the state is built at the first step".into(),
            )),
        }
    }

    /// Writes the whole model's weights to one safetensors file from rank 0, gathered group by
    /// group from the fp32 masters (never the whole model in one rank's memory beyond the
    /// file's writer): `dtype` None is f32; `names` renames or drops parameters (their names in
    /// the layout; e.g. `NameMap::apply` for HuggingFace's). Every rank calls it, after a step.
    /// With a tensor-parallel group, each tensor rank writes its slices into a
    /// `tensor_rank_{t}` directory beside `path`'s file name.
    pub fn save_weights(
        &self,
        path: impl AsRef<std::path::Path>,
        dtype: Option<zero_core::checkpoint::HalfDtype>,
        names: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ZeroError> {
        let path = path.as_ref();
        let path = match (path.parent(), path.file_name()) {
            (Some(parent), Some(name)) => self.own_dir(parent).join(name),
            _ => path.to_path_buf(),
        };
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = guard.as_mut() {
            state.settle()?;
        }
        match guard.as_ref() {
            Some(State::Host(core)) => core.save_weights(&path, dtype, names),
            Some(State::Device(state)) => state.save_weights(&path, dtype, names),
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
    /// and the client state. Every file is verified before anything changes. With a
    /// tensor-parallel group, each tensor rank reads `dir/tensor_rank_{t}` (saved over as many
    /// tensor ranks; the data-parallel ranks may differ); a checkpoint saved over another number
    /// of tensor ranks is refused, and `zero to-fp32` makes a whole model of it.
    pub fn load_checkpoint<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        module: M,
    ) -> Result<(M, serde_json::Value), ZeroError> {
        self.check_tensor_degree(dir.as_ref(), tag)?;
        let dir = self.own_dir(dir.as_ref());
        // The checkpoint supersedes a record loaded and not yet applied.
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = guard.as_mut() {
            state.settle()?;
        }
        // A state built for this load takes the checkpoint's groups, where they fit.
        let mut meta = match guard.is_none() {
            true => zero_core::checkpoint::Checkpoint::open(&dir, tag).ok().map(|c| c.meta),
            false => None,
        };
        // Every rank builds the same layout: the checkpoint's only where every rank read it.
        if guard.is_none() && self.comm.world_size() > 1 {
            let mut unread = zero_core::comm::FlatBuffer::F32(vec![f32::from(meta.is_none())]);
            self.comm.all_reduce(&mut unread, zero_core::comm::ReduceOp::Max)?;
            if unread.into_f32()[0] > 0.0 {
                meta = None;
            }
        }
        let saved = meta.as_ref().map(|m| (&m.layout, m.stage));
        let view = self.ensure_state::<B, M>(&mut guard, &module, saved)?;
        match guard.as_mut().unwrap_or_else(|| unreachable!("just built")) {
            State::Host(core) => {
                let client = core.load_checkpoint(&dir, tag)?;
                // The loaded masters replace a delayed update's: every group is written below.
                core.owed = None;
                let device = first_device::<B, M>(&module)?;
                let every = vec![true; view.layout.groups.len()];
                Ok((
                    host::write_back::<B, M>(core, module, &device, &view.held, &every)?,
                    client,
                ))
            }
            state @ State::Device(_) => {
                let state = state.device::<B::InnerBackend>()?;
                view.check_unchanged(&state.layout)?;
                let client = state.load_checkpoint(&dir, tag)?;
                let every = vec![true; view.layout.groups.len()];
                Ok((device::write_back::<B, M>(state, module, &view, &every)?, client))
            }
        }
    }
}
