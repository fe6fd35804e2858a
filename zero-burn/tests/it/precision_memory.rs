//! `ZeroOptimizer`'s per-rank accounting under bf16 on the `ZeroModule` path (`UnitNet`, each of
//! its 40 blocks a unit, from `initialize_settings`) against the ZeRO paper's mixed-precision
//! split (Adam): 16-bit parameters 2Ψ, 16-bit gradients 2Ψ, and K = 12 bytes per parameter of
//! optimizer states (fp32 master weights 4Ψ, Adam's moments 8Ψ), each divided by N where the
//! stage shards it: stage 1 shards the 12Ψ, stage 2 the gradients too, stage 3 everything.
//!
//! The report departs from the formulas by padding (each unit to 16 elements per rank, each flat
//! group of the other parameters to the ranks' alignment) and by the input layer and the head,
//! which are not units and stay whole where the units are cut: the tolerance is those elements
//! at the kind's bytes per element. The exact count at stage 3: sharded_precision_memory.rs.

use crate::common;
use common::{psi, unit_net_report, within, BLOCK_ELEMENTS};
use zero_burn::sharded::shard_len;
use zero_burn::{EngineSettings, MemoryReport, PrecisionSettings, Stage};
use zero_core::optim::OptimizerSpec;

const BLOCKS: usize = 40;
/// Stage 3 gathers ahead up to two blocks' worth of elements.
const PREFETCH: usize = 2 * BLOCK_ELEMENTS;

fn report(stage: Stage, world: usize) -> MemoryReport {
    let mut s = EngineSettings::new(stage, OptimizerSpec::adamw());
    s.alignment = 1;
    s.param_persistence_threshold = 0;
    s.reduce_bucket_size = 1 << 20;
    s.overlap_comm = true;
    s.prefetch_bucket_size = PREFETCH;
    s.precision = PrecisionSettings::bf16();
    unit_net_report(&s, world, BLOCKS)
}

#[test]
fn per_rank_bytes_follow_the_mixed_precision_zero_formulas() {
    // The input layer and the head: Ψ of no blocks.
    let ends = psi(0);
    let psi = psi(BLOCKS) as f64;
    for world in [1usize, 2, 4] {
        let n = world as f64;
        // A unit's length padded to the ranks.
        let padded = shard_len(BLOCK_ELEMENTS, world) * world;
        // Elements the formulas do not count: the units' padding, at most 16 per rank for each
        // of the other parameters' two flat groups, and those parameters whole.
        let extra = (BLOCKS * (padded - BLOCK_ELEMENTS) + 2 * 16 * world + ends) as f64;
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let r = report(stage, world);
            let label = format!("bf16 {stage:?} world {world}");
            let (params, grads, states) = match stage {
                Stage::Zero0 => (2.0 * psi, 2.0 * psi, 12.0 * psi),
                Stage::Zero1 => (2.0 * psi, 2.0 * psi, 12.0 * psi / n),
                Stage::Zero2 => (2.0 * psi, 2.0 * psi / n, 12.0 * psi / n),
                Stage::Zero3 => (2.0 * psi / n, 2.0 * psi / n, 12.0 * psi / n),
            };
            within(
                &format!("{label} parameters"),
                r.parameters.current,
                params,
                2.0 * extra,
            );
            within(&format!("{label} gradients"), r.gradients.current, grads, 2.0 * extra);
            // The 12Ψ: fp32 masters (4) and Adam's moments (8), each checked on its own too.
            let states_got = r.master_weights.current + r.optimizer_state.current;
            within(
                &format!("{label} optimizer states (masters + moments)"),
                states_got,
                states,
                12.0 * extra,
            );
            within(
                &format!("{label} master weights"),
                r.master_weights.current,
                states / 3.0,
                4.0 * extra,
            );
            let total = params + grads + states;
            within(&format!("{label} total"), r.total_current(), total, 16.0 * extra);
            let gathered = if stage == Stage::Zero3 {
                // Gathered 16-bit parameters: the unit in use whole and, on more than one rank,
                // the prefetch budget and one more unit in flight beside it, at 2 bytes.
                let ahead = if world > 1 { PREFETCH + padded } else { 0 };
                2 * (padded + ahead)
            } else {
                0
            };
            assert_eq!(r.gathered.current, gathered, "{label}: gathered parameters");
        }
    }
}
