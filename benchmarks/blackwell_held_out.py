"""Held-out check on Blackwell (issue 18): plan3d against NVIDIA's published Blackwell pre-training throughput of
one Megatron-Bridge release, with the one constant fitted on Blackwell runs refitted without that release.

Run: python benchmarks/blackwell_held_out.py [--release 26.02.01]

Rows: benchmarks/data/megatron_bridge_perf.json (NVIDIA Megatron-Bridge performance summary; sources per row),
every row of the release on DGX-B200, DGX-B300, GB200 NVL72 and GB300 NVL72, dense and MoE, scored as
``benchmarks/megatron_bridge.py`` scores them (its assumptions, its unscored reasons).

What is held out: the Blackwell profiles carry one fitted constant, the die's ``sustained_fraction``
(``benchmarks/blackwell_sustained.py``, fitted on the die's dense rows of every release). Here it is refitted on
the die's dense rows of the other releases, the same grid, and the release's rows are scored at that value.
Nothing else in planner/ or hardware_profiles/ was fitted to any of these rows.

Flagged, not dropped: a row whose printed layout differs from its recipe at the page's own commit
(``recipe.layout_differs_from_row``) and is predicted not to fit, e.g. the 26.02.01 GB300 Llama-3 70B NVFP4 row
printed as TP1 PP1 without FSDP (about 600 GiB a GPU) whose recipe is PP4 VP5 micro-batch 1: such a run probably
did not use the layout as printed, but which one it used is not certain, and plan3d's memory estimate may be the
one in error. The summary is printed with and without the flagged rows.

Prints each row, then mean and worst |error| per family and overall (issue 18 target: mean <= 10 %, worst
<= 25 %). Asserts nothing. About a minute (the refit scores each die's rows 30 times).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from blackwell_sustained import DIES, fit, runs_of  # noqa: E402
from megatron_bridge import DATA, line, score  # noqa: E402
from planner.presets import MODEL_DIRNAME, preset_names  # noqa: E402


def held_out(release: str) -> list[dict]:
    """Each Blackwell row of ``release`` scored at its die's sustained fraction fitted without that release."""
    models = set(preset_names(MODEL_DIRNAME))
    out = []
    for die in DIES:
        runs = runs_of(die)
        rows = [r for r in runs if r["release"] == release]
        if not rows:
            continue
        sustained = fit([r for r in runs if r["release"] != release])
        for r in rows:
            o = score(r, models, memory=True, hardware_update={"sustained_fraction": sustained})
            o["sustained_fraction"] = sustained
            differs = (r.get("recipe") or {}).get("layout_differs_from_row")
            o["flag"] = (f"printed layout predicted not to fit and its recipe differs ({differs})"
                         if o["scored"] and differs and not o["fits"] else None)
            out.append(o)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", default="26.02.01", help="the Megatron-Bridge release held out")
    args = ap.parse_args()
    results = held_out(args.release)
    if not results:
        sys.exit(f"release: no Blackwell rows of {args.release} in {DATA.name}; choose one it holds")
    for die in DIES:
        fitted = {o["sustained_fraction"] for o in results if o["hardware"] in DIES[die]}
        if fitted:
            print(f"{die} die: sustained_fraction {fitted.pop():.2f} fitted without release {args.release}")
    for o in results:
        print(line(o) + (f"  FLAG: {o['flag']}" if o["flag"] else ""))
    for label, keep in (("all scored rows", lambda o: True), ("without the flagged rows", lambda o: not o["flag"])):
        groups: dict[str, list[float]] = {}
        for o in results:
            if o["scored"] and keep(o):
                groups.setdefault(o["family"], []).append(o["error"])
                groups.setdefault("overall", []).append(o["error"])
        print(f"\n{label} (issue 18 target: mean <= 10 %, worst <= 25 %)")
        for key in sorted(groups, key=lambda k: k == "overall"):
            errs = groups[key]
            print(f"  {key:<8} {len(errs):>3} runs: mean |error| {100 * sum(map(abs, errs)) / len(errs):.1f} %, "
                  f"worst {100 * max(errs, key=abs):+.1f} %")
    print(f"unscored {sum(not o['scored'] for o in results)} of {len(results)} (reasons above)")


if __name__ == "__main__":
    main()
