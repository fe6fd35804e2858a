//! Checkpoints of a `gpt2 train` run, as a user meets them through the binary: every tag a run
//! writes loads back (the shipped config's WarmupDecayLR gives learning rates whose decimal form
//! used to parse back an ulp off, which made tags 6 and 7 of a 12-step run unreadable), a
//! damaged shard of any rank stops `--load` with one line naming that rank's file, a run
//! resumed from an older tag into its directory neither replaces nor orphans the tags saved
//! after it, a resumed run says what it resumed from, and `--save-total-limit` keeps the newest
//! checkpoints.

use crate::support;
use support::{fixture, fixture_model, train_shipped as train};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use zero_core::checkpoint::{self, Checkpoint};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The tag directories under `dir`, in step order.
fn tags(dir: &Path) -> Vec<String> {
    let mut tags: Vec<(u64, String)> = std::fs::read_dir(dir)
        .expect("checkpoint dir")
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .map(|t| (t.trim_start_matches("global_step").parse().unwrap_or(u64::MAX), t))
        .collect();
    tags.sort();
    tags.into_iter().map(|(_, t)| t).collect()
}

/// Whether `tag` reads back whole: metadata verified, every shard byte checked against its
/// checksum, and the weights consolidated (the path `zero to-fp32` takes); the error otherwise.
fn readable(dir: &Path, tag: &str) -> Result<usize, String> {
    let c = Checkpoint::open(dir, Some(tag)).map_err(|e| e.to_string())?;
    c.verify().map_err(|e| e.to_string())?;
    let out = tempfile::tempdir().map_err(|e| e.to_string())?;
    let report = checkpoint::to_fp32(&c, out.path(), None, &|n| Some(n.to_string())).map_err(|e| e.to_string())?;
    Ok(report.tensors)
}

#[test]
fn every_tag_of_a_12_step_run_with_the_shipped_schedule_loads_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("ckpt");
    let run = train(12, &["--save", save.to_str().unwrap(), "--save-every", "1"]);
    assert!(run.status.success(), "training must succeed: {}", stderr(&run));

    let tags = tags(&save);
    assert_eq!(tags.len(), 12, "one tag per step: {tags:?}");
    let unreadable: Vec<(String, String)> = tags
        .iter()
        .filter_map(|t| readable(&save, t).err().map(|e| (t.clone(), e)))
        .collect();
    println!(
        "checkpoints written: {}, verified readable: {}, unreadable: {}",
        tags.len(),
        tags.len() - unreadable.len(),
        unreadable.len()
    );
    assert!(unreadable.is_empty(), "unreadable tags: {unreadable:#?}");

    // And the trainer itself resumes from the newest one, taking step 13 only.
    let resumed = train(13, &["--load", save.to_str().unwrap()]);
    assert!(resumed.status.success(), "resume must succeed: {}", stderr(&resumed));
}

#[test]
fn a_damaged_shard_of_each_rank_is_named_when_loading() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("ckpt");
    let run = train(1, &["--save", save.to_str().unwrap()]);
    assert!(run.status.success(), "training must succeed: {}", stderr(&run));

    for rank in 0..2 {
        // A copy of the checkpoint with a few bytes of this rank's shard flipped, mid-file.
        let copy = dir.path().join(format!("damaged-{rank}"));
        std::fs::create_dir_all(copy.join("global_step1")).expect("mkdir");
        std::fs::copy(save.join("latest"), copy.join("latest")).expect("copy latest");
        for entry in std::fs::read_dir(save.join("global_step1")).expect("tag dir").flatten() {
            std::fs::copy(entry.path(), copy.join("global_step1").join(entry.file_name())).expect("copy");
        }
        let file = format!("rank_{rank:05}.safetensors");
        let shard = copy.join("global_step1").join(&file);
        let mut bytes = std::fs::read(&shard).expect("shard");
        let mid = bytes.len() / 2;
        for b in &mut bytes[mid..mid + 4] {
            *b ^= 0xa5;
        }
        std::fs::write(&shard, bytes).expect("damage");

        let out = train(2, &["--load", copy.to_str().unwrap()]);
        let err = stderr(&out);
        assert_eq!(
            out.status.code(),
            Some(1),
            "rank {rank}'s damaged shard must stop the load: {err}"
        );
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one line: {err}");
        assert!(lines[0].starts_with("gpt2: "), "{err}");
        for want in [file.as_str(), "checksum mismatch", "corrupt"] {
            assert!(err.contains(want), "rank {rank}: `{want}` missing from: {err}");
        }
        if rank != 0 {
            assert!(err.contains(&format!("rank {rank} failed to load")), "{err}");
        }
        println!("damaged {file}: {}", lines[0]);
    }
}

/// `gpt2 train` of the tiny fixture model on the fixture token batch (4 rank threads, stage 3),
/// to step `steps`, quietly, plus `extra`: a step takes a fraction of a second.
fn fixture_train(steps: u64, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpt2"))
        .args([
            "train",
            "--quiet",
            "--nproc",
            "4",
            "--steps",
            &steps.to_string(),
            "--model",
        ])
        .arg(fixture_model())
        .arg("--config")
        .arg(fixture("train_config.json"))
        .arg("--tokens")
        .arg(fixture("train_tokens.json"))
        .args(extra)
        .env("ZERO_COMM_TIMEOUT_SECS", "30")
        .output()
        .expect("run gpt2")
}

/// Every file under `dir`, by path, with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).expect("file");
                out.push((path.strip_prefix(dir).expect("under dir").to_path_buf(), bytes));
            }
        }
    }
    out.sort();
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A run resumed from an older tag, saving into the directory that holds the tags saved after it
/// (the tester's `--load ck/global_step4 --save ck` with global_step1..12 there): refused before
/// step 1, naming the later tags and the two ways out, with every file as it was (it used to
/// replace global_step5..8 and leave 9..12 beside its `latest`, saying nothing). With
/// `--discard-later-tags` it trains, says what it resumed from and which tags it removed, and
/// leaves its own trajectory: the tags up to its last, `latest` on it, each loading back.
#[test]
fn resuming_an_older_tag_into_its_directory_neither_replaces_nor_orphans_later_tags() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ck = dir.path().join("ck");
    let ck_arg = ck.to_string_lossy().into_owned();
    let first = fixture_train(6, &["--save", &ck_arg, "--save-every", "1"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let before = snapshot(&ck);
    let older = ck.join("global_step3").to_string_lossy().into_owned();

    let refused = fixture_train(5, &["--load", &older, "--save", &ck_arg, "--save-every", "1"]);
    let err = stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    for want in [
        format!("gpt2: --save {ck_arg}: holds global_step4, global_step5, global_step6 (3 tags, steps 4 to 6)"),
        "saved after global_step3 (step 3)".to_string(),
        "another directory".to_string(),
        "--discard-later-tags".to_string(),
    ] {
        assert!(err.contains(&want), "{want:?} missing from: {err}");
    }
    assert!(snapshot(&ck) == before, "a refused run changes nothing");

    let discarding = fixture_train(
        5,
        &[
            "--load",
            &older,
            "--save",
            &ck_arg,
            "--save-every",
            "1",
            "--discard-later-tags",
        ],
    );
    assert!(discarding.status.success(), "{}", stderr(&discarding));
    let said = stdout(&discarding);
    assert!(
        said.contains(&format!(
            "resumed from global_step3 in {ck_arg} at step 3: training steps 4 to 5; every step trains on the \
             whole token file"
        )),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "removed global_step4, global_step5, global_step6 (3 tags, steps 4 to 6) from {ck_arg}"
        )) && said.contains("--discard-later-tags"),
        "{said}"
    );
    assert_eq!(
        tags(&ck),
        (1..=5).map(|s| format!("global_step{s}")).collect::<Vec<_>>()
    );
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).expect("latest"),
        "global_step5"
    );
    for tag in tags(&ck) {
        readable(&ck, &tag).unwrap_or_else(|e| panic!("{tag}: {e}"));
    }
}

/// A resumed run says, in one line, what it resumed from (tag, directory, step) and where the
/// sampled data goes on, and when its seed is not the saved run's, that the batches differ.
#[test]
fn a_resumed_run_says_what_it_resumed_from() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ck = dir.path().join("ck");
    let ck_arg = ck.to_string_lossy().into_owned();
    let first = train(1, &["--save", &ck_arg]);
    assert!(first.status.success(), "{}", stderr(&first));
    let resumed = train(2, &["--load", &ck_arg]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let said = stdout(&resumed);
    let line = format!(
        "resumed from global_step1 in {ck_arg} at step 1: training steps 2 to 2; the data sampler goes on at step 2, \
         seed 42"
    );
    assert_eq!(
        said.lines().filter(|l| l.starts_with("resumed from")).count(),
        1,
        "{said}"
    );
    assert!(said.lines().any(|l| l == line), "{line:?} missing from: {said}");
    let reseeded = train(2, &["--load", &ck_arg, "--seed", "7"]);
    assert!(reseeded.status.success(), "{}", stderr(&reseeded));
    assert!(
        stdout(&reseeded).contains("seed 7 (the saved run's was 42: the batches from here are not its)"),
        "{}",
        stdout(&reseeded)
    );
}

/// `--save-total-limit 2` (HuggingFace's save_total_limit) with a checkpoint every step keeps the
/// newest two, each loading back, `latest` on the newest; a run resumed from them goes on
/// keeping two.
#[test]
fn save_total_limit_keeps_the_newest_checkpoints() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ck = dir.path().join("ck");
    let ck_arg = ck.to_string_lossy().into_owned();
    let keep = [
        "--save",
        ck_arg.as_str(),
        "--save-every",
        "1",
        "--save-total-limit",
        "2",
    ];
    let run = fixture_train(5, &keep);
    assert!(run.status.success(), "{}", stderr(&run));
    assert_eq!(tags(&ck), ["global_step4", "global_step5"]);
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).expect("latest"),
        "global_step5"
    );
    for tag in tags(&ck) {
        readable(&ck, &tag).unwrap_or_else(|e| panic!("{tag}: {e}"));
    }
    let resumed = fixture_train(7, &[&["--load", ck_arg.as_str()][..], &keep].concat());
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(tags(&ck), ["global_step6", "global_step7"]);
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).expect("latest"),
        "global_step7"
    );
}
