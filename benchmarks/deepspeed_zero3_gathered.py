"""How many parameter elements DeepSpeed ZeRO-3 keeps gathered: plan3d's port of its coordinator against the real one.

Run: python benchmarks/deepspeed_zero3_gathered.py   (deepspeed 0.19.8 and torch, as the Makefile installs them)

plan3d counts a ZeRO-3 DeepSpeed GPU's gathered weights by replaying DeepSpeed's parameter coordinator
(planner/frameworks/deepspeed_zero3.py) over Megatron-DeepSpeed's module tree of the model
(planner/frameworks/deepspeed.py ``zero3_tree``). This script prints, for Llama-3-8B and Llama-3-70B at DeepSpeed's
defaults and two leaner configs, the port's figure on the full-size tree, and then checks it on the real coordinator
(one CPU rank, gloo, tests/deepspeed_zero3_probe.py) over the same tree with every element count and every limit
divided by ``SCALE`` (the coordinator decides in element counts only; rounding to whole elements moves the
scaled figure slightly, so the full-size and the scaled-back figures agree to about a percent, while the port and
the real coordinator on the scaled tree must agree exactly). The figure plan3d counted before the port (the largest
module plus ``stage3_prefetch_bucket_size``) is printed beside it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.frameworks.deepspeed import zero3_shape, zero3_tree  # noqa: E402
from planner.frameworks.deepspeed_zero3 import Module, Settings, flatten, gathered_elements  # noqa: E402
from planner.presets import load_model  # noqa: E402

SCALE = 20_000
CONFIGS = {"DeepSpeed's defaults": Settings(),
           "reuse distance 0": Settings(max_reuse=0),
           "reuse 0, prefetch 0": Settings(max_reuse=0, prefetch_bucket=0)}


def scaled(m: Module) -> Module:
    return Module(tuple((pid, max(1, round(n / SCALE))) for pid, n in m.params), tuple(scaled(c) for c in m.children))


def scaled_settings(s: Settings) -> Settings:
    return Settings(prefetch_bucket=round(s.prefetch_bucket / SCALE), max_live=round(s.max_live / SCALE),
                    max_reuse=round(s.max_reuse / SCALE), persistence_threshold=round(s.persistence_threshold / SCALE))


def as_json(m: Module) -> dict:
    return {"params": [list(p) for p in m.params], "children": [as_json(c) for c in m.children]}


def main() -> None:
    from tests.subprocess_probe import run_json_probe

    rows, cases = [], []
    for name, tp in (("llama3-8b", 1), ("llama3-70b", 8)):
        model = load_model(name)
        tree = zero3_tree(zero3_shape(model, tp))
        largest = max(sum(n for _, n in mod.params) for mod in flatten(tree))
        for label, s in CONFIGS.items():
            small = scaled(tree)
            rows.append((name, tp, label, gathered_elements(tree, s), largest + s.prefetch_bucket,
                         gathered_elements(small, scaled_settings(s))))
            ss = scaled_settings(s)
            cases.append({"tree": as_json(small), "config": {
                "stage3_prefetch_bucket_size": ss.prefetch_bucket, "stage3_max_live_parameters": ss.max_live,
                "stage3_max_reuse_distance": ss.max_reuse, "stage3_param_persistence_threshold":
                    ss.persistence_threshold}})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cases.json"
        path.write_text(json.dumps(cases))
        real = run_json_probe(Path(__file__).resolve().parent.parent / "tests" / "deepspeed_zero3_probe.py",
                              extra_args=[str(path)])["cases"]
    print(f"elements gathered at once (millions); scaled: every count and limit / {SCALE}, real = DeepSpeed 0.19.8's "
          "coordinator on CPU")
    print(f"{'model':12s} {'tp':>2s} {'config':22s} {'port':>8s} {'before':>8s} {'scaled port':>12s} "
          f"{'scaled real':>12s}")
    for (name, tp, label, full, before, small_port), r in zip(rows, real):
        small_real = max(e[3] for step in r["steps"][1:] for e in step if e[0] == "fetch")
        print(f"{name:12s} {tp:2d} {label:22s} {full / 1e6:8.0f} {before / 1e6:8.0f} "
              f"{small_port * SCALE / 1e6:12.0f} {small_real * SCALE / 1e6:12.0f}"
              + ("" if small_port == small_real else "   MISMATCH"))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
