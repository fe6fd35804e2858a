//! Crash-safe file replacement: write under a temporary name, flush to disk, rename over the
//! final name, then flush the directory so that the rename itself survives a power cut.
//!
//! A reader therefore sees either the old file or the complete new one, never a prefix.

use super::error::CheckpointError;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The temporary name a file is written under before it is renamed to `path`: hidden, and
/// unique to the process so that two writers never share one.
pub(crate) fn temporary_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp{}", std::process::id()))
}

/// Creates the temporary file for `path`.
pub(crate) fn create_temporary(path: &Path) -> Result<(PathBuf, File), CheckpointError> {
    let tmp = temporary_name(path);
    let file = File::create(&tmp).map_err(|e| CheckpointError::io(&tmp, "create", e))?;
    Ok((tmp, file))
}

/// Flushes `file` (written at `tmp`) to disk and renames it to `path`.
pub(crate) fn commit(tmp: &Path, file: File, path: &Path) -> Result<(), CheckpointError> {
    file.sync_all().map_err(|e| CheckpointError::io(tmp, "fsync", e))?;
    drop(file);
    std::fs::rename(tmp, path).map_err(|e| CheckpointError::io(path, "rename", e))?;
    sync_parent(path)
}

/// Writes `bytes` to `path` atomically.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let (tmp, mut file) = create_temporary(path)?;
    let written = file
        .write_all(bytes)
        .map_err(|e| CheckpointError::io(&tmp, "write", e))
        .and_then(|()| commit(&tmp, file, path));
    if written.is_err() {
        // What failed to be written leaves nothing behind.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Flushes the directory holding `path`, so that a rename or a new entry in it is durable.
pub(crate) fn sync_parent(path: &Path) -> Result<(), CheckpointError> {
    let Some(dir) = path.parent() else {
        return Ok(());
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    sync_dir(dir)
}

/// Flushes a directory's entries to disk (a no-op where directories cannot be opened as files).
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    #[cfg(unix)]
    {
        let d = File::open(dir).map_err(|e| CheckpointError::io(dir, "open directory", e))?;
        d.sync_all()
            .map_err(|e| CheckpointError::io(dir, "fsync directory", e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_file_replaces_whole_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("zero-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("latest");
        write_file(&path, b"first").unwrap();
        write_file(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        assert!(
            !temporary_name(&path).exists(),
            "the temporary name must be renamed away"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
