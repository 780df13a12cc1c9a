"""Blackwell's sustained fraction, fitted per die on NVIDIA's dense Megatron-Bridge runs and checked on runs it
was not fitted on (issue 12 item 4: a fitted constant is fitted on the project's benchmark data, with its
leave-one-family-out error printed).

Run: python benchmarks/blackwell_sustained.py

``sustained_fraction`` is the share of the burst GEMM rate (MAMF) a GPU holds through a long run (power-capped
clocks, kernel gaps): the A100 value (0.87, Narayanan/Korthikanti runs) was carried to Blackwell unfitted, and
Hopper has its own (0.82, NeMo 24.07). Here it is fitted once per die on the dense Llama-3 runs of the
Megatron-Bridge performance summary (benchmarks/data/megatron_bridge_perf.json):

* B200 die: DGX-B200 (1,000 W) and GB200 NVL72 (1,200 W);
* B300 die (Blackwell Ultra): DGX-B300 and GB300 NVL72 (1,400 W).

The value minimises the mean |error| over the die's dense runs (grid 0.70-0.99 by 0.01). Checks it was not
fitted on: each release left out in turn (fitted on the others, scored on it), and every MoE run of the die
(DeepSeek-V3, Qwen3), scored at the fitted value and at 0.87. Prints them; asserts nothing.
``tests/test_blackwell.py`` checks that the profiles carry the value this script fits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from megatron_bridge import DATA, score  # noqa: E402
from planner.presets import MODEL_DIRNAME, preset_names  # noqa: E402

DIES = {"B200": ("b200-180gb", "gb200-nvl72"), "B300": ("b300-288gb", "gb300-nvl72")}
GRID = tuple(round(0.70 + 0.01 * i, 2) for i in range(30))


def runs_of(die: str) -> list[dict]:
    return [r for r in json.loads(DATA.read_text())["runs"] if r["hardware"] in DIES[die]]


def errors(runs: list[dict], sustained: float, family: str) -> list[float]:
    models = set(preset_names(MODEL_DIRNAME))
    out = []
    for r in runs:
        o = score(r, models, memory=False, hardware_update={"sustained_fraction": sustained})
        if o["scored"] and o["family"] == family:
            out.append(o["error"])
    return out


def mean_abs(errs: list[float]) -> float:
    return sum(abs(e) for e in errs) / len(errs) if errs else float("nan")


def fit(runs: list[dict]) -> float:
    return min(GRID, key=lambda x: mean_abs(errors(runs, x, "dense")))


def main() -> None:
    for die in DIES:
        runs = runs_of(die)
        best = fit(runs)
        dense = errors(runs, best, "dense")
        print(f"{die} die ({', '.join(DIES[die])}): fitted sustained_fraction {best:.2f} on {len(dense)} dense runs: "
              f"mean |error| {100 * mean_abs(dense):.1f} %, worst {100 * max(dense, key=abs):+.1f} % "
              f"(at 0.87: {100 * mean_abs(errors(runs, 0.87, 'dense')):.1f} %)")
        for rel in sorted({r["release"] for r in runs}):
            held = [r for r in runs if r["release"] == rel]
            if not errors(held, best, "dense"):
                continue
            x = fit([r for r in runs if r["release"] != rel])
            e = errors(held, x, "dense")
            print(f"  leave release {rel:<8} out: fitted {x:.2f}, its {len(e)} dense runs mean |error| "
                  f"{100 * mean_abs(e):.1f} %, worst {100 * max(e, key=abs):+.1f} %")
        moe_fit, moe_old = errors(runs, best, "MoE"), errors(runs, 0.87, "MoE")
        if moe_fit:
            print(f"  MoE runs (not fitted on), {len(moe_fit)}: mean |error| {100 * mean_abs(moe_fit):.1f} % at "
                  f"{best:.2f}, {100 * mean_abs(moe_old):.1f} % at 0.87")


if __name__ == "__main__":
    main()
