//! What can go wrong with a checkpoint: every error names the file and what is wrong with it.

use std::path::PathBuf;

/// A checkpoint could not be written, read, verified or converted.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file or directory could not be read or written.
    #[error("{path}: {action}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`create`, `read`, `rename`, ...).
        action: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A file the metadata lists is not there.
    #[error("{path}: missing (the checkpoint metadata lists it; was the save interrupted or the file removed?)")]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// A file has another length than the metadata records.
    #[error("{path}: {actual} bytes, but the metadata records {expected} (truncated or replaced)")]
    Length {
        /// The file.
        path: PathBuf,
        /// Length recorded in the metadata.
        expected: u64,
        /// Length on disk.
        actual: u64,
    },
    /// A file's bytes do not match their recorded checksum.
    #[error("{path}: checksum mismatch in bytes {start}..{end} (crc32 {actual:08x}, metadata records {expected:08x}): the file is corrupt")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// First byte of the checked range.
        start: u64,
        /// End of the checked range.
        end: u64,
        /// Recorded checksum.
        expected: u32,
        /// Checksum of the bytes on disk.
        actual: u32,
    },
    /// The metadata file cannot be parsed or contradicts itself.
    #[error("{path}: invalid checkpoint metadata: {detail}")]
    Metadata {
        /// The metadata file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A shard file does not hold what the metadata says it holds.
    #[error("{path}: does not match the checkpoint metadata: {detail}")]
    ShardMismatch {
        /// The shard file.
        path: PathBuf,
        /// What differs.
        detail: String,
    },
    /// The checkpoint was written for another model (other parameter names or shapes).
    #[error("{path}: checkpoint is of another model: {detail}")]
    OtherModel {
        /// The metadata file.
        path: PathBuf,
        /// The first difference found.
        detail: String,
    },
    /// `latest` names no tag, or a tag is not a usable directory name.
    #[error("{path}: {detail}")]
    Tag {
        /// The `latest` file or the checkpoint directory.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The caller asked for something the checkpoint cannot give or hold.
    #[error("checkpoint: {0}")]
    Usage(String),
    /// Other ranks failed while this one succeeded: their own errors, gathered from them.
    #[error("{}; nothing was changed on this rank", peers_failed(.action, .failures))]
    PeerFailed {
        /// `save` or `load`.
        action: &'static str,
        /// Every rank that failed, in rank order, with its own error message.
        failures: Vec<RankFailure>,
    },
    /// This rank failed, and other ranks failed too with other errors (each message once).
    #[error("{own}; {}", peers_failed(.action, .others))]
    AlsoFailed {
        /// This rank's own error.
        own: Box<CheckpointError>,
        /// `save` or `load`.
        action: &'static str,
        /// The other ranks that failed with another message, in rank order.
        others: Vec<RankFailure>,
    },
    /// A value to be saved has no exact JSON form, so the metadata would not read back.
    #[error("checkpoint: cannot save `{field}` = {value}: JSON has no NaN or infinity, so the checkpoint would not read back")]
    NotFinite {
        /// The metadata field, dotted (`lr_next`, `loss_scaler.cur_scale`).
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// The weights to be saved hold a NaN or an infinity: training diverged. Nothing is
    /// written, so `latest` still names the last checkpoint whose weights were finite. Every
    /// rank fails with this same error.
    #[error(
        "checkpoint: not saved: the master weights diverged: {detail}; a learning rate or loss scale too large? \
         `latest` and earlier tags are unchanged"
    )]
    Diverged {
        /// Where: the parameter, the element, the value and the rank (and tensor rank) that
        /// holds it first, and how many more ranks hold one.
        detail: String,
    },
    /// The directory holds tags of another trajectory (saved after the step the run's state
    /// comes from, by a run it does not continue), which the save would replace or leave beside
    /// its `latest`. Nothing was written.
    #[error("{}", other_trajectory(.dir, .tag, *.since_step, .tags))]
    OtherTrajectory {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The tag being saved.
        tag: String,
        /// The step the run's state was loaded at (0: its initialisation).
        since_step: u64,
        /// The other trajectory's tags, by step.
        tags: Vec<super::retention::SavedTag>,
    },
    /// A checkpoint just written does not read back; nothing was published, so the previous
    /// checkpoint and `latest` are as they were.
    #[error("the checkpoint just written does not read back, so it was not published (`latest` and earlier tags are unchanged): {0}")]
    ReadBack(Box<CheckpointError>),
    /// A collective failed during save or load.
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
}

/// One failed rank's error, as every rank learns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFailure {
    /// The rank (in the group the save or load ran over).
    pub rank: usize,
    /// Its error message.
    pub message: String,
}

/// "rank 1 failed to load the checkpoint: MSG", one clause per failed rank.
fn peers_failed(action: &str, failures: &[RankFailure]) -> String {
    failures
        .iter()
        .map(|f| format!("rank {} failed to {action} the checkpoint: {}", f.rank, f.message))
        .collect::<Vec<_>>()
        .join("; ")
}

/// What [`CheckpointError::OtherTrajectory`] says: the tags, what the save would do to them,
/// and what to do instead.
fn other_trajectory(dir: &std::path::Path, tag: &str, since: u64, tags: &[super::retention::SavedTag]) -> String {
    let from = match since {
        0 => "this run started from its initialisation".to_string(),
        step => format!("this run's state was loaded at step {step}"),
    };
    let harm = if tags.iter().any(|t| t.tag == tag) {
        format!("replace `{tag}` among them and leave the others beside its `latest`")
    } else {
        "leave them beside its `latest`, where they would read as its own".to_string()
    };
    format!(
        "{}: holds {}, saved after step {since} by a run this one does not continue ({from}); saving `{tag}` \
         here would {harm}: save into another directory, or save with discard_later_tags to remove them once \
         `{tag}` is published",
        dir.display(),
        super::retention::describe_tags(tags)
    )
}

impl CheckpointError {
    /// An I/O error on `path` while doing `action`; a missing file becomes [`CheckpointError::Missing`].
    pub(crate) fn io(path: impl Into<PathBuf>, action: &'static str, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound && action == "open" {
            CheckpointError::Missing { path }
        } else {
            CheckpointError::Io { path, action, source }
        }
    }
}
