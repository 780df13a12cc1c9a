"""Faults end every worker: a dead rank, the wall-clock limit, Ctrl-C and SIGTERM leave no process
behind (checked with psutil), a taken rendezvous port is handled, and the temp folders are removed.
Small 2-rank gloo runs; faults are injected with ``PLAN3D_VALIDATE_FAULT`` (planner/validate/worker.py).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from planner.presets import load_hardware, load_model  # noqa: E402
from planner.specs import Plan, Scenario, TrainingSpec  # noqa: E402
from planner.validate import launch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _scenario():
    return Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048),
                    plan=Plan(tp=2, pp=1, dp=32, micro_batch_size=1))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """Route tempfile.mkdtemp into tmp_path so that leftovers can be counted."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(("plan3d-validate-", "plan3d-calibrate-"))]


def test_a_dead_rank_ends_every_worker_and_the_temp_folder(own_tmp, monkeypatch):
    monkeypatch.setenv("PLAN3D_VALIDATE_FAULT", "1:build")
    started, groups = [], []

    def on_start(pids):
        started.append(pids)
        groups.append({os.getpgid(pid) for pid in pids})

    t0 = time.perf_counter()
    _, outcome = launch.validate_local(_scenario(), steps=1, max_ranks=2, timeout_s=90, on_start=on_start)
    assert time.perf_counter() - t0 < 60
    assert groups == [{started[0][0]}] and os.getpgid(0) != started[0][0]  # one group of their own, led by rank 0
    assert not outcome.ok and outcome.report["verdict"] == "fail"
    assert outcome.message[0].startswith("a rank failed: rank 1 exited with code 17 in phase 'build'")
    assert "furthest behind" in outcome.message[0]
    assert any("injected fault" in line for line in outcome.message)
    assert len(started) == 1 and len(started[0]) == 2
    assert not any(_alive(pid) for pid in started[0])
    assert psutil.Process().children(recursive=True) == []
    assert _leftovers(own_tmp) == []


def test_the_wall_clock_limit_kills_a_hung_rank(own_tmp, monkeypatch):
    monkeypatch.setenv("PLAN3D_VALIDATE_FAULT", "1:build:hang")
    started = []
    t0 = time.perf_counter()
    _, outcome = launch.validate_local(_scenario(), steps=1, max_ranks=2, timeout_s=8, on_start=started.append)
    assert time.perf_counter() - t0 < 25
    assert not outcome.ok and outcome.message[0].startswith("validate timed out after 8 s")
    assert not any(_alive(pid) for pid in started[0])
    assert psutil.Process().children(recursive=True) == []
    assert _leftovers(own_tmp) == []


DRIVER = """
import json, sys
from planner.validate import launch
from tests.test_validate_faults import _scenario
def started(pids):
    print(json.dumps(pids), flush=True)
launch.validate_local(_scenario(), steps=1, max_ranks=2, timeout_s=300, on_start=started)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_and_sigterm_end_every_worker(tmp_path, sig):
    env = dict(os.environ, PLAN3D_VALIDATE_FAULT="1:build:hang", TMPDIR=str(tmp_path),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)
    try:
        pids = json.loads(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not any((d / "phases" / "rank1").exists() for d in tmp_path.glob("plan3d-validate-*")):
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        assert all(_alive(pid) for pid in pids)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
    assert _leftovers(tmp_path) == []


def test_a_taken_port_is_replaced_by_a_free_one(tmp_path, monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = holder.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or _free())
        args = ["--out", str(tmp_path / "c.json"), "--quick"]
        run = launch.run_ranks("planner.validate.calibrate", args, 2, 90, tmp_path)
        assert run.status == "ok", (tmp_path / "rank0.log").read_text()[-2000:]
        assert json.loads((tmp_path / "c.json").read_text())["world"] == 2
        # a port the caller insists on is not replaced: a clear status instead of a hang
        fixed = launch.run_ranks("planner.validate.calibrate", args, 2, 90, tmp_path, port=taken)
        assert fixed.status == "port" and fixed.code == taken
        assert not any(_alive(pid) for pid in fixed.pids)


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
