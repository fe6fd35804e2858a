//! The engine's per-rank accounting under bf16 against the ZeRO paper's mixed-precision split
//! (Adam): 16-bit parameters 2Ψ, 16-bit gradients 2Ψ, and K = 12 bytes per parameter of
//! optimizer states (fp32 master weights 4Ψ, Adam's moments 8Ψ), each divided by N where the
//! stage shards it: stage 1 shards the 12Ψ, stage 2 the gradients too, stage 3 everything.

mod common;

use common::*;
use zero_burn::{ChainEngine, EngineSettings, MemoryReport, PrecisionSettings, Stage};
use zero_core::optim::OptimizerSpec;

const BLOCKS: usize = 40;

fn report(stage: Stage, world: usize) -> MemoryReport {
    let reports = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let mut s = EngineSettings::new(stage, OptimizerSpec::adamw());
        s.alignment = 1;
        s.param_persistence_threshold = 0;
        s.reduce_bucket_size = 1 << 20;
        s.overlap_comm = true;
        s.prefetch_bucket_size = 2 * BLOCK_ELEMENTS;
        s.precision = PrecisionSettings::bf16();
        let mut engine = ChainEngine::new(s, Net::<B>::new(&device, BLOCKS), group).expect("engine");
        let (x, y) = batch::<B>(0, rank * 2..rank * 2 + 2, &device);
        let dtype = engine.compute_dtype().burn();
        let loss = engine.forward((x.cast(dtype), y.cast(dtype))).expect("forward");
        engine.backward(loss).expect("backward");
        let step = engine.step().expect("step").expect("a boundary");
        assert!(!step.skipped);
        engine.memory()
    });
    reports[0]
}

#[test]
fn per_rank_bytes_follow_the_mixed_precision_zero_formulas() {
    let psi = psi(BLOCKS) as f64;
    // Padding: at most one element per rank and group; 2 + 4 + 8 bytes of it per element.
    let slack = 14.0 * (BLOCKS + 2) as f64;
    for world in [1usize, 2, 4] {
        let n = world as f64;
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let r = report(stage, world);
            let label = format!("bf16 {stage:?} world {world}");
            let (params, grads, states) = match stage {
                Stage::Zero0 => (2.0 * psi, 2.0 * psi, 12.0 * psi),
                Stage::Zero1 => (2.0 * psi, 2.0 * psi, 12.0 * psi / n),
                Stage::Zero2 => (2.0 * psi, 2.0 * psi / n, 12.0 * psi / n),
                Stage::Zero3 => (2.0 * psi / n, 2.0 * psi / n, 12.0 * psi / n),
            };
            within(&format!("{label} parameters"), r.parameters.current, params, slack);
            within(&format!("{label} gradients"), r.gradients.current, grads, slack);
            // The 12Ψ: fp32 masters (4) and Adam's moments (8), each checked on its own too.
            let states_got = r.master_weights.current + r.optimizer_state.current;
            within(
                &format!("{label} optimizer states (masters + moments)"),
                states_got,
                states,
                slack,
            );
            within(
                &format!("{label} master weights"),
                r.master_weights.current,
                states / 3.0,
                slack,
            );
            let total = params + grads + states;
            within(&format!("{label} total"), r.total_current(), total, slack);
            if stage == Stage::Zero3 {
                // Gathered 16-bit parameters: the part in use, the 2-block prefetch budget and the
                // ends (107 elements) in flight, at 2 bytes.
                assert_eq!(r.gathered.current, 0, "{label}: gathered parameters released");
                assert!(r.gathered.peak > 0, "{label}: gathers were counted");
                let bound = 2 * (3 * BLOCK_ELEMENTS + 2 * 107 + 64);
                assert!(
                    r.gathered.peak <= bound,
                    "{label}: peak gathered {} exceeds {bound}",
                    r.gathered.peak
                );
            }
        }
    }
}
