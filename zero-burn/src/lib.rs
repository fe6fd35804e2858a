//! zero-burn
