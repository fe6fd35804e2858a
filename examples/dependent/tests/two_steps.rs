//! zero-burn used from outside its workspace: a model of this crate's own, trained at stage 3.

#[test]
fn the_ranks_train_one_model() {
    let runs = zero_dependent::train(2, 2).expect("two steps on two ranks");
    assert_eq!(runs.len(), 2);
    // One model: after the steps every rank gathers the same whole weights from the shards.
    assert_eq!(runs[0].hidden_weight, runs[1].hidden_weight);
    assert_eq!(runs[0].hidden_weight.len(), 8 * 32);
    // Each rank's loss on its own batch fell over the step between its two forwards.
    for run in &runs {
        assert!(run.losses[1] < run.losses[0], "{:?}", run.losses);
    }
}
