//! zero-models
