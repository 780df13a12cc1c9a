"""The search tables built over worker processes (planner.search.build_tables, ``PLAN3D_WORKERS``) are the tables
built in one process, entry for entry; the worker count and the chunks follow their rules."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from planner.candidates import SearchSpace
from planner.errors import SpecError
from planner.presets import load_hardware, load_model
from planner.search import (PARALLEL_MIN_SHAPES, PARALLEL_MIN_STEPS, _shape_chunks, build_tables, can_fork_workers,
                            search, simulation_workers, table_shapes, table_workers)
from planner.specs import TrainingSpec

JOBS = [  # (model, GPUs, global batch, seq, framework): a MoE model's expert shapes; torchtitan's zero-bubble
    ("tiny-moe", 64, 256, 1024, "megatron"),  # schedules, whose bubbles are simulated after the shapes (owed),
    # over the workers too (build_tables's workers)
    ("llama3-8b", 32, 256, 4096, "torchtitan"),
]


# Run in a fresh interpreter: one Python thread there, so the workers are forked (in the test process, threads
# other tests leave alive would keep the tables in one process and the comparison would test nothing)
COMPARE = """
import json, sys
import numpy as np
from planner.candidates import SearchSpace
from planner.presets import load_hardware, load_model
from planner.search import build_tables, can_fork_workers
from planner.specs import TrainingSpec
name, gpus, batch, seq, framework = json.loads(sys.argv[1])
model, hw = load_model(name), load_hardware("h100-sxm-80gb").for_job(gpus)
training = TrainingSpec(num_gpus=gpus, global_batch_size=batch, seq_len=seq, precision="bf16", framework=framework)
one = build_tables(model, hw, training, SearchSpace(), workers=1)
three = build_tables(model, hw, training, SearchSpace(), workers=3)
print(json.dumps({"forked": can_fork_workers(), "shapes": len(one.shapes), "legal": int(one.legal.sum()),
                  "same_keys": one.shapes == three.shapes and one.micros == three.micros and one.zeros == three.zeros,
                  "time": bool(np.array_equal(one.time_ns, three.time_ns)),
                  "mem": bool(np.array_equal(one.mem_kib, three.mem_kib)),
                  "legal_same": bool(np.array_equal(one.legal, three.legal))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the table workers are forked on Linux only")
@pytest.mark.parametrize("name,gpus,batch,seq,framework", JOBS)
def test_workers_build_the_same_tables(name, gpus, batch, seq, framework):
    res = subprocess.run([sys.executable, "-c", COMPARE, json.dumps([name, gpus, batch, seq, framework])],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["forked"], "a fresh interpreter should fork the table workers"
    assert got["shapes"] > 10 and got["legal"] > 0
    assert got["same_keys"] and got["time"] and got["mem"] and got["legal_same"], got


def test_chunks_cover_every_shape_once_and_keep_factor_groups_together():
    model, hw = load_model("tiny-moe"), load_hardware("h100-sxm-80gb").for_job(64)
    training = TrainingSpec(num_gpus=64, global_batch_size=256, seq_len=1024, precision="bf16")
    shapes = table_shapes(model, hw, training, SearchSpace())
    assert shapes == build_tables(model, hw, training, SearchSpace(), workers=1).shapes
    chunks = _shape_chunks(shapes, 4)
    assert 1 < len(chunks) <= 4
    assert sorted(i for c in chunks for i in c) == list(range(len(shapes)))
    owner = {}
    for k, chunk in enumerate(chunks):
        for i in chunk:
            tp, cp, _, _, ep, etp = shapes[i]
            assert owner.setdefault((tp, cp, ep, etp), k) == k
    sizes = [len(c) for c in chunks]
    biggest_group = max(sum(1 for s in shapes if (s[0], s[1], s[4], s[5]) == key) for key in owner)
    assert max(sizes) - min(sizes) <= biggest_group  # greedy: no chunk outgrows another by more than a group


def test_worker_count_rules(monkeypatch):
    monkeypatch.delenv("PLAN3D_WORKERS", raising=False)
    assert table_workers(PARALLEL_MIN_SHAPES - 1) == 1
    assert table_workers(PARALLEL_MIN_SHAPES) == (min(len(__import__("os").sched_getaffinity(0)), 16)
                                                  if can_fork_workers() else 1)
    # the zero-bubble simulations: by the length of their programs
    assert simulation_workers(PARALLEL_MIN_STEPS - 1) == 1
    assert simulation_workers(PARALLEL_MIN_STEPS) == table_workers(PARALLEL_MIN_SHAPES)
    monkeypatch.setenv("PLAN3D_WORKERS", "1")
    assert table_workers(10**6) == 1 and simulation_workers(10**9) == 1
    monkeypatch.setenv("PLAN3D_WORKERS", "3")
    assert table_workers(5) == (3 if can_fork_workers() else 1)
    assert simulation_workers(5) == (3 if can_fork_workers() else 1)
    for bad in ("many", "0", "-2", "1.5"):
        monkeypatch.setenv("PLAN3D_WORKERS", bad)
        with pytest.raises(SpecError, match=f"PLAN3D_WORKERS: '{bad}' is not a process count"):
            table_workers(5)


def test_another_thread_keeps_the_tables_in_this_process(monkeypatch):
    """A fork copies only its calling thread, so with another thread alive no worker is forked."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork_workers()
        monkeypatch.setenv("PLAN3D_WORKERS", "4")
        assert table_workers(10**6) == 1
        model, hw = load_model("tiny-moe"), load_hardware("h100-sxm-80gb")
        training = TrainingSpec(num_gpus=64, global_batch_size=256, seq_len=1024, precision="bf16")
        assert search(model, hw, training).best is not None
    finally:
        stop.set()
        thread.join()


def test_bad_worker_count_is_a_one_line_cli_error(monkeypatch):
    from typer.testing import CliRunner

    from planner.cli import app

    monkeypatch.setenv("PLAN3D_WORKERS", "many")
    r = CliRunner().invoke(app, ["search", "--model", "tiny-moe", "--hardware", "h100-sxm-80gb", "--gpus", "64",
                                 "--global-batch", "256", "--seq-len", "1024", "--json"])
    assert r.exit_code == 2
    assert "PLAN3D_WORKERS" in r.output and "Traceback" not in r.output


# A worker killed (the OOM killer, say) in the table phase or in the simulations: the parent's own calls run as usual,
# and the tables must come out as one process builds them. {module}.{name} is the function each worker runs.
BROKEN = """
import json, os
import numpy as np
import planner.cost as C
import planner.search as S
from planner.candidates import SearchSpace
from planner.presets import load_hardware, load_model
from planner.specs import TrainingSpec
parent, original = os.getpid(), {module}.{name}
def dying(arg):
    if os.getpid() != parent:
        os._exit(9)
    return original(arg)
{module}.{name} = dying
model, hw = load_model("{model}"), load_hardware("h100-sxm-80gb").for_job({gpus})
training = TrainingSpec(num_gpus={gpus}, global_batch_size=256, seq_len={seq}, precision="bf16", framework="{framework}")
one = S.build_tables(model, hw, training, SearchSpace(), workers=1)
broken = S.build_tables(model, hw, training, SearchSpace(), workers=2)
print(json.dumps({{"forked": S.can_fork_workers(), "same": bool(np.array_equal(one.time_ns, broken.time_ns)
                  and np.array_equal(one.mem_kib, broken.mem_kib) and np.array_equal(one.legal, broken.legal))}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers are forked on Linux only")
@pytest.mark.parametrize("module,name,model,gpus,seq,framework", [
    ("S", "_fill_tables_job", "tiny-moe", 64, 1024, "megatron"),  # the table workers
    ("C", "simulate_task", "llama3-8b", 32, 4096, "torchtitan"),  # the zero-bubble simulations' workers
], ids=["tables", "simulations"])
def test_a_killed_worker_leaves_its_work_to_this_process(module, name, model, gpus, seq, framework):
    script = BROKEN.format(module=module, name=name, model=model, gpus=gpus, seq=seq, framework=framework)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"forked": True, "same": True}
