#!/usr/bin/env python3
"""Reference learning rates from DeepSpeed's own deepspeed.runtime.lr_schedules.

Builds each schedule on a torch optimizer exactly as the DeepSpeed engine does (the config's
params as keyword arguments), records the rate and the optimizer's betas (which OneCycle sets
when it cycles the momentum) before the first scheduler step and after each of N steps, and writes
zero-core/tests/fixtures/lr_schedule/deepspeed_reference.json.

Regenerate (needs torch and deepspeed):
    python3 tools/lr_schedule_reference.py
"""

import json
import pathlib

import deepspeed
import torch
from deepspeed.runtime import lr_schedules

OUT = pathlib.Path(__file__).resolve().parent.parent / "zero-core/tests/fixtures/lr_schedule/deepspeed_reference.json"

CASES = [
    ("warmup_log", "WarmupLR", dict(warmup_min_lr=1e-5, warmup_max_lr=3e-3, warmup_num_steps=20, warmup_type="log"), 30),
    ("warmup_linear_default_max", "WarmupLR", dict(warmup_min_lr=1e-4, warmup_num_steps=15, warmup_type="linear"), 25),
    ("warmup_decay", "WarmupDecayLR", dict(total_num_steps=50, warmup_min_lr=1e-5, warmup_max_lr=2e-3, warmup_num_steps=10, warmup_type="linear"), 60),
    ("warmup_decay_log", "WarmupDecayLR", dict(total_num_steps=30, warmup_num_steps=7), 40),
    ("warmup_cosine", "WarmupCosineLR", dict(total_num_steps=40, warmup_min_ratio=0.05, warmup_num_steps=8, cos_min_ratio=0.02, warmup_type="log"), 50),
    ("warmup_cosine_linear", "WarmupCosineLR", dict(total_num_steps=25, warmup_num_steps=5, warmup_type="linear"), 30),
    ("one_cycle", "OneCycle", dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=10, cycle_second_step_size=6,
                                    decay_step_size=4, decay_lr_rate=0.5, decay_mom_rate=0.01, cycle_min_mom=0.85, cycle_max_mom=0.95), 30),
    ("one_cycle_stairs", "OneCycle", dict(cycle_min_lr=2e-4, cycle_max_lr=4e-3, cycle_first_step_size=12, cycle_first_stair_count=3,
                                           cycle_second_step_size=8, cycle_second_stair_count=2), 25),
    ("one_cycle_no_momentum", "OneCycle", dict(cycle_min_lr=1e-3, cycle_max_lr=5e-3, cycle_first_step_size=5, cycle_momentum=False), 15),
    ("range_test", "LRRangeTest", dict(lr_range_test_min_lr=1e-4, lr_range_test_step_size=5, lr_range_test_step_rate=2.0), 20),
    ("range_test_staircase", "LRRangeTest", dict(lr_range_test_min_lr=1e-3, lr_range_test_step_size=4, lr_range_test_step_rate=0.5,
                                                  lr_range_test_staircase=True), 20),
]
OPTIMIZER_LR = 7e-4


def main():
    cases = []
    for name, kind, params, steps in CASES:
        p = torch.zeros(2, requires_grad=True)
        opt = torch.optim.Adam([p], lr=OPTIMIZER_LR)
        sched = getattr(lr_schedules, kind)(opt, **params)
        group = opt.param_groups[0]
        lrs, moms, beta2s = [float(group["lr"])], [float(group["betas"][0])], [float(group["betas"][1])]
        for _ in range(steps):
            sched.step()
            lrs.append(float(group["lr"]))
            moms.append(float(group["betas"][0]))
            beta2s.append(float(group["betas"][1]))
        cases.append({"name": name, "type": kind, "params": params, "lrs": lrs, "beta1": moms, "beta2": beta2s})
    doc = {
        "generator": "tools/lr_schedule_reference.py",
        "deepspeed_version": deepspeed.__version__,
        "optimizer_lr": OPTIMIZER_LR,
        "optimizer_beta1": 0.9,
        "optimizer_beta2": 0.999,
        "note": "lrs[0], beta1[0] and beta2[0] are the values before the first scheduler step (last_batch_iteration = -1); lrs[k] after k steps",
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
