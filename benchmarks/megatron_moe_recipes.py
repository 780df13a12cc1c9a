"""Megatron-LM's own MoE recipes (Qwen3-30B-A3B and Qwen3-235B-A22B on H100 and GB200/GB300) against plan3d's
predicted step time. Held out: nothing is fitted to them and no other benchmark reads them.

Run: python benchmarks/megatron_moe_recipes.py

Data: benchmarks/data/megatron_moe_recipes.json: each recipe's Megatron-LM arguments as its YAML in NVIDIA/Megatron-LM
``examples/moe_recipes`` sets them (file and commit per row), and the model TFLOP/s per GPU measured for it
(NVIDIA/Megatron-LM PR 5728, "the median model TFLOP/s/GPU over steady-state iterations 30-45", run through the
matching Megatron-Bridge recipes). The measured step time is ``gbs * seq * FLOPs per token / (TFLOP/s * GPUs)``, with
the FLOPs per token Megatron counts for these models (``planner.flops.model_flops_per_token``, which reproduces the
Megatron-MoE-ModelZoo page's TFLOP/s for Qwen3-235B within 1 %, tests/test_moe_specs.py). Each run is pinned to its
recipe: layout, micro-batch, precision, HybridEP (plan3d's ``hybridep`` dispatcher), the all-to-all overlap, the
CUDA-graph scopes, selective recompute modules, fp8 weights and the precision-aware optimizer where the recipe sets
them (Megatron-Core's semantics, ``--framework megatron``). Rows whose recipe plan3d cannot state are listed with the
reason. Error = predicted / measured step time - 1 (negative: plan3d is optimistic). It asserts nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import flops  # noqa: E402
from planner.cost import estimate_time  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.specs import Plan, TrainingSpec, plan_problems  # noqa: E402

DATA = ROOT / "benchmarks/data/megatron_moe_recipes.json"


def measured_step_s(r: dict, model, tflops: float) -> float:
    """The step time a measured TFLOP/s per GPU stands for, by the model FLOPs Megatron counts."""
    return r["gbs"] * r["seq"] * flops.model_flops_per_token(model, r["seq"]) / (tflops * 1e12 * r["gpus"])


def job(r: dict):
    """(model, hardware, training, plan) of one recipe, as module docstring says."""
    model, hw = load_model(r["model"]), load_hardware(r["hardware"])
    training = TrainingSpec(num_gpus=r["gpus"], global_batch_size=r["gbs"], seq_len=r["seq"], precision=r["precision"],
                            framework="megatron", moe_token_dispatcher="hybridep", moe_a2a_overlap=r["a2a_overlap"],
                            cuda_graph_modules=tuple(r["cuda_graph_modules"]),
                            recompute_modules=tuple(r["recompute_modules"]) or ("core_attn",),
                            fp8_params=r["fp8_params"], optimizer_dtype=r["optimizer_dtype"], cross_entropy_fusion="te",
                            fp8_recipe=r.get("fp8_recipe", "delayed"))
    dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
    plan = Plan(tp=r["tp"], pp=r["pp"], vpp=r["vpp"], dp=dp, cp=r["cp"], ep=r["ep"], etp=1,
                micro_batch_size=r["mbs"], sequence_parallel=r["tp"] > 1, zero_stage=1,
                recompute="selective" if r["recompute_modules"] else "none",
                layers_per_stage=tuple(r["layers_per_stage"]) if r["layers_per_stage"] else None)
    return model, hw, training, plan


def score(r: dict) -> dict:
    out = {"name": r["name"], "hardware": r["hardware"]}
    if r.get("not_modelled"):
        return out | {"reason": r["not_modelled"]}
    model, hw, training, plan = job(r)
    problems = plan_problems(model, hw, training, plan)
    if problems:
        return out | {"reason": "plan refused: " + "; ".join(problems)}
    est = estimate_time(model, hw, training, plan)
    mem = estimate_memory(model, hw, training, plan)
    measured = measured_step_s(r, model, r["tflops_per_gpu"])
    return out | {"label": plan.label(), "measured_s": measured, "predicted_s": est.step_time_s,
                  "error": est.step_time_s / measured - 1,
                  "error_previous": est.step_time_s / measured_step_s(r, model, r["tflops_per_gpu_previous"]) - 1,
                  "breakdown": dict(est.breakdown), "peak_gib": mem.peak_gib, "usable_gib": mem.usable_gib,
                  "fits": mem.fits}


def scored_results() -> list[dict]:
    return [score(r) for r in json.loads(DATA.read_text())["runs"]]


def main() -> None:
    results = scored_results()
    for o in results:
        if "reason" in o:
            print(f"{o['name']:40s} not scored: {o['reason']}")
            continue
        terms = ", ".join(f"{k} {v:.2f}" for k, v in o["breakdown"].items() if v)
        print(f"{o['name']:40s} {o['label']:34s} measured {o['measured_s']:7.2f} s  predicted {o['predicted_s']:7.2f} s"
              f"  {100 * o['error']:+6.1f} %  (against the index's previous figure {100 * o['error_previous']:+6.1f} %;"
              f" memory {o['peak_gib']:.1f} of {o['usable_gib']:.1f} GiB{'' if o['fits'] else ', does NOT fit'})")
        print(f"    {terms}")
    errs = [o["error"] for o in results if "error" in o]
    if errs:
        print(f"\nscored {len(errs)} of {len(results)}: mean |error| {100 * statistics.mean(abs(e) for e in errs):.1f} %,"
              f" worst {100 * max(errs, key=abs):+.1f} %, mean {100 * statistics.mean(errs):+.1f} % (target mean <= 10 %,"
              f" worst <= 25 %)")


if __name__ == "__main__":
    main()
