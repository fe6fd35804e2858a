//! From the text of a config file to a JSON value.
//!
//! DeepSpeed reads its config with hjson, so files with `//` or `#` comments, `/* */` blocks and
//! trailing commas train under DeepSpeed; other readers of the same file (HuggingFace's Trainer
//! uses Python's strict `json`) reject them. We accept those four relaxations, as DeepSpeed does,
//! and return a warning for each kind found so the user knows the file is not portable. We do not
//! accept the rest of hjson (unquoted strings, missing commas): hjson reads an unsubstituted
//! template placeholder such as `CONFIG_FP16_ENABLED` as the string "CONFIG_FP16_ENABLED" and the
//! error surfaces much later; here it is an error that names the placeholder and its line.
//! Only text with a placeholder's shape is one: `${...}` or `{{...}}` anywhere, and `$X`, `%X%`,
//! `<X>` or a bare word in capitals where a value goes. Any other text that is not JSON (a
//! lower-case bare word, text after the JSON, a file that is not JSON at all) is the JSON
//! parser's error, with its line and column. Duplicate keys are an error, as in DeepSpeed.

use super::error::{ConfigError, ConfigWarning};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;

/// Parses `text` (named `source_name` in errors) into a JSON value, with warnings for the
/// relaxations it had to make.
pub(crate) fn parse_relaxed(text: &str, source_name: &str) -> Result<(Value, Vec<ConfigWarning>), ConfigError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let scan = scan(text);
    if let Some(err) = scan.bad_literal {
        return Err(ConfigError::Syntax {
            source_name: source_name.to_string(),
            line: err.1,
            column: err.2,
            message: err.0,
        });
    }
    // A placeholder used twice is reported once, at its first line.
    let mut seen = std::collections::BTreeSet::new();
    let placeholders: Vec<(String, usize)> = scan
        .placeholders
        .into_iter()
        .filter(|(p, _)| seen.insert(p.clone()))
        .collect();
    if let Some((first, rest)) = placeholders.split_first() {
        return Err(placeholder_error(source_name, first, rest));
    }
    let mut warnings = Vec::new();
    if let Some(line) = scan.first_comment {
        warnings.push(ConfigWarning::new(
            "",
            format!(
                "{source_name}:{line}: comments are not JSON; DeepSpeed (hjson) accepts them, \
                 strict JSON readers such as HuggingFace's Trainer do not"
            ),
        ));
    }
    if let Some(line) = scan.first_trailing_comma {
        warnings.push(ConfigWarning::new(
            "",
            format!(
                "{source_name}:{line}: trailing comma; DeepSpeed (hjson) accepts it, strict JSON \
                 readers such as HuggingFace's Trainer do not"
            ),
        ));
    }
    let mut de = serde_json::Deserializer::from_str(&scan.clean);
    let value = NoDuplicates::deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v.0))
        .map_err(|e| ConfigError::Syntax {
            source_name: source_name.to_string(),
            line: e.line(),
            // serde_json reports column 0 for an error at the very end of a line (a file cut
            // after a newline); columns are 1-based.
            column: e.column().max(1),
            message: strip_position(&e.to_string()),
        })?;
    Ok((value, warnings))
}

/// Builds the error for unsubstituted placeholders: the first by name and line, the others listed.
pub(crate) fn placeholder_error(source_name: &str, first: &(String, usize), rest: &[(String, usize)]) -> ConfigError {
    let more = if rest.is_empty() {
        String::new()
    } else {
        let listed: Vec<String> = rest.iter().take(8).map(|(p, l)| format!("`{p}` (line {l})")).collect();
        let tail = if rest.len() > 8 {
            format!(" and {} more", rest.len() - 8)
        } else {
            String::new()
        };
        format!(" and {} other(s): {}{tail}", rest.len(), listed.join(", "))
    };
    ConfigError::Placeholder {
        source_name: source_name.to_string(),
        placeholder: first.0.clone(),
        line: first.1,
        more,
    }
}

/// Whether a quoted string is a template placeholder (`"${x}"`, `"{{x}}"`, `"$X"`, `"%X%"`,
/// `"<X>"`). A quoted word in capitals (`"INF"`, `"BATCH_SIZE"`) is not: it is a string where
/// the key may want a number, and the type error that names the key says so better.
pub(crate) fn looks_like_placeholder(s: &str) -> bool {
    let s = s.trim();
    let ident = |t: &str| {
        !t.is_empty()
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')
    };
    if let Some(inner) = s.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
        return !inner.trim().is_empty();
    }
    if let Some(inner) = s.strip_prefix("{{").and_then(|r| r.strip_suffix("}}")) {
        return !inner.trim().is_empty();
    }
    if let Some(inner) = s.strip_prefix('$') {
        return ident(inner);
    }
    if let Some(inner) = s.strip_prefix('%').and_then(|r| r.strip_suffix('%')) {
        return ident(inner);
    }
    if let Some(inner) = s.strip_prefix('<').and_then(|r| r.strip_suffix('>')) {
        return ident(inner);
    }
    false
}

/// 1-based line of the first occurrence of `needle` in `text`.
pub(crate) fn line_of(text: &str, needle: &str) -> Option<usize> {
    text.find(needle)
        .map(|at| text[..at].bytes().filter(|&b| b == b'\n').count() + 1)
}

fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}

/// What one pass over the text found.
struct Scan {
    /// The text with comments and trailing commas blanked out (lines kept).
    clean: String,
    /// Placeholders outside strings, with their lines.
    placeholders: Vec<(String, usize)>,
    /// A literal that is not JSON (`True`, `None`, `NaN`): message, line, column.
    bad_literal: Option<(String, usize, usize)>,
    first_comment: Option<usize>,
    first_trailing_comma: Option<usize>,
}

fn scan(text: &str) -> Scan {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Scan {
        clean: String::with_capacity(text.len()),
        placeholders: Vec::new(),
        bad_literal: None,
        first_comment: None,
        first_trailing_comma: None,
    };
    let mut line = 1usize;
    let mut line_start = 0usize;
    let mut i = 0usize;
    let n = chars.len();
    // Where a value may start: after `:` in an object, after `[` or `,` in an array. Only there
    // is a bare word a placeholder; anywhere else (a non-JSON file, text after the JSON) it is
    // left for the JSON parser to report with its line and column.
    let mut open: Vec<char> = Vec::new();
    let mut prev: Option<char> = None;
    while i < n {
        let c = chars[i];
        let in_value_position = matches!(
            (open.last(), prev),
            (Some(_), Some(':')) | (Some('['), Some('[') | Some(','))
        );
        match c {
            '\n' => {
                out.clean.push(c);
                line += 1;
                line_start = i + 1;
                i += 1;
            }
            c if c.is_whitespace() => {
                out.clean.push(c);
                i += 1;
            }
            '"' => {
                // Copy the string verbatim; the JSON parser judges its escapes.
                out.clean.push(c);
                i += 1;
                while i < n {
                    let d = chars[i];
                    out.clean.push(d);
                    i += 1;
                    if d == '\\' && i < n {
                        out.clean.push(chars[i]);
                        i += 1;
                    } else if d == '"' {
                        break;
                    } else if d == '\n' {
                        line += 1;
                        line_start = i;
                    }
                }
                prev = Some('"');
            }
            '/' if chars.get(i + 1) == Some(&'/') => {
                out.first_comment.get_or_insert(line);
                i = blank_line_comment(&chars, i, &mut out.clean);
            }
            '#' => {
                out.first_comment.get_or_insert(line);
                i = blank_line_comment(&chars, i, &mut out.clean);
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                out.first_comment.get_or_insert(line);
                out.clean.push_str("  ");
                i += 2;
                while i < n && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                    if chars[i] == '\n' {
                        out.clean.push('\n');
                        line += 1;
                        line_start = i + 1;
                    } else {
                        out.clean.push(' ');
                    }
                    i += 1;
                }
                if i < n {
                    out.clean.push_str("  ");
                    i += 2;
                }
            }
            ',' if matches!(next_significant(&chars, i + 1), Some('}') | Some(']')) => {
                out.first_trailing_comma.get_or_insert(line);
                out.clean.push(' ');
                i += 1;
            }
            // `${...}` and `{{...}}` are template syntax wherever they stand (JSON has neither).
            '$' if chars.get(i + 1) == Some(&'{') => {
                i = placeholder(&chars, i, placeholder_end(&chars, i), line, &mut out);
                prev = Some('a');
            }
            '{' if next_significant(&chars, i + 1) == Some('{') => {
                let end = double_brace_end(&chars, i);
                let token: String = chars[i..end].iter().collect();
                let token: String = token.split_whitespace().collect::<Vec<_>>().join("");
                out.placeholders.push((token, line));
                out.clean.push_str("null");
                i = end;
                prev = Some('a');
            }
            '$' | '%' | '<' if in_value_position && placeholder_end(&chars, i) > i + 1 => {
                i = placeholder(&chars, i, placeholder_end(&chars, i), line, &mut out);
                prev = Some('a');
            }
            c if c.is_ascii_digit() || c == '-' => {
                // A number, exponent included (`5e8`, `-1.5E-3`); the JSON parser judges it.
                while i < n && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '.' | '+' | '-')) {
                    out.clean.push(chars[i]);
                    i += 1;
                }
                prev = Some('0');
            }
            c if c.is_alphabetic() || c == '_' => {
                let mut end = i;
                while end < n && (chars[end].is_alphanumeric() || matches!(chars[end], '_' | '.' | '-')) {
                    end += 1;
                }
                let word: String = chars[i..end].iter().collect();
                match word.as_str() {
                    "true" | "false" | "null" => out.clean.push_str(&word),
                    "True" | "False" | "None" | "NaN" | "Infinity" if in_value_position => {
                        let fix = match word.as_str() {
                            "True" => "JSON writes booleans as true",
                            "False" => "JSON writes booleans as false",
                            "None" => "JSON writes null",
                            _ => "JSON has no NaN or Infinity; write a number",
                        };
                        out.bad_literal.get_or_insert((
                            format!("`{word}` is a Python literal, not JSON: {fix}"),
                            line,
                            i - line_start + 1,
                        ));
                        out.clean.push_str("null");
                    }
                    _ if in_value_position && placeholder_shaped(&word) => {
                        out.placeholders.push((word, line));
                        out.clean.push_str("null");
                    }
                    // Not a placeholder: the JSON parser reports it with its line and column.
                    _ => out.clean.push_str(&word),
                }
                i = end;
                prev = Some('a');
            }
            _ => {
                match c {
                    '{' | '[' => open.push(c),
                    '}' | ']' => {
                        open.pop();
                    }
                    _ => {}
                }
                out.clean.push(c);
                prev = Some(c);
                i += 1;
            }
        }
    }
    out
}

/// Records the placeholder `chars[i..end]` and stands `null` in for it; returns `end`.
fn placeholder(chars: &[char], i: usize, end: usize, line: usize, out: &mut Scan) -> usize {
    let token: String = chars[i..end].iter().collect();
    out.placeholders.push((token.trim().to_string(), line));
    out.clean.push_str("null");
    end.max(i + 1)
}

/// Whether a bare word has a placeholder's shape: an identifier written mostly in capitals
/// (`CONFIG_FP16_ENABLED`, `CL_1st_MAX`, `E`), as templates name their variables. A lower-case
/// word (`cpu`, `yes`) is a JSON error, not a placeholder.
fn placeholder_shaped(word: &str) -> bool {
    let upper = word.chars().filter(char::is_ascii_uppercase).count();
    let lower = word.chars().filter(char::is_ascii_lowercase).count();
    word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !word.starts_with(|c: char| c.is_ascii_digit())
        && upper > lower
}

/// Blanks a comment running to the end of the line; returns the index of the newline.
fn blank_line_comment(chars: &[char], mut i: usize, clean: &mut String) -> usize {
    while i < chars.len() && chars[i] != '\n' {
        clean.push(' ');
        i += 1;
    }
    i
}

/// The next character that is neither whitespace nor inside a comment.
fn next_significant(chars: &[char], mut i: usize) -> Option<char> {
    while i < chars.len() {
        match chars[i] {
            c if c.is_whitespace() => i += 1,
            '/' if chars.get(i + 1) == Some(&'/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                i += 2;
                while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                    i += 1;
                }
                i += 2;
            }
            c => return Some(c),
        }
    }
    None
}

/// End of a `${...}`, `$NAME`, `%NAME%` or `<NAME>` placeholder starting at `i`.
fn placeholder_end(chars: &[char], i: usize) -> usize {
    let n = chars.len();
    let ident = |j: usize| j < n && (chars[j].is_alphanumeric() || matches!(chars[j], '_' | '.'));
    match chars[i] {
        '$' if chars.get(i + 1) == Some(&'{') => {
            let mut j = i + 2;
            while j < n && chars[j] != '}' && chars[j] != '\n' {
                j += 1;
            }
            (j + 1).min(n)
        }
        '%' | '<' => {
            let close = if chars[i] == '%' { '%' } else { '>' };
            let mut j = i + 1;
            while ident(j) {
                j += 1;
            }
            if j < n && chars[j] == close {
                j + 1
            } else {
                j
            }
        }
        _ => {
            let mut j = i + 1;
            while ident(j) {
                j += 1;
            }
            j
        }
    }
}

/// End of a `{{ ... }}` placeholder starting at `i`.
fn double_brace_end(chars: &[char], i: usize) -> usize {
    let n = chars.len();
    let mut j = i + 1;
    while j + 1 < n && !(chars[j] == '}' && chars[j + 1] == '}') && chars[j] != '\n' {
        j += 1;
    }
    if j + 1 < n && chars[j] == '}' {
        j + 2
    } else {
        j
    }
}

/// A JSON value read with duplicate keys rejected (serde_json keeps the last one silently).
struct NoDuplicates(Value);

impl<'de> Deserialize<'de> for NoDuplicates {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NoDuplicatesVisitor).map(NoDuplicates)
    }
}

struct NoDuplicatesVisitor;

impl<'de> Visitor<'de> for NoDuplicatesVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("number out of range"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(NoDuplicates(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!(
                    "duplicate key \"{key}\" (DeepSpeed rejects duplicate keys)"
                )));
            }
            let NoDuplicates(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_json_parses_without_warnings() {
        let (v, w) = parse_relaxed(r#"{"a": [1, 2.5, "x"], "b": {"c": null}}"#, "t").unwrap();
        assert_eq!(v["a"][1], 2.5);
        assert!(v["b"]["c"].is_null());
        assert!(w.is_empty());
    }

    #[test]
    fn comments_and_trailing_commas_parse_with_warnings() {
        let text = "{\n  // note\n  \"a\": 1, # hash\n  /* block\n */ \"b\": [1,2,],\n}\n";
        let (v, w) = parse_relaxed(text, "t.json").unwrap();
        assert_eq!(v["a"], 1);
        assert_eq!(v["b"], serde_json::json!([1, 2]));
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].message.contains("t.json:2"), "{}", w[0].message);
        assert!(w[1].message.contains("t.json:5"), "{}", w[1].message);
    }

    #[test]
    fn comment_markers_inside_strings_are_text() {
        let (v, w) = parse_relaxed(r#"{"p": "http://x/#y, ]", "q": "${not_a_placeholder}"}"#, "t").unwrap();
        assert_eq!(v["p"], "http://x/#y, ]");
        assert_eq!(v["q"], "${not_a_placeholder}");
        assert!(w.is_empty());
    }

    #[test]
    fn bare_placeholders_are_named_with_their_line() {
        for (text, name, line) in [
            ("{\n\"stage\": ${zero_stage}\n}", "${zero_stage}", 2),
            ("{\"enabled\": CONFIG_FP16_ENABLED}", "CONFIG_FP16_ENABLED", 1),
            ("{\n\n\"x\": $VAR}", "$VAR", 3),
            ("{\"x\": {{ var }} }", "{{var}}", 1),
            ("{\"x\": %BS%}", "%BS%", 1),
            ("{\"x\": <batch_size>}", "<batch_size>", 1),
        ] {
            match parse_relaxed(text, "f.json") {
                Err(ConfigError::Placeholder {
                    placeholder, line: l, ..
                }) => {
                    assert_eq!(placeholder, name, "{text}");
                    assert_eq!(l, line, "{text}");
                }
                other => panic!("{text}: expected a placeholder error, got {other:?}"),
            }
        }
    }

    #[test]
    fn all_placeholders_are_listed() {
        let err = parse_relaxed("{\"a\": A_B,\n\"b\": C_D,\n\"c\": E, \"d\": A_B}", "f").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`A_B`") && msg.contains("`C_D` (line 2)"), "{msg}");
        assert!(msg.contains("`E` (line 3)"), "{msg}");
        assert!(
            msg.contains("2 other(s)"),
            "a repeated placeholder is listed once: {msg}"
        );
    }

    #[test]
    fn python_literals_get_a_specific_error() {
        let err = parse_relaxed("{\"a\": True}", "f").unwrap_err();
        assert!(err.to_string().contains("JSON writes booleans as true"), "{err}");
    }

    #[test]
    fn duplicate_keys_are_errors_with_position() {
        let err = parse_relaxed("{\"a\": 1,\n \"a\": 2}", "f").unwrap_err();
        match err {
            ConfigError::Syntax { line, message, .. } => {
                assert_eq!(line, 2);
                assert!(message.contains("duplicate key \"a\""), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn broken_json_reports_line_and_column() {
        let err = parse_relaxed("{\n\"a\": 1\n\"b\": 2}", "f").unwrap_err();
        match err {
            ConfigError::Syntax { line, .. } => assert_eq!(line, 3),
            other => panic!("{other:?}"),
        }
        // A file cut after a newline: the position is the start of the last line, not column 0.
        let (line, column, _) = syntax_error("{\n\"a\": 1,\n");
        assert_eq!((line, column), (3, 1));
    }

    #[test]
    fn placeholder_strings() {
        assert!(looks_like_placeholder("${x}"));
        assert!(looks_like_placeholder("{{ x }}"));
        assert!(looks_like_placeholder("$BS"));
        assert!(!looks_like_placeholder("WARN"));
        assert!(!looks_like_placeholder("INF"));
        assert!(!looks_like_placeholder("CONFIG_MBSIZE"));
        assert!(!looks_like_placeholder("auto"));
        assert!(!looks_like_placeholder("cpu"));
    }

    fn syntax_error(text: &str) -> (usize, usize, String) {
        match parse_relaxed(text, "f.json") {
            Err(ConfigError::Syntax {
                line, column, message, ..
            }) => (line, column, message),
            other => panic!("{text:?}: expected a JSON error, got {other:?}"),
        }
    }

    #[test]
    fn words_outside_a_value_position_are_json_errors_not_placeholders() {
        // Trailing garbage after the JSON.
        let (line, column, message) = syntax_error("{\"a\": 1}\ngarbage\n");
        assert_eq!((line, column), (2, 1), "{message}");
        assert!(message.contains("trailing characters"), "{message}");
        // A text file that is not JSON at all: one error at its start, not a word count.
        let (line, column, _) = syntax_error("ZeRO is a Memory Optimizer\nfor Deep Learning TRAINING\n");
        assert_eq!((line, column), (1, 1));
        // A lower-case bare word where a value goes is a JSON error too.
        let (line, _, _) = syntax_error("{\n\"device\": cpu}");
        assert_eq!(line, 2);
        // A Python literal outside a value position is not singled out.
        let (line, column, _) = syntax_error("True");
        assert_eq!((line, column), (1, 1));
    }

    #[test]
    fn capitals_in_a_value_position_stay_placeholders() {
        for (text, name) in [
            ("[1, MB_SIZE]", "MB_SIZE"),
            ("{\"a\": [CL_1st_MAX]}", "CL_1st_MAX"),
            ("{\"a\": QuantW_FORWARD}", "QuantW_FORWARD"),
        ] {
            match parse_relaxed(text, "f.json") {
                Err(ConfigError::Placeholder { placeholder, .. }) => assert_eq!(placeholder, name, "{text}"),
                other => panic!("{text}: expected a placeholder error, got {other:?}"),
            }
        }
    }
}
