//! zero-examples
