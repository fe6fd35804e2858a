//! Reading typed values out of a JSON section: DeepSpeed's numeric leniency, legacy spellings,
//! unknown keys with suggestions, and what "auto" means for each key.
//!
//! Every section of the config is read by the same code twice: once when the file is parsed (so
//! every type error, unknown key and placeholder is reported up front, with "auto" standing in
//! as the default), and once at resolve time, when "auto" must become a value.

use super::auto::Overrides;
use super::error::{ConfigError, ConfigWarning};
use super::scalar::{integral, Scalar};
use super::text::{line_of, looks_like_placeholder, placeholder_error};
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};

/// A value left as "auto" that resolution could not fill in, and what would.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Deferred {
    /// The dotted key.
    pub key: String,
    /// What resolves it, as a noun phrase ("the model's hidden size", "the training script",
    /// "the other batch keys and the world size").
    pub resolved_by: String,
}

/// What an unknown key in a section leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnknownKeys {
    /// An error: DeepSpeed rejects unknown keys here.
    Error,
    /// A warning: DeepSpeed ignores them here.
    Warn,
}

/// Keys whose "auto" is filled by the caller (HuggingFace's Trainer fills exactly these from
/// its arguments) or derived from the model; any other "auto" means DeepSpeed's default,
/// because DeepSpeed's own config models drop "auto" values before validation.
fn fill_hint(key: &str) -> Option<String> {
    const CALLER: &[&str] = &[
        "gradient_clipping",
        "fp16.enabled",
        "bf16.enabled",
        "bfloat16.enabled",
        "amp.enabled",
        "amp.opt_level",
    ];
    if super::resolved::FROM_HIDDEN.contains(&key) {
        Some("the model's hidden size".into())
    } else if CALLER.contains(&key) || key.starts_with("optimizer.params.") || key.starts_with("scheduler.params.") {
        Some("the training script".into())
    } else {
        None
    }
}

/// The reading context: where the text came from, and how "auto" is treated.
pub(crate) struct Cx<'a> {
    pub source: &'a str,
    /// The original text, to give string placeholders a line number.
    pub text: Option<&'a str>,
    pub overrides: &'a Overrides,
    /// Values derived for "auto" keys (by canonical dotted key).
    pub derived: BTreeMap<String, Value>,
    /// Record unresolvable "auto" values in `deferred` (and use the default) instead of failing.
    pub defer: bool,
    /// Collect warnings (only on the parse pass, so that resolving does not repeat them).
    pub warn: bool,
    pub warnings: Vec<ConfigWarning>,
    pub deferred: Vec<Deferred>,
    /// Dotted keys written "auto" (as written and in their current spelling): the keys a
    /// caller's override can fill.
    pub written_auto: BTreeSet<String>,
    /// The keys `zero_optimization` reads (once it has been read): a top-level key among them
    /// is a ZeRO setting written outside its section.
    pub zero_keys: Vec<&'static str>,
}

impl<'a> Cx<'a> {
    pub fn new(source: &'a str, overrides: &'a Overrides) -> Self {
        Self {
            source,
            text: None,
            overrides,
            derived: BTreeMap::new(),
            defer: true,
            warn: false,
            warnings: Vec::new(),
            deferred: Vec::new(),
            written_auto: BTreeSet::new(),
            zero_keys: Vec::new(),
        }
    }

    /// Adds a warning (on the parse pass only).
    pub fn warning(&mut self, key: impl Into<String>, message: impl Into<String>) {
        if self.warn {
            self.warnings.push(ConfigWarning::new(key, message));
        }
    }

    /// An "invalid value" error for `key`.
    pub fn invalid(&self, key: &str, value: &Value, valid: impl Into<String>) -> ConfigError {
        ConfigError::InvalidValue {
            source_name: self.source.to_string(),
            key: key.to_string(),
            value: value.to_string(),
            valid: valid.into(),
        }
    }

    /// A value of `key` (under any of its spellings `names`, the first being the current one),
    /// or `default` when absent, null, or "auto" that means DeepSpeed's default.
    pub fn get<T: Scalar>(
        &mut self,
        s: &mut Section<'_>,
        names: &[&'static str],
        default: T,
    ) -> Result<T, ConfigError> {
        match s.lookup(names, self)? {
            None => {
                // null where the key has no "none" value (an Option's null is its None): the
                // default is taken, and the user told which, as a null may be a template's
                // leftover rather than a choice.
                if T::from_value(&Value::Null).is_none() {
                    if let Some(written) = s.written_null(names) {
                        let shown = serde_json::to_string(&default.to_json()).unwrap_or_default();
                        self.warning(
                            s.key(written),
                            format!("null, read as DeepSpeed's default ({shown}); write the value, or remove the key"),
                        );
                    }
                }
                Ok(default)
            }
            Some((written, v)) => {
                let key = s.key(written);
                if v.as_str() == Some("auto") {
                    let canonical = s.key(names[0]);
                    self.written_auto.insert(key.clone());
                    self.written_auto.insert(canonical.clone());
                    self.resolve_auto(&key, &canonical, default)
                } else {
                    self.convert(&key, v)
                }
            }
        }
    }

    /// Converts `v` to `T`, naming `key` (and any placeholder) on failure.
    pub fn convert<T: Scalar>(&self, key: &str, v: &Value) -> Result<T, ConfigError> {
        if let Value::String(s) = v {
            if looks_like_placeholder(s) {
                let quoted = format!("\"{s}\"");
                let line = self.text.and_then(|t| line_of(t, &quoted)).unwrap_or(0);
                return Err(placeholder_error(self.source, &(s.clone(), line), &[]));
            }
        }
        T::from_value(v).ok_or_else(|| {
            // A value that would do, written in quotes ("8", "true"): say so, not just the type.
            let unquoted = match v {
                Value::String(s) => serde_json::from_str::<Value>(s.trim())
                    .ok()
                    .filter(|inner| !inner.is_string() && T::from_value(inner).is_some()),
                _ => None,
            };
            ConfigError::InvalidType {
                source_name: self.source.to_string(),
                key: key.to_string(),
                expected: T::EXPECTED.to_string(),
                found: match unquoted {
                    Some(inner) => format!("{v}, a string: write {inner} without the quotes"),
                    // An integer of the right kind, but too large (or below the range).
                    None if v.is_i64() || v.is_u64() || integral(v).is_some() => format!("{v}, out of range"),
                    None => v.to_string(),
                },
            }
        })
    }

    /// What "auto" at `key` (canonical spelling `canonical`) becomes: the caller's override,
    /// a derived value, DeepSpeed's default, or (for keys only the caller or the model can
    /// fill) a deferral or an error.
    pub fn resolve_auto<T: Scalar>(&mut self, key: &str, canonical: &str, default: T) -> Result<T, ConfigError> {
        if let Some(v) = self.overrides.get(key).or_else(|| self.overrides.get(canonical)) {
            // The value is the caller's (`--set`), not the file's: the error says so.
            return self.convert(key, v).map_err(|e| match e {
                ConfigError::InvalidType {
                    source_name,
                    key,
                    expected,
                    found,
                } => ConfigError::InvalidType {
                    source_name,
                    key: format!("{key} (the value supplied for its \"auto\")"),
                    expected,
                    found,
                },
                other => other,
            });
        }
        if let Some(v) = self.derived.get(canonical).cloned() {
            return self.convert(key, &v);
        }
        match fill_hint(canonical) {
            Some(hint) if self.defer => {
                self.deferred.push(Deferred {
                    key: key.to_string(),
                    resolved_by: hint,
                });
                Ok(default)
            }
            Some(hint) => Err(ConfigError::UnresolvedAuto {
                source_name: self.source.to_string(),
                key: key.to_string(),
                hint,
            }),
            None => {
                let shown = serde_json::to_string(&default.to_json()).unwrap_or_default();
                self.warning(
                    key,
                    format!("\"auto\" here means DeepSpeed's default ({shown}), used as such"),
                );
                Ok(default)
            }
        }
    }
}

/// One JSON object of the config, with the keys read from it tracked so that the rest can be
/// reported as unknown.
pub(crate) struct Section<'v> {
    map: Option<&'v Map<String, Value>>,
    path: String,
    asked: Vec<&'static str>,
}

impl<'v> Section<'v> {
    /// A section at `path` (dotted, empty for the top level); `None` when it is absent or null.
    pub fn new(value: Option<&'v Value>, path: &str, cx: &Cx<'_>) -> Result<Self, ConfigError> {
        let map = match value {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => Some(m),
            Some(other) => {
                return Err(ConfigError::InvalidType {
                    source_name: cx.source.to_string(),
                    key: if path.is_empty() {
                        "(top level)".into()
                    } else {
                        path.to_string()
                    },
                    expected: "an object".into(),
                    found: other.to_string(),
                })
            }
        };
        Ok(Self {
            map,
            path: path.to_string(),
            asked: Vec::new(),
        })
    }

    /// Whether the section was written in the file.
    pub fn present(&self) -> bool {
        self.map.is_some()
    }

    /// The dotted path of `key` in this section.
    pub fn key(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The value written under any of `names` (null counts as absent). Two spellings of the
    /// same key given together are a conflict.
    pub fn lookup(
        &mut self,
        names: &[&'static str],
        cx: &Cx<'_>,
    ) -> Result<Option<(&'static str, &'v Value)>, ConfigError> {
        self.asked.extend_from_slice(names);
        let Some(map) = self.map else { return Ok(None) };
        let mut found: Option<(&'static str, &'v Value)> = None;
        for &name in names {
            if let Some(v) = map.get(name) {
                if v.is_null() {
                    continue;
                }
                if let Some((first, _)) = found {
                    return Err(ConfigError::Conflict {
                        source_name: cx.source.to_string(),
                        key: self.key(first),
                        other: self.key(name),
                        reason: "both spell the same setting; keep one".into(),
                    });
                }
                found = Some((name, v));
            }
        }
        Ok(found)
    }

    /// The spelling among `names` written as null, if one is (and none is written with a value).
    pub fn written_null(&self, names: &[&'static str]) -> Option<&'static str> {
        let map = self.map?;
        names.iter().copied().find(|n| map.get(*n).is_some_and(Value::is_null))
    }

    /// A sub-section (an object) under `name`.
    pub fn child(&mut self, name: &'static str, cx: &Cx<'_>) -> Result<Section<'v>, ConfigError> {
        let path = self.key(name);
        let v = self.lookup(&[name], cx)?.map(|(_, v)| v);
        Section::new(v, &path, cx)
    }

    /// The raw value under `name`, for sections kept as JSON.
    pub fn raw(&mut self, name: &'static str) -> Option<&'v Value> {
        self.asked.push(name);
        self.map.and_then(|m| m.get(name))
    }

    /// The keys asked for so far (every spelling).
    pub fn asked(&self) -> &[&'static str] {
        &self.asked
    }

    /// Reports the keys that were never asked for, as `policy` says.
    pub fn finish(self, cx: &mut Cx<'_>, policy: UnknownKeys) -> Result<(), ConfigError> {
        let Some(map) = self.map else { return Ok(()) };
        for key in map.keys() {
            if self.asked.iter().any(|a| a == key) {
                continue;
            }
            let suggestion = nearest(key, &self.asked);
            let dotted = self.key(key);
            match policy {
                UnknownKeys::Error => {
                    let mut valid: Vec<&str> = self.asked.clone();
                    valid.sort_unstable();
                    valid.dedup();
                    return Err(ConfigError::UnknownKey {
                        source_name: cx.source.to_string(),
                        key: dotted,
                        suggestion,
                        valid: valid.join(", "),
                    });
                }
                UnknownKeys::Warn => {
                    // A ZeRO setting written at the top level instead of inside its section.
                    let misplaced = (self.path.is_empty() && cx.zero_keys.contains(&key.as_str()))
                        .then(|| format!("zero_optimization.{key}"));
                    let message = match suggestion.or(misplaced) {
                        Some(s) => format!("unknown key, ignored (did you mean `{s}`?)"),
                        None => "unknown key, ignored".to_string(),
                    };
                    cx.warning(dotted, message);
                }
            }
        }
        Ok(())
    }
}

/// The known key nearest to `key` by edit distance, if it is close enough to be a misspelling.
pub(crate) fn nearest(key: &str, known: &[&str]) -> Option<String> {
    let lower = key.to_ascii_lowercase();
    known
        .iter()
        .map(|k| (strsim::damerau_levenshtein(&lower, k), *k))
        .filter(|(d, k)| *d <= (k.len().max(key.len()) / 4).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read<T: Scalar>(v: Value) -> Result<T, ConfigError> {
        let o = Overrides::new();
        let mut cx = Cx::new("t.json", &o);
        let doc = json!({ "k": v });
        let mut s = Section::new(Some(&doc), "sec", &cx).unwrap();
        let placeholder: T = T::from_value(&json!(0))
            .or_else(|| T::from_value(&json!(false)))
            .or_else(|| T::from_value(&json!("")))
            .unwrap();
        cx.get(&mut s, &["k"], placeholder)
    }

    #[test]
    fn integers_accept_exponent_and_integral_floats() {
        assert_eq!(read::<u64>(json!(5e8)).unwrap(), 500_000_000);
        assert_eq!(read::<u64>(json!(1.0)).unwrap(), 1);
        assert_eq!(read::<u64>(json!(7)).unwrap(), 7);
        assert_eq!(read::<i64>(json!(-1.0)).unwrap(), -1);
        assert_eq!(
            read::<u64>(json!(9_223_372_036_854_775_807u64)).unwrap(),
            i64::MAX as u64
        );
    }

    #[test]
    fn fractional_or_negative_integers_are_errors_naming_the_key() {
        let e = read::<u64>(json!(2.5)).unwrap_err().to_string();
        assert!(
            e.contains("`sec.k`") && e.contains("2.5") && e.contains("integer"),
            "{e}"
        );
        assert!(read::<u64>(json!(-3)).is_err());
        assert!(read::<u64>(json!("5")).is_err());
    }

    #[test]
    fn booleans_stay_booleans() {
        assert!(read::<bool>(json!(true)).unwrap());
        let e = read::<bool>(json!(1)).unwrap_err().to_string();
        assert!(e.contains("boolean"), "{e}");
        assert!(read::<bool>(json!("true")).is_err());
    }

    #[test]
    fn string_placeholders_are_reported_as_placeholders() {
        let e = read::<u64>(json!("${BATCH_SIZE}")).unwrap_err();
        assert!(
            matches!(e, ConfigError::Placeholder { ref placeholder, .. } if placeholder == "${BATCH_SIZE}"),
            "{e}"
        );
        let e = read::<String>(json!("${opt}")).unwrap_err();
        assert!(matches!(e, ConfigError::Placeholder { .. }), "{e}");
        assert_eq!(read::<String>(json!("WARN")).unwrap(), "WARN");
    }

    #[test]
    fn a_quoted_word_where_a_number_goes_is_a_type_error_naming_the_key() {
        for word in ["INF", "BATCH_SIZE", "inf"] {
            let e = read::<f64>(json!(word)).unwrap_err();
            match &e {
                ConfigError::InvalidType { key, found, .. } => {
                    assert_eq!(key, "sec.k");
                    assert!(found.contains(word), "{e}");
                }
                other => panic!("{word}: expected a type error, got {other:?}"),
            }
        }
    }

    #[test]
    fn null_where_a_value_is_needed_warns_with_the_default() {
        let o = Overrides::new();
        let mut cx = Cx::new("t.json", &o);
        cx.warn = true;
        let doc = json!({ "stage": null, "seed": null });
        let mut s = Section::new(Some(&doc), "zero_optimization", &cx).unwrap();
        assert_eq!(cx.get(&mut s, &["stage"], 0u64).unwrap(), 0);
        // An optional key's null is its "none": nothing to warn about.
        assert_eq!(cx.get::<Option<u64>>(&mut s, &["seed"], None).unwrap(), None);
        assert_eq!(cx.warnings.len(), 1, "{:?}", cx.warnings);
        assert_eq!(cx.warnings[0].key, "zero_optimization.stage");
        assert!(cx.warnings[0].message.contains("default (0)"), "{}", cx.warnings[0]);
    }

    #[test]
    fn legacy_and_current_spelling_together_conflict() {
        let o = Overrides::new();
        let mut cx = Cx::new("t", &o);
        let doc = json!({"a": 1, "b": 2});
        let mut s = Section::new(Some(&doc), "", &cx).unwrap();
        let e = cx.get(&mut s, &["a", "b"], 0u64).unwrap_err();
        assert!(matches!(e, ConfigError::Conflict { .. }), "{e}");
    }

    #[test]
    fn unknown_keys_error_or_warn_with_suggestion() {
        let o = Overrides::new();
        let mut cx = Cx::new("t", &o);
        cx.warn = true;
        let doc = json!({"stage3_prefetch_bucketsize": 1});
        let mut s = Section::new(Some(&doc), "zero_optimization", &cx).unwrap();
        let _ = cx.get(&mut s, &["stage3_prefetch_bucket_size"], 0u64).unwrap();
        let e = s.finish(&mut cx, UnknownKeys::Error).unwrap_err().to_string();
        assert!(e.contains("did you mean `stage3_prefetch_bucket_size`?"), "{e}");
        assert!(e.contains("zero_optimization.stage3_prefetch_bucketsize"), "{e}");

        let mut s = Section::new(Some(&doc), "", &cx).unwrap();
        let _ = cx.get(&mut s, &["stage3_prefetch_bucket_size"], 0u64).unwrap();
        s.finish(&mut cx, UnknownKeys::Warn).unwrap();
        assert_eq!(cx.warnings.len(), 1);
        assert!(cx.warnings[0].message.contains("did you mean"));
    }

    #[test]
    fn nearest_ignores_unrelated_keys() {
        assert_eq!(
            nearest("overlap_com", &["overlap_comm", "stage"]).as_deref(),
            Some("overlap_comm")
        );
        assert_eq!(nearest("cuda_visible_devices", &["stage", "overlap_comm"]), None);
    }
}
