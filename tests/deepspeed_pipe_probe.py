"""DeepSpeed's pipeline engine on this CPU (``DS_ACCELERATOR=cpu``, gloo), asked which stage-boundary tensors it
holds besides the model's own saved activations, for tests/test_deepspeed_pipe_buffers.py.

Each case trains one step of a ``PipelineModule`` of identical blocks (``h -> h`` linears, so every stage boundary
is one ``mbs x s x h`` tensor) over ``pp`` ranks with ``m`` micro-batches (DeepSpeed's ``TrainSchedule``). After every
pipeline instruction (``PipelineEngine._INSTRUCTION_MAP``) the probe adds up, per rank, the distinct storages the
engine itself references: ``pipe_buffers`` (``inputs``, ``outputs``, ``output_tensors``), ``pipe_recv_buf`` and
``grad_layer``; a storage the model's autograd graph saved is still counted (the first block saves its input: the
probe reports that apart). It reports the most held over the step, in boundary tensors, and the most micro-batches
in flight (forwards without their backward yet).

Run as ``python tests/deepspeed_pipe_probe.py PORT``; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

H, S, MBS = 32, 8, 2  # the boundary: MBS x S x H fp32 = 2 KiB
#: (pp, micro-batches, tp): tp > 1 makes the engine partition what it sends over the model-parallel ranks; pp 1 is
#: the engine on one stage (Megatron-DeepSpeed builds a PipelineModule unless --no-pipeline-parallel)
#: (``pipe_partitioned`` / ``grad_partitioned``, on by default, active where the grid is model-parallel)
CASES = ((1, 4, 1), (2, 1, 1), (2, 4, 1), (3, 2, 1), (3, 6, 1), (4, 8, 1), (2, 4, 2), (3, 6, 2))


def _held_bytes(engine, torch) -> dict:
    """Bytes of the distinct storages the engine references, by where it keeps them."""
    seen, by = set(), {}

    def add(where, x):
        if isinstance(x, (list, tuple)):
            for y in x:
                add(where, y)
        elif torch.is_tensor(x) and x.numel() > 1 and x.is_floating_point():  # ints: metadata, token ids
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                by[where] = by.get(where, 0) + x.untyped_storage().nbytes()

    for key in ("inputs", "outputs", "output_tensors", "labels"):
        for x in engine.pipe_buffers.get(key, []):
            add(key, x)
    add("recv_buf", engine.pipe_recv_buf)
    add("grad_layer", engine.grad_layer)
    return by


def _rank(rank: int, world: int, port: int, pp: int, m: int, tp: int, out) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(H, H)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
    model = PipelineModule(layers=[Block() for _ in range(2 * pp)], topology=topology,
                           loss_fn=lambda out, labels: ((out - labels) ** 2).mean(), partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": m,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=config)[0]
    peak = {"held": 0, "in_flight": 0, "at_peak": {}}
    forwards, backwards = [0], [0]
    for name, fn in list(PipelineEngine._INSTRUCTION_MAP.items()):
        def wrapped(self, *args, _fn=fn, _name=name.__name__, **kwargs):
            result = _fn(self, *args, **kwargs)
            if _name == "ForwardPass":
                forwards[0] += 1
            if _name == "BackwardPass":
                backwards[0] += 1
            by = _held_bytes(self, torch)
            by.pop("labels", None)  # the data: a language model's labels and first-stage inputs are token ids
            if self.is_first_stage():
                by.pop("inputs", None)
            if sum(by.values()) > peak["held"]:
                peak["held"], peak["at_peak"] = sum(by.values()), by
            peak["in_flight"] = max(peak["in_flight"], forwards[0] - backwards[0])
            return result
        PipelineEngine._INSTRUCTION_MAP[name] = wrapped

    def batches():
        while True:
            x = torch.randn(MBS, S, H)
            yield x, torch.zeros_like(x)

    engine.train_batch(data_iter=batches())
    boundary = MBS * S * H * 4
    out.put((rank, {"stage": engine.stage_id, "held_boundaries": peak["held"] / boundary, "in_flight": peak["in_flight"],
                    "at_peak": {k: v / boundary for k, v in peak["at_peak"].items()}}))


def _worker(port: int) -> dict:
    import torch.multiprocessing as mp

    results = {}
    for i, (pp, m, tp) in enumerate(CASES):
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        world = pp * tp
        procs = [ctx.Process(target=_rank, args=(r, world, port + 1 + i, pp, m, tp, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        results[f"pp{pp}_m{m}_tp{tp}"] = [got[r] for r in range(world)]
    return results


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]))), flush=True)
