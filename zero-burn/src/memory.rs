//! Bytes the engine holds, by kind, per rank: current and peak.
//!
//! The engine counts what it allocates itself (flat buffers, gathered parameters, the model's
//! parameter tensors in replicated stages); it does not see allocator slack or Burn's transient
//! activations. The kinds follow the ZeRO paper's split of model states.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Current and peak bytes of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Bytes {
    /// Held now.
    pub current: usize,
    /// Most ever held at once.
    pub peak: usize,
}

/// The per-rank memory report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryReport {
    /// Model parameters as the model sees them: the full replica (stages 0-2) or the rank's
    /// parameter shards (stage 3).
    pub parameters: Bytes,
    /// Gradients the engine keeps between backward and the step (accumulators).
    pub gradients: Bytes,
    /// fp32 master weights of the owned range, when they are not the parameters themselves.
    pub master_weights: Bytes,
    /// Optimizer state (Adam's two moments, momentum buffers ...).
    pub optimizer_state: Bytes,
    /// Parameters gathered for a block's forward or backward (stage 3), in flight or in use.
    pub gathered: Bytes,
}

impl MemoryReport {
    /// Sum of the current bytes of every kind.
    pub fn total_current(&self) -> usize {
        self.parameters.current
            + self.gradients.current
            + self.master_weights.current
            + self.optimizer_state.current
            + self.gathered.current
    }
}

#[derive(Debug, Default)]
struct Counter {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl Counter {
    fn add(&self, bytes: usize) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, bytes: usize) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }
    fn get(&self) -> Bytes {
        Bytes { current: self.current.load(Ordering::Relaxed), peak: self.peak.load(Ordering::Relaxed) }
    }
}

/// Counts bytes by kind as the engine allocates and frees them.
#[derive(Debug, Default)]
pub struct MemoryTracker {
    parameters: Counter,
    gradients: Counter,
    master: Counter,
    optimizer: Counter,
    gathered: Counter,
}

impl MemoryTracker {
    pub(crate) fn add_parameters(&self, bytes: usize) {
        self.parameters.add(bytes)
    }
    pub(crate) fn add_grads(&self, bytes: usize) {
        self.gradients.add(bytes)
    }
    pub(crate) fn sub_grads(&self, bytes: usize) {
        self.gradients.sub(bytes)
    }
    pub(crate) fn add_master(&self, bytes: usize) {
        self.master.add(bytes)
    }
    pub(crate) fn sub_master(&self, bytes: usize) {
        self.master.sub(bytes)
    }
    pub(crate) fn add_optimizer(&self, bytes: usize) {
        self.optimizer.add(bytes)
    }
    pub(crate) fn add_gathered(&self, bytes: usize) {
        self.gathered.add(bytes)
    }
    pub(crate) fn sub_gathered(&self, bytes: usize) {
        self.gathered.sub(bytes)
    }

    /// A snapshot of every kind.
    pub fn report(&self) -> MemoryReport {
        MemoryReport {
            parameters: self.parameters.get(),
            gradients: self.gradients.get(),
            master_weights: self.master.get(),
            optimizer_state: self.optimizer.get(),
            gathered: self.gathered.get(),
        }
    }
}
