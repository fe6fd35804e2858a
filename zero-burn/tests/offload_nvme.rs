//! Optimizer offload: with the masters and optimizer state on the host (`cpu`) or streamed from
//! a swap file (`nvme`), training must be bit for bit the in-memory training, at every stage
//! and world size, and the memory report must say where each kind of state lives.

mod common;
mod precision_support;

use common::{Net, B};
use precision_support::*;
use std::path::PathBuf;
use zero_burn::{ChainEngine, EngineSettings, OptimizerOffload, PrecisionSettings, Stage};
use zero_core::optim::{OptimizerSpec, SgdSpec};

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("zero-offload-test-{}-{name}", std::process::id()))
}

fn nvme(dir: PathBuf, buffer_count: usize, chunk_elements: usize) -> OptimizerOffload {
    OptimizerOffload::Nvme {
        path: dir,
        buffer_count,
        chunk_elements,
        threads: 2,
    }
}

/// Trains 4 steps with and without `offload` and asserts equal losses and weights after every
/// step. Reference: the same run with the state in memory; the update is element-wise and the
/// chunks see exactly the in-memory values, so nothing may differ in any bit.
fn assert_same_training(label: &str, base: EngineSettings, offload: OptimizerOffload, world: usize) {
    let mut with = base.clone();
    with.offload_optimizer = offload;
    assert_bit_for_bit(label, base, with, world);
}

#[test]
fn nvme_offloaded_training_is_bit_for_bit_in_memory_training() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1usize, 2] {
            for (dtype, precision) in [("fp32", PrecisionSettings::fp32()), ("bf16", PrecisionSettings::bf16())] {
                let label = format!("nvme {stage:?} world {world} {dtype}");
                let dir = scratch(&format!("{stage:?}-{world}-{dtype}"));
                // Chunks of 37 elements: groups span many chunks, most with a shorter last one;
                // 3 buffers overlap read, step and write.
                assert_same_training(&label, settings(stage, 1, precision), nvme(dir.clone(), 3, 37), world);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

#[test]
fn nvme_with_one_buffer_accumulation_and_sgd_momentum() {
    // One buffer: no overlap at all (read, step, write one chunk at a time).
    let dir = scratch("one-buffer");
    assert_same_training(
        "nvme 1 buffer, gas 2",
        settings(Stage::Zero2, 2, PrecisionSettings::bf16()),
        nvme(dir.clone(), 1, 64),
        2,
    );
    // SGD with momentum: its buffer starts as the first gradient, decided by the step count that
    // every chunk must see.
    let mut s = settings(Stage::Zero1, 1, PrecisionSettings::fp32());
    s.optimizer = OptimizerSpec::Sgd(SgdSpec {
        lr: 0.05,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.01,
        nesterov: true,
    });
    assert_same_training("nvme sgd momentum", s, nvme(dir.clone(), 2, 50), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cpu_offloaded_training_is_bit_for_bit_in_memory_training() {
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let label = format!("cpu {stage:?}");
        assert_same_training(
            &label,
            settings(stage, 1, PrecisionSettings::bf16()),
            OptimizerOffload::Cpu { threads: 1 },
            2,
        );
    }
}

/// One step at stage 2 in bf16; the memory report, the swap directory's files, Ψ, and whether
/// a checkpoint could be saved.
fn memory_after_a_step(offload: OptimizerOffload) -> (zero_burn::MemoryReport, Vec<String>, usize, Result<(), String>) {
    let dir = match &offload {
        OptimizerOffload::Nvme { path, .. } => Some(path.clone()),
        _ => None,
    };
    let mut s = settings(Stage::Zero2, 1, PrecisionSettings::bf16());
    s.offload_optimizer = offload;
    let device = Default::default();
    let group = zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0);
    let mut engine = ChainEngine::new(s, Net::<B>::new(&device, 3), group).expect("engine");
    let (x, y) = common::batch::<B>(0, 0..4, &device);
    let dtype = engine.compute_dtype().burn();
    let loss = engine.forward((x.cast(dtype), y.cast(dtype))).expect("forward");
    engine.backward(loss).expect("backward");
    engine.step().expect("step").expect("boundary");
    let files: Vec<String> = dir
        .and_then(|d| std::fs::read_dir(d).ok())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let psi = common::values::<B, _>(&engine.module().expect("module"))
        .iter()
        .map(Vec::len)
        .sum();
    let report = engine.memory();
    let ckpt = scratch(&format!("ckpt-{}", files.len()));
    let saved = engine
        .save_checkpoint(&ckpt, None, &serde_json::Value::Null)
        .map(|_| ())
        .map_err(|e| e.to_string());
    let _ = std::fs::remove_dir_all(&ckpt);
    (report, files, psi, saved)
}

#[test]
fn memory_report_says_where_each_kind_lives() {
    // Reference: the in-memory run's own report, kind by kind.
    let (plain_report, _, psi, saved) = memory_after_a_step(OptimizerOffload::None);
    assert_eq!(saved, Ok(()));
    assert_eq!(
        plain_report.locations.optimizer_state.device,
        plain_report.optimizer_state.current
    );
    assert_eq!(plain_report.locations.optimizer_state.host, 0);

    let (cpu, _, _, saved) = memory_after_a_step(OptimizerOffload::Cpu { threads: 1 });
    assert_eq!(saved, Ok(()), "cpu offload saves checkpoints");
    assert_eq!(
        cpu.locations.master_weights.host, plain_report.master_weights.current,
        "cpu: masters on the host"
    );
    assert_eq!(
        cpu.locations.optimizer_state.host, plain_report.optimizer_state.current,
        "cpu: moments on the host"
    );
    assert_eq!(
        cpu.locations.master_weights.device + cpu.locations.optimizer_state.device,
        0
    );

    let dir = scratch("report");
    let (nv, files, _, saved) = memory_after_a_step(nvme(dir.clone(), 2, 40));
    // The checkpoint reads the swapped state from the file (offload_checkpoint.rs checks what).
    assert_eq!(saved, Ok(()), "nvme offload saves checkpoints");
    assert_eq!(
        files,
        vec!["zero_optimizer_rank0.swap".to_string()],
        "one swap file for the rank"
    );
    // In memory: no masters; the streaming buffers (2 buffers × 40 elements × 3 arrays) and
    // one chunk's optimizer per group, less than the whole state.
    assert_eq!(nv.master_weights.current, 0);
    assert!(
        nv.locations.optimizer_state.host >= 2 * 40 * 3 * 4,
        "{:?}",
        nv.locations
    );
    assert!(
        nv.locations.optimizer_state.host < plain_report.optimizer_state.current,
        "{:?}",
        nv.locations
    );
    // On NVMe: exactly what the in-memory run holds in memory (one rank: every element owned).
    assert_eq!(nv.locations.master_weights.nvme, plain_report.master_weights.current);
    assert_eq!(nv.locations.optimizer_state.nvme, plain_report.optimizer_state.current);
    assert!(nv.locations.master_weights.nvme >= 4 * psi);
    // The bf16 parameter shard is kept in memory in their place.
    assert_eq!(
        nv.parameters.current,
        plain_report.parameters.current + plain_report.master_weights.current / 2
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_sections_become_offload_settings() {
    let settings = |zero: &str| {
        let text = format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "{opt}", "params": {{"lr": 0.001}}}}, "zero_optimization": {zero}}}"#,
            opt = if zero.contains("lamb") { "Lamb" } else { "Adam" }
        );
        let cfg = zero_core::config::DeepSpeedConfig::from_str(&text, "ds_config.json")
            .expect("parses")
            .config;
        let resolved = zero_burn::resolve(&cfg, 2, &Default::default()).expect("resolves");
        zero_burn::engine_settings(&resolved)
    };
    let cpu = settings(r#"{"stage": 2, "offload_optimizer": {"device": "cpu"}}"#).expect("cpu offload is accepted");
    assert_eq!(cpu.offload_optimizer, OptimizerOffload::Cpu { threads: 0 });
    let nv = settings(r#"{"stage": 3, "sub_group_size": 1000, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 5}}"#)
        .expect("nvme offload is accepted");
    assert_eq!(
        nv.offload_optimizer,
        OptimizerOffload::Nvme {
            path: "/tmp/x".into(),
            buffer_count: 5,
            chunk_elements: 1000,
            threads: 0
        }
    );
    let err =
        settings(r#"{"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}"#).expect_err("partial offload");
    assert!(err.to_string().contains("ratio"), "{err}");
}
