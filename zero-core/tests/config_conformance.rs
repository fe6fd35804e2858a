//! Every real DeepSpeed config in ../shared/conformance/ds-configs: the valid ones parse (and
//! resolve as far as the file allows), the templates fail with the placeholder error.
//! Reference: the corpus INDEX.tsv, which records for each file whether it is a template and
//! which placeholders it holds (found independently of this parser).
//!
//! The corpus lives beside the project (`../shared`, which every developer and CI run has),
//! not in it. Where it is absent both tests skip with a line on stderr, except under CI
//! (`CI=true`, as `.ci/run` sets), where they fail: a skip there would pass unchecked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use zero_core::config::{ConfigError, DeepSpeedConfig, Overrides};

fn corpus() -> Option<PathBuf> {
    let dir = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/conformance/ds-configs"
    ));
    if dir.join("INDEX.tsv").exists() {
        Some(dir)
    } else {
        zero_test_support::skip(format!(
            "{} is absent (the shared DeepSpeed config corpus, at ../shared beside the project)",
            dir.display()
        ));
        None
    }
}

/// file name -> the placeholders INDEX.tsv lists for it (empty for a valid config).
fn index(dir: &Path) -> BTreeMap<String, Vec<String>> {
    let text = std::fs::read_to_string(dir.join("INDEX.tsv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split('\t').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (file, notes) = (col("file"), col("notes"));
    lines
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let cells: Vec<&str> = l.split('\t').collect();
            let placeholders = cells[notes]
                .split(';')
                .find_map(|n| n.strip_prefix("template_placeholders="))
                .map(|p| p.split(',').map(str::to_string).collect())
                .unwrap_or_default();
            (cells[file].to_string(), placeholders)
        })
        .collect()
}

#[test]
fn every_corpus_config_parses_or_names_its_placeholder() {
    let Some(dir) = corpus() else { return };
    let index = index(&dir);
    assert!(index.len() > 250, "the corpus index lists {} files", index.len());
    let mut failures = Vec::new();
    let (mut valid, mut templates) = (0, 0);
    for (name, placeholders) in &index {
        let path = dir.join(name);
        let result = DeepSpeedConfig::from_file(&path);
        if placeholders.is_empty() {
            valid += 1;
            match result {
                Ok(parsed) => {
                    let raw = parsed.config.raw();
                    let has_batch =
                        raw.get("train_batch_size").is_some() || raw.get("train_micro_batch_size_per_gpu").is_some();
                    match parsed.config.resolve_partial(None, None, &Overrides::new()) {
                        Ok(_) => {}
                        // Partial configs (autotuning templates) give no batch size: DeepSpeed
                        // cannot run them either.
                        Err(ConfigError::Batch { .. }) if !has_batch => {}
                        Err(e) => failures.push(format!("{name}: parses but does not resolve: {e}")),
                    }
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        } else {
            templates += 1;
            match result {
                Err(ConfigError::Placeholder { placeholder, line, .. }) => {
                    if !placeholders.contains(&placeholder) || line == 0 {
                        failures.push(format!(
                            "{name}: placeholder `{placeholder}` at line {line}, index lists {placeholders:?}"
                        ));
                    }
                }
                other => failures.push(format!("{name}: expected a placeholder error, got {other:?}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} files:\n{}",
        failures.len(),
        index.len(),
        failures.join("\n")
    );
    assert!(valid > 250 && templates >= 10, "{valid} valid, {templates} templates");
}

#[test]
fn corpus_configs_resolve_for_a_real_run() {
    // With a world size, a hidden size and the values HuggingFace's Trainer would supply, every
    // valid config whose batch triad fits the world size resolves completely.
    let Some(dir) = corpus() else { return };
    let overrides = Overrides::new()
        .with("train_micro_batch_size_per_gpu", 4)
        .with("gradient_accumulation_steps", 1)
        .with("gradient_clipping", 1.0)
        .with("fp16.enabled", false)
        .with("bf16.enabled", true)
        .with("bfloat16.enabled", true)
        .with("optimizer.params.lr", 1e-4)
        .with("optimizer.params.betas", serde_json::json!([0.9, 0.999]))
        .with("optimizer.params.eps", 1e-8)
        .with("optimizer.params.weight_decay", 0.0)
        .with("scheduler.params.warmup_min_lr", 0.0)
        .with("scheduler.params.warmup_max_lr", 1e-4)
        .with("scheduler.params.warmup_num_steps", 100)
        .with("scheduler.params.total_num_steps", 1000);
    let mut resolved = 0;
    let mut failures = Vec::new();
    for (name, placeholders) in index(&dir) {
        if !placeholders.is_empty() {
            continue;
        }
        let parsed = DeepSpeedConfig::from_file(dir.join(&name)).unwrap();
        let ctx = zero_core::config::ResolveContext {
            world_size: 1,
            hidden_size: Some(4096),
            overrides: overrides.clone(),
        };
        match parsed.config.resolve(&ctx) {
            Ok(c) => {
                resolved += 1;
                assert_eq!(
                    c.train_batch_size,
                    c.micro_batch_size * c.gradient_accumulation_steps,
                    "{name}"
                );
            }
            // A triad written for more than one rank does not fit one; anything else is a bug.
            Err(ConfigError::Batch { .. }) => {}
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(resolved > 150, "only {resolved} resolved");
}
