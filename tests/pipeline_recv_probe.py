"""A 2-rank gloo pipeline on this CPU (torch.distributed.pipelining ``PipelineStage`` + ``Schedule1F1B``):
after one training step, the receive buffers each stage holds, counted as distinct storages
(``args_recv_info`` for its inputs, ``grad_recv_info`` for its output's gradient), for
tests/test_pipeline_buffers.py; and the outputs each stage keeps after ``step()`` and ``step(return_outputs=False)``,
for tests/test_pipeline_kept_outputs.py. Run as ``python tests/pipeline_recv_probe.py RANK STORE OUT M``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORLD = 2


def _worker(rank: int, store: str, out: str, m: int) -> None:
    import inspect

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    dim, rows = 8, 2
    stage = PipelineStage(nn.Linear(dim, dim), rank, WORLD, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, target = torch.randn(rows * m, dim), torch.randn(rows * m, dim)
    args, kwargs = (x,) if rank == 0 else (), {"target": target} if rank == WORLD - 1 else {}
    returned = sched.step(*args, **kwargs)  # torch's default: return_outputs=True
    # what the stage keeps after the step (planner.memory.pipeline_kept_output_bytes): its output_chunks, and on the
    # last stage the rows of what step() returned (their concatenation)
    kept_default = {"kept": len(stage.output_chunks),
                    "returned_rows": int(returned.shape[0]) if returned is not None else 0}

    def storages(infos):
        return {info.buffer.untyped_storage().data_ptr() for per_mb in infos.values() for info in per_mb
                if getattr(info, "buffer", None) is not None}

    found = {"input": len(storages(stage.args_recv_info)), "grad": len(storages(stage.grad_recv_info)),
             "default": kept_default}
    if "return_outputs" in inspect.signature(sched.step).parameters:  # torchtitan 0.3.0 passes False
        returned = sched.step(*args, **kwargs, return_outputs=False)
        found["return_outputs_false"] = {"kept": len(stage.output_chunks),
                                         "returned_rows": int(returned.shape[0]) if returned is not None else 0}
    Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def run_probe(microbatches: int) -> dict:
    """{rank: {"input": buffers, "grad": buffers, "default": kept outputs, "return_outputs_false": kept outputs}}
    after one step of ``microbatches`` micro-batches (the last key where torch's step has ``return_outputs``)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, str(r), f"{tmp}/store", f"{tmp}/{r}.json",
                                   str(microbatches)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(WORLD)]
        try:
            for proc in procs:
                log, _ = proc.communicate(timeout=120)
                assert proc.returncode == 0, log.decode()[-3000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        return {r: json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(WORLD)}


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
