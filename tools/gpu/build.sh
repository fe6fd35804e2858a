#!/usr/bin/env bash
# Builds what the GPU checks run, with the `cuda` feature, and stages it in .gpu/ (ignored by
# git) for the GPU machine, which has no Rust toolchain: the throughput bench, the GPT-2 trainer,
# `zero`, and the NCCL test (the other tests run on the CPU backend and read fixtures by
# build-time paths).
#
#   bash tools/gpu/build.sh        # here; then run tools/gpu/run.sh there, carrying .gpu
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu
cargo build --release --features cuda -p zero-benches --bin throughput
cp target/release/throughput .gpu/
cargo build --release --features cuda -p zero-examples --bin gpt2
cp target/release/gpt2 .gpu/
cargo build --release -p zero-core --bin zero
cp target/release/zero .gpu/
# Test executables, found from cargo's JSON messages.
cargo test --release --features cuda -p zero-core --test comm_nccl -p zero-burn --test device_nccl --no-run \
  --message-format=json \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"] + "-" + m["target"]["kind"][0]
        shutil.copy(m["executable"], ".gpu/test-" + name)
        print("staged", name)
'
strip .gpu/* 2>/dev/null || true
du -sh .gpu
