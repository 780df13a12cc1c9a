"""Qwen3-235B-A22B as NVIDIA's Megatron-MoE-ModelZoo measured it, against plan3d's predicted step time (issue 16).

Run: python benchmarks/moe_modelzoo.py [--by-term]

Data and sources: benchmarks/data/megatron_moe_modelzoo.json (github.com/yanring/Megatron-MoE-ModelZoo,
best_practice/qwen3/readme.md: five H100 layouts of one job with their step times, cross-node and intra-node
expert parallelism, DeepEP and the alltoall dispatcher, Megatron-FSDP; and the GB200 / GB300 rows, which print
TFLOP/s per GPU). The ModelZoo runs Megatron-LM itself, so the framework profile is ``megatron``. Each row's
layout is pinned as printed (94 layers plus the embedding and the loss split evenly over the virtual stages, the
data file's ``not_stated``) and costed by ``planner.cost.estimate_time``. Nothing was fitted to these rows, and
they are in no other benchmark. Error = predicted step time / measured - 1 (negative: plan3d is optimistic).

What the page leaves open, and which way it leans: the H100 rows do not say whether they force the router's
balance (the page's long-context table, same model and dispatcher, measures dropless routing 9-25 % slower than
forced balance), and plan3d's default load imbalance is 1.0, the forced-balance case; so an optimistic error on
those rows may be the routing the page ran. The Blackwell rows force the balance (their commands say so).
Prints each row, then mean |error| and worst per system; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import flops  # noqa: E402
from planner.cost import estimate_time  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.specs import Plan, TrainingSpec, plan_problems  # noqa: E402

DATA = ROOT / "benchmarks/data/megatron_moe_modelzoo.json"
MODEL = "qwen3-235b-a22b"
#: the page's recompute column as Megatron's flags: 'norm, act' is --recompute-modules layernorm moe_act (its
#: command line), 'full' full recompute, empty none
RECOMPUTE = {"norm, act": ("selective", ("layernorm", "moe_act")), "full": ("full", ("core_attn",)),
             "": ("none", ("core_attn",))}


def stage_layers(num_layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
    """The layers plus the embedding and the loss counted as layers, split evenly over the ``pp x vpp`` virtual
    stages (Megatron's ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``): the first
    and last ranks hold one layer less. None without a pipeline."""
    if pp == 1:
        return None
    slots, chunks = num_layers + 2, pp * vpp
    if slots % chunks:
        raise ValueError(f"{slots} slots over {chunks} virtual stages")
    per_rank = slots // chunks * vpp
    return (per_rank - 1,) + (per_rank,) * (pp - 2) + (per_rank - 1,)


def measured_step_s(r: dict, model) -> tuple[float, float]:
    """(measured step seconds, TFLOP/s per GPU implied by plan3d's FLOPs count at that step time)."""
    per_token = flops.model_flops_per_token(model, r["seq"])
    total = r["gbs"] * r["seq"] * per_token
    step = r["step_time_s"] or total / (r["tflops_per_gpu"] * 1e12 * r["gpus"])
    return step, total / (step * r["gpus"]) / 1e12


def score(r: dict) -> dict:
    model, hw = load_model(MODEL), load_hardware(r["system"])
    recompute, modules = RECOMPUTE[r["recompute"]]
    training = TrainingSpec(num_gpus=r["gpus"], global_batch_size=r["gbs"], seq_len=r["seq"], precision=r["precision"],
                            framework="megatron", moe_token_dispatcher=r["dispatcher"], moe_a2a_overlap=r["a2a_overlap"],
                            recompute_modules=modules, cuda_graph_modules=tuple(r["cuda_graph"]))
    lps = stage_layers(model.num_layers, r["pp"], r["vpp"])
    plan = Plan(tp=r["tp"], pp=r["pp"], dp=r["dp"], cp=r["cp"], vpp=r["vpp"], micro_batch_size=r["mbs"],
                recompute=recompute, sequence_parallel=r["tp"] > 1, zero_stage=3 if r["fsdp"] else 1, ep=r["ep"],
                etp=1, **({"layers_per_stage": lps} if lps else {}))
    out = {"name": r["name"], "system": r["system"], "label": plan.label()}
    problems = plan_problems(model, hw, training, plan)
    if problems:
        return out | {"reason": "; ".join(problems)}
    measured, implied = measured_step_s(r, model)
    est = estimate_time(model, hw, training, plan)
    mem = estimate_memory(model, hw, training, plan)
    return out | {"measured_s": measured, "predicted_s": est.step_time_s, "error": est.step_time_s / measured - 1,
                  "implied_tflops": implied, "published_tflops": r["tflops_per_gpu"], "from_step": bool(r["step_time_s"]),
                  "breakdown": dict(est.breakdown), "peak_gib": mem.peak_gib, "usable_gib": mem.usable_gib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--by-term", action="store_true", help="print each row's step-time breakdown")
    args = ap.parse_args()
    data = json.loads(DATA.read_text())
    groups: dict[str, list[float]] = defaultdict(list)
    for r in data["runs"]:
        o = score(r)
        if "reason" in o:
            print(f"{o['name']:58s} refused: {o['reason']}")
            continue
        check = (f"TF {o['published_tflops']} published, {o['implied_tflops']:.0f} by plan3d's FLOPs"
                 if o["from_step"] else f"time from {o['published_tflops']} TF")
        print(f"{o['name']:58s} {o['label']:32s} measured {o['measured_s']:6.2f} s  predicted {o['predicted_s']:6.2f} s "
              f"{100 * o['error']:+6.1f} %  ({check}; memory {o['peak_gib']:.1f} of {o['usable_gib']:.1f} GiB)")
        if args.by_term:
            print("    " + ", ".join(f"{k} {v:.2f}" for k, v in o["breakdown"].items() if v))
        groups[o["system"]].append(o["error"])
        groups["overall"].append(o["error"])
    print(f"\n{'group':16s} {'rows':>4s} {'mean |err|':>10s} {'worst':>8s}")
    for key in sorted(groups, key=lambda k: (k == "overall", k)):
        e = groups[key]
        print(f"{key:16s} {len(e):4d} {100 * sum(map(abs, e)) / len(e):9.1f}% {100 * max(e, key=abs):+7.1f}%")
    for line in data["not_scored"]:
        print(f"not scored: {line}")


if __name__ == "__main__":
    main()
