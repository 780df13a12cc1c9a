"""The benchmark scripts under ``benchmarks/`` as modules, for the tests that check their data and figures.

They are scripts, not a package, so each is loaded from its file; once per test session, registered in
``sys.modules`` under ``<name>_bench`` (a dataclass looks its module up there while the class is built)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (``name`` without ``.py``)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
