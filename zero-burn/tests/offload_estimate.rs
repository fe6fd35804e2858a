//! `zero_core::estimate` (what `zero estimate` prints) against the engine's own accounting
//! (`MemoryReport`) for a small chain model in bf16, every stage, one and two ranks, with and
//! without optimizer offload to the host.

mod common;

use common::*;
use zero_burn::{ChainEngine, EngineSettings, MemoryReport, OptimizerOffload, PrecisionSettings, Stage};
use zero_core::estimate::{estimate, Dtype, EstimateInput, OffloadTarget};
use zero_core::optim::OptimizerSpec;

const BLOCKS: usize = 40;

fn report(stage: Stage, world: usize, offload: OptimizerOffload) -> MemoryReport {
    let reports = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let mut s = EngineSettings::new(stage, OptimizerSpec::adamw());
        s.alignment = 1;
        s.param_persistence_threshold = 0;
        s.reduce_bucket_size = 1 << 20;
        s.precision = PrecisionSettings::bf16();
        s.offload_optimizer = offload.clone();
        let mut engine = ChainEngine::new(s, Net::<B>::new(&device, BLOCKS), group).expect("engine");
        let (x, y) = batch::<B>(0, rank * 2..rank * 2 + 2, &device);
        let dtype = engine.compute_dtype().burn();
        let loss = engine.forward((x.cast(dtype), y.cast(dtype))).expect("forward");
        engine.backward(loss).expect("backward");
        engine.step().expect("step").expect("a boundary");
        engine.memory()
    });
    reports[0]
}

fn close(label: &str, engine: usize, formula: u64, slack: u64) {
    assert!(
        (engine as i64 - formula as i64).unsigned_abs() <= slack,
        "{label}: the engine holds {engine} bytes, zero estimate says {formula}"
    );
}

#[test]
fn estimate_matches_the_engines_accounting() {
    // Padding: at most one element per rank and group (alignment 1), 2 + 2 + 12 bytes each.
    let slack = 16 * (BLOCKS as u64 + 2) * 2;
    for world in [1usize, 2] {
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let label = format!("stage {stage:?} world {world}");
            let r = report(stage, world, OptimizerOffload::None);
            let e = estimate(&EstimateInput::new(
                psi(BLOCKS) as u64,
                stage.number(),
                world as u64,
                Dtype::Bf16,
            ))
            .unwrap()
            .per_device;
            close(
                &format!("{label} parameters"),
                r.parameters.current,
                e.parameters,
                slack,
            );
            close(&format!("{label} gradients"), r.gradients.current, e.gradients, slack);
            close(
                &format!("{label} optimizer states"),
                r.master_weights.current + r.optimizer_state.current,
                e.optimizer_state,
                slack,
            );
            // Everything is beside the model without offload.
            assert_eq!(
                r.locations.optimizer_state.host + r.locations.master_weights.host,
                0,
                "{label}"
            );
        }
    }
    // Offload to the host: the K = 12 part leaves the device and is in host memory.
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let label = format!("cpu offload stage {stage:?}");
        let r = report(stage, 2, OptimizerOffload::Cpu { threads: 1 });
        let mut input = EstimateInput::new(psi(BLOCKS) as u64, stage.number(), 2, Dtype::Bf16);
        input.offload_optimizer = Some(OffloadTarget::Cpu);
        let e = estimate(&input).unwrap();
        let host = r.locations.master_weights.host + r.locations.optimizer_state.host;
        // Per host = both devices' shards; the engine reports one rank's.
        close(
            &format!("{label} host optimizer states"),
            host,
            e.per_host.optimizer_state / 2,
            slack,
        );
        assert_eq!(e.per_device.optimizer_state, 0);
        assert_eq!(
            r.locations.master_weights.device + r.locations.optimizer_state.device,
            0,
            "{label}"
        );
    }
}
