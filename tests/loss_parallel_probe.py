"""torchtitan's loss under ``loss_parallel`` on real tensors, one gloo rank per TP rank (run by torchrun).

Run: torchrun --standalone --nproc-per-node T tests/loss_parallel_probe.py

Rank 0 prints one JSON line: the peak bytes the loss creates per local logit, by torch's own ``MemTracker``
(activations and temporaries; the hidden states, the output weight and the labels are tracked apart), measured
twice in the process. The loss is torchtitan's (``components/loss.py``: ``cross_entropy(pred.flatten(0, 1).float(),
labels.flatten(0, 1))``) on vocabulary-sharded logits (``ColwiseParallel`` output layer with ``Shard(-1)`` output,
``apply_tp``), inside ``torch.distributed.tensor.parallel.loss_parallel``, forward and backward. Used by
tests/test_loss_parallel_gloo.py.
"""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

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
    per_logit = []
    for _ in range(2):
        tracker = MemTracker()
        tracker.track_external(weight, h, labels)
        with tracker:
            w = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
            pred = F.linear(DTensor.from_local(h, mesh, [Replicate()]), w)  # Shard(-1): vocabulary-parallel
            with loss_parallel():
                loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
                del pred
                loss.backward()
            snap = tracker.get_tracker_snapshot("peak")
        per_device = next(iter(snap.values()))
        created = sum(v for k, v in per_device.items() if str(getattr(k, "value", k)) in ("Activation", "Temp"))
        per_logit.append(created / local_logits)
    if dist.get_rank() == 0:
        print(json.dumps({"tp": tp, "bytes_per_local_logit": per_logit}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
