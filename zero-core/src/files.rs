//! Opening the files a user names for reading without waiting on them.
//!
//! A plain `open` of a FIFO blocks until some process opens it for writing, so a checkpoint or
//! config file replaced by a FIFO (or a path that names one by mistake) would hang the tool at
//! its open, with nothing said. These functions open without blocking and then read as usual.
//! A FIFO is not waited for: one without a writer at the first read reads as empty (an error
//! about its content follows, naming the file), and one whose writer is there, such as a
//! shell's process substitution `<(...)` (a pipe), reads as it should. A regular file reads as
//! with `std::fs` (on a file under a conflicting lease, such as an NFS server's delegation,
//! the open fails where a plain one would wait for the lease's break).
//!
//! Every read has a limit in bytes, given by its caller, so that a wrong path (`/dev/zero`, a
//! dataset given as a config) is refused at once instead of filling memory.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// `path` opened for reading, never waiting for a writer; reads then block as usual.
pub fn open(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function owns, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// The most bytes read from a small file a user names: a config, a hostfile, a model's
/// config.json, a checkpoint's `latest`. Far more than any such file holds.
pub const SMALL: u64 = 8 << 20;

/// The most bytes read from a data stream read whole (a device, a pipe: a token file, a text
/// corpus, a metrics log given as one); a regular file is read whole at any size
/// ([`data_limit`]).
pub const DATA: u64 = 4 << 30;

/// The limit for reading the data file `path` whole: a regular file's own length, which the
/// user chose (a corpus of any size the host holds), or [`DATA`] for anything else, whose end
/// is not known before it is read (`/dev/zero` is refused at the limit).
pub fn data_limit(path: &Path) -> u64 {
    std::fs::metadata(path)
        .ok()
        .filter(std::fs::Metadata::is_file)
        .map_or(DATA, |m| m.len().max(DATA))
}

/// The bytes of `path` (see [`open`]), at most `limit` of them: a longer file is a
/// [`io::ErrorKind::FileTooLarge`] error that says the limit.
pub fn read(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    // One byte past the limit tells a file of exactly the limit from a larger one (a device
    // such as /dev/zero reports no length, so the length cannot be asked first).
    open(path)?.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(limit));
    }
    Ok(bytes)
}

/// The text of `path` (see [`read`]); not UTF-8 is an `InvalidData` error.
pub fn read_to_string(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read(path, limit)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Whether `a` and `b` name one existing regular file (by device and inode: another name, a
/// symbolic link or a hard link to it is the same file). A terminal, a pipe or a path that
/// does not exist is no file here.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .filter(std::fs::Metadata::is_file)
            .map(|m| (m.dev(), m.ino()))
    };
    id(a).is_some_and(|x| id(b) == Some(x))
}

/// The error of a file longer than `limit` bytes.
pub fn too_large(limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::FileTooLarge,
        format!(
            "longer than {}, the most read from such a file: is it the file meant?",
            crate::estimate::human_bytes(limit)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn fifo(path: &Path) {
        let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("a path");
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    #[test]
    fn a_fifo_without_a_writer_reads_empty_at_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("meta.json");
        fifo(&path);
        // On a thread, so that a read that waits fails the test instead of hanging it.
        let (done, result) = std::sync::mpsc::channel();
        let reader_path = path.clone();
        std::thread::spawn(move || done.send(read(&reader_path, SMALL).map_err(|e| e.to_string())));
        let start = Instant::now();
        let bytes = result
            .recv_timeout(Duration::from_secs(10))
            .expect("the read returned instead of waiting for a writer");
        assert_eq!(bytes, Ok(Vec::new()));
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_fifo_with_a_writer_reads_what_it_writes() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("config.json");
        fifo(&path);
        let mut reader = open(&path).expect("open to read");
        // A reader holds the FIFO open, so the writer's open does not wait.
        let mut writer = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open to write");
        writer.write_all(b"{\"a\": 1}").expect("write");
        drop(writer);
        let mut text = String::new();
        reader.read_to_string(&mut text).expect("read");
        assert_eq!(text, "{\"a\": 1}");
    }

    #[test]
    fn a_regular_file_reads_whole() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("f");
        std::fs::write(&path, b"abc").expect("write");
        assert_eq!(read(&path, SMALL).expect("read"), b"abc");
        assert_eq!(read_to_string(&path, 3).expect("exactly the limit"), "abc");
        assert_eq!(
            read(&dir.path().join("missing"), SMALL).expect_err("missing").kind(),
            io::ErrorKind::NotFound
        );
        let e = read(&path, 2).expect_err("one byte over");
        assert_eq!(e.kind(), io::ErrorKind::FileTooLarge);
        assert!(e.to_string().contains("longer than 2 B"), "{e}");
    }

    /// A data file is read whole at any size when it is a regular file; a stream is capped.
    #[test]
    fn a_regular_data_file_is_limited_by_its_own_length_a_stream_by_data() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("corpus.txt");
        let file = std::fs::File::create(&path).expect("create");
        // Sparse: a corpus past the stream limit without writing it.
        file.set_len(DATA + 10).expect("set_len");
        assert_eq!(data_limit(&path), DATA + 10);
        assert_eq!(data_limit(Path::new("/dev/zero")), DATA);
        assert_eq!(data_limit(&dir.path().join("missing")), DATA);
    }

    /// A device that never ends is refused at the limit instead of filling memory.
    #[test]
    fn an_endless_device_is_refused_at_the_limit() {
        let e = read(Path::new("/dev/zero"), 1 << 20).expect_err("endless");
        assert_eq!(e.kind(), io::ErrorKind::FileTooLarge);
        assert!(e.to_string().contains("1.00 MiB"), "{e}");
    }
}
