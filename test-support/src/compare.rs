//! Largest differences and relative errors between a result and its reference.

use std::fmt;

/// One part of some [`Values`]: a slice of f32 or of f64.
#[derive(Clone, Copy, Debug)]
pub enum Part<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
}

impl Part<'_> {
    fn len(&self) -> usize {
        match self {
            Part::F32(v) => v.len(),
            Part::F64(v) => v.len(),
        }
    }

    fn get(&self, i: usize) -> f64 {
        match self {
            Part::F32(v) => f64::from(v[i]),
            Part::F64(v) => v[i],
        }
    }
}

/// Numbers to compare, in parts: a flat slice is one part, a slice of vectors (a model's
/// parameters, one vector each) one part per vector.
pub trait Values {
    /// The parts, in order.
    fn parts(&self) -> Vec<Part<'_>>;
}

impl<T: Values + ?Sized> Values for &T {
    fn parts(&self) -> Vec<Part<'_>> {
        (**self).parts()
    }
}

macro_rules! values_of {
    ($elem:ty, $variant:ident) => {
        impl Values for [$elem] {
            fn parts(&self) -> Vec<Part<'_>> {
                vec![Part::$variant(self)]
            }
        }
        impl Values for Vec<$elem> {
            fn parts(&self) -> Vec<Part<'_>> {
                vec![Part::$variant(self)]
            }
        }
        impl<const N: usize> Values for [$elem; N] {
            fn parts(&self) -> Vec<Part<'_>> {
                vec![Part::$variant(self)]
            }
        }
        impl Values for [Vec<$elem>] {
            fn parts(&self) -> Vec<Part<'_>> {
                self.iter().map(|v| Part::$variant(v)).collect()
            }
        }
        impl Values for Vec<Vec<$elem>> {
            fn parts(&self) -> Vec<Part<'_>> {
                self.iter().map(|v| Part::$variant(v)).collect()
            }
        }
        impl<const N: usize> Values for [Vec<$elem>; N] {
            fn parts(&self) -> Vec<Part<'_>> {
                self.iter().map(|v| Part::$variant(v)).collect()
            }
        }
    };
}

values_of!(f32, F32);
values_of!(f64, F64);

/// Where a value sits: `element i` of a single part, `part p, element i` of several.
#[derive(Clone, Copy, Debug)]
struct At {
    part: usize,
    index: usize,
    parts: usize,
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.parts == 1 {
            write!(f, "element {}", self.index)
        } else {
            write!(f, "part {}, element {}", self.part, self.index)
        }
    }
}

/// Every value with where it sits.
fn each<'a>(parts: &'a [Part<'a>]) -> impl Iterator<Item = (At, f64)> + 'a {
    let count = parts.len();
    parts.iter().enumerate().flat_map(move |(part, p)| {
        (0..p.len()).map(move |index| {
            let at = At {
                part,
                index,
                parts: count,
            };
            (at, p.get(index))
        })
    })
}

/// The largest |got - want|, where it is, and the two values there.
#[derive(Clone, Copy, Debug)]
struct Worst {
    diff: f64,
    at: Option<(At, f64, f64)>,
}

/// Fails, naming `what` and the place, unless `got` and `want` have the same parts of the same
/// lengths, all finite; then the largest difference.
#[track_caller]
fn worst(what: &str, got: &(impl Values + ?Sized), want: &(impl Values + ?Sized)) -> Worst {
    let (got, want) = (got.parts(), want.parts());
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: the result has {} parts, the reference {}",
        got.len(),
        want.len()
    );
    for (part, (g, w)) in got.iter().zip(&want).enumerate() {
        let (g, w) = (g.len(), w.len());
        let place = if got.len() == 1 {
            String::new()
        } else {
            format!(" in part {part}")
        };
        assert_eq!(g, w, "{what}: the result has {g} values{place}, the reference {w}");
    }
    let mut out = Worst { diff: 0.0, at: None };
    for ((at, g), (_, w)) in each(&got).zip(each(&want)) {
        assert!(g.is_finite(), "{what}: the result is {g} at {at} (the reference {w})");
        assert!(w.is_finite(), "{what}: the reference is {w} at {at} (the result {g})");
        let diff = (g - w).abs();
        if out.at.is_none() || diff > out.diff {
            out = Worst {
                diff,
                at: Some((at, g, w)),
            };
        }
    }
    out
}

/// The largest magnitude in `values`; fails, naming `what` and the place, on a NaN or an
/// infinity. 0 for no values.
#[track_caller]
pub fn max_abs(what: &str, values: &(impl Values + ?Sized)) -> f64 {
    let parts = values.parts();
    let mut largest = 0.0f64;
    for (at, v) in each(&parts) {
        assert!(v.is_finite(), "{what}: {v} at {at}");
        largest = largest.max(v.abs());
    }
    largest
}

/// max |got - want| over every value; fails, naming `what` and what differed, unless both have
/// the same parts of the same lengths and every value is finite.
#[track_caller]
pub fn max_abs_diff(what: &str, got: &(impl Values + ?Sized), want: &(impl Values + ?Sized)) -> f64 {
    worst(what, got, want).diff
}

/// max |got - want| / max |want|: relative to the reference's scale, so that values near zero
/// do not blow the measure up. Fails as [`max_abs_diff`] does, and where the reference is all
/// zeros (a relative error would mean nothing).
#[track_caller]
pub fn max_relative_error(what: &str, got: &(impl Values + ?Sized), want: &(impl Values + ?Sized)) -> f64 {
    let diff = worst(what, got, want).diff;
    diff / scale(what, want)
}

#[track_caller]
fn scale(what: &str, want: &(impl Values + ?Sized)) -> f64 {
    let scale = max_abs(what, want);
    assert!(
        scale > 0.0,
        "{what}: the reference is all zeros (or empty), so a relative error would mean nothing"
    );
    scale
}

/// Fails, naming `what` and the largest difference, unless [`max_relative_error`] is at most
/// `tolerance`.
#[track_caller]
pub fn assert_close(what: &str, got: &(impl Values + ?Sized), want: &(impl Values + ?Sized), tolerance: f64) {
    let worst = worst(what, got, want);
    let error = worst.diff / scale(what, want);
    if let (false, Some((at, g, w))) = (error <= tolerance, worst.at) {
        panic!("{what}: relative error {error:e} (tolerance {tolerance:e}); the largest difference at {at}: {g} against {w}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_the_largest_difference_against_the_largest_reference() {
        let got = vec![vec![1.0f32, 2.5], vec![-4.0]];
        let want = vec![vec![1.0f32, 2.0], vec![-4.0]];
        assert_eq!(max_abs_diff("w", &got, &want), 0.5);
        assert_eq!(max_relative_error("w", &got, &want), 0.125);
        assert_eq!(max_abs("w", &want), 4.0);
        assert_close("w", &got, &want, 0.125);
        // f32 against f64, flat.
        assert_eq!(max_abs_diff("w", &[1.0f32, 2.0], &[1.0f64, 2.25]), 0.25);
    }

    #[test]
    #[should_panic(expected = "w: the result is NaN at element 0")]
    fn an_all_nan_result_fails() {
        max_relative_error("w", &[f32::NAN, f32::NAN], &[1.0f32, 2.0]);
    }

    #[test]
    #[should_panic(expected = "w: the reference is inf at part 1, element 0")]
    fn an_infinite_reference_fails() {
        max_abs_diff(
            "w",
            &vec![vec![1.0f64], vec![2.0]],
            &vec![vec![1.0f64], vec![f64::INFINITY]],
        );
    }

    #[test]
    #[should_panic(expected = "w: NaN at element 1")]
    fn a_nan_magnitude_fails() {
        max_abs("w", &[1.0f32, f32::NAN]);
    }

    #[test]
    #[should_panic(expected = "w: the result has 1 parts, the reference 2")]
    fn a_missing_part_fails() {
        max_abs_diff("w", &vec![vec![1.0f32]], &vec![vec![1.0f32], vec![2.0]]);
    }

    #[test]
    #[should_panic(expected = "w: the result has 1 values in part 1, the reference 2")]
    fn a_short_part_fails() {
        max_abs_diff("w", &vec![vec![1.0f32], vec![2.0]], &vec![vec![1.0f32], vec![2.0, 3.0]]);
    }

    #[test]
    #[should_panic(expected = "w: the result has 2 values, the reference 3")]
    fn a_short_slice_fails() {
        max_abs_diff("w", &[1.0f32, 2.0], &[1.0f32, 2.0, 3.0]);
    }

    #[test]
    #[should_panic(expected = "the reference is all zeros")]
    fn a_zero_reference_has_no_relative_error() {
        max_relative_error("w", &[0.0f32], &[0.0f32]);
    }

    #[test]
    #[should_panic(
        expected = "w: relative error 2.5e-1 (tolerance 1e-1); the largest difference at element 1: 3 against 4"
    )]
    fn assert_close_names_the_largest_difference() {
        assert_close("w", &[1.0f32, 3.0], &[1.0f32, 4.0], 0.1);
    }
}
