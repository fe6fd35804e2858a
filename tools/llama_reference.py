#!/usr/bin/env python3
"""Reference fixtures for zero-models' Llama family, computed with HuggingFace transformers on the CPU.

Builds four small random models itself (no download), one per family, each with the options its
family adds, and writes under models/tests/fixtures/:

  llama-micro/      LlamaForCausalLM: rope_scaling of type "llama3" (its three frequency bands all
                    present at head_dim 12), attention_bias and mlp_bias, untied LM head.
  qwen2-micro/      Qwen2ForCausalLM: q/k/v biases, tied embeddings; saved with a small
                    max_shard_size, so model.safetensors.index.json lists several shards.
  qwen3-micro/      Qwen3ForCausalLM: per-head q/k RMSNorm, an explicit head_dim (32, not
                    hidden / heads = 12), tied embeddings.
  mistral-micro/    MistralForCausalLM: sliding_window 32 (longer than the batch), untied head.

Each is 2 layers, hidden 48, 4 query heads over 2 key/value heads, MLP 96, vocabulary 192, saved
with save_pretrained (config.json + safetensors, float32), plus reference.safetensors holding
one batch run through the model in float32 (eager attention, eval mode):

  input_ids [2, 16] (I64), labels [2, 16] (I64, a few set to -100),
  logits [2, 16, 192], loss [1],
  hidden.1 [2, 16, 48]: the output of layer 0,
  grad.<name> for every parameter (HF name; a tied head is model.embed_tokens.weight) of
  loss.backward().

Weights are drawn with initializer_range 0.2 (activations of order one, so that the comparison
tells the options apart) and every 1-D parameter (norms, biases) is perturbed, so that a
parameter loaded into the wrong place shows.

Regenerate (needs torch, transformers and safetensors from PyPI; no download of weights;
written with torch 2.15 and transformers 5.24):

  python3 tools/llama_reference.py            # from the repository root

Check that a directory written by zero-models loads in transformers and computes the fixture's
logits (the HF-out direction):

  python3 tools/llama_reference.py --check DIR FIXTURE    # e.g. a save of llama-micro

The output is deterministic for a given torch version (fixed seeds); the Rust tests
(models/tests/it/llama_parity.rs) compare with a relative error max|a - b| / max|b| below 1e-5.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "models", "tests", "fixtures")

SIZES = dict(
    vocab_size=192,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)


def families():
    yield "llama-micro", LlamaForCausalLM, LlamaConfig(
        **{**SIZES, "max_position_embeddings": 128},
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ), None
    yield "qwen2-micro", Qwen2ForCausalLM, Qwen2Config(
        **SIZES,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ), "24KB"
    yield "qwen3-micro", Qwen3ForCausalLM, Qwen3Config(
        **SIZES,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ), None
    yield "mistral-micro", MistralForCausalLM, MistralConfig(
        **SIZES,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=32,
        tie_word_embeddings=False,
    ), None


def batch(vocab_size):
    generator = torch.Generator().manual_seed(99)
    input_ids = torch.randint(0, vocab_size, (2, 16), generator=generator)
    labels = input_ids.clone()
    labels[0, 3] = -100
    labels[1, 10:13] = -100
    return input_ids, labels


def build(name, cls, config, seed):
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float()
    model.eval()  # no dropout: the Rust model applies none
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def write(name, cls, config, max_shard_size, seed):
    out = os.path.join(FIXTURES, name)
    model = build(name, cls, config, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    if max_shard_size and not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        sys.exit(f"{name}: expected a sharded checkpoint: lower max_shard_size")

    input_ids, labels = batch(config.vocab_size)
    model.zero_grad()
    result = model(input_ids, labels=labels, output_hidden_states=True)
    result.loss.backward()
    tensors = {
        "input_ids": input_ids.to(torch.int64),
        "labels": labels.to(torch.int64),
        "logits": result.logits.detach().float().contiguous(),
        "loss": result.loss.detach().reshape(1).float(),
        "hidden.1": result.hidden_states[1].detach().contiguous(),
    }
    for param_name, p in model.named_parameters():
        tensors["grad." + param_name] = p.grad.detach().contiguous()
    save_file(tensors, os.path.join(out, "reference.safetensors"))

    # The saved directory computes the same logits when transformers loads it back.
    again = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    with torch.no_grad():
        reloaded = again(input_ids).logits
    assert torch.equal(reloaded, result.logits.detach()), f"{name}: reload differs"
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, loss {result.loss.item():.6f}")


def check(directory, fixture):
    """Loads `directory` with transformers and compares its logits with `fixture`'s reference."""
    reference = load_file(os.path.join(FIXTURES, fixture, "reference.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()
    with torch.no_grad():
        result = model(reference["input_ids"], labels=reference["labels"])
    want = reference["logits"]
    error = ((result.logits - want).abs().max() / want.abs().max()).item()
    loss_error = abs(result.loss.item() - reference["loss"].item()) / abs(reference["loss"].item())
    print(f"{directory} ({model_type}, {type(model).__name__}): logits error {error:.3e}, loss error {loss_error:.3e}")
    if error > 1e-5 or loss_error > 1e-5:
        sys.exit("the directory does not compute the fixture's logits")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        check(sys.argv[2], sys.argv[3])
        sys.exit(0)
    for seed, (name, cls, config, max_shard_size) in enumerate(families()):
        write(name, cls, config, max_shard_size, seed=2024 + seed)
    print("fixtures written to", FIXTURES)
