#!/usr/bin/env python3
"""Reference trace of DeepSpeed's DynamicLossScaler (deepspeed.runtime.fp16.loss_scaler).

Feeds fixed overflow sequences to the scaler under several settings and records, after every
update, the scale and the remaining hysteresis (or the error DeepSpeed raises at the minimum
scale). Writes zero-core/tests/fixtures/loss_scaler/deepspeed_trace.json.

Regenerate (needs torch and deepspeed):
    python3 tools/loss_scaler_reference.py
"""

import json
import pathlib
import random

import deepspeed
from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler

OUT = pathlib.Path(__file__).resolve().parent.parent / "zero-core/tests/fixtures/loss_scaler/deepspeed_trace.json"

# The scaler logs through deepspeed.comm, which needs no process group for rank 0's view.
ds_loss_scaler.dist.get_rank = lambda: 0

CASES = [
    # name, DeepSpeed config keys, number of updates, probability of an overflow
    ("defaults_short_window", dict(initial_scale_power=16, loss_scale_window=4, hysteresis=2,
                                   consecutive_hysteresis=False, min_loss_scale=1.0), 80, 0.3),
    ("consecutive_hysteresis", dict(initial_scale_power=12, loss_scale_window=3, hysteresis=3,
                                    consecutive_hysteresis=True, min_loss_scale=1.0), 80, 0.4),
    ("no_hysteresis_hits_minimum", dict(initial_scale_power=5, loss_scale_window=5, hysteresis=1,
                                        consecutive_hysteresis=False, min_loss_scale=4.0), 60, 0.5),
    ("min_scale_clamps", dict(initial_scale_power=3, loss_scale_window=2, hysteresis=1,
                              consecutive_hysteresis=False, min_loss_scale=3.0), 40, 0.35),
]


def main():
    rng = random.Random(7)
    cases = []
    for name, cfg, n, p in CASES:
        scaler = ds_loss_scaler.DynamicLossScaler(
            init_scale=2 ** cfg["initial_scale_power"],
            scale_window=cfg["loss_scale_window"],
            min_scale=cfg["min_loss_scale"],
            delayed_shift=cfg["hysteresis"],
            consecutive_hysteresis=cfg["consecutive_hysteresis"],
        )
        overflows, trace = [], []
        for _ in range(n):
            overflow = rng.random() < p
            overflows.append(overflow)
            try:
                scaler.update_scale(overflow)
            except Exception as e:  # DeepSpeed raises a bare Exception at the minimum scale
                trace.append({"error": str(e)})
                break
            trace.append({"scale": float(scaler.cur_scale), "hysteresis": scaler.cur_hysteresis})
        cases.append({"name": name, "config": cfg, "overflows": overflows, "trace": trace})
    doc = {"generator": "tools/loss_scaler_reference.py", "deepspeed_version": deepspeed.__version__, "cases": cases}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
