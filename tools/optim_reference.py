#!/usr/bin/env python3
"""Reference trajectories of torch.optim for the zero-core optimizer tests.

Runs torch.optim (single-tensor implementation, float32) on a small fixed tensor for five steps,
with a fixed gradient and learning rate per step, and writes what every step produced to
zero-core/tests/fixtures/optim/torch_reference.json.

Regenerate (needs torch):
    python3 tools/optim_reference.py
"""

import json
import pathlib

import torch

N = 37  # odd, so that no SIMD width divides it
STEPS = 5
OUT = pathlib.Path(__file__).resolve().parent.parent / "zero-core/tests/fixtures/optim/torch_reference.json"

CASES = [
    # name, constructor, kwargs, learning rate per step, state buffers to record
    ("adam_l2", torch.optim.Adam, dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
     [1e-2] * STEPS, ["exp_avg", "exp_avg_sq"]),
    ("adamw", torch.optim.AdamW, dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
     [1e-2, 2e-2, 3e-2, 2e-2, 1e-2], ["exp_avg", "exp_avg_sq"]),
    ("adam_amsgrad", torch.optim.Adam, dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=True),
     [5e-2] * STEPS, ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]),
    ("sgd_nesterov", torch.optim.SGD, dict(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
     [0.1] * STEPS, ["momentum_buffer"]),
    ("sgd_dampening", torch.optim.SGD, dict(momentum=0.8, dampening=0.3, weight_decay=0.0),
     [0.1, 0.05, 0.1, 0.05, 0.1], ["momentum_buffer"]),
    ("sgd_plain", torch.optim.SGD, dict(momentum=0.0, weight_decay=0.02),
     [0.1] * STEPS, []),
]


def floats(t):
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def main():
    gen = torch.Generator().manual_seed(1234)
    params0 = torch.randn(N, generator=gen, dtype=torch.float32)
    # Gradients of mixed magnitude, with a zero and a sign flip between steps.
    grads = [torch.randn(N, generator=gen, dtype=torch.float32) * (0.5 ** k) for k in range(STEPS)]
    for g in grads:
        g[3] = 0.0
    cases = []
    for name, ctor, kwargs, lrs, state_names in CASES:
        p = params0.clone().requires_grad_(True)
        opt = ctor([p], lr=lrs[0], foreach=False, **kwargs)
        trajectory = []
        for lr, g in zip(lrs, grads):
            for group in opt.param_groups:
                group["lr"] = lr
            p.grad = g.clone()
            opt.step()
            trajectory.append(floats(p))
        state = opt.state[p]
        cases.append({
            "name": name,
            "optimizer": ctor.__name__,
            "hyper": {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()},
            "lrs": lrs,
            "params_after_step": trajectory,
            "final_state": {k: floats(state[k]) for k in state_names},
        })
    doc = {
        "generator": "tools/optim_reference.py",
        "torch_version": torch.__version__,
        "params0": floats(params0),
        "grads": [floats(g) for g in grads],
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
