#!/usr/bin/env bash
# The GPU checks, on the GPU machine, from the binaries tools/gpu/build.sh staged in .gpu/:
# the CUDA/NCCL tests, then GPT-2 124M and 1.5B tokens/s and MFU for each ZeRO stage at world
# size 1 beside PyTorch + transformers on the same GPU, then ZeRO-Offload up the GPT-2 ladder.
# Everything goes to stdout and, when $OUT is set, to $OUT/gpu.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
log="${OUT:-/tmp}/gpu.log"
exec > >(tee "$log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# NCCL comes with PyTorch's wheels; cudarc loads it by name.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), "lib"))' 2>/dev/null || true)
[ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$nccl_dir:${LD_LIBRARY_PATH:-}"
echo "== tests (cuda feature)"
for t in .gpu/test-*; do
  echo "-- $t"
  "$t" --test-threads 1 2>&1 | tail -5
done
steps=${STEPS:-10}
echo "== PyTorch + transformers: eager, bf16 autocast, fused AdamW (the baseline)"
python3 tools/gpu/torch_gpt2_throughput.py --models gpt2 --batch 8 --seq 1024 --steps "$steps" | tee /tmp/torch-small.md
python3 tools/gpu/torch_gpt2_throughput.py --models gpt2-xl --batch 4 --seq 1024 --steps "$steps" | tee /tmp/torch-xl.md
# The tokens/s column of the model's row, passed to the Rust bench as its named baseline.
tps() { awk -F'|' -v m="$2" '$2 ~ " "m" " {gsub(/ /, "", $5); print $5}' "$1"; }
echo "== zero-burn: GPT-2 124M and 1.5B, bf16, world size 1, beside PyTorch"
.gpu/throughput --backend cuda --models gpt2 --dtype bf16 --batch 8 --seq 1024 --steps "$steps" --stages 0,1,2,3 \
  --baseline "pytorch=$(tps /tmp/torch-small.md gpt2)"
.gpu/throughput --backend cuda --models gpt2-xl --dtype bf16 --batch 4 --seq 1024 --steps "$steps" --stages 0,3 \
  --baseline "pytorch=$(tps /tmp/torch-xl.md gpt2-xl)"
echo "== ZeRO-Offload (optimizer on the CPU), stage 3, up the ladder"
for m in gpt2-xl gpt2-10b; do
  .gpu/zero estimate --preset "$m" --stage 3 --offload-optimizer cpu --dtype bf16
  .gpu/throughput --backend cuda --models "$m" --dtype bf16 --batch 1 --seq 512 --steps 2 --stages 3 --offload-optimizer cpu
done
