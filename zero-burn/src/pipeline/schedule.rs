//! The 1F1B schedule (PipeDream-Flush, DeepSpeed's `TrainSchedule`): a stage runs a few
//! forwards to fill the pipeline, then alternates one forward and one backward, then drains the
//! backwards left. A stage never holds the activations of more than `stages - stage`
//! micro-batches, where GPipe's all-forwards-then-all-backwards holds all of them.

/// One step of a stage's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipeOp {
    /// Forward of a micro-batch (index in the step's micro-batches).
    Forward(usize),
    /// Backward of a micro-batch.
    Backward(usize),
}

/// The operations of stage `stage` of `stages` for `micro_batches` micro-batches, in order.
/// Forwards and backwards each visit the micro-batches in order.
pub fn one_f_one_b(stage: usize, stages: usize, micro_batches: usize) -> Vec<PipeOp> {
    // Warm-up: the forwards whose backwards cannot have arrived yet.
    let warmup = stages.saturating_sub(stage + 1).min(micro_batches);
    let mut ops = Vec::with_capacity(2 * micro_batches);
    ops.extend((0..warmup).map(PipeOp::Forward));
    let mut backward = 0;
    for forward in warmup..micro_batches {
        ops.push(PipeOp::Forward(forward));
        ops.push(PipeOp::Backward(backward));
        backward += 1;
    }
    ops.extend((backward..micro_batches).map(PipeOp::Backward));
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use PipeOp::*;

    /// Reference: PipeDream-Flush's schedule for 4 stages and 4 micro-batches, written by hand.
    #[test]
    fn warm_up_steady_cool_down() {
        assert_eq!(
            one_f_one_b(0, 4, 4),
            vec![
                Forward(0),
                Forward(1),
                Forward(2),
                Forward(3),
                Backward(0),
                Backward(1),
                Backward(2),
                Backward(3)
            ]
        );
        assert_eq!(
            one_f_one_b(2, 4, 4),
            vec![
                Forward(0),
                Forward(1),
                Backward(0),
                Forward(2),
                Backward(1),
                Forward(3),
                Backward(2),
                Backward(3)
            ]
        );
        assert_eq!(
            one_f_one_b(3, 4, 4),
            vec![
                Forward(0),
                Backward(0),
                Forward(1),
                Backward(1),
                Forward(2),
                Backward(2),
                Forward(3),
                Backward(3)
            ]
        );
    }
}
