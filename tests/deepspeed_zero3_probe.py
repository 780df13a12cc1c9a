"""DeepSpeed ZeRO-3's parameter coordinator on this CPU (``DS_ACCELERATOR=cpu``, one rank, gloo), replayed over the
module trees of tests/test_deepspeed_zero3.py, for planner/frameworks/deepspeed_zero3.py's port to be compared with.

Reads a JSON list of cases from the file named by its second argument; each case is ``{"tree": <module>,
"config": <zero_optimization keys>}`` with a module as ``{"params": [[id, elements], ...], "children": [...]}``
(the same shape as ``deepspeed_zero3.Module``; an id seen before is the same ``Parameter`` object, a tied weight;
``"checkpointed": true`` has its parent call it through ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=True)``). For each case it builds those modules (each adds the means of its own parameters to its
input, then calls its children in order), runs three forward/backward/step iterations, and reports, per iteration,
every coordinator call (``fetch_sub_module``, ``release_sub_module``, ``release_backward_leftovers``) with the
module's number in the tree's pre-order and, after each fetch, the elements of all parameters not
``NOT_AVAILABLE``. Prints one JSON line.

Run as ``python tests/deepspeed_zero3_probe.py PORT CASES.json``."""

from __future__ import annotations

import json
import os
import sys

WIDTH = 4


def _worker(port: int, cases: list) -> dict:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    deepspeed.init_distributed(dist_backend="gloo")

    class Node(torch.nn.Module):
        def __init__(self, spec: dict, shared: dict):
            super().__init__()
            self.names = []
            for pid, n in spec["params"]:
                if pid not in shared:
                    shared[pid] = torch.nn.Parameter(torch.randn(n) * 0.01)
                name = f"p{pid}"
                self.register_parameter(name, shared[pid])
                self.names.append(name)
            self.kids = torch.nn.ModuleList(Node(c, shared) for c in spec["children"])
            self.checkpointed = spec.get("checkpointed", False)

        def forward(self, x):
            for name in self.names:
                x = x + getattr(self, name).mean()
            for kid in self.kids:
                x = torch.utils.checkpoint.checkpoint(kid, x, use_reentrant=True) if kid.checkpointed else kid(x)
            return x * 1.0

    out = []
    for case in cases:
        torch.manual_seed(0)
        model = Node(case["tree"], {})
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 3, **case["config"]}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        params = list(engine.module.parameters())
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        # the tree's pre-order numbering (DeepSpeed's ds_id also counts each node's never-called ModuleList)
        index = {m.ds_id: i for i, m in enumerate(m for m in engine.module.modules() if isinstance(m, Node))}
        log: list = []

        def live() -> int:
            return sum(p.ds_numel for p in params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE)

        fetch, release, leftovers = (coordinator.fetch_sub_module, coordinator.release_sub_module,
                                     coordinator.release_backward_leftovers)

        def fetched(module, forward):
            fetch(module, forward)
            log.append(["fetch", index[module.ds_id], bool(forward), live()])

        def released(module, forward=False):
            release(module, forward)
            log.append(["release", index[module.ds_id], bool(forward)])

        def leftover():
            leftovers()
            log.append(["leftovers", -1, False])
        coordinator.fetch_sub_module, coordinator.release_sub_module = fetched, released
        coordinator.release_backward_leftovers = leftover
        steps = []
        for _ in range(3):
            log.clear()
            engine.backward(engine(torch.randn(2, WIDTH, dtype=torch.bfloat16)).float().sum())
            engine.step()
            steps.append(list(log))
        out.append({"steps": steps})
    return {"cases": out}


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), json.load(open(sys.argv[2])))))
