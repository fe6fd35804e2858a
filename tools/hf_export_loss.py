#!/usr/bin/env python3
"""The loss HuggingFace transformers computes for an exported GPT-2 directory.

  python3 tools/hf_export_loss.py OUT TOKENS.json

OUT is what `zero to-fp32 CHECKPOINT OUT` wrote for a `gpt2 train` checkpoint (HuggingFace names
and config.json by default); TOKENS.json a JSON array of equal-length token sequences, as
`gpt2 score --tokens` reads. Prints `loss X` (labels = inputs, the mean over the batch), the same
line `gpt2 score --model OUT --tokens TOKENS.json` prints, so the two can be compared. transformers
reports every weight it did not find in the directory; the script fails if there is any.

Needs torch, transformers and safetensors from PyPI; nothing is downloaded.
"""

import json
import sys

import torch
from transformers import GPT2LMHeadModel


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, tokens = sys.argv[1], sys.argv[2]
    model, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.endswith("attn.masked_bias") and k != "lm_head.weight"]
    if missing or info["unexpected_keys"]:
        sys.exit(f"{out}: missing {missing}, unexpected {info['unexpected_keys']}")
    model.eval()
    with open(tokens) as f:
        ids = torch.tensor(json.load(f), dtype=torch.long)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    print(f"loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
