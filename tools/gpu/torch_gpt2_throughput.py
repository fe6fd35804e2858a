"""GPT-2 training throughput in PyTorch + transformers: the baseline for benches' `throughput`.

Eager attention, bf16 autocast over fp32 weights (PyTorch's mixed precision: fp32 master
weights, bf16 compute), AdamW with fused=True. Random initialisation from GPT2Config, the same
shapes as zero-models' presets, the same token pattern as the Rust bench. Prints the same table:
median step (forward + backward + optimizer step, synchronised) over --steps after 2 warm-ups,
tokens/s, and MFU with the same FLOPs count (6 x matrix parameters + 12 x layers x n_embd x seq).

python3 tools/gpu/torch_gpt2_throughput.py --models gpt2,gpt2-xl --batch 8 --seq 1024 --steps 10
"""

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

PRESETS = {
    "tiny": dict(n_embd=128, n_layer=2, n_head=4),
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dev = torch.device(a.device)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[a.dtype]
    print(f"torch {torch.__version__}, device {dev}, {a.dtype} autocast, batch {a.batch} x seq {a.seq}")
    print("| model | params | step | tokens/s | MFU | loss |")
    print("|---|---|---|---|---|---|")
    for name in a.models.split(","):
        shape = PRESETS[name]
        cfg = GPT2Config(vocab_size=50257, n_positions=max(1024, a.seq), **shape,
                         attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg).to(dev)
        params = sum(t.numel() for t in model.parameters())
        matrix = params - cfg.n_positions * cfg.n_embd
        flops_per_token = 6 * matrix + 12 * cfg.n_layer * cfg.n_embd * a.seq
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
        scaler = torch.amp.GradScaler(enabled=a.dtype == "fp16")
        times, loss = [], float("nan")
        for step in range(2 + a.steps):
            i = torch.arange(a.batch * a.seq, device=dev)
            ids = ((i * 7919 + step * 104729) % cfg.vocab_size).view(a.batch, a.seq)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
                out = model(input_ids=ids, labels=ids)
            scaler.scale(out.loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if step >= 2:
                times.append(time.perf_counter() - t)
            loss = out.loss.item()
        step_s = statistics.median(times)
        tps = a.batch * a.seq / step_s
        mfu = 100 * tps * flops_per_token / (a.peak_tflops * 1e12)
        print(f"| {name} | {params / 1e6:.1f}M | {step_s * 1e3:.1f} ms | {tps:.0f} | {mfu:.1f}% | {loss:.3f} |")
        del model, opt


if __name__ == "__main__":
    main()
