#!/usr/bin/env bash
# The GPU checks, on the GPU machine, from the binaries tools/gpu/build.sh staged in .gpu/.
#
#   bash tools/gpu/run.sh [PHASE ...]        # default: every phase, in this order
#
# Phases, most important first, each step under its own time limit, and the whole run under
# BUDGET seconds (default 420), so that one call leaves device time to rerun what failed:
#   env         the GPU, the libraries the binaries load (libcuda, libnvrtc, libnccl), CUDA_PATH,
#               and a warning where NVRTC is newer than the driver's CUDA
#   tests       the CUDA/NCCL tests; under ZERO_REQUIRE_CUDA=1 a missing GPU or NCCL fails them
#   train       gpt2 train on Autodiff<Cuda>: a tiny smoke run, then GPT-2 124M in bf16 at
#               stages 0 and 3, stage 3 with --collectives nccl (one rank), whose losses must be
#               the host path's (to bf16's rounding), stages 1 and 2, stage 3 in fp16, and
#               stage 3 with 2 ranks as threads on the one GPU
#   throughput  tokens/s and MFU of GPT-2 124M (stages 0-3, batch 8; stages 0 and 3 once more
#               without Burn's fusion, against the fused stage 0), bf16, world size 1, beside
#               PyTorch + transformers measured in the same run
#   large       the same for GPT-2 1.5B (stages 0 and 3, batch LARGE_BATCH, default 2:
#               PyTorch's eager attention runs out of an 80 GB GPU's memory at 4)
#   offload     ZeRO-Offload at stage 3 (optimizer and 16-bit shards in host memory), GPT-2 124M
#               (sequential, then its update delayed), the host's Adam over 1-16 threads, then 1.5B
#   finetune    the user's path at 124M: gpt2 init, train --model --save, zero to-fp32, score
# A failed test binary, tiny smoke run or unfused throughput row runs once more under
# `diagnose` (below), its log in $OUT/diagnose-NAME.log.
# Each step prints "== STEP: ok|FAILED rc N|TIMED OUT|SKIPPED (budget) (S s)"; the summary at the
# end lists them all. Everything goes to stdout and, when $OUT is set, to $OUT/gpu.log, the
# summary to $OUT/summary.txt.
#
# A dry run of the plumbing on a machine without a GPU (after tools/gpu/build.sh):
#   BACKEND=cpu SMALL=tiny LARGE=tiny SEQ=64 bash tools/gpu/run.sh train throughput finetune
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/zero-gpu}"
mkdir -p "$out"
exec > >(tee "$out/gpu.log") 2>&1
backend=${BACKEND:-cuda}
small=${SMALL:-gpt2}
large=${LARGE:-gpt2-xl}
large_batch=${LARGE_BATCH:-2}
seq=${SEQ:-1024}
steps=${STEPS:-10}
budget=${BUDGET:-420}
phases=${*:-env tests train throughput large offload finetune}
start=$SECONDS
summary=()
# The binaries travel packed (tools/gpu/build.sh); unpacked into .gpu/ on first use.
if [ -f .gpu/bin.tar.xz ] && [ ! -x .gpu/gpt2 ]; then
  python3 -c '
import tarfile
with tarfile.open(".gpu/bin.tar.xz") as t:
    t.extractall(".gpu", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' || exit 1
fi

# step NAME LIMIT_S COMMAND...: runs COMMAND under LIMIT_S seconds, unless less is left of the
# budget; records the outcome. Its status is the command's, or 200 when skipped; last_rc keeps
# it for `failed` below.
last_rc=0
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  local left=$((budget - (SECONDS - start)))
  if ((left < 10)); then
    summary+=("$name: SKIPPED (budget)")
    echo "== $name: SKIPPED (budget)"
    last_rc=200
    return 200
  fi
  ((limit > left)) && limit=$left
  echo "-- $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$@"
  rc=$?
  local took=$((SECONDS - t0)) outcome
  case $rc in
    0) outcome=ok ;;
    124 | 137) outcome="TIMED OUT" ;;
    *) outcome="FAILED rc $rc" ;;
  esac
  summary+=("$name: $outcome (${took} s)")
  echo "== $name: $outcome (${took} s)"
  last_rc=$rc
  return $rc
}

# Whether the last step failed outright: not skipped and not cut off by its time limit, whose
# rerun under `diagnose` (slower still) would only be cut off again.
failed() {
  case $last_rc in
    0 | 124 | 137 | 200) return 1 ;;
    *) return 0 ;;
  esac
}

has() { [[ " $phases " == *" $1 "* ]]; }

# The libraries, wherever this machine keeps them. cudarc tries a fixed list of names
# (libnccl.so, libnvrtc.so, lib*.so.<CUDA major>, ...), none fully versioned; NVIDIA's wheels
# ship libnccl.so.2 and libnvrtc.so.<major>, a toolkit may hold only libnvrtc.so.13.0.NN. So
# libnccl.so and libnvrtc.so are links in a directory of our own on LD_LIBRARY_PATH, and the
# libraries' own directories follow it: NVRTC loads libnvrtc-builtins from beside itself.
libs=/tmp/zero-gpu-libs
mkdir -p "$libs"
# One search of the disk for what the ldconfig cache may not know: the libraries, CUDA's headers.
found=$(find / -xdev \( -name 'libnccl.so*' -o -name 'libnvrtc.so*' -o -name cuda_fp16.h \) 2>/dev/null)
# first NAME: the first library named NAME* that ldconfig, then the search, knows, resolved.
first() {
  local lib
  lib=$( (ldconfig -p 2>/dev/null | awk '{print $NF}'; printf '%s\n' "$found") |
    awk -F/ -v name="$1" 'index($NF, name) == 1 && $NF !~ /alt/' | head -1)
  [ -n "$lib" ] && readlink -f "$lib"
}
nccl=$(first libnccl.so)
nvrtc=$(first libnvrtc.so)
dirs=
for lib in "$nccl" "$nvrtc"; do
  [ -n "$lib" ] || continue
  base=$(basename "$lib")
  ln -sf "$lib" "$libs/${base%%.so*}.so"
  dirs="$dirs:$(dirname "$lib")"
done
export LD_LIBRARY_PATH="$libs$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cubecl compiles its kernels with NVRTC against CUDA's headers, found through CUDA_PATH (or
# /usr/local/cuda, /opt/cuda); without them it panics. Else from nvcc; else the headers beside
# NVRTC's lib/ (NVIDIA's wheels: .../site-packages/nvidia/cu13/{lib,include}), which match its
# version; else the directory above the first include/ that holds cuda_fp16.h.
if [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda ] && [ ! -d /opt/cuda ]; then
  beside=${nvrtc:+$(dirname "$(dirname "$nvrtc")")}
  if command -v nvcc > /dev/null; then
    CUDA_PATH=$(dirname "$(dirname "$(command -v nvcc)")")
  elif [ -n "$beside" ] && [ -f "$beside/include/cuda_fp16.h" ]; then
    CUDA_PATH=$beside
  elif header=$(grep -m1 '/include/cuda_fp16\.h$' <<< "$found"); then
    CUDA_PATH=$(dirname "$(dirname "$header")")
  fi
  [ -n "${CUDA_PATH:-}" ] && export CUDA_PATH
fi
# Kernels compiled once, for every process of the run: cubecl reads cubecl.toml from the
# working directory up, and keeps the PTX under target/. Written here for the run only.
if [ ! -e cubecl.toml ]; then
  printf '[compilation]\ncache = "target"\n' > cubecl.toml
  trap 'rm -f cubecl.toml' EXIT
fi

if has env; then
  echo "== env"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  echo "nccl: ${nccl:-NOT FOUND}"
  echo "nvrtc: ${nvrtc:-NOT FOUND}"
  # NVRTC emits PTX for its own CUDA version, which a driver of an older one refuses.
  driver_cuda=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}')
  if [ -n "$nvrtc" ] && command -v python3 > /dev/null; then
    nvrtc_version=$(python3 - "$nvrtc" <<'PY' 2>/dev/null
import ctypes, sys
major, minor = ctypes.c_int(), ctypes.c_int()
ctypes.CDLL(sys.argv[1]).nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
print(f"{major.value}.{minor.value}")
PY
    )
    echo "NVRTC ${nvrtc_version:-version unknown}, driver's CUDA ${driver_cuda:-unknown}"
    if [ -n "$nvrtc_version" ] && [ -n "$driver_cuda" ] &&
      [ "$(printf '%s\n' "$nvrtc_version" "$driver_cuda" | sort -V | tail -1)" != "$driver_cuda" ]; then
      echo "WARNING: NVRTC $nvrtc_version is newer than the driver's CUDA $driver_cuda: the driver may refuse its PTX"
    fi
  fi
  echo "CUDA_PATH: ${CUDA_PATH:-unset} (/usr/local/cuda: $(ls -d /usr/local/cuda/include 2>/dev/null || echo absent))"
  nvcc --version 2>/dev/null | tail -2
  nproc
  free -g | head -2
fi

# diagnose NAME COMMAND...: COMMAND again with every kernel launch synchronous and checked
# (cubecl's full profiling), so that a launch the driver refuses panics where it was made, and
# the backtrace names the call (build.sh keeps the symbols). The log, $out/diagnose-NAME.log,
# comes back whole.
diagnose() {
  local name=$1 log
  shift
  log="$out/diagnose-${name//[^A-Za-z0-9]/-}.log"
  # Only the command's output goes to the log; the step's own lines stay in gpu.log.
  step "diagnose $name" 120 bash -c 'log=$1; shift; "$@" > "$log" 2>&1' _ "$log" \
    env CUBECL_DEBUG_LOG=stderr CUBECL_DEBUG_OPTION=profile-full RUST_BACKTRACE=1 "$@"
  grep -v '^ *at /rustc/' "$log" | grep -m1 -B5 -A80 'panicked' || tail -40 "$log"
}

if has tests; then
  for t in .gpu/test-*; do
    step "test $(basename "$t")" 120 env ZERO_REQUIRE_CUDA=1 "$t" --test-threads 1 ||
      { failed && diagnose "$(basename "$t")" env ZERO_REQUIRE_CUDA=1 "$t" --test-threads 1; }
  done
fi

# A DeepSpeed config for `gpt2 train`: stage, dtype, micro-batch, accumulation.
cfgdir=$(mktemp -d)
config() {
  python3 - "$@" > "$cfgdir/s$1-$2-m$3-a$4.json" <<'PY'
import json, sys
stage, dtype, micro, accum = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print(json.dumps({
    "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
    "gradient_clipping": 1.0, "steps_per_print": 5,
    "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 5}},
    "zero_optimization": {"stage": stage, "overlap_comm": True},
    dtype: {"enabled": True},
}))
PY
  echo "$cfgdir/s$1-$2-m$3-a$4.json"
}
# train NAME LIMIT STAGE DTYPE MICRO ACCUM PRESET NPROC STEPS [COLLECTIVES]: the loss must fall
# (the trainer's summary line names the first and last loss; the check reads the metrics file).
train() {
  local name=$1 limit=$2 stage=$3 dtype=$4 micro=$5 accum=$6 preset=$7 nproc=$8 n=$9 coll=${10:-auto}
  local cfg metrics="$cfgdir/$name.jsonl"
  cfg=$(config "$stage" "$dtype" "$micro" "$accum")
  step "$name" "$limit" bash -c '
    "$@" && python3 - "'"$metrics"'" <<'"'PY'"'
import json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1]) if "\"loss\"" in l]
print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} records")
sys.exit(0 if losses[-1] < losses[0] else "the loss did not fall")
PY' _ .gpu/gpt2 train --backend "$backend" --config "$cfg" --preset "$preset" --nproc "$nproc" \
    --steps "$n" --seq-len $((seq < 256 ? seq : 256)) --quiet --metrics "$metrics" --collectives "$coll"
}

if has train; then
  if ! train "train tiny smoke s3 bf16" 90 3 bf16 4 1 tiny 1 5 && failed; then
    diagnose "tiny smoke" .gpu/gpt2 train --backend "$backend" --config "$(config 3 bf16 4 1)" --preset tiny \
      --nproc 1 --steps 1 --seq-len 64 --quiet
  fi
  # The first run at this size compiles what the others then find cached.
  train "train $small s0 bf16" 150 0 bf16 8 2 "$small" 1 "$steps"
  train "train $small s3 bf16" 90 3 bf16 8 2 "$small" 1 "$steps"
  # The trainer's NCCL path, at one rank (the one GPU): its losses must be the host path's, up
  # to bf16 rounding. The first step (same weights, same batch) differs only in the order of
  # fused reductions; later steps carry that on through the updates.
  if [ "$backend" = cuda ] && train "train $small s3 bf16 nccl" 90 3 bf16 8 2 "$small" 1 "$steps" nccl; then
    step "nccl losses = host losses" 10 python3 - "$cfgdir/train $small s3 bf16.jsonl" "$cfgdir/train $small s3 bf16 nccl.jsonl" <<'PY'
import json, os, sys
host, nccl = ([json.loads(l)["loss"] for l in open(p) if "\"loss\"" in l] if os.path.exists(p) else []
              for p in sys.argv[1:])
if len(host) < len(nccl):
    sys.exit(f"host run incomplete ({len(host)} of {len(nccl)} steps): nothing to compare the NCCL run with")
rel = [abs(a - b) / max(abs(a), 1e-6) for a, b in zip(host, nccl)]
print(f"{len(nccl)} steps, relative loss difference {rel[0]:.1e} at the first (limit 1e-3), "
      f"largest {max(rel):.1e} (limit 2e-3)")
ok = len(host) == len(nccl) and rel[0] <= 1e-3 and max(rel) <= 2e-3
sys.exit(0 if ok else "the NCCL run's losses are not the host run's")
PY
  fi
  for stage in 1 2; do
    train "train $small s$stage bf16" 90 "$stage" bf16 8 2 "$small" 1 "$steps"
  done
  train "train $small s3 fp16" 90 3 fp16 8 2 "$small" 1 "$steps"
  train "train $small s3 bf16 2 ranks" 120 3 bf16 8 1 "$small" 2 "$steps"
fi

if has throughput || has large; then
  # The tokens/s column of a model's row in the PyTorch table: the Rust bench's named baseline.
  tps() { awk -F'|' -v m="$2" '$2 ~ " "m" " {gsub(/ /, "", $5); print $5}' "$1"; }
  bench() { # model batch stages
    local base=() torch="$cfgdir/torch-$1.md"
    if python3 -c 'import torch, transformers' 2> /dev/null; then
      # Into a file, then shown: a pipe would run `step` in a subshell and lose its summary line.
      step "pytorch $1" 120 python3 tools/gpu/torch_gpt2_throughput.py --models "$1" --batch "$2" --seq "$seq" \
        --steps "$steps" --device "$([ "$backend" = cuda ] && echo cuda || echo cpu)" > "$torch"
      cat "$torch"
      [ -n "$(tps "$torch" "$1")" ] && base=(--baseline "pytorch=$(tps "$torch" "$1")")
    else
      echo "(no torch + transformers here: no PyTorch baseline)"
    fi
    local ours="$cfgdir/ours-$1.md"
    step "throughput $1" 240 .gpu/throughput --backend "$backend" --models "$1" --dtype bf16 --batch "$2" \
      --seq "$seq" --steps "$steps" --stages "$3" "${base[@]}" > "$ours"
    cat "$ours"
  }
fi
if has throughput; then
  bench "$small" 8 0,1,2,3
  # What Burn's fusion brings: the same model on the unfused CubeBackend, against the fused
  # stage 0 just measured.
  if [ "$backend" = cuda ]; then
    fused=$(awk -F'|' -v m="$small" '$2 ~ " "m" " && $4 ~ / 0 / {gsub(/ /, "", $7); print $7}' "$cfgdir/ours-$small.md")
    step "throughput $small unfused" 120 .gpu/throughput --backend cuda-unfused --models "$small" --dtype bf16 \
      --batch 8 --seq "$seq" --steps "$steps" --stages 0,3 ${fused:+--baseline "fused-stage-0=$fused"} ||
      { failed && diagnose "unfused" .gpu/throughput --backend cuda-unfused --models "$small" --dtype bf16 \
        --batch 1 --seq 128 --steps 1 --stages 0; }
  fi
fi
if has large; then
  bench "$large" "$large_batch" 0,3
fi

if has offload; then
  step "offload $small" 120 .gpu/throughput --backend "$backend" --models "$small" --dtype bf16 \
    --batch 8 --seq 512 --steps 3 --stages 3 --offload-optimizer cpu --offload-param cpu
  # The same with the host's update delayed a step (beside the next forward and backward), and
  # the host's Adam kernel alone over 1 to 16 threads (the kernel the engine picks is printed).
  step "offload $small delayed" 120 .gpu/throughput --backend "$backend" --models "$small" --dtype bf16 \
    --batch 8 --seq 512 --steps 3 --stages 3 --offload-optimizer cpu --offload-param cpu --delayed-update
  step "cpu adam threads" 90 .gpu/cpu_adam --params 50000000 --steps 5 --threads 1,2,4,8,16 --no-torch
  .gpu/zero estimate --preset "$large" --stage 3 --offload-optimizer cpu --offload-param cpu --dtype bf16 | sed -n '1,6p'
  # At 1.5B on an H200: ready in 61 s, the first warm-up step 73 s, the second 18 s; with two
  # timed steps like it, about 61 + 73 + 3 × 18 ≈ 190 s.
  step "offload $large" 260 /usr/bin/time -v .gpu/throughput --backend "$backend" --models "$large" --dtype bf16 \
    --batch 1 --seq 512 --steps 2 --stages 3 --offload-optimizer cpu --offload-param cpu
fi

if has finetune; then
  # The trainer as a user runs it, with the shipped offload config (optimizer and parameters
  # on the CPU), from a directory `gpt2 init` wrote, to a checkpoint, its export and a score.
  ft=$(mktemp -d)
  # With wall_clock_breakdown: one line of forward / backward / step milliseconds at the end.
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["wall_clock_breakdown"] = True; json.dump(c, open(sys.argv[2], "w"))' \
    examples/configs/gpt2-10b-zero3-offload.json "$ft/config.json"
  step "finetune init" 60 .gpu/gpt2 init --preset "$small" --out "$ft/init" &&
    step "finetune train" 120 .gpu/gpt2 train --backend "$backend" --quiet --model "$ft/init" --config "$ft/config.json" \
      --nproc 1 --steps 4 --seq-len $((seq < 256 ? seq : 256)) --metrics "$out/finetune.jsonl" --save "$ft/ckpt" &&
    step "finetune to-fp32" 60 .gpu/zero to-fp32 "$ft/ckpt" "$ft/export" &&
    step "finetune score" 60 .gpu/gpt2 score --model "$ft/export" --tokens examples/tests/fixtures/train_tokens.json
fi

echo
echo "== summary ($((SECONDS - start)) s of a ${budget} s budget)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
