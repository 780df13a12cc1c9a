"""tests/rank_pool.py, which the framework probes start their gloo ranks with: a dead or hung rank ends the attempt
with what happened instead of hanging the suite (a DeepSpeed probe hung a CI run for its whole 900 s timeout), and a
failed attempt is retried once on a fresh port."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.rank_pool import run_ranks


def _report_port(rank: int, port: int, queue) -> None:
    if rank == 0:
        queue.put({"port": port, "pid": os.getpid()})


def _rank_one_dies(rank: int, port: int, queue) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(60)  # rank 0 waits, as a rank waits in a rendezvous for a peer that is gone


def _hang(rank: int, port: int, queue) -> None:
    time.sleep(600)


def _fail_once(rank: int, port: int, flag: str, queue) -> None:
    if rank == 0:
        if not Path(flag).exists():
            Path(flag).write_text(str(port))
            os._exit(5)
        queue.put({"port": port, "first_port": int(Path(flag).read_text())})


def test_returns_rank_zeros_report():
    got = run_ranks(_report_port, 2, timeout_s=60)
    assert got["pid"] != os.getpid() and got["port"] > 0


def test_a_dead_rank_ends_the_attempt_at_once_naming_its_exit_code():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\{1: 3\}"):
        run_ranks(_rank_one_dies, 2, timeout_s=120, attempts=1)
    assert time.monotonic() - t0 < 50  # not the 60 s rank 0 would wait, nor the 120 s timeout


def test_a_hung_rank_is_stopped_and_reported():
    with pytest.raises(RuntimeError, match="exited|no report"):
        run_ranks(_hang, 2, timeout_s=3, attempts=1)


def test_a_failed_attempt_is_retried_on_a_fresh_port(tmp_path):
    got = run_ranks(_fail_once, 2, (str(tmp_path / "flag"),), timeout_s=60)
    assert got["port"] != got["first_port"]
