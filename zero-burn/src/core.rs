//! What every engine shares: the flat state, the process group, the step counters, and the
//! machinery that turns per-parameter gradients into reduced group gradients and updated
//! weights back into per-parameter values.

use crate::error::ZeroError;
use crate::flat_state::{FlatState, GradFlow};
use crate::memory::MemoryTracker;
use crate::optimizer_bridge::OptimizerFactory;
use crate::settings::EngineSettings;
use std::collections::HashMap;
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp, Work};
use zero_core::partition::{ParamPlace, PartitionLayout, Placement};

/// What one call to `step` did.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Learning rate used.
    pub lr: f64,
    /// Global L2 norm of the averaged gradient, before clipping.
    pub grad_norm: f64,
}

/// The shared state and logic of the engines.
pub(crate) struct EngineCore {
    pub state: FlatState,
    pub comm: Arc<dyn ProcessGroup>,
    pub settings: EngineSettings,
    pub places: Vec<ParamPlace>,
    pub memory: Arc<MemoryTracker>,
    /// Micro-batches absorbed since the last optimizer step.
    pub micro_steps: usize,
    /// Optimizer steps taken.
    pub global_step: u64,
    assembler: Assembler,
    in_flight: Vec<(usize, Work<FlatBuffer>)>,
}

impl EngineCore {
    pub fn new(
        layout: PartitionLayout,
        comm: Arc<dyn ProcessGroup>,
        settings: EngineSettings,
        flows: impl Fn(usize) -> GradFlow,
        values: impl FnMut(usize) -> Vec<f32>,
        memory: Arc<MemoryTracker>,
    ) -> Result<Self, ZeroError> {
        let factory = OptimizerFactory { spec: settings.optimizer.clone() };
        let state = FlatState::new(layout, comm.rank(), flows, &factory, values, &memory)?;
        let places = state.layout.places();
        let assembler = Assembler::new(&state.layout);
        Ok(EngineCore {
            state,
            comm,
            settings,
            places,
            memory,
            micro_steps: 0,
            global_step: 0,
            assembler,
            in_flight: Vec::new(),
        })
    }

    /// Takes one parameter's micro-batch gradient (`None`: the parameter was not used). When a
    /// group is complete it goes on: added to the accumulator, or reduce-scattered (in the
    /// background when `overlap_comm` is set).
    pub fn absorb(&mut self, param: usize, grad: Option<Vec<f32>>) -> Result<(), ZeroError> {
        let place = self.places[param];
        let group = &self.state.layout.groups[place.group];
        let n = self.state.layout.params[param].numel();
        if let Some(g) = &grad {
            if g.len() != n {
                let spec = &self.state.layout.params[param];
                return Err(ZeroError::Model(format!(
                    "parameter `{}` had shape {:?} ({} elements) at initialize but its gradient now has {} elements: \
                     parameters must keep their shapes for the engine's lifetime",
                    spec.name,
                    spec.shape,
                    n,
                    g.len()
                )));
            }
        }
        let Some(full) = self.assembler.put(place.group, group.padded, place.offset, n, grad) else {
            return Ok(());
        };
        self.memory.add_grads(full.len() * 4);
        match self.state.groups[place.group].flow {
            GradFlow::AccumulateThenReduce => {
                self.state.add_full(place.group, &full);
                self.memory.sub_grads(full.len() * 4);
            }
            GradFlow::ReduceThenAccumulate if self.comm.world_size() == 1 => {
                self.state.add_owned(place.group, &full);
                self.memory.sub_grads(full.len() * 4);
            }
            GradFlow::ReduceThenAccumulate => {
                let work = self.comm.reduce_scatter_async(FlatBuffer::F32(full), ReduceOp::Avg);
                self.in_flight.push((place.group, work));
                if self.settings.overlap_comm {
                    // Overlap, but never hold more than about two buckets of gradients in flight
                    // (DeepSpeed's reduce_bucket_size bounds this memory the same way).
                    let limit = 2 * self.settings.reduce_bucket_size.max(group.padded);
                    self.drain_to(limit)?;
                } else {
                    self.drain_to(0)?;
                }
            }
        }
        Ok(())
    }

    /// Waits for every reduction in flight and accumulates the results.
    pub fn drain(&mut self) -> Result<(), ZeroError> {
        self.drain_to(0)
    }

    /// Waits for the oldest reductions in flight until at most `limit` elements remain in
    /// flight, and accumulates their results.
    fn drain_to(&mut self, limit: usize) -> Result<(), ZeroError> {
        let mut in_flight: usize = self.in_flight.iter().map(|(g, _)| self.state.layout.groups[*g].padded).sum();
        while in_flight > limit && !self.in_flight.is_empty() {
            let (group, work) = self.in_flight.remove(0);
            let padded = self.state.layout.groups[group].padded;
            let shard = work.wait()?.into_f32();
            self.memory.sub_grads(padded * 4);
            self.state.add_owned(group, &shard);
            in_flight -= padded;
        }
        Ok(())
    }

    /// Ends a micro-batch: waits for its reductions and counts it.
    pub fn finish_micro_batch(&mut self) -> Result<(), ZeroError> {
        self.drain()?;
        if !self.assembler.is_empty() {
            return Err(ZeroError::Model(
                "some parameters of a group received no gradient call: the model's parameter list changed after initialize"
                    .into(),
            ));
        }
        self.micro_steps += 1;
        Ok(())
    }

    /// Whether enough micro-batches were absorbed for the optimizer step.
    pub fn at_boundary(&self) -> bool {
        self.micro_steps >= self.settings.gradient_accumulation_steps
    }

    /// The optimizer step on the owned masters (at a boundary).
    pub fn update(&mut self) -> Result<StepReport, ZeroError> {
        self.state.reduce_at_boundary(self.comm.as_ref())?;
        let lr = self.settings.lr_at(self.global_step);
        let grad_norm = self.state.update(self.comm.as_ref(), lr, self.settings.gradient_clipping)?;
        self.micro_steps = 0;
        self.global_step += 1;
        Ok(StepReport { step: self.global_step, lr, grad_norm })
    }

    /// The scale applied to every micro-batch loss before backward: the mean over the
    /// accumulated micro-batches.
    pub fn loss_scale(&self) -> f32 {
        1.0 / self.settings.gradient_accumulation_steps as f32
    }

    /// Every parameter's full value, in the order asked for: a group is gathered the first time
    /// one of its parameters is asked for and released after its last.
    pub fn value_source(&self) -> ValueSource<'_> {
        ValueSource { core: self, cache: HashMap::new(), error: None }
    }

    /// The full padded values of one group, from the owned masters.
    pub fn gather_group(&self, group: usize) -> Result<Vec<f32>, ZeroError> {
        let master = &self.state.groups[group].master;
        match self.state.layout.groups[group].placement {
            Placement::Sharded if self.comm.world_size() > 1 => {
                Ok(self.comm.all_gather(FlatBuffer::F32(master.clone()))?.into_f32())
            }
            _ => Ok(master.clone()),
        }
    }
}

/// Hands out parameter values group by group (see [`EngineCore::value_source`]).
pub(crate) struct ValueSource<'a> {
    core: &'a EngineCore,
    cache: HashMap<usize, (Vec<f32>, usize)>,
    /// The first collective error met; the values handed out after it are zeros.
    pub error: Option<ZeroError>,
}

impl ValueSource<'_> {
    /// The values of parameter `param`.
    pub fn take(&mut self, param: usize) -> Vec<f32> {
        let place = self.core.places[param];
        let n = self.core.state.layout.params[param].numel();
        if !self.cache.contains_key(&place.group) {
            let values = match self.core.gather_group(place.group) {
                Ok(v) => v,
                Err(e) => {
                    self.error.get_or_insert(e);
                    vec![0.0; self.core.state.layout.groups[place.group].padded]
                }
            };
            let count = self.core.state.layout.groups[place.group].params.len();
            self.cache.insert(place.group, (values, count));
        }
        let (values, remaining) = self.cache.get_mut(&place.group).map(|(v, r)| (v as &Vec<f32>, r)).unwrap_or_else(|| unreachable!());
        let out = values[place.offset..place.offset + n].to_vec();
        *remaining -= 1;
        if *remaining == 0 {
            self.cache.remove(&place.group);
        }
        out
    }

    /// The first error met, if any.
    pub fn finish(self) -> Result<(), ZeroError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Collects per-parameter gradients into whole group buffers.
struct Assembler {
    pending: HashMap<usize, (Vec<f32>, usize)>,
    sizes: Vec<usize>,
}

impl Assembler {
    fn new(layout: &PartitionLayout) -> Self {
        Assembler { pending: HashMap::new(), sizes: layout.groups.iter().map(|g| g.params.len()).collect() }
    }

    /// Puts one parameter's gradient in place; returns the group's buffer when it is complete.
    fn put(&mut self, group: usize, padded: usize, offset: usize, n: usize, grad: Option<Vec<f32>>) -> Option<Vec<f32>> {
        let entry = self.pending.entry(group).or_insert_with(|| (vec![0.0; padded], self.sizes[group]));
        if let Some(g) = grad {
            entry.0[offset..offset + n].copy_from_slice(&g[..n]);
        }
        entry.1 -= 1;
        if entry.1 == 0 {
            self.pending.remove(&group).map(|(buf, _)| buf)
        } else {
            None
        }
    }

    fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}
