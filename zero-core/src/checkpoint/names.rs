//! Renaming parameters on export: the engine records module paths (`ends.wte.weight`,
//! `blocks.3.attn.c_attn.weight`), other tools want their own names (HuggingFace's
//! `transformer.h.3.attn.c_attn.weight`) and sometimes their own layouts (PyTorch's
//! `nn.Linear` stores `[out, in]` what Burn's `Linear` stores `[in, out]`).
//!
//! A [`NameMap`] is an ordered list of rules applied one after the other to each name; a name
//! that a rule drops is left out of the export. It also says which parameters the exported
//! model stores transposed ([`NameMap::transposed`]); [`NameMap::export`] gives both. For
//! anything the rules cannot say, every export function also takes a plain closure
//! (`Fn(&str) -> Option<String>`, or `Fn(&str) -> Option<ExportedTensor>` for
//! [`export_fp32`](super::export_fp32)), e.g. one built from a model zoo's own name table;
//! [`NameMap::apply`] and [`NameMap::export`] are such closures.

/// One renaming rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NameRule {
    /// Replace a leading `from` by `to` (names without the prefix are unchanged).
    Prefix {
        /// Prefix to replace.
        from: String,
        /// Replacement.
        to: String,
    },
    /// Replace a trailing `from` by `to`.
    Suffix {
        /// Suffix to replace.
        from: String,
        /// Replacement.
        to: String,
    },
    /// Leave out every name that starts with this prefix.
    Drop(String),
}

/// The namings [`NameMap::named`] knows: what `zero to-fp32 --names` accepts and what a
/// checkpoint's [`super::ModelRecord::naming`] may say.
pub const NAMINGS: [&str; 3] = [INTERNAL_NAMING, GPT2_HF_NAMING, LLAMA_HF_NAMING];
/// The engine's own module paths, unchanged.
pub const INTERNAL_NAMING: &str = "internal";
/// HuggingFace `GPT2LMHeadModel` keys ([`NameMap::gpt2_huggingface`]).
pub const GPT2_HF_NAMING: &str = "gpt2-hf";
/// HuggingFace keys and layouts of the Llama family's `LlamaForCausalLM`, `Qwen2ForCausalLM`,
/// `Qwen3ForCausalLM` and `MistralForCausalLM` ([`NameMap::llama_huggingface`]).
pub const LLAMA_HF_NAMING: &str = "llama-hf";

/// How an exported tensor's values are laid out, against the checkpoint's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorLayout {
    /// As the checkpoint stores them.
    AsStored,
    /// A 2-D tensor `[rows, cols]` written as its transpose `[cols, rows]` (a Burn `Linear`'s
    /// `[in, out]` weight as PyTorch's `nn.Linear` stores it, `[out, in]`).
    Transposed,
}

/// What an export makes of one parameter: its name there, and its layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedTensor {
    /// The exported name.
    pub name: String,
    /// How its values are laid out.
    pub layout: TensorLayout,
}

impl ExportedTensor {
    /// `name`, its values as stored: what a plain renaming closure's name becomes.
    pub fn as_stored(name: String) -> Self {
        ExportedTensor {
            name,
            layout: TensorLayout::AsStored,
        }
    }
}

/// Ordered renaming rules (empty: names unchanged), the tied copies a model's layouts may hold
/// under names of their own, and the parameters the exported model stores transposed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NameMap {
    /// The rules, applied in order.
    pub rules: Vec<NameRule>,
    /// `(copy, of)` prefixes: a parameter named `{copy}{rest}` is a tied copy of `{of}{rest}`
    /// (GPT-2's pipeline head holds `lm_head.weight`, a copy of `wte.weight`). An export
    /// leaves copies to the rules (usually dropped); [`NameMap::canonical`] names a copy as its
    /// original, so that checkpoints of different layouts of one model match.
    pub tied: Vec<(String, String)>,
    /// Suffixes of the engine's parameter names (before any rule) whose 2-D tensors the
    /// exported model stores transposed ([`TensorLayout::Transposed`]): the Llama family's
    /// `_proj.weight` and `lm_head.weight`, Burn `Linear` weights that PyTorch stores
    /// `[out, in]`. Matched on the engine's names, so that renaming rules added after a naming's
    /// own (`zero to-fp32 --rename`) leave the layouts as the naming says.
    pub transposed: Vec<String>,
}

impl NameMap {
    /// Parses a command-line rule: `PREFIX=NEW` (a prefix rename; `=NEW` adds a prefix,
    /// `PREFIX=` strips one), `*SUFFIX=NEW` (a suffix rename), or `!PREFIX` (drop).
    pub fn parse_rule(text: &str) -> Result<NameRule, String> {
        if let Some(prefix) = text.strip_prefix('!') {
            return Ok(NameRule::Drop(prefix.to_string()));
        }
        let (from, to) = text
            .split_once('=')
            .ok_or_else(|| format!("`{text}` is not a rename rule: write FROM=TO, *SUFFIX=TO or !PREFIX"))?;
        Ok(match from.strip_prefix('*') {
            Some(suffix) => NameRule::Suffix {
                from: suffix.to_string(),
                to: to.to_string(),
            },
            None => NameRule::Prefix {
                from: from.to_string(),
                to: to.to_string(),
            },
        })
    }

    /// The rules that turn the GPT-2 zoo's names into HuggingFace `GPT2LMHeadModel` keys:
    /// the chain's `ends.` and the sharded model's `embed.` → `transformer.`, the
    /// tensor-parallel model's `wte.` and `wpe.` → `transformer.wte.` and `transformer.wpe.`,
    /// `ln_f.` → `transformer.ln_f.`, `blocks.` → `transformer.h.`, LayerNorm `gamma`/`beta` →
    /// `weight`/`bias`. (The zoo's `Gpt2Config::param_shapes` lists the names this produces.)
    pub fn gpt2_huggingface() -> Self {
        NameMap {
            // A pipeline's head holds a copy of the tied `wte` under this name; HuggingFace
            // ties the head to `transformer.wte.weight` and stores no copy.
            tied: vec![("lm_head.".into(), "wte.".into())],
            rules: rules(&[
                "!lm_head.",
                "ends.=transformer.",
                "embed.=transformer.",
                "wte.=transformer.wte.",
                "wpe.=transformer.wpe.",
                "ln_f.=transformer.ln_f.",
                "blocks.=transformer.h.",
                "*.gamma=.weight",
                "*.beta=.bias",
            ]),
            // HuggingFace's GPT-2 stores its projections as `Conv1D`, `[in, out]` as Burn does.
            transposed: Vec::new(),
        }
    }

    /// The rules that turn the Llama family zoo's names (those of `Llama` and of
    /// `ShardedLlama`, whose `ZeroModule`s leave no trace in a name) into HuggingFace's
    /// `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `MistralForCausalLM` keys:
    /// `embed_tokens.`, `layers.` and the final `norm.` → under `model.`, RMSNorm `gamma` →
    /// `weight`, `lm_head.weight` as it is (a tied model has none). Every linear weight (the
    /// attention's and the MLP's `*_proj.weight`, an untied `lm_head.weight`) is transposed:
    /// Burn's `[in, out]` is PyTorch's `[out, in]`; the embedding, the norms and the biases are
    /// not. (The zoo's `LlamaConfig::param_shapes` lists the names and shapes this produces.)
    pub fn llama_huggingface() -> Self {
        NameMap {
            rules: rules(&[
                "embed_tokens.=model.embed_tokens.",
                "layers.=model.layers.",
                "norm.=model.norm.",
                "*.gamma=.weight",
            ]),
            tied: Vec::new(),
            transposed: vec!["_proj.weight".into(), "lm_head.weight".into()],
        }
    }

    /// The rules of a naming of [`NAMINGS`], by its name; an error naming the known ones
    /// otherwise.
    pub fn named(naming: &str) -> Result<Self, String> {
        match naming {
            INTERNAL_NAMING => Ok(NameMap::default()),
            GPT2_HF_NAMING => Ok(NameMap::gpt2_huggingface()),
            LLAMA_HF_NAMING => Ok(NameMap::llama_huggingface()),
            other => Err(format!("unknown naming `{other}` (known: {})", NAMINGS.join(", "))),
        }
    }

    /// The name `name` has in the exported model, a tied copy named as its original: equal
    /// for the same parameter in any layout of the model (`embed.wte.weight` of the sharded
    /// GPT-2, `wte.weight` and its copy `lm_head.weight` of the pipelined one). `None` when the
    /// rules drop it.
    pub fn canonical(&self, name: &str) -> Option<String> {
        let original = self
            .tied
            .iter()
            .find_map(|(copy, of)| name.strip_prefix(copy.as_str()).map(|rest| format!("{of}{rest}")));
        self.apply(original.as_deref().unwrap_or(name))
    }

    /// The layout the exported model stores parameter `name` (the engine's name) in.
    pub fn layout(&self, name: &str) -> TensorLayout {
        if self.transposed.iter().any(|suffix| name.ends_with(suffix.as_str())) {
            TensorLayout::Transposed
        } else {
            TensorLayout::AsStored
        }
    }

    /// What an export makes of parameter `name`: its new name and its layout, or `None` when a
    /// rule drops it.
    pub fn export(&self, name: &str) -> Option<ExportedTensor> {
        Some(ExportedTensor {
            name: self.apply(name)?,
            layout: self.layout(name),
        })
    }

    /// The new name of `name`, or `None` when a rule drops it.
    pub fn apply(&self, name: &str) -> Option<String> {
        let mut name = name.to_string();
        for rule in &self.rules {
            match rule.rewrite(&name) {
                Some(Some(new)) => name = new,
                Some(None) => return None,
                None => {}
            }
        }
        Some(name)
    }

    /// The rules (by index) that no name of `names` meets on its way through the rules before
    /// them: rules that change nothing (a misspelt prefix, usually).
    pub fn unused_rules<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Vec<usize> {
        let mut used = vec![false; self.rules.len()];
        for name in names {
            let mut name = name.to_string();
            for (i, rule) in self.rules.iter().enumerate() {
                if let Some(new) = rule.rewrite(&name) {
                    used[i] = true;
                    match new {
                        Some(new) => name = new,
                        None => break,
                    }
                }
            }
        }
        (0..used.len()).filter(|&i| !used[i]).collect()
    }
}

/// A naming's own rules, written as [`NameMap::parse_rule`] reads them.
fn rules(texts: &[&str]) -> Vec<NameRule> {
    texts
        .iter()
        .map(|text| NameMap::parse_rule(text).unwrap_or(NameRule::Drop(String::new())))
        .collect()
}

impl NameRule {
    /// What the rule makes of `name`: `None` when it does not apply to it, `Some(None)` when it
    /// drops it, `Some(Some(new))` when it renames it.
    pub fn rewrite(&self, name: &str) -> Option<Option<String>> {
        match self {
            NameRule::Prefix { from, to } => name.strip_prefix(from.as_str()).map(|rest| Some(format!("{to}{rest}"))),
            NameRule::Suffix { from, to } => name.strip_suffix(from.as_str()).map(|rest| Some(format!("{rest}{to}"))),
            NameRule::Drop(prefix) => name.starts_with(prefix.as_str()).then_some(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_rules_give_huggingface_keys() {
        // Reference: the key names of HuggingFace's GPT2LMHeadModel state dict.
        let m = NameMap::gpt2_huggingface();
        assert_eq!(m.apply("ends.wte.weight").as_deref(), Some("transformer.wte.weight"));
        assert_eq!(
            m.apply("blocks.3.attn.c_attn.weight").as_deref(),
            Some("transformer.h.3.attn.c_attn.weight")
        );
        assert_eq!(
            m.apply("blocks.0.ln_1.gamma").as_deref(),
            Some("transformer.h.0.ln_1.weight")
        );
        assert_eq!(m.apply("ends.ln_f.beta").as_deref(), Some("transformer.ln_f.bias"));
        // ShardedGpt2's names.
        assert_eq!(m.apply("embed.wpe.weight").as_deref(), Some("transformer.wpe.weight"));
        assert_eq!(m.apply("ln_f.gamma").as_deref(), Some("transformer.ln_f.weight"));
        // A pipeline head's copy of the tied embedding: left out of an export, named as the
        // embedding when layouts are matched.
        assert_eq!(m.apply("lm_head.weight"), None);
        assert_eq!(m.canonical("lm_head.weight").as_deref(), Some("transformer.wte.weight"));
        assert_eq!(
            m.canonical("embed.wte.weight").as_deref(),
            Some("transformer.wte.weight")
        );
    }

    #[test]
    fn namings_by_name() {
        assert_eq!(NameMap::named("gpt2-hf"), Ok(NameMap::gpt2_huggingface()));
        assert_eq!(NameMap::named("internal"), Ok(NameMap::default()));
        assert_eq!(NameMap::named("llama-hf"), Ok(NameMap::llama_huggingface()));
        let e = NameMap::named("bert-hf").unwrap_err();
        assert!(
            e.contains("bert-hf") && e.contains("internal, gpt2-hf, llama-hf"),
            "{e}"
        );
        for naming in NAMINGS {
            assert!(NameMap::named(naming).is_ok(), "{naming}");
        }
    }

    #[test]
    fn llama_rules_give_huggingface_keys_and_layouts() {
        // Reference: the key names of transformers' LlamaForCausalLM / Qwen3ForCausalLM state
        // dicts, and which of them are nn.Linear weights ([out, in]).
        let m = NameMap::llama_huggingface();
        let export = |name: &str| m.export(name).map(|t| (t.name, t.layout));
        let t = TensorLayout::Transposed;
        let s = TensorLayout::AsStored;
        let cases = [
            ("embed_tokens.weight", "model.embed_tokens.weight", s),
            (
                "layers.0.input_layernorm.gamma",
                "model.layers.0.input_layernorm.weight",
                s,
            ),
            (
                "layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.q_proj.weight",
                t,
            ),
            (
                "layers.0.self_attn.q_proj.bias",
                "model.layers.0.self_attn.q_proj.bias",
                s,
            ),
            (
                "layers.1.self_attn.k_norm.gamma",
                "model.layers.1.self_attn.k_norm.weight",
                s,
            ),
            (
                "layers.1.self_attn.o_proj.weight",
                "model.layers.1.self_attn.o_proj.weight",
                t,
            ),
            (
                "layers.1.post_attention_layernorm.gamma",
                "model.layers.1.post_attention_layernorm.weight",
                s,
            ),
            (
                "layers.1.mlp.down_proj.weight",
                "model.layers.1.mlp.down_proj.weight",
                t,
            ),
            ("layers.1.mlp.gate_proj.bias", "model.layers.1.mlp.gate_proj.bias", s),
            ("norm.gamma", "model.norm.weight", s),
            ("lm_head.weight", "lm_head.weight", t),
        ];
        for (from, to, layout) in cases {
            assert_eq!(export(from), Some((to.to_string(), layout)), "{from}");
        }
        // The layouts follow the engine's names, whatever rules come after the naming's.
        let mut renamed = m.clone();
        renamed.rules.push(NameMap::parse_rule("model.=").unwrap());
        assert_eq!(
            renamed.export("layers.0.mlp.up_proj.weight"),
            Some(ExportedTensor {
                name: "layers.0.mlp.up_proj.weight".into(),
                layout: t
            })
        );
        assert!(NameMap::gpt2_huggingface().transposed.is_empty());
    }

    #[test]
    fn rules_apply_in_order_and_drop() {
        let m = NameMap {
            rules: ["model.=", "!head.", "*.w=.weight"]
                .iter()
                .map(|r| NameMap::parse_rule(r).unwrap())
                .collect(),
            ..NameMap::default()
        };
        assert_eq!(m.apply("model.body.w").as_deref(), Some("body.weight"));
        assert_eq!(m.apply("model.head.w"), None);
        assert_eq!(m.apply("other.w2").as_deref(), Some("other.w2"));
        assert!(NameMap::parse_rule("nonsense").is_err());
    }
}
