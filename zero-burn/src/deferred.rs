//! The offloaded optimizer step, moved out of `step()` and overlapped with the next forward.
//!
//! With the optimizer on the CPU, the update of a rank's fp32 shard is local work that nothing
//! needs until the next forward reads a part's weights. `step()` keeps everything that decides
//! the step (the reductions, the global norm, the clipping coefficient, fp16's overflow check,
//! the learning rate) and hands the groups of each part, with their reduced gradients, to one
//! background thread, in the order the next forward uses the parts. The forward waits for a
//! part's update just before that part's weights are needed, so the update of block k + 1 runs
//! while block k computes.
//!
//! The background thread runs no collective: a rank waiting for it waits on its own CPU work
//! only, never on a peer, so the forward's gathers cannot deadlock against it. Each group goes
//! through the same operations as in the synchronous step ([`step_lent_group`]), so the new
//! weights are the same in every bit; only the time they are computed moves.
//!
//! While a part is away, its groups in the state are stand-ins without values
//! ([`FlatState::lend`]): whatever reads weights or optimizer state waits for its return first.

use crate::error::ZeroError;
use crate::flat_state::{step_lent_group, FlatState, GroupState};
use crate::half_buffer;
use crate::memory::MemoryTracker;
use crate::settings::ComputeDtype;
use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use zero_core::comm::ProcessGroup;
use zero_core::optim::CpuPool;

/// One group handed to the background thread: its state and its reduced gradient, not yet
/// unscaled nor clipped (f32, the rank's owned range).
pub(crate) struct LentGroup {
    /// The group's index in the layout.
    pub index: usize,
    /// Its masters, optimizer and parameter shard.
    pub state: GroupState,
    /// Its gradient.
    pub grad: Vec<f32>,
    /// Elements of its next gradient accumulator, zeroed by the background thread once the
    /// gradient is freed (so that the forward does not spend the time, nor holds both).
    pub accumulator_len: usize,
}

/// The groups of one part, updated one after the other.
pub(crate) struct PartUpdate {
    /// The part (0: the ends, `b + 1`: block `b`).
    pub part: usize,
    /// Its groups.
    pub groups: Vec<LentGroup>,
}

/// One optimizer step handed to the background thread.
pub(crate) struct StepUpdate {
    /// The parts, in the order the next forward needs them.
    pub parts: Vec<PartUpdate>,
    /// The optimizer step (1-based), for the errors.
    pub step: u64,
    /// Unscaling times clipping, applied to every gradient.
    pub coef: f32,
    /// The learning rate.
    pub lr: f64,
    /// The optimizer's thread pool.
    pub pool: Option<Arc<CpuPool>>,
    /// The data-parallel group: the optimizers stepped here never use it (no collective inside
    /// their step, see [`FlatState::can_defer`]); the step's signature asks for one.
    pub comm: Arc<dyn ProcessGroup>,
    /// Memory accounting: the f32 gradient copy of a 16-bit run is freed group by group.
    pub memory: Arc<MemoryTracker>,
    /// Whether the gradients are a copy counted in `memory` (16-bit accumulators).
    pub counted_copy: bool,
    /// The accumulators' dtype.
    pub accumulate: ComputeDtype,
}

/// A part back from the background thread.
struct PartDone {
    part: usize,
    groups: Vec<(usize, GroupState)>,
    result: Result<(), ZeroError>,
}

/// Parts not yet updated, shared with the background thread so that a reader holding only
/// `&self` can wait for the thread to be idle.
type Unfinished = Arc<(Mutex<usize>, Condvar)>;

/// The update of the last step's parts, running or finished, and what is not collected yet.
pub(crate) struct DeferredUpdates {
    /// Each part's name, for errors ("the ends", "block 3").
    names: Vec<String>,
    /// The groups of each part.
    part_groups: Vec<Vec<usize>>,
    /// Parts handed over and not yet collected, in the order they come back.
    pending: VecDeque<usize>,
    results: Option<Mutex<mpsc::Receiver<PartDone>>>,
    worker: Option<JoinHandle<()>>,
    unfinished: Unfinished,
    /// Set when a part's groups can never come back: every later call fails with it.
    lost: Option<String>,
    /// The first error of a collected part, until a wait returns it.
    unreported: Option<ZeroError>,
}

impl DeferredUpdates {
    /// Deferred updates of the parts `parts` (name, groups), which must cover every group once.
    pub fn new(parts: Vec<(String, Vec<usize>)>) -> Self {
        let (names, part_groups) = parts.into_iter().unzip();
        DeferredUpdates {
            names,
            part_groups,
            pending: VecDeque::new(),
            results: None,
            worker: None,
            unfinished: Arc::new((Mutex::new(0), Condvar::new())),
            lost: None,
            unreported: None,
        }
    }

    /// The groups of each part, in the order the forward uses the parts.
    pub fn part_groups(&self) -> &[Vec<usize>] {
        &self.part_groups
    }

    /// Whether some part's update is not collected yet.
    pub fn any_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether `part`'s update is not collected yet.
    pub fn is_pending(&self, part: usize) -> bool {
        self.pending.contains(&part)
    }

    /// Whether a new update can be launched: the last one is collected and nothing was lost.
    /// Checked before the groups are lent, since a refused launch would drop them.
    pub fn ready(&self) -> Result<(), ZeroError> {
        self.check_usable()?;
        if !self.pending.is_empty() {
            return Err(ZeroError::Usage(
                "an optimizer step started while the last one's update was still running in the background".into(),
            ));
        }
        Ok(())
    }

    /// Starts the background update of `update.parts` (see [`DeferredUpdates::ready`]).
    pub fn launch(&mut self, update: StepUpdate) -> Result<(), ZeroError> {
        self.ready()?;
        if let Some(worker) = self.worker.take() {
            // It sent its last part already; this only reaps the thread.
            let _ = worker.join();
        }
        let (sender, receiver) = mpsc::channel();
        let parts: VecDeque<usize> = update.parts.iter().map(|p| p.part).collect();
        *lock(&self.unfinished.0) = update.parts.len();
        let names = self.names.clone();
        let unfinished = self.unfinished.clone();
        let spawned = std::thread::Builder::new()
            .name("zero-offload-step".into())
            .spawn(move || run(update, &names, &sender, &unfinished));
        match spawned {
            Ok(handle) => {
                self.pending = parts;
                self.results = Some(Mutex::new(receiver));
                self.worker = Some(handle);
                Ok(())
            }
            Err(e) => {
                // The closure, and the groups in it, are gone with the failed spawn.
                *lock(&self.unfinished.0) = 0;
                let message = format!("the optimizer's background thread could not start ({e}); the state is lost");
                self.lost = Some(message.clone());
                Err(ZeroError::Optimizer(message))
            }
        }
    }

    /// Collects the updates up to `part`'s (they come back in order) into `state`. An error of
    /// a part collected here or by an earlier [`DeferredUpdates::poll`] is returned, naming the
    /// part; the groups are back either way.
    pub fn wait_for(&mut self, part: usize, state: &mut FlatState) -> Result<(), ZeroError> {
        self.check_usable()?;
        while self.pending.contains(&part) {
            let done = {
                let Some(results) = &self.results else { break };
                let receiver = results.lock().unwrap_or_else(PoisonError::into_inner);
                receiver.recv()
            };
            match done {
                Ok(done) => self.collect(done, state),
                Err(_) => return Err(self.lose()),
            }
        }
        match self.unreported.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Collects every update.
    pub fn wait_all(&mut self, state: &mut FlatState) -> Result<(), ZeroError> {
        match self.pending.back().copied() {
            Some(last) => self.wait_for(last, state),
            None => {
                self.check_usable()?;
                match self.unreported.take() {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            }
        }
    }

    /// Collects the updates already finished, without waiting; their errors wait for the next
    /// [`DeferredUpdates::wait_for`].
    pub fn poll(&mut self, state: &mut FlatState) {
        if self.lost.is_some() {
            return;
        }
        loop {
            let next = {
                let Some(results) = &self.results else { break };
                let receiver = results.lock().unwrap_or_else(PoisonError::into_inner);
                receiver.try_recv()
            };
            match next {
                Ok(done) => self.collect(done, state),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if !self.pending.is_empty() {
                        let e = self.lose();
                        self.unreported.get_or_insert(e);
                    }
                    break;
                }
            }
        }
    }

    /// Waits until the background thread has finished every part (collecting nothing): for
    /// readers that hold only `&self` and read counters the thread updates (memory).
    pub fn wait_idle(&self) {
        let (count, idle) = &*self.unfinished;
        let mut left = lock(count);
        while *left > 0 {
            left = idle.wait(left).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Puts one finished part's groups back and keeps its error for the next wait.
    fn collect(&mut self, done: PartDone, state: &mut FlatState) {
        self.pending.retain(|&p| p != done.part);
        for (index, group) in done.groups {
            state.give_back(index, group);
        }
        if let Err(e) = done.result {
            self.unreported.get_or_insert(e);
        }
    }

    /// The background thread stopped without returning every part: the state is incomplete for
    /// good.
    fn lose(&mut self) -> ZeroError {
        let parts: Vec<&str> = self.pending.iter().map(|&p| self.names[p].as_str()).collect();
        let message = format!(
            "the optimizer's background thread stopped without returning {}; their state is lost, rebuild the \
             engine (e.g. from the last checkpoint)",
            parts.join(", ")
        );
        self.pending.clear();
        self.lost = Some(message.clone());
        ZeroError::Optimizer(message)
    }

    fn check_usable(&self) -> Result<(), ZeroError> {
        match &self.lost {
            Some(message) => Err(ZeroError::Optimizer(message.clone())),
            None => Ok(()),
        }
    }
}

impl Drop for DeferredUpdates {
    fn drop(&mut self) {
        // The thread finishes the part in hand and stops at the closed channel; wait for it so
        // that no update outlives the engine.
        self.results = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The background thread: each part's groups, stepped in order and sent back.
fn run(update: StepUpdate, names: &[String], sender: &mpsc::Sender<PartDone>, unfinished: &Unfinished) {
    let StepUpdate {
        parts,
        step,
        coef,
        lr,
        pool,
        comm,
        memory,
        counted_copy,
        accumulate,
    } = update;
    let mut failed = false;
    let mut receiver_gone = false;
    for PartUpdate { part, groups } in parts {
        let mut result = Ok(());
        let mut back = Vec::with_capacity(groups.len());
        for LentGroup {
            index,
            mut state,
            mut grad,
            accumulator_len,
        } in groups
        {
            // After a failure the rest is not stepped, as in the synchronous step; once the
            // engine is gone nothing is.
            if !failed && !receiver_gone && result.is_ok() {
                result = step_guarded(&mut state, &mut grad, coef, lr, comm.as_ref(), pool.as_deref())
                    .map_err(|e| named(e, &names[part], index, step));
            }
            if counted_copy {
                memory.sub_grads(grad.len() * 4);
            }
            drop(grad);
            state.grad = half_buffer::zeros(accumulate, accumulator_len);
            back.push((index, state));
        }
        failed |= result.is_err();
        let done = PartDone {
            part,
            groups: back,
            result,
        };
        receiver_gone |= sender.send(done).is_err();
        let (count, idle) = &**unfinished;
        let mut left = lock(count);
        *left = left.saturating_sub(1);
        idle.notify_all();
    }
}

/// One group's update; a panic inside it becomes an error (the group's state is kept, so the
/// engine stays whole).
fn step_guarded(
    state: &mut GroupState,
    grad: &mut [f32],
    coef: f32,
    lr: f64,
    comm: &dyn ProcessGroup,
    pool: Option<&CpuPool>,
) -> Result<(), ZeroError> {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        step_lent_group(state, grad, coef, lr, comm, pool)
    }));
    match outcome {
        Ok(result) => result,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(ZeroError::Optimizer(format!("panicked: {what}")))
        }
    }
}

/// The error of a background update, naming the part, the group and the step.
fn named(e: ZeroError, part: &str, group: usize, step: u64) -> ZeroError {
    ZeroError::Optimizer(format!(
        "step {step}: the update of {part} (group {group}), run in the background while the next forward \
         started, failed: {e}"
    ))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat_state::{GradFlow, StateDtypes};
    use crate::optimizer_bridge::OptimizerFactory;
    use crate::settings::{OptimizerOffload, ParamOffload};
    use zero_core::comm::{FlatBuffer, ThreadGroup};
    use zero_core::optim::OptimizerSpec;
    use zero_core::partition::{LayoutBuilder, ParamSpec, Placement};

    const SIZES: [usize; 3] = [15, 7, 40];

    /// One rank's state of three parameters, each its own group (and its own part below).
    fn state(memory: &MemoryTracker) -> FlatState {
        let specs = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec {
                name: format!("p{i}"),
                shape: vec![n],
            })
            .collect();
        let mut builder = LayoutBuilder::new(specs, 1, 4);
        for i in 0..SIZES.len() {
            builder.group(vec![i], Placement::Replicated);
        }
        let factory = OptimizerFactory {
            spec: OptimizerSpec::adamw(),
        };
        let dtypes = StateDtypes {
            accumulate: ComputeDtype::F32,
            half_shard: Some(ComputeDtype::Bf16),
            communicate: ComputeDtype::F32,
        };
        FlatState::new(
            builder.finish(),
            0,
            |_| GradFlow::AccumulateThenReduce,
            &factory,
            |i| (0..SIZES[i]).map(|k| ((i * 31 + k) as f32 * 0.29).sin()).collect(),
            memory,
            dtypes,
            &OptimizerOffload::Cpu { threads: 1 },
            &ParamOffload::None,
        )
        .expect("state")
    }

    fn grads(state: &FlatState, step: usize) -> Vec<Vec<f32>> {
        (0..state.groups.len())
            .map(|g| {
                let n = state.layout.owned_len(g);
                (0..n).map(|k| ((g * 7 + k * 3 + step) as f32 * 0.41).cos()).collect()
            })
            .collect()
    }

    /// Lends every group, part `p` holding group `p`, with `grads`.
    fn update(state: &mut FlatState, grads: Vec<Vec<f32>>, step: u64, memory: Arc<MemoryTracker>) -> StepUpdate {
        let factory = OptimizerFactory {
            spec: OptimizerSpec::adamw(),
        };
        let parts = grads
            .into_iter()
            .enumerate()
            .map(|(g, grad)| {
                let stand_in = FlatState::stand_in_optimizer(g, &factory).expect("stand-in");
                PartUpdate {
                    part: g,
                    groups: vec![LentGroup {
                        index: g,
                        accumulator_len: state.accumulator_len(g),
                        state: state.lend(g, stand_in),
                        grad,
                    }],
                }
            })
            .collect();
        let comm: Arc<dyn ProcessGroup> = ThreadGroup::new_group(1).expect("group").remove(0);
        StepUpdate {
            parts,
            step,
            coef: 0.75,
            lr: 0.01,
            pool: state.pool(),
            comm,
            memory,
            counted_copy: false,
            accumulate: ComputeDtype::F32,
        }
    }

    fn parts() -> Vec<(String, Vec<usize>)> {
        vec![
            ("the ends".into(), vec![0]),
            ("block 0".into(), vec![1]),
            ("block 1".into(), vec![2]),
        ]
    }

    /// Every bit of the masters, the 16-bit shards and the optimizer state.
    fn snapshot(state: &FlatState) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        for g in &state.groups {
            out.push(g.master.iter().map(|v| v.to_bits()).collect());
            let half = g.half.clone().map(FlatBuffer::into_f32).unwrap_or_default();
            out.push(half.iter().map(|v| v.to_bits()).collect());
            for (_, buffer) in g.optimizer.inner.state() {
                out.push(buffer.iter().map(|v| v.to_bits()).collect());
            }
        }
        out
    }

    #[test]
    fn background_update_is_the_synchronous_apply() {
        // Reference: FlatState::apply on a twin state, for three steps.
        let memory = Arc::new(MemoryTracker::default());
        let comm = ThreadGroup::new_group(1).expect("group").remove(0);
        let mut reference = state(&memory);
        let mut deferred_state = state(&memory);
        let mut deferred = DeferredUpdates::new(parts());
        for step in 0..3 {
            let g = grads(&reference, step);
            reference
                .apply(g.clone(), 0.75, 0.01, comm.as_ref(), &memory)
                .expect("apply");
            let job = update(&mut deferred_state, g, step as u64 + 1, memory.clone());
            deferred.launch(job).expect("launch");
            assert!(deferred.any_pending());
            deferred.wait_for(1, &mut deferred_state).expect("parts 0 and 1");
            assert!(!deferred.is_pending(0) && !deferred.is_pending(1));
            deferred.wait_all(&mut deferred_state).expect("every part");
            assert!(!deferred.any_pending());
            assert_eq!(snapshot(&deferred_state), snapshot(&reference), "step {step}");
            for (gi, g) in deferred_state.groups.iter().enumerate() {
                assert_eq!(
                    g.grad.len(),
                    deferred_state.layout.groups[gi].padded,
                    "accumulator back"
                );
            }
        }
        assert_ne!(
            snapshot(&reference),
            snapshot(&state(&memory)),
            "the steps moved the state"
        );
    }

    #[test]
    fn an_error_surfaces_at_the_next_wait_naming_the_part() {
        let memory = Arc::new(MemoryTracker::default());
        let mut s = state(&memory);
        let mut deferred = DeferredUpdates::new(parts());
        let mut g = grads(&s, 0);
        // A gradient of the wrong length: the optimizer of group 1 refuses it.
        g[1].pop();
        let job = update(&mut s, g, 5, memory);
        deferred.launch(job).expect("launch");
        deferred.wait_for(0, &mut s).expect("part 0 is fine");
        let e = deferred.wait_for(1, &mut s).expect_err("part 1 failed").to_string();
        assert!(
            e.contains("block 0") && e.contains("group 1") && e.contains("step 5"),
            "{e}"
        );
        // Every group came back, the failed one included, and the error is reported once.
        deferred.wait_all(&mut s).expect("reported already");
        for (gi, g) in s.groups.iter().enumerate() {
            assert_eq!(g.master.len(), s.layout.owned_len(gi), "group {gi} is back");
        }
    }
}
