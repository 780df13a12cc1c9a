"""FSDP2 (``fully_shard``) on this CPU's gloo ranks, asked which memory-bound passes each micro-batch runs over
parameter-sized tensors besides the GEMMs, for tests/test_fsdp2_accumulation.py (``planner.frameworks.torchtitan
.microbatch_passes``, ``cost.grad_accum_s``).

Four ranks, torchtitan's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (and fp32 parameters, no
policy), eight bias-free linears, four micro-batches per step, recorded with a ``TorchDispatchMode`` around each
micro-batch's backward (and forward); per operation ``[name, bytes read, bytes written]`` per element of the stage's parameters,
with the dtypes it touched:

* ``pipeline``: pp 2 x dp 2, one ``fully_shard`` per linear and the stage root on the dp mesh with
  ``reshard_after_forward=False`` (torchtitan's default under PP; ``pipeline_reshard``: True, plan3d validate's
  miniature at zero_stage 3), ``torch.distributed.pipelining``'s ``PipelineStage`` and ``Schedule1F1B``: the stage's
  ``backward_maybe_with_nosync`` recorded per call;
  (``pipeline_forward``: its ``forward_one_chunk``);
* ``plain``: FSDP over all four ranks, torchtitan's loop without PP (forward and backward per micro-batch, gradients
  reduce-scattered every time), each micro-batch's forward and backward recorded together, with torchtitan's default
  ``reshard_after_forward=True`` (``plain``) and ``False`` (``plain_never``).

Run as ``python tests/fsdp2_accumulation_probe.py PORT``; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

WORLD = 4
MICROBATCHES = 4
#: eight bias-free linears of 960 elements: a dp 2 or dp 4 shard is a whole number of elements of each
IN_FEATURES, OUT_FEATURES, LINEARS = 24, 40, 8
#: views, GEMMs and allocations: no bytes moved over the parameters
SKIPPED = {"mm", "addmm", "bmm", "t", "view", "detach", "_unsafe_view", "as_strided", "alias", "transpose", "expand",
           "permute", "slice", "split", "split_with_sizes", "empty", "empty_like", "new_empty", "new_empty_strided",
           "empty_strided", "new_zeros", "zeros", "zeros_like", "resize_", "record_stream"}


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from tests.dispatch_bytes import recorder

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)

    def layers(n: int):
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(*((IN_FEATURES, OUT_FEATURES) if i % 2 == 0 else
                                                       (OUT_FEATURES, IN_FEATURES)), bias=False) for i in range(n)])

    def per_element(recorded: dict, elements: int) -> list:
        return sorted([name, r / elements, w / elements, sorted(d)] for name, (r, w, d) in recorded.items())

    def _pipeline(precision, policy, reshard):
        suffix = "_reshard" if reshard else ""
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("pp", "dp"))
        stage_index = mesh["pp"].get_local_rank()
        mod = layers(LINEARS // 2)
        for layer in mod:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(mod, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=reshard)
        stage = PipelineStage(mod, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        calls = {"forward_one_chunk": [], "backward_maybe_with_nosync": []}
        originals = {name: getattr(PipelineStage, name) for name in calls}

        def recording(name):
            def recorded(self, *args, **kwargs):
                with recorder(IN_FEATURES * OUT_FEATURES, SKIPPED) as rec:
                    result = originals[name](self, *args, **kwargs)
                calls[name].append(rec.bytes)
                return result
            return recorded
        for name in calls:
            setattr(PipelineStage, name, recording(name))
        try:
            schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=lambda o, _: o.float().sum())
            if stage_index == 0:
                schedule.step(torch.randn(2 * MICROBATCHES, IN_FEATURES))
            else:
                schedule.step(target=torch.zeros(2 * MICROBATCHES, IN_FEATURES))
        finally:
            for name, original in originals.items():
                setattr(PipelineStage, name, original)
        elements = sum(p.numel() for p in mod.parameters())  # the stage's whole (unsharded) parameters
        out[f"pipeline{suffix}_{precision}"] = [per_element(c, elements) for c in calls["backward_maybe_with_nosync"]]
        out[f"pipeline{suffix}_forward_{precision}"] = [per_element(c, elements) for c in calls["forward_one_chunk"]]

    out = {}
    for precision, policy in (("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
                              ("fp32", MixedPrecisionPolicy())):
        # pipeline: pp 2 x dp 2, torchtitan's reshard_after_forward=False under PP, and True (plan3d validate's
        # miniature at zero_stage 3)
        for reshard in (False, True):
            _pipeline(precision, policy, reshard)
        # no pipeline: FSDP over every rank, a reduce-scatter per micro-batch (torchtitan's loop), each micro-batch's
        # forward and backward recorded together; with torchtitan's default reshard after forward (zero_stage 3)
        # and without ("never", its zero_stage 1 and 2)
        for reshard in (True, False):
            mod = layers(LINEARS)
            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
            for layer in mod:
                fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
            fully_shard(mod, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
            elements = sum(p.numel() for p in mod.parameters())
            calls = []
            for _ in range(MICROBATCHES):
                with recorder(IN_FEATURES * OUT_FEATURES // WORLD, SKIPPED) as rec:
                    mod(torch.randn(2, IN_FEATURES)).float().sum().backward()
                calls.append(rec.bytes)
            out[f"plain{'' if reshard else '_never'}_{precision}"] = [per_element(c, elements) for c in calls]
    queue.put((rank, out))
    dist.destroy_process_group()


def _worker(port: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, port, queue)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return {"ranks": [results[r] for r in range(WORLD)]}


def run_probe(timeout_s: float = 600) -> dict:
    """Runs the probe in a fresh process and returns its JSON."""
    from tests.subprocess_probe import run_json_probe

    return run_json_probe(__file__, timeout_s)


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]))), flush=True)
