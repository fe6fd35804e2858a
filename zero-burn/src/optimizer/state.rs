//! Where [`super::ZeroOptimizer`]'s state lives: host buffers ([`EngineCore`]) or tensors of the
//! model's backend ([`DeviceState`]), behind one type that does not name the backend.

use crate::core::EngineCore;
use crate::device::state::DeviceState;
use crate::error::ZeroError;
use crate::memory::MemoryReport;
use burn::tensor::backend::Backend;
use std::any::Any;
use zero_core::checkpoint::{CheckpointMeta, HalfDtype, LoadedGroup, SaveOptions, Saved};
use zero_core::partition::PartitionLayout;

/// Where the optimizer's state lives.
pub(super) enum State {
    /// Host memory ([`EngineCore`]).
    Host(Box<EngineCore>),
    /// The model's device: a [`DeviceState`] of the model's inner backend.
    Device(Box<dyn AnyDeviceState>),
}

/// A [`DeviceState`] of any backend, for what does not depend on it.
pub(super) trait AnyDeviceState: Send {
    fn global_step(&self) -> u64;
    fn skipped_steps(&self) -> u64;
    fn loss_scale(&self) -> f64;
    fn memory(&self) -> MemoryReport;
    fn save_checkpoint(
        &self,
        dir: &std::path::Path,
        tag: Option<&str>,
        client_state: &serde_json::Value,
        options: SaveOptions,
    ) -> Result<Saved, ZeroError>;
    fn rank_state(&self) -> Result<(CheckpointMeta, Vec<LoadedGroup>), ZeroError>;
    fn save_weights(
        &self,
        path: &std::path::Path,
        dtype: Option<HalfDtype>,
        names: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ZeroError>;
    fn load_groups(&mut self, meta: CheckpointMeta, groups: Vec<LoadedGroup>) -> Result<serde_json::Value, ZeroError>;
    fn layout(&self) -> &PartitionLayout;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<I: Backend> AnyDeviceState for DeviceState<I> {
    fn global_step(&self) -> u64 {
        self.global_step
    }

    fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    fn loss_scale(&self) -> f64 {
        DeviceState::loss_scale(self)
    }

    fn memory(&self) -> MemoryReport {
        self.memory.report()
    }

    fn save_checkpoint(
        &self,
        dir: &std::path::Path,
        tag: Option<&str>,
        client_state: &serde_json::Value,
        options: SaveOptions,
    ) -> Result<Saved, ZeroError> {
        DeviceState::save_checkpoint(self, dir, tag, client_state, options)
    }

    fn rank_state(&self) -> Result<(CheckpointMeta, Vec<LoadedGroup>), ZeroError> {
        DeviceState::rank_state(self)
    }

    fn save_weights(
        &self,
        path: &std::path::Path,
        dtype: Option<HalfDtype>,
        names: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ZeroError> {
        DeviceState::save_weights(self, path, dtype, names)
    }

    fn load_groups(&mut self, meta: CheckpointMeta, groups: Vec<LoadedGroup>) -> Result<serde_json::Value, ZeroError> {
        DeviceState::load_groups(self, meta, groups)
    }

    fn layout(&self) -> &PartitionLayout {
        &self.layout
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl State {
    pub(super) fn global_step(&self) -> u64 {
        match self {
            State::Host(core) => core.global_step,
            State::Device(state) => state.global_step(),
        }
    }

    pub(super) fn skipped_steps(&self) -> u64 {
        match self {
            State::Host(core) => core.skipped_steps,
            State::Device(state) => state.skipped_steps(),
        }
    }

    /// Waits for a delayed update of the host state still running (nothing for the device
    /// state, whose updates are not delayed): what reads or replaces the state calls it first.
    pub(super) fn settle(&mut self) -> Result<(), ZeroError> {
        match self {
            State::Host(core) => core.settle().map(|_| ()),
            State::Device(_) => Ok(()),
        }
    }

    /// This rank's owned slices and their description, in host memory.
    pub(super) fn rank_state(&self) -> Result<(CheckpointMeta, Vec<LoadedGroup>), ZeroError> {
        match self {
            State::Host(core) => core.rank_state(),
            State::Device(state) => state.rank_state(),
        }
    }

    /// Replaces the state with this rank's owned slices of the current layout, on every rank
    /// or on none.
    pub(super) fn load_groups(
        &mut self,
        meta: CheckpointMeta,
        groups: Vec<LoadedGroup>,
    ) -> Result<serde_json::Value, ZeroError> {
        match self {
            State::Host(core) => core.load_groups(meta, groups),
            State::Device(state) => state.load_groups(meta, groups),
        }
    }

    /// The flat layout of the state.
    pub(super) fn layout(&self) -> &PartitionLayout {
        match self {
            State::Host(core) => &core.state.layout,
            State::Device(state) => state.layout(),
        }
    }

    pub(super) fn device<I: Backend>(&mut self) -> Result<&mut DeviceState<I>, ZeroError> {
        match self {
            State::Device(state) => state.as_any_mut().downcast_mut::<DeviceState<I>>().ok_or_else(|| {
                ZeroError::Usage(
                    "ZeroOptimizer: the state was built for a model of another backend; one optimizer trains one \
                     model"
                        .into(),
                )
            }),
            State::Host(_) => unreachable!("asked for the device state of a host state"),
        }
    }
}
