"""torchtitan's loss under ``loss_parallel`` on real tensors, one gloo rank per TP rank (run by torchrun).

Run: torchrun --standalone --nproc-per-node T tests/loss_parallel_probe.py

Rank 0 prints one JSON line: the peak bytes the loss creates per local logit, measured twice in the process by
``planner.fake_rank.loss_created_bytes`` (torch's ``MemTracker``; torchtitan's ``cross_entropy(pred.flatten(0,
1).float(), labels.flatten(0, 1))`` on vocabulary-sharded logits inside ``loss_parallel``, forward and backward),
the same code ``measure_loss_bytes`` runs under fake tensors, here on real ones. Used by
tests/test_loss_parallel_gloo.py.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's planner, as torchrun starts us

from planner.fake_rank import loss_created_bytes  # noqa: E402
from torchrun_jobs import run_tp_probe  # noqa: E402  (tests/, this script's folder, is on the path)

BATCH, SEQ, VOCAB, HIDDEN = 2, 1024, 16384, 64


def measure(mesh, tp: int) -> dict:
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16))
    h = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    local_logits = BATCH * SEQ * VOCAB / tp
    return {"bytes_per_local_logit": [loss_created_bytes(weight, h, labels, mesh) / local_logits for _ in range(2)]}


if __name__ == "__main__":
    run_tp_probe(measure)
