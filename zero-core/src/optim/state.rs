//! Restoring named state buffers from a checkpoint, all-or-nothing.

use super::{check_len, OptimError};

/// Copies `buffers` into `targets` (matched by name) after checking that every target is present
/// exactly once, that no unknown name is given, and that every length is `len`. Nothing is
/// written unless everything checks.
pub(crate) fn load_buffers(
    len: usize,
    targets: &mut [(&'static str, &mut Vec<f32>)],
    buffers: &[(&str, &[f32])],
) -> Result<(), OptimError> {
    let expected = || targets.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ");
    for (name, data) in buffers {
        if !targets.iter().any(|(n, _)| n == name) {
            return Err(OptimError::UnknownState {
                name: name.to_string(),
                expected: expected(),
            });
        }
        check_len(&format!("state `{name}`"), len, data.len())?;
    }
    for (name, _) in targets.iter() {
        if !buffers.iter().any(|(n, _)| n == name) {
            return Err(OptimError::MissingState {
                name: name.to_string(),
                expected: expected(),
            });
        }
    }
    for (name, target) in targets.iter_mut() {
        if let Some((_, data)) = buffers.iter().find(|(n, _)| n == name) {
            target.clear();
            target.extend_from_slice(data);
        }
    }
    Ok(())
}
