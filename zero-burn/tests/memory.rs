//! The engine's per-rank accounting against the ZeRO paper's formulas (fp32 training with Adam:
//! parameters 4Ψ, gradients 4Ψ, Adam's moments 8Ψ, each divided by N where the stage shards it).

mod common;

use common::*;
use zero_burn::{ChainEngine, EngineSettings, MemoryReport, Stage};
use zero_core::optim::OptimizerSpec;

fn report(stage: Stage, world: usize) -> MemoryReport {
    let reports = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let mut s = EngineSettings::new(stage, OptimizerSpec::adamw());
        s.alignment = 1;
        s.param_persistence_threshold = 0;
        s.reduce_bucket_size = 2 * BLOCK_ELEMENTS;
        s.overlap_comm = true;
        s.prefetch_bucket_size = 2 * BLOCK_ELEMENTS;
        let mut engine = ChainEngine::new(s, Net::<B>::new(&device, 40), group).expect("engine");
        let loss = engine
            .forward(batch::<B>(0, rank * 2..rank * 2 + 2, &device))
            .expect("forward");
        engine.backward(loss).expect("backward");
        engine.step().expect("step");
        engine.memory()
    });
    reports[0]
}

#[test]
fn per_rank_bytes_follow_the_zero_formulas() {
    let psi = psi(40) as f64;
    let block = (common::HIDDEN * 7 + 7 + 7 * common::HIDDEN + common::HIDDEN) as f64 * 4.0;
    for world in [1usize, 2, 4] {
        let n = world as f64;
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let r = report(stage, world);
            let label = format!("{stage:?} world {world}");
            let (params, grads, adam) = match stage {
                Stage::Zero0 => (4.0 * psi, 4.0 * psi, 8.0 * psi),
                Stage::Zero1 => (4.0 * psi, 4.0 * psi, 8.0 * psi / n),
                Stage::Zero2 => (4.0 * psi, 4.0 * psi / n, 8.0 * psi / n),
                Stage::Zero3 => (4.0 * psi / n, 4.0 * psi / n, 8.0 * psi / n),
            };
            // Padding of the last shard of each group is at most one element per rank and group.
            let slack = block;
            within(&format!("{label} parameters"), r.parameters.current, params, slack);
            within(&format!("{label} gradients"), r.gradients.current, grads, slack);
            within(
                &format!("{label} optimizer state"),
                r.optimizer_state.current,
                adam,
                slack,
            );
            // fp32 master weights: the owned shard; under stage 3 they are the parameters.
            let master = if stage == Stage::Zero3 {
                0.0
            } else if stage == Stage::Zero0 {
                4.0 * psi
            } else {
                4.0 * psi / n
            };
            within(
                &format!("{label} master weights"),
                r.master_weights.current,
                master,
                slack,
            );
            if matches!(stage, Stage::Zero2 | Stage::Zero3) && world > 1 {
                // Gradients are reduce-scattered part by part during backward: the full gradient
                // never exists at once. Peak: the shards, two buckets in flight (a bucket is two
                // blocks here), the group being assembled, and the ends.
                let full = 4.0 * psi;
                let bound = 4.0 * psi / n + 4.0 * (6 * BLOCK_ELEMENTS + 200) as f64;
                assert!(bound < full);
                assert!(
                    (r.gradients.peak as f64) <= bound,
                    "{label}: gradient peak {} above {bound} (the full gradient is {full})",
                    r.gradients.peak
                );
            }
            if stage == Stage::Zero3 {
                // Nothing gathered stays after the step; live at once: the part in use plus the
                // prefetch budget (2 blocks) plus the ends (68 + 39 elements) in flight.
                assert_eq!(r.gathered.current, 0, "{label}: gathered parameters released");
                assert!(r.gathered.peak > 0, "{label}: gathers were counted");
                let bound = 4 * (3 * BLOCK_ELEMENTS + 2 * 107 + 64);
                assert!(
                    r.gathered.peak <= bound,
                    "{label}: peak gathered {} exceeds {bound}",
                    r.gathered.peak
                );
            } else {
                assert_eq!(r.gathered.peak, 0, "{label}: nothing is gathered below stage 3");
            }
        }
    }
}
