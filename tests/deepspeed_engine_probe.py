"""DeepSpeed's engine on this CPU (``DS_ACCELERATOR=cpu``, one rank), asked what plan3d's DeepSpeed profile assumes
(planner/frameworks/deepspeed.py), for tests/test_deepspeed_engine.py:

* ``wrappers``: the optimizer class ``deepspeed.initialize`` wraps Adam in (or the error it raises), per model kind
  (a plain module or a one-stage ``PipelineModule``, which makes the engine a ``PipelineEngine``), ZeRO stage
  and ``data_types.grad_accum_dtype``, in bf16 (the CPU accelerator refuses fp16);
* ``buckets``: the reduce buffers a ZeRO optimizer holds during a backward, per stage, ``contiguous_gradients`` and
  ``overlap_comm`` (stage 1-2: the ``ipg_buckets`` buffers once ``setup_buckets`` has run; stage 3: its bucket's
  buffer), as ``[elements, dtype]`` pairs;
* ``zero_config``: DeepSpeed's own ``DeepSpeedZeroConfig`` parse of a few ``zero_optimization`` sections.

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
    return {"wrappers": wrappers, "buckets": buckets, "zero_config": zero_config}


def run_probe(timeout_s: float = 900) -> dict:
    """Runs the probe in a fresh process and returns its JSON."""
    from tests.subprocess_probe import run_json_probe

    return run_json_probe(__file__, timeout_s)


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]))), flush=True)
