"""benchmarks/data/megatron_moe_recipes.json (Megatron-LM's examples/moe_recipes with the TFLOP/s of NVIDIA/Megatron-LM
PR 5728): each row agrees with the recipe file it cites (the file names carry GPUs, precision, TP/PP/EP), its layout
is one Megatron can build, and plan3d accepts every recipe it models (benchmarks/megatron_moe_recipes.py scores them;
a refusal would drop a row silently from the figure)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "benchmarks/data/megatron_moe_recipes.json").read_text())
RUNS = DATA["runs"]


def _bench():
    from tests.bench_modules import load_benchmark

    return load_benchmark("megatron_moe_recipes")


@pytest.mark.parametrize("r", RUNS, ids=[r["name"] for r in RUNS])
def test_each_row_agrees_with_the_recipe_file_it_cites(r):
    name = r["recipe"]["path"].rsplit("/", 1)[1]
    assert re.fullmatch(r"[0-9a-f]{40}", r["recipe"]["commit"])
    assert name.startswith({"bf16": "bf16", "fp8": "fp8", "mxfp8": "mxfp8"}[r["precision"]] + "_")
    assert f"_{r['gpus']}GPU_" in name and f"TP{r['tp']}PP{r['pp']}EP{r['ep']}" in name
    assert f"/{r['hardware'].split('-')[0]}/" in r["recipe"]["path"]  # h100, gb200, gb300
    dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
    assert dp * r["tp"] * r["pp"] * r["cp"] == r["gpus"]
    assert r["gbs"] % (r["mbs"] * dp) == 0
    assert (r["tp"] * r["cp"] * dp) % r["ep"] == 0  # Megatron folds EP into the tp x cp x dp ranks (etp 1)
    assert r["tflops_per_gpu"] > 0 and r["tflops_per_gpu_previous"] > 0
    if r.get("layers_per_stage"):
        assert len(r["layers_per_stage"]) == r["pp"]


def test_every_modelled_recipe_is_scored():
    results = _bench().scored_results()
    modelled = [r["name"] for r in RUNS if not r.get("not_modelled")]
    scored = [o["name"] for o in results if "error" in o]
    assert scored == modelled and len(scored) == 6
    assert all(o["fits"] for o in results if "error" in o)  # the recipes ran
