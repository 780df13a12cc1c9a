"""Megatron-Core's ``DistributedDataParallel`` and optimizers (core_v0.16.1, ../shared/consumers) on this CPU, four
gloo ranks, asked which model states they hold, for tests/test_megatron_states.py to compare with
planner/frameworks/megatron.py ``state_bytes``.

The model is ``LAYERS`` bias-free ``Linear(WIDTH, WIDTH)`` in bf16 wrapped in Megatron's own
``DistributedDataParallel``; the optimizer is what ``get_megatron_optimizer`` builds for Adam in bf16 (no
Transformer Engine or Apex here, so its Adam is ``torch.optim.AdamW``, which holds the same two fp32 states as
their FusedAdam). Two micro-batches a step, then ``optimizer.step()``. Per job (distributed optimizer or not, fp32 or
bf16 gradient buffer, context parallelism 2, expert parallelism 2 with half the layers marked as experts as
Megatron's MoE layers mark them, ``allreduce = False``; and fp16 with the grad scaler's optimizers) it reports, in bytes on rank 0: the storages of the
parameters (the bf16 weights, in DDP's param buffer under the distributed optimizer), of their ``main_grad`` (the
gradient buffer), of the optimizer's fp32 master weights, of Adam's states, and of the gradients the inner Adam
steps on that are not views of the gradient buffer (``_copy_model_grads_to_main_grads``: ``main_grad.float()``).
Then, on a PP 2 x DP 2 layout with ``overlap_grad_reduce`` and buckets of two layers, how many gradient buckets each
pipeline rank's DDP makes.

Stand-ins for what needs a GPU (../shared/consumers/README.md allows exactly these, named;
tests/megatron_stand_ins.py): ``torch.cuda.current_device`` returns ``"cpu"``; a ``TorchFunctionMode`` puts every
tensor Megatron creates with ``device="cuda"`` on the CPU, makes ``Tensor.cuda()`` the identity, and answers
``Tensor.type()`` with the CUDA type name (``distrib_optimizer.py`` and ``optimizer.py`` accept only
``torch.cuda.*Tensor`` parameters); ``torch.cuda.Stream`` is a placeholder (the partial distributed optimizer's
communication stream, used only with ``overlap_grad_reduce``, off here). Nothing else is changed.

Run as ``python tests/megatron_states_probe.py PORT MEGATRON_ROOT`` (PORT is ignored: tests/rank_pool.py takes a
fresh one); prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

WIDTH, LAYERS, RANKS, MICRO_BATCHES = 256, 8, 4, 2
PARAMS = WIDTH * WIDTH * LAYERS

#: (name, distributed optimizer, fp32 gradient buffer, context parallel, expert parallel[, fp16[, optimizer instances]])
JOBS = (("zero0-fp32-grads", False, True, 1, 1), ("zero0-bf16-grads", False, False, 1, 1),
        ("zero1-fp32-grads", True, True, 1, 1), ("zero1-bf16-grads", True, False, 1, 1),
        ("zero1-cp2", True, True, 2, 1), ("zero1-ep2-bf16-grads", True, False, 1, 2),
        # --fp16: fp16 weights, the grad scaler, fp16 gradients unless --accumulate-allreduce-grads-in-fp32
        ("zero0-fp16-grads", False, False, 1, 1, True), ("zero1-fp16-grads", True, False, 1, 1, True),
        ("zero1-fp16-fp32-grads", True, True, 1, 1, True),
        # --num-distributed-optimizer-instances 2: two copies of the distributed optimizer, each over 2 ranks
        ("zero1-2-instances", True, True, 1, 1, False, 2), ("zero1-2-instances-bf16-grads", True, False, 1, 1, False, 2),
        ("zero1-2-instances-ep2", True, False, 1, 2, False, 2))


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _job(torch, name: str, distributed: bool, fp32_grads: bool, cp: int, ep: int, fp16: bool = False,
         instances: int = 1) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=cp, expert_model_parallel_size=ep,
                                 num_distributed_optimizer_instances=instances)
    torch.manual_seed(0)
    dtype = torch.float16 if fp16 else torch.bfloat16
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=dtype) for _ in range(LAYERS)])
    experts = list(model)[LAYERS // 2:] if ep > 1 else []
    for layer in experts:  # as Megatron's expert layers mark their weights (moe/experts.py)
        layer.weight.allreduce = False
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=not fp16, fp16=fp16,
                               params_dtype=dtype, context_parallel_size=cp,
                               expert_model_parallel_size=ep, num_moe_experts=2 if ep > 1 else None)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp32_grads, use_distributed_optimizer=distributed,
        num_distributed_optimizer_instances=instances), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=not fp16, fp16=fp16,
                                                 use_distributed_optimizer=distributed), [ddp])
    inner = [o for o in getattr(opt, "chained_optimizers", [opt])]
    params = list(model.parameters())
    seen: dict = {}

    def grad_storages() -> dict[int, int]:
        return _storages(p.main_grad for p in params)

    for o in inner:  # the gradients the wrapped Adam steps on, beyond the gradient buffer
        step = o.optimizer.step

        def stepped(*args, _step=step, **kwargs):
            buffer = grad_storages()
            grads = _storages(p.grad for g in _step.__self__.param_groups for p in g["params"] if p.grad is not None)
            seen["step_grads"] = seen.get("step_grads", 0) + sum(v for k, v in grads.items() if k not in buffer)
            return _step(*args, **kwargs)
        o.optimizer.step = stepped
    x = torch.randn(4, WIDTH, dtype=dtype)
    for _ in range(MICRO_BATCHES):
        ddp(x).float().sum().backward()
    ddp.finish_grad_sync()
    opt.step()
    masters = []
    for o in inner:
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            masters += [p for g in getattr(o, attr, []) for p in g]
    adam = [t for o in inner for s in o.optimizer.state.values() for t in s.values()
            if isinstance(t, torch.Tensor) and t.numel() > 1]
    expert_ids = {id(layer.weight) for layer in experts}
    return {"job": name, "distributed_optimizer": distributed, "fp32_grads": fp32_grads, "cp": cp, "ep": ep,
            "fp16": fp16, "instances": instances,
            "expert_params": sum(p.numel() for p in params if id(p) in expert_ids),
            "weights": sum(_storages(params).values()), "grads": sum(grad_storages().values()),
            "master": sum(_storages(masters).values()), "adam": sum(_storages(adam).values()),
            "step_grads": seen.get("step_grads", 0)}


def _buckets(torch, dist) -> list:
    """(pipeline rank, gradient buckets) of every rank of a PP 2 x DP 2 job whose DDP asks for buckets of two layers
    (``bucket_size``) with ``overlap_grad_reduce``: Megatron buckets only the first pipeline rank's gradients."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.bfloat16)
                                  for _ in range(LAYERS)])
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                               pipeline_model_parallel_size=2)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=2 * WIDTH * WIDTH), model)
    mine = (ps.get_pipeline_model_parallel_rank(), sum(len(b.buckets) for b in ddp.buffers))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _rank(rank: int, port: int, megatron_root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, megatron_root)
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    from tests.megatron_stand_ins import device_for_cuda, no_cuda_streams

    device_for_cuda(torch, "cpu").__enter__()  # the stand-ins of the module docstring
    no_cuda_streams(torch)
    out = [_job(torch, *job) for job in JOBS]
    buckets = _buckets(torch, dist)
    if rank == 0:
        queue.put({"jobs": out, "buckets": buckets})
    dist.barrier()
    dist.destroy_process_group()


def main(megatron_root: str) -> dict:
    from tests.rank_pool import run_ranks

    got = run_ranks(_rank, RANKS, (megatron_root,), timeout_s=420)
    return {"ranks": RANKS, "params": PARAMS, "width": WIDTH, "layers": LAYERS, **got}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[2])))
