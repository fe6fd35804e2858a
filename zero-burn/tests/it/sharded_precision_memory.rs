//! The memory report of `ZeroOptimizer` at stage 3 in bf16 on the `ZeroModule` path, against
//! the mixed-precision ZeRO accounting counted by hand from the units' shard sizes: 16-bit
//! parameters and gradients 2 bytes per element of each unit's shard (and of the replicated
//! input and head layers whole), fp32 masters 4 bytes and Adam's two moments 8 bytes per
//! element the rank owns, and one unit gathered whole at a time (2 bytes per padded element).

use crate::common;
use common::{unit_net_report, BLOCK_ELEMENTS};
use zero_burn::sharded::shard_len;
use zero_burn::{EngineSettings, MemoryReport, PrecisionSettings, Stage};
use zero_core::optim::OptimizerSpec;

const BLOCKS: usize = 40;
/// The input layer (5 → 12) and the head (12 → 3), weights and biases: replicated.
const ENDS: usize = 5 * 12 + 12 + 12 * 3 + 3;

fn report(world: usize) -> MemoryReport {
    let mut s = EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw());
    s.precision = PrecisionSettings::bf16();
    s.param_persistence_threshold = 0;
    s.overlap_comm = false;
    unit_net_report(&s, world, BLOCKS)
}

#[test]
fn stage_3_bf16_bytes_follow_the_mixed_precision_accounting() {
    assert_eq!(BLOCK_ELEMENTS, 187, "the block the counts below assume");
    for world in [1usize, 2, 4] {
        let r = report(world);
        let label = format!("bf16 stage 3 world {world}");
        let shard = shard_len(BLOCK_ELEMENTS, world);
        let held = BLOCKS * shard + ENDS;
        assert_eq!(r.parameters.current, 2 * held, "{label}: 16-bit parameters");
        // The gradients the step is handed: each unit's shard, the ends' flat groups whole,
        // padded to the ranks' alignment (16 elements per rank, at most two groups).
        let g = r.gradients.current;
        let padded_ends = BLOCKS * shard + ENDS.next_multiple_of(16 * world) + 16 * world;
        assert!(g >= 2 * held && g <= 2 * padded_ends, "{label}: 16-bit gradients {g}");
        // The masters: each unit's shard, and this rank's part of the ends' flat groups (sharded
        // as at stage 2: at most one alignment's padding per group and rank on top).
        let owned_min = BLOCKS * shard + ENDS.div_ceil(world);
        let m = r.master_weights.current;
        assert!(
            m >= 4 * owned_min && m <= 4 * (owned_min + 2 * 16),
            "{label}: masters {m}"
        );
        assert_eq!(r.optimizer_state.current, 2 * m, "{label}: Adam's two moments");
        // Against the ZeRO formula 16Ψ/N: the units' 16 bytes per element over N, the replicated
        // ends' 16-bit copies and gradients (4 bytes) whole.
        let psi = (BLOCKS * BLOCK_ELEMENTS + ENDS) as f64;
        let formula = 16.0 * psi / world as f64 + 4.0 * ENDS as f64 * (1.0 - 1.0 / world as f64);
        let total = (r.parameters.current + r.gradients.current + m + r.optimizer_state.current) as f64;
        assert!(
            (total - formula).abs() <= 0.05 * formula,
            "{label}: {total} bytes against the formula's {formula}"
        );
        // One unit gathered whole at a time, padded to the ranks.
        assert_eq!(r.gathered.current, 2 * shard * world, "{label}: gathered");
    }
}
