//! Gathers issued ahead of use (`stage3_prefetch_bucket_size` with `overlap_comm`): while one
//! unit computes, the units that come next have their all-gathers in flight.
//!
//! The order is learned, not declared. Every fetch of a unit's whole vector is noted in the
//! phase it happens in: forward (the gathers of forward) or backward (the gathers again for
//! backward under a checkpointing strategy; a reduce-scatter also says that backward has
//! begun). When a phase ends, its sequence of units is kept as the one to follow next time.
//! While a phase follows its kept sequence, a fetch at position p starts the gathers of the
//! units at p + 1, p + 2, ... while the elements already in flight are fewer than the budget
//! (DeepSpeed's rule: the last unit started may pass it, so any budget above 0 prefetches at
//! least the next unit); a phase that leaves its sequence prefetches nothing more (and is
//! recorded afresh). Backward's sequence is its own (forward's reversed, for a chain; not for a
//! unit used twice), and follows forward's: the end of a forward starts the gathers that its
//! backward begins with. A unit that comes again within the window keeps its whole vector for
//! that use instead of being gathered again (a model's last unit is the first its backward
//! needs).
//!
//! A prefetch gathers the unit's latest shard as the schedule saw it: at its last forward, or
//! as the optimizer wrote it ([`after_step`](super::after_step)). The prefetched vector is
//! used only if the shard at its use is that same value (its autodiff node); otherwise it is
//! dropped and the unit gathered again. Every rank runs the same code on the same model, so
//! every rank starts the same prefetches in the same order: the collectives stay matched.

use super::gather::UnitComm;
use crate::device::Started;
use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use std::collections::HashMap;
use std::sync::Mutex;
use zero_core::comm::Subject;

/// Where a fetch happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Forward = 0,
    Backward = 1,
}

/// A unit's gather in flight.
struct InFlight<I: Backend> {
    unit: u64,
    /// The shard value it gathers.
    key: u64,
    /// Elements of the whole vector.
    len: usize,
    started: Started<I>,
}

struct Schedule<I: Backend> {
    phase: Phase,
    /// The sequence of units each phase fetched the last time it fetched any.
    recorded: [Vec<u64>; 2],
    /// This phase's fetches so far.
    current: Vec<u64>,
    /// Whether `current` is a prefix of the phase's recorded sequence.
    on_track: bool,
    /// Each unit's latest shard: its value's key and the tensor.
    latest: HashMap<u64, (u64, Tensor<I, 1>)>,
    /// How each unit's collectives name it.
    subjects: HashMap<u64, Subject>,
    in_flight: Vec<InFlight<I>>,
}

/// The prefetch schedule of the units cut together (one model's), over one group of ranks.
pub(crate) struct Prefetcher<I: Backend> {
    comm: UnitComm<I>,
    /// Elements of whole vectors that may be in flight at once; 0 prefetches nothing.
    budget: usize,
    schedule: Mutex<Schedule<I>>,
}

impl<I: Backend> std::fmt::Debug for Prefetcher<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Prefetcher(budget {})", self.budget)
    }
}

impl<I: Backend> Prefetcher<I> {
    pub(crate) fn new(comm: UnitComm<I>, budget: usize) -> Self {
        Prefetcher {
            comm,
            budget,
            schedule: Mutex::new(Schedule {
                phase: Phase::Forward,
                recorded: [Vec::new(), Vec::new()],
                current: Vec::new(),
                on_track: true,
                latest: HashMap::new(),
                subjects: HashMap::new(),
                in_flight: Vec::new(),
            }),
        }
    }

    fn schedule(&self) -> std::sync::MutexGuard<'_, Schedule<I>> {
        self.schedule.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Unit `unit`'s whole vector from this rank's `shard` (the value `key` names), fetched in
    /// `phase`: taken from a prefetch of that value, or gathered now; then the gathers of the
    /// units that follow it are started.
    pub(crate) fn fetch(
        &self,
        unit: u64,
        subject: Subject,
        key: u64,
        shard: Tensor<I, 1>,
        phase: Phase,
    ) -> Result<Tensor<I, 1>, ZeroError> {
        let mut s = self.schedule();
        s.enter(phase);
        s.subjects.insert(unit, subject);
        s.latest.insert(unit, (key, shard.clone()));
        let prefetched = s
            .in_flight
            .iter()
            .position(|f| f.unit == unit)
            .map(|i| s.in_flight.remove(i))
            // A prefetch of another value (the shard was written since) is dropped.
            .filter(|f| f.key == key);
        let position = s.current.len();
        s.current.push(unit);
        let follows = s.recorded[phase as usize].get(position) == Some(&unit);
        s.on_track &= follows;
        // This unit's gather first, then those that follow it, so that it does not wait
        // behind them.
        let own = match prefetched {
            Some(f) => f.started,
            None => self.comm.all_gather_start_of(shard, subject),
        };
        let keep = s.on_track && self.budget > 0 && self.start_following(&mut s, phase, position, unit);
        drop(s);
        let whole = own.wait()?;
        if keep {
            let len = whole.dims()[0];
            self.schedule().in_flight.push(InFlight {
                unit,
                key,
                len,
                started: Started::ready(Ok(whole.clone())),
            });
        }
        Ok(whole)
    }

    /// Backward has begun (a unit's gradient is being reduce-scattered).
    pub(crate) fn backward_began(&self) {
        self.schedule().enter(Phase::Backward);
    }

    /// Unit `unit`'s shard is now `shard` (written by the optimizer): the value the next
    /// forward's prefetch gathers. A prefetch of an older value is dropped.
    pub(crate) fn note(&self, unit: u64, key: u64, shard: Tensor<I, 1>) {
        let mut s = self.schedule();
        s.in_flight.retain(|f| f.unit != unit || f.key == key);
        s.latest.insert(unit, (key, shard));
    }

    /// Starts the gathers of the units after `position` in `phase`'s recorded sequence (after
    /// forward's last, backward's first), while what is in flight is below the budget.
    /// Returns whether `unit`, being fetched, comes again among them: its whole vector is then
    /// kept for that use rather than gathered twice (without counting against the budget when
    /// it is the very next: it would be gathered again at once, as large).
    fn start_following(&self, s: &mut Schedule<I>, phase: Phase, position: usize, unit: u64) -> bool {
        let world = self.comm.world_size();
        let mut in_flight: usize = s.in_flight.iter().map(|f| f.len).sum();
        let mut next: Vec<u64> = s.recorded[phase as usize][position + 1..].to_vec();
        if phase == Phase::Forward {
            // The shards do not change between a forward and its backward.
            next.extend_from_slice(&s.recorded[Phase::Backward as usize]);
        }
        let mut keep = false;
        for (distance, next) in next.into_iter().enumerate() {
            if next == unit {
                if keep {
                    continue;
                }
                let len = s.latest.get(&unit).map_or(0, |(_, shard)| shard.dims()[0] * world);
                if distance > 0 && in_flight >= self.budget {
                    break;
                }
                in_flight += if distance > 0 { len } else { 0 };
                keep = true;
                continue;
            }
            if s.in_flight.iter().any(|f| f.unit == next) {
                continue;
            }
            let Some((key, shard)) = s.latest.get(&next) else { break };
            let len = shard.dims()[0] * world;
            if in_flight >= self.budget {
                break;
            }
            in_flight += len;
            let (key, shard) = (*key, shard.clone());
            let subject = s.subjects.get(&next).copied().unwrap_or_default();
            s.in_flight.push(InFlight {
                unit: next,
                key,
                len,
                started: self.comm.all_gather_start_of(shard, subject),
            });
        }
        keep
    }
}

impl<I: Backend> Schedule<I> {
    /// Moves to `phase`; leaving a phase keeps its sequence (when it fetched anything).
    fn enter(&mut self, phase: Phase) {
        if self.phase == phase {
            return;
        }
        let done = std::mem::take(&mut self.current);
        if !done.is_empty() {
            self.recorded[self.phase as usize] = done;
        }
        self.phase = phase;
        self.on_track = true;
    }
}
