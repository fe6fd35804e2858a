//! The per-group FIFO worker: collectives run on one thread, in issue order.
//!
//! Issue order is the order of the calls on the group handle, whether they are blocking or not,
//! so asynchronous and blocking collectives can be mixed. The worker also holds the group's
//! poison: once a collective fails, every later one fails at once with the same cause.

use super::op::OpKind;
use super::{CommError, FlatBuffer, ReduceOp, Work};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;
use std::time::Duration;

/// What a backend keeps on its worker thread.
pub(crate) trait BackendState: Send + 'static {
    /// Called once with the first error; tells the peers, if the backend can.
    fn on_error(&mut self, error: &CommError);
    /// Called when the handle is dropped and every queued collective has run.
    fn on_exit(&mut self, reason: &str);
    /// Runs one collective on the worker thread. `reduce` for the reducing ops, `root` for
    /// broadcast, `out` an optional buffer to reuse for an all-gather's result.
    fn run(
        &mut self,
        kind: OpKind,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Result<FlatBuffer, CommError>;
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
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Work<FlatBuffer> {
        self.submit(kind.name(), move |s| s.run(kind, buffer, reduce, root, out))
    }

    /// Queues `f`; its result arrives through the returned handle.
    pub(crate) fn submit<T, F>(&self, op: &'static str, f: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut S) -> Result<T, CommError> + Send + 'static,
    {
        let (done_tx, done_rx) = mpsc::channel();
        let job: Job<S> = Box::new(move |state, poison| {
            let result = match poison {
                Some(cause) => Err(cause.clone()),
                None => match catch_unwind(AssertUnwindSafe(|| f(state))) {
                    Ok(r) => r,
                    Err(_) => Err(CommError::Shutdown { op: op.to_string() }),
                },
            };
            if let (Err(e), None) = (&result, &poison) {
                *poison = Some(e.clone());
                state.on_error(e);
            }
            // The caller may have dropped its handle; the collective still counted.
            let _ = done_tx.send(result);
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
