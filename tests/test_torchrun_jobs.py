"""tests/torchrun_jobs.py's rule for retrying a torchrun job: a rank killed by SIGABRT with no Python
traceback of its own. torchrun prints its own traceback (ChildFailedError) whenever a rank fails; the form below
is what a run of test_validate_bf16.py printed here on 2026-12-03 (its 2-rank job: rank 1 aborted after the PASS)."""

import subprocess

import torchrun_jobs
from torchrun_jobs import native_abort

LAUNCHER = """E1203 16:45:02.465000 21065 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/v/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 21071)  (SIGABRT)
  traceback : Signal 6 (SIGABRT) received by PID 21071
"""
RANK_ERROR = """Traceback (most recent call last):
  File "/w/planner/validate/worker.py", line 500, in main
    loss.backward()
RuntimeError: Connection closed by peer
"""


def _res(code, stderr):
    return subprocess.CompletedProcess(args=[], returncode=code, stdout="", stderr=stderr)


def test_an_abort_with_only_torchruns_own_traceback_is_retried():
    assert native_abort(_res(1, LAUNCHER))


def test_a_rank_that_raised_is_not_retried():
    assert not native_abort(_res(1, RANK_ERROR + LAUNCHER))
    assert not native_abort(_res(1, LAUNCHER.replace("(SIGABRT)", "(SIGSEGV)")))
    assert not native_abort(_res(0, LAUNCHER))


def _starts(monkeypatch, results):
    """run_torchrun against a scripted sequence of job results; the number of starts it made."""
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return results[len(calls) - 1]

    monkeypatch.setattr(torchrun_jobs.subprocess, "run", fake_run)
    res = torchrun_jobs.run_torchrun(["torchrun"], timeout=1)
    return res, len(calls)


def test_two_aborts_in_a_row_are_retried_until_the_job_passes(monkeypatch):
    res, starts = _starts(monkeypatch, [_res(1, LAUNCHER), _res(1, LAUNCHER), _res(0, "")])
    assert (res.returncode, starts) == (0, 3)


def test_retries_stop_after_the_last_allowed_start(monkeypatch):
    aborts = [_res(1, LAUNCHER)] * (torchrun_jobs.NATIVE_ABORT_RETRIES + 2)
    res, starts = _starts(monkeypatch, aborts)
    assert (res.returncode, starts) == (1, torchrun_jobs.NATIVE_ABORT_RETRIES + 1)


def test_a_rank_error_is_returned_at_the_first_start(monkeypatch):
    res, starts = _starts(monkeypatch, [_res(1, RANK_ERROR + LAUNCHER), _res(0, "")])
    assert (res.returncode, starts) == (1, 1)
