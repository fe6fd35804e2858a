//! A metadata file whose recorded shapes disagree with the shards, its checksum re-sealed so
//! that only the content can tell: the trainer's load and `zero to-fp32` refuse it alike, with
//! the same check, and the converter writes nothing. A renaming that leaves no tensor is an
//! error, not an empty file. Reference: the intact checkpoint, which both accept.

mod checkpoint_support;

use checkpoint_support::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use zero_core::checkpoint::{self, CheckpointMeta, META_FILE};
use zero_core::partition::ParamSpec;

/// A world-2 stage-2 checkpoint in a fresh directory; returns (dir, metadata file).
fn fresh(name: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    save_reference(&dir, "t", 2, 2, 3, "");
    let meta = dir.join("t").join(META_FILE);
    (dir, meta)
}

/// Edits the metadata as JSON and re-seals its checksum, as a user with a script would.
fn edit_and_reseal(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    edit(&mut v);
    let meta: CheckpointMeta = serde_json::from_value(v).expect("still the metadata's structure");
    std::fs::write(path, meta.to_bytes().expect("sealable")).unwrap();
}

/// Sets parameter `p`'s shape in both places the metadata records it.
fn set_shape(v: &mut Value, p: usize, shape: &[usize]) {
    v["params"][p]["shape"] = shape.into();
    v["layout"]["params"][p]["shape"] = shape.into();
}

fn to_fp32(dir: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["to-fp32", dir.to_str().unwrap(), out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

/// The load's error on rank 0 (ranks as threads, world 2) for a model of parameters `params`.
fn load_error(dir: &Path, params: Vec<ParamSpec>) -> String {
    let dir = dir.to_path_buf();
    let errors = on_ranks(2, move |_, comm| {
        checkpoint::load(comm.as_ref(), &dir, None, &layout(params.clone(), 2, 2))
            .err()
            .map(|e| e.to_string())
    });
    errors.into_iter().next().flatten().expect("the load must refuse it")
}

/// `zero to-fp32` refuses with exit status 2, says `parts`, and leaves no weights file.
fn assert_converter_refuses(dir: &Path, parts: &[&str]) -> String {
    let out = dir.join("converted");
    let run = to_fp32(dir, &out, &[]);
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert_eq!(run.status.code(), Some(2), "to-fp32 must refuse: {stderr}");
    for part in parts {
        assert!(stderr.contains(part), "to-fp32's error must say `{part}`: {stderr}");
    }
    let written = std::fs::read_dir(&out).map(|d| d.count()).unwrap_or(0);
    assert_eq!(written, 0, "nothing may be written for a refused checkpoint");
    stderr
}

#[test]
fn the_intact_checkpoint_converts_and_loads() {
    let (dir, _) = fresh("shapes-intact");
    let run = to_fp32(&dir, &dir.join("out"), &[]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let d = dir.clone();
    let ok = on_ranks(2, move |_, comm| {
        checkpoint::load(comm.as_ref(), &d, None, &layout(specs(""), 2, 2)).is_ok()
    });
    assert_eq!(ok, [true, true]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_shape_edited_alone_contradicts_the_layout() {
    // layer0 [7, 3] recorded as [7, 2]: the converter used to write a [7, 2] tensor of the
    // first 14 values; the layout's offsets and sizes still describe [7, 3].
    let (dir, meta) = fresh("shapes-alone");
    edit_and_reseal(&meta, |v| set_shape(v, 0, &[7, 2]));
    let err = assert_converter_refuses(&dir, &[META_FILE, "disagree"]);
    let load = load_error(&dir, specs(""));
    assert!(load.contains(META_FILE) && load.contains("disagree"), "{load}");
    println!("to-fp32: {err}load: {load}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_shape_edited_with_every_size_that_follows_disagrees_with_the_shards() {
    // layer3 [10, 10] recorded as [10, 20], and the group's size and padding moved with it:
    // the metadata is consistent, the shards hold slices of the old size.
    let (dir, meta) = fresh("shapes-consistent");
    edit_and_reseal(&meta, |v| {
        set_shape(v, 3, &[10, 20]);
        let groups = v["layout"]["groups"].as_array_mut().unwrap();
        let g = groups
            .iter_mut()
            .find(|g| g["params"].as_array().unwrap().contains(&3.into()))
            .expect("layer3's group");
        let numel = g["numel"].as_u64().unwrap() + 100;
        g["numel"] = numel.into();
        g["padded"] = numel.div_ceil(8).max(1).saturating_mul(8).into();
    });
    let err = assert_converter_refuses(
        &dir,
        &["rank_0000", ".safetensors", "does not match the checkpoint metadata"],
    );
    // The trainer's model refuses it as another model's; a model of the shapes the metadata
    // claims passes that check and meets the shard check to-fp32 met, word for word.
    let load = load_error(&dir, specs(""));
    assert!(
        load.contains("another model") && load.contains("layer3.weight"),
        "{load}"
    );
    let mut claimed = specs("");
    claimed[3].shape = vec![10, 20];
    let load = load_error(&dir, claimed);
    let shard_error = err.trim().trim_start_matches("error: ");
    assert!(
        load.contains(shard_error),
        "the load must refuse with the converter's check:\n  load: {load}\n  to-fp32: {shard_error}"
    );
    println!("to-fp32: {err}load: {load}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_renaming_that_leaves_no_tensor_is_an_error() {
    let (dir, _) = fresh("rename-none");
    let out = dir.join("empty");
    for rules in [&["--rename", "!"][..], &["--rename", "!layer"][..]] {
        let run = to_fp32(&dir, &out, rules);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{rules:?} must be refused: {stderr}");
        assert!(stderr.contains("leave none"), "{rules:?}: {stderr}");
        assert!(
            !out.join("model.safetensors").exists(),
            "{rules:?}: no empty weights file"
        );
    }
    // A rule that keeps something still converts.
    let run = to_fp32(&dir, &out, &["--rename", "!layer0."]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    std::fs::remove_dir_all(&dir).ok();
}

/// A rename rule that meets no tensor name (a misspelt prefix) is refused, naming the rule and
/// some of the names it could have met, and nothing is written; a drop rule that meets none
/// leaves out nothing, as it asks.
#[test]
fn a_rename_that_matches_no_name_is_an_error() {
    let (dir, _) = fresh("rename-unused");
    let out = dir.join("renamed");
    let run = to_fp32(&dir, &out, &["--rename", "layr=block"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--rename layr=block") && stderr.contains("layer0"),
        "{stderr}"
    );
    assert!(!out.join("model.safetensors").exists());
    let run = to_fp32(&dir, &out, &["--rename", "layer=block", "--rename", "!absent"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    std::fs::remove_dir_all(&dir).ok();
}
