//! Which parameter tensor each part of a shard belongs to, and the per-parameter partial sums
//! that optimizers with per-tensor norms (LAMB) exchange between ranks.

use std::ops::Range;

use super::OptimError;

/// A piece of one parameter tensor inside a rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The parameter's index in the model's flat layout (the same on every rank).
    pub param_id: usize,
    /// Where the piece lies in this rank's shard.
    pub range: Range<usize>,
}

/// How a rank's shard is cut into parameter pieces.
///
/// Elements outside every segment are padding: optimizers with per-tensor norms leave them
/// alone (they are zero and stay zero).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSegments {
    /// Number of parameters in the whole model (not just this shard), so that every rank's
    /// partial sums have the same length.
    pub num_params: usize,
    /// The pieces in this shard, in any order, not overlapping.
    pub segments: Vec<Segment>,
}

impl ShardSegments {
    /// A shard that is one whole parameter tensor of `len` elements.
    pub fn single(len: usize) -> Self {
        ShardSegments {
            num_params: 1,
            segments: vec![Segment {
                param_id: 0,
                range: 0..len,
            }],
        }
    }

    /// Checks that the segments lie in a shard of `len` elements, do not overlap, and name
    /// parameters below `num_params`.
    pub fn validate(&self, len: usize) -> Result<(), OptimError> {
        let bad = |index: usize, s: &Segment, reason: String| OptimError::InvalidSegment {
            index,
            param_id: s.param_id,
            start: s.range.start,
            end: s.range.end,
            reason,
        };
        for (index, s) in self.segments.iter().enumerate() {
            if s.range.start > s.range.end || s.range.end > len {
                return Err(bad(index, s, format!("outside the shard of {len} elements")));
            }
            if s.param_id >= self.num_params {
                return Err(bad(
                    index,
                    s,
                    format!("parameter id not below num_params = {}", self.num_params),
                ));
            }
        }
        let mut order: Vec<usize> = (0..self.segments.len()).collect();
        order.sort_by_key(|&i| self.segments[i].range.start);
        for pair in order.windows(2) {
            let (a, b) = (&self.segments[pair[0]], &self.segments[pair[1]]);
            if b.range.start < a.range.end && !b.range.is_empty() && !a.range.is_empty() {
                return Err(bad(
                    pair[1],
                    b,
                    format!("overlaps segment #{} ({:?})", pair[0], a.range),
                ));
            }
        }
        Ok(())
    }
}

/// Per-parameter partial sums of squares, `[‖p‖², ‖u‖²]` for each parameter id in turn, as one
/// flat f32 buffer so that the caller can all-reduce (sum) it in one collective.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NormPartials(pub Vec<f32>);

impl NormPartials {
    /// No partials: the optimizer needs no cross-rank norms.
    pub fn empty() -> Self {
        NormPartials(Vec::new())
    }

    /// Zeroed partials for `num_params` parameters.
    pub fn zeros(num_params: usize) -> Self {
        NormPartials(vec![0.0; 2 * num_params])
    }

    /// Whether there is nothing to exchange.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Number of parameters covered.
    pub fn num_params(&self) -> usize {
        self.0.len() / 2
    }

    /// ‖p‖² of parameter `id` (partial or total).
    pub fn weight_sq(&self, id: usize) -> f32 {
        self.0[2 * id]
    }

    /// ‖u‖² of parameter `id` (partial or total).
    pub fn update_sq(&self, id: usize) -> f32 {
        self.0[2 * id + 1]
    }

    /// Adds another rank's partials element-wise (what an all-reduce with sum does).
    pub fn add_assign(&mut self, other: &NormPartials) {
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a += b;
        }
    }
}
