//! `offload_param` on the `ZeroModule` path: each cut unit's shard kept in a file on NVMe (or in
//! host memory, under `max_in_cpu`) instead of on the model's device, read for every gather.
//!
//! Reference: the same run with the shards on the device (the stored bytes are the shard's, so
//! the runs agree bit for bit), at worlds 1 and 2, fp32 and bf16, with the optimizer's state on
//! the device and offloaded (to host memory; and to its own NVMe swap file with two micro-batches
//! accumulated by Burn's `GradientsAccumulator`, the shards all in the file or split by
//! `max_in_cpu`); the memory report places the shard bytes; for the resume, the same run
//! without the stop. The model is sharded_support's three linear units (a skip connection), cut
//! by `initialize_settings`. The config's `offload_param` sections become these settings.

use crate::sharded_support;
use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use sharded_support::*;
use std::path::{Path, PathBuf};
use zero_burn::params::read_values;
use zero_burn::{EngineSettings, OptimizerOffload, ParamOffload, PrecisionSettings, Stage, ZeroOptimizer};

type AB = Autodiff<Flex>;
const STEPS: usize = 4;

fn scratch(name: &str) -> PathBuf {
    sharded_support::scratch("param-offload", name)
}

/// Every shard in the file (`max_in_cpu` 0), or every shard in host memory (room for all).
fn nvme(dir: &Path, in_cpu: bool) -> ParamOffload {
    ParamOffload::Nvme {
        path: dir.to_path_buf(),
        max_in_cpu: if in_cpu { usize::MAX } else { 0 },
    }
}

fn settings(precision: PrecisionSettings, optimizer: OptimizerOffload, params: ParamOffload) -> EngineSettings {
    offload_settings(Stage::Zero3, precision, optimizer, params)
}

/// Each unit gathered whole, as bits: from the model's `valid()` copy, whose gathers leave no
/// autodiff graph holding the units behind.
fn gathered(model: &Net<AB>) -> Vec<Vec<u32>> {
    model
        .valid()
        .units
        .iter()
        .map(|u| {
            let mut v = Vec::new();
            read_values::<Flex, _>(&u.gathered().expect("gather"), |_, p| {
                v.extend(p.iter().map(|x| x.to_bits()))
            });
            v
        })
        .collect()
}

/// One step of rank `rank` of `world` on batch `step`; returns the loss's bits.
fn step(
    model: Net<AB>,
    optim: &mut ZeroOptimizer,
    rate: f64,
    rank: usize,
    world: usize,
    step: usize,
) -> (Net<AB>, u32) {
    let device = Default::default();
    // The compute dtype (an offloaded unit's parameter is a placeholder of its own dtype).
    let dtype = model.units[0].gathered().expect("gather").weight.val().dtype();
    let per = ROWS / world;
    let mine = rank * per..(rank + 1) * per;
    let x = rows::<AB>(mine.clone(), 4, step, &device).cast(dtype);
    let loss = model.loss(x, rows::<AB>(mine, 3, 5 + step, &device).cast(dtype));
    let bits = loss.clone().into_scalar().elem::<f32>().to_bits();
    let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
    (optim.try_step(rate, model, grads).expect("step"), bits)
}

use burn::tensor::ElementConversion;

/// [`train_net`] with one micro-batch a step.
fn run(
    settings: EngineSettings,
    world: usize,
    steps: std::ops::Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<NetRun> {
    train_net(&settings, world, 1, steps, load, save)
}

/// [`train_net`] from the start without a checkpoint, each step's rows split into two
/// micro-batches whose gradients Burn's `GradientsAccumulator` sums (each loss halved); a
/// step's loss is its first micro-batch's.
fn run_accumulated(settings: EngineSettings, world: usize) -> Vec<NetRun> {
    train_net(&settings, world, 2, 0..STEPS, None, None)
}

/// Bytes of this rank's shards of the three units at `world` ranks, in `bytes`-byte elements.
fn shard_bytes(world: usize, bytes: usize) -> usize {
    SIZES
        .iter()
        .map(|&(i, o)| zero_burn::sharded::shard_len(i * o + o, world) * bytes)
        .sum()
}

#[test]
fn offloaded_shards_train_bit_for_bit_as_shards_on_the_device() {
    for world in [1usize, 2] {
        for (dtype, precision, bytes) in [
            ("fp32", PrecisionSettings::fp32(), 4),
            ("bf16", PrecisionSettings::bf16(), 2),
        ] {
            for optimizer in [OptimizerOffload::None, OptimizerOffload::Cpu { threads: 1 }] {
                let label = format!("world {world} {dtype} optimizer {optimizer:?}");
                let want = run(
                    settings(precision.clone(), optimizer.clone(), ParamOffload::None),
                    world,
                    0..STEPS,
                    None,
                    None,
                );
                for in_cpu in [false, true] {
                    let dir = scratch(&format!("{world}-{dtype}-{in_cpu}"));
                    let got = run(
                        settings(precision.clone(), optimizer.clone(), nvme(&dir, in_cpu)),
                        world,
                        0..STEPS,
                        None,
                        None,
                    );
                    for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            (&g.losses, &g.units),
                            (&w.losses, &w.units),
                            "{label}, in cpu {in_cpu}: rank {rank}"
                        );
                        // Every parameter is a unit's: none is left on the device, and the
                        // optimizer keeps no copy of the shards between steps.
                        let shards = shard_bytes(world, bytes);
                        let placed = if in_cpu { [0, shards, 0] } else { [0, 0, shards] };
                        assert_eq!(
                            g.params_placed, placed,
                            "{label}, in cpu {in_cpu}: rank {rank}'s parameter bytes"
                        );
                        assert_eq!(
                            w.params_placed,
                            [shards, 0, 0],
                            "{label}: rank {rank}'s parameter bytes"
                        );
                    }
                    // The parameter files go with the model.
                    let left: Vec<_> = std::fs::read_dir(&dir)
                        .map(|d| d.flatten().map(|e| e.path()).collect())
                        .unwrap_or_default();
                    assert!(left.is_empty(), "{label}: files left behind: {left:?}");
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
    }
}

#[test]
fn the_shards_are_in_the_file_while_the_model_holds_placeholders() {
    for optimizer in [OptimizerOffload::None, OptimizerOffload::Cpu { threads: 1 }] {
        let dir = scratch(&format!("file-{}", optimizer == OptimizerOffload::None));
        on_ranks(2, |rank, comm| {
            let device = Default::default();
            let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
            let s = settings(PrecisionSettings::bf16(), optimizer.clone(), nvme(&dir, false));
            let (mut model, mut optim) =
                zero_burn::initialize_settings(s, Net::<AB>::whole(&device), group, comm).expect("initialize");
            // The parameter's own data is a broadcast NaN, before and after steps (a step
            // writes the new shard into the file, not into the model): the values are only in
            // the file, which holds this rank's shards and nothing else.
            let placeholders = |model: &Net<AB>| {
                for unit in &model.units {
                    let held: Vec<f32> = unit.shard().val().into_data().convert::<f32>().into_vec().unwrap();
                    assert!(
                        held.iter().all(|v| v.is_nan()),
                        "{optimizer:?}: a placeholder holds no values"
                    );
                }
            };
            placeholders(&model);
            let before = gathered(&model);
            for s in 0..2 {
                model = step(model, &mut optim, 0.01, rank, 2, s).0;
                placeholders(&model);
            }
            assert_ne!(
                gathered(&model),
                before,
                "{optimizer:?}: the steps changed the stored shards"
            );
            let file = std::fs::read_dir(&dir)
                .expect("the parameter directory")
                .flatten()
                .find(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(&format!("zero_params_rank{rank}-"))
                })
                .expect("this rank's parameter file");
            let len = file.metadata().expect("metadata").len() as usize;
            assert_eq!(
                len,
                shard_bytes(2, 2),
                "{optimizer:?}: rank {rank}'s file holds its bf16 shards"
            );
            model
        });
        // (Each rank's file was removed with its model.)
        let left = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
        assert_eq!(left, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_run_resumed_from_a_checkpoint_with_offloaded_shards_is_bit_for_bit_the_run_without_the_stop() {
    let (swap, ckpt) = (scratch("resume-swap"), scratch("resume-ckpt"));
    for optimizer in [OptimizerOffload::None, OptimizerOffload::Cpu { threads: 1 }] {
        let s = settings(PrecisionSettings::bf16(), optimizer.clone(), nvme(&swap, false));
        let whole = run(s.clone(), 2, 0..STEPS, None, None);
        let first = run(s.clone(), 2, 0..2, None, Some(&ckpt));
        let second = run(s, 2, 2..STEPS, Some(&ckpt), None);
        assert_resumed(&format!("{optimizer:?}"), &first, &second, &whole);
        let _ = std::fs::remove_dir_all(&ckpt);
    }
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn a_burn_record_carries_the_offloaded_values_and_loads_back_into_the_store() {
    let dir = scratch("record");
    on_ranks(2, |rank, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let offloaded = settings(PrecisionSettings::fp32(), OptimizerOffload::None, nvme(&dir, false));
        let (mut model, mut optim) = zero_burn::initialize_settings(
            offloaded.clone(),
            Net::<AB>::whole(&device),
            group.clone(),
            comm.clone(),
        )
        .expect("initialize");
        for s in 0..2 {
            model = step(model, &mut optim, 0.01, rank, 2, s).0;
        }
        let trained = gathered(&model);
        let bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(model.clone().into_record(), ())
            .expect("record");
        // Into a fresh model whose shards are offloaded, and into one whose shards are not:
        // both hold the trained values (a fresh model holds the initial ones).
        let on_device = settings(PrecisionSettings::fp32(), OptimizerOffload::None, ParamOffload::None);
        for (label, s) in [("offloaded", offloaded.clone()), ("on the device", on_device)] {
            let (fresh, _) = zero_burn::initialize_settings(s, Net::<AB>::whole(&device), group.clone(), comm.clone())
                .expect("initialize");
            assert_ne!(gathered(&fresh), trained, "{label}: the fresh model starts elsewhere");
            let record = BinBytesRecorder::<FullPrecisionSettings>::default()
                .load(bytes.clone(), &device)
                .expect("load");
            let loaded = fresh.load_record(record);
            assert_eq!(gathered(&loaded), trained, "{label}: rank {rank}");
            if label == "offloaded" {
                for unit in &loaded.units {
                    let held: Vec<f32> = unit.shard().val().into_data().convert::<f32>().into_vec().unwrap();
                    assert!(held.iter().all(|v| v.is_nan()), "the loaded values went into the store");
                }
            }
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn param_and_optimizer_both_on_nvme_with_accumulation() {
    // The optimizer's state streamed from its own swap file too (chunks of 7 elements, 3
    // buffers), two micro-batches per step. The shards all in the parameter file, or the
    // first unit's in host memory (`max_in_cpu` its shard) and the others in the file.
    let dir = scratch("both");
    let optimizer = OptimizerOffload::Nvme {
        path: dir.join("optimizer"),
        buffer_count: 3,
        chunk_elements: 7,
        threads: 1,
    };
    let world = 2;
    let want = run_accumulated(
        settings(PrecisionSettings::bf16(), optimizer.clone(), ParamOffload::None),
        world,
    );
    let unit = |u: usize| {
        let (i, o) = SIZES[u];
        zero_burn::sharded::shard_len(i * o + o, world)
    };
    for max_in_cpu in [0, unit(0)] {
        let label = format!("params and optimizer on nvme, max_in_cpu {max_in_cpu}, two micro-batches");
        let params = ParamOffload::Nvme {
            path: dir.join("params"),
            max_in_cpu,
        };
        let got = run_accumulated(settings(PrecisionSettings::bf16(), optimizer.clone(), params), world);
        for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!((&g.losses, &g.units), (&w.losses, &w.units), "{label}: rank {rank}");
            // bf16: 2 bytes an element. What the run without offload_param holds on the
            // device is now in host memory (the units under `max_in_cpu`) or in the file.
            let in_host = if max_in_cpu == 0 { 0 } else { 2 * unit(0) };
            let shards = shard_bytes(world, 2);
            assert_eq!(
                w.params_placed[0], shards,
                "{label}: rank {rank}'s shards on the device without offload_param"
            );
            assert_eq!(
                g.params_placed,
                [0, w.params_placed[1] + in_host, shards - in_host],
                "{label}: rank {rank}'s parameter bytes"
            );
        }
    }
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
    // Below stage 3 every rank holds the whole parameters: the section is ignored (as DeepSpeed
    // does; the parser warns), and the run trains.
    let whole = settings(2, r#"{"device": "cpu"}"#).expect("stage 2 runs");
    assert_eq!(whole.offload_param, ParamOffload::None);
}

#[test]
fn a_parameter_file_that_cannot_be_read_back_is_an_error_naming_it() {
    let dir = scratch("unreadable");
    on_ranks(1, |_, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let s = settings(PrecisionSettings::bf16(), OptimizerOffload::None, nvme(&dir, false));
        let (model, optim) =
            zero_burn::initialize_settings(s, Net::<AB>::whole(&device), group, comm).expect("initialize");
        // The file loses its contents under the running model.
        let file = std::fs::read_dir(&dir)
            .expect("the parameter directory")
            .flatten()
            .next()
            .expect("the parameter file")
            .path();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .and_then(|f| f.set_len(0))
            .expect("truncate");
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let gather = model.units[0].gathered().expect_err("a gather reads the shard");
        assert!(gather.to_string().contains(&name), "{gather}");
        let Err(sync) = optim.synchronize(model) else {
            panic!("reading the model's values succeeded")
        };
        assert!(sync.to_string().contains(&name), "{sync}");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn units_cut_without_offload_param_under_settings_with_it_are_an_error() {
    // Cut by `shard_units` (no store), then handed to an optimizer whose settings put the
    // parameters on NVMe: the first step says so instead of keeping the shards on the device.
    let dir = scratch("cut-without");
    on_ranks(2, |rank, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let model = Net::<AB>::new(comm, &device);
        let s = settings(PrecisionSettings::fp32(), OptimizerOffload::None, nvme(&dir, false));
        let mut optim = ZeroOptimizer::new(s, group).expect("optimizer");
        let x = rows::<AB>(rank * 4..rank * 4 + 4, 4, 0, &device);
        let loss = model.loss(x, rows::<AB>(rank * 4..rank * 4 + 4, 3, 5, &device));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let Err(e) = optim.try_step(0.01, model, grads) else {
            panic!("the step ran with the shards on the device")
        };
        assert!(
            e.to_string().contains("offload_param") && e.to_string().contains("UnitPlan"),
            "{e}"
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}
