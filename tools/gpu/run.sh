#!/usr/bin/env bash
# The GPU checks, on the GPU machine, from the binaries tools/gpu/build.sh staged in .gpu/:
# the CUDA/NCCL tests, then GPT-2 124M and 1.5B tokens/s and MFU for each ZeRO stage at world
# size 1 beside PyTorch + transformers on the same GPU, then ZeRO-Offload up the GPT-2 ladder, then
# the fine-tune path (init, train --model, to-fp32, score) at the deepest size the machine holds.
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
echo "== training on Autodiff<Cuda>: every ZeRO stage, bf16 and fp16, GPT-2 124M on the shipped corpus"
# The loss must fall in every cell; 2 ranks as threads on the one GPU (threads backend) at the end.
cfgdir=$(mktemp -d)
for dtype in bf16 fp16; do
  for stage in 0 1 2 3; do
    python3 - "$stage" "$dtype" > "$cfgdir/s$stage-$dtype.json" <<'PY'
import json, sys
stage, dtype = int(sys.argv[1]), sys.argv[2]
print(json.dumps({
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 5}},
    "zero_optimization": {"stage": stage, "overlap_comm": True},
    dtype: {"enabled": True},
}))
PY
    echo "-- stage $stage, $dtype"
    .gpu/gpt2 train --backend cuda --config "$cfgdir/s$stage-$dtype.json" --preset gpt2 --nproc 1 \
      --steps 30 --seq-len 256 --quiet 2>&1 | tail -3
  done
done
echo "-- stage 3, bf16, 2 ranks as threads on one GPU"
sed 's/"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2/"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1/' \
  "$cfgdir/s3-bf16.json" > "$cfgdir/s3-bf16-2.json"
.gpu/gpt2 train --backend cuda --config "$cfgdir/s3-bf16-2.json" --preset gpt2 --nproc 2 --steps 30 --seq-len 256 \
  --quiet 2>&1 | tail -3
echo "== PyTorch + transformers: eager, bf16 autocast, fused AdamW (the baseline)"
python3 tools/gpu/torch_gpt2_throughput.py --models gpt2 --batch 8 --seq 1024 --steps "$steps" | tee /tmp/torch-small.md
python3 tools/gpu/torch_gpt2_throughput.py --models gpt2-xl --batch 4 --seq 1024 --steps "$steps" | tee /tmp/torch-xl.md
# The tokens/s column of the model's row, passed to the Rust bench as its named baseline.
tps() { awk -F'|' -v m="$2" '$2 ~ " "m" " {gsub(/ /, "", $5); print $5}' "$1"; }
echo "== zero-burn: GPT-2 124M and 1.5B, bf16, world size 1, beside PyTorch"
.gpu/throughput --backend cuda --models gpt2 --dtype bf16 --batch 8 --seq 1024 --steps "$steps" --stages 0,1,2,3 \
  --baseline "pytorch=$(tps /tmp/torch-small.md gpt2)"
.gpu/throughput --backend cuda --models gpt2-xl --dtype bf16 --batch 4 --seq 1024 --steps "$steps" --stages 0,1,2,3 \
  --baseline "pytorch=$(tps /tmp/torch-xl.md gpt2-xl)"
echo "== ZeRO-Offload (optimizer on the CPU), stage 3: the deepest GPT-2 (hidden 4096) the host allows"
# The estimate's model states must fit 90 % of the host's memory (the rest: the process, the
# activations' host side, the OS) and the GPU's memory less 16 GiB for activations. The 16-bit
# shards are kept in host memory too (offload_param cpu), each uploaded when its unit is gathered.
host=$(awk '/MemTotal/ {printf "%d", $2 * 1024 * 0.9}' /proc/meminfo)
gpu=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%d", ($1 - 16384) * 1048576}')
.gpu/zero estimate --stage 3 --offload-optimizer cpu --offload-param cpu --dtype bf16 --fit-host-memory "$host" \
  --fit-device-memory "$gpu" \
  | tee /tmp/fit.txt
largest=$(awk '/deepest fitting:/ {sub(":", "", $3); print $3}' /tmp/fit.txt)
for m in gpt2-xl "$largest"; do
  .gpu/zero estimate --preset "$m" --stage 3 --offload-optimizer cpu --offload-param cpu --dtype bf16 | sed -n '1p;5p' 
  /usr/bin/time -v .gpu/throughput --backend cuda --models "$m" --dtype bf16 --batch 1 --seq 512 --steps 2 --stages 3 \
    --offload-optimizer cpu --offload-param cpu 2>&1 | grep -E "^\||Maximum resident|error|Error"
done
echo "== the fine-tune path: gpt2 init, gpt2 train --model (ZeRO-3, optimizer and parameters on the CPU), to-fp32, score"
# The trainer as a user runs it, with examples/configs/gpt2-10b-zero3-offload.json, at the deepest
# size that fits this GPU and host (above). Peak host memory from time -v, peak device memory
# sampled by nvidia-smi every 200 ms. The checkpoint (about 14 bytes per parameter) and its export
# are written at gpt2-xl, which the disk holds beside the larger model's starting directory.
ft=/tmp/finetune && rm -rf "$ft" && mkdir -p "$ft"
cp examples/configs/gpt2-10b-zero3-offload.json "$ft/config.json"
finetune() { # model, steps, extra trainer args...
  local m=$1 steps=$2; shift 2
  .gpu/gpt2 init --preset "$m" --out "$ft/$m-init"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$ft/$m-gpu.txt" &
  local smi=$!
  /usr/bin/time -v .gpu/gpt2 train --backend cuda --quiet --model "$ft/$m-init" \
    --config "$ft/config.json" --nproc 1 --steps "$steps" --seq-len 1024 \
    --metrics "$ft/$m.jsonl" "$@" 2>&1 | grep -E "steps in|holds|of which|Maximum resident|rror"
  kill "$smi"
  echo "$m peak device memory: $(sort -n "$ft/$m-gpu.txt" | tail -1) MiB"
  if [ -n "${OUT:-}" ]; then cp "$ft/$m.jsonl" "$OUT/finetune-$m.jsonl"; fi
}
# The deepest size that fits with the optimizer state and the 16-bit shards on the host.
.gpu/zero estimate --stage 3 --offload-optimizer cpu --offload-param cpu --dtype bf16 --fit-host-memory "$host" \
  --fit-device-memory "$gpu" | tee /tmp/fit-ft.txt
deepest=$(awk '/deepest fitting:/ {sub(":", "", $3); print $3}' /tmp/fit-ft.txt)
finetune "$deepest" 4
rm -rf "$ft/$deepest-init"
finetune gpt2-xl 4 --save "$ft/ckpt"
.gpu/zero to-fp32 "$ft/ckpt" "$ft/export"
.gpu/gpt2 score --model "$ft/export" --tokens examples/tests/fixtures/train_tokens.json
