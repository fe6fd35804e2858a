//! What a save keeps in its directory beside the tag it publishes.
//!
//! A directory of tags is one run's trajectory: tags saved in the order of their steps, `latest`
//! naming the newest. A run resumed from an older tag into that directory would replace, one by
//! one, the tags the run before it went on to save after that tag, and leave the later ones
//! beside its own `latest` (where a rotation by step would then take them for its own). So a
//! save first looks for the tags there that are not its run's ([`Lineage`]: saved after the
//! step its state was loaded at, or the run's start, and not by it since) and refuses, naming
//! them, unless told to discard them ([`SaveOptions::discard_later_tags`]), which happens only
//! once its own tag is published. With [`SaveOptions::keep_last`], the oldest of the
//! directory's `global_step{N}` tags go too (HuggingFace's `save_total_limit`), never the tag
//! `latest` names.

use super::error::CheckpointError;
use super::format::{MAX_META_BYTES, META_FILE};
use std::collections::BTreeSet;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What a save does beside publishing its tag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// Remove the tags of another trajectory that the directory holds ([`Lineage`]) once this
    /// save is published. By default such a save is refused, naming them.
    pub discard_later_tags: bool,
    /// Keep at most this many of the directory's `global_step{N}` tags (the default name of a
    /// tag), the newest by step, removing the others once this save is published
    /// (HuggingFace's `save_total_limit`); `None` keeps every tag. Tags of other names stay.
    pub keep_last: Option<NonZeroUsize>,
}

/// A tag of a checkpoint directory, and the step its metadata records.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SavedTag {
    /// The optimizer step the tag was saved at (its metadata's `global_step`).
    pub global_step: u64,
    /// The tag's name (its directory's).
    pub tag: String,
}

/// What a save did: the tag it published, and the tags it removed from the directory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    /// The published tag's directory.
    pub tag_dir: PathBuf,
    /// Another trajectory's tags, removed ([`SaveOptions::discard_later_tags`]), by step;
    /// one of the published tag's name among them was replaced by it.
    pub discarded: Vec<SavedTag>,
    /// Older tags removed to keep [`SaveOptions::keep_last`], by step.
    pub rotated: Vec<SavedTag>,
}

/// Which tags of a directory a run's saves may replace, or leave beside their own: those of the
/// trajectory its state comes from (saved at or before the step it was loaded at, step 0 for a
/// run from its initialisation) and those it saved since. Any other tag is another
/// trajectory's: saved after that step by a run this one did not continue. Every engine keeps
/// one, told of each load and save.
#[derive(Debug, Default)]
pub struct Lineage(Mutex<LineageState>);

#[derive(Debug, Default)]
struct LineageState {
    /// The step the run's state was loaded at.
    since_step: u64,
    /// Tags known to be the run's, by directory: saved by it, or found at or before
    /// `since_step` (not read again at every save).
    own: BTreeSet<(PathBuf, String)>,
}

impl Lineage {
    /// A run from its initialisation: every tag saved after step 0 is another's.
    pub fn new() -> Self {
        Self::default()
    }

    /// The run's state was replaced by one saved at `global_step` (a checkpoint, or a record,
    /// loaded): the tags saved after it are another trajectory's, the run's own earlier ones
    /// included.
    pub fn loaded_at(&self, global_step: u64) {
        let mut state = self.lock();
        state.since_step = global_step;
        state.own.clear();
    }

    /// The step the run's state was loaded at (0: from its initialisation).
    pub fn since_step(&self) -> u64 {
        self.lock().since_step
    }

    /// The tags of `dir` that are another trajectory's, by step.
    pub fn other_tags(&self, dir: &Path) -> Vec<SavedTag> {
        let key = canonical(dir);
        let mut state = self.lock();
        let mut others = Vec::new();
        for name in tag_names(dir) {
            let id = (key.clone(), name);
            if state.own.contains(&id) {
                continue;
            }
            let Some(global_step) = step_of(&dir.join(&id.1)) else {
                continue;
            };
            if global_step <= state.since_step {
                state.own.insert(id);
            } else {
                others.push(SavedTag { global_step, tag: id.1 });
            }
        }
        others.sort();
        others
    }

    /// The run published `tag` in `dir`.
    pub(crate) fn saved(&self, dir: &Path, tag: &str) {
        self.lock().own.insert((canonical(dir), tag.to_string()));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LineageState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `dir` by the path the filesystem resolves it to, so that two spellings of it are one.
fn canonical(dir: &Path) -> PathBuf {
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// The names of `dir`'s subdirectories that hold checkpoint metadata, except those of a save in
/// progress (`TAG.partial`) or of a tag being replaced (`TAG.replaced`).
fn tag_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|name| !name.ends_with(".partial") && !name.ends_with(".replaced"))
        .filter(|name| dir.join(name).join(META_FILE).is_file())
        .collect();
    names.sort();
    names
}

/// The step a tag directory's metadata records; `None` where it does not read (no run loads
/// such a tag, and nothing here removes it).
fn step_of(tag_dir: &Path) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Step {
        global_step: u64,
    }
    let text = crate::files::read_to_string(&tag_dir.join(META_FILE), MAX_META_BYTES).ok()?;
    serde_json::from_str::<Step>(&text).ok().map(|s| s.global_step)
}

/// The published tags of `dir`, by step: its directories that hold checkpoint metadata, each
/// with the step it records (one whose metadata does not read is left out).
pub fn tags(dir: &Path) -> Vec<SavedTag> {
    let mut tags: Vec<SavedTag> = tag_names(dir)
        .into_iter()
        .filter_map(|tag| step_of(&dir.join(&tag)).map(|global_step| SavedTag { global_step, tag }))
        .collect();
    tags.sort();
    tags
}

/// The tags of `dir` saved after `step`, by step: another trajectory's, for a run whose state
/// was loaded at `step` (what a save there refuses, or discards).
pub fn tags_after(dir: &Path, step: u64) -> Vec<SavedTag> {
    tags(dir).into_iter().filter(|t| t.global_step > step).collect()
}

/// `tags` in a sentence: the first few and the last by name, how many, and their steps.
pub fn describe_tags(tags: &[SavedTag]) -> String {
    let names: Vec<&str> = tags.iter().map(|t| t.tag.as_str()).collect();
    let shown = match names.as_slice() {
        [] => return "no tags".into(),
        [one] => return format!("{one} (step {})", tags[0].global_step),
        few if few.len() <= 4 => few.join(", "),
        many => format!("{}, {}, ..., {}", many[0], many[1], many[many.len() - 1]),
    };
    let (first, last) = (tags[0].global_step, tags[tags.len() - 1].global_step);
    format!("{shown} ({} tags, steps {first} to {last})", tags.len())
}

/// Rank 0, once `tag` is published in `dir` (and `latest` names it): removes `others`
/// (another trajectory's tags, with [`SaveOptions::discard_later_tags`]) and the tags beyond
/// [`SaveOptions::keep_last`]. The published tag, and the one `latest` names, are never
/// removed.
pub(crate) fn prune(
    dir: &Path,
    tag: &str,
    others: Vec<SavedTag>,
    options: SaveOptions,
) -> Result<(Vec<SavedTag>, Vec<SavedTag>), CheckpointError> {
    let latest = super::load::resolve_tag(dir, None)?;
    let kept = |t: &SavedTag| t.tag == tag || t.tag == latest;
    let remove = |t: &SavedTag| {
        let path = dir.join(&t.tag);
        std::fs::remove_dir_all(&path).map_err(|e| CheckpointError::io(&path, "remove", e))
    };
    let mut discarded = Vec::new();
    if options.discard_later_tags {
        for t in others {
            // One of the published tag's name was replaced by it: gone all the same.
            if !kept(&t) {
                remove(&t)?;
            }
            discarded.push(t);
        }
    }
    let mut rotated = Vec::new();
    if let Some(keep) = options.keep_last {
        let mut numbered: Vec<SavedTag> = tags(dir).into_iter().filter(|t| is_step_tag(&t.tag)).collect();
        // Newest first: by step, then by name. The published tag takes one of the places.
        numbered.sort_by(|a, b| b.cmp(a));
        let mut room = keep.get() - usize::from(numbered.iter().any(|t| t.tag == tag));
        for t in numbered.into_iter().filter(|t| t.tag != tag) {
            if room > 0 {
                room -= 1;
            } else if !kept(&t) {
                remove(&t)?;
                rotated.push(t);
            }
        }
        rotated.sort();
    }
    super::atomic::sync_dir(dir)?;
    Ok((discarded, rotated))
}

/// Whether `tag` is named as a save names it by default: `global_step` and digits.
fn is_step_tag(tag: &str) -> bool {
    tag.strip_prefix("global_step")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{save, GroupShard, SaveRequest, LATEST_FILE};
    use crate::comm::ThreadGroup;
    use crate::partition::{LayoutBuilder, ParamSpec, Placement};

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zero-retention-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A one-rank save of a `[3, 5]` parameter at `step` under `global_step{step}` (or `tag`).
    fn save_at(
        dir: &Path,
        step: u64,
        tag: Option<&str>,
        lineage: &Lineage,
        options: SaveOptions,
    ) -> Result<Saved, CheckpointError> {
        let specs = vec![ParamSpec {
            name: "w".into(),
            shape: vec![3, 5],
        }];
        let mut b = LayoutBuilder::new(specs, 1, 4);
        b.group(vec![0], Placement::Sharded);
        let layout = b.finish();
        let master = vec![step as f32; layout.owned_len(0)];
        let request = SaveRequest {
            layout: &layout,
            groups: vec![GroupShard {
                master: &master,
                state: vec![],
            }],
            stage: 1,
            global_step: step,
            skipped_steps: 0,
            optimizer_name: "adamw".into(),
            optimizer_step: step,
            group_steps: Vec::new(),
            lr_next: None,
            loss_scaler: None,
            rng: None,
            client_state: serde_json::json!({}),
            model: None,
            tensor_parallel: None,
            tensor_ranks: None,
            lineage: Some(lineage),
            options,
        };
        let comm = ThreadGroup::new_group(1).expect("one rank").remove(0);
        let tag = tag.map_or_else(|| format!("global_step{step}"), str::to_string);
        save(comm.as_ref(), dir, &tag, &request)
    }

    fn names(dir: &Path) -> Vec<String> {
        tags(dir).into_iter().map(|t| t.tag).collect()
    }

    fn latest(dir: &Path) -> String {
        std::fs::read_to_string(dir.join(LATEST_FILE)).expect("latest")
    }

    fn steps(range: std::ops::RangeInclusive<u64>) -> Vec<String> {
        range.map(|s| format!("global_step{s}")).collect()
    }

    /// A run resumed at step 4 into the directory of the run that went on to step 8: its save
    /// is refused, naming the later tags, and nothing changes; told to discard them, it
    /// publishes, then removes them (the one it replaced among them) and says which.
    #[test]
    fn a_save_among_another_trajectorys_later_tags_is_refused_or_discards_them() {
        let dir = scratch("trajectory");
        let first = Lineage::new();
        for step in 1..=8 {
            save_at(&dir, step, None, &first, SaveOptions::default()).expect("the first run's own tags");
        }
        let resumed = Lineage::new();
        resumed.loaded_at(4);
        let e = save_at(&dir, 5, None, &resumed, SaveOptions::default()).expect_err("refused");
        let CheckpointError::OtherTrajectory { tags, since_step, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!((tags.len(), *since_step), (4, 4));
        let said = e.to_string();
        assert!(
            said.contains("global_step5, global_step6, global_step7, global_step8 (4 tags, steps 5 to 8)")
                && said.contains("saved after step 4")
                && said.contains("replace `global_step5`")
                && said.contains("another directory")
                && said.contains("discard_later_tags"),
            "{said}"
        );
        assert_eq!(names(&dir), steps(1..=8), "nothing removed");
        assert_eq!(latest(&dir), "global_step8");
        assert!(!dir.join("global_step5.partial").exists());

        let discard = SaveOptions {
            discard_later_tags: true,
            ..SaveOptions::default()
        };
        let saved = save_at(&dir, 5, None, &resumed, discard).expect("discarding");
        let discarded: Vec<&str> = saved.discarded.iter().map(|t| t.tag.as_str()).collect();
        assert_eq!(discarded, steps(5..=8));
        assert_eq!(names(&dir), steps(1..=5));
        assert_eq!(latest(&dir), "global_step5");
        // Its own tags after that are its own: no refusal, nothing more discarded.
        let next = save_at(&dir, 6, None, &resumed, SaveOptions::default()).expect("its own next tag");
        assert!(next.discarded.is_empty());
        assert_eq!(names(&dir), steps(1..=6));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A run from its initialisation into a directory of another run's tags is refused too,
    /// saying so; the run itself saving the same tag twice is not.
    #[test]
    fn a_fresh_run_among_another_runs_tags_is_refused() {
        let dir = scratch("fresh");
        let other = Lineage::new();
        save_at(&dir, 3, None, &other, SaveOptions::default()).expect("the other run");
        save_at(&dir, 3, None, &other, SaveOptions::default()).expect("the same tag again, by its run");
        let e = save_at(&dir, 1, None, &Lineage::new(), SaveOptions::default())
            .expect_err("another run's tag")
            .to_string();
        assert!(
            e.contains("global_step3 (step 3)")
                && e.contains("started from its initialisation")
                && e.contains("leave them beside its `latest`"),
            "{e}"
        );
        assert_eq!(latest(&dir), "global_step3");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// `keep_last` 2 over five saves: the newest two `global_step` tags stay, `latest` names the
    /// newest, a tag of another name stays, and each save says what it removed.
    #[test]
    fn keep_last_keeps_the_newest_tags_and_never_latest() {
        let dir = scratch("keep-last");
        let lineage = Lineage::new();
        let keep = SaveOptions {
            keep_last: NonZeroUsize::new(2),
            ..SaveOptions::default()
        };
        save_at(&dir, 1, Some("best"), &lineage, keep).expect("a named tag");
        let mut removed = Vec::new();
        for step in 1..=5 {
            let saved = save_at(&dir, step, None, &lineage, keep).expect("save");
            assert_eq!(latest(&dir), format!("global_step{step}"));
            removed.extend(saved.rotated.into_iter().map(|t| t.tag));
        }
        assert_eq!(removed, steps(1..=3));
        let mut left = names(&dir);
        left.sort();
        assert_eq!(left, ["best", "global_step4", "global_step5"]);
        // One place kept: the published tag alone.
        let one = SaveOptions {
            keep_last: NonZeroUsize::new(1),
            ..SaveOptions::default()
        };
        let saved = save_at(&dir, 6, None, &lineage, one).expect("save");
        let rotated: Vec<&str> = saved.rotated.iter().map(|t| t.tag.as_str()).collect();
        assert_eq!(rotated, ["global_step4", "global_step5"]);
        assert!(dir.join("global_step6").is_dir() && dir.join("best").is_dir());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tags_are_described_by_name_count_and_steps() {
        let tag = |s: u64| SavedTag {
            global_step: s,
            tag: format!("global_step{s}"),
        };
        assert_eq!(describe_tags(&[tag(5)]), "global_step5 (step 5)");
        assert_eq!(
            describe_tags(&(5..=12).map(tag).collect::<Vec<_>>()),
            "global_step5, global_step6, ..., global_step12 (8 tags, steps 5 to 12)"
        );
        assert!(is_step_tag("global_step12") && !is_step_tag("global_step") && !is_step_tag("global_step1a"));
    }
}
