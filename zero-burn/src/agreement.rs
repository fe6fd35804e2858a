//! What the ranks agree on about a step before it is applied: the gradient norm of a model
//! spread over more ranks than the data-parallel group, whether some rank saw a non-finite loss
//! or gradient (and which, for the error), and so whether the step applies, is skipped or fails.

use crate::error::ZeroError;
use crate::flat_state::FlatState;
use crate::settings::{ComputeDtype, EngineSettings, NonFinitePolicy};
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ReduceOp, SharedGroup};
use zero_core::loss_scaler::{LossScaler, ScaleDecision};
use zero_core::partition::{PartitionLayout, Placement};

/// The squared-and-summed gradient norm of a whole model when this engine holds only a piece
/// of it (a pipeline stage): given the state and the owned, reduced gradients, the global norm.
pub(crate) type GradNormFn = Box<dyn Fn(&FlatState, &[Vec<f32>]) -> Result<f64, ZeroError> + Send + Sync>;

/// The gradient norm of a model spread over more ranks than the data-parallel group: each rank
/// sums the squares of its `counted` parameters in its owned ranges (a replicated group only on
/// data rank 0), and the partial sums are added over each of `groups` in turn (groups whose
/// members hold disjoint parts: the data-parallel group, then the tensor-parallel group).
pub(crate) fn counted_grad_norm(counted: Vec<bool>, data_rank: usize, groups: Vec<SharedGroup>) -> GradNormFn {
    Box::new(move |state: &FlatState, grads: &[Vec<f32>]| {
        let mut sum = 0.0f64;
        // A group that does not train has no gradient.
        for (gi, grad) in grads.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            let rank = match state.layout.groups[gi].placement {
                Placement::Replicated if data_rank != 0 => continue,
                Placement::Replicated => 0,
                Placement::Sharded => data_rank,
            };
            for seg in state.layout.segments(gi, rank) {
                if counted[seg.param] {
                    sum += zero_core::passes::sum_squares(&grad[seg.local]);
                }
            }
        }
        for group in &groups {
            if group.world_size() > 1 {
                let mut b = FlatBuffer::F32(vec![sum as f32]);
                group.all_reduce(&mut b, ReduceOp::Sum)?;
                sum = b.into_f32()[0] as f64;
            }
        }
        Ok(sum.sqrt())
    })
}

/// LAMB's per-tensor norms of a model split over tensor ranks: each optimizer group's partial
/// sums (a pair per parameter of the group, already added over the data ranks) add over the
/// tensor ranks too. A parameter split over them counts on every tensor rank; one that every
/// tensor rank holds whole counts on tensor rank 0 alone, so that it counts once.
#[derive(Clone)]
pub(crate) struct TensorNorms {
    group: SharedGroup,
    /// Per optimizer group, per parameter of the group: whether it is split over the ranks.
    split: Arc<Vec<Vec<bool>>>,
}

impl TensorNorms {
    /// The norms of `layout`'s groups over `group`, `is_split(p)` telling whether `layout`'s
    /// parameter `p` is split over the ranks.
    pub(crate) fn new(group: SharedGroup, layout: &PartitionLayout, is_split: impl Fn(usize) -> bool) -> Self {
        let split = layout
            .groups
            .iter()
            .map(|g| g.params.iter().map(|&p| is_split(p)).collect())
            .collect();
        TensorNorms {
            group,
            split: Arc::new(split),
        }
    }

    /// Whether there is more than one tensor rank to add over.
    pub(crate) fn spans_ranks(&self) -> bool {
        self.group.world_size() > 1
    }

    /// Adds optimizer group `gi`'s partial sums `values` over the tensor ranks, `param_of(k)`
    /// being the parameter of the group that `values[k]` belongs to.
    pub(crate) fn sum(
        &self,
        gi: usize,
        values: &mut [f32],
        param_of: impl Fn(usize) -> usize,
    ) -> Result<(), ZeroError> {
        if !self.spans_ranks() {
            return Ok(());
        }
        let split = &self.split[gi];
        let mut counted: Vec<f32> = values.to_vec();
        if self.group.rank() != 0 {
            for (k, v) in counted.iter_mut().enumerate() {
                if !split[param_of(k)] {
                    *v = 0.0;
                }
            }
        }
        let mut buf = FlatBuffer::F32(counted);
        self.group.all_reduce(&mut buf, ReduceOp::Sum)?;
        values.copy_from_slice(&buf.into_f32());
        Ok(())
    }
}

/// What a rank found infinite or NaN in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NonFiniteSeen {
    /// A micro-batch loss.
    Loss,
    /// Its shard of the averaged gradient.
    Gradient,
}

/// A rank that saw a non-finite value in a step, and what it saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Overflow {
    /// The rank (in the group that agrees on the step).
    pub rank: usize,
    /// What it saw.
    pub seen: NonFiniteSeen,
}

impl Overflow {
    /// The one value this rank contributes to the step's overflow all-reduce (`ReduceOp::Max`):
    /// 0 when it saw nothing, else a code that puts lower ranks above higher ones and, on one
    /// rank, a loss above a gradient. The maximum over the ranks thus names the lowest rank that
    /// saw one and what it saw, for the price of the one scalar the ranks exchange anyway to
    /// agree on the step. Exact in f32 up to 2^23 ranks.
    pub(crate) fn code(mine: Option<Overflow>, world: usize) -> f32 {
        mine.map_or(0.0, |o| {
            (2 * world.saturating_sub(o.rank) + usize::from(o.seen == NonFiniteSeen::Loss)) as f32
        })
    }

    /// The reduced code back: `None` when no rank saw a non-finite value.
    pub(crate) fn decode(code: f32, world: usize) -> Option<Overflow> {
        if code.is_nan() || code < 1.0 {
            return None;
        }
        let code = code as usize;
        Some(Overflow {
            rank: world.saturating_sub(code / 2),
            seen: if code % 2 == 1 {
                NonFiniteSeen::Loss
            } else {
                NonFiniteSeen::Gradient
            },
        })
    }
}

/// The ranks that agree on skipping (or failing) a step: reduced over each of `groups` in turn
/// (groups that together span them: the data-parallel group, then the tensor-parallel one), this
/// rank being `rank` of `world` among them.
#[derive(Clone)]
pub(crate) struct Agreement {
    /// The groups the code is reduced over, in order.
    pub groups: Vec<SharedGroup>,
    /// This rank, among all the agreeing ranks.
    pub rank: usize,
    /// The agreeing ranks.
    pub world: usize,
}

impl Agreement {
    /// The ranks of `group`.
    pub fn over(group: SharedGroup) -> Self {
        Agreement {
            rank: group.rank(),
            world: group.world_size(),
            groups: vec![group],
        }
    }

    /// The data-parallel ranks of every tensor rank: rank `t × data + d`.
    pub fn data_and_tensor(data: SharedGroup, tensor: SharedGroup) -> Self {
        Agreement {
            rank: tensor.rank() * data.world_size() + data.rank(),
            world: data.world_size() * tensor.world_size(),
            groups: vec![data, tensor],
        }
    }

    /// This rank's overflow (what it saw), and the one every agreeing rank sees: the lowest rank
    /// that saw one, and what it saw (one scalar maximum per group).
    pub fn agree(&self, seen: Option<NonFiniteSeen>) -> Result<(Option<Overflow>, Option<Overflow>), ZeroError> {
        let mine = seen.map(|seen| Overflow { rank: self.rank, seen });
        let mut code = Overflow::code(mine, self.world);
        for group in self.groups.iter().filter(|g| g.world_size() > 1) {
            let mut buf = FlatBuffer::F32(vec![code]);
            group.all_reduce(&mut buf, ReduceOp::Max)?;
            code = buf.into_f32()[0];
        }
        Ok((mine, Overflow::decode(code, self.world)))
    }
}

/// What a step does once every rank agreed whether any saw a non-finite loss or gradient
/// (`agreed`, the lowest such rank; `mine`, what this rank saw): `true` to apply it, `false` to
/// skip it (fp16's loss scaler backs off, or the skip policy), or the error of the fail policy
/// (naming what this rank saw, or else the rank that saw it) or of a loss scale that can fall no
/// further.
pub(crate) fn decide_step(
    scaler: &mut Option<LossScaler>,
    settings: &EngineSettings,
    agreed: Option<Overflow>,
    mine: Option<Overflow>,
    step: u64,
    loss_scale: f64,
) -> Result<bool, ZeroError> {
    if let Some(scaler) = scaler {
        return match scaler.update(agreed.is_some()) {
            Ok(ScaleDecision::Skip) => Ok(false),
            Ok(ScaleDecision::Apply) => Ok(true),
            Err(source) => Err(ZeroError::LossScale {
                step,
                scale: loss_scale,
                source,
            }),
        };
    }
    let Some(seen) = mine.or(agreed) else {
        return Ok(true);
    };
    if settings.precision.non_finite == NonFinitePolicy::Skip {
        return Ok(false);
    }
    Err(ZeroError::NonFinite {
        step,
        what: match seen.seen {
            NonFiniteSeen::Loss => "the loss",
            NonFiniteSeen::Gradient => "the averaged gradient",
        }
        .to_string(),
        rank: seen.rank,
        dtype: match settings.precision.dtype {
            ComputeDtype::F32 => "fp32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "fp16",
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Stage;

    #[test]
    fn the_largest_overflow_code_names_the_lowest_rank_and_a_loss_before_a_gradient() {
        let world = 4;
        let seen = |rank, seen| Some(Overflow { rank, seen });
        let codes = [
            Overflow::code(None, world),
            Overflow::code(seen(3, NonFiniteSeen::Loss), world),
            Overflow::code(seen(1, NonFiniteSeen::Gradient), world),
            Overflow::code(seen(2, NonFiniteSeen::Loss), world),
        ];
        let max = codes.iter().copied().fold(0.0f32, f32::max);
        assert_eq!(Overflow::decode(max, world), seen(1, NonFiniteSeen::Gradient));
        let with_loss = max.max(Overflow::code(seen(1, NonFiniteSeen::Loss), world));
        assert_eq!(Overflow::decode(with_loss, world), seen(1, NonFiniteSeen::Loss));
        assert_eq!(Overflow::decode(Overflow::code(None, world), world), None);
        // Rank 0 of the largest world the f32 code holds exactly.
        let big = 1 << 22;
        let code = Overflow::code(seen(0, NonFiniteSeen::Loss), big);
        assert_eq!(Overflow::decode(code, big), seen(0, NonFiniteSeen::Loss));
    }

    #[test]
    fn fp32_fails_a_non_finite_step_by_default_naming_the_rank_that_saw_it() {
        let settings = EngineSettings::new(Stage::Zero1, zero_core::optim::OptimizerSpec::adamw());
        assert_eq!(settings.precision.non_finite, NonFinitePolicy::Error);
        let agreed = Some(Overflow {
            rank: 2,
            seen: NonFiniteSeen::Loss,
        });
        let err = decide_step(&mut None, &settings, agreed, None, 1, 1.0).expect_err("fails");
        let text = err.to_string();
        assert!(
            text.contains("step 1") && text.contains("the loss") && text.contains("rank 2") && text.contains("fp32"),
            "{text}"
        );
        assert!(decide_step(&mut None, &settings, None, None, 1, 1.0).expect("no overflow"));
    }
}
