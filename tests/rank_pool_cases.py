"""Rank targets for tests/test_rank_pool.py, run in a process of their own (``python tests/rank_pool_cases.py CASE
[ARG]``, one JSON line out): multiprocessing's spawn context starts a resource-tracker process that lives as long
as the process that made it, and pytest's own process must end each test without children
(tests/test_validate_faults.py checks that), so the pool is never started inside it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.rank_pool import run_ranks  # noqa: E402


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


CASES = {"report": (_report_port, (), 60, 2), "dies": (_rank_one_dies, (), 120, 1), "hangs": (_hang, (), 3, 1),
         "fails-once": (_fail_once, None, 60, 2)}


def main(case: str, arg: str | None = None) -> dict:
    target, args, timeout_s, attempts = CASES[case]
    t0 = time.monotonic()
    try:
        got = run_ranks(target, 2, (arg,) if args is None else args, timeout_s=timeout_s, attempts=attempts)
        return {"got": got, "pid": os.getpid(), "seconds": time.monotonic() - t0}
    except RuntimeError as err:
        return {"error": str(err), "seconds": time.monotonic() - t0}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
