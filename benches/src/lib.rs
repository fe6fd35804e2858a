//! zero-benches: the benchmark binaries (src/bin) and the command-line reading they share.

pub mod cli;
