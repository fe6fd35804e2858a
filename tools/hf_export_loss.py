#!/usr/bin/env python3
"""The loss HuggingFace transformers computes for an exported GPT-2 or Llama-family directory.

  python3 tools/hf_export_loss.py OUT TOKENS.json

OUT is what `zero to-fp32 CHECKPOINT OUT` wrote for a checkpoint that records its model
(HuggingFace names and config.json by default): a `gpt2 train` checkpoint (GPT2LMHeadModel), or
one of the zoo's Llama family (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM, whichever config.json names). TOKENS.json is a JSON array of equal-length
token sequences, as `gpt2 score --tokens` reads. Prints `loss X` (labels = inputs, the mean over
the batch), the same line `gpt2 score --model OUT --tokens TOKENS.json` prints, so the two can be
compared; for the Llama family, models/tests/it/llama_export.rs prints the zoo's loss of the
directories it keeps (ZERO_LLAMA_EXPORT_DIR) on the tokens it writes there.

The model is loaded with AutoModelForCausalLM from OUT alone (nothing is downloaded). The script
fails if transformers reports a weight it did not find in the directory (other than a head tied
to the embedding and GPT-2's attention-mask buffer), a tensor it did not expect, or one of
another shape.

Needs torch, transformers and safetensors from PyPI.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, tokens = sys.argv[1], sys.argv[2]
    model, info = AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, local_files_only=True, dtype=torch.float32
    )
    tied = model.config.tie_word_embeddings
    missing = [
        k
        for k in info["missing_keys"]
        if not k.endswith("attn.masked_bias") and not (tied and k == "lm_head.weight")
    ]
    unexpected = list(info["unexpected_keys"])
    mismatched = list(info.get("mismatched_keys", []))
    if missing or unexpected or mismatched:
        sys.exit(f"{out}: missing {missing}, unexpected {unexpected}, mismatched {mismatched}")
    model.eval()
    with open(tokens) as f:
        ids = torch.tensor(json.load(f), dtype=torch.long)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    print(f"{type(model).__name__}: loss {loss.item():.6f}", file=sys.stderr)
    print(f"loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
