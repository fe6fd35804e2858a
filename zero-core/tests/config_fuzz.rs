//! A config fuzzer: real DeepSpeed configs (../shared/conformance/ds-configs and the shipped
//! examples/configs), mutated the ways files go wrong (a wrong type at a key, numbers past every
//! range, nulls, truncation, invalid UTF-8, deep nesting, duplicate keys, flipped bytes), read
//! the way the tools read them. For every case: no panic, no hang, and every refusal names the
//! file and a key or a line. Hundreds of cases go through the library (fast, panics caught); a
//! sample goes through `zero check-config`, each under a timeout.
//!
//! Deterministic: a fixed seed drives a small xorshift generator, so a failure names a case that
//! fails the same way on the next run. `ZERO_FUZZ_SHOW=1` (with `--no-capture`) prints every
//! refusal, to read what users would see; `ZERO_FUZZ_SEED=N` explores other cases.

use serde_json::Value;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use zero_core::config::{ConfigError, DeepSpeedConfig, Overrides, ResolveContext};

/// Library cases (the binary sample comes on top).
const CASES: usize = 720;
/// Cases also run through the `zero` binary.
const BINARY_SAMPLE: usize = 30;
/// How long one `zero check-config` may take before it counts as a hang.
const BINARY_TIMEOUT: Duration = Duration::from_secs(20);

/// xorshift64*: enough randomness to pick mutations, and reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The seed configs: every corpus file (valid or template) and the shipped examples.
fn seeds() -> Vec<(String, Vec<u8>)> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for dir in [
        manifest.join("../../shared/conformance/ds-configs"),
        manifest.join("../examples/configs"),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            // Under CI the shared corpus must be there (see config_conformance.rs).
            zero_test_support::skip(format!("{} is absent; fuzzing the other seeds", dir.display()));
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        for path in files {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            out.push((name, std::fs::read(&path).unwrap()));
        }
    }
    assert!(!out.is_empty(), "no seed configs found");
    out
}

/// Every path in a JSON value, as JSON-pointer segments (object keys and array indices).
fn paths(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                prefix.push(k.clone());
                out.push(prefix.clone());
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                prefix.push(i.to_string());
                out.push(prefix.clone());
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

fn slot<'v>(v: &'v mut Value, path: &[String]) -> Option<&'v mut Value> {
    path.iter().try_fold(v, |v, seg| match v {
        Value::Object(m) => m.get_mut(seg),
        Value::Array(a) => seg.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
        _ => None,
    })
}

/// Dotted config keys in a text, for checking that a refusal names one: every object key path
/// of the text (read leniently) and of its seed.
fn dotted_keys(texts: &[&[u8]]) -> Vec<String> {
    let mut keys = vec![
        "train_batch_size".to_string(),
        "train_micro_batch_size_per_gpu".to_string(),
        "gradient_accumulation_steps".to_string(),
        "(top level)".to_string(),
    ];
    for text in texts {
        let Ok(v) = serde_json::from_slice::<Value>(text) else {
            continue;
        };
        let mut all = Vec::new();
        paths(&v, &mut Vec::new(), &mut all);
        keys.extend(
            all.iter()
                .filter(|p| p.iter().all(|s| s.parse::<usize>().is_err()))
                .map(|p| p.join(".")),
        );
    }
    keys
}

/// A marker replaced in the serialised text by raw JSON that `Value` cannot hold (1e400,
/// 2^64 as written) or by a repeated key.
const MARK: &str = "__zero_fuzz_mark__";

/// One mutation of a seed: its description and bytes.
fn mutate(rng: &mut Rng, kind: usize, seed: &[u8]) -> (String, Vec<u8>) {
    let parsed: Option<Value> = serde_json::from_slice(seed).ok();
    let mut all = Vec::new();
    if let Some(v) = &parsed {
        paths(v, &mut Vec::new(), &mut all);
    }
    // Kinds that need a JSON tree fall back to byte-level ones for templates.
    let kind = if parsed.is_none() || all.is_empty() {
        [3, 4, 7][kind % 3]
    } else {
        kind
    };
    match kind {
        0 => {
            // A value of the wrong type at a key.
            let mut v = parsed.unwrap();
            let path = all[rng.below(all.len())].clone();
            let replacement = [
                Value::from("x"),
                Value::from("INF"),
                Value::from(7),
                Value::from(-2.5),
                Value::from(true),
                serde_json::json!([]),
                serde_json::json!([1, "a"]),
                serde_json::json!({}),
                serde_json::json!({"k": 1}),
                Value::from("auto"),
            ][rng.below(10)]
            .clone();
            let desc = format!("wrong type at /{}: {replacement}", path.join("/"));
            *slot(&mut v, &path).unwrap() = replacement;
            (desc, serde_json::to_vec_pretty(&v).unwrap())
        }
        1 => {
            // A number past every range, written as text.
            let mut v = parsed.unwrap();
            let path = all[rng.below(all.len())].clone();
            let literal = [
                "1e308",
                "1e400",
                "-1e400",
                "-1",
                "18446744073709551616",
                "18446744073709551615",
                "-9223372036854775809",
                "1e-400",
                "0.5",
                "0",
                "4294967296",
                "1e19",
            ][rng.below(12)];
            *slot(&mut v, &path).unwrap() = Value::from(MARK);
            let text = serde_json::to_string_pretty(&v)
                .unwrap()
                .replace(&format!("\"{MARK}\""), literal);
            (format!("number {literal} at /{}", path.join("/")), text.into_bytes())
        }
        2 => {
            // null at a key.
            let mut v = parsed.unwrap();
            let path = all[rng.below(all.len())].clone();
            *slot(&mut v, &path).unwrap() = Value::Null;
            (
                format!("null at /{}", path.join("/")),
                serde_json::to_vec_pretty(&v).unwrap(),
            )
        }
        3 => {
            // Truncated at a random byte (possibly inside a multi-byte character).
            let at = rng.below(seed.len());
            (format!("truncated at byte {at}"), seed[..at].to_vec())
        }
        4 => {
            // Invalid UTF-8 inserted at a random byte.
            let at = rng.below(seed.len() + 1);
            let bad: &[u8] = [&[0xff][..], &[0xc3, 0x28], &[0xe2, 0x82], &[0x80], &[0xf0, 0x9f, 0x92]][rng.below(5)];
            let mut out = seed[..at].to_vec();
            out.extend_from_slice(bad);
            out.extend_from_slice(&seed[at..]);
            (format!("invalid UTF-8 {bad:02x?} at byte {at}"), out)
        }
        5 => {
            // Deep nesting at a key.
            let mut v = parsed.unwrap();
            let path = all[rng.below(all.len())].clone();
            let depth = [200, 5_000, 100_000][rng.below(3)];
            let (open, close) = if rng.below(2) == 0 {
                ("[".repeat(depth), "]".repeat(depth))
            } else {
                ("{\"a\":".repeat(depth), "}".repeat(depth))
            };
            *slot(&mut v, &path).unwrap() = Value::from(MARK);
            let text = serde_json::to_string_pretty(&v)
                .unwrap()
                .replace(&format!("\"{MARK}\""), &format!("{open}1{close}"));
            (
                format!("nesting {depth} deep at /{}", path.join("/")),
                text.into_bytes(),
            )
        }
        8 => {
            // Every number at once replaced by one huge value, so that products of values (the
            // batch triad) pass every range too.
            let mut v = parsed.unwrap();
            let literal = [
                "18446744073709551615",
                "9223372036854775807",
                "4294967296",
                "1e19",
                "1e308",
            ][rng.below(5)];
            let numbers: Vec<Vec<String>> = all
                .iter()
                .filter(|p| slot(&mut v, p).is_some_and(|s| s.is_number()))
                .cloned()
                .collect();
            for path in &numbers {
                *slot(&mut v, path).unwrap() = Value::from(MARK);
            }
            let text = serde_json::to_string_pretty(&v)
                .unwrap()
                .replace(&format!("\"{MARK}\""), literal);
            (format!("all {} numbers {literal}", numbers.len()), text.into_bytes())
        }
        6 => {
            // A key written twice in one object.
            let mut v = parsed.unwrap();
            let objects: Vec<Vec<String>> = std::iter::once(Vec::new())
                .chain(all.iter().cloned())
                .filter(|p| {
                    let mut v = v.clone();
                    slot(&mut v, p).is_some_and(|s| s.as_object().is_some_and(|m| !m.is_empty()))
                })
                .collect();
            let Some(path) = objects.get(rng.below(objects.len())).cloned() else {
                return mutate(rng, 7, seed);
            };
            let object = slot(&mut v, &path).unwrap().as_object_mut().unwrap();
            let key = object.keys().nth(rng.below(object.len())).unwrap().clone();
            let value = object[&key].clone();
            object.insert(MARK.into(), value);
            let text = serde_json::to_string_pretty(&v)
                .unwrap()
                .replace(&format!("\"{MARK}\""), &serde_json::to_string(&key).unwrap());
            (
                format!("duplicate key {key:?} in /{}", path.join("/")),
                text.into_bytes(),
            )
        }
        _ => {
            // A few random bytes flipped.
            let mut out = seed.to_vec();
            let flips = 1 + rng.below(4);
            for _ in 0..flips {
                let at = rng.below(out.len());
                out[at] ^= 1 + rng.below(255) as u8;
            }
            (format!("{flips} byte(s) flipped"), out)
        }
    }
}

/// Whether a refusal's message names the file and a key or a line (`FILE:LINE`).
fn well_named(message: &str, file: &str, keys: &[String]) -> bool {
    let names_file = message.contains(file);
    let names_line = message.match_indices(file).any(|(at, _)| {
        let rest = &message[at + file.len()..];
        rest.strip_prefix(':')
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
    });
    names_file && (names_line || keys.iter().any(|k| names_word(message, k)))
}

/// Whether `word` stands in `message` as a whole key (not inside a longer identifier).
fn names_word(message: &str, word: &str) -> bool {
    let part_of_key = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
    message.match_indices(word).any(|(at, _)| {
        let before = message[..at].chars().next_back();
        let after = message[at + word.len()..].chars().next();
        !before.is_some_and(part_of_key) && !after.is_some_and(|c| part_of_key(c) && c != '.')
    })
}

/// The values HuggingFace's Trainer would supply, so that "auto" resolves as in a real run.
fn overrides() -> Overrides {
    Overrides::new()
        .with("train_micro_batch_size_per_gpu", 4)
        .with("gradient_accumulation_steps", 1)
        .with("gradient_clipping", 1.0)
        .with("fp16.enabled", false)
        .with("bf16.enabled", true)
        .with("optimizer.params.lr", 1e-4)
        .with("optimizer.params.betas", serde_json::json!([0.9, 0.999]))
        .with("optimizer.params.eps", 1e-8)
        .with("optimizer.params.weight_decay", 0.0)
        .with("scheduler.params.warmup_num_steps", 100)
        .with("scheduler.params.total_num_steps", 1000)
}

/// What the library made of one case: accepted, or refused with the message.
enum Outcome {
    Accepted,
    /// The message, and whether it is about the file as a whole (too large to be a config),
    /// where naming the file and the limit is all there is to say.
    Refused(String, bool),
}

/// Reads, checks and resolves a file the way the tools do; every error's message.
fn run_library(path: &Path) -> Result<Outcome, String> {
    let result = catch_unwind(AssertUnwindSafe(|| -> Result<(), ConfigError> {
        let parsed = DeepSpeedConfig::from_file(path)?;
        parsed.config.resolve_partial(None, None, &Overrides::new())?;
        parsed.config.resolve_partial(Some(1), Some(4096), &overrides())?;
        let ctx = ResolveContext {
            world_size: 1,
            hidden_size: Some(4096),
            overrides: overrides(),
        };
        match parsed.config.resolve(&ctx) {
            // A triad written for more ranks than one does not fit one: that is the file's
            // business, and a named refusal is all that is asked of it.
            Ok(_) | Err(ConfigError::Batch { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }));
    match result {
        Ok(Ok(())) => Ok(Outcome::Accepted),
        Ok(Err(e)) => Ok(Outcome::Refused(
            e.to_string(),
            matches!(e, ConfigError::TooLarge { .. }),
        )),
        Err(panic) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()),
    }
}

/// `zero check-config FILE` under a timeout: (exit code, stderr), or `None` on a hang.
fn run_binary(path: &Path) -> Option<(Option<i32>, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_zero"))
        .arg("check-config")
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run zero");
    // stderr is drained on a thread so that a chatty child cannot block on a full pipe.
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).ok();
        s
    });
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some((status.code(), reader.join().unwrap()));
        }
        if start.elapsed() > BINARY_TIMEOUT {
            child.kill().ok();
            child.wait().ok();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn mutated_real_configs_never_panic_hang_or_refuse_without_naming_a_key_or_line() {
    let seeds = seeds();
    let dir = tempfile::tempdir().unwrap();
    // Another seed explores other cases (`ZERO_FUZZ_SEED=N`); the default is what CI runs.
    let seed = std::env::var("ZERO_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0x5eed_0f2e_40c0_f1a5);
    let mut rng = Rng(seed | 1);
    let mut cases: Vec<(String, Vec<u8>, Vec<u8>)> = Vec::new();
    // Fixed cases first: the shapes a fuzzer might not reach by chance.
    let fixed: [(&str, Vec<u8>); 5] = [
        ("100000 '['", "[".repeat(100_000).into_bytes()),
        ("100000 '{\"a\":'", "{\"a\":".repeat(100_000).into_bytes()),
        ("one byte past the size limit", vec![b' '; (8 << 20) + 1]),
        ("empty file", Vec::new()),
        ("a JSON string", b"\"ds_config\"".to_vec()),
    ];
    for (desc, bytes) in fixed {
        cases.push((desc.to_string(), bytes, Vec::new()));
    }
    while cases.len() < CASES {
        let (name, seed) = &seeds[rng.below(seeds.len())];
        let kind = cases.len() % 9;
        let (desc, bytes) = mutate(&mut rng, kind, seed);
        cases.push((format!("{name}: {desc}"), bytes, seed.clone()));
    }

    let (mut accepted, mut refused) = (0usize, 0usize);
    let mut panics = Vec::new();
    let mut unnamed = Vec::new();
    let mut paths = Vec::new();
    // Silence the default hook's report of caught panics; they are counted and listed below.
    let show = std::env::var_os("ZERO_FUZZ_SHOW").is_some();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for (i, (desc, bytes, seed)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("case-{i:04}.json"));
        std::fs::write(&path, bytes).unwrap();
        let file = path.display().to_string();
        match run_library(&path) {
            Ok(Outcome::Accepted) => accepted += 1,
            Ok(Outcome::Refused(message, whole_file)) => {
                refused += 1;
                if show {
                    eprintln!("refused: case {i} ({desc}): {message}");
                }
                let named = if whole_file {
                    message.contains(&file) && message.contains("8388608 bytes")
                } else {
                    well_named(&message, &file, &dotted_keys(&[bytes, seed]))
                };
                if !named {
                    unnamed.push(format!("case {i} ({desc}): {message}"));
                }
            }
            Err(panic) => panics.push(format!("case {i} ({desc}): {panic}")),
        }
        paths.push((path, desc.clone(), bytes.clone(), seed.clone()));
    }
    std::panic::set_hook(hook);

    // A sample through the binary, spread over the mutation kinds and the fixed cases.
    let (mut bin_runs, mut bin_panics, mut hangs) = (0usize, Vec::new(), Vec::new());
    let step = (paths.len() / BINARY_SAMPLE).max(1);
    for (path, desc, bytes, seed) in paths
        .iter()
        .step_by(step)
        .take(BINARY_SAMPLE)
        .chain(paths.iter().take(3))
    {
        bin_runs += 1;
        let file = path.display().to_string();
        match run_binary(path) {
            None => hangs.push(format!("{desc}: no exit within {BINARY_TIMEOUT:?}")),
            Some((code, stderr)) => {
                if code == Some(101) || stderr.contains("panicked") || code.is_none() {
                    bin_panics.push(format!("{desc}: exit {code:?}: {stderr}"));
                } else if code != Some(0) {
                    let error = stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
                    let named = well_named(error, &file, &dotted_keys(&[bytes, seed]))
                        || (error.contains(&file) && error.contains("8388608 bytes"));
                    if !named {
                        unnamed.push(format!("binary, {desc}: {stderr}"));
                    }
                }
            }
        }
    }

    eprintln!(
        "config fuzz: {} cases through the library ({accepted} accepted, {refused} refused, {} panics), \
         {bin_runs} through `zero check-config` ({} panics, {} hangs); {} refusals without a key or line",
        cases.len(),
        panics.len(),
        bin_panics.len(),
        hangs.len(),
        unnamed.len()
    );
    assert!(panics.is_empty(), "library panics:\n{}", panics.join("\n"));
    assert!(bin_panics.is_empty(), "binary panics:\n{}", bin_panics.join("\n"));
    assert!(hangs.is_empty(), "hangs:\n{}", hangs.join("\n"));
    assert!(
        unnamed.is_empty(),
        "refusals that name no key or line:\n{}",
        unnamed.join("\n")
    );
    // Both sides were exercised: mutations that keep a config valid and ones that break it.
    assert!(accepted > 50 && refused > 200, "{accepted} accepted, {refused} refused");
}
