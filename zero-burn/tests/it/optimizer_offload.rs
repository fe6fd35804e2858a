//! `ZeroOptimizer` with its optimizer offloaded (`offload_optimizer`): streamed from a swap file
//! (`nvme`) training is bit for bit the host-memory training (`cpu`), at every stage and world
//! size, in fp32 and bf16, and with one streaming buffer, two micro-batches accumulated by
//! Burn's `GradientsAccumulator` and SGD with momentum; a run saved from the swap file and
//! resumed (into the swap file or into memory) continues bit for bit, as does one saved from
//! memory and resumed into the swap file, or resumed with the units' shards in a parameter file
//! (`offload_param` nvme); the memory report says the state is on NVMe; the config's
//! `offload_optimizer` sections become these settings.
//!
//! Reference: the same run with the state in host memory (`offload_optimizer: cpu`, the same
//! fused kernel on the same values: the chunks see exactly the in-memory values, and the
//! update is element-wise), and for the resume, the same run without the stop. The model is
//! sharded_support's three linear units (a skip connection), cut at stages 2-3 by
//! `initialize_settings`.

use crate::sharded_support;
use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use sharded_support::*;
use std::path::{Path, PathBuf};
use zero_burn::{EngineSettings, OptimizerOffload, ParamOffload, PrecisionSettings, Stage};
use zero_core::optim::{OptimizerSpec, SgdSpec};

type AB = Autodiff<Flex>;
const STEPS: usize = 4;

fn scratch(name: &str) -> PathBuf {
    sharded_support::scratch("optimizer-offload", name)
}

/// Chunks of 29 elements and 2 buffers: every group spans several chunks, most with a shorter
/// last one.
fn nvme(dir: &Path) -> OptimizerOffload {
    OptimizerOffload::Nvme {
        path: dir.to_path_buf(),
        buffer_count: 2,
        chunk_elements: 29,
        threads: 1,
    }
}

fn settings(stage: Stage, precision: PrecisionSettings, offload: OptimizerOffload) -> EngineSettings {
    offload_settings(stage, precision, offload, ParamOffload::None)
}

/// [`train_net`] with `micro` micro-batches a step, every rank asserting that its state is in
/// host buffers (offloaded).
fn run_accumulated(
    settings: EngineSettings,
    world: usize,
    micro: usize,
    steps: std::ops::Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<NetRun> {
    let runs = train_net(&settings, world, micro, steps, load, save);
    for run in &runs {
        assert_eq!(run.tensor_state, Some(false), "offloaded: host buffers");
    }
    runs
}

/// [`run_accumulated`] with one micro-batch a step.
fn run(
    settings: EngineSettings,
    world: usize,
    steps: std::ops::Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<NetRun> {
    run_accumulated(settings, world, 1, steps, load, save)
}

/// Every rank's losses and units in bits: what two runs must share.
fn trained(runs: &[NetRun]) -> Vec<(&Vec<u32>, &Vec<Vec<u32>>)> {
    runs.iter().map(|r| (&r.losses, &r.units)).collect()
}

#[test]
fn nvme_offloaded_training_is_bit_for_bit_host_memory_training() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1usize, 2] {
            for (dtype, precision) in [("fp32", PrecisionSettings::fp32()), ("bf16", PrecisionSettings::bf16())] {
                let label = format!("{stage:?} world {world} {dtype}");
                let dir = scratch(&format!("{stage:?}-{world}-{dtype}"));
                let want = run(
                    settings(stage, precision.clone(), OptimizerOffload::Cpu { threads: 1 }),
                    world,
                    0..STEPS,
                    None,
                    None,
                );
                let got = run(settings(stage, precision, nvme(&dir)), world, 0..STEPS, None, None);
                assert_eq!(trained(&got), trained(&want), "{label}: nvme against host memory");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

#[test]
fn a_run_saved_from_the_swap_file_resumes_bit_for_bit_into_the_swap_file_or_memory() {
    for stage in [Stage::Zero1, Stage::Zero3] {
        let whole = run(
            settings(stage, PrecisionSettings::bf16(), OptimizerOffload::Cpu { threads: 1 }),
            2,
            0..STEPS,
            None,
            None,
        );
        let (swap, ckpt) = (scratch(&format!("swap-{stage:?}")), scratch(&format!("ckpt-{stage:?}")));
        let first = run(
            settings(stage, PrecisionSettings::bf16(), nvme(&swap)),
            2,
            0..2,
            None,
            Some(&ckpt),
        );
        for (label, offload) in [
            ("into the swap file", nvme(&swap)),
            ("into memory", OptimizerOffload::Cpu { threads: 1 }),
        ] {
            let second = run(
                settings(stage, PrecisionSettings::bf16(), offload),
                2,
                2..STEPS,
                Some(&ckpt),
                None,
            );
            assert_resumed(&format!("{stage:?} {label}"), &first, &second, &whole);
        }
        let _ = std::fs::remove_dir_all(&swap);
        let _ = std::fs::remove_dir_all(&ckpt);
    }
}

#[test]
fn checkpoints_move_from_host_memory_into_the_swap_file_and_beside_offloaded_parameters() {
    // The other ways across: saved from host memory and resumed into the swap file; saved from
    // the swap file and resumed with the units' shards in a parameter file too. Reference: the
    // run without the stop, in host memory.
    let host = settings(
        Stage::Zero3,
        PrecisionSettings::bf16(),
        OptimizerOffload::Cpu { threads: 1 },
    );
    let whole = run(host.clone(), 2, 0..STEPS, None, None);
    let (swap, params) = (scratch("across-swap"), scratch("across-params"));
    let swapped = settings(Stage::Zero3, PrecisionSettings::bf16(), nvme(&swap));
    let mut beside = swapped.clone();
    beside.offload_param = ParamOffload::Nvme {
        path: params.clone(),
        max_in_cpu: 0,
    };
    let ways = [
        ("from host memory into the swap file", host, swapped.clone()),
        ("from the swap file beside a parameter file", swapped, beside),
    ];
    for (i, (label, first, second)) in ways.into_iter().enumerate() {
        let ckpt = scratch(&format!("across-ckpt-{i}"));
        let a = run(first, 2, 0..2, None, Some(&ckpt));
        let b = run(second, 2, 2..STEPS, Some(&ckpt), None);
        assert_resumed(label, &a, &b, &whole);
        let _ = std::fs::remove_dir_all(&ckpt);
    }
    let _ = std::fs::remove_dir_all(&swap);
    let _ = std::fs::remove_dir_all(&params);
}

#[test]
fn the_memory_report_puts_the_state_on_nvme() {
    let dir = scratch("report");
    let reports = on_ranks(1, |_, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let mut out = Vec::new();
        for offload in [OptimizerOffload::Cpu { threads: 1 }, nvme(&dir)] {
            let s = settings(Stage::Zero2, PrecisionSettings::bf16(), offload);
            let (model, mut optim) =
                zero_burn::initialize_settings(s, Net::<AB>::whole(&device), group.clone(), comm.clone())
                    .expect("init");
            let x = rows::<AB>(0..ROWS, 4, 0, &device).cast(burn::tensor::DType::BF16);
            let y = rows::<AB>(0..ROWS, 3, 5, &device).cast(burn::tensor::DType::BF16);
            let loss = model.loss(x, y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            optim.try_step(0.01, model, grads).expect("step");
            // The swap files, while the optimizer holds them.
            let files = std::fs::read_dir(&dir).map_or(0, |d| d.count());
            out.push((optim.memory(), files));
        }
        out
    })
    .remove(0);
    let (reports, files): (Vec<_>, Vec<_>) = reports.into_iter().unzip();
    assert_eq!(files, vec![0, 1], "one swap file for the rank, under nvme only");
    let (host, nv) = (&reports[0], &reports[1]);
    assert!(host.master_weights.current > 0 && host.locations.master_weights.host == host.master_weights.current);
    assert_eq!(nv.master_weights.current, 0, "nvme: no masters in memory");
    assert_eq!(nv.locations.master_weights.nvme, host.master_weights.current);
    assert_eq!(nv.locations.optimizer_state.nvme, host.optimizer_state.current);
    // In memory: the streaming buffers (2 buffers of 29 elements of the master and Adam's two
    // moments), not the state (on a model this small they are the larger).
    assert!(
        nv.locations.optimizer_state.host >= 2 * 29 * 3 * 4,
        "{:?}",
        nv.locations
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nvme_with_one_buffer_accumulation_and_sgd_momentum() {
    // One buffer: no overlap at all (read, step, write one chunk at a time); chunks of 13
    // elements; two micro-batches accumulated by Burn's `GradientsAccumulator`. SGD with
    // momentum: its buffer starts as the first gradient, decided by the step count that every
    // chunk must see.
    let sgd = OptimizerSpec::Sgd(SgdSpec {
        lr: 0.05,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.01,
        nesterov: true,
    });
    let runs = [
        ("Adam bf16", Stage::Zero2, PrecisionSettings::bf16(), None),
        ("SGD fp32", Stage::Zero1, PrecisionSettings::fp32(), Some(sgd.clone())),
        ("SGD bf16", Stage::Zero3, PrecisionSettings::bf16(), Some(sgd)),
    ];
    for (name, stage, precision, optimizer) in runs {
        let label = format!("{name} {stage:?}: one buffer, two micro-batches");
        let dir = scratch(&format!("one-buffer-{stage:?}"));
        let mut host = settings(stage, precision, OptimizerOffload::Cpu { threads: 1 });
        if let Some(spec) = optimizer {
            host.optimizer = spec;
        }
        let mut swapped = host.clone();
        swapped.offload_optimizer = OptimizerOffload::Nvme {
            path: dir.clone(),
            buffer_count: 1,
            chunk_elements: 13,
            threads: 1,
        };
        let want = run_accumulated(host, 2, 2, 0..STEPS, None, None);
        let got = run_accumulated(swapped, 2, 2, 0..STEPS, None, None);
        assert_eq!(trained(&got), trained(&want), "{label}: nvme against host memory");
        let _ = std::fs::remove_dir_all(&dir);
    }
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
            chunk_elements: zero_core::offload::MIN_CHUNK_ELEMENTS,
            threads: 0
        }
    );
    // sub_group_size is held within the streaming bounds: 1000 elements is raised to the
    // smallest chunk (above), DeepSpeed's default 1e9 lowered to the largest.
    let default = settings(r#"{"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}"#)
        .expect("nvme offload is accepted");
    assert!(matches!(
        default.offload_optimizer,
        OptimizerOffload::Nvme { chunk_elements, .. } if chunk_elements == zero_core::offload::MAX_CHUNK_ELEMENTS
    ));
    let err =
        settings(r#"{"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}"#).expect_err("partial offload");
    assert!(err.to_string().contains("ratio"), "{err}");
}
