//! `to_fp32` and `zero to-fp32`: the consolidated file holds every parameter whole, bit-equal to
//! the reference function it was saved from, under the (renamed) names, in one file or in
//! shards with a HuggingFace-style index. Files are read back with the `safetensors` crate.

mod checkpoint_support;

use checkpoint_support::*;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use zero_core::checkpoint::{to_fp32, Checkpoint, NameMap};

/// Every tensor of the safetensors files in `dir`, by name, as f32.
fn read_all(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).expect("a valid safetensors file");
            for (name, view) in st.tensors() {
                let values = view
                    .data()
                    .chunks(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                assert!(
                    out.insert(name.clone(), (view.shape().to_vec(), values)).is_none(),
                    "{name} twice"
                );
            }
        }
    }
    out
}

#[test]
fn consolidates_every_parameter_whole_from_any_world_size() {
    for (world, stage) in [(1, 0), (3, 2), (4, 3)] {
        let dir = scratch(&format!("fp32-{world}-{stage}"));
        save_reference(&dir, "t", world, stage, 4, "");
        let out = dir.join("out");
        let c = Checkpoint::open(&dir, None).unwrap();
        let report = to_fp32(&c, &out, None, &|n| Some(n.to_string())).expect("to_fp32");
        assert_eq!(report.files.len(), 1);
        let got = read_all(&out);
        let l = layout(specs(""), world, stage);
        assert_eq!(got.len(), l.params.len());
        for (p, spec) in l.params.iter().enumerate() {
            let (shape, values) = &got[&spec.name];
            assert_eq!(shape, &spec.shape, "{}", spec.name);
            assert_eq!(
                values,
                &full(&l, p, 4),
                "{} from world {world} stage {stage}",
                spec.name
            );
        }
        assert_eq!(report.largest_tensor_bytes, 400);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn sharded_output_with_index_and_renamed_keys() {
    let dir = scratch("fp32-sharded");
    save_reference(&dir, "t", 2, 1, 1, "model.");
    let out = dir.join("out");
    let names = NameMap {
        rules: ["model.=encoder.", "!encoder.layer2.", "*.weight=.w"]
            .iter()
            .map(|r| NameMap::parse_rule(r).unwrap())
            .collect(),
        ..NameMap::default()
    };
    let c = Checkpoint::open(&dir, None).unwrap();
    let report = to_fp32(&c, &out, Some(500), &|n| names.apply(n)).expect("to_fp32");
    assert!(
        report.files.len() >= 3,
        "500-byte shards must split the 652 bytes of weights: {:?}",
        report.files
    );
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let got = read_all(&out);
    assert_eq!(map.len(), 5, "six parameters, one dropped");
    assert_eq!(got.len(), 5);
    assert!(!got.contains_key("encoder.layer2.w"));
    let l = layout(specs("model."), 2, 1);
    for p in [0, 1, 3, 4, 5] {
        let name = format!("encoder.layer{p}.w");
        assert_eq!(got[&name].1, full(&l, p, 1), "{name}");
        let file = map[&name].as_str().unwrap();
        let bytes = std::fs::read(out.join(file)).unwrap();
        assert!(
            SafeTensors::deserialize(&bytes).unwrap().tensor(&name).is_ok(),
            "the index must name {name}'s file"
        );
    }
    let total: u64 = [0, 1, 3, 4, 5].iter().map(|&p| l.params[p].numel() as u64 * 4).sum();
    assert_eq!(index["metadata"]["total_size"], total);

    // Exported again into the same directory in the other layout, and back: what the earlier
    // export left (a single file loaders would take first, or an index and its shards) goes,
    // and no temporary file stays.
    let single = to_fp32(&c, &out, None, &|n| names.apply(n)).expect("single file");
    assert_eq!(single.files, [out.join("model.safetensors")]);
    let left: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["model.safetensors"], "the index and its shards are gone");
    to_fp32(&c, &out, Some(500), &|n| names.apply(n)).expect("sharded again");
    assert!(!out.join("model.safetensors").exists(), "the single file is gone");
    assert_eq!(read_all(&out).len(), 5);
    // Sharded again into another count of files: the earlier shards, named `-of-` the earlier
    // count, go; what is left is the new index and the files it names.
    let finer = to_fp32(&c, &out, Some(150), &|n| names.apply(n)).expect("finer shards");
    let mut left: Vec<PathBuf> = std::fs::read_dir(&out).unwrap().flatten().map(|e| e.path()).collect();
    left.sort();
    let mut expected = finer.files.clone();
    expected.push(out.join("model.safetensors.index.json"));
    expected.sort();
    assert_eq!(left, expected);
    assert_eq!(read_all(&out).len(), 5);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn command_line_converts_and_reports_damage() {
    let dir = scratch("fp32-cli");
    save_reference(&dir, "t", 2, 3, 3, "ends.");
    let out = dir.join("hf");
    let status = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args([
            "to-fp32",
            dir.to_str().unwrap(),
            out.to_str().unwrap(),
            "--names",
            "gpt2-hf",
            "--verify",
        ])
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let got = read_all(&out);
    assert!(got.contains_key("transformer.layer0.weight"), "{:?}", got.keys());
    // Into the checkpoint's own directory, beside `latest` and the tags (HuggingFace's
    // Trainer's layout): written, and the checkpoint still opens and verifies.
    let beside = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["to-fp32", dir.to_str().unwrap(), dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(beside.status.success(), "{}", String::from_utf8_lossy(&beside.stderr));
    assert!(dir.join("model.safetensors").is_file());
    Checkpoint::open(&dir, None).unwrap().verify().unwrap();

    let shard = dir.join("t/rank_00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let failed = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args([
            "to-fp32",
            dir.to_str().unwrap(),
            dir.join("again").to_str().unwrap(),
            "--tag",
            "t",
        ])
        .output()
        .unwrap();
    assert_eq!(failed.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(
        stderr.contains("rank_00001.safetensors") && stderr.contains("checksum"),
        "{stderr}"
    );

    // An output in a tag's directory (or below one, by any path) is refused before anything
    // is written; a new directory beside the tags is not (`hf` above), nor the checkpoint's
    // own directory (where HuggingFace's Trainer keeps the weights), below.
    for (out, says) in [
        (dir.join("t"), "inside a tag directory"),
        (dir.join("hf/../t/new"), "inside a tag directory"),
    ] {
        let refused = Command::new(env!("CARGO_BIN_EXE_zero"))
            .args(["to-fp32", dir.to_str().unwrap(), out.to_str().unwrap()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
        assert!(!dir.join("t/new").exists() && !dir.join("t/model.safetensors").exists());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Every file under `dir`, by path relative to it, with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path.clone());
            }
            let bytes = if path.is_file() {
                std::fs::read(&path).unwrap()
            } else {
                Vec::new()
            };
            out.push((path.strip_prefix(dir).unwrap().to_path_buf(), bytes));
        }
    }
    out.sort();
    out
}

/// A conversion that fails half way (a shard damaged in the bytes of the second tensor, read
/// after the first output file is whole) leaves nothing it created: a new output's directories
/// are gone, parents included, and an output that held an earlier export (and a file of the
/// user's) holds exactly what it held, with no staged file left. It used to leave an empty or
/// partial directory, and the first files of the new export over the earlier one's.
#[test]
fn a_failed_conversion_leaves_nothing_it_created() {
    let dir = scratch("fp32-failed");
    // Two 4 MiB tensors, one rank: the shard's values span several checksum chunks, so the
    // second tensor's damage is met only once the first file is written.
    let params = ["first", "second"]
        .map(|name| zero_core::partition::ParamSpec {
            name: format!("{name}.weight"),
            shape: vec![1024, 1024],
        })
        .to_vec();
    save_specs(&dir, "t", 1, 0, 1, params.clone());
    // The earlier export is of another step: other bytes in every file.
    let other = dir.join("other");
    save_specs(&other, "t", 1, 0, 2, params);
    let convert_from = |from: &Path, out: &Path, extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_zero"))
            .args(["to-fp32", from.to_str().unwrap(), out.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let convert = |out: &Path, extra: &[&str]| convert_from(&dir, out, extra);
    let earlier = dir.join("earlier");
    let ok = convert_from(&other, &earlier, &["--max-shard-size", "4MiB"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    std::fs::write(earlier.join("NOTES.md"), "the user's own file").unwrap();
    let before = snapshot(&earlier);
    assert_eq!(before.len(), 4, "two shards, the index and the notes: {before:?}");

    // The second tensor's master values, damaged where the checksum of their chunk sees it.
    let shard = dir.join("t/rank_00000.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let second = &header[zero_core::checkpoint::format::master_tensor(1)]["data_offsets"];
    let at = 8 + header_len + second[0].as_u64().unwrap() as usize + 1000;
    bytes[at] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();

    let fresh = dir.join("new/deeper/out");
    for (out, extra) in [
        (&earlier, &["--max-shard-size", "4MiB"][..]),
        (&earlier, &[][..]),
        (&fresh, &[][..]),
        (&fresh, &["--max-shard-size", "4MiB"][..]),
    ] {
        let failed = convert(out, extra);
        let stderr = String::from_utf8_lossy(&failed.stderr);
        assert_eq!(failed.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("rank_00000.safetensors") && stderr.contains("checksum"),
            "{stderr}"
        );
        assert!(
            !dir.join("new").exists(),
            "{} {extra:?}: a new output leaves nothing",
            out.display()
        );
        assert!(
            snapshot(&earlier) == before,
            "{} {extra:?}: the earlier export changed: {:?}",
            out.display(),
            snapshot(&earlier).iter().map(|(p, _)| p).collect::<Vec<_>>()
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Writes a large checkpoint for the memory measurement in BENCHMARKS.md:
/// `ZERO_CKPT_BENCH_DIR=/tmp/big ZERO_CKPT_BENCH_MB=400 cargo test -p zero-core --release
/// --test checkpoint_to_fp32 -- --ignored generate_large_checkpoint`, then
/// `/usr/bin/time -v zero to-fp32 /tmp/big /tmp/big-out`.
#[test]
#[ignore = "generates a checkpoint of ZERO_CKPT_BENCH_MB megabytes of weights for a measurement"]
fn generate_large_checkpoint() {
    let dir = std::path::PathBuf::from(std::env::var("ZERO_CKPT_BENCH_DIR").expect("ZERO_CKPT_BENCH_DIR"));
    let mb: usize = std::env::var("ZERO_CKPT_BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    // Transformer-like: a few 1024-wide matrices of 4 MiB each, and biases.
    let mut params = Vec::new();
    for i in 0..mb / 4 {
        params.push(zero_core::partition::ParamSpec {
            name: format!("blocks.{i}.weight"),
            shape: vec![1024, 1024],
        });
        params.push(zero_core::partition::ParamSpec {
            name: format!("blocks.{i}.bias"),
            shape: vec![1024],
        });
    }
    std::fs::create_dir_all(&dir).unwrap();
    save_specs(&dir, "bench", 4, 3, 1, params);
}

/// Times a resharding load of the checkpoint [`generate_large_checkpoint`] wrote (saved by 4
/// ranks at stage 3) at 3 ranks, stage 2 buckets, and checks a few values against the reference.
#[test]
#[ignore = "reads the checkpoint generate_large_checkpoint wrote, for a measurement"]
fn load_large_checkpoint_at_another_world_size() {
    let dir = std::path::PathBuf::from(std::env::var("ZERO_CKPT_BENCH_DIR").expect("ZERO_CKPT_BENCH_DIR"));
    let c = Checkpoint::open(&dir, None).expect("open");
    let params = c.meta.layout.params.clone();
    let bytes: u64 = std::fs::read_dir(dir.join(&c.meta.tag))
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum();
    let start = std::time::Instant::now();
    let firsts = on_ranks(3, move |rank, comm| {
        let l = layout(params.clone(), 3, 2);
        let (_, groups) = zero_core::checkpoint::load(comm.as_ref(), &dir, None, &l).expect("load");
        // Reference: element 0 of the first segment of group 0.
        let s = &l.segments(0, rank)[0];
        (groups[0].master[s.local.start], value(s.param, s.in_param.start, 1, 0))
    });
    let secs = start.elapsed().as_secs_f64();
    for (got, want) in firsts {
        assert_eq!(got, want);
    }
    println!(
        "loaded {:.1} MB of shards at world 3 in {secs:.2} s ({:.0} MB/s)",
        bytes as f64 / 1e6,
        bytes as f64 / 1e6 / secs
    );
}

/// A checkpoint that records its model exports under that model's names with its config.json
/// beside, without being told; `--names internal` exports the engine's names and no config.
#[test]
fn a_recorded_model_exports_under_its_names_with_its_config() {
    use zero_core::checkpoint::ModelRecord;
    let dir = scratch("fp32-recorded");
    let config = serde_json::json!({ "model_type": "gpt2", "n_embd": 8, "n_layer": 6 });
    let record = ModelRecord {
        naming: "gpt2-hf".into(),
        config: config.clone(),
    };
    save_model(&dir, "t", 2, 3, 3, specs("ends."), Some(record));
    let convert = |out: &Path, extra: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_zero"))
            .args(["to-fp32", dir.to_str().unwrap(), out.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    let l = layout(specs("ends."), 2, 3);

    let hf = dir.join("hf");
    let summary = convert(&hf, &[]);
    assert!(
        summary.contains("config.json"),
        "the summary lists the config: {summary}"
    );
    let got = read_all(&hf);
    for (p, spec) in l.params.iter().enumerate() {
        let name = spec.name.replace("ends.", "transformer.");
        assert_eq!(got[&name].1, full(&l, p, 3), "{name}");
    }
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(written, config);

    let internal = dir.join("internal");
    convert(&internal, &["--names", "internal"]);
    let got = read_all(&internal);
    assert!(got.contains_key("ends.layer0.weight"), "{:?}", got.keys());
    assert!(
        !internal.join("config.json").exists(),
        "no config for the engine's own names"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The engine's names of a small Llama-family model as the zoo's `Llama` and `ShardedLlama`
/// name them, in Burn's layouts (a `Linear` weight `[in, out]`), untied: vocabulary 11, hidden 6,
/// one layer, q/k/v/o projections of 8, 4, 4 and 6 outputs, an MLP of 5.
fn llama_specs() -> Vec<zero_core::partition::ParamSpec> {
    let p = |name: &str, shape: Vec<usize>| zero_core::partition::ParamSpec {
        name: name.to_string(),
        shape,
    };
    vec![
        p("embed_tokens.weight", vec![11, 6]),
        p("layers.0.input_layernorm.gamma", vec![6]),
        p("layers.0.self_attn.q_proj.weight", vec![6, 8]),
        p("layers.0.self_attn.q_proj.bias", vec![8]),
        p("layers.0.self_attn.k_proj.weight", vec![6, 4]),
        p("layers.0.self_attn.v_proj.weight", vec![6, 4]),
        p("layers.0.self_attn.o_proj.weight", vec![8, 6]),
        p("layers.0.post_attention_layernorm.gamma", vec![6]),
        p("layers.0.mlp.gate_proj.weight", vec![6, 5]),
        p("layers.0.mlp.up_proj.weight", vec![6, 5]),
        p("layers.0.mlp.down_proj.weight", vec![5, 6]),
        p("norm.gamma", vec![6]),
        p("lm_head.weight", vec![6, 11]),
    ]
}

/// A checkpoint that records the `llama-hf` naming exports with `zero to-fp32` as a
/// HuggingFace Llama directory: transformers' names (`model.` before the body, `gamma` as
/// `weight`), every linear weight transposed to PyTorch's `[out, in]` (the embedding, norms and
/// biases as stored), its config.json beside; into shards too, and under further --rename rules,
/// which leave the layouts as the naming says. Reference: the synthetic masters the checkpoint
/// was saved from ([`full`]), and transformers' names of `LlamaForCausalLM`'s state dict.
#[test]
fn a_recorded_llama_exports_with_huggingface_names_transposed_linears_and_its_config() {
    use zero_core::checkpoint::ModelRecord;
    let dir = scratch("fp32-llama");
    let config = serde_json::json!({ "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 6 });
    let record = ModelRecord {
        naming: "llama-hf".into(),
        config: config.clone(),
    };
    // Stage 3 on 3 ranks: the matrices are cut over the ranks, so each transposed tensor is put
    // together from several shard files first.
    save_model(&dir, "t", 3, 3, 2, llama_specs(), Some(record));
    let convert = |out: &Path, extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_zero"))
            .args(["to-fp32", dir.to_str().unwrap(), out.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let l = layout(llama_specs(), 3, 3);
    let hf_name = |engine: &str| {
        let name = engine.replace(".gamma", ".weight");
        if name.starts_with("lm_head.") {
            name
        } else {
            format!("model.{name}")
        }
    };
    let check = |got: &HashMap<String, (Vec<usize>, Vec<f32>)>, name: &dyn Fn(&str) -> String| {
        assert_eq!(got.len(), l.params.len(), "{:?}", got.keys());
        for (p, spec) in l.params.iter().enumerate() {
            let stored = full(&l, p, 2);
            let (shape, values) = &got[&name(&spec.name)];
            let linear = spec.name.ends_with("_proj.weight") || spec.name == "lm_head.weight";
            if linear {
                let [rows, cols] = [spec.shape[0], spec.shape[1]];
                assert_eq!(shape, &vec![cols, rows], "{}: [out, in]", spec.name);
                for r in 0..rows {
                    for c in 0..cols {
                        assert_eq!(
                            values[c * rows + r],
                            stored[r * cols + c],
                            "{} at ({r}, {c})",
                            spec.name
                        );
                    }
                }
            } else {
                assert_eq!(shape, &spec.shape, "{}", spec.name);
                assert_eq!(values, &stored, "{}", spec.name);
            }
        }
    };

    let hf = dir.join("hf");
    let run = convert(&hf, &[]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stdout).contains("config.json"));
    let got = read_all(&hf);
    assert!(
        got.contains_key("model.layers.0.self_attn.q_proj.weight"),
        "{:?}",
        got.keys()
    );
    assert!(got.contains_key("model.norm.weight") && got.contains_key("lm_head.weight"));
    check(&got, &hf_name);
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(written, config);

    // Shards, and a rename after the naming's own rules: the same tensors, transposed alike.
    let renamed = dir.join("renamed");
    let run = convert(&renamed, &["--max-shard-size", "300", "--rename", "model.="]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(renamed.join("model.safetensors.index.json").is_file());
    check(&read_all(&renamed), &|engine: &str| {
        hf_name(engine).trim_start_matches("model.").to_string()
    });

    // The engine's own names are the layouts as stored.
    let internal = dir.join("internal");
    let run = convert(&internal, &["--names", "internal"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let got = read_all(&internal);
    assert_eq!(got["lm_head.weight"].0, vec![6, 11]);
    assert!(!internal.join("config.json").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// `--names` lists `llama-hf` among the namings it knows; the naming on a checkpoint of another
/// model, whose parameter it would transpose is not a matrix, is refused naming the parameter
/// and its shape, and writes nothing.
#[test]
fn the_llama_naming_is_listed_and_refuses_what_it_cannot_transpose() {
    let dir = scratch("fp32-llama-refused");
    let mut specs = llama_specs();
    specs[2].shape = vec![48];
    save_specs(&dir, "t", 2, 1, 1, specs);
    let convert = |names: &str| {
        Command::new(env!("CARGO_BIN_EXE_zero"))
            .args([
                "to-fp32",
                dir.to_str().unwrap(),
                dir.join("out").to_str().unwrap(),
                "--names",
                names,
            ])
            .output()
            .unwrap()
    };
    let unknown = convert("bert-hf");
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(!unknown.status.success());
    assert!(err.contains("internal, gpt2-hf, llama-hf"), "{err}");
    let refused = convert("llama-hf");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        err.contains("layers.0.self_attn.q_proj.weight") && err.contains("[48]") && err.contains("2-D"),
        "{err}"
    );
    assert!(!dir.join("out").exists(), "nothing written");
    std::fs::remove_dir_all(&dir).ok();
}

/// A checkpoint written before checkpoints recorded their model (a committed fixture: 2 ranks,
/// stage 3, step 4, saved by `save_reference` with no prefix) still verifies, and exports whole
/// under the engine's names with no config.
#[test]
fn a_checkpoint_from_before_model_records_loads_and_exports_as_before() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint_before_model_record");
    let c = Checkpoint::open(&fixture, None).expect("the old checkpoint opens");
    c.verify().expect("and verifies");
    assert!(c.meta.model.is_none());
    let out = scratch("fp32-before-record");
    let status = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["to-fp32", fixture.to_str().unwrap(), out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let got = read_all(&out);
    let l = layout(specs(""), 2, 3);
    assert_eq!(got.len(), l.params.len());
    for (p, spec) in l.params.iter().enumerate() {
        assert_eq!(got[&spec.name].1, full(&l, p, 4), "{}", spec.name);
    }
    assert!(!out.join("config.json").exists());
    std::fs::remove_dir_all(&out).ok();
}

/// The one size parser every tool's size flag goes through. Reference: the units' definitions
/// (powers of 1000 and 1024) and what a u64 holds.
#[test]
fn sizes_are_read_with_units_exponents_and_bounds() {
    use zero_core::checkpoint::parse_size;
    assert_eq!(parse_size("1000000"), Ok(1_000_000));
    assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
    assert_eq!(parse_size("5gb"), Ok(5_000_000_000));
    assert_eq!(parse_size("2GiB"), Ok(2 << 30));
    assert_eq!(parse_size("1TiB"), Ok(1 << 40));
    assert_eq!(parse_size("120e9"), Ok(120_000_000_000));
    assert_eq!(parse_size("1_000 MB"), Ok(1_000_000_000));
    assert_eq!(parse_size("1PB"), Ok(1_000_000_000_000_000));
    assert_eq!(parse_size("2PiB"), Ok(2 << 50));
    assert_eq!(parse_size("15EiB"), Ok(15 << 60));
    assert_eq!(parse_size("3e2KB"), Ok(300_000));
    assert!(parse_size("1e30").unwrap_err().contains("16 EiB"));
    // u64::MAX itself reads as a float at 2^64: said as the bound, not as "more than 2^64".
    let e = parse_size("18446744073709551615").unwrap_err();
    assert!(e.contains("1.8e19 bytes (about 16 EiB) or more"), "{e}");
    assert!(parse_size("16EiB").unwrap_err().contains("16 EiB"));
    assert!(parse_size("64 parsecs").unwrap_err().contains("unknown unit `parsecs`"));
    assert!(parse_size("5 GBs").unwrap_err().contains("unknown unit `GBs`"));
    assert!(parse_size("0").unwrap_err().contains("positive size"));
    assert!(parse_size("-5GB").unwrap_err().contains("positive size"));
}
