//! What can be wrong with a configuration, said so that the user knows which line or key to fix.

use std::fmt;
use std::path::PathBuf;

/// A configuration that cannot be used. Every variant names its source (the file, or the name the
/// caller gave the text) and, where one is to blame, the dotted key
/// (`zero_optimization.offload_optimizer.device`).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is larger than any config (see [`super::MAX_CONFIG_BYTES`]).
    #[error(
        "{path}: larger than {limit} bytes ({} MiB), the most read from a config file; \
         is this the config?", limit >> 20
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit, in bytes.
        limit: u64,
    },
    /// A template whose placeholders were never substituted (`${zero_stage}`, `CONFIG_FP16_ENABLED`).
    #[error(
        "{source_name}:{line}: unsubstituted template placeholder `{placeholder}`{more}; \
         replace it with a value (the file is a template, not a config)"
    )]
    Placeholder {
        /// File or source name.
        source_name: String,
        /// The first placeholder, as written.
        placeholder: String,
        /// Its line (1-based).
        line: usize,
        /// The other placeholders, with their lines, already formatted (may be empty).
        more: String,
    },
    /// The text is not JSON (even allowing comments and trailing commas).
    #[error("{source_name}:{line}:{column}: not valid JSON: {message}")]
    Syntax {
        /// File or source name.
        source_name: String,
        /// Line (1-based).
        line: usize,
        /// Column (1-based).
        column: usize,
        /// What the parser found.
        message: String,
    },
    /// A key that DeepSpeed does not know, where DeepSpeed rejects unknown keys.
    #[error("{source_name}: unknown key `{key}`{}; valid keys here: {valid}", suggestion_text(.suggestion))]
    UnknownKey {
        /// File or source name.
        source_name: String,
        /// The dotted key.
        key: String,
        /// The nearest known key, if one is close.
        suggestion: Option<String>,
        /// The keys that are valid in this section.
        valid: String,
    },
    /// A value of the wrong JSON type, or a number out of range.
    #[error("{source_name}: `{key}` expects {expected}, found {found}")]
    InvalidType {
        /// File or source name.
        source_name: String,
        /// The dotted key.
        key: String,
        /// What the key accepts.
        expected: String,
        /// The value found, as JSON (for a usable value in quotes, also how to write it).
        found: String,
    },
    /// A value of the right type that is not one of the accepted ones.
    #[error("{source_name}: `{key}` = {value} is not valid; {valid}")]
    InvalidValue {
        /// File or source name.
        source_name: String,
        /// The dotted key.
        key: String,
        /// The value found, as JSON.
        value: String,
        /// What would be valid.
        valid: String,
    },
    /// Two keys that cannot be given together (a legacy spelling and its current name, or two
    /// options that exclude each other).
    #[error("{source_name}: `{key}` conflicts with `{other}`: {reason}")]
    Conflict {
        /// File or source name.
        source_name: String,
        /// The dotted key.
        key: String,
        /// The other dotted key.
        other: String,
        /// Why they cannot go together.
        reason: String,
    },
    /// The batch triad is inconsistent or incomplete.
    #[error("{source_name}: {message}")]
    Batch {
        /// File or source name.
        source_name: String,
        /// The values involved and which one to change.
        message: String,
    },
    /// A value supplied for a key that the file does not write "auto" (so it would fill
    /// nothing), or for a key of the ranks' layout, which is read from the file before any
    /// supplied value.
    #[error(
        "{source_name}: a value is supplied for `{key}`, but {}",
        match (.layout, .written.as_deref()) {
            (true, _) => "it sets the ranks' layout, which is read from the file before any supplied value; write \
                it in the file".to_string(),
            (false, Some(v)) => format!("the file writes it as {v}; a supplied value only fills a value written \
                \"auto\" (edit the file to change it)"),
            (false, None) => "the file does not write it; a supplied value only fills a value written \"auto\" \
                (edit the file to change it)".to_string(),
        }
    )]
    NotAuto {
        /// File or source name.
        source_name: String,
        /// The dotted key.
        key: String,
        /// The value the file writes there, as JSON; `None` when it writes none.
        written: Option<String>,
        /// Whether the key is one of the ranks' layout ([`super::LAYOUT_KEYS`]).
        layout: bool,
    },
    /// A value left as "auto" that nothing could resolve.
    #[error(
        "{source_name}: `{key}` is \"auto\" and cannot be resolved here: it comes from {hint}; supply it \
         (`--set {key}=VALUE` on a command line, `ResolveContext` in code) or write a value in the file"
    )]
    UnresolvedAuto {
        /// File or source name.
        source_name: String,
        /// The dotted key.
        key: String,
        /// What would resolve it.
        hint: String,
    },
}

fn suggestion_text(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(s) => format!(" (did you mean `{s}`?)"),
        None => String::new(),
    }
}

/// Something in the configuration worth telling the user that does not stop it from being used:
/// an unknown top-level key, a legacy spelling, non-strict JSON. The library collects these and
/// returns them; printing is the caller's choice.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConfigWarning {
    /// The dotted key concerned (empty for the file as a whole).
    pub key: String,
    /// What is worth knowing, and what to do about it.
    pub message: String,
}

impl ConfigWarning {
    pub(crate) fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "`{}`: {}", self.key, self.message)
        }
    }
}
