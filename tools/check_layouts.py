#!/usr/bin/env python3
"""Trains the tiny GPT-2 under every layout and setting that should not change the arithmetic,
and checks that each run's losses agree with the first run of its precision.

What is varied: ZeRO stage 0-3; data × pipeline × tensor ranks (2 × 1 × 1, 4 × 1 × 1,
2 × 1 × 2, 2 × 2 × 1, 1 × 2 × 2; a pipeline refuses stage 3); optimizer state offloaded to the
host or to NVMe; parameters offloaded at stage 3; activation checkpointing; the optimizers
(AdamW, Adam, Lamb, Lion, SGD); fp32, bf16 and fp16. Every run takes the same global batch of
16 rows for 5 steps at a constant learning rate, so the reference of each run is the first run
of its precision and optimizer; fp32 runs must agree to 1e-5 relative, 16-bit ones to 1e-3
(their sums round in other orders). A run that fails, or disagrees, is printed and the script
exits 1.

    cargo build -p zero-examples --bin gpt2
    python3 tools/check_layouts.py [--only fp32|bf16|fp16|optimizers] [--bin target/debug/gpt2]

About 8 minutes per group on two cores (debug build). It found two faults no test had: NVMe
swap files shared by pipeline stages and tensor ranks, and a tensor-parallel loss summed in bf16.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = [(2, 1, 1), (4, 1, 1), (2, 1, 2), (2, 2, 1), (1, 2, 2)]
OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "adam": {"type": "Adam", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "lamb": {"type": "Lamb", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "lion": {"type": "Lion", "params": {"lr": 0.0003, "weight_decay": 0.01}},
    "sgd": {"type": "SGD", "params": {"lr": 0.03, "momentum": 0.9}},
}


def config(work, stage, layout, optimizer="adamw", precision="fp32", offload_optimizer=None,
           offload_param=None, checkpointing=False):
    data, stages, tensor = layout
    zero = {"stage": stage}
    nvme = str(work / "nvme")
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer, "nvme_path": nvme}
    if offload_param:
        zero["offload_param"] = {"device": offload_param, "nvme_path": nvme}
    c = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4 // data,
        "gradient_clipping": 1.0,
        "optimizer": OPTIMIZERS[optimizer],
        "zero_optimization": zero,
        "pipeline": {"stages": stages},
        "tensor_parallel": {"autotp_size": tensor},
    }
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    if precision == "fp16":
        c["fp16"] = {"enabled": True, "initial_scale_power": 12}
    if checkpointing:
        c["activation_checkpointing"] = {"number_checkpoints": 1}
    return c


def cases(only):
    """(name, reference key, nproc, config arguments) of every run of the chosen groups."""
    out = []
    for precision in ["fp32", "bf16", "fp16"]:
        if only not in (None, precision):
            continue
        for layout in LAYOUTS:
            stages = [0, 1, 2, 3] if layout[1] == 1 else [0, 1, 2]
            for stage in stages:
                offloads = [(None, None)]
                if stage > 0:
                    offloads += [("cpu", None), ("nvme", None)]
                if stage == 3:
                    offloads += [(None, "cpu"), ("nvme", "nvme")]
                for oo, op in offloads:
                    for ckpt in [False, True] if (oo, op) == (None, None) else [False]:
                        name = f"{precision} {layout} stage {stage} offload {oo}/{op} checkpointing {ckpt}"
                        out.append((name, precision, layout, dict(stage=stage, precision=precision,
                                    offload_optimizer=oo, offload_param=op, checkpointing=ckpt)))
    if only in (None, "optimizers"):
        for opt in OPTIMIZERS:
            for layout in LAYOUTS:
                for stage in [1, 3] if layout[1] == 1 else [1]:
                    out.append((f"{opt} {layout} stage {stage}", opt, layout, dict(stage=stage, optimizer=opt)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["fp32", "bf16", "fp16", "optimizers"])
    ap.add_argument("--bin", default=str(ROOT / "target/debug/gpt2"))
    args = ap.parse_args()
    failures = 0
    references = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i, (name, key, layout, kw) in enumerate(cases(args.only)):
            path = work / f"{i}.json"
            metrics = work / f"{i}.jsonl"
            path.write_text(json.dumps(config(work, layout=layout, **kw)))
            nproc = layout[0] * layout[1] * layout[2]
            run = subprocess.run(
                [args.bin, "train", "--config", str(path), "--preset", "tiny", "--nproc", str(nproc),
                 "--steps", "5", "--seq-len", "32", "--quiet", "--metrics", str(metrics)],
                capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{name}: FAILED: {run.stderr.strip()[-300:]}", flush=True)
                failures += 1
                continue
            losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()[1:]]
            want = references.setdefault(key, (name, losses))
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want[1]))
            limit = 1e-5 if kw.get("precision", "fp32") == "fp32" else 1e-3
            verdict = "ok" if worst <= limit else f"DIFFERS from {want[0]}"
            failures += verdict != "ok"
            print(f"{name}: {[round(x, 4) for x in losses]} (relative {worst:.1e}) {verdict}", flush=True)
    print(f"{failures} failed or differing")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
