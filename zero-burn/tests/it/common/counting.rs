//! A `DeviceCollective` that records every call (its op, length and dtype) and runs it through
//! `HostStaged`: how the tests count what a stage communicates. Gathers also leave when they
//! were started and when they were waited for, to see prefetches.

use burn::tensor::{DType, Tensor};
use std::sync::{Arc, Mutex};
use zero_burn::device::Started;
use zero_burn::{DeviceCollective, HostStaged, ZeroError};
use zero_core::comm::{ReduceOp, Subject};

type Inner = burn::backend::Flex;

/// One collective call: its name, its length, its dtype.
pub type Call = (&'static str, usize, DType);

/// Records every collective the state calls, then runs it through `HostStaged`.
#[derive(Debug)]
pub struct Counting {
    pub inner: HostStaged,
    pub log: Mutex<Vec<Call>>,
    /// Gathers: `Gather::Start(len)` when one is started, `Gather::Wait(len)` when it is waited
    /// for (a blocking one leaves both at once).
    pub gathers: Arc<Mutex<Vec<Gather>>>,
    /// What it says of its ranks: processes of their own (NCCL's case), or maybe threads.
    pub separate_processes: bool,
}

/// A gather of a vector of this many elements (every rank's shard) started or waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gather {
    Start(usize),
    Wait(usize),
}

impl Counting {
    pub fn new(inner: HostStaged) -> Self {
        Counting {
            inner,
            log: Mutex::new(Vec::new()),
            gathers: Arc::new(Mutex::new(Vec::new())),
            separate_processes: false,
        }
    }
    /// A collective that says its ranks are processes of their own.
    pub fn in_processes(mut self, separate: bool) -> Self {
        self.separate_processes = separate;
        self
    }
    pub fn take_gathers(&self) -> Vec<Gather> {
        std::mem::take(&mut *self.gathers.lock().expect("gathers"))
    }
    pub fn note(&self, op: &'static str, t: &Tensor<Inner, 1>) {
        self.log.lock().expect("log").push((op, t.dims()[0], t.dtype()));
    }
    pub fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.log.lock().expect("log"))
    }
}

impl DeviceCollective<Inner> for Counting {
    fn rank(&self) -> usize {
        DeviceCollective::<Inner>::rank(&self.inner)
    }
    fn world_size(&self) -> usize {
        DeviceCollective::<Inner>::world_size(&self.inner)
    }
    fn all_reduce(&self, t: Tensor<Inner, 1>, op: ReduceOp) -> Result<Tensor<Inner, 1>, ZeroError> {
        self.note("all_reduce", &t);
        self.inner.all_reduce(t, op)
    }
    fn reduce_scatter_of(
        &self,
        t: Tensor<Inner, 1>,
        op: ReduceOp,
        subject: Subject,
    ) -> Result<Tensor<Inner, 1>, ZeroError> {
        self.note("reduce_scatter", &t);
        self.inner.reduce_scatter_of(t, op, subject)
    }
    fn all_gather_of(&self, t: Tensor<Inner, 1>, subject: Subject) -> Result<Tensor<Inner, 1>, ZeroError> {
        self.note("all_gather", &t);
        let len = t.dims()[0] * DeviceCollective::<Inner>::world_size(self);
        let mut gathers = self.gathers.lock().expect("gathers");
        gathers.extend([Gather::Start(len), Gather::Wait(len)]);
        drop(gathers);
        self.inner.all_gather_of(t, subject)
    }
    fn all_gather_start_of(&self, t: Tensor<Inner, 1>, subject: Subject) -> Started<Inner> {
        self.note("all_gather", &t);
        let len = t.dims()[0] * DeviceCollective::<Inner>::world_size(self);
        self.gathers.lock().expect("gathers").push(Gather::Start(len));
        let started = self.inner.all_gather_start_of(t, subject);
        let gathers = self.gathers.clone();
        Started::pending(move || {
            gathers.lock().expect("gathers").push(Gather::Wait(len));
            started.wait()
        })
    }
    fn broadcast(&self, t: Tensor<Inner, 1>, root: usize) -> Result<Tensor<Inner, 1>, ZeroError> {
        self.note("broadcast", &t);
        self.inner.broadcast(t, root)
    }
    fn ranks_may_share_a_process(&self) -> bool {
        !self.separate_processes
    }
    fn all_reduce_scalars(&self, v: &mut [f32], op: ReduceOp) -> Result<(), ZeroError> {
        self.log.lock().expect("log").push(("scalars", v.len(), DType::F32));
        DeviceCollective::<Inner>::all_reduce_scalars(&self.inner, v, op)
    }
}
