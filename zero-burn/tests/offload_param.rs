//! Stage-3 parameter offload: with the rank's parameter shards in host memory (`cpu`) or in a
//! file read in for every gather (`nvme`), training must be bit for bit the training with the
//! shards beside the model, and the memory report must say where the shard bytes live.

mod common;
mod precision_support;

use common::{Net, B};
use precision_support::*;
use std::path::PathBuf;
use zero_burn::{ChainEngine, EngineSettings, OptimizerOffload, ParamOffload, PrecisionSettings, Stage};

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("zero-offload-param-{}-{name}", std::process::id()))
}

/// Trains 4 steps with and without `offload` and asserts equal losses and weights after every
/// step. Reference: the same run with the shards in memory beside the model; a shard goes to
/// the file and back unchanged, so nothing may differ in any bit.
fn assert_same_training(label: &str, base: EngineSettings, offload: ParamOffload, world: usize) {
    let mut with = base.clone();
    with.offload_param = offload;
    assert_bit_for_bit(label, base, with, world);
}

#[test]
fn param_offload_training_is_bit_for_bit_in_memory_training() {
    for world in [1usize, 2] {
        for (dtype, precision) in [("fp32", PrecisionSettings::fp32()), ("bf16", PrecisionSettings::bf16())] {
            let base = settings(Stage::Zero3, 1, precision);
            assert_same_training(
                &format!("cpu world {world} {dtype}"),
                base.clone(),
                ParamOffload::Cpu,
                world,
            );
            // max_in_cpu 0: every shard in the file; 100: the first groups in memory, the
            // others in the file.
            for max_in_cpu in [0, 100] {
                let dir = scratch(&format!("{world}-{dtype}-{max_in_cpu}"));
                let label = format!("nvme max_in_cpu {max_in_cpu} world {world} {dtype}");
                let offload = ParamOffload::Nvme {
                    path: dir.clone(),
                    max_in_cpu,
                };
                assert_same_training(&label, base.clone(), offload, world);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

#[test]
fn param_and_optimizer_both_on_nvme_with_accumulation() {
    let dir = scratch("both");
    let mut base = settings(Stage::Zero3, 2, PrecisionSettings::bf16());
    base.offload_optimizer = OptimizerOffload::Nvme {
        path: dir.join("optimizer"),
        buffer_count: 3,
        chunk_elements: 31,
        threads: 1,
    };
    let offload = ParamOffload::Nvme {
        path: dir.join("params"),
        max_in_cpu: 0,
    };
    assert_same_training("params and optimizer on nvme, gas 2", base, offload, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One bf16 step at stage 3 on one rank; the memory report and the parameter file's size.
fn memory_after_a_step(offload: ParamOffload) -> (zero_burn::MemoryReport, Option<u64>) {
    let file = match &offload {
        ParamOffload::Nvme { path, .. } => Some(path.join("zero_params_rank0.swap")),
        _ => None,
    };
    let mut s = settings(Stage::Zero3, 1, PrecisionSettings::bf16());
    s.offload_param = offload;
    let device = Default::default();
    let group = zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0);
    let mut engine = ChainEngine::new(s, Net::<B>::new(&device, 3), group).expect("engine");
    let (x, y) = common::batch::<B>(0, 0..4, &device);
    let dtype = engine.compute_dtype().burn();
    let loss = engine.forward((x.cast(dtype), y.cast(dtype))).expect("forward");
    engine.backward(loss).expect("backward");
    engine.step().expect("step").expect("boundary");
    let size = file.and_then(|f| std::fs::metadata(f).ok()).map(|m| m.len());
    (engine.memory(), size)
}

#[test]
fn memory_report_says_where_the_parameter_shards_live() {
    // Reference: the run without parameter offload, whose shards are beside the model.
    let (plain_report, _) = memory_after_a_step(ParamOffload::None);
    let shard_bytes = plain_report.parameters.current;
    assert!(shard_bytes > 0);
    assert_eq!(plain_report.locations.parameters.device, shard_bytes);

    let (cpu, _) = memory_after_a_step(ParamOffload::Cpu);
    assert_eq!(cpu.parameters.current, shard_bytes, "cpu: the same shards");
    assert_eq!(cpu.locations.parameters.host, shard_bytes, "cpu: on the host");
    assert_eq!(cpu.locations.parameters.device + cpu.locations.parameters.nvme, 0);

    let dir = scratch("report");
    let (nv, size) = memory_after_a_step(ParamOffload::Nvme {
        path: dir.clone(),
        max_in_cpu: 0,
    });
    // Every shard in the file, none left in memory between steps (bf16: 2 bytes an element).
    assert_eq!(nv.parameters.current, 0, "{:?}", nv.locations);
    assert_eq!(nv.locations.parameters.nvme, shard_bytes);
    assert_eq!(size, Some(shard_bytes as u64), "the file holds exactly the shards");
    // The step brought each group's shard in, one at a time: the peak is below all of them.
    assert!(
        nv.parameters.peak > 0 && nv.parameters.peak < shard_bytes,
        "{:?}",
        nv.parameters
    );
    let _ = std::fs::remove_dir_all(&dir);

    // Half the budget: the first groups stay in memory, the rest go to the file.
    let dir = scratch("report-half");
    let (part, _) = memory_after_a_step(ParamOffload::Nvme {
        path: dir.clone(),
        max_in_cpu: shard_bytes / 2 / 2,
    });
    assert!(
        part.parameters.current > 0 && part.parameters.current <= shard_bytes / 2,
        "{:?}",
        part.parameters
    );
    assert_eq!(part.parameters.current + part.locations.parameters.nvme, shard_bytes);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_sections_become_param_offload_settings() {
    let settings = |stage: u8, param: &str| {
        let text = format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "Adam", "params": {{"lr": 0.001}}}}, "zero_optimization": {{"stage": {stage}, "offload_param": {param}}}}}"#
        );
        let cfg = zero_core::config::DeepSpeedConfig::from_str(&text, "ds_config.json")
            .expect("parses")
            .config;
        let resolved = zero_burn::resolve(&cfg, 2, &Default::default()).expect("resolves");
        zero_burn::engine_settings(&resolved)
    };
    let cpu = settings(3, r#"{"device": "cpu"}"#).expect("cpu");
    assert_eq!(cpu.offload_param, ParamOffload::Cpu);
    let nv = settings(3, r#"{"device": "nvme", "nvme_path": "/tmp/p", "max_in_cpu": 1000}"#).expect("nvme");
    assert_eq!(
        nv.offload_param,
        ParamOffload::Nvme {
            path: "/tmp/p".into(),
            max_in_cpu: 1000
        }
    );
    let err = settings(2, r#"{"device": "cpu"}"#).expect_err("stage 2");
    assert!(err.to_string().contains("stage 3"), "{err}");
}
