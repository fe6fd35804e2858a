//! zero-benches
