"""torchtitan's loss under ``loss_parallel`` on real tensors, one gloo rank per TP rank (run by torchrun).

Run: torchrun --standalone --nproc-per-node T tests/loss_parallel_probe.py

Rank 0 prints one JSON line: the peak bytes the loss creates per local logit, measured twice in the process by
``planner.fake_rank.loss_created_bytes`` (torch's ``MemTracker``; torchtitan's ``cross_entropy(pred.flatten(0,
1).float(), labels.flatten(0, 1))`` on vocabulary-sharded logits inside ``loss_parallel``, forward and backward),
the same code ``measure_loss_bytes`` runs under fake tensors, here on real ones. Used by
tests/test_loss_parallel_gloo.py.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's planner, as torchrun starts us

from planner.fake_rank import loss_created_bytes  # noqa: E402

BATCH, SEQ, VOCAB, HIDDEN = 2, 1024, 16384, 64


def main() -> None:
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16))
    h = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    local_logits = BATCH * SEQ * VOCAB / tp
    per_logit = [loss_created_bytes(weight, h, labels, mesh) / local_logits for _ in range(2)]
    if dist.get_rank() == 0:
        print(json.dumps({"tp": tp, "bytes_per_local_logit": per_logit}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
