"""The rank program of `plan3d calibrate`: measure matmul FLOP/s and bus bandwidth where it runs.

Every rank times GEMMs of the shapes the cost model uses (tokens x hidden x projection widths) at
the same time (a barrier before each sample), as a loaded node runs them; each rank reports its own
process's rate. All ranks then time all-reduces of growing buffers on
the ranks of their node (intra-node) and, when the job spans nodes, on one rank per node
(inter-node). The bus bandwidth follows nccl-tests (``planner.comm.bus_factor``) and the latency
comes from the smallest message. Rank 0 writes the measurements as JSON; the launcher turns them
into a hardware profile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from planner.comm import bus_factor, ring_steps


def time_it(fn, repeats: int, before=None) -> float:
    """Median seconds of ``fn`` after one untimed call; ``before`` (a barrier) runs untimed before
    each sample so that every rank starts together. ``fn`` must synchronise the device itself."""
    fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def gemm_rates(device, dtype, shapes, sync, before=None) -> list[dict]:
    """This process's GEMM rate per shape; with ``before`` = a barrier over all ranks, every sample
    starts while all the other ranks start the same GEMM (a loaded node)."""
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)

        def run():
            torch.mm(a, b)
            sync()

        t = time_it(run, repeats=5, before=before)
        out.append({"m": m, "k": k, "n": n, "seconds": t, "tflops": 2 * m * k * n / t / 1e12})
    return out


def allreduce_curve(group, n: int, device, sizes_bytes, sync) -> list[dict]:
    out = []
    for size in sizes_bytes:
        buf = torch.ones(max(size // 4, 1), device=device)

        def run():
            dist.all_reduce(buf, group=group)
            sync()

        t = time_it(run, repeats=5, before=lambda: dist.barrier(group=group))
        out.append({"bytes": size, "seconds": t, "busbw_gbps": bus_factor("all_reduce", n) * size / t / 1e9,
                    "latency_us": t / max(ring_steps("all_reduce", n), 1) * 1e6})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU)")
    args = ap.parse_args(argv)
    use_cuda = args.backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dtype = torch.bfloat16 if use_cuda else torch.float32
    shapes = [(256, 256, 768), (256, 768, 256), (512, 512, 512)] if args.quick else \
        [(8192, 8192, 3072), (8192, 3072, 8192), (4096, 8192, 28672 // 8), (8192, 8192, 8192)]
    dist.barrier()
    gemms = gemm_rates(device, dtype, shapes, sync, before=dist.barrier)
    nodes = max(1, world // per_node)
    intra_groups = [dist.new_group(list(range(i * per_node, (i + 1) * per_node))) for i in range(nodes)]
    inter_groups = [dist.new_group(list(range(j, world, per_node))) for j in range(per_node)] if nodes > 1 else []
    sizes = [2**12, 2**16, 2**20, 2**22] if args.quick else [2**12, 2**20, 2**24, 2**27, 2**29]
    intra = allreduce_curve(intra_groups[rank // per_node], per_node, device, sizes, sync) if per_node > 1 else []
    inter = allreduce_curve(inter_groups[rank % per_node], nodes, device, sizes, sync) if inter_groups else []
    result = {"rank": rank, "gemms": gemms, "intra": intra, "inter": inter}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"world": world, "gpus_per_node": per_node, "nodes": nodes,
                                              "backend": args.backend, "dtype": str(dtype), "ranks": gathered},
                                             indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from planner.validate import exit_after_run

    exit_after_run(main())
