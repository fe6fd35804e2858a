//! `wall_clock_breakdown`: where a step's time goes.
//!
//! Forward, backward and step are timed around the engine's calls. Communication is timed by
//! [`TimedGroup`], which the engine's collectives pass through: it measures the wall time during
//! which at least one collective was in flight (from issue to completion, waiting on slower peers
//! included). Under ZeRO those collectives run inside forward, backward and step, so the
//! communication time overlaps the other three rather than adding to them.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zero_core::comm::{CommError, FlatBuffer, ProcessGroup, ReduceOp, Subject, Work};

/// Seconds spent in each phase since the last [`StepTimers::take`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Breakdown {
    /// Optimizer steps covered.
    pub steps: u64,
    /// In the engine's forward.
    pub forward: Duration,
    /// In the engine's backward.
    pub backward: Duration,
    /// In the engine's step.
    pub step: Duration,
    /// With a collective in flight; None when the collectives were not timed.
    pub communication: Option<Duration>,
}

impl Breakdown {
    /// One line, in milliseconds per optimizer step.
    pub fn line(&self, first_step: u64, last_step: u64) -> String {
        let per = |d: Duration| d.as_secs_f64() * 1e3 / self.steps.max(1) as f64;
        let comm = self
            .communication
            .map(|d| format!("{:.2}", per(d)))
            .unwrap_or_else(|| "not measured".into());
        format!(
            "time (ms per step, steps {first_step}-{last_step}) | forward: {:.2} | backward: {:.2} | step: {:.2} | communication: {comm}",
            per(self.forward),
            per(self.backward),
            per(self.step)
        )
    }
}

/// Accumulates the phase timers of rank 0's steps.
#[derive(Default)]
pub struct StepTimers {
    acc: Breakdown,
    comm: Option<Arc<CommClock>>,
    comm_at_take: Duration,
}

impl StepTimers {
    /// Timers; `comm` is the clock of the engine's [`TimedGroup`], when there is one.
    pub fn new(comm: Option<Arc<CommClock>>) -> Self {
        let comm_at_take = comm.as_ref().map(|c| c.busy()).unwrap_or_default();
        StepTimers {
            acc: Breakdown::default(),
            comm,
            comm_at_take,
        }
    }

    /// Runs `f`, adding its time to forward.
    pub fn forward<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.acc.forward += t.elapsed();
        out
    }

    /// Runs `f`, adding its time to backward.
    pub fn backward<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.acc.backward += t.elapsed();
        out
    }

    /// Runs `f`, adding its time to step.
    pub fn step<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.acc.step += t.elapsed();
        out
    }

    /// Counts one finished optimizer step.
    pub fn end_step(&mut self) {
        self.acc.steps += 1;
    }

    /// The times since the last call, and starts over.
    pub fn take(&mut self) -> Breakdown {
        let mut out = std::mem::take(&mut self.acc);
        if let Some(clock) = &self.comm {
            let busy = clock.busy();
            out.communication = Some(busy.saturating_sub(self.comm_at_take));
            self.comm_at_take = busy;
        }
        out
    }
}

/// The union of the intervals during which a collective was in flight.
#[derive(Debug, Default)]
pub struct CommClock {
    state: Mutex<ClockState>,
}

#[derive(Debug, Default)]
struct ClockState {
    busy: Duration,
    last_end: Option<Instant>,
}

impl CommClock {
    /// Total in-flight wall time so far.
    pub fn busy(&self) -> Duration {
        self.state.lock().map(|s| s.busy).unwrap_or_default()
    }

    /// Adds `[issued, done]`; intervals arrive in completion order, which is issue order.
    fn add(&self, issued: Instant, done: Instant) {
        if let Ok(mut s) = self.state.lock() {
            let start = match s.last_end {
                Some(end) if end > issued => end,
                _ => issued,
            };
            if done > start {
                s.busy += done - start;
            }
            s.last_end = Some(s.last_end.map_or(done, |e| e.max(done)));
        }
    }
}

/// A collective handed to the waiter thread.
struct Pending {
    work: Work<FlatBuffer>,
    issued: Instant,
    reply: Sender<Result<FlatBuffer, CommError>>,
}

/// A [`ProcessGroup`] that forwards every collective to `inner` and times it on a [`CommClock`].
///
/// A waiter thread waits on the collectives in issue order (the order every backend completes
/// them in) and notes when each is done; the caller's `wait()` receives the result from it.
/// That costs one thread hand-off per collective, which is why the trainer wraps the group only
/// when `wall_clock_breakdown` is set.
#[derive(Debug)]
pub struct TimedGroup {
    inner: Arc<dyn ProcessGroup>,
    clock: Arc<CommClock>,
    queue: Mutex<Sender<Pending>>,
}

impl TimedGroup {
    /// Wraps `inner`; returns the group and its clock.
    pub fn new(inner: Arc<dyn ProcessGroup>) -> (Arc<Self>, Arc<CommClock>) {
        let clock = Arc::new(CommClock::default());
        let (tx, rx) = channel::<Pending>();
        let waiter_clock = clock.clone();
        // The thread ends when the group (the only sender) is dropped.
        std::thread::spawn(move || {
            for p in rx {
                let result = p.work.wait();
                waiter_clock.add(p.issued, Instant::now());
                let _ = p.reply.send(result);
            }
        });
        let group = Arc::new(TimedGroup {
            inner,
            clock: clock.clone(),
            queue: Mutex::new(tx),
        });
        (group, clock)
    }

    fn timed(&self, issued: Instant, work: Work<FlatBuffer>, op: &'static str) -> Work<FlatBuffer> {
        let (reply, rx) = channel();
        let sent = self
            .queue
            .lock()
            .ok()
            .and_then(|q| q.send(Pending { work, issued, reply }).err());
        match sent {
            // The waiter is gone (it cannot be while the group lives): hand the work back untimed.
            Some(failed) => failed.0.work,
            None => Work::pending(rx, op),
        }
    }
}

impl ProcessGroup for TimedGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce_async(&self, buffer: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer> {
        let t = Instant::now();
        self.timed(t, self.inner.all_reduce_async(buffer, op), "all_reduce")
    }

    fn reduce_scatter_async(&self, input: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer> {
        let t = Instant::now();
        self.timed(t, self.inner.reduce_scatter_async(input, op), "reduce_scatter")
    }

    fn reduce_scatter_of_async(&self, input: FlatBuffer, op: ReduceOp, subject: Subject) -> Work<FlatBuffer> {
        let t = Instant::now();
        self.timed(
            t,
            self.inner.reduce_scatter_of_async(input, op, subject),
            "reduce_scatter",
        )
    }

    fn all_gather_async(&self, shard: FlatBuffer) -> Work<FlatBuffer> {
        let t = Instant::now();
        self.timed(t, self.inner.all_gather_async(shard), "all_gather")
    }

    fn all_gather_of_async(&self, shard: FlatBuffer, subject: Subject) -> Work<FlatBuffer> {
        let t = Instant::now();
        self.timed(t, self.inner.all_gather_of_async(shard, subject), "all_gather")
    }

    fn all_gather_into_async(&self, shard: FlatBuffer, out: FlatBuffer) -> Work<FlatBuffer> {
        let t = Instant::now();
        self.timed(t, self.inner.all_gather_into_async(shard, out), "all_gather")
    }

    fn broadcast_async(&self, buffer: FlatBuffer, root: usize) -> Work<FlatBuffer> {
        let t = Instant::now();
        self.timed(t, self.inner.broadcast_async(buffer, root), "broadcast")
    }

    fn barrier(&self) -> Result<(), CommError> {
        let t = Instant::now();
        let r = self.inner.barrier();
        self.clock.add(t, Instant::now());
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_intervals_count_once() {
        // Reference: the union of [0,10] ms, [5,15] ms and [20,25] ms is 20 ms.
        let clock = CommClock::default();
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        clock.add(ms(0), ms(10));
        clock.add(ms(5), ms(15));
        clock.add(ms(20), ms(25));
        assert_eq!(clock.busy(), Duration::from_millis(20));
    }

    #[test]
    fn breakdown_says_not_measured_without_a_clock() {
        let mut t = StepTimers::new(None);
        t.end_step();
        let line = t.take().line(1, 1);
        assert!(line.contains("communication: not measured"), "{line}");
    }
}
