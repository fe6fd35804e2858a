"""torch.distributed gloo baseline for benches/src/bin/collectives.rs.

Started once per rank by the bench with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set.
Rank 0 prints one line per measurement:  RESULT <op> <bytes> <median seconds>
where <bytes> is the full buffer (nccl-tests conventions; all_gather's output, reduce_scatter's
input). Usage: python3 gloo_collectives.py SIZE_MB[,SIZE_MB...]
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def iterations(nbytes):
    return max(3, min(20, (64 << 20) // max(nbytes, 1)))


def main():
    sizes = [int(s) for s in sys.argv[1].split(",")]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mb in sizes:
        nbytes = mb << 20
        n = nbytes // 4
        n -= n % world
        full = torch.ones(n, dtype=torch.float32)
        shard = torch.ones(n // world, dtype=torch.float32)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        }
        for name, fn in ops.items():
            fn()
            times = []
            for _ in range(iterations(nbytes)):
                dist.barrier()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            if rank == 0:
                print(f"RESULT {name} {n * 4} {statistics.median(times):.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
