//! [`ZeroOptimizer`]'s Burn record: this rank's part of the sharded checkpoint (its owned slices
//! of the fp32 masters and optimizer buffers, and the state's description: layout, stage, step
//! counts, loss scaler), for a loop that saves its optimizer with Burn's recorders. Every rank
//! saves its own and loads its own back.
//!
//! A record loads over the same ranks at any stage or grouping: the ranks re-cut their slices
//! among themselves ([`zero_core::checkpoint::recut`]). Another world size needs every old
//! rank's slices, which one rank's record does not hold: that is the sharded checkpoint's job
//! ([`ZeroOptimizer::save_checkpoint`] / [`ZeroOptimizer::load_checkpoint`]).

use super::ZeroOptimizer;
use crate::error::ZeroError;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};
use zero_core::checkpoint::{recut, CheckpointMeta, LoadedGroup};

/// One rank's optimizer state, as Burn's `Optimizer::to_record` gives it (see the module docs).
/// The masters and buffers stay fp32 whatever the recorder's precision settings: they are the
/// training state, not a copy of the weights.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ZeroOptimizerRecord {
    /// The state's description (a sharded checkpoint's metadata) as JSON; empty for an optimizer
    /// that has not stepped yet (its state is built at the first step).
    meta: String,
    /// The rank whose slices these are.
    rank: usize,
    /// The rank's owned slice of every flat group.
    groups: Vec<LoadedGroup>,
}

impl ZeroOptimizerRecord {
    /// Whether the record holds no state (taken before the optimizer's first step).
    pub fn is_empty(&self) -> bool {
        self.meta.is_empty()
    }

    /// The rank that made it.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The state's description; `None` for an empty record.
    pub fn meta(&self) -> Result<Option<CheckpointMeta>, ZeroError> {
        if self.is_empty() {
            return Ok(None);
        }
        serde_json::from_str(&self.meta)
            .map(Some)
            .map_err(|e| ZeroError::Usage(format!("the optimizer record's description is unreadable: {e}")))
    }
}

impl<B: Backend> Record<B> for ZeroOptimizerRecord {
    type Item<S: PrecisionSettings> = ZeroOptimizerRecord;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        self
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &B::Device) -> Self {
        item
    }
}

impl ZeroOptimizer {
    /// `Optimizer::to_record` returning its error instead of panicking with it. Every rank calls
    /// it (the host state with NVMe offload reads its swap files and agrees with the other
    /// ranks that every rank could). A record loaded but not yet applied (no step since) is
    /// what it gives back.
    pub fn try_to_record(&self) -> Result<ZeroOptimizerRecord, ZeroError> {
        if let Some(pending) = self.pending.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            return Ok(pending.clone());
        }
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = state.as_mut() else {
            return Ok(ZeroOptimizerRecord {
                rank: self.comm.rank(),
                ..Default::default()
            });
        };
        state.settle()?;
        let (meta, groups) = state.rank_state()?;
        let meta = serde_json::to_string(&meta)
            .map_err(|e| ZeroError::Usage(format!("the optimizer state's description: {e}")))?;
        Ok(ZeroOptimizerRecord {
            meta,
            rank: self.comm.rank(),
            groups,
        })
    }

    /// `Optimizer::to_record` (callable without naming the module's type).
    ///
    /// # Panics
    /// When the state cannot be read ([`ZeroOptimizer::try_to_record`] returns the error).
    pub fn to_record(&self) -> ZeroOptimizerRecord {
        match self.try_to_record() {
            Ok(r) => r,
            Err(e) => panic!("ZeRO optimizer record failed: {e}"),
        }
    }

    /// `Optimizer::load_record` (callable without naming the module's type): the record
    /// replaces the state at the next step, on every rank together, before that step's update
    /// (a `load_checkpoint` before then supersedes it). That step fails, leaving the state as it
    /// was, when the record does not fit: another model, world size or optimizer, another
    /// rank's record. Load the model's own record too: the step's gradients are the module's.
    pub fn load_record(self, record: ZeroOptimizerRecord) -> Self {
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(record);
        self
    }

    /// The applied steps (skipped ones left out) a pending record will restore, if one is
    /// waiting: the learning-rate schedule's position.
    pub(super) fn pending_step(&self) -> Option<u64> {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending
            .as_ref()
            .and_then(|r| r.meta().ok().flatten())
            .map(|m| m.global_step.saturating_sub(m.skipped_steps))
    }

    /// Applies a pending record to `state` (built): re-cut over the ranks for the state's layout,
    /// then put in place on every rank or on none.
    pub(super) fn apply_pending(&self, state: &mut super::State) -> Result<(), ZeroError> {
        let Some(record) = self.pending.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        let Some(meta) = record.meta()? else {
            return Ok(());
        };
        let groups = recut(
            self.comm.as_ref(),
            "the optimizer record",
            &meta,
            record.rank,
            record.groups,
            state.layout(),
        )?;
        state.load_groups(meta, groups)?;
        Ok(())
    }
}
