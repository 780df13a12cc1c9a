"""NVIDIA's Megatron-Core MoE report (arXiv:2603.07685) throughput table against plan3d's predicted throughput.

Run: python benchmarks/megatron_moe_report.py [--by-term]

Data and sources: benchmarks/data/megatron_moe_report.json: Table 11 (per-GPU TFLOP/s and tokens/s of DeepSeek-V3
and Qwen3-235B-A22B on GB300, GB200 and H100), each row's layout from Table 20 and its switches (dispatcher,
recompute modules, the 1F1B all-to-all overlap, CUDA-graph scopes) from appendix B.2. The runs are held out: no
figure of plan3d was set from them. Each row is scored exactly as ``benchmarks/megatron_bridge.py`` scores its rows
(``megatron_bridge.score``: the same mapping to a plan and a job, the same consistency rule between the row's two
figures). Error = predicted tokens/s/GPU / published - 1 (positive: plan3d is optimistic). It asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import megatron_bridge as mb  # noqa: E402

from planner.presets import MODEL_DIRNAME, preset_names  # noqa: E402

DATA = ROOT / "benchmarks/data/megatron_moe_report.json"


def results() -> list[dict]:
    models = set(preset_names(MODEL_DIRNAME))
    return [mb.score(r, models, memory=True) for r in json.loads(DATA.read_text())["runs"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--by-term", action="store_true", help="print each scored run's step-time breakdown")
    args = ap.parse_args()
    out = results()
    for o in out:
        print(mb.line(o))
        if args.by_term and o["scored"]:
            print(mb.breakdown_line(o))
    scored = [o for o in out if o["scored"]]
    if scored:
        errs = [o["error"] for o in scored]
        print(f"\nscored {len(scored)} of {len(out)} runs: mean |error| {100 * sum(map(abs, errs)) / len(errs):.1f} %, "
              f"worst {100 * max(errs, key=abs):+.1f} % (issue 16 target: mean <= 10 %, worst <= 25 %)")


if __name__ == "__main__":
    main()
