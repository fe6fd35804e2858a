//! Which saved parameter each of a model's parameters reads from, across layouts of one model
//! (pipelined or not, tied copies named apart): [`CheckpointMeta::param_sources`].

use super::error::CheckpointError;
use super::format::CheckpointMeta;
use crate::partition::ParamSpec;
use std::collections::{HashMap, HashSet};
use std::path::Path;

impl CheckpointMeta {
    /// For each of the model's `params`, the index of the saved parameter its values come from:
    /// the same list (the common case), or, for a checkpoint of another layout of the same model
    /// (pipelined, or not), the parameter of the same name, else of the same name in the model's
    /// naming ([`NameMap::canonical`](super::NameMap::canonical): `embed.wte.weight` and
    /// `wte.weight` are GPT-2's `transformer.wte.weight`, and a pipeline head's tied copy
    /// `lm_head.weight` is one too). Shapes must be equal; a saved parameter the model has no
    /// place for is an error, unless it is a tied copy of one it has. `path` names the file in
    /// errors.
    pub fn param_sources(&self, path: &Path, params: &[ParamSpec]) -> Result<Vec<usize>, CheckpointError> {
        let other = |detail: String| CheckpointError::OtherModel {
            path: path.to_path_buf(),
            detail,
        };
        let saved = &self.layout.params;
        let shape = |i: usize, j: usize| -> Result<usize, CheckpointError> {
            let (s, m) = (&saved[j], &params[i]);
            if s.shape != m.shape {
                return Err(other(format!(
                    "parameter `{}` has shape {:?} in the checkpoint but {:?} in the model",
                    m.name, s.shape, m.shape
                )));
            }
            Ok(j)
        };
        if saved.len() == params.len() && saved.iter().zip(params).all(|(s, m)| s.name == m.name) {
            return (0..params.len()).map(|i| shape(i, i)).collect();
        }
        let naming = self.model.as_ref().and_then(|m| super::NameMap::named(&m.naming).ok());
        let key = |name: &str| match &naming {
            Some(n) => n.canonical(name),
            None => Some(name.to_string()),
        };
        let mut by_name: HashMap<&str, usize> = HashMap::new();
        let mut by_key: HashMap<String, usize> = HashMap::new();
        for (j, s) in saved.iter().enumerate() {
            by_name.entry(s.name.as_str()).or_insert(j);
            if let Some(k) = key(&s.name) {
                by_key.entry(k).or_insert(j);
            }
        }
        let mut sources = Vec::with_capacity(params.len());
        let mut missing = Vec::new();
        for (i, m) in params.iter().enumerate() {
            let found = by_name
                .get(m.name.as_str())
                .copied()
                .or_else(|| key(&m.name).and_then(|k| by_key.get(&k).copied()));
            match found {
                Some(j) => sources.push(shape(i, j)?),
                None => missing.push(m.name.as_str()),
            }
        }
        // A saved parameter is used when it, or what it is a copy of, is.
        let used: HashSet<Option<String>> = sources.iter().map(|&j| key(&saved[j].name)).collect();
        let unused: Vec<&str> = saved
            .iter()
            .filter(|s| !used.contains(&key(&s.name)))
            .map(|s| s.name.as_str())
            .collect();
        if missing.is_empty() && unused.is_empty() {
            return Ok(sources);
        }
        let list = |names: &[&str]| {
            let shown: Vec<String> = names.iter().take(4).map(|n| format!("`{n}`")).collect();
            let more = names.len().saturating_sub(4);
            format!(
                "{}{}",
                shown.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )
        };
        let mut detail = format!(
            "{} parameters in the checkpoint, {} in the model",
            saved.len(),
            params.len()
        );
        if !missing.is_empty() {
            detail += &format!("; the model's {} are not in it", list(&missing));
        }
        if !unused.is_empty() {
            detail += &format!("; its {} are not in the model", list(&unused));
        }
        Err(other(detail))
    }
}
