//! Tests that cannot run where something they need is absent.

/// Whether this is a CI run: the environment variable `CI` is `true` (or `1`), as CI services
/// set it and `.ci/run` does.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Skips the rest of a check because `why` (something it needs is absent), saying so on
/// stderr; under CI ([`in_ci`]) fails instead, where a skip would pass a check that never ran.
///
/// The caller returns after it.
#[track_caller]
pub fn skip(why: impl std::fmt::Display) {
    assert!(!in_ci(), "CI is set, and a check cannot run: {why}");
    eprintln!("skipped: {why}");
}
