//! Saving: every rank writes its shard, rank 0 writes the metadata, and the tag becomes visible
//! (and `latest` names it) only once everything is on disk.
//!
//! Order of events, each file written atomically (temporary name, fsync, rename):
//!
//! 1. every rank checks that its master weights are finite (a diverged run is not saved over a
//!    good one), and all learn whether any is not; rank 0 looks for tags of another trajectory
//!    in `DIR` ([`super::Lineage`]: saved after the step the run's state comes from, by a run it
//!    does not continue) and refuses to save among them unless told to discard them; every rank
//!    checks that the run's scalars can be recorded (finite floats); rank 0 clears
//!    `DIR/TAG.partial`; barrier;
//! 2. every rank writes `DIR/TAG.partial/rank_XXXXX.safetensors` and reports its checksums;
//! 3. rank 0 writes `zero_meta.json` there; barrier;
//! 4. every rank reads it back as a loader would (parse, checksum, consistency) and checks its
//!    own shard against it (the file record it computed while writing, the length on disk, the
//!    header and its tensors); rank 0 also checks that the metadata parsed is the metadata it
//!    wrote; barrier. A checkpoint that would not load fails here, naming the file, and is never
//!    published;
//! 5. rank 0 renames `TAG.partial` to `TAG` (an older `TAG` is first moved to `TAG.replaced`,
//!    removed after) and rewrites `latest`, then removes what [`super::SaveOptions`] asks
//!    (the other trajectory's tags, the tags beyond `keep_last`); barrier.
//!
//! A process killed anywhere in this sequence leaves the previous checkpoint and `latest` as
//! they were (or, killed between the two renames of step 5, the old `TAG` as `TAG.replaced`,
//! which the loader accepts). A shared filesystem is assumed, as for any multi-rank checkpoint.

use super::atomic;
use super::collective::{agree, all_gather_bytes};
use super::error::CheckpointError;
use super::format::{
    self, CheckpointMeta, FileRecord, ModelRecord, OptimizerRecord, TensorParallelRecord, FORMAT_VERSION, LATEST_FILE,
    META_FILE,
};
use super::load::{resolve_tag, Checkpoint, LoadedGroup};
use super::retention::{self, Lineage, SaveOptions, Saved, SavedTag};
use super::writer::{SafetensorsStream, TensorEntry};
use crate::comm::ProcessGroup;
use crate::loss_scaler::LossScalerState;
use crate::partition::PartitionLayout;
use safetensors::tensor::Dtype;
use std::path::Path;

/// One group's owned slice on this rank.
#[derive(Debug)]
pub struct GroupShard<'a> {
    /// fp32 master weights.
    pub master: &'a [f32],
    /// Optimizer state buffers, by name, each as long as `master`; none for a group whose
    /// optimizer state is not made yet (its parameters have not trained), which is written as
    /// zeros under the other groups' names (an optimizer's state before its first step).
    pub state: Vec<(&'a str, &'a [f32])>,
}

impl GroupShard<'_> {
    /// The slices, copied.
    pub fn copied(&self) -> LoadedGroup {
        LoadedGroup {
            master: self.master.to_vec(),
            state: self.state.iter().map(|(n, b)| (n.to_string(), b.to_vec())).collect(),
        }
    }
}

/// What one rank saves, and the run's scalar state.
#[derive(Debug)]
pub struct SaveRequest<'a> {
    /// The engine's layout at the current world size.
    pub layout: &'a PartitionLayout,
    /// This rank's slice of every group, in group order.
    pub groups: Vec<GroupShard<'a>>,
    /// ZeRO stage.
    pub stage: u8,
    /// Optimizer steps taken by the engine.
    pub global_step: u64,
    /// Of those, the steps skipped (fp16 overflow).
    pub skipped_steps: u64,
    /// Optimizer name.
    pub optimizer_name: String,
    /// The optimizer's own step count: the most steps any group has taken.
    pub optimizer_step: u64,
    /// Each group's step count where they differ (a group whose parameters trained for fewer
    /// steps, or none yet); empty: every group took `optimizer_step`.
    pub group_steps: Vec<u64>,
    /// Learning rate of the next step.
    pub lr_next: Option<f64>,
    /// Loss scaler state, if any.
    pub loss_scaler: Option<LossScalerState>,
    /// RNG state, if any.
    pub rng: Option<serde_json::Value>,
    /// The training loop's own state.
    pub client_state: serde_json::Value,
    /// The model, for tools that export the checkpoint (`None`: names stay the engine's).
    pub model: Option<ModelRecord>,
    /// With tensor parallelism: this tensor rank, and how the parameters are split.
    pub tensor_parallel: Option<TensorParallelRecord>,
    /// With tensor parallelism: the tensor ranks that save the other slices beside this
    /// group's at the same time (each over its own data ranks). The refusal of diverged weights
    /// is agreed over them too, so that no tensor rank publishes while another refuses.
    pub tensor_ranks: Option<&'a dyn ProcessGroup>,
    /// The run's tags, against which the directory's others are another trajectory's (`None`:
    /// not looked for, as for a tool that writes one checkpoint).
    pub lineage: Option<&'a Lineage>,
    /// What the save does with the directory's other tags.
    pub options: SaveOptions,
}

/// Saves every rank's part under `DIR/TAG` and points `latest` at it; every rank calls this.
/// Returns the tag directory and, on rank 0, the tags it removed ([`SaveOptions`]).
pub fn save(
    comm: &dyn ProcessGroup,
    dir: &Path,
    tag: &str,
    request: &SaveRequest<'_>,
) -> Result<Saved, CheckpointError> {
    format::check_tag(dir, tag)?;
    let rank = comm.rank();
    let staging = dir.join(format!("{tag}.partial"));
    // Refused before anything is written: weights that diverged, tags of another trajectory
    // this save would replace or leave beside its own, and a value the metadata cannot hold
    // exactly.
    check_weights(comm, request)?;
    let others = check_other_tags(comm, dir, tag, request)?;
    let prepared = format::check_finite(request.lr_next, request.loss_scaler.as_ref()).and_then(|()| {
        if rank == 0 {
            prepare_staging(&staging)
        } else {
            Ok(())
        }
    });
    agree(comm, "save", prepared)?;

    let staged = (|| {
        let written = write_shard(&staging, rank, request);
        let record = agree(comm, "save", written)?;
        let record_bytes = serde_json::to_vec(&record).unwrap_or_default();
        let records = all_gather_bytes(comm, &record_bytes)?;

        let meta = if rank == 0 {
            write_meta(tag, &staging, request, comm.world_size(), &records).map(Some)
        } else {
            Ok(None)
        };
        let meta = agree(comm, "save", meta)?;

        let verified =
            read_back(&staging, rank, &record, meta.as_ref()).map_err(|e| CheckpointError::ReadBack(Box::new(e)));
        agree(comm, "save", verified)
    })();
    if let Err(e) = staged {
        // Every rank has stopped writing (each failed at the same agreement): what was staged
        // goes, rather than stay on a disk that may be full. The checkpoints before it are
        // untouched.
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&staging);
        }
        return Err(e);
    }

    let published = if rank == 0 {
        publish(dir, tag, &staging).and_then(|()| retention::prune(dir, tag, others, request.options))
    } else {
        Ok((Vec::new(), Vec::new()))
    };
    let (discarded, rotated) = agree(comm, "save", published)?;
    if let Some(lineage) = request.lineage {
        lineage.saved(dir, tag);
    }
    Ok(Saved {
        tag_dir: dir.join(tag),
        discarded,
        rotated,
    })
}

/// Rank 0: the tags of `dir` that are another trajectory's ([`Lineage::other_tags`]); refused
/// unless [`SaveOptions::discard_later_tags`]. Agreed over the ranks, and over the tensor ranks
/// (each saving its slice into a directory of its own), so that all save or none does.
fn check_other_tags(
    comm: &dyn ProcessGroup,
    dir: &Path,
    tag: &str,
    req: &SaveRequest<'_>,
) -> Result<Vec<SavedTag>, CheckpointError> {
    let Some(lineage) = req.lineage else {
        return Ok(Vec::new());
    };
    let own = if comm.rank() == 0 {
        let others = lineage.other_tags(dir);
        if others.is_empty() || req.options.discard_later_tags {
            Ok(others)
        } else {
            Err(CheckpointError::OtherTrajectory {
                dir: dir.to_path_buf(),
                tag: tag.to_string(),
                since_step: lineage.since_step(),
                tags: others,
            })
        }
    } else {
        Ok(Vec::new())
    };
    let own = agree(comm, "save", own);
    if let Some(tensor) = req.tensor_ranks.filter(|t| t.world_size() > 1) {
        let message = own.as_ref().err().map(|e| e.to_string());
        let heard = crate::comm::gather_failures(tensor, message.as_deref())?;
        if let (Ok(_), Some(first)) = (&own, heard.first()) {
            return Err(CheckpointError::Usage(format!(
                "not saved: tensor rank {}: {}",
                first.rank, first.message
            )));
        }
    }
    own
}

/// Fails on every rank, the same way, when any rank's master weights hold a NaN or an
/// infinity, naming the first such rank's parameter and element, and how many ranks hold one;
/// with tensor parallelism, over every tensor rank's data ranks.
fn check_weights(comm: &dyn ProcessGroup, req: &SaveRequest<'_>) -> Result<(), CheckpointError> {
    let own = first_non_finite(comm.rank(), req);
    let failures = crate::comm::gather_failures(comm, own.as_deref())?;
    let mut verdict = failures.first().map(|first| {
        let more = match failures.len() - 1 {
            0 => String::new(),
            1 => " (and 1 more rank holds NaN or infinities)".to_string(),
            n => format!(" (and {n} more ranks hold NaN or infinities)"),
        };
        format!("{} on rank {}{more}", first.message, first.rank)
    });
    if let Some(tensor) = req.tensor_ranks.filter(|t| t.world_size() > 1) {
        let heard = crate::comm::gather_failures(tensor, verdict.as_deref())?;
        verdict = heard.first().map(|f| format!("tensor rank {}: {}", f.rank, f.message));
    }
    match verdict {
        None => Ok(()),
        Some(detail) => Err(CheckpointError::Diverged { detail }),
    }
}

/// Where the first NaN or infinity lies in the parameters' master weights `rank` would write:
/// the parameter, the element and the value. Padding is not looked at: no parameter is there.
fn first_non_finite(rank: usize, req: &SaveRequest<'_>) -> Option<String> {
    for (g, shard) in req.groups.iter().enumerate() {
        if g >= req.layout.groups.len() || !format::shard_holds(req.layout, g, rank) {
            continue;
        }
        for s in req.layout.segments(g, rank) {
            let Some(values) = shard.master.get(s.local.clone()) else {
                continue;
            };
            if let Some(at) = values.iter().position(|v| !v.is_finite()) {
                return Some(format!(
                    "`{}` holds {} at element {}",
                    req.layout.params[s.param].name,
                    values[at],
                    s.in_param.start + at
                ));
            }
        }
    }
    None
}

fn prepare_staging(staging: &Path) -> Result<(), CheckpointError> {
    if staging.exists() {
        std::fs::remove_dir_all(staging).map_err(|e| CheckpointError::io(staging, "remove stale", e))?;
    }
    std::fs::create_dir_all(staging).map_err(|e| CheckpointError::io(staging, "create", e))
}

/// Writes this rank's shard file into the staging directory.
fn write_shard(staging: &Path, rank: usize, req: &SaveRequest<'_>) -> Result<FileRecord, CheckpointError> {
    let layout = req.layout;
    if req.groups.len() != layout.groups.len() {
        return Err(CheckpointError::Usage(format!(
            "{} group slices for a layout of {} groups",
            req.groups.len(),
            layout.groups.len()
        )));
    }
    let names = state_names(req);
    let mut entries = Vec::new();
    // What follows the header, in order: a slice, or that many zeros.
    let mut values: Vec<Result<&[f32], usize>> = Vec::new();
    for (g, shard) in req.groups.iter().enumerate() {
        if !format::shard_holds(layout, g, rank) {
            continue;
        }
        let len = layout.owned_len(g);
        let mut push = |name: String, v: &'_ [f32]| -> Result<(), CheckpointError> {
            if v.len() != len {
                return Err(CheckpointError::Usage(format!(
                    "rank {rank}: `{name}` has {} elements, its owned slice {len}",
                    v.len()
                )));
            }
            entries.push(TensorEntry {
                name,
                dtype: Dtype::F32,
                shape: vec![len],
            });
            Ok(())
        };
        push(format::master_tensor(g), shard.master)?;
        values.push(Ok(shard.master));
        for &(name, buf) in &shard.state {
            push(format::state_tensor(g, name), buf)?;
            values.push(Ok(buf));
        }
        if shard.state.is_empty() {
            for name in &names {
                entries.push(TensorEntry {
                    name: format::state_tensor(g, name),
                    dtype: Dtype::F32,
                    shape: vec![len],
                });
                values.push(Err(len));
            }
        }
    }
    let path = staging.join(format::shard_file_name(rank));
    let mut stream = SafetensorsStream::create(&path, &entries, None)?;
    let zeros = vec![0.0f32; 1 << 16];
    for v in values {
        match v {
            Ok(v) => stream.write_f32(v)?,
            Err(mut n) => {
                while n > 0 {
                    let k = n.min(zeros.len());
                    stream.write_f32(&zeros[..k])?;
                    n -= k;
                }
            }
        }
    }
    stream.finish()
}

/// The optimizer buffers' names: those of the groups that hold buffers (a group without
/// optimizer state holds none).
fn state_names<'a>(req: &SaveRequest<'a>) -> Vec<&'a str> {
    req.groups
        .iter()
        .find(|g| !g.state.is_empty())
        .map(|g| g.state.iter().map(|(n, _)| *n).collect())
        .unwrap_or_default()
}

/// The metadata of `req`, saved by `world` ranks under `tag`, without its shard files (no file
/// is written): what a checkpoint's `metadata` holds, and an in-memory record's description.
pub fn describe(req: &SaveRequest<'_>, world: usize, tag: &str) -> Result<CheckpointMeta, CheckpointError> {
    let names = state_names(req);
    if let Some(g) = req
        .groups
        .iter()
        .position(|g| !g.state.is_empty() && g.state.iter().map(|(n, _)| *n).ne(names.iter().copied()))
    {
        return Err(CheckpointError::Usage(format!(
            "group {g}'s optimizer state buffers differ from the other groups'"
        )));
    }
    let state_names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    Ok(CheckpointMeta {
        format_version: FORMAT_VERSION,
        tag: tag.to_string(),
        stage: req.stage,
        world_size: world,
        global_step: req.global_step,
        skipped_steps: req.skipped_steps,
        params: CheckpointMeta::param_records(req.layout),
        layout: req.layout.clone(),
        optimizer: OptimizerRecord {
            name: req.optimizer_name.clone(),
            step: req.optimizer_step,
            state_names,
            param_steps: if req.group_steps.iter().all(|&s| s == req.optimizer_step) {
                Vec::new()
            } else {
                let places = req.layout.places();
                let step = |g: usize| req.group_steps.get(g).copied().unwrap_or(req.optimizer_step);
                places.iter().map(|p| step(p.group)).collect()
            },
        },
        lr_next: req.lr_next,
        loss_scaler: req.loss_scaler,
        rng: req.rng.clone(),
        client_state: req.client_state.clone(),
        model: req.model.clone(),
        tensor_parallel: req.tensor_parallel.clone(),
        files: Vec::new(),
        meta_crc32: None,
    })
}

/// Rank 0: writes the metadata into the staging directory; returns what it wrote.
fn write_meta(
    tag: &str,
    staging: &Path,
    req: &SaveRequest<'_>,
    world: usize,
    records: &[Vec<u8>],
) -> Result<CheckpointMeta, CheckpointError> {
    let files = records
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice::<FileRecord>(b)
                .map_err(|e| CheckpointError::Usage(format!("rank {r}'s file record arrived unreadable: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut meta = describe(req, world, tag)?;
    meta.files = files;
    let bytes = meta.to_bytes()?;
    atomic::write_file(&staging.join(META_FILE), &bytes)?;
    atomic::sync_dir(staging)?;
    // What the read-back compares with: the sealed form, as written.
    meta.meta_crc32 = Some(meta.content_crc());
    Ok(meta)
}

/// Every rank, before anything is published: the staging directory read as a loader reads it.
/// The metadata must parse and verify (and, on rank 0, equal `written`, what was meant to be
/// recorded); this rank's shard must be the file it wrote (`record`, computed on the way out)
/// and hold the tensors the metadata's layout implies.
fn read_back(
    staging: &Path,
    rank: usize,
    record: &FileRecord,
    written: Option<&CheckpointMeta>,
) -> Result<(), CheckpointError> {
    let path = staging.join(META_FILE);
    let bytes = std::fs::read(&path).map_err(|e| CheckpointError::io(&path, "open", e))?;
    let meta = CheckpointMeta::from_bytes(&path, &bytes)?;
    if let Some(written) = written {
        if &meta != written {
            return Err(CheckpointError::Metadata {
                path,
                detail: "reads back other than it was written".into(),
            });
        }
    }
    let checkpoint = Checkpoint {
        tag_dir: staging.to_path_buf(),
        meta,
    };
    let shard = staging.join(format::shard_file_name(rank));
    if checkpoint.meta.files.get(rank) != Some(record) {
        return Err(CheckpointError::ShardMismatch {
            path: shard,
            detail: "the metadata records another length or other checksums than were written".into(),
        });
    }
    // Length, header (its chunk's checksum verified on disk) and tensor list, as a load opens it.
    checkpoint.open_shard(rank).map(drop)
}

/// Rank 0: the rename of the staging directory, then `latest`, read back.
fn publish(dir: &Path, tag: &str, staging: &Path) -> Result<(), CheckpointError> {
    let target = dir.join(tag);
    let replaced = dir.join(format!("{tag}.replaced"));
    if target.exists() {
        if replaced.exists() {
            std::fs::remove_dir_all(&replaced).map_err(|e| CheckpointError::io(&replaced, "remove", e))?;
        }
        std::fs::rename(&target, &replaced).map_err(|e| CheckpointError::io(&target, "rename", e))?;
    }
    std::fs::rename(staging, &target).map_err(|e| CheckpointError::io(staging, "rename", e))?;
    atomic::sync_dir(dir)?;
    if replaced.exists() {
        std::fs::remove_dir_all(&replaced).map_err(|e| CheckpointError::io(&replaced, "remove", e))?;
    }
    let latest = dir.join(LATEST_FILE);
    atomic::write_file(&latest, tag.as_bytes())?;
    match resolve_tag(dir, None)? {
        t if t == tag => Ok(()),
        other => Err(CheckpointError::Tag {
            path: latest,
            detail: format!("names `{other}` right after it was written with `{tag}`"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ThreadGroup;
    use crate::partition::{LayoutBuilder, ParamSpec, Placement};
    use std::path::PathBuf;

    /// The layout the tests save: one `[3, 5]` parameter, sharded over one rank.
    fn one_matrix() -> PartitionLayout {
        let specs = vec![ParamSpec {
            name: "w".into(),
            shape: vec![3, 5],
        }];
        let mut b = LayoutBuilder::new(specs, 1, 4);
        b.group(vec![0], Placement::Sharded);
        b.finish()
    }

    /// A one-rank checkpoint under a fresh `DIR/t`; returns (DIR, the metadata as written).
    fn saved(name: &str) -> (PathBuf, CheckpointMeta) {
        let dir = std::env::temp_dir().join(format!("zero-readback-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let layout = one_matrix();
        let master: Vec<f32> = (0..layout.owned_len(0)).map(|i| i as f32 / 3.0).collect();
        let request = SaveRequest {
            layout: &layout,
            groups: vec![GroupShard {
                master: &master,
                state: vec![("exp_avg", &master)],
            }],
            stage: 3,
            global_step: 5,
            skipped_steps: 0,
            optimizer_name: "adamw".into(),
            optimizer_step: 5,
            group_steps: Vec::new(),
            lr_next: Some(1.7943120135055317e-3),
            loss_scaler: None,
            rng: None,
            client_state: serde_json::json!({ "batch": 5 }),
            model: None,
            tensor_parallel: None,
            tensor_ranks: None,
            lineage: None,
            options: SaveOptions::default(),
        };
        let comm = ThreadGroup::new_group(1).expect("one rank").remove(0);
        save(comm.as_ref(), &dir, "t", &request).expect("save");
        let meta = Checkpoint::open(&dir, None).expect("open").meta;
        (dir, meta)
    }

    /// A save that fails once ranks are writing removes what it staged, and leaves the
    /// checkpoint before it as it was.
    #[test]
    fn a_failed_save_leaves_nothing_staged() {
        let (dir, meta) = saved("failed");
        let before = std::fs::read(dir.join("t").join(META_FILE)).unwrap();
        let layout = one_matrix();
        // One element short of the rank's slice: refused while writing the shard.
        let master = vec![0.5f32; layout.owned_len(0) - 1];
        let request = step_six(&layout, &master);
        let comm = ThreadGroup::new_group(1).expect("one rank").remove(0);
        let e = save(comm.as_ref(), &dir, "u", &request)
            .expect_err("a short slice")
            .to_string();
        assert!(e.contains("owned slice"), "{e}");
        assert!(!dir.join("u.partial").exists(), "nothing staged is left");
        assert!(!dir.join("u").exists());
        assert_eq!(std::fs::read(dir.join("t").join(META_FILE)).unwrap(), before);
        assert_eq!(
            Checkpoint::open(&dir, None).expect("the earlier one").meta.tag,
            meta.tag
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A request at step 6 with `master` and no optimizer state.
    fn step_six<'a>(layout: &'a PartitionLayout, master: &'a [f32]) -> SaveRequest<'a> {
        SaveRequest {
            layout,
            groups: vec![GroupShard { master, state: vec![] }],
            stage: 3,
            global_step: 6,
            skipped_steps: 0,
            optimizer_name: "adamw".into(),
            optimizer_step: 6,
            group_steps: Vec::new(),
            lr_next: None,
            loss_scaler: None,
            rng: None,
            client_state: serde_json::json!({}),
            model: None,
            tensor_parallel: None,
            tensor_ranks: None,
            lineage: None,
            options: SaveOptions::default(),
        }
    }

    /// Weights that diverged are not saved: the error names the parameter, the element and the
    /// value, nothing is staged, and `latest` still names the checkpoint before.
    #[test]
    fn diverged_weights_are_not_saved() {
        let (dir, meta) = saved("diverged");
        let layout = one_matrix();
        for (at, bad, said) in [(7, f32::NAN, "NaN"), (14, f32::NEG_INFINITY, "-inf")] {
            let mut master = vec![0.5f32; layout.owned_len(0)];
            master[at] = bad;
            let comm = ThreadGroup::new_group(1).expect("one rank").remove(0);
            let e = save(comm.as_ref(), &dir, "u", &step_six(&layout, &master))
                .expect_err("diverged weights")
                .to_string();
            assert!(
                e.contains(&format!("`w` holds {said} at element {at}")) && e.contains("diverged"),
                "{e}"
            );
            assert!(!dir.join("u.partial").exists() && !dir.join("u").exists());
            assert_eq!(
                Checkpoint::open(&dir, None).expect("the earlier one").meta.tag,
                meta.tag
            );
        }
        // After the refusals, the same tag saves; a NaN in the padding (element 15 of the
        // group, past the 15 of `w`) is no parameter's and does not stop it.
        let mut master = vec![0.5f32; layout.owned_len(0)];
        assert_eq!(layout.owned_len(0), 16);
        master[15] = f32::NAN;
        save(
            ThreadGroup::new_group(1).expect("one rank").remove(0).as_ref(),
            &dir,
            "u",
            &step_six(&layout, &master),
        )
        .expect("finite weights save");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Two tensor ranks, each saving its slice over its own data rank: when one's weights
    /// diverged, both refuse (neither publishes a tag beside the other's refusal), naming the
    /// tensor rank.
    #[test]
    fn a_divergence_on_one_tensor_rank_stops_every_tensor_ranks_save() {
        let base = std::env::temp_dir().join(format!("zero-diverged-tp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let tensor = ThreadGroup::new_group(2).expect("two tensor ranks");
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = tensor
                .into_iter()
                .enumerate()
                .map(|(t, tensor)| {
                    let dir = base.join(format!("tensor_rank_{t}"));
                    s.spawn(move || {
                        let layout = one_matrix();
                        let mut master = vec![0.5f32; layout.owned_len(0)];
                        if t == 1 {
                            master[4] = f32::INFINITY;
                        }
                        let data = ThreadGroup::new_group(1).expect("one data rank").remove(0);
                        let request = SaveRequest {
                            tensor_ranks: Some(tensor.as_ref()),
                            ..step_six(&layout, &master)
                        };
                        let e = save(data.as_ref(), &dir, "u", &request)
                            .expect_err("refused")
                            .to_string();
                        assert!(!dir.join("u").exists() && !dir.join("u.partial").exists());
                        e
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("no panic")).collect()
        });
        for e in &errors {
            assert!(
                e.contains("tensor rank 1: `w` holds inf at element 4 on rank 0") && e.contains("diverged"),
                "{e}"
            );
        }
        std::fs::remove_dir_all(&base).ok();
    }

    /// Metadata edited to something no run writes, and sealed again (its checksum matches): the
    /// reader refuses it, naming what is impossible.
    #[test]
    fn sealed_metadata_that_no_run_writes_is_refused() {
        let (dir, meta) = saved("impossible");
        let path = dir.join("t").join(META_FILE);
        type Edit = fn(&mut CheckpointMeta);
        let edits: [(&str, Edit); 4] = [
            ("optimizer took", |m| m.optimizer.step = u64::MAX),
            ("were skipped", |m| m.skipped_steps = 6),
            ("stage 7", |m| m.stage = 7),
            ("alignment is 0", |m| m.layout.alignment = 0),
        ];
        for (said, edit) in edits {
            let mut bad = meta.clone();
            edit(&mut bad);
            let bytes = bad.to_bytes().expect("serialise");
            let e = CheckpointMeta::from_bytes(&path, &bytes).expect_err(said).to_string();
            assert!(e.contains(said) && e.contains(META_FILE), "{said}: {e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    fn check(dir: &Path, record: &FileRecord, written: &CheckpointMeta) -> String {
        read_back(&dir.join("t"), 0, record, Some(written))
            .expect_err("must be found")
            .to_string()
    }

    #[test]
    fn read_back_accepts_what_was_written_and_names_what_was_not() {
        let (dir, meta) = saved("cases");
        let record = meta.files[0].clone();
        read_back(&dir.join("t"), 0, &record, Some(&meta)).expect("an intact checkpoint reads back");

        // The metadata verifies but says something else than was meant (an inexact float).
        let mut other = meta.clone();
        other.lr_next = other.lr_next.map(|v| f64::from_bits(v.to_bits() + 1));
        let e = check(&dir, &record, &other);
        assert!(e.contains(META_FILE) && e.contains("other than it was written"), "{e}");

        // The rank's own record of its shard is not the one the metadata holds.
        let mut wrong = record.clone();
        wrong.crc32 ^= 1;
        let e = check(&dir, &wrong, &meta);
        assert!(
            e.contains("rank_00000.safetensors") && e.contains("other checksums"),
            "{e}"
        );

        // The shard's header on disk is not what was written.
        let shard = dir.join("t/rank_00000.safetensors");
        let good = std::fs::read(&shard).unwrap();
        let mut bad = good.clone();
        bad[12] ^= 0x20;
        std::fs::write(&shard, &bad).unwrap();
        let e = check(&dir, &record, &meta);
        assert!(
            e.contains("rank_00000.safetensors") && e.contains("checksum mismatch"),
            "{e}"
        );
        std::fs::write(&shard, &good).unwrap();

        // The metadata on disk does not verify.
        let path = dir.join("t").join(META_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replacen("\"global_step\": 5", "\"global_step\": 6", 1)).unwrap();
        let e = check(&dir, &record, &meta);
        assert!(e.contains(META_FILE) && e.contains("checksum mismatch"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
