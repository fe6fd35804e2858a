//! `gpt2 init`: the starting checkpoint of a preset, written block by block, is a directory the
//! trainer's own loader and `gpt2 score` read. Reference: a random GPT-2 scores about ln(vocab)
//! on any text (its next-token distribution is near uniform).

use std::process::Command;

fn gpt2() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpt2"))
}

#[test]
fn init_writes_a_directory_that_scores_like_a_random_gpt2() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny");
    let made = gpt2()
        .args(["init", "--preset", "tiny", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let said = String::from_utf8_lossy(&made.stdout);
    assert!(said.contains("in 3 shards"), "{said}");

    let tokens = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/train_tokens.json");
    let scored = gpt2()
        .args(["score", "--model"])
        .arg(&out)
        .arg("--tokens")
        .arg(&tokens)
        .output()
        .unwrap();
    assert!(scored.status.success(), "{}", String::from_utf8_lossy(&scored.stderr));
    let text = String::from_utf8_lossy(&scored.stdout);
    let loss: f64 = text
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("loss "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no loss line in {text}"));
    let uniform = (50257f64).ln();
    assert!(
        (loss - uniform).abs() < 0.1,
        "loss {loss}, a random GPT-2 gives about {uniform}"
    );

    // `generate` prints the prompt and its continuation, as they come: a reader that stops
    // after a few bytes ends a generation asked for a million tokens at once (it would run for
    // hours if it printed only at the end).
    let told = gpt2()
        .args([
            "generate",
            "--prompt",
            "Hello there",
            "--max-new-tokens",
            "5",
            "--model",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(told.status.success(), "{}", String::from_utf8_lossy(&told.stderr));
    let text = String::from_utf8_lossy(&told.stdout);
    assert!(
        text.starts_with("Hello there") && text.len() > "Hello there\n".len(),
        "{text:?}"
    );
    assert!(text.ends_with('\n'), "{text:?}");
    let mut child = gpt2()
        .args([
            "generate",
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "1000000",
            "--model",
        ])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut head = [0u8; 24];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut head).expect("text streams out");
    assert!(head.starts_with(b"Hello"));
    drop(child.stdout.take());
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("generate went on after its reader left");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

#[test]
fn init_refuses_an_output_that_is_a_file_and_an_unknown_preset() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    for (preset, out, says) in [
        ("tiny", file.clone(), "not a directory"),
        ("gpt2-huge", dir.path().join("new"), "unknown GPT-2 preset"),
    ] {
        let made = gpt2()
            .args(["init", "--preset", preset, "--out"])
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&made.stderr);
        assert_eq!(made.status.code(), Some(1), "{err}");
        assert!(err.contains(says), "{err}");
    }
}

/// A directory that already holds files (a model) is refused, and left exactly as it was; an
/// init that completes leaves only the new directory beside it, no staging directory.
#[test]
fn init_never_writes_into_a_directory_that_holds_files() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), "{\"kept\": true}").unwrap();
    let made = gpt2()
        .args(["init", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&made.stderr);
    assert_eq!(made.status.code(), Some(1), "{err}");
    assert!(err.contains("already holds files"), "{err}");
    assert_eq!(
        std::fs::read_to_string(model.join("config.json")).unwrap(),
        "{\"kept\": true}"
    );

    // An empty directory is written into (replaced), and nothing else is left beside it.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let made = gpt2()
        .args(["init", "--preset", "tiny", "--out"])
        .arg(&empty)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    assert!(empty.join("config.json").is_file());
    let mut beside: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    beside.sort();
    assert_eq!(beside, ["empty", "model"]);
}

/// What an init that did not finish left beside its output (a directory named for its process,
/// which is gone) is removed by the next init of that output, which says so; a model whose
/// largest unit cannot be drawn in this machine's memory is refused before anything is written.
#[cfg(target_os = "linux")]
#[test]
fn init_cleans_what_an_interrupted_init_left_and_refuses_what_cannot_fit() {
    let dir = tempfile::tempdir().unwrap();
    // Above any pid_max Linux allows (2^22): no such process.
    let stale = dir.path().join(".tiny.partial99999999");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("model-00001-of-00003.safetensors"), "half").unwrap();
    let made = gpt2()
        .args(["init", "--preset", "tiny", "--out"])
        .arg(dir.path().join("tiny"))
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    assert!(!stale.exists(), "the stale directory is still there");
    assert!(String::from_utf8_lossy(&made.stderr).contains("did not finish"));

    let huge = gpt2()
        .args(["init", "--preset", "gpt2-1x1000000", "--out"])
        .arg(dir.path().join("huge"))
        .output()
        .unwrap();
    assert_eq!(huge.status.code(), Some(1), "{huge:?}");
    let err = String::from_utf8_lossy(&huge.stderr);
    assert!(
        err.contains("one block") && err.contains("more than this machine's"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("tiny")], "nothing else written");
}
