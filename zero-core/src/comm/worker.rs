//! The per-group FIFO worker: collectives run on one thread, in issue order.
//!
//! Issue order is the order of the calls on the group handle, whether they are blocking or not,
//! so asynchronous and blocking collectives can be mixed. The worker also holds the group's
//! poison: once a collective fails, every later one fails at once with the same cause.

use super::op::OpKind;
use super::{CommError, FlatBuffer, ReduceOp, Subject, Work};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;
use std::time::Duration;

/// Implements [`super::ProcessGroup`] for a backend handle with fields `rank`, `world` and a
/// `worker` running its collectives: every op goes through the worker's queue in issue order.
macro_rules! process_group_on_worker {
    ($handle:ty) => {
        impl $crate::comm::ProcessGroup for $handle {
            fn rank(&self) -> usize {
                self.rank
            }

            fn world_size(&self) -> usize {
                self.world
            }

            fn all_reduce_async(
                &self,
                buffer: $crate::comm::FlatBuffer,
                op: $crate::comm::ReduceOp,
            ) -> $crate::comm::Work<$crate::comm::FlatBuffer> {
                self.worker.collective(
                    $crate::comm::op::OpKind::AllReduce,
                    $crate::comm::Subject::Unnamed,
                    buffer,
                    Some(op),
                    0,
                    None,
                )
            }

            fn reduce_scatter_async(
                &self,
                input: $crate::comm::FlatBuffer,
                op: $crate::comm::ReduceOp,
            ) -> $crate::comm::Work<$crate::comm::FlatBuffer> {
                self.reduce_scatter_of_async(input, op, $crate::comm::Subject::Unnamed)
            }

            fn reduce_scatter_of_async(
                &self,
                input: $crate::comm::FlatBuffer,
                op: $crate::comm::ReduceOp,
                subject: $crate::comm::Subject,
            ) -> $crate::comm::Work<$crate::comm::FlatBuffer> {
                self.worker.collective(
                    $crate::comm::op::OpKind::ReduceScatter,
                    subject,
                    input,
                    Some(op),
                    0,
                    None,
                )
            }

            fn reduce_scatter_into_async(
                &self,
                input: $crate::comm::FlatBuffer,
                out: $crate::comm::FlatBuffer,
                op: $crate::comm::ReduceOp,
            ) -> $crate::comm::Work<($crate::comm::FlatBuffer, $crate::comm::FlatBuffer)> {
                self.worker.reduce_scatter_into(input, out, op)
            }

            fn all_gather_async(
                &self,
                shard: $crate::comm::FlatBuffer,
            ) -> $crate::comm::Work<$crate::comm::FlatBuffer> {
                self.all_gather_of_async(shard, $crate::comm::Subject::Unnamed)
            }

            fn all_gather_of_async(
                &self,
                shard: $crate::comm::FlatBuffer,
                subject: $crate::comm::Subject,
            ) -> $crate::comm::Work<$crate::comm::FlatBuffer> {
                self.worker
                    .collective($crate::comm::op::OpKind::AllGather, subject, shard, None, 0, None)
            }

            fn all_gather_into_async(
                &self,
                shard: $crate::comm::FlatBuffer,
                out: $crate::comm::FlatBuffer,
            ) -> $crate::comm::Work<$crate::comm::FlatBuffer> {
                self.worker.collective(
                    $crate::comm::op::OpKind::AllGather,
                    $crate::comm::Subject::Unnamed,
                    shard,
                    None,
                    0,
                    Some(out),
                )
            }

            fn broadcast_async(
                &self,
                buffer: $crate::comm::FlatBuffer,
                root: usize,
            ) -> $crate::comm::Work<$crate::comm::FlatBuffer> {
                self.worker.collective(
                    $crate::comm::op::OpKind::Broadcast,
                    $crate::comm::Subject::Unnamed,
                    buffer,
                    None,
                    root,
                    None,
                )
            }

            fn barrier(&self) -> Result<(), $crate::comm::CommError> {
                self.worker
                    .collective(
                        $crate::comm::op::OpKind::Barrier,
                        $crate::comm::Subject::Unnamed,
                        $crate::comm::FlatBuffer::F32(Vec::new()),
                        None,
                        0,
                        None,
                    )
                    .wait()
                    .map(drop)
            }
        }
    };
}
pub(crate) use process_group_on_worker;

/// What a backend keeps on its worker thread.
pub(crate) trait BackendState: Send + 'static {
    /// Called once with the first error; tells the peers, if the backend can.
    fn on_error(&mut self, error: &CommError);
    /// Called when the handle is dropped and every queued collective has run.
    fn on_exit(&mut self, reason: &str);
    /// Runs one collective on the worker thread, for `subject` (checked against the peers'). `reduce` for the reducing ops, `root` for
    /// broadcast, `out` an optional buffer to reuse for an all-gather's or a reduce-scatter's
    /// result. Returns the result and the input's allocation when the result does not live in
    /// it (values unspecified): a reduce-scatter into `out` hands it back to the caller, other
    /// collectives free it only after the caller has its answer.
    fn run(
        &mut self,
        kind: OpKind,
        subject: Subject,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Result<(FlatBuffer, Option<FlatBuffer>), CommError>;
}

type Job<S> = Box<dyn FnOnce(&mut S, &mut Option<CommError>) + Send>;

enum Message<S> {
    Run(Job<S>),
    Exit(String),
}

/// A thread that owns a backend's state and runs its collectives one after another.
pub(crate) struct Worker<S: BackendState> {
    // Mutex: `Sender` is not `Sync` on older toolchains, and the handle is shared between threads.
    tx: Mutex<Option<Sender<Message<S>>>>,
    /// Disconnected when the worker thread ends.
    exited: Mutex<Receiver<()>>,
}

impl<S: BackendState> Worker<S> {
    /// Starts the worker thread; `name` shows in debuggers.
    pub(crate) fn spawn(name: String, mut state: S) -> Result<Self, CommError> {
        let (tx, rx) = mpsc::channel::<Message<S>>();
        let (alive, exited) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let _alive = alive;
                let mut poison: Option<CommError> = None;
                let mut reason = String::from("it dropped its group handle");
                for msg in rx {
                    match msg {
                        Message::Run(job) => job(&mut state, &mut poison),
                        Message::Exit(r) => reason = r,
                    }
                }
                state.on_exit(&reason);
            })
            .map_err(|e| CommError::Setup(format!("cannot start the communication thread: {e}")))?;
        Ok(Worker {
            tx: Mutex::new(Some(tx)),
            exited: Mutex::new(exited),
        })
    }

    /// Queues one collective (see [`BackendState::run`]).
    pub(crate) fn collective(
        &self,
        kind: OpKind,
        subject: Subject,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Work<FlatBuffer> {
        self.submit_then_free(kind.name(), move |s| {
            match s.run(kind, subject, buffer, reduce, root, out) {
                Ok((result, spare)) => (Ok(result), spare),
                Err(e) => (Err(e), None),
            }
        })
    }

    /// Queues a reduce-scatter into `out`; the result is `(out, input)`.
    pub(crate) fn reduce_scatter_into(
        &self,
        input: FlatBuffer,
        out: FlatBuffer,
        reduce: ReduceOp,
    ) -> Work<(FlatBuffer, FlatBuffer)> {
        let kind = OpKind::ReduceScatter;
        self.submit(kind.name(), move |s| {
            let dtype = input.dtype();
            let (shard, spare) = s.run(kind, Subject::Unnamed, input, Some(reduce), 0, Some(out))?;
            Ok((shard, spare.unwrap_or_else(|| FlatBuffer::zeros(dtype, 0))))
        })
    }

    /// Queues `f`; its result arrives through the returned handle.
    pub(crate) fn submit<T, F>(&self, op: &'static str, f: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut S) -> Result<T, CommError> + Send + 'static,
    {
        self.submit_then_free(op, move |s| (f(s), None))
    }

    /// As [`Worker::submit`]; `f` also returns a buffer to free once the answer is sent, so
    /// that the caller does not wait for the pages of a consumed input to be returned.
    fn submit_then_free<T, F>(&self, op: &'static str, f: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut S) -> (Result<T, CommError>, Option<FlatBuffer>) + Send + 'static,
    {
        let (done_tx, done_rx) = mpsc::channel();
        let job: Job<S> = Box::new(move |state, poison| {
            let (result, garbage) = match poison {
                Some(cause) => (Err(cause.clone()), None),
                None => match catch_unwind(AssertUnwindSafe(|| f(state))) {
                    Ok(r) => r,
                    Err(_) => (Err(CommError::Shutdown { op: op.to_string() }), None),
                },
            };
            if let (Err(e), None) = (&result, &poison) {
                *poison = Some(e.clone());
                state.on_error(e);
            }
            // The caller may have dropped its handle; the collective still counted.
            let _ = done_tx.send(result);
            drop(garbage);
        });
        let sent = match self.tx.lock() {
            Ok(tx) => tx.as_ref().map(|tx| tx.send(Message::Run(job)).is_ok()),
            Err(_) => None,
        };
        match sent {
            Some(true) => Work::pending(done_rx, op),
            _ => Work::ready(Err(CommError::Shutdown { op: op.to_string() })),
        }
    }

    /// Stops the worker after the queued collectives, with the reason peers will be told, and
    /// waits at most `patience` for it to finish.
    pub(crate) fn stop(&mut self, reason: String, patience: Duration) {
        if let Ok(mut tx) = self.tx.lock() {
            if let Some(tx) = tx.take() {
                let _ = tx.send(Message::Exit(reason));
            }
        }
        // Waiting lets the peers hear a clean goodbye before this process exits; the bound keeps
        // a drop from hanging on collectives that wait for peers.
        if let Ok(exited) = self.exited.lock() {
            let _ = exited.recv_timeout(patience);
        }
    }
}

impl<S: BackendState> Drop for Worker<S> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.stop("its thread panicked".to_string(), Duration::from_millis(100));
        } else {
            self.stop("it dropped its group handle".to_string(), Duration::from_secs(30));
        }
    }
}
