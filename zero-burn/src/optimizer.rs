//! [`ZeroOptimizer`]: ZeRO behind Burn's `Optimizer` trait, for code written against Burn's
//! optimizers (a custom loop, burn-train's `Learner`).
//!
//! Each rank runs its own forward and backward on its replica, as with any Burn optimizer, and
//! hands the gradients to `step`. There they are averaged over the ranks (all-reduce at stage 0,
//! reduce-scatter at stages 1 and 2), the rank's fp32 shard is updated, and the new weights are
//! gathered back into the module. The learning rate is the one Burn's loop passes; gradient
//! accumulation is the loop's (Burn's `GradientsAccumulator`): every `step` is a boundary.

use crate::core::{EngineCore, StepReport};
use crate::engine::{broadcast_values, replicated_layout};
use crate::error::ZeroError;
use crate::flat_state::GradFlow;
use crate::half_buffer;
use crate::memory::{MemoryReport, MemoryTracker};
use crate::params::{describe, write_data};
use crate::settings::{ComputeDtype, EngineSettings, Stage};
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use std::sync::{Arc, Mutex};
use zero_core::comm::ProcessGroup;

/// ZeRO stages 0-2 as a `burn::optim::Optimizer`.
///
/// Burn's `Optimizer::step` cannot return an error, so a failed collective (a dead or diverging
/// peer) panics with the error's message, on every surviving rank; use [`crate::ZeroEngine`] for
/// a `Result`-returning loop. Clones share one state: the optimizer is one per rank.
///
/// Its Burn record is empty: Burn's own checkpointing of the optimizer (`to_record`) does not
/// carry the sharded Adam state. Resumable training goes through
/// [`ZeroOptimizer::save_checkpoint`] / [`ZeroOptimizer::load_checkpoint`] (the engines' sharded
/// format, loadable by them and at another world size).
#[derive(Clone)]
pub struct ZeroOptimizer {
    settings: EngineSettings,
    comm: Arc<dyn ProcessGroup>,
    core: Arc<Mutex<Option<EngineCore>>>,
    last: Arc<Mutex<Option<StepReport>>>,
}

impl ZeroOptimizer {
    /// A ZeRO optimizer over `comm` (stage 0, 1 or 2 from `settings`). The flat state is built at
    /// the first step, from the module passed to it. Every rank must start from the same weights:
    /// build the model from one seed, or call [`ZeroOptimizer::synchronize`] first.
    pub fn new(settings: EngineSettings, comm: Arc<dyn ProcessGroup>) -> Result<Self, ZeroError> {
        if settings.stage == Stage::Zero3 {
            return Err(ZeroError::Config(
                "ZeroOptimizer supports stages 0-2; stage 3 partitions the parameters themselves and needs \
                 zero_burn::ChainEngine with a ChainModel"
                    .into(),
            ));
        }
        if settings.precision.dtype == ComputeDtype::F16 {
            return Err(ZeroError::Config(
                "fp16.enabled: fp16 needs its loss scaled before backward, which Burn's loop runs outside the \
                 optimizer; use zero_burn::ZeroEngine or ChainEngine for fp16, or bf16 (no loss scale) here"
                    .into(),
            ));
        }
        Ok(ZeroOptimizer {
            settings,
            comm,
            core: Arc::new(Mutex::new(None)),
            last: Arc::new(Mutex::new(None)),
        })
    }

    /// Rank 0's weights, on every rank, in the compute dtype (bf16 parameters under bf16).
    pub fn synchronize<B: AutodiffBackend, M: AutodiffModule<B>>(&self, module: M) -> Result<M, ZeroError> {
        let layout = replicated_layout::<B, M>(&module, &self.settings, self.comm.world_size());
        let values = broadcast_values::<B, M>(&module, &layout, self.comm.as_ref())?;
        let device = first_device::<B, M>(&module)?;
        let dtype = self.settings.precision.dtype;
        Ok(write_data(module, &device, true, |i, shape| {
            half_buffer::f32_to_data(values[i].clone(), shape, dtype)
        }))
    }

    /// What the last step did (its gradient norm, learning rate).
    pub fn last_step(&self) -> Option<StepReport> {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes held by this rank, by kind (zero before the first step).
    pub fn memory(&self) -> MemoryReport {
        let core = self.core.lock().unwrap_or_else(|e| e.into_inner());
        core.as_ref().map(|c| c.memory.report()).unwrap_or_default()
    }

    /// Saves the optimizer's state (every rank's fp32 master shard and optimizer buffers, the
    /// step count) under `dir/tag` (tag None: `global_step{N}`), in the engines' sharded format;
    /// every rank calls this after a step. The module's weights are the masters rounded, so this
    /// is the whole training state. Returns the tag directory.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        client_state: &serde_json::Value,
    ) -> Result<std::path::PathBuf, ZeroError> {
        let guard = self.core.lock().unwrap_or_else(|e| e.into_inner());
        let core = guard.as_ref().ok_or_else(|| {
            ZeroError::Usage(
                "ZeroOptimizer::save_checkpoint before the first step: the state is built at the first step".into(),
            )
        })?;
        core.save_checkpoint(dir.as_ref(), tag, client_state)
    }

    /// Restores the state saved by [`ZeroOptimizer::save_checkpoint`] (or by an engine, at any
    /// world size and stage 0-2) for `module`, and returns the module with the restored weights
    /// and the client state. Every file is verified before anything changes.
    pub fn load_checkpoint<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        module: M,
    ) -> Result<(M, serde_json::Value), ZeroError> {
        let device = first_device::<B, M>(&module)?;
        let mut guard = self.core.lock().unwrap_or_else(|e| e.into_inner());
        self.ensure_core::<B, M>(&mut guard, &module)?;
        let core = guard.as_mut().unwrap_or_else(|| unreachable!("just built"));
        let client = core.load_checkpoint(dir.as_ref(), tag)?;
        let mut source = core.value_source();
        let module = write_data(module, &device, true, |i, _| source.take_data(i));
        source.finish()?;
        Ok((module, client))
    }

    /// Builds the flat state from `module` if this is its first use.
    fn ensure_core<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        guard: &mut Option<EngineCore>,
        module: &M,
    ) -> Result<(), ZeroError> {
        if guard.is_none() {
            crate::sharded::refuse_zero_modules::<B, M>(module, "ZeroOptimizer")?;
            let layout = replicated_layout::<B, M>(module, &self.settings, self.comm.world_size());
            let mut values = vec![Vec::new(); layout.params.len()];
            let dtype = self.settings.precision.dtype;
            crate::params::read_values::<B, M>(module, |i, mut v| {
                half_buffer::round_to(dtype, &mut v);
                values[i] = v
            });
            let memory = Arc::new(MemoryTracker::default());
            memory.add_parameters(layout.numel() * dtype.size());
            let flow = if self.settings.stage == Stage::Zero2 {
                GradFlow::ReduceThenAccumulate
            } else {
                GradFlow::AccumulateThenReduce
            };
            let mut settings = self.settings.clone();
            settings.gradient_accumulation_steps = 1;
            *guard = Some(EngineCore::new(
                layout,
                self.comm.clone(),
                settings,
                |_| flow,
                |i| std::mem::take(&mut values[i]),
                memory,
            )?);
        }
        Ok(())
    }

    fn try_step<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        lr: f64,
        module: M,
        mut take: impl FnMut(burn::module::ParamId) -> Option<Vec<f32>>,
    ) -> Result<M, ZeroError> {
        let device = first_device::<B, M>(&module)?;
        let mut guard = self.core.lock().unwrap_or_else(|e| e.into_inner());
        self.ensure_core::<B, M>(&mut guard, &module)?;
        let core = guard.as_mut().unwrap_or_else(|| unreachable!());
        // Burn's loop owns the schedule: use its learning rate for this step.
        let fixed = lr;
        core.settings.lr_schedule = Some(Arc::new(move |_| fixed));
        for (i, (id, _)) in describe::<B, M>(&module).into_iter().enumerate() {
            core.absorb(i, take(id))?;
        }
        core.finish_micro_batch()?;
        let report = core.update()?;
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
        let mut source = core.value_source();
        let module = write_data(module, &device, true, |i, _| source.take_data(i));
        source.finish()?;
        Ok(module)
    }
}

fn first_device<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Result<B::Device, ZeroError> {
    module
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| ZeroError::Model("the model has no parameters (no device found)".into()))
}

/// Takes every float parameter's gradient out of a `GradientsParams`, by id.
fn collect_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
) -> std::collections::HashMap<burn::module::ParamId, Vec<f32>> {
    struct Collect<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        out: std::collections::HashMap<burn::module::ParamId, Vec<f32>>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.out.insert(param.id, crate::params::tensor_to_vec(g));
            }
        }
    }
    let mut c = Collect::<B> {
        grads,
        out: Default::default(),
        _b: std::marker::PhantomData,
    };
    module.visit(&mut c);
    c.out
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Optimizer<M, B> for ZeroOptimizer {
    type Record = ();

    fn step(&mut self, lr: f64, module: M, mut grads: GradientsParams) -> M {
        let mut by_id = collect_grads::<B, M>(&module, &mut grads);
        match self.try_step::<B, M>(lr, module, |id| by_id.remove(&id)) {
            Ok(m) => m,
            Err(e) => panic!("ZeRO optimizer step failed: {e}"),
        }
    }

    fn step_multi(&mut self, lr: f64, module: M, mut grads: MultiGradientsParams) -> M {
        // Gradients from several devices of this rank: sum them per parameter first.
        let mut summed: std::collections::HashMap<burn::module::ParamId, Vec<f32>> = Default::default();
        for (g, _) in grads.grads.iter_mut() {
            for (id, v) in collect_grads::<B, M>(&module, g) {
                match summed.get_mut(&id) {
                    Some(acc) => acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b),
                    None => {
                        summed.insert(id, v);
                    }
                }
            }
        }
        match self.try_step::<B, M>(lr, module, |id| summed.remove(&id)) {
            Ok(m) => m,
            Err(e) => panic!("ZeRO optimizer step failed: {e}"),
        }
    }

    fn to_record(&self) -> Self::Record {}

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }
}
