//! Values that may be written "auto" (the HuggingFace convention), and the values a caller
//! supplies for them.

use serde::{Serialize, Serializer};
use serde_json::Value;
use std::collections::BTreeMap;

/// A config value that is either given or left as "auto" for someone else to fill in: derived
/// from the other values and the world size (the batch triad), from the model (bucket sizes from
/// the hidden size), or supplied by the caller (see [`Overrides`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Auto<T> {
    /// Written as "auto".
    Auto,
    /// Written as a value.
    Value(T),
}

impl<T> Auto<T> {
    /// Whether the value was written as "auto".
    pub fn is_auto(&self) -> bool {
        matches!(self, Auto::Auto)
    }

    /// The value, if one was written.
    pub fn value(&self) -> Option<&T> {
        match self {
            Auto::Auto => None,
            Auto::Value(v) => Some(v),
        }
    }
}

impl<T: Serialize> Serialize for Auto<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Auto::Auto => serializer.serialize_str("auto"),
            Auto::Value(v) => v.serialize(serializer),
        }
    }
}

/// Values the caller supplies for keys the file left as "auto", by dotted key
/// (`optimizer.params.lr`, `gradient_clipping`, `train_micro_batch_size_per_gpu`), as
/// HuggingFace's Trainer fills a config from its own arguments. A key written with a value in
/// the file keeps that value: overrides only fill in "auto".
///
/// ```
/// use zero_core::config::Overrides;
/// let overrides = Overrides::new()
///     .with("optimizer.params.lr", 3e-4)
///     .with("optimizer.params.betas", serde_json::json!([0.9, 0.95]));
/// assert_eq!(overrides.get("optimizer.params.lr"), Some(&serde_json::json!(3e-4)));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Overrides(BTreeMap<String, Value>);

impl Overrides {
    /// No overrides.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the value for a dotted key.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.set(key, value);
        self
    }

    /// Sets the value for a dotted key.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<Value>) {
        self.0.insert(key.into(), value.into());
    }

    /// The value for a dotted key, if the caller supplied one.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }

    /// The dotted keys a value was supplied for, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// Whether no value was supplied.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The values of command-line assignments `KEY=JSON` (`--set`); a value that is not JSON is
    /// taken as a string (`amp.opt_level=O1`).
    pub fn from_assignments(items: &[String]) -> Result<Self, String> {
        let mut overrides = Overrides::new();
        for item in items {
            let (key, value) = item
                .split_once('=')
                .filter(|(key, _)| !key.is_empty())
                .ok_or_else(|| format!("--set {item}: expected KEY=JSON, e.g. train_micro_batch_size_per_gpu=4"))?;
            if overrides.get(key).is_some() {
                return Err(format!("--set {key}: given twice; give each key once"));
            }
            let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
            overrides.set(key, value);
        }
        Ok(overrides)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_serializes_as_the_string_auto() {
        assert_eq!(serde_json::to_value(Auto::<u64>::Auto).unwrap(), "auto");
        assert_eq!(serde_json::to_value(Auto::Value(4u64)).unwrap(), 4);
        assert!(Auto::<u8>::Auto.is_auto());
        assert_eq!(Auto::Value(3).value(), Some(&3));
    }

    /// A key given twice on the command line is refused, not settled by the last.
    #[test]
    fn a_key_assigned_twice_is_refused() {
        let twice = ["optimizer.params.lr=1".to_string(), "optimizer.params.lr=2".to_string()];
        let err = Overrides::from_assignments(&twice).unwrap_err();
        assert!(err.contains("optimizer.params.lr") && err.contains("twice"), "{err}");
        let once = ["optimizer.params.lr=1".to_string(), "gradient_clipping=2".to_string()];
        assert!(Overrides::from_assignments(&once).is_ok());
    }

    #[test]
    fn overrides_replace_by_key() {
        let mut o = Overrides::new().with("a.b", 1);
        o.set("a.b", 2);
        assert_eq!(o.get("a.b"), Some(&Value::from(2)));
        assert_eq!(o.get("a"), None);
        assert!(!o.is_empty());
    }
}
