"""DeepSpeed's ZeRO optimizers on this CPU (``DS_ACCELERATOR=cpu``, gloo), four ranks, asked which model states they
hold, for tests/test_deepspeed_states.py to compare with planner/frameworks/deepspeed.py ``state_bytes``.

A model of ``LAYERS`` bias-free ``Linear(WIDTH, WIDTH)`` in bf16, Adam (``torch.optim.Adam``, the CPU stand-in for
FusedAdam, which holds the same two states), ``gradient_accumulation_steps`` 2, ``contiguous_gradients`` false (no
reduce buckets). For ZeRO stages 0 (``FP16_Optimizer`` in bf16), 1, 2 and 3 it reports, in bytes per parameter on rank 0, the storages of the tensors
the optimizer holds under each name: the 16-bit weights, the fp32 master partition, Adam's states, the 16-bit
gradients held after a micro-batch that is not the last of the step (stages 0-1: the parameters' ``.grad``;
stages 2-3: the gradient partitions), and the fp32 gradient partition the wrapped optimizer steps on.

Run as ``python tests/deepspeed_states_probe.py [PORT]`` (the port is ignored: tests/rank_pool.py takes a fresh one
for each group of ranks); prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

WIDTH, LAYERS, RANKS, ACCUMULATION = 256, 32, 4, 2
PARAMS = WIDTH * WIDTH * LAYERS


def _storages(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _rank(rank: int, port: int, stage: int, queue) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank))
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATION,
              "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "foreach": False}},
              "zero_optimization": {"stage": stage, "contiguous_gradients": False, "overlap_comm": False,
                                    "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
                                    "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    opt = engine.optimizer
    seen: dict = {}
    inner_step = opt.optimizer.step

    def stepped(*args, **kwargs):  # the fp32 gradient partition the wrapped Adam steps on
        seen["fp32_grads"] = _storages(p.grad for g in opt.optimizer.param_groups for p in g["params"]
                                       if p.grad is not None)
        return inner_step(*args, **kwargs)
    opt.optimizer.step = stepped
    for i in range(2 * ACCUMULATION):
        engine.backward(engine(torch.randn(1, WIDTH, dtype=torch.bfloat16)).float().sum())
        if i == ACCUMULATION:  # a micro-batch that is not the step's last
            if stage in (0, 1):
                seen["bf16_grads"] = _storages(p.grad for p in engine.module.parameters() if p.grad is not None)
            elif stage == 2:  # stage_1_and_2.py: the partition's gradients, reduced every micro-batch
                seen["bf16_grads"] = _storages(t for ts in opt.all_grad_tensors.values() if ts for t in ts
                                               if t is not None)
            else:
                seen["bf16_grads"] = _storages([opt.grad_partitions_flat_buffer])
        engine.step()
    if stage == 0:  # FP16_Optimizer in bf16 (engine.py DDP_BFLOAT16), fused or unfused
        weights = _storages(opt.fp16_groups_flat) if hasattr(opt, "fp16_groups_flat") else \
            _storages(p for g in opt.fp16_groups for p in g)
        master = _storages(opt.fp32_groups_flat) if hasattr(opt, "fp32_groups_flat") else \
            _storages(p for g in opt.fp32_groups for p in g)
    elif stage == 3:
        weights = _storages(opt.fp16_partitioned_groups_flat)
        master = _storages(opt.fp32_partitioned_groups_flat)
    else:
        weights = _storages(opt.bit16_groups_flat)
        master = _storages(opt.single_partition_of_fp32_groups)
    adam = _storages(t for s in opt.optimizer.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.numel() > 1)
    if rank == 0:
        queue.put({"stage": stage, **{k: v / PARAMS for k, v in seen.items()}, "weights": weights / PARAMS,
                   "master": master / PARAMS, "adam": adam / PARAMS})


def main() -> dict:
    from tests.rank_pool import run_ranks

    out = [run_ranks(_rank, RANKS, (stage,), timeout_s=300) for stage in (0, 1, 2, 3)]
    return {"ranks": RANKS, "params": PARAMS, "width": WIDTH, "layers": LAYERS, "stages": out}


if __name__ == "__main__":
    print(json.dumps(main()))
