#!/usr/bin/env python3
"""Reference fixtures for zero-models' GPT-2, computed with HuggingFace transformers on the CPU.

Writes, under models/tests/fixtures/:

  gpt2-tiny/config.json, gpt2-tiny/model.safetensors
      A random GPT2LMHeadModel (2 layers, hidden 64, 4 heads, vocab 512, n_positions 32), saved
      with save_pretrained(safe_serialization=True): keys "transformer.h.N...", tied head not
      stored.
  gpt2-tiny/reference.safetensors
      One batch run through that model in float32:
        input_ids [2, 16] (I64), labels [2, 16] (I64, a few set to -100),
        logits [2, 16, 512], loss [1] (labels with -100), loss_unmasked [1] (labels = input_ids),
        hidden.0, hidden.1 [2, 16, 64]: the inputs of blocks 0 and 1 (hidden.1 = block0(hidden.0)),
        grad.<name> for every parameter (HF name, "transformer." prefix) of loss.backward().
  gpt2-micro-sharded/
      A second random model with other options (n_inner 48, scale_attn_by_inverse_layer_idx,
      2 heads) saved with a small max_shard_size, so model.safetensors.index.json lists several
      shard files; plus reference.safetensors with input_ids and logits.

Regenerate (needs torch, transformers and safetensors from PyPI; no download of weights):

  python3 tools/gpt2_reference.py            # from the repository root

The output is deterministic for a given torch version (fixed seeds); the Rust tests compare with
a relative error max|a - b| / max|b| below 1e-5.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "models", "tests", "fixtures")


def build(config, seed):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.eval()  # no dropout: the Rust model applies none
    return model.float()


def tiny():
    out = os.path.join(FIXTURES, "gpt2-tiny")
    config = GPT2Config(
        vocab_size=512,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        # Weights ten times GPT-2's usual scale, so that activations are of order one and the
        # comparison tells the GELU variants, the attention scale etc. apart (at 0.02 they all
        # agree to 1e-5).
        initializer_range=0.2,
        bos_token_id=511,
        eos_token_id=511,
    )
    model = build(config, seed=1234)
    # Random init leaves LayerNorms at 1/0 and biases at 0: perturb them so the test also
    # checks they are loaded into the right place.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)

    generator = torch.Generator().manual_seed(99)
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
    labels = input_ids.clone()
    labels[0, 3] = -100
    labels[1, 10:13] = -100

    model.zero_grad()
    result = model(input_ids, labels=labels, output_hidden_states=True)
    result.loss.backward()
    with torch.no_grad():
        loss_unmasked = model(input_ids, labels=input_ids).loss

    tensors = {
        "input_ids": input_ids.to(torch.int64),
        "labels": labels.to(torch.int64),
        "logits": result.logits.detach().float().contiguous(),
        "loss": result.loss.detach().reshape(1).float(),
        "loss_unmasked": loss_unmasked.reshape(1).float(),
        "hidden.0": result.hidden_states[0].detach().contiguous(),
        "hidden.1": result.hidden_states[1].detach().contiguous(),
    }
    for name, p in model.named_parameters():
        # named_parameters lists the tied head once, as transformer.wte.weight: its gradient
        # holds both uses.
        tensors["grad." + name] = p.grad.detach().contiguous()
    save_file(tensors, os.path.join(out, "reference.safetensors"))


def micro_sharded():
    out = os.path.join(FIXTURES, "gpt2-micro-sharded")
    config = GPT2Config(
        vocab_size=96,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_inner=48,
        scale_attn_by_inverse_layer_idx=True,
        layer_norm_epsilon=1e-6,
        initializer_range=0.2,
        bos_token_id=95,
        eos_token_id=95,
    )
    model = build(config, seed=4321)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="8KB")
    index = os.path.join(out, "model.safetensors.index.json")
    if not os.path.exists(index):
        sys.exit("expected a sharded checkpoint: lower max_shard_size")
    with open(index) as f:
        shards = set(json.load(f)["weight_map"].values())
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, config.vocab_size, (3, 9), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits
    save_file(
        {"input_ids": input_ids.to(torch.int64), "logits": logits.float().contiguous()},
        os.path.join(out, "reference.safetensors"),
    )
    print(f"gpt2-micro-sharded: {len(shards)} shards")


if __name__ == "__main__":
    torch.set_num_threads(1)
    tiny()
    micro_sharded()
    print("fixtures written to", FIXTURES)
