//! Shared by the checkpoint tests: a synthetic model state whose every element is a known
//! function of (parameter, element, step), saved by ranks on threads, so that whatever a load
//! or a conversion returns can be checked against that function (the reference).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_core::checkpoint::{self, GroupShard, ModelRecord, SaveRequest};
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::partition::{LayoutBuilder, ParamSpec, PartitionLayout, Placement};

/// Parameter shapes: sizes that world sizes 2-4 do not divide, one matrix, one scalar-like.
pub fn specs(prefix: &str) -> Vec<ParamSpec> {
    [vec![7, 3], vec![13], vec![1], vec![10, 10], vec![9], vec![5, 4]]
        .into_iter()
        .enumerate()
        .map(|(i, shape)| ParamSpec {
            name: format!("{prefix}layer{i}.weight"),
            shape,
        })
        .collect()
}

/// A layout like the engines build: buckets (stages 0-2: replicated for 0, sharded for 1-2) or
/// one sharded group of large parameters and one replicated group of small ones (stage 3).
pub fn layout(params: Vec<ParamSpec>, world: usize, stage: u8) -> PartitionLayout {
    let all: Vec<usize> = (0..params.len()).collect();
    let numels: Vec<usize> = params.iter().map(ParamSpec::numel).collect();
    let mut b = LayoutBuilder::new(params, world, 4);
    match stage {
        0 => drop(b.buckets(&all, 40, Placement::Replicated)),
        3 => {
            let (small, large): (Vec<usize>, Vec<usize>) = all.iter().partition(|&&p| numels[p] < 10);
            b.group(large, Placement::Sharded);
            b.group(small, Placement::Replicated);
        }
        _ => drop(b.buckets(&all, 40, Placement::Sharded)),
    }
    b.finish()
}

/// The reference value of element `i` of parameter `p` at `step`, for buffer `kind`
/// (0: master, 1: exp_avg, 2: exp_avg_sq).
pub fn value(p: usize, i: usize, step: u64, kind: usize) -> f32 {
    let x = ((p * 1009 + i * 31 + step as usize * 7) as f32 * 0.013).sin();
    match kind {
        0 => x,
        1 => -0.5 * x,
        _ => x * x + 1e-3,
    }
}

/// `rank`'s owned slice of `group` for buffer `kind` (padding zero).
pub fn owned(layout: &PartitionLayout, group: usize, rank: usize, step: u64, kind: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; layout.owned_len(group)];
    for s in layout.segments(group, rank) {
        for (l, i) in s.local.zip(s.in_param) {
            v[l] = value(s.param, i, step, kind);
        }
    }
    v
}

/// The full parameter `p` at `step`.
pub fn full(layout: &PartitionLayout, p: usize, step: u64) -> Vec<f32> {
    (0..layout.params[p].numel()).map(|i| value(p, i, step, 0)).collect()
}

/// Runs `f(rank, group)` on `world` threads; results in rank order.
pub fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let groups = ThreadGroup::new_group(world).expect("thread group");
    let f = Arc::new(f);
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, g)| {
            let f = f.clone();
            std::thread::spawn(move || f(rank, g as Arc<dyn ProcessGroup>))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Saves the reference state at `step` from `world` ranks at `stage` under `dir/tag`.
pub fn save_reference(dir: &Path, tag: &str, world: usize, stage: u8, step: u64, prefix: &str) {
    save_specs(dir, tag, world, stage, step, specs(prefix));
}

/// Saves the reference state of parameters `params` (see [`save_reference`]).
pub fn save_specs(dir: &Path, tag: &str, world: usize, stage: u8, step: u64, params: Vec<ParamSpec>) {
    save_model(dir, tag, world, stage, step, params, None);
}

/// [`save_specs`] with the model recorded as `model`.
pub fn save_model(
    dir: &Path,
    tag: &str,
    world: usize,
    stage: u8,
    step: u64,
    params: Vec<ParamSpec>,
    model: Option<ModelRecord>,
) {
    let dir = dir.to_path_buf();
    let tag = tag.to_string();
    on_ranks(world, move |rank, comm| {
        let layout = layout(params.clone(), world, stage);
        let bufs: Vec<[Vec<f32>; 3]> = (0..layout.groups.len())
            .map(|g| [0, 1, 2].map(|k| owned(&layout, g, rank, step, k)))
            .collect();
        let request = SaveRequest {
            layout: &layout,
            groups: bufs
                .iter()
                .map(|b| GroupShard {
                    master: &b[0],
                    state: vec![("exp_avg", &b[1][..]), ("exp_avg_sq", &b[2][..])],
                })
                .collect(),
            stage,
            global_step: step,
            skipped_steps: 0,
            optimizer_name: "adamw".into(),
            optimizer_step: step,
            group_steps: Vec::new(),
            lr_next: Some(1e-3),
            loss_scaler: None,
            rng: None,
            client_state: serde_json::json!({ "data_position": step * 24 }),
            model: model.clone(),
            tensor_parallel: None,
            tensor_ranks: None,
            lineage: None,
            options: Default::default(),
        };
        checkpoint::save(comm.as_ref(), &dir, &tag, &request).expect("save");
    });
}

/// A fresh, empty directory under the system's temporary directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}
