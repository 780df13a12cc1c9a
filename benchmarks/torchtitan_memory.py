"""torchtitan's published memory readings against plan3d's torchtitan profile (issue 13).

Run: python benchmarks/torchtitan_memory.py [--torch]

For every run of tests/data/published_memory.json ``torchtitan_h100_202412`` (torchtitan
benchmarks/llama3_h100_202412_torchtitan.md, Tables 1-6; the reading is ``max_memory_reserved``):
the reading, plan3d's peak allocated (``planner.memory``), its peak reserved (the synthetic step trace
replayed through the caching-allocator model, ``planner.allocator_trace``, what ``estimate`` now reports
for torchtitan) and both errors; ``modelled`` marks the runs the profile models (no Float8: the others are
printed for reference only). Plans as tests/test_framework_memory.py builds them: runs with torch.compile are
predicted with ``TrainingSpec.compile`` and the blocks compiled, as torchtitan 9dec370 ran them (its loss compile
was commented out; docs/memory.md "torch.compile (torchtitan)").

Then the held-out June 2025 runs on 32 and 64 H200 (``torchtitan_h200_202506``: Llama 3.1 8B, compile + float8,
op SAC, FSDP; nothing in the profile was set from them), their reading against the allocated and reserved estimate,
and their throughput (tests/test_torchtitan_held_out.py: FlashAttention-2, torch 2.8's SDPA on Hopper).

``--torch`` also replays torch's own trace of the full-size step (``planner.fake_rank.measure_step``,
FakeTensorMode) for the modelled runs and for the reduced-depth cases of tests/test_torchtitan_reserved.py (its TP 4
and 8 ``WIDE_CASES`` included), next to the synthetic trace's figure (needs torch; about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.presets import load_model  # noqa: E402
from planner.specs import GIB  # noqa: E402
from tests.test_framework_memory import _torchtitan_estimate  # noqa: E402

PUBLISHED = json.loads((ROOT / "tests" / "data" / "published_memory.json").read_text())["torchtitan_h100_202412"]


def published() -> None:
    print(f"{'table':>5s} {'techniques':46s} {'mod':>3s} {'read GiB':>8s} {'alloc GiB':>9s} {'err':>7s} "
          f"{'reserved GiB':>12s} {'err':>7s} {'fits':>5s} {'ms':>6s}")
    for run in PUBLISHED["runs"]:
        t0 = time.perf_counter()
        est = _torchtitan_estimate(run)
        ms = 1000 * (time.perf_counter() - t0)
        alloc = max(s.total_bytes for s in est.stages) / GIB
        read = run["reading_gib"]
        print(f"{run['table']:5d} {run['techniques']:46s} {'yes' if run['modelled'] else 'no':>3s} {read:8.1f} "
              f"{alloc:9.1f} {alloc / read - 1:+7.1%} {est.peak_gib:12.1f} {est.peak_gib / read - 1:+7.1%} "
              f"{str(est.fits):>5s} {ms:6.0f}")


def against_torch() -> None:
    from tests import test_torchtitan_reserved as t

    cases = dict(t.CASES)
    for table in (1, 3):
        run = next(r for r in PUBLISHED["runs"] if r["table"] == table and r["techniques"] == "FSDP")
        cases[f"table{table}-fsdp{run['dp']}-32-layers"] = (32, run["dp"], 1, 1, 3, run["ac"], 1, "only")
    print(f"\n{'case':34s} {'torch alloc':>11s} {'torch reserved':>14s} {'synthetic reserved':>18s} {'err':>7s}")
    wide = {name: (case, {"spec": load_model(spec), "mbs": mbs}) for name, (case, spec, mbs) in t.WIDE_CASES.items()}
    for name, (case, kw) in {**{n: (c, {}) for n, c in cases.items()}, **wide}.items():
        m = t._torch_trace(*case, **kw)
        reserved, _, _ = t._synthetic(*case, **kw)
        print(f"{name:34s} {m.peak_bytes / GIB:11.2f} {m.reserved_bytes / GIB:14.2f} {reserved / GIB:18.2f} "
              f"{reserved / m.reserved_bytes - 1:+7.1%}")


def held_out_h200() -> None:
    """The June 2025 H200 runs (published_memory.json ``torchtitan_h200_202506``), compile + float8, held out."""
    from planner.cost import estimate_time
    from planner.memory import estimate_memory
    from tests.test_torchtitan_held_out import TT_H200, torchtitan_h200_scenario

    print(f"\nheld out: {TT_H200['source'][:100]}")
    for run in TT_H200["runs"]:
        sc = torchtitan_h200_scenario(run)
        est = estimate_memory(*sc)
        alloc = max(s.total_bytes for s in est.stages) / GIB
        read = run["reading_gib"]
        tps, pub = estimate_time(*sc).tokens_per_s / run["gpus"], run["tokens_per_s_per_gpu"]
        print(f"  {run['gpus']:3d} H200, FSDP {run['dp']}, local batch {run['local_batch']}: read {read:5.1f} GiB, "
              f"allocated {alloc:5.1f} ({alloc / read - 1:+.1%}), reserved {est.peak_gib:5.1f} "
              f"({est.peak_gib / read - 1:+.1%}); {tps:,.0f} tokens/s per GPU against {pub:,} ({tps / pub - 1:+.1%})")


if __name__ == "__main__":
    published()
    held_out_h200()
    if "--torch" in sys.argv:
        against_torch()
