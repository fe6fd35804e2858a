//! Loading: find the tag, verify the metadata, check it is this model's, then read each rank's
//! new owned slices from whichever old shards hold them, at any world size and stage.
//!
//! Everything is read into fresh buffers and every chunk is verified as it is read, so an error
//! (a missing or truncated shard, a flipped byte, a header that disagrees with the metadata)
//! surfaces before the caller replaces any state; ranks agree on the outcome, so that all of
//! them fail together.

use super::collective::agree;
use super::error::CheckpointError;
use super::format::{self, CheckpointMeta, LATEST_FILE, META_FILE};
use super::reader::ShardReader;
use super::reshard::plan_rank;
use super::save::GroupShard;
use crate::comm::ProcessGroup;
use crate::partition::PartitionLayout;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One group's owned slice, read back.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoadedGroup {
    /// fp32 master weights.
    pub master: Vec<f32>,
    /// Optimizer state buffers, by name.
    pub state: Vec<(String, Vec<f32>)>,
}

impl LoadedGroup {
    /// The optimizer buffers, or, where the group holds none (an optimizer state not made yet:
    /// its parameters had not trained), zeros of the masters' length under `names`: the state
    /// of an optimizer before its first step.
    pub fn state_or_zeros<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> std::borrow::Cow<'_, [(String, Vec<f32>)]> {
        if !self.state.is_empty() {
            return std::borrow::Cow::Borrowed(&self.state);
        }
        let n = self.master.len();
        std::borrow::Cow::Owned(names.into_iter().map(|name| (name.to_string(), vec![0.0; n])).collect())
    }

    /// The slices as a save takes them (the inverse of [`GroupShard::copied`]).
    pub fn as_shard(&self) -> GroupShard<'_> {
        GroupShard {
            master: &self.master,
            state: self.state.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect(),
        }
    }
}

/// A checkpoint whose metadata has been read and verified.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The tag's directory.
    pub tag_dir: PathBuf,
    /// The verified metadata.
    pub meta: CheckpointMeta,
}

/// The tag to load: `tag`, or the one `DIR/latest` names.
pub fn resolve_tag(dir: &Path, tag: Option<&str>) -> Result<String, CheckpointError> {
    if let Some(t) = tag {
        format::check_tag(dir, t)?;
        return Ok(t.to_string());
    }
    let latest = dir.join(LATEST_FILE);
    let text =
        crate::files::read_to_string(&latest, crate::files::SMALL).map_err(|e| match e.kind() {
            // The directory itself, where it is missing or not one (a directory that cannot be
            // looked into is said by the read's own error, below).
            _ if let Some(detail) = match std::fs::metadata(dir) {
                Err(m) if m.kind() == std::io::ErrorKind::NotFound => Some("no such directory"),
                Ok(m) if !m.is_dir() => Some("is not a directory"),
                _ => None,
            } =>
            {
                CheckpointError::Tag {
                    path: dir.to_path_buf(),
                    detail: detail.into(),
                }
            }
            std::io::ErrorKind::NotFound => CheckpointError::Tag {
                path: latest.clone(),
                detail: match super::tensor_parallel::tensor_ranks_in(dir).as_slice() {
                    [] => no_latest(dir),
                    ranks => format!(
                    "missing: this directory holds a tensor-parallel checkpoint, one per tensor rank ({}): load it \
                     with the same tensor_parallel.autotp_size ({}), or convert it whole with `zero to-fp32`, \
                     which merges the ranks' slices",
                    ranks.iter().map(|t| format!("tensor_rank_{t}")).collect::<Vec<_>>().join(", "),
                    ranks.len()
                ),
                },
            },
            _ => CheckpointError::io(&latest, "read", e),
        })?;
    let t = text.trim();
    // A tag is a directory's name, at most 255 bytes: longer text is not echoed whole.
    if t.len() > 255 {
        return Err(CheckpointError::Tag {
            path: latest.clone(),
            detail: format!(
                "holds {} bytes, more than a tag's name can have (255): not a tag",
                t.len()
            ),
        });
    }
    format::check_tag(dir, t).map_err(|_| CheckpointError::Tag {
        path: latest.clone(),
        detail: format!("names `{t}`, which is not a tag"),
    })?;
    Ok(t.to_string())
}

/// Why `dir` has no `latest`, and what to give instead: its parent when it is a tag's own
/// directory, else the tags it holds (saves that never wrote `latest`), if any.
fn no_latest(dir: &Path) -> String {
    if dir.join(META_FILE).is_file() {
        let tag = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parent = dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        return format!(
            "missing: this is the directory of one checkpoint, tag `{tag}`; give the directory above it ({})",
            parent.display()
        );
    }
    let mut tags: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join(META_FILE).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    tags.sort();
    if tags.is_empty() {
        "missing: no checkpoint was completed in this directory".into()
    } else {
        format!(
            "missing: no save here finished (`latest` is written last); the tags here are {}: name the one to load",
            tags.join(", ")
        )
    }
}

impl Checkpoint {
    /// Opens `DIR/TAG` (`tag` None: the tag `latest` names) and verifies its metadata.
    pub fn open(dir: &Path, tag: Option<&str>) -> Result<Self, CheckpointError> {
        let tag = resolve_tag(dir, tag)?;
        let mut tag_dir = dir.join(&tag);
        if !tag_dir.is_dir() {
            // A save killed between its two renames leaves the previous version here.
            let replaced = dir.join(format!("{tag}.replaced"));
            if replaced.join(META_FILE).is_file() {
                tag_dir = replaced;
            } else {
                return Err(CheckpointError::Tag {
                    path: tag_dir,
                    detail: "no such checkpoint tag directory".into(),
                });
            }
        }
        let path = tag_dir.join(META_FILE);
        let bytes = crate::files::read(&path, format::MAX_META_BYTES).map_err(|e| match e.kind() {
            // The metadata itself, not a file it lists.
            std::io::ErrorKind::NotFound => CheckpointError::Metadata {
                path: path.clone(),
                detail: "missing: the tag's directory holds no metadata (the save did not finish, or it was \
                         removed)"
                    .into(),
            },
            _ => CheckpointError::io(&path, "read", e),
        })?;
        let meta = CheckpointMeta::from_bytes(&path, &bytes)?;
        Ok(Checkpoint { tag_dir, meta })
    }

    /// The metadata file.
    pub fn meta_path(&self) -> PathBuf {
        self.tag_dir.join(META_FILE)
    }

    /// Opens rank `rank`'s shard and checks that it holds the tensors the metadata implies.
    pub fn open_shard(&self, rank: usize) -> Result<ShardReader, CheckpointError> {
        let record = self.meta.files.get(rank).ok_or_else(|| CheckpointError::Metadata {
            path: self.meta_path(),
            detail: format!("no file record for rank {rank}"),
        })?;
        let expected_name = format::shard_file_name(rank);
        if record.name != expected_name {
            return Err(CheckpointError::Metadata {
                path: self.meta_path(),
                detail: format!(
                    "rank {rank}'s file is recorded as `{}`, expected `{expected_name}`",
                    record.name
                ),
            });
        }
        let reader = ShardReader::open(&self.tag_dir.join(&record.name), record)?;
        let layout = &self.meta.layout;
        let mut expected = Vec::new();
        for g in 0..layout.groups.len() {
            if format::shard_holds(layout, g, rank) {
                let len = layout.owned_len(g);
                expected.push((format::master_tensor(g), len));
                for s in &self.meta.optimizer.state_names {
                    expected.push((format::state_tensor(g, s), len));
                }
            }
        }
        reader.check_tensors(&expected)?;
        Ok(reader)
    }

    /// Reads `rank`'s owned slices of every group of `layout` (the caller's layout, at any world
    /// size and grouping over the same parameters, or another layout of the same model, which
    /// [`CheckpointMeta::param_sources`] matches). Only the needed shard files are opened, and of
    /// them only the needed chunks read.
    pub fn read_rank(&self, layout: &PartitionLayout, rank: usize) -> Result<Vec<LoadedGroup>, CheckpointError> {
        let sources = self.meta.param_sources(&self.meta_path(), &layout.params)?;
        let plan = plan_rank(&self.meta.layout, layout, rank, Some(&sources));
        // Open (length, header, tensor list) every needed file before reading any value.
        let mut readers: BTreeMap<usize, ShardReader> = BTreeMap::new();
        for p in plan.iter().flatten() {
            if let std::collections::btree_map::Entry::Vacant(slot) = readers.entry(p.file_rank) {
                slot.insert(self.open_shard(p.file_rank)?);
            }
        }
        let names = &self.meta.optimizer.state_names;
        let mut out = Vec::with_capacity(plan.len());
        for (g, pieces) in plan.iter().enumerate() {
            let len = layout.owned_len(g);
            let mut group = LoadedGroup {
                master: vec![0.0; len],
                state: names.iter().map(|n| (n.clone(), vec![0.0; len])).collect(),
            };
            // One tensor kind at a time, so that each file is read front to back and a chunk is
            // read once, not once per piece.
            let kinds = std::iter::once((None, &mut group.master))
                .chain(group.state.iter_mut().map(|(n, b)| (Some(n.as_str()), b)));
            for (kind, buf) in kinds {
                for p in pieces {
                    let reader = readers
                        .get_mut(&p.file_rank)
                        .ok_or_else(|| CheckpointError::Usage("unplanned shard".into()))?;
                    let tensor = match kind {
                        None => format::master_tensor(p.group),
                        Some(name) => format::state_tensor(p.group, name),
                    };
                    reader.read_f32(&tensor, p.src.clone(), &mut buf[p.dst.clone()])?;
                }
            }
            out.push(group);
        }
        Ok(out)
    }

    /// Reads every shard file whole and checks every checksum.
    pub fn verify(&self) -> Result<(), CheckpointError> {
        for r in 0..self.meta.world_size {
            self.open_shard(r)?.verify_all()?;
        }
        Ok(())
    }
}

/// Every rank: opens the checkpoint and reads its owned slices of `layout`; all ranks succeed
/// or all fail.
pub fn load(
    comm: &dyn ProcessGroup,
    dir: &Path,
    tag: Option<&str>,
    layout: &PartitionLayout,
) -> Result<(CheckpointMeta, Vec<LoadedGroup>), CheckpointError> {
    let outcome = Checkpoint::open(dir, tag).and_then(|c| {
        let groups = c.read_rank(layout, comm.rank())?;
        Ok((c.meta, groups))
    });
    agree(comm, "load", outcome)
}
