#!/usr/bin/env python3
"""Reference for `gpt2 train`: five AdamW steps of the tiny HuggingFace GPT-2 fixture, in PyTorch.

Reads models/tests/fixtures/gpt2-tiny (written by tools/gpt2_reference.py), makes a fixed batch of
token sequences, and trains GPT2LMHeadModel with torch.optim.AdamW on the whole batch at every
step (labels = input_ids, HuggingFace's shifted mean cross-entropy), recording the loss of each
step before its update. Writes examples/tests/fixtures/:

  train_tokens.json       the global batch: 8 sequences of 16 token ids
  train_config.json       the DeepSpeed config the Rust test trains with (stage 3, micro 1, gas 2)
  train_reference.json    {"losses": [...], "grad_norms": [...]} per step

Regenerate (torch and transformers from PyPI, CPU):

  python3 tools/gpt2_train_reference.py      # from the repository root
"""

import json
import os

import torch
from transformers import GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "tests", "fixtures", "gpt2-tiny")
OUT = os.path.join(ROOT, "examples", "tests", "fixtures")

STEPS = 5
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
CLIP = 1.0


def main():
    torch.manual_seed(1234)
    model = GPT2LMHeadModel.from_pretrained(MODEL, torch_dtype=torch.float32)
    model.train()
    # No dropout: the Burn model has none; make the PyTorch side deterministic too.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(7))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())

    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "train_tokens.json"), "w") as f:
        json.dump(tokens.tolist(), f)
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": CLIP,
        "steps_per_print": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
    }
    with open(os.path.join(OUT, "train_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(OUT, "train_reference.json"), "w") as f:
        json.dump({"losses": losses, "grad_norms": norms}, f, indent=2)
    print("losses", losses)


if __name__ == "__main__":
    main()
