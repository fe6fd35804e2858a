//! What the workspace's tests share: comparisons of numbers that cannot pass by accident, and a
//! skip that CI refuses.
//!
//! A maximum folded with `f64::max` drops NaN (`0.0f64.max(f64::NAN)` is 0), so an all-NaN
//! result would score a difference of 0; and `zip` stops at the shorter side, so a result
//! missing its last values would compare equal. Every comparison here instead fails, naming
//! what differed, on a NaN or an infinity on either side, on a different number of parts, or on
//! parts of different lengths.
//!
//! It is not a numerics library: it measures, the tests choose their tolerances.
//!
//! ```
//! use zero_test_support::{assert_close, max_relative_error};
//!
//! // A model's parameters, one vector each.
//! let want = vec![vec![1.0f32, 2.0], vec![4.0]];
//! assert_close("weights", &vec![vec![1.0f32, 2.0], vec![4.0 + 1e-6]], &want, 1e-6);
//! // An all-NaN result does not score 0, and one missing its last parameter does not pass.
//! let nan = vec![vec![f32::NAN; 2], vec![f32::NAN]];
//! assert!(std::panic::catch_unwind(|| max_relative_error("weights", &nan, &want)).is_err());
//! assert!(std::panic::catch_unwind(|| max_relative_error("weights", &want[..1], &want)).is_err());
//! ```

mod compare;
mod skip;

pub use compare::{assert_close, max_abs, max_abs_diff, max_relative_error, Part, Values};
pub use skip::{in_ci, skip};
