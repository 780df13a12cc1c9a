"""How many layers DeepSpeed ZeRO-3 keeps gathered, asked of its own parameter coordinator on this CPU.

Run: python benchmarks/deepspeed_zero3_gathered.py   (deepspeed 0.19.8 and torch, as the Makefile installs them)

plan3d counts a ZeRO-3 DeepSpeed stage's gathered weights as one layer plus ``stage3_prefetch_bucket_size``
(planner/frameworks/deepspeed.py). DeepSpeed's coordinator (``runtime/zero/partitioned_param_coordinator.py``)
keeps a parameter that is used again within ``stage3_max_reuse_distance`` elements of the trace
(``__params_to_release``), and one the prefetcher scanned past while it was gathered (``__most_recent_step_id_
param_fetched_for``). This script runs the real coordinator on one rank (``DS_ACCELERATOR=cpu``, gloo) over a toy
model shaped as Llama-3-8B in element counts, scaled down: an input embedding, 32 equal ``Linear`` layers and an
output layer, the two embeddings each 525.3e6 / 218.1e6 of a layer (Llama-3-8B's 128,256 x 4096 against its
layer's 218,112,000 elements), in bf16, with ``stage3_param_persistence_threshold`` 0. It prints the most layers'
worth of parameters gathered at any module's forward or backward hook of the third step (the first records the
trace). The coordinator decides in element counts only, so scaling every module, the reuse distance, the prefetch
bucket and the live-parameter limit by one factor keeps its decisions: the last rows put the model against
DeepSpeed's defaults (1e9, 5e7, 1e9). The hooks run after DeepSpeed's own, so the module being computed may already
be released when counted. It asserts nothing (docs/memory.md, Known limits).
"""

from __future__ import annotations

import json
import os
import sys

LAYERS, WIDTH = 32, 64
PER_LAYER = WIDTH * WIDTH + WIDTH
LLAMA3_8B_LAYER = 218_112_000  # 4096 x (4096 + 2 x 1024 + 4096) attention + 3 x 4096 x 14336 MLP + 2 norms
LLAMA3_8B_EMBEDDING = 128_256 * 4096  # each of the untied input and output embeddings
EMBEDDING = round(LLAMA3_8B_EMBEDDING / LLAMA3_8B_LAYER * PER_LAYER)


def _peak(live: int, reuse: int, prefetch: int) -> float:
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    class Embedding(torch.nn.Module):  # a module holding `numel` elements, used once per pass
        def __init__(self, numel: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(numel) * 0.01)

        def forward(self, x):
            return x + self.weight[:WIDTH]

    torch.manual_seed(0)
    model = torch.nn.Sequential(Embedding(EMBEDDING), *[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)],
                                Embedding(EMBEDDING))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_max_live_parameters": live,
                                    "stage3_max_reuse_distance": reuse, "stage3_prefetch_bucket_size": prefetch,
                                    "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    params = list(engine.module.parameters())
    seen = [0]

    def hook(*_):
        seen[0] = max(seen[0], sum(p.ds_numel for p in params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE))
    for layer in engine.module:
        layer.register_forward_hook(hook)
        layer.register_full_backward_hook(hook)
    for _ in range(3):
        seen[0] = 0
        engine.backward(engine(torch.randn(2, WIDTH, dtype=torch.bfloat16)).float().sum())
        engine.step()
    return seen[0] / PER_LAYER


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    scale = PER_LAYER / LLAMA3_8B_LAYER
    rows = [("reuse 0, prefetch 0", 10**9, 0, 0),
            ("reuse 4 layers, prefetch 0", 10**9, 4 * PER_LAYER, 0),
            ("reuse 0, prefetch 1 layer", 10**9, 0, PER_LAYER),
            ("DeepSpeed's reuse default, prefetch 0", 10**9, int(1e9 * scale), 0),
            ("DeepSpeed's defaults", int(1e9 * scale), int(1e9 * scale), int(5e7 * scale))]
    out = []
    for name, live, reuse, prefetch in rows:
        out.append({"case": name, "max_live": live, "reuse": reuse, "prefetch": prefetch,
                    "gathered_layers": round(_peak(live, reuse, prefetch), 2)})
    if "--json" in sys.argv:
        print(json.dumps(out))
        return
    print(f"embedding {EMBEDDING}, {LAYERS} layers of {PER_LAYER}, output layer {EMBEDDING} elements (Llama-3-8B x "
          f"{scale:.2e}); most layers' worth gathered at a hook (third step):")
    for r in out:
        print(f"  {r['case']:42s} live {r['max_live']:>10}  reuse {r['reuse']:>10}  prefetch {r['prefetch']:>8}:"
              f" {r['gathered_layers']:5.2f} layers")
    print("plan3d counts one layer plus the prefetch bucket (planner/frameworks/deepspeed.py state_bytes)")


if __name__ == "__main__":
    main()
