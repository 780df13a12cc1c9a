"""DeepSpeed's engine on this CPU (``DS_ACCELERATOR=cpu``, one rank), asked what plan3d's DeepSpeed profile assumes
(planner/frameworks/deepspeed.py), for tests/test_deepspeed_engine.py:

* ``wrappers``: the optimizer class ``deepspeed.initialize`` wraps Adam in (or the error it raises), per model kind
  (a plain module or a one-stage ``PipelineModule``, which makes the engine a ``PipelineEngine``), ZeRO stage
  and ``data_types.grad_accum_dtype``, in bf16 (the CPU accelerator refuses fp16);
* ``buckets``: the reduce buffers a ZeRO optimizer holds during a backward, per stage, ``contiguous_gradients`` and
  ``overlap_comm`` (stage 1-2: the ``ipg_buckets`` buffers once ``setup_buckets`` has run; stage 3: its bucket's
  buffer), as ``[elements, dtype]`` pairs;
* ``zero_config``: DeepSpeed's own ``DeepSpeedZeroConfig`` parse of a few ``zero_optimization`` sections;
* ``accumulation``: what a steady micro-batch's backward (neither the step's first nor its last) runs on
  parameter-sized tensors besides the GEMMs, per optimizer wrapper: ``[name, bytes read, bytes written]`` per
  parameter element, recorded with a ``TorchDispatchMode`` around the engine's backward (the pipeline engine's
  ``BackwardPass`` instruction for a ``PipelineModule``), gradient accumulation 4, with the dtype of BF16_Optimizer's
  accumulation buffer; ``accumulation_ranks``: the ZeRO 2 and 3 cases again on two and four ranks, and the pipeline
  engine with a stage per rank, per rank.

Run as ``python tests/deepspeed_engine_probe.py PORT``; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
BUCKET = 1000  # reduce_bucket_size in the bucket cases (elements)
#: zero_optimization sections DeepSpeedZeroConfig parses, for the reader's own parse to match
ZERO_SECTIONS = [{}, {"stage": 3}, {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 2e8},
                 {"stage": 1, "contiguous_gradients": False, "reduce_bucket_size": 50000000},
                 {"stage": 3, "overlap_comm": False, "stage3_prefetch_bucket_size": 1e7, "contiguous_gradients": True},
                 # the Hugging Face Trainer's "auto" placeholders left in, and pydantic's lax booleans and integers
                 {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": "auto", "contiguous_gradients": "yes"},
                 {"stage": 3, "stage3_prefetch_bucket_size": "auto", "overlap_comm": 0, "reduce_bucket_size": "20000"},
                 {"stage": 2, "contiguous_gradients": "false", "overlap_comm": None},
                 # the ZeRO-3 coordinator's limits (planner/frameworks/deepspeed_zero3.py), also by their field names
                 {"stage": 3, "stage3_max_live_parameters": 3e8, "stage3_max_reuse_distance": 0,
                  "stage3_param_persistence_threshold": "auto"},
                 {"stage": 3, "max_live_parameters": "20000", "max_reuse_distance": 5e5,
                  "param_persistence_threshold": 0}]


def _worker(port: int) -> dict:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    deepspeed.init_distributed(dist_backend="gloo")
    seen: list = []
    setup = stage_1_and_2.DeepSpeedZeroOptimizer.setup_buckets

    def recorded(self, *args, **kwargs):  # the largest set of reduce buffers a backward holds
        out = setup(self, *args, **kwargs)
        now = [[b.numel(), str(b.dtype)] for bucket in self.ipg_buckets.values() for b in bucket.buffer]
        if sum(n for n, _ in now) > sum(n for n, _ in seen):
            seen[:] = now
        return out
    stage_1_and_2.DeepSpeedZeroOptimizer.setup_buckets = recorded

    def engine(pipe: bool, config: dict):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)]
        model = PipelineModule(layers=layers, num_stages=1, loss_fn=lambda out, _: out.float().sum()) if pipe \
            else torch.nn.Sequential(*layers)
        base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
        return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=base | config)[0]

    wrappers = []
    for pipe in (False, True):
        for stage in (0, 1, 2, 3):
            for dtype in ("bf16",):  # fp16: DeepSpeed's CPU accelerator refuses it (ValueError)
                for accum in (None, "bf16", "fp16", "fp32"):
                    config = {dtype: {"enabled": True}, "zero_optimization": {"stage": stage}}
                    if accum:
                        config["data_types"] = {"grad_accum_dtype": accum}
                    try:
                        got = type(engine(pipe, config).optimizer).__name__
                    except Exception as err:  # noqa: BLE001 - the refusal is the answer
                        got = "error " + type(err).__name__
                    wrappers.append([pipe, stage, dtype, accum, got])
    buckets = []
    for stage in (1, 2, 3):
        for contiguous in (True, False):
            for overlap in (None, True, False):
                zero = {"stage": stage, "contiguous_gradients": contiguous, "reduce_bucket_size": BUCKET}
                if overlap is not None:
                    zero["overlap_comm"] = overlap
                eng = engine(False, {"bf16": {"enabled": True}, "zero_optimization": zero})
                seen.clear()
                eng.backward(eng(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum())
                held = list(seen)
                if stage == 3:
                    held = [[b.buffer.numel(), str(b.buffer.dtype)] for b in eng.optimizer.ipg_buckets.values()
                            if b.buffer is not None]
                buckets.append([stage, contiguous, overlap, held])
    zero_config = []
    for section in ZERO_SECTIONS:
        c = DeepSpeedZeroConfig(**section)
        zero_config.append([section, {"contiguous_gradients": c.contiguous_gradients, "overlap_comm": c.overlap_comm,
                                      "reduce_bucket_size": int(c.reduce_bucket_size),
                                      "prefetch_bucket_size": int(c.prefetch_bucket_size),
                                      "max_live_parameters": int(c.max_live_parameters),
                                      "max_reuse_distance": int(c.max_reuse_distance),
                                      "param_persistence_threshold": int(c.param_persistence_threshold)}])
    return {"wrappers": wrappers, "buckets": buckets, "zero_config": zero_config,
            "accumulation": _accumulation(deepspeed, torch, PipelineModule, ACCUMULATION_CASES),
            "accumulation_ranks": {n: _on_ranks(n) for n in PARTITION_RANKS}}


def _rank_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    queue.put((rank, _accumulation(deepspeed, torch, PipelineModule, PARTITIONED_CASES)))


def _on_ranks(world: int) -> list:
    """``_accumulation`` of ``PARTITIONED_CASES`` on ``world`` ranks (fresh processes, their own rendezvous), one
    list per rank."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_worker, args=(rank, world, port, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    out = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return [out[r] for r in range(world)]


#: (pipeline engine, ZeRO stage, grad_accum_dtype) of the ``accumulation`` cases: BF16_Optimizer with its bf16 buffer
#: (the pipeline engine's default) and its fp32 one (ZeRO 1, fp32), FP16_Optimizer in bf16 (ZeRO 0 without a
#: pipeline), the ZeRO-1, ZeRO-2 and ZeRO-3 optimizers; ZeRO 2 and 3 also on two and four ranks
#: (``accumulation_ranks``), where the passes over the rank's gradient partition move 1 / N as much, and the
#: pipeline engine's BF16_Optimizer with a stage per rank
ACCUMULATION_CASES = [(True, 0, None), (False, 1, "fp32"), (False, 0, None), (False, 1, None), (False, 2, None),
                      (False, 3, None)]
PARTITIONED_CASES = [(False, 2, None), (False, 3, None), (True, 0, None)]
PARTITION_RANKS = (2, 4)
#: eight bias-free linears of 960 elements (activations of 2 x 24 and 2 x 40): on two or four ranks the gradient
#: partitions fall on whole linears, so a pass over the partition shows as 1 / N of the parameters
IN_FEATURES, OUT_FEATURES, LINEARS = 24, 40, 8
#: operations that write their operands without reading them (tests/dispatch_bytes.py)
WRITE_ONLY = ("zero_", "_foreach_zero_", "fill_")


def _accumulation(deepspeed, torch, PipelineModule, cases) -> list:
    import torch.distributed as dist
    from deepspeed.runtime.pipe import schedule

    from tests.dispatch_bytes import recorder

    numel = IN_FEATURES * OUT_FEATURES // dist.get_world_size()  # a weight, or its partition under ZeRO 3
    skipped = {"mm", "addmm", "bmm", "t", "view", "detach", "_unsafe_view", "as_strided", "alias", "transpose",
               "expand", "permute", "slice", "empty", "allreduce_", "cat", "split", "narrow", "_reduce_scatter_base_",
               "allgather_", "_allgather_base_", "reduce_scatter_"}  # GEMMs, views, the collectives

    results = []
    for pipe, stage, accum in cases:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(*((IN_FEATURES, OUT_FEATURES) if i % 2 == 0 else (OUT_FEATURES, IN_FEATURES)),
                                  bias=False) for i in range(LINEARS)]
        # a pipeline over every rank: on two, rank 0 is a first stage, whose backward clears and updates the
        # gradients itself (PipelineEngine._exec_backward_pass), the last one through the engine's backward
        model = PipelineModule(layers=layers, num_stages=dist.get_world_size(),
                               loss_fn=lambda out, _: out.float().sum()) if pipe else torch.nn.Sequential(*layers)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
        if accum:
            config["data_types"] = {"grad_accum_dtype": accum}
        eng = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)[0]
        elements = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO 3: the whole size
        per_micro = []
        if pipe:
            backward = eng._INSTRUCTION_MAP[schedule.BackwardPass]

            def recorded(self, buffer_id, backward=backward):
                with recorder(numel, skipped, write_only=WRITE_ONLY, full_names=False, dtypes=False) as rec:
                    backward(self, buffer_id)
                per_micro.append(rec.bytes)
            eng._INSTRUCTION_MAP[schedule.BackwardPass] = recorded
            eng.train_batch(data_iter=iter([(torch.randn(2, IN_FEATURES, dtype=torch.bfloat16), torch.zeros(2))] * 4))
        else:
            for _ in range(4):
                loss = eng(torch.randn(2, IN_FEATURES, dtype=torch.bfloat16)).float().sum()
                with recorder(numel, skipped, write_only=WRITE_ONLY, full_names=False, dtypes=False) as rec:
                    eng.backward(loss)
                per_micro.append(rec.bytes)
                eng.step()
        steady = per_micro[1]  # the second of four: after the first, before the boundary
        assert steady == per_micro[2], (per_micro[1], per_micro[2])
        flat = getattr(eng.optimizer, "fp32_groups_gradients_flat", None)  # BF16_Optimizer's accumulation buffer
        results.append([pipe, stage, accum, type(eng.optimizer).__name__,
                        str(flat[0].dtype).split(".")[-1] if flat else None,
                        sorted([name, r / elements, w / elements] for name, (r, w) in steady.items())])
    return results


def run_probe(timeout_s: float = 900) -> dict:
    """Runs the probe in a fresh process and returns its JSON."""
    from tests.subprocess_probe import run_json_probe

    return run_json_probe(__file__, timeout_s)


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]))), flush=True)
