"""Wall time of the CP-SAT search against brute-force enumeration, side by side, and of the whole CLI.

Run: python benchmarks/search_speed.py [--repeats N] [--case MODEL]

Cases (issue 5): GPT 1T on 3072 A100-80GB (global batch 3072, seq 2048); Llama-3-405B on 16384
H100 (global batch 2048, seq 8192); GPT-3 175B on 1024 H100 (global batch 1536, seq 2048);
(issue 12) Llama-3-70B on 256 H100 (global batch 512, seq 8192); (issue 16) DeepSeek-V3 on 2048 H100
(global batch 15360, seq 4096: the DeepSeek-V3 report's final batch, arXiv:2412.19437 section 4.2), with
EP and ETP searched (its brute force is left out: it enumerates millions of plans). torchtitan, whose
search also offers torch's zero-bubble schedules (their bubbles simulated from the action lists, one
run per action program for all shapes: cost.ZeroBubbleBatch): Llama-3-8B on 64 H100 (global batch
512, seq 8192) and Mixtral-8x7B on 128 H100 (global batch 1024, seq 4096); no brute force for
either (the reference estimate simulates every plan's schedule alone: over 10 minutes).

- "search" is planner.search.search: table building + CP-SAT, no alternatives (median of N runs), with the
  tables built over ``planner.search.table_workers`` processes (printed as "workers"; this machine's CPUs
  from ``PARALLEL_MIN_SHAPES`` shapes on) and the zero-bubble simulations over
  ``planner.search.simulation_workers`` (this machine's CPUs from ``PARALLEL_MIN_STEPS`` program steps on).
- "CP-SAT" is the solver call alone, inside that.
- "exhaustive" is planner.search.exhaustive: every legal plan through the reference estimate_time
  and estimate_memory (median of 1 run by default; it is slow).
- "plan3d search" is the whole process, `plan3d search ... --json --top 0`, interpreter start included; "1 process"
  the same with ``PLAN3D_WORKERS=1`` (a fresh process each, so no memoised term is warm from an earlier run).
Both must return the same step time; the script checks that.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.cost import estimate_time  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.candidates import SearchSpace  # noqa: E402
from planner.search import exhaustive, search, table_shapes, table_workers  # noqa: E402
from planner.specs import TrainingSpec  # noqa: E402

CASES = [
    ("megatron-gpt-1t", "a100-80gb", 3072, 3072, 2048),
    ("llama3-405b", "h100-sxm-80gb", 16384, 2048, 8192),
    ("gpt3-175b", "h100-sxm-80gb", 1024, 1536, 2048),
    ("llama3-70b", "h100-sxm-80gb", 256, 512, 8192),
    ("deepseek-v3", "h100-sxm-80gb", 2048, 15360, 4096),
    ("llama3-8b", "h100-sxm-80gb", 64, 512, 8192, "torchtitan"),
    ("mixtral-8x7b", "h100-sxm-80gb", 128, 1024, 4096, "torchtitan"),
]
NO_BRUTE_FORCE = {"deepseek-v3", "llama3-8b", "mixtral-8x7b"}  # torchtitan: every plan simulated alone


def timed(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def cli_wall(name, hw, gpus, batch, seq, repeats, framework="megatron", workers=None):
    cmd = [sys.executable, "-m", "planner.cli", "search", "--model", name, "--hardware", hw, "--gpus", str(gpus),
           "--global-batch", str(batch), "--seq-len", str(seq), "--framework", framework, "--json", "--top", "0"]
    env = {**os.environ, **({"PLAN3D_WORKERS": str(workers)} if workers else {})}
    return timed(lambda: subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env), repeats)[0]


def main() -> None:
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 5
    print(f"{'case':42s} {'search s':>9s} {'workers':>7s} {'CP-SAT s':>9s} {'exhaustive s':>13s} "
          f"{'speed-up':>9s} {'plan3d search s':>16s} {'1 process s':>11s} {'plans':>7s}")
    only = sys.argv[sys.argv.index("--case") + 1] if "--case" in sys.argv else None
    for name, hw_name, gpus, batch, seq, *fw in CASES:
        if only and name != only:
            continue
        framework = fw[0] if fw else "megatron"
        model, hw = load_model(name), load_hardware(hw_name)
        tr = TrainingSpec(num_gpus=gpus, global_batch_size=batch, seq_len=seq, framework=framework)
        search_s, res = timed(lambda: search(model, hw, tr), repeats)
        workers = table_workers(len(table_shapes(model, hw.for_job(gpus), tr, SearchSpace())))
        solver_s = statistics.median(search(model, hw, tr).solver_s for _ in range(repeats))
        if name in NO_BRUTE_FORCE:
            brute_s, n = float("nan"), res.candidates
            print(f"{name}: best {res.best.label() if res.best else None} ({res.status}), "
                  f"{res.candidates} legal combinations, CP-SAT {solver_s:.3f} s")
        else:
            brute_s, (plan, brute_t, n) = timed(lambda: exhaustive(model, hw, tr), 1)
            got = estimate_time(model, hw, tr, res.best).step_time_s
            assert abs(got / brute_t - 1) < 1e-6, f"{name}: solver {got} != exhaustive {brute_t}"
        cli_s = cli_wall(name, hw_name, gpus, batch, seq, max(1, repeats // 2), framework)
        serial_s = cli_wall(name, hw_name, gpus, batch, seq, max(1, repeats // 2), framework, workers=1)
        case = f"{name} on {gpus} x {hw_name}" + (f" ({framework})" if fw else "")
        print(f"{case:42s} {search_s:9.3f} {workers:7d} {solver_s:9.3f} {brute_s:13.2f} "
              f"{brute_s / search_s:8.1f}x {cli_s:16.3f} {serial_s:11.3f} {n:7d}")
    print("\nTarget: CP-SAT under 1 s per case on a 2-core machine, whole `plan3d search` under 2 s.")


if __name__ == "__main__":
    main()
