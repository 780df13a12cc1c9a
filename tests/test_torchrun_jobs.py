"""tests/torchrun_jobs.py's rule for retrying a torchrun job once: a rank killed by SIGABRT with no Python
traceback of its own. torchrun prints its own traceback (ChildFailedError) whenever a rank fails; the form below
is what a run of test_validate_bf16.py printed here on 2026-12-03 (its 2-rank job: rank 1 aborted after the PASS)."""

import subprocess

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
