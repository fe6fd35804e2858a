#!/usr/bin/env python3
"""torch.optim.AdamW(fused=True) on one flat fp32 tensor: the peer the CPU Adam benchmark
(benches/src/bin/cpu_adam.rs) measures beside its own kernel, in the same run.

    python3 tools/bench_torch_adamw.py --params 100000000 --threads 2 --steps 7

Prints one JSON line: {"threads": .., "params": .., "median_s": .., "all_s": [..]}.
"""

import argparse
import json
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = torch.nn.Parameter(torch.rand(args.params, dtype=torch.float32))
    p.grad = torch.rand(args.params, dtype=torch.float32) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
    print(json.dumps({"threads": args.threads, "params": args.params,
                      "median_s": statistics.median(times), "all_s": times,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
