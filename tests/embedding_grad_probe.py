"""torchtitan's word embedding under TP on real tensors, one gloo rank per TP rank (run by torchrun).

Run: torchrun --standalone --nproc-per-node T tests/embedding_grad_probe.py

torchtitan shards the embedding's rows over TP (``parallelize.py``: ``RowwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(1))``). Rank 0 prints one JSON line: the rows this rank holds, the shape and placement of the
weight's gradient after one forward and backward, and the largest tensor torch's ``MemTracker`` saw created in
the backward. Used by tests/test_embedding_grad_gloo.py.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's planner, as torchrun starts us

from planner.fake_rank import _allocation_trace  # noqa: E402
from torchrun_jobs import run_tp_probe  # noqa: E402  (tests/, this script's folder, is on the path)

BATCH, SEQ, VOCAB, HIDDEN = 2, 256, 32000, 256


def measure(mesh, tp: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    emb = torch.nn.Embedding(VOCAB, HIDDEN, dtype=torch.bfloat16)
    parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    emb(tokens).float().sum().backward()  # DTensor's per-op caches warm
    emb.weight.grad = None
    out = emb(tokens).float().sum()
    events: list = []
    with _allocation_trace(events), MemTracker():
        out.backward()
    grad = emb.weight.grad
    return {"rows": emb.weight.to_local().shape[0], "grad_local_shape": list(grad.to_local().shape),
            "grad_placements": [str(p) for p in grad.placements], "grad_element_bytes": grad.element_size(),
            "largest_backward_tensor_bytes": max((e[2] for e in events if e[0] == "ADD"), default=0)}


if __name__ == "__main__":
    run_tp_probe(measure)
