//! Checkpoints of a model split over tensor-parallel ranks: one complete checkpoint per tensor
//! rank, under `tensor_rank_{t}` of the checkpoint directory, each recording how its parameters
//! are cut ([`TensorParallelRecord`]). Opened together, they give back the whole model:
//! [`TensorParallelCheckpoint`], and `to_fp32` of it merges each split parameter's slices.

use super::error::CheckpointError;
use super::format::{TensorParallelRecord, TensorSplit};
use super::load::Checkpoint;
use std::path::{Path, PathBuf};

/// The directory of tensor rank `t` under a checkpoint directory.
pub fn tensor_rank_dir(dir: &Path, t: usize) -> PathBuf {
    dir.join(format!("tensor_rank_{t}"))
}

/// Whether `dir` holds a published checkpoint: its `latest`, or a tensor rank's
/// (`tensor_rank_{t}/latest`). A save that never finished (only `TAG.partial`) is none.
pub fn holds_checkpoint(dir: &Path) -> bool {
    let latest = super::format::LATEST_FILE;
    dir.join(latest).is_file()
        || tensor_ranks_in(dir)
            .into_iter()
            .any(|t| tensor_rank_dir(dir, t).join(latest).is_file())
}

/// The tensor rank a directory named `name` holds, if it is one: named as [`tensor_rank_dir`]
/// writes it, in plain digits (`parse` alone would take `tensor_rank_+1` and `tensor_rank_01`).
pub fn tensor_rank_of(name: &str) -> Option<usize> {
    let t = name.strip_prefix("tensor_rank_")?;
    let plain = t.bytes().all(|b| b.is_ascii_digit()) && !(t.len() > 1 && t.starts_with('0'));
    plain.then(|| t.parse().ok()).flatten()
}

/// The tensor ranks whose directories (`tensor_rank_{t}`) are under `dir`, in rank order.
pub(crate) fn tensor_ranks_in(dir: &Path) -> Vec<usize> {
    let mut ranks: Vec<usize> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| tensor_rank_of(e.file_name().to_str()?))
        .collect();
    ranks.sort_unstable();
    ranks
}

/// Refuses to save into `dir` a checkpoint of the other kind than it holds: one split over
/// tensor ranks (`tensor_parallel`) beside a whole-model checkpoint (`dir/latest`), or a whole
/// one beside tensor ranks' directories. Readers take the tensor ranks' directories first, so
/// the later save would be silently passed over. Called before a run trains, and again by the
/// save.
pub fn check_same_kind(dir: &Path, tensor_parallel: bool) -> Result<(), CheckpointError> {
    let ranks = tensor_ranks_in(dir);
    let whole = dir.join(super::format::LATEST_FILE).is_file();
    let (holds, saving) = match (tensor_parallel, whole, ranks.is_empty()) {
        (true, true, _) => ("a checkpoint of the whole model (latest)", "split over tensor ranks"),
        (false, _, false) => (
            "a checkpoint split over tensor ranks (tensor_rank_*)",
            "of the whole model",
        ),
        _ => return Ok(()),
    };
    Err(CheckpointError::Usage(format!(
        "{} holds {holds}; a checkpoint {saving} cannot go beside it (a reader would take the other one): \
         save into another directory",
        dir.display()
    )))
}

/// Refuses, before a run that splits the model over `tensor_ranks` (> 1) tensor ranks reads
/// anything, a checkpoint in `dir` it cannot take slice by slice: one saved without tensor
/// parallelism, or over another number of tensor ranks (its slices are other shapes), saying
/// what works instead; and one whose tensor ranks' checkpoints are not one save (a directory
/// missing, moved or from another run, naming it). Every rank reads the same directories, so
/// every rank refuses alike. With one tensor rank there is nothing to check here: reading a
/// split checkpoint whole fails on its own, saying so ([`resolve_tag`](super::resolve_tag)).
pub fn check_tensor_degree(dir: &Path, tag: Option<&str>, tensor_ranks: usize) -> Result<(), CheckpointError> {
    if tensor_ranks <= 1 {
        return Ok(());
    }
    let refuse = |saved: String| {
        CheckpointError::Usage(format!(
            "the checkpoint in {} was saved {saved}, and this run splits the model over {tensor_ranks} tensor \
             ranks: convert it whole with `zero to-fp32` and start from the export",
            dir.display()
        ))
    };
    if !tensor_rank_dir(dir, 0).is_dir() && Checkpoint::open(dir, tag).is_ok() {
        return Err(refuse("without tensor parallelism".into()));
    }
    match TensorParallelCheckpoint::open(dir, tag)? {
        Some(saved) if saved.ranks.len() != tensor_ranks => {
            Err(refuse(format!("over {} tensor ranks", saved.ranks.len())))
        }
        _ => Ok(()),
    }
}

/// Every tensor rank's checkpoint of one save, checked to belong together.
#[derive(Clone, Debug)]
pub struct TensorParallelCheckpoint {
    /// The checkpoint directory (holding the `tensor_rank_{t}` directories).
    pub dir: PathBuf,
    /// Tensor rank `t`'s checkpoint at index `t`.
    pub ranks: Vec<Checkpoint>,
}

impl TensorParallelCheckpoint {
    /// Opens the tensor ranks' checkpoints under `dir` (each at `tag`, or at the tag its own
    /// `latest` names), or `None` when `dir` holds no `tensor_rank_{t}` directory. Fails unless
    /// they are one save: tensor ranks 0 to T-1 each present once, each recording itself as
    /// rank `t` of T, at the same step, with the same parameters split the same way.
    pub fn open(dir: &Path, tag: Option<&str>) -> Result<Option<Self>, CheckpointError> {
        let found = tensor_ranks_in(dir);
        if found.is_empty() {
            return Ok(None);
        }
        let size = found.len();
        if found != (0..size).collect::<Vec<_>>() {
            return Err(CheckpointError::Usage(format!(
                "{}: the tensor ranks' directories are tensor_rank_{{{}}}, expected 0 to {}",
                dir.display(),
                found.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
                size - 1
            )));
        }
        let ranks = (0..size)
            .map(|t| Checkpoint::open(&tensor_rank_dir(dir, t), tag))
            .collect::<Result<Vec<_>, _>>()?;
        let first = &ranks[0];
        for (t, c) in ranks.iter().enumerate() {
            let differ = |what: &str| {
                CheckpointError::Usage(format!(
                    "{}: tensor rank {t}'s checkpoint {what} than tensor rank 0's ({}): they are not one save",
                    c.tag_dir.display(),
                    first.tag_dir.display()
                ))
            };
            match &c.meta.tensor_parallel {
                Some(TensorParallelRecord { rank, size: n, .. }) if *rank == t && *n == size => {}
                Some(TensorParallelRecord { rank, size: n, .. }) => {
                    return Err(CheckpointError::Metadata {
                        path: c.meta_path(),
                        detail: format!(
                            "records tensor rank {rank} of {n}, but it is in tensor_rank_{t} beside {size} tensor ranks"
                        ),
                    })
                }
                None => {
                    return Err(CheckpointError::Metadata {
                        path: c.meta_path(),
                        detail: "records no tensor-parallel split (saved before splits were recorded, or without \
                                 tensor parallelism)"
                            .into(),
                    })
                }
            }
            if c.meta.global_step != first.meta.global_step || c.meta.tag != first.meta.tag {
                return Err(differ("is at another tag or step"));
            }
            let names = |k: &Checkpoint| k.meta.params.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
            if names(c) != names(first) {
                return Err(differ("holds other parameters"));
            }
            let splits = |k: &Checkpoint| k.meta.tensor_parallel.as_ref().map(|r| r.splits.clone());
            if splits(c) != splits(first) {
                return Err(differ("splits its parameters otherwise"));
            }
        }
        Ok(Some(TensorParallelCheckpoint {
            dir: dir.to_path_buf(),
            ranks,
        }))
    }

    /// How the parameters are split (the same on every tensor rank).
    pub fn splits(&self) -> &std::collections::BTreeMap<String, TensorSplit> {
        // `open` refuses a rank without the record.
        static NONE: std::collections::BTreeMap<String, TensorSplit> = std::collections::BTreeMap::new();
        self.ranks[0].meta.tensor_parallel.as_ref().map_or(&NONE, |r| &r.splits)
    }

    /// The whole shape of parameter `p` (of rank 0's layout): its slice's shape, with the split
    /// axis times the tensor ranks. Fails when a split does not fit the slice's shape.
    pub fn whole_shape(&self, p: usize) -> Result<Vec<usize>, CheckpointError> {
        let param = &self.ranks[0].meta.layout.params[p];
        let mut shape = param.shape.clone();
        if let Some(split) = self.splits().get(&param.name) {
            let meta_path = self.ranks[0].meta_path();
            let ranks = self.ranks.len();
            match shape.get_mut(split.axis) {
                Some(n)
                    if split.pieces > 0
                        && *n % split.pieces == 0
                        && split.len.is_none_or(|len| len <= *n * ranks && split.pieces == 1) =>
                {
                    *n = split.len.unwrap_or(*n * ranks)
                }
                _ => {
                    return Err(CheckpointError::Metadata {
                        path: meta_path,
                        detail: format!(
                            "`{}` of shape {:?} cannot be split along axis {} in {} pieces",
                            param.name, param.shape, split.axis, split.pieces
                        ),
                    })
                }
            }
        }
        Ok(shape)
    }
}

/// Writes the whole tensor into `whole` from the tensor ranks' `slices` (rank order, each of
/// shape `slice_shape`) of a parameter split as `split`: for every index before the axis, and
/// every block along it, rank 0's part of the block, then rank 1's, and so on; with
/// `split.len`, only the first `len` along the axis (the padding past it left out).
pub fn merge_slices(slices: &[&[f32]], slice_shape: &[usize], split: TensorSplit, whole: &mut [f32]) {
    let ranks = slices.len();
    let outer: usize = slice_shape[..split.axis].iter().product();
    let inner: usize = slice_shape[split.axis + 1..].iter().product();
    // One rank's part of one block, as contiguous elements (the axis and everything after it).
    let part = slice_shape[split.axis] / split.pieces * inner;
    let slice_row = slice_shape[split.axis] * inner;
    // Elements of one whole row along the axis, padding left out.
    let row = split.len.map_or(slice_row * ranks, |len| len * inner);
    let mut at = 0;
    for o in 0..outer {
        let mut kept = 0;
        for block in 0..split.pieces {
            for slice in slices {
                let n = part.min(row - kept);
                let from = o * slice_row + block * part;
                whole[at..at + n].copy_from_slice(&slice[from..from + n]);
                at += n;
                kept += n;
            }
        }
    }
    debug_assert_eq!(at, outer * row);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_rank_directory_has_one_name() {
        assert_eq!(tensor_rank_of("tensor_rank_0"), Some(0));
        assert_eq!(tensor_rank_of("tensor_rank_12"), Some(12));
        for other in [
            "tensor_rank_",
            "tensor_rank_+1",
            "tensor_rank_01",
            "tensor_rank_1a",
            "global_step1",
        ] {
            assert_eq!(tensor_rank_of(other), None, "{other}");
        }
    }

    /// A published checkpoint is one with a `latest`, its own or a tensor rank's; a save that
    /// never finished (a `TAG.partial` alone) is none.
    #[test]
    fn only_a_published_latest_is_a_checkpoint_held() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!holds_checkpoint(dir.path()));
        std::fs::create_dir_all(dir.path().join("tensor_rank_0/global_step1.partial")).unwrap();
        assert!(!holds_checkpoint(dir.path()));
        std::fs::write(dir.path().join("tensor_rank_0/latest"), "global_step1").unwrap();
        assert!(holds_checkpoint(dir.path()));
        let whole = tempfile::tempdir().unwrap();
        std::fs::write(whole.path().join("latest"), "global_step1").unwrap();
        assert!(holds_checkpoint(whole.path()));
    }

    /// A directory holding one kind of checkpoint refuses the other kind, and takes its own.
    #[test]
    fn a_checkpoint_of_the_other_kind_is_refused_beside_one() {
        let empty = tempfile::tempdir().unwrap();
        check_same_kind(empty.path(), true).expect("an empty directory takes either");
        check_same_kind(empty.path(), false).expect("an empty directory takes either");

        let split = tempfile::tempdir().unwrap();
        std::fs::create_dir(split.path().join("tensor_rank_0")).unwrap();
        check_same_kind(split.path(), true).expect("another split save");
        let e = check_same_kind(split.path(), false).unwrap_err().to_string();
        assert!(e.contains("tensor_rank_*") && e.contains("another directory"), "{e}");

        let whole = tempfile::tempdir().unwrap();
        std::fs::write(whole.path().join("latest"), "global_step2").unwrap();
        check_same_kind(whole.path(), false).expect("another whole save");
        let e = check_same_kind(whole.path(), true).unwrap_err().to_string();
        assert!(e.contains("whole model (latest)"), "{e}");
    }

    /// A `[2, 6]` matrix cut over 2 ranks along axis 1 in 3 blocks (q|k|v): each rank holds the
    /// columns of its half of every block.
    #[test]
    fn merging_a_fused_column_split_restores_the_matrix() {
        let whole: Vec<f32> = (0..12).map(|v| v as f32).collect();
        // Row r: [0..6) + 6r. Blocks of 2 columns; rank 0 takes each block's first column.
        let rank0 = [0.0, 2.0, 4.0, 6.0, 8.0, 10.0];
        let rank1 = [1.0, 3.0, 5.0, 7.0, 9.0, 11.0];
        let mut out = vec![0.0; 12];
        merge_slices(&[&rank0, &rank1], &[2, 3], TensorSplit::blocks(1, 3), &mut out);
        assert_eq!(out, whole);
    }

    /// Rows cut over 3 ranks (a row-parallel weight, an embedding's vocabulary).
    #[test]
    fn merging_a_row_split_concatenates_the_rows() {
        let slices: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32 * 10.0, r as f32 * 10.0 + 1.0]).collect();
        let refs: Vec<&[f32]> = slices.iter().map(Vec::as_slice).collect();
        let mut out = vec![0.0; 6];
        merge_slices(&refs, &[1, 2], TensorSplit::along(0), &mut out);
        assert_eq!(out, [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
    }

    /// A vocabulary of 5 rows padded to 3 per rank over 2 ranks: the padding row is left out.
    #[test]
    fn merging_padded_rows_leaves_the_padding_out() {
        let rank0 = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let rank1 = [6.0, 7.0, 8.0, 9.0, -1.0, -1.0];
        let mut out = vec![0.0; 10];
        merge_slices(&[&rank0, &rank1], &[3, 2], TensorSplit::padded(0, 5), &mut out);
        assert_eq!(out, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    }
}
