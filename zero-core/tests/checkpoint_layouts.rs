//! A checkpoint of one layout of a model loads into another layout of the same model: the
//! parameters matched by their names in the model's naming, whatever their order, and a
//! pipeline head's tied copy (`lm_head.weight`) read from, or standing for, the embedding.
//! Reference: the saved function of (saved parameter, element) at the matched parameter.

mod checkpoint_support;

use checkpoint_support::*;
use zero_core::checkpoint::{self, ModelRecord, GPT2_HF_NAMING};
use zero_core::partition::ParamSpec;

fn spec(name: &str, shape: &[usize]) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        shape: shape.to_vec(),
    }
}

fn gpt2() -> Option<ModelRecord> {
    Some(ModelRecord {
        naming: GPT2_HF_NAMING.into(),
        config: serde_json::json!({}),
    })
}

/// GPT-2's parameters as a pipeline lays them out: the head's copy of `wte` before `ln_f`.
fn pipelined() -> Vec<ParamSpec> {
    vec![
        spec("wte.weight", &[11, 4]),
        spec("wpe.weight", &[6, 4]),
        spec("blocks.0.attn.c_attn.weight", &[4, 12]),
        spec("lm_head.weight", &[11, 4]),
        spec("ln_f.gamma", &[4]),
    ]
}

/// The same model as the sharded GPT-2 names it.
fn sharded() -> Vec<ParamSpec> {
    vec![
        spec("embed.wte.weight", &[11, 4]),
        spec("embed.wpe.weight", &[6, 4]),
        spec("blocks.0.attn.c_attn.weight", &[4, 12]),
        spec("ln_f.gamma", &[4]),
    ]
}

/// Loads the checkpoint at `tag` into `params` at `world` ranks and stage 1; checks each rank's
/// slices against the saved parameter `sources[p]` of each parameter `p`.
fn loads_as(dir: &std::path::Path, tag: &str, params: Vec<ParamSpec>, sources: Vec<usize>, world: usize) {
    let dir = dir.to_path_buf();
    let tag = tag.to_string();
    on_ranks(world, move |rank, comm| {
        let new = layout(params.clone(), world, 1);
        let (_, groups) = checkpoint::load(comm.as_ref(), &dir, Some(&tag), &new).expect("load");
        for (g, loaded) in groups.iter().enumerate() {
            let mut want = vec![0.0f32; new.owned_len(g)];
            for s in new.segments(g, rank) {
                for (l, i) in s.local.zip(s.in_param) {
                    want[l] = value(sources[s.param], i, 3, 0);
                }
            }
            assert_eq!(loaded.master, want, "{tag}: rank {rank}, group {g}");
        }
    });
}

#[test]
fn a_pipelined_checkpoint_loads_into_the_sharded_layout_and_back() {
    let dir = scratch("layouts");
    save_model(&dir, "piped", 2, 1, 3, pipelined(), gpt2());
    // embed.wte ← wte (0), embed.wpe ← wpe (1), the block (2), ln_f (4); the copy goes unread.
    loads_as(&dir, "piped", sharded(), vec![0, 1, 2, 4], 3);
    save_model(&dir, "sharded", 3, 2, 3, sharded(), gpt2());
    // The head's copy is read from the embedding.
    loads_as(&dir, "sharded", pipelined(), vec![0, 1, 2, 0, 3], 2);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn other_models_are_refused_naming_the_parameters() {
    let dir = scratch("layouts-refused");
    save_model(&dir, "piped", 1, 1, 3, pipelined(), gpt2());
    let load = |params: Vec<ParamSpec>| {
        let dir = dir.clone();
        on_ranks(1, move |_, comm| {
            let new = layout(params.clone(), 1, 1);
            checkpoint::load(comm.as_ref(), &dir, Some("piped"), &new)
                .expect_err("refused")
                .to_string()
        })
        .remove(0)
    };
    // A block the checkpoint does not have.
    let mut more = sharded();
    more.push(spec("blocks.1.attn.c_attn.weight", &[4, 12]));
    let e = load(more);
    assert!(e.contains("`blocks.1.attn.c_attn.weight` are not in it"), "{e}");
    // A parameter of the checkpoint the model has no place for.
    let fewer: Vec<ParamSpec> = sharded().into_iter().filter(|p| !p.name.starts_with("ln_f")).collect();
    let e = load(fewer);
    assert!(e.contains("`ln_f.gamma` are not in the model"), "{e}");
    // The same names at another shape.
    let mut wider = sharded();
    wider[3] = spec("ln_f.gamma", &[5]);
    let e = load(wider);
    assert!(e.contains("`ln_f.gamma` has shape [4]") && e.contains("[5]"), "{e}");
    // Without a recorded naming, only the same names match.
    save_model(&dir, "unnamed", 1, 1, 3, pipelined(), None);
    let dir2 = dir.clone();
    let e = on_ranks(1, move |_, comm| {
        checkpoint::load(comm.as_ref(), &dir2, Some("unnamed"), &layout(sharded(), 1, 1))
            .expect_err("refused")
            .to_string()
    })
    .remove(0);
    assert!(e.contains("`embed.wte.weight`"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
