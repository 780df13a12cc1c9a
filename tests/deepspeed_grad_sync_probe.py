"""DeepSpeed's ZeRO engine on this CPU (``DS_ACCELERATOR=cpu``, one rank): with ``gradient_accumulation_steps``
3, how many gradient-bucket reductions each ``engine.backward`` runs, per ZeRO stage (stage 1/2:
``DeepSpeedZeroOptimizer.reduce_ipg_grads``; stage 3: ``DeepSpeedZeroOptimizer_Stage3.__reduce_and_partition_ipg_grads``),
for tests/test_cost_dp_sync.py. Run as ``python tests/deepspeed_grad_sync_probe.py PORT``; prints one JSON line
``{stage: [[is_boundary, reductions], ...]}``."""

from __future__ import annotations

import json
import os
import sys


def _worker(port: int) -> dict:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero import stage_1_and_2

    count = [0]

    def counted(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)
        setattr(cls, name, wrapper)

    counted(stage_1_and_2.DeepSpeedZeroOptimizer, "reduce_ipg_grads")
    counted(stage3.DeepSpeedZeroOptimizer_Stage3, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                                        "reduce_bucket_size": 1000}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                          dist_init_required=True)
        seen = []
        for _ in range(3):
            count[0] = 0
            engine.backward(engine(torch.randn(2, 8)).sum())
            seen.append([engine.is_gradient_accumulation_boundary(), count[0]])
            engine.step()
        out[stage] = seen
    return out


def run_probe(timeout_s: float = 600) -> dict:
    """Runs the probe in a fresh process; returns ``{stage: [[is_boundary, reductions], ...]}``."""
    from tests.subprocess_probe import run_json_probe

    return {int(k): v for k, v in run_json_probe(__file__, timeout_s).items()}


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]))), flush=True)
