//! The 1F1B schedule's invariants for every small pipeline, against their definition: each
//! micro-batch's forward then its backward, exactly once each, in micro-batch order, and a stage
//! `s` of `p` never holding more than `p - s` micro-batches' activations (GPipe would hold `m`).

use zero_burn::pipeline::{one_f_one_b, PipeOp};

#[test]
fn every_stage_holds_at_most_p_minus_s_activations() {
    for p in 1..=8 {
        for m in 1..=16 {
            for s in 0..p {
                let ops = one_f_one_b(s, p, m);
                assert_eq!(
                    ops.len(),
                    2 * m,
                    "p {p} m {m} stage {s}: one forward and one backward each"
                );
                let (mut forwards, mut backwards, mut live, mut peak) = (0, 0, 0usize, 0usize);
                for op in &ops {
                    match *op {
                        PipeOp::Forward(i) => {
                            assert_eq!(i, forwards, "p {p} m {m} stage {s}: forwards in order");
                            forwards += 1;
                            live += 1;
                        }
                        PipeOp::Backward(i) => {
                            assert_eq!(i, backwards, "p {p} m {m} stage {s}: backwards in order");
                            assert!(i < forwards, "p {p} m {m} stage {s}: backward {i} before its forward");
                            backwards += 1;
                            live -= 1;
                        }
                    }
                    peak = peak.max(live);
                }
                // The bound is reached: the warm-up fills exactly p - s slots (or all m).
                assert_eq!(peak, (p - s).min(m), "p {p} m {m} stage {s}: activations in flight");
            }
        }
    }
}

/// The last stage alternates from the start (no warm-up); the first waits for p - 1 forwards.
#[test]
fn last_stage_alternates_first_stage_warms_up() {
    let last = one_f_one_b(3, 4, 3);
    assert!(last
        .chunks(2)
        .all(|c| matches!(c, [PipeOp::Forward(a), PipeOp::Backward(b)] if a == b)));
    let first = one_f_one_b(0, 4, 8);
    assert_eq!(
        &first[..4],
        &[
            PipeOp::Forward(0),
            PipeOp::Forward(1),
            PipeOp::Forward(2),
            PipeOp::Forward(3)
        ]
    );
    assert_eq!(first[4], PipeOp::Backward(0));
}
