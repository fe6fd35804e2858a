//! What the `zero launch` tests share: the binary, scratch directories, and whether a process
//! is still alive.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// The `zero` binary.
pub fn zero() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zero"))
}

/// An empty directory for the test `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zero-launch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// True while `pid` is a live (not zombie) process.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .map(|s| !s.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}
