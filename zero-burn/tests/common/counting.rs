//! A `DeviceCollective` that records every call (its op, length and dtype) and runs it through
//! `HostStaged`: how the tests count what a stage communicates.

use burn::tensor::{DType, Tensor};
use std::sync::Mutex;
use zero_burn::{DeviceCollective, HostStaged, ZeroError};
use zero_core::comm::ReduceOp;

type Inner = burn::backend::Flex;

/// One collective call: its name, its length, its dtype.
pub type Call = (&'static str, usize, DType);

/// Records every collective the state calls, then runs it through `HostStaged`.
#[derive(Debug)]
pub struct Counting {
    pub inner: HostStaged,
    pub log: Mutex<Vec<Call>>,
}

impl Counting {
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
    fn reduce_scatter(&self, t: Tensor<Inner, 1>, op: ReduceOp) -> Result<Tensor<Inner, 1>, ZeroError> {
        self.note("reduce_scatter", &t);
        self.inner.reduce_scatter(t, op)
    }
    fn all_gather(&self, t: Tensor<Inner, 1>) -> Result<Tensor<Inner, 1>, ZeroError> {
        self.note("all_gather", &t);
        self.inner.all_gather(t)
    }
    fn broadcast(&self, t: Tensor<Inner, 1>, root: usize) -> Result<Tensor<Inner, 1>, ZeroError> {
        self.note("broadcast", &t);
        self.inner.broadcast(t, root)
    }
    fn all_reduce_scalars(&self, v: &mut [f32], op: ReduceOp) -> Result<(), ZeroError> {
        self.log.lock().expect("log").push(("scalars", v.len(), DType::F32));
        DeviceCollective::<Inner>::all_reduce_scalars(&self.inner, v, op)
    }
}
