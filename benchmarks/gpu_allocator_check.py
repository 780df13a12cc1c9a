"""The caching-allocator model against the real CUDA caching allocator, on one GPU (issue 13: reserved memory).

Run on a GPU machine from the repository root: ``python3 benchmarks/gpu_allocator_check.py OUT.json``.
``planner.fake_rank.measure_step`` predicts a torchtitan rank's peak *reserved* memory by running its training
step (FSDP2, AdamW, torchtitan's AC wrappers) under fake tensors on the CPU and replaying every allocation through
``planner.fake_rank.CachingAllocator``, a model of ``c10/cuda/CUDACachingAllocator.cpp``. Here the same step
(``planner.fake_rank._run``, the very code) runs on a real GPU, one rank (NCCL, world size 1), for a few cases, and
records for each:

* ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` above what was held before the case;
* the allocator's own event trace (``torch.cuda.memory._record_memory_history``: alloc, free_completed,
  segment_alloc, segment_free, with sizes and streams), so that the allocator *policy* model can be replayed on
  the trace torch really issued, apart from the question whether the fake-tensor trace matches it.

``tests/test_gpu_allocator.py`` compares them with the model on the CPU. ``--device cpu`` runs the same cases on
gloo without the CUDA figures (a smoke test of this script where there is no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner import fake_rank  # noqa: E402
from planner.presets import load_model  # noqa: E402

# name: (model preset, layers, seq, micro-batch size, recompute, reshard_after_forward, micro-batches per step)
CASES = {
    "llama3-8b-2l-none": ("llama3-8b", 2, 4096, 1, "none", True, 1),
    "llama3-8b-2l-full": ("llama3-8b", 2, 4096, 1, "full", True, 1),
    "llama3-8b-2l-selective": ("llama3-8b", 2, 4096, 1, "selective", True, 1),
    "llama3-8b-4l-none-mbs2": ("llama3-8b", 4, 4096, 2, "none", True, 1),
    "llama3-8b-2l-none-2micro-keep": ("llama3-8b", 2, 4096, 1, "none", False, 2),
}
TRACE_ACTIONS = ("alloc", "free_completed", "segment_alloc", "segment_free")


def run_case(name, case, mesh, device, small: bool, meta_init: bool) -> dict:
    preset, layers, seq, mbs, recompute, reshard, micro = case
    spec = load_model(preset)
    if small:  # the CPU smoke test: the same code at a width a CPU runs in seconds
        spec = spec.model_copy(update={"hidden_size": 256, "num_attention_heads": 4, "num_kv_heads": 2,
                                       "ffn_hidden_size": 512, "vocab_size": 1024, "head_dim": None})
        seq = 256
    cuda = device == "cuda"
    row = {"case": name, "model": preset, "layers": layers, "seq": seq, "micro_batch_size": mbs,
           "recompute": recompute, "reshard_after_forward": reshard, "microbatches": micro, "steps": 2}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row["held_before_allocated_bytes"] = torch.cuda.memory_allocated()
        row["held_before_reserved_bytes"] = torch.cuda.memory_reserved()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000)
    t0 = time.perf_counter()
    transformer, after_shard = fake_rank._modules(torch), None
    if meta_init:  # torchtitan's order: build on meta, fully_shard, then to_empty on the device
        class MetaTransformer(transformer):
            def __init__(self, *args, **kwargs):
                with torch.device("meta"):
                    super().__init__(*args, **kwargs)
        transformer = MetaTransformer

        def after_shard(model):
            model.to_empty(device=device)
    row["meta_init"] = meta_init
    with torch.device(device):
        result = fake_rank._run(torch, F, mesh, transformer, spec, layers, seq, mbs, 1, reshard,
                                recompute, micro, False, False, 0, 2, t0, after_shard=after_shard)
    row["tracker_peak_bytes"] = result.peak_bytes  # torch's FSDPMemTracker on the real run
    row["wall_s"] = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        row["max_allocated_bytes"] = torch.cuda.max_memory_allocated() - row["held_before_allocated_bytes"]
        row["max_reserved_bytes"] = torch.cuda.max_memory_reserved() - row["held_before_reserved_bytes"]
        trace = snap["device_traces"][torch.cuda.current_device()]
        streams = sorted({e["stream"] for e in trace})
        row["streams"] = len(streams)
        row["trace"] = [[e["action"], e["addr"], e["size"], streams.index(e["stream"])]
                        for e in trace if e["action"] in TRACE_ACTIONS]
        row["trace_dropped"] = len(trace) >= 4_000_000
        print(f"{name:<32} allocated {row['max_allocated_bytes'] / 2**30:7.3f} GiB  reserved "
              f"{row['max_reserved_bytes'] / 2**30:7.3f} GiB  tracker {result.peak_bytes / 2**30:7.3f} GiB  "
              f"{len(row['trace'])} events, {len(streams)} streams, {row['wall_s']:.1f} s", flush=True)
    else:
        print(f"{name:<32} tracker {result.peak_bytes / 2**20:9.2f} MiB  {row['wall_s']:.1f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="gpu_allocator_check.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--meta-init", action="store_true", help="build each model on the meta device, shard it, "
                        "then to_empty on the GPU, as torchtitan does (default: built on the GPU, as measure_step's "
                        "fake tensors are)")
    parser.add_argument("--case", choices=tuple(CASES), help="run this case alone, in this process (the parent runs "
                        "each case in a process of its own: a finished step's FSDP2 graph is not all freed at once)")
    opts = parser.parse_args()
    device, out_path = opts.device, opts.out
    if device == "cuda" and not torch.cuda.is_available():  # `make bench` runs every benchmark; this one needs the GPU
        print(f"{__file__.rsplit('/', 1)[-1]}: needs a CUDA GPU; skipped (--device cpu: smoke test)")
        return
    if opts.case is None:
        rows = []
        for i, name in enumerate(CASES):
            part = f"{out_path}.{i}"
            env = {**os.environ, "MASTER_PORT": str(29517 + i)}
            done = subprocess.run([sys.executable, __file__, part, "--device", device, "--case", name]
                                  + ["--meta-init"] * opts.meta_init, env=env, timeout=300)
            if done.returncode == 0:
                with open(part) as fh:
                    part_data = json.load(fh)
                os.remove(part)
                rows += part_data["rows"]
                with open(out_path, "w") as fh:  # partial results survive a time limit
                    json.dump({"meta": part_data["meta"], "rows": rows}, fh)
            else:
                print(f"{name}: exit {done.returncode}", flush=True)
        print(f"-> {out_path}")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("dp", "tp"))
    mesh = {"dp": mesh["dp"], "tp": mesh["tp"]}
    meta = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    try:
        row = run_case(opts.case, CASES[opts.case], mesh, device, small=device == "cpu", meta_init=opts.meta_init)
        with open(out_path, "w") as fh:
            json.dump({"meta": meta, "rows": [row]}, fh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
