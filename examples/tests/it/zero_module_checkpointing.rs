//! Activation checkpointing on the `ZeroModule` path: the zoo's `ShardedGpt2` trained in
//! Burn's own loop with `ZeroOptimizer`, each micro-batch's gradients from
//! `zero_burn::checkpointed_grads` (the blocks run untracked in forward, only each segment's
//! input kept, and again, unit by unit gathered, in backward), as `gpt2 train` does under an
//! `activation_checkpointing` section.
//!
//! Reference: one process, the plain `Gpt2` trained by Burn's own AdamW over the whole batch
//! with no checkpointing (the harness's `one_process`), every unit's parameters after 5 steps to
//! 1e-6 of the largest: the same reference as the matrix of zero_module_gpt2.rs.

use crate::zero_module;
use zero_burn::ActivationCheckpointing;
use zero_module::*;
use zero_test_support::assert_close;

#[test]
fn checkpointed_training_equals_one_process_at_every_stage() {
    let batch = matrix_batch();
    let clip = 0.5;
    let want = one_process(&batch, clip);
    let lens: Vec<usize> = want.iter().map(Vec::len).collect();
    let one_per_block = ActivationCheckpointing::default();
    let two_on_the_host = ActivationCheckpointing {
        number_checkpoints: Some(2),
        cpu_checkpointing: true,
        ..Default::default()
    };
    // The units' shards in a file (`offload_param` nvme): the checkpointed forward runs the
    // blocks on copies of them, which must still read the shards from the file.
    let swap = tempfile::tempdir().expect("temp dir");
    for (stage, world, gas, setting, offload_param) in [
        (0u8, 2, 1, &one_per_block, false),
        (1, 2, 2, &two_on_the_host, false),
        (2, 2, 1, &two_on_the_host, false),
        (3, 1, 1, &one_per_block, false),
        (3, 2, 2, &one_per_block, false),
        (3, 4, 1, &two_on_the_host, false),
        (3, 2, 1, &two_on_the_host, true),
    ] {
        let micro = 24 / (world * gas);
        let options = RunOptions {
            checkpointed: Some(setting),
            ..RunOptions::default()
        };
        let mut config: serde_json::Value =
            serde_json::from_str(&matrix_config(stage, world, gas, clip)).expect("the matrix's config");
        if offload_param {
            config["zero_optimization"]["offload_param"] =
                serde_json::json!({ "device": "nvme", "nvme_path": swap.path(), "max_in_cpu": 0 });
        }
        let runs = train_zero_between(&config.to_string(), world, micro, gas, &batch, STEPS, options);
        assert!(
            runs[0].norms.iter().all(|&n| n > clip),
            "every step clips: {:?}",
            runs[0].norms
        );
        let label =
            format!("stage {stage}, world {world}, accumulation {gas}, {setting:?}, offload_param {offload_param}");
        for (u, (got, want)) in put_together(&runs, &lens).iter().zip(&want).enumerate() {
            assert_close(&format!("{label}: unit {u}"), got, want, 1e-6);
        }
    }
}
