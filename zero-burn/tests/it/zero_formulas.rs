//! `ZeroOptimizer`'s per-rank memory report on the `ZeroModule` path against the ZeRO paper's
//! formulas for fp32 training with Adam: parameters 4Ψ, gradients 4Ψ, Adam's two moments 8Ψ,
//! each divided by N where the stage partitions it (optimizer state from stage 1, gradients
//! from stage 2, parameters at stage 3), at stages 0-3 over 1, 2 and 4 ranks.
//!
//! The model is the common `Net` with 40 blocks, each block a `ZeroModule` (187 elements), the
//! input layer and head (111 elements, 1.5 % of Ψ) outside any unit, trained one step in
//! Burn's loop under a checkpointing strategy (stage 3 frees each gathered unit after its use).
//! The step's fp32 masters are tensors of their own beside the module's parameters: 4Ψ at
//! stage 0, 4Ψ/N from stage 1. Stage 3 also holds one unit gathered whole at a time.
//!
//! Slack: the padding of the flat groups (each unit's vector to a multiple of 16·N elements,
//! each other group by less than 16·N; a rank's part holds 1/N of it), and at stage 3 the
//! ends, whole on every rank: their parameters and gradients 4·111·(1 - 1/N) bytes above 4Ψ/N.
//! Together at most 16 % of a figure (the gradients sharded over 4 ranks, beside which the whole
//! ends weigh most); a kind not divided by N where the stage divides it is off by half or more.

use crate::common;
use common::{psi, unit_net_reports, BLOCK_ELEMENTS, HIDDEN, IN, OUT};
use zero_burn::sharded::shard_len;
use zero_burn::{EngineSettings, MemoryReport, Stage};
use zero_core::optim::OptimizerSpec;

const BLOCKS: usize = 40;
/// The input layer and the head, weights and biases: outside any unit.
const ENDS: usize = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT;

/// Rank 0's report after one step at `stage` on `world` ranks.
fn report(stage: Stage, world: usize) -> MemoryReport {
    let mut s = EngineSettings::new(stage, OptimizerSpec::adamw());
    // Every block is cut at stage 3; no prefetch beside the unit in use.
    s.param_persistence_threshold = 0;
    s.overlap_comm = false;
    let reports = unit_net_reports(&s, world, BLOCKS);
    for (_, tensors) in &reports {
        assert_eq!(*tensors, Some(true), "the state on the model's device");
    }
    reports[0].0
}

/// Asserts that the report's `got` bytes are within `slack` bytes of the formula's `want`.
fn within(label: &str, got: usize, want: f64, slack: f64) {
    assert!(
        (got as f64 - want).abs() <= slack,
        "{label}: {got} bytes, the formula gives {want:.0} (slack {slack:.0})"
    );
}

#[test]
fn per_rank_bytes_follow_the_zero_formulas() {
    assert_eq!(psi(BLOCKS), BLOCKS * BLOCK_ELEMENTS + ENDS);
    let psi = psi(BLOCKS) as f64;
    for world in [1usize, 2, 4] {
        let n = world as f64;
        // Padding, in elements of a whole vector: each unit's to a multiple of 16·N, each
        // other flat group (at most two) by less than 16·N. A rank's part holds 1/N of it.
        let units_pad = BLOCKS * (shard_len(BLOCK_ELEMENTS, world) * world - BLOCK_ELEMENTS);
        let groups_pad = 2 * 16 * world;
        let whole = 4.0 * (units_pad + groups_pad) as f64;
        let part = whole / n;
        // Stage 3: the ends' parameters and gradients whole on every rank.
        let ends_whole = 4.0 * ENDS as f64 * (1.0 - 1.0 / n);
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let r = report(stage, world);
            let label = format!("{stage:?} world {world}");
            let (params, grads, masters, adam) = match stage {
                Stage::Zero0 => (4.0 * psi, 4.0 * psi, 4.0 * psi, 8.0 * psi),
                Stage::Zero1 => (4.0 * psi, 4.0 * psi, 4.0 * psi / n, 8.0 * psi / n),
                Stage::Zero2 => (4.0 * psi, 4.0 * psi / n, 4.0 * psi / n, 8.0 * psi / n),
                Stage::Zero3 => (4.0 * psi / n, 4.0 * psi / n, 4.0 * psi / n, 8.0 * psi / n),
            };
            // The ends' gradient is whole (and padded as a whole vector) from stage 2 on.
            let (params_slack, grads_slack) = match stage {
                Stage::Zero0 | Stage::Zero1 => (whole, whole),
                Stage::Zero2 => (whole, part + ends_whole + 4.0 * groups_pad as f64),
                Stage::Zero3 => (part + ends_whole, part + ends_whole + 4.0 * groups_pad as f64),
            };
            let state_slack = if stage == Stage::Zero0 { whole } else { part };
            within(
                &format!("{label} parameters"),
                r.parameters.current,
                params,
                params_slack,
            );
            within(&format!("{label} gradients"), r.gradients.current, grads, grads_slack);
            within(
                &format!("{label} master weights"),
                r.master_weights.current,
                masters,
                state_slack,
            );
            within(
                &format!("{label} optimizer state"),
                r.optimizer_state.current,
                adam,
                2.0 * state_slack,
            );
            // Everything on the model's device.
            let l = r.locations;
            assert_eq!(
                l.parameters.host + l.master_weights.host + l.optimizer_state.host,
                0,
                "{label}: nothing in host memory"
            );
            if stage == Stage::Zero3 {
                // One unit gathered whole at a time, padded to the ranks.
                assert_eq!(
                    r.gathered.current,
                    4 * shard_len(BLOCK_ELEMENTS, world) * world,
                    "{label}: gathered"
                );
            } else {
                assert_eq!(r.gathered.peak, 0, "{label}: nothing is gathered below stage 3");
            }
        }
    }
}
