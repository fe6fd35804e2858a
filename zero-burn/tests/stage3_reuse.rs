//! Stage 3 keeps the ends gathered between their uses when `stage3_max_reuse_distance` and
//! `stage3_max_live_parameters` allow (DeepSpeed's defaults, 1e9 each, do for any model here):
//! one gather of the ends per micro-batch instead of three, and the same weights.
//!
//! Reference: the same engine with `max_reuse_distance = 0`, which gathers the ends for each of
//! their three uses (embedding, head, embedding's backward); the count of all-gathers follows
//! from the schedule (ends, every block in forward, every block in backward, plus the two
//! re-gathers of the ends).

mod common;
mod precision_support;

use common::*;
use precision_support::Recording;
use std::sync::{Arc, Mutex};
use zero_burn::{ChainEngine, EngineSettings, Stage};

const BLOCKS: usize = 3;

fn run(max_reuse_distance: usize, overlap: bool) -> (Vec<Vec<f32>>, usize, usize) {
    let results = on_ranks(2, move |rank, group| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let recording = Arc::new(Recording {
            inner: group,
            log: log.clone(),
        });
        let mut s = EngineSettings::new(Stage::Zero3, adamw_eps4(0.01));
        s.param_persistence_threshold = 13;
        s.overlap_comm = overlap;
        s.max_reuse_distance = max_reuse_distance;
        let device = Default::default();
        let mut engine = ChainEngine::new(s, Net::<B>::new(&device, BLOCKS), recording).expect("engine");
        let mut gathers_per_micro_batch = 0;
        for step in 0..3 {
            let before = log.lock().expect("log").len();
            let loss = engine
                .forward(batch::<B>(step, rank * 12..(rank + 1) * 12, &device))
                .expect("forward");
            engine.backward(loss).expect("backward");
            let issued = log.lock().expect("log")[before..]
                .iter()
                .filter(|i| i.op == "all_gather")
                .count();
            gathers_per_micro_batch = issued;
            engine.step().expect("step");
        }
        let gathered = engine.memory().gathered;
        assert_eq!(gathered.current, 0, "nothing stays gathered after a step");
        let peak = gathered.peak;
        (
            values::<B, _>(&engine.module().expect("module")),
            gathers_per_micro_batch,
            peak,
        )
    });
    results.into_iter().next().expect("rank 0")
}

#[test]
fn ends_are_gathered_once_per_micro_batch_when_reuse_allows() {
    for overlap in [false, true] {
        let (kept, kept_gathers, kept_peak) = run(1_000_000_000, overlap);
        let (regathered, regathered_gathers, regathered_peak) = run(0, overlap);
        assert_eq!(kept, regathered, "overlap {overlap}: the same weights either way");
        assert_eq!(
            regathered_gathers,
            1 + 2 * BLOCKS + 2,
            "overlap {overlap}: ends three times"
        );
        assert_eq!(kept_gathers, 1 + 2 * BLOCKS, "overlap {overlap}: ends once");
        assert!(
            kept_peak > regathered_peak || overlap,
            "without prefetch, keeping the ends raises the gathered peak ({kept_peak} vs {regathered_peak})"
        );
    }
}
