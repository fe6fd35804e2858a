#!/usr/bin/env bash
# Builds what the GPU checks run, with the `cuda` feature, for the GPU machine, which has no
# Rust toolchain: the throughput bench, the GPT-2 trainer, `zero`, and the CUDA/NCCL tests (the
# other tests run on the CPU backend and read fixtures by build-time paths). They travel as one
# xz archive, .gpu/bin.tar.xz (.gpu/ is ignored by git): stripped, the binaries take about 80 MB,
# more than the 64 MiB a device call carries; tools/gpu/run.sh unpacks them there.
#
#   bash tools/gpu/build.sh        # here; then run tools/gpu/run.sh there, carrying .gpu
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/bin
# The CUDA API the bindings are generated for. Without nvcc here cudarc would take its newest
# (13.4); the GPU machines run driver 580, which is CUDA 13.0, and a binding newer than the
# driver can name a function the driver lacks.
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
cargo build --release --features cuda -p zero-benches --bin throughput
cp target/release/throughput .gpu/bin/
cargo build --release --features cuda -p zero-benches --bin cpu_adam
cp target/release/cpu_adam .gpu/bin/
cargo build --release --features cuda -p zero-examples --bin gpt2
cp target/release/gpt2 .gpu/bin/
cargo build --release -p zero-core --bin zero
cp target/release/zero .gpu/bin/
# Test executables, found from cargo's JSON messages.
cargo test --release --features cuda -p zero-core --test comm_nccl -p zero-burn --test optimizer_device_nccl --no-run \
  --message-format=json \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"] + "-" + m["target"]["kind"][0]
        shutil.copy(m["executable"], ".gpu/bin/test-" + name)
        print("staged", name)
'
# Debug info goes; the symbols stay, so that a backtrace there names the functions (run.sh's
# diagnosis of a failed launch reads one).
strip --strip-debug .gpu/bin/*
tar -C .gpu/bin -cf - . | xz -9 -T0 > .gpu/bin.tar.xz
rm -rf .gpu/bin
size=$(stat -c %s .gpu/bin.tar.xz)
echo ".gpu/bin.tar.xz: $((size / 1048576)) MiB"
# What a device call carries: this archive and the working tree, 64 MiB together.
if ((size > 48 * 1048576)); then
  echo "the archive is over 48 MiB: with the working tree it may not fit a device call's 64 MiB" >&2
  exit 1
fi
