"""The search tables against ``estimate``, entry by entry: how many legal entries of each job's tables hold another
step time (beyond 2 ns) or another fullest-stage memory (beyond 2 KiB) than ``cost.estimate_time`` and
``memory.estimate_memory`` give for the same plan.

Run: python benchmarks/tables_vs_estimate.py [--entries N]

tests/test_search_tables_sweep.py asserts the same on a seeded sample of 120 entries per job, which is what CI can
afford. This walks up to N entries per job (default 1,000; every entry where there are fewer), over the test's jobs
and four larger MoE and dense ones, so that a term applied in one path and not the other shows up even where it
touches a small share of the entries. Two such gaps were found this way (2026-12-06): the MoE all-to-all overlap's
lone micro-batches applied per layer (448 of 5,856 entries), and tables built on a profile without the job's NVLink
domain (most MoE entries at 128 GB200 GPUs). Exit status 1 when any entry differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.candidates import Pins, SearchSpace  # noqa: E402
from planner.cost import estimate_time  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.presets import load_hardware  # noqa: E402
from planner.search import INFEASIBLE, KIB, build_tables  # noqa: E402
from planner.specs import TrainingSpec  # noqa: E402


def _sweep_module():
    """tests/test_search_tables_sweep.py: its JOBS and its model names ("+padded": drop-and-pad routing)."""
    spec = importlib.util.spec_from_file_location("tables_sweep", ROOT / "tests/test_search_tables_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MORE_JOBS = [  # (model, hardware, job, pins, largest micro-batch, largest cp), as the test's JOBS
    ("deepseek-v3", "h100-sxm-80gb", dict(num_gpus=256, global_batch_size=512, seq_len=4096, precision="fp8",
                                          moe_a2a_overlap=True), Pins(pp=8), 1, 1),
    ("gpt-oss-120b", "b200-180gb", dict(num_gpus=64, global_batch_size=256, seq_len=4096, framework="nemo",
                                        moe_a2a_overlap=True, recompute_modules=("layernorm", "moe_act")), Pins(), 2, 1),
    ("qwen3-235b-a22b", "gb200-nvl72", dict(num_gpus=128, global_batch_size=256, seq_len=4096, precision="mxfp8",
                                            moe_token_dispatcher="deepep",
                                            cuda_graph_modules=("attn", "moe_router", "moe_preprocess")), Pins(), 2, 1),
    ("llama3-70b", "h100-sxm-80gb", dict(num_gpus=64, global_batch_size=128, seq_len=8192, framework="nemo"),
     Pins(), 2, 4),
]


def compare(model, hw, training, space, entries: int, seed: int) -> tuple[int, int, int, int, list[str]]:
    """(legal entries, entries compared, time mismatches, memory mismatches, the first few plans that differ)."""
    tables = build_tables(model, hw, training, space)
    legal = np.flatnonzero(tables.legal.ravel())
    pick = legal if legal.size <= entries else np.random.default_rng(seed).choice(legal, entries, replace=False)
    bad_t = bad_m = 0
    first = []
    for k in pick:
        plan = tables.plan(int(k))
        s, u, z = tables.unindex(int(k))
        t = tables.time_ns[s, u, z]
        if t < INFEASIBLE and abs(t - estimate_time(model, hw, training, plan).step_time_s * 1e9) > 2:
            bad_t += 1
            first.append(f"time {plan.label()}")
        peak = max(st.total_bytes for st in estimate_memory(model, hw, training, plan).stages)
        if abs(int(tables.mem_kib[s, u, z].max()) * KIB - peak) > 2 * KIB:
            bad_m += 1
            first.append(f"memory {plan.label()}")
    return legal.size, len(pick), bad_t, bad_m, first[:3]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1000, help="entries compared per job at most")
    args = ap.parse_args()
    sweep = _sweep_module()
    worst = 0
    for i, (name, hw_name, job, pins, mbs, cp) in enumerate(sweep.JOBS + MORE_JOBS):
        t0 = time.perf_counter()
        space = SearchSpace(pins=pins, max_micro_batch_size=mbs, max_cp=cp)
        legal, n, bad_t, bad_m, first = compare(sweep._model(name), load_hardware(hw_name), TrainingSpec(**job), space,
                                                args.entries, i)
        worst = max(worst, bad_t + bad_m)
        print(f"{name:22s} {hw_name:14s} {n:5d} of {legal:6d} entries: {bad_t} step times and {bad_m} memories differ"
              f" ({time.perf_counter() - t0:.0f} s){'  ' + '; '.join(first) if first else ''}")
    print("the tables are the estimate on every entry compared" if not worst else "ENTRIES DIFFER")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
