"""tests/rank_pool.py, which the framework probes start their gloo ranks with: a dead or hung rank ends the attempt
with what happened instead of hanging the suite (a DeepSpeed probe hung a CI run for its whole 900 s timeout), and a
failed attempt is retried once on a fresh port. Each case runs in a process of its own (tests/rank_pool_cases.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).resolve().parent / "rank_pool_cases.py"


def _run(*args: str) -> dict:
    res = subprocess.run([sys.executable, str(CASES), *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_returns_rank_zeros_report():
    out = _run("report")
    assert out["got"]["pid"] != out["pid"] and out["got"]["port"] > 0


def test_a_dead_rank_ends_the_attempt_at_once_naming_its_exit_code():
    out = _run("dies")
    assert "{1: 3}" in out["error"]
    assert out["seconds"] < 50  # not the 60 s rank 0 would wait, nor the 120 s timeout


def test_a_hung_rank_is_stopped_and_reported():
    out = _run("hangs")
    assert "exited" in out["error"] or "no report" in out["error"]


def test_a_failed_attempt_is_retried_on_a_fresh_port(tmp_path):
    out = _run("fails-once", str(tmp_path / "flag"))
    assert out["got"]["port"] != out["got"]["first_port"]
