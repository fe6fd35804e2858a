//! `ZeroOptimizer::save_16bit_model` and `save_weights`: the whole model written from the
//! fp32 masters, group by group, at stage 3 (every unit cut over 3 ranks, so the groups'
//! padding differs by rank), with the state on the device and in host buffers.
//!
//! References: the model's own weights after the steps (each unit gathered whole; in fp32 the
//! module holds the masters themselves), rounded to bf16 by `half` for the 16-bit file; and the
//! same run's checkpoint consolidated by `zero to-fp32`'s code (`to_fp32`), a separate path from
//! the shard files.

use crate::sharded_support;
use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use sharded_support::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use zero_burn::params::read_values;
use zero_burn::{EngineSettings, OptimizerOffload, Stage, ZeroOptimizer};
use zero_core::checkpoint::{to_fp32, Checkpoint, HalfDtype, NameMap};
use zero_core::optim::OptimizerSpec;

type AB = Autodiff<Flex>;
const WORLD: usize = 3;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-sharded-export-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// Every tensor of a safetensors file: name → (dtype, bytes).
fn read(path: &Path) -> HashMap<String, (safetensors::Dtype, Vec<u8>)> {
    let bytes = std::fs::read(path).expect("exported file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.data().to_vec())))
        .collect()
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Two steps at stage 3 on `WORLD` ranks, then the exports and a checkpoint under `dir`;
/// returns rank 0's units whole (weight, then bias).
fn train_and_export(dir: &Path, host: bool) -> Vec<Vec<Vec<f32>>> {
    let d = dir.to_path_buf();
    let runs = on_ranks(WORLD, move |rank, comm| {
        let device = Default::default();
        let group = zero_burn::DeviceCollective::<Flex>::host_group(comm.as_ref()).expect("a host group");
        let mut model = Net::<AB>::new(comm, &device);
        let mut settings = EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw());
        if host {
            settings.offload_optimizer = OptimizerOffload::Cpu { threads: 1 };
        }
        let mut optim = ZeroOptimizer::new(settings, group).expect("optimizer");
        let per = ROWS / 2;
        for step in 0..2 {
            // Ranks 0 and 1 take half the rows each; rank 2 the first half again.
            let mine = (rank % 2) * per..(rank % 2 + 1) * per;
            let x = rows::<AB>(mine.clone(), 4, step, &device);
            let loss = model.loss(x, rows::<AB>(mine, 3, 5 + step, &device));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.try_step(1e-2, model, grads).expect("step");
        }
        assert_eq!(optim.tensor_state(), Some(!host), "where the state lives");
        optim
            .save_16bit_model(d.join("bf16/model.safetensors"), HalfDtype::Bf16)
            .expect("16-bit save");
        let map = NameMap {
            rules: vec![NameMap::parse_rule("units.=layer.").expect("rule")],
            ..NameMap::default()
        };
        optim
            .save_weights(d.join("f32/model.safetensors"), None, &|n| map.apply(n))
            .expect("f32 save");
        optim
            .save_checkpoint(d.join("ckpt"), None, &serde_json::Value::Null)
            .expect("save");
        model
            .units
            .iter()
            .map(|u| {
                let mut parts = Vec::new();
                read_values::<AB, _>(&u.gathered().expect("gather"), |_, v| parts.push(v));
                parts
            })
            .collect::<Vec<_>>()
    });
    runs.into_iter().next().expect("rank 0")
}

#[test]
fn the_exports_hold_the_models_weights_from_either_state() {
    for host in [false, true] {
        let dir = scratch(if host { "host" } else { "device" });
        let units = train_and_export(&dir, host);
        let bf16 = read(&dir.join("bf16/model.safetensors"));
        let f32s = read(&dir.join("f32/model.safetensors"));
        let c = Checkpoint::open(&dir.join("ckpt"), None).expect("open");
        to_fp32(&c, &dir.join("consolidated"), None, &|n| Some(n.to_string())).expect("to_fp32");
        let consolidated = read(&dir.join("consolidated/model.safetensors"));
        assert_eq!(bf16.len(), 2 * units.len(), "host {host}: a weight and a bias per unit");
        for (u, parts) in units.iter().enumerate() {
            for (name, values) in [("weight", &parts[0]), ("bias", &parts[1])] {
                let full = format!("units.{u}.{name}");
                let expect_bf16: Vec<u8> = values
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect();
                let (dtype, bytes) = &bf16[&full];
                assert_eq!(*dtype, safetensors::Dtype::BF16);
                assert_eq!(bytes, &expect_bf16, "host {host}: {full} in the 16-bit export");
                let renamed = format!("layer.{u}.{name}");
                assert_eq!(
                    f32s[&renamed].1,
                    le_bytes(values),
                    "host {host}: {renamed} in the f32 export"
                );
                assert_eq!(
                    consolidated[&full].1,
                    le_bytes(values),
                    "host {host}: {full} consolidated"
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
