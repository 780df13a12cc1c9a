"""Start a few gloo ranks as spawned processes on this CPU and collect what rank 0 reports, for the probes that
measure a framework's own code (tests/deepspeed_states_probe.py, tests/megatron_states_probe.py).

Each attempt takes a fresh free port (a port chosen once and reused, or ``port + k``, can be taken by another
process's ephemeral connection by the time the next group binds it); a rank that dies ends the attempt at once
instead of leaving its peers waiting in the rendezvous; a rank that hangs prints every thread's stack to stderr
(``faulthandler``) and exits, so a failure names where it stopped. The ranks are killed on the way out either way.
A failed attempt is retried once on a new port; a second failure raises with what happened."""

from __future__ import annotations

import faulthandler
import queue as queue_module
import socket
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap(target, hang_s: float, rank: int, port: int, args: tuple, results) -> None:
    faulthandler.dump_traceback_later(hang_s, exit=True)  # a hung rank leaves its stacks on stderr and exits (code 1)
    target(rank, port, *args, results)


def run_ranks(target, ranks: int, args: tuple = (), timeout_s: float = 300, attempts: int = 2):
    """Runs ``target(rank, port, *args, queue)`` on ``ranks`` spawned processes; returns the first object put on
    ``queue`` (rank 0's report). ``target`` must be a module-level function (spawn pickles it by name)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    failure = ""
    for attempt in range(attempts):
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_bootstrap, args=(target, timeout_s, r, port, tuple(args), results))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + 30
        try:
            while True:
                try:
                    got = results.get(timeout=1)
                except queue_module.Empty:
                    dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                    if dead:
                        failure = f"ranks {dead} exited (rank: exit code) before rank 0 reported"
                    elif all(p.exitcode == 0 for p in procs):
                        failure = "every rank exited without a report"
                    elif time.monotonic() > deadline:
                        failure = f"no report within {timeout_s:.0f} s"
                    else:
                        continue
                    break
                for p in procs:
                    p.join(timeout=60)
                return got
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        print(f"rank_pool: attempt {attempt + 1} on port {port}: {failure}", file=sys.stderr, flush=True)
    raise RuntimeError(f"{ranks} ranks of {target.__name__} failed {attempts} times; last: {failure}")
