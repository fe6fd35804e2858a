//! Bytes the engine holds, by kind, per rank: current and peak.
//!
//! The engine counts what it allocates itself (flat buffers, gathered parameters, the model's
//! parameter tensors in replicated stages); it does not see allocator slack or Burn's transient
//! activations. The kinds follow the ZeRO paper's split of model states.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Current and peak bytes of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Bytes {
    /// Held now.
    pub current: usize,
    /// Most ever held at once.
    pub peak: usize,
}

/// The per-rank memory report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryReport {
    /// Model parameters as the model sees them: the full replica (stages 0-2) or the rank's
    /// parameter shards (stage 3).
    pub parameters: Bytes,
    /// Gradients between backward and the step: the optimizer's accumulators and, where those
    /// are host buffers (an offloaded optimizer), also the model's own gradient tensors on its
    /// device.
    pub gradients: Bytes,
    /// fp32 master weights of the owned range, when they are not the parameters themselves.
    pub master_weights: Bytes,
    /// Optimizer state (Adam's two moments, momentum buffers ...).
    pub optimizer_state: Bytes,
    /// Parameters gathered for a block's forward or backward (stage 3), in flight or in use.
    pub gathered: Bytes,
    /// Where the current bytes of each kind live: beside the model (device), in host memory
    /// for the offloaded optimizer, or in NVMe swap files (not counted in the kinds above,
    /// which are memory).
    pub locations: LocationSplit,
}

/// Current bytes of one kind by location.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Locations {
    /// Beside the model, on the backend's device (the CPU for the CPU backend).
    pub device: usize,
    /// In host memory, for the offloaded optimizer step.
    pub host: usize,
    /// In NVMe swap files.
    pub nvme: usize,
}

/// Current bytes of every kind by location.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LocationSplit {
    /// Model parameters (and the parameter shard; with stage 3 `offload_param`, on the host
    /// or in files).
    pub parameters: Locations,
    /// Gradient accumulators.
    pub gradients: Locations,
    /// fp32 master weights.
    pub master_weights: Locations,
    /// Optimizer state (with NVMe offload: the host buffers it streams through, and the files).
    pub optimizer_state: Locations,
    /// Gathered parameters (stage 3).
    pub gathered: Locations,
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
        Bytes {
            current: self.current.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
        }
    }
}

/// Counts bytes by kind as the engine allocates and frees them.
#[derive(Debug, Default)]
pub struct MemoryTracker {
    parameters: Counter,
    gradients: Counter,
    /// The model's own gradient tensors (on its device, from backward to the step) where the
    /// optimizer's gradient buffers are elsewhere (its state in host buffers).
    model_gradients: Counter,
    master: Counter,
    optimizer: Counter,
    gathered: Counter,
    nvme_master: Counter,
    nvme_optimizer: Counter,
    nvme_parameters: Counter,
    /// Of `parameters`, the bytes in host memory (`ZeroModule` shards under `offload_param`).
    host_parameters: Counter,
    /// The masters and optimizer state are in host memory for an offloaded step.
    optimizer_on_host: std::sync::atomic::AtomicBool,
}

impl MemoryTracker {
    pub(crate) fn add_parameters(&self, bytes: usize) {
        self.parameters.add(bytes)
    }
    /// Parameter bytes kept in host memory rather than on the device.
    pub(crate) fn add_host_parameters(&self, bytes: usize) {
        self.parameters.add(bytes);
        self.host_parameters.add(bytes)
    }
    pub(crate) fn sub_host_parameters(&self, bytes: usize) {
        self.parameters.sub(bytes);
        self.host_parameters.sub(bytes)
    }
    pub(crate) fn sub_parameters(&self, bytes: usize) {
        self.parameters.sub(bytes)
    }
    pub(crate) fn add_nvme_parameters(&self, bytes: usize) {
        self.nvme_parameters.add(bytes)
    }
    /// The model's gradients on its device, beside an optimizer state in host buffers.
    pub(crate) fn add_model_gradients(&self, bytes: usize) {
        self.model_gradients.add(bytes)
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
    pub(crate) fn add_optimizer(&self, bytes: usize) {
        self.optimizer.add(bytes)
    }
    pub(crate) fn sub_optimizer(&self, bytes: usize) {
        self.optimizer.sub(bytes)
    }
    pub(crate) fn add_gathered(&self, bytes: usize) {
        self.gathered.add(bytes)
    }
    /// From now on the masters and optimizer state count as host memory.
    pub(crate) fn set_optimizer_on_host(&self) {
        self.optimizer_on_host.store(true, Ordering::Relaxed)
    }
    pub(crate) fn add_nvme_master(&self, bytes: usize) {
        self.nvme_master.add(bytes)
    }
    pub(crate) fn add_nvme_optimizer(&self, bytes: usize) {
        self.nvme_optimizer.add(bytes)
    }

    /// A snapshot of every kind.
    pub fn report(&self) -> MemoryReport {
        let on_device = |b: Bytes| Locations {
            device: b.current,
            ..Default::default()
        };
        let optimizer_side = |b: Bytes, nvme: &Counter| {
            let nvme = nvme.get().current;
            if self.optimizer_on_host.load(Ordering::Relaxed) {
                Locations {
                    host: b.current,
                    nvme,
                    ..Default::default()
                }
            } else {
                Locations {
                    device: b.current,
                    nvme,
                    ..Default::default()
                }
            }
        };
        let report = MemoryReport {
            parameters: self.parameters.get(),
            gradients: {
                let (own, model) = (self.gradients.get(), self.model_gradients.get());
                Bytes {
                    current: own.current + model.current,
                    peak: own.peak + model.peak,
                }
            },
            master_weights: self.master.get(),
            optimizer_state: self.optimizer.get(),
            gathered: self.gathered.get(),
            locations: LocationSplit::default(),
        };
        MemoryReport {
            locations: LocationSplit {
                parameters: {
                    let host = self.host_parameters.get().current;
                    Locations {
                        device: report.parameters.current.saturating_sub(host),
                        host,
                        nvme: self.nvme_parameters.get().current,
                    }
                },
                gradients: {
                    let model = self.model_gradients.get().current;
                    let own = report.gradients.current - model;
                    if self.optimizer_on_host.load(Ordering::Relaxed) {
                        Locations {
                            device: model,
                            host: own,
                            ..Default::default()
                        }
                    } else {
                        on_device(report.gradients)
                    }
                },
                master_weights: optimizer_side(report.master_weights, &self.nvme_master),
                optimizer_state: optimizer_side(report.optimizer_state, &self.nvme_optimizer),
                gathered: on_device(report.gathered),
            },
            ..report
        }
    }
}
