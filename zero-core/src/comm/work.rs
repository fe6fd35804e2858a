//! Handles to collectives in flight.

use super::CommError;
use std::sync::mpsc::Receiver;

/// The result of an asynchronous collective; [`Work::wait`] blocks until it is done.
///
/// Dropping a `Work` without waiting does not cancel the collective: peers still expect it.
#[must_use = "a collective's result is only seen through wait()"]
pub struct Work<T> {
    state: WorkState<T>,
}

enum WorkState<T> {
    Ready(Result<T, CommError>),
    Pending(Receiver<Result<T, CommError>>, &'static str),
    /// A pending handle whose result is transformed once it arrives.
    Mapped(Box<dyn FnOnce() -> Result<T, CommError> + Send>, &'static str),
}

impl<T> Work<T> {
    /// A handle that is already complete.
    pub fn ready(result: Result<T, CommError>) -> Self {
        Work {
            state: WorkState::Ready(result),
        }
    }

    /// A handle completed by whoever holds the sending half of `receiver`. `op` names the
    /// collective in the error if the sender vanishes without answering.
    pub fn pending(receiver: Receiver<Result<T, CommError>>, op: &'static str) -> Self {
        Work {
            state: WorkState::Pending(receiver, op),
        }
    }

    /// Blocks until the collective is done and returns its result.
    pub fn wait(self) -> Result<T, CommError> {
        match self.state {
            WorkState::Ready(r) => r,
            WorkState::Pending(rx, op) => rx
                .recv()
                .unwrap_or_else(|_| Err(CommError::Shutdown { op: op.to_string() })),
            WorkState::Mapped(f, _) => f(),
        }
    }

    /// The name of the collective while it is pending.
    fn op(&self) -> Option<&'static str> {
        match &self.state {
            WorkState::Ready(_) => None,
            WorkState::Pending(_, op) | WorkState::Mapped(_, op) => Some(op),
        }
    }
}

impl<T: Send + 'static> Work<T> {
    /// A handle to `f` applied to this one's result, once it is there; nothing blocks before
    /// [`Work::wait`].
    pub fn map<U>(self, f: impl FnOnce(T) -> U + Send + 'static) -> Work<U> {
        match self.op() {
            None => Work::ready(self.wait().map(f)),
            Some(op) => Work {
                state: WorkState::Mapped(Box::new(move || self.wait().map(f)), op),
            },
        }
    }
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.op() {
            None => f.write_str("Work(ready)"),
            Some(op) => write!(f, "Work(pending {op})"),
        }
    }
}
