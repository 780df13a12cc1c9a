"""planner.validate.exit_after_run: a finished rank leaves with its exit code and its buffered output written,
without the interpreter's finalization (atexit handlers do not run)."""

import subprocess
import sys

SCRIPT = """
import atexit, sys
from planner.validate import exit_after_run
atexit.register(lambda: print("finalized"))
print("report", end="")
sys.stderr.write("log")
exit_after_run(3)
"""


def test_a_finished_rank_keeps_its_output_and_code_and_skips_finalization():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (3, "report", "log")
