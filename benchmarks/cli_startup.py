"""`plan3d --help` as a whole process: the target is under 0.5 s (issue 17).

Prints the median and the best of ten runs of ``python -m planner.cli --help`` (and of
``plan3d models``, which loads every preset). Run: ``python benchmarks/cli_startup.py``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.5


def timed(argv: list[str], runs: int = 10) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "planner.cli", *argv], cwd=ROOT, capture_output=True, check=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    worst_median = 0.0
    for argv in (["--help"], ["search", "--help"], ["models"]):
        runs = timed(argv)
        med = statistics.median(runs)
        worst_median = max(worst_median, med) if argv != ["models"] else worst_median
        print(f"plan3d {' '.join(argv):<16} median {med:.3f} s, best {min(runs):.3f} s over {len(runs)} runs")
    verdict = "meets" if worst_median < TARGET_S else "MISSES"
    print(f"--help {verdict} the {TARGET_S} s target (worst median {worst_median:.3f} s)")
    return 0  # a benchmark prints figures; it does not fail the run


if __name__ == "__main__":
    sys.exit(main())
