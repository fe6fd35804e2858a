//! `zero_core::estimate` (what `zero estimate` prints) against `ZeroOptimizer`'s memory report
//! on the `ZeroModule` path, in bf16, at every stage, on one and two ranks, with the optimizer
//! beside the model and offloaded to host memory (`offload_optimizer` cpu); and at stage 3 with
//! the units' shards on NVMe too (`offload_param` nvme).
//!
//! Reference: the estimate's per-device bytes (16-bit parameters and gradients 2Ψ, divided by N
//! from stage 3 and 2; fp32 masters and Adam's moments K = 12 bytes per element, divided by N
//! from stage 1; at stage 3 one unit gathered whole), and with the offload its per-host
//! optimizer state (every device's: the report is one rank's) and nothing of it on the device.
//! The model is the common `Net` with 40 blocks, each block a `ZeroModule`, the input layer and
//! head outside any unit, trained one step in Burn's loop under a checkpointing strategy.
//!
//! Slack: the padding of the flat groups (each unit's vector to a multiple of 16·N elements,
//! each other group by less than 16·N; a rank's part holds 1/N of it), and at stage 3 the ends'
//! parameters and gradients, whole on every rank.

use crate::common;
use common::{psi, unit_net_report, BLOCK_ELEMENTS, HIDDEN, IN, OUT};
use zero_burn::sharded::shard_len;
use zero_burn::{EngineSettings, MemoryReport, OptimizerOffload, ParamOffload, PrecisionSettings, Stage};
use zero_core::estimate::{estimate, Dtype, EstimateInput, OffloadTarget};
use zero_core::optim::OptimizerSpec;

const BLOCKS: usize = 40;
/// The input layer and the head, weights and biases: outside any unit.
const ENDS: usize = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT;

/// Rank 0's report after one bf16 step at `stage` on `world` ranks.
fn report(stage: Stage, world: usize, offload: OptimizerOffload) -> MemoryReport {
    report_with(stage, world, offload, ParamOffload::None)
}

/// [`report`] with the parameters' placement too.
fn report_with(stage: Stage, world: usize, offload: OptimizerOffload, params: ParamOffload) -> MemoryReport {
    let mut s = EngineSettings::new(stage, OptimizerSpec::adamw());
    s.precision = PrecisionSettings::bf16();
    s.offload_optimizer = offload;
    s.offload_param = params;
    // Every block is cut at stage 3; no prefetch beside the unit in use.
    s.param_persistence_threshold = 0;
    s.overlap_comm = false;
    unit_net_report(&s, world, BLOCKS)
}

/// The estimate for the model at `stage` on `world` devices of one node.
fn estimated(stage: Stage, world: usize, offload: Option<OffloadTarget>) -> zero_core::estimate::Estimate {
    estimated_with(stage, world, offload, None)
}

/// [`estimated`] with the parameters' placement too.
fn estimated_with(
    stage: Stage,
    world: usize,
    offload: Option<OffloadTarget>,
    params: Option<OffloadTarget>,
) -> zero_core::estimate::Estimate {
    let mut input = EstimateInput::new(psi(BLOCKS) as u64, stage.number(), world as u64, Dtype::Bf16);
    input.gathered_at_once = Some(BLOCK_ELEMENTS as u64);
    input.offload_optimizer = offload;
    input.offload_param = params;
    estimate(&input).expect("estimate")
}

fn close(label: &str, report: usize, formula: u64, slack: f64) {
    assert!(
        (report as f64 - formula as f64).abs() <= slack,
        "{label}: the report says {report} bytes, zero estimate {formula} (slack {slack:.0})"
    );
}

/// The header's slack on `world` ranks, in elements: the padding of a whole vector, the part
/// of it that is the other groups' (the ends'), and the ends' elements beyond a rank's 1/N.
fn slack(world: usize) -> (f64, f64, f64) {
    let units_pad = BLOCKS * (shard_len(BLOCK_ELEMENTS, world) * world - BLOCK_ELEMENTS);
    let groups_pad = 2 * 16 * world;
    let ends = ENDS as f64 * (1.0 - 1.0 / world as f64);
    ((units_pad + groups_pad) as f64, groups_pad as f64, ends)
}

#[test]
fn estimate_matches_the_memory_report() {
    for world in [1usize, 2] {
        let (whole, groups_pad, ends) = slack(world);
        let part = whole / world as f64;
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let label = format!("{stage:?} world {world}");
            let r = report(stage, world, OptimizerOffload::None);
            let e = estimated(stage, world, None).per_device;
            let (params, grads) = match stage {
                Stage::Zero0 | Stage::Zero1 => (whole, whole),
                Stage::Zero2 => (whole, part + ends + groups_pad),
                Stage::Zero3 => (part + ends, part + ends + groups_pad),
            };
            let state = if stage == Stage::Zero0 { whole } else { part };
            close(
                &format!("{label} parameters"),
                r.parameters.current,
                e.parameters,
                2.0 * params,
            );
            close(
                &format!("{label} gradients"),
                r.gradients.current,
                e.gradients,
                2.0 * grads,
            );
            close(
                &format!("{label} optimizer states"),
                r.master_weights.current + r.optimizer_state.current,
                e.optimizer_state,
                12.0 * state,
            );
            // One unit whole, padded to the ranks.
            let unit_pad = shard_len(BLOCK_ELEMENTS, world) * world - BLOCK_ELEMENTS;
            close(
                &format!("{label} gathered"),
                r.gathered.current,
                e.gathered,
                2.0 * unit_pad as f64,
            );
            // Everything beside the model without offload.
            let l = r.locations;
            assert_eq!(
                l.parameters.host + l.master_weights.host + l.optimizer_state.host,
                0,
                "{label}"
            );
        }
        // Offload to host memory: the K = 12 part leaves the device and is in host memory.
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let label = format!("cpu offload {stage:?} world {world}");
            let r = report(stage, world, OptimizerOffload::Cpu { threads: 1 });
            let e = estimated(stage, world, Some(OffloadTarget::Cpu));
            let state = if stage == Stage::Zero0 { whole } else { part };
            let l = r.locations;
            // Per host: every device's state; the report is one rank's.
            close(
                &format!("{label} host optimizer states"),
                l.master_weights.host + l.optimizer_state.host,
                e.per_host.optimizer_state / world as u64,
                12.0 * state,
            );
            assert_eq!(e.per_device.optimizer_state, 0, "{label}");
            assert_eq!(l.master_weights.device + l.optimizer_state.device, 0, "{label}");
            // The model's gradients stay on the device until the step (the optimizer's own
            // buffers are in host memory), as its parameters do.
            let grads = match stage {
                Stage::Zero0 | Stage::Zero1 => whole,
                Stage::Zero2 | Stage::Zero3 => part + ends + groups_pad,
            };
            close(
                &format!("{label} gradients on the device"),
                l.gradients.device,
                e.per_device.gradients,
                2.0 * grads,
            );
            assert!(
                l.gradients.host > 0,
                "{label}: the state's gradient buffers are in host memory"
            );
            let params = if stage == Stage::Zero3 { part + ends } else { whole };
            close(
                &format!("{label} parameters on the device"),
                l.parameters.device,
                e.per_device.parameters,
                2.0 * params,
            );
        }
    }
}

#[test]
fn estimate_matches_the_memory_report_with_the_parameters_on_nvme() {
    // Stage 3, the optimizer in host memory and the units' shards in a file: the report's NVMe
    // parameters are this rank's shards (the estimate's per-node figure over the devices), and
    // the device keeps only the ends, which are outside any unit (the estimate counts none).
    for world in [1usize, 2] {
        let (whole, _, ends) = slack(world);
        let part = whole / world as f64;
        let label = format!("offload_param nvme, world {world}");
        let dir = std::env::temp_dir().join(format!("zero-offload-estimate-{world}-{}", std::process::id()));
        let r = report_with(
            Stage::Zero3,
            world,
            OptimizerOffload::Cpu { threads: 1 },
            ParamOffload::Nvme {
                path: dir.clone(),
                max_in_cpu: 0,
            },
        );
        let _ = std::fs::remove_dir_all(&dir);
        let e = estimated_with(Stage::Zero3, world, Some(OffloadTarget::Cpu), Some(OffloadTarget::Nvme));
        let l = r.locations;
        assert_eq!(e.per_device.parameters, 0, "{label}");
        close(
            &format!("{label} parameters on NVMe"),
            l.parameters.nvme,
            e.per_node_nvme.parameters / world as u64,
            2.0 * part,
        );
        close(
            &format!("{label} parameters on the device"),
            l.parameters.device,
            0,
            2.0 * (ENDS as f64 / world as f64 + ends),
        );
        assert_eq!(l.parameters.host, 0, "{label}: no copy of the shards in host memory");
    }
}

/// With prefetching, the gathered bound is the prefetch rule's for the budget the schedule
/// runs with: `stage3_prefetch_bucket_size` cut to `stage3_max_live_parameters`. Reference:
/// `gathered_with_prefetch` (the rule `zero estimate` prints) of the padded units for that
/// budget, one block here, not the ten the bucket alone would allow.
#[test]
fn the_prefetch_bound_is_cut_to_the_live_parameters() {
    let world = 2;
    let mut s = EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw());
    s.precision = PrecisionSettings::bf16();
    s.param_persistence_threshold = 0;
    s.overlap_comm = true;
    s.prefetch_bucket_size = 10 * BLOCK_ELEMENTS;
    s.max_live_parameters = BLOCK_ELEMENTS;
    let r = unit_net_report(&s, world, BLOCKS);
    let unit = (shard_len(BLOCK_ELEMENTS, world) * world * 2) as u64;
    let want = zero_core::estimate::gathered_with_prefetch(&vec![unit; BLOCKS], (BLOCK_ELEMENTS * 2) as u64);
    assert_eq!(r.gathered.current as u64, want);
    let uncut = zero_core::estimate::gathered_with_prefetch(&vec![unit; BLOCKS], (10 * BLOCK_ELEMENTS * 2) as u64);
    assert!(uncut > want, "the cut must matter here: {uncut} vs {want}");
}
