"""torchtitan's published H100 throughput (Llama 3.1 8B/70B/405B) against plan3d's predicted step time.

Run: python benchmarks/torchtitan_published.py

Data: benchmarks/data/torchtitan_h100_202412.json (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables
1-6, with its source commit). Each run is predicted twice:

* **pinned, --framework torchtitan**: the published layout (FSDP = ZeRO 3 over the data-parallel ranks, the
  local batch as one micro-batch without a pipeline; with one, as torchtitan 9dec370 split it: as many
  micro-batches as stages, vpp 2 for Interleaved 1F1B, ``frameworks.torchtitan.published_layers_per_stage``;
  torchtitan's op-level selective or full AC) costed by ``planner.cost.estimate_time``;
* **as the scorer scores** (``../shared/tools/score_runs.py``): the stated knobs (tp, pp, cp, recompute)
  pinned, ``plan3d search`` with its defaults (Megatron-Core semantics) picks the rest.

Error = predicted / measured step time - 1 (negative: plan3d is optimistic). Only the rows torchtitan ran
without torch.compile and Float8 (``modelled``) are summed: plan3d models Inductor's fusions only as the fused count
of the memory-bound kernels (``--compile``, blocks only as 9dec370 compiled them; eager rows get the eager block,
``planner.cost.eager_block``) and torchao's float8 as Transformer Engine's FP8. Attention is FlashAttention-2
(``ATTENTION``, below) in the pinned rows, plan3d's default in the scorer's. The GPUs are not the h100-sxm-80gb profile: 96 GB HBM2e at 2.4 TB/s and a 500 W power limit
(the file's own note), so the profile's sustained clock and HBM rate are upper bounds for them. Nothing is
fitted; it asserts nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.candidates import Pins, SearchSpace  # noqa: E402
from planner.cost import estimate_time  # noqa: E402
from planner.frameworks import torchtitan  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.search import search  # noqa: E402
from planner.specs import Plan, TrainingSpec, plan_problems  # noqa: E402

DATA = ROOT / "benchmarks/data/torchtitan_h100_202412.json"
LLAMA31_CONTEXT = 131072  # Llama 3.1 HF config max_position_embeddings
# torchtitan 9dec370's Llama called F.scaled_dot_product_attention, whose H100 default at torch nightly 2.6.0.dev
# (December 2024) was FlashAttention-2, not cuDNN: pytorch/pytorch#142132 (2.6.0.dev20241204: SDPA 329 against cuDNN
# 631 TFLOP/s at (1, 24, 4608, 128) on H100); cuDNN became the default on SM90 with torch 2.9 (pytorch/pytorch#162073)
ATTENTION = "flash2"


def _job(run: dict, framework: str) -> tuple:
    model = load_model(run["model"]).model_copy(update={"max_seq_len": LLAMA31_CONTEXT})
    dp = run["gpus"] // (run["tp"] * run["pp"] * run["cp"])
    precision = "fp8" if "Float8" in run["techniques"] else "bf16"
    # torchtitan 9dec370 compiled each TransformerBlock, not the loss (its apply_compile; TrainingSpec.compile_components)
    compiled = "compile" in run["techniques"]
    training = TrainingSpec(num_gpus=run["gpus"], global_batch_size=run["local_batch"] * dp, seq_len=run["seq"],
                            precision=precision, framework=framework, compile=compiled,
                            compile_components=("model",) if compiled else ("model", "loss"), attention=ATTENTION,
                            # 9dec370 ran eager steps: no whole-step CUDA graph (pytorch/torchtitan#3559, 2026)
                            step_cuda_graph=False if framework == "torchtitan" else None)
    return model, training, dp


def pinned(run: dict, hw) -> tuple[float | None, str]:
    model, training, dp = _job(run, "torchtitan")
    vpp = 2 if "Interleaved" in run["techniques"] else 1  # torchtitan 9dec370: two stages per rank (published_layers_per_stage)
    mbs = run["local_batch"] // (torchtitan.published_microbatches(run["pp"], vpp) if run["pp"] > 1 else 1)
    lps = torchtitan.published_layers_per_stage(model.num_layers, run["pp"], vpp)
    plan = Plan(tp=run["tp"], pp=run["pp"], dp=dp, cp=run["cp"], vpp=vpp, micro_batch_size=mbs, recompute=run["ac"],
                sequence_parallel=run["tp"] > 1, zero_stage=3 if run["pp"] == 1 else 1, layers_per_stage=lps)
    problems = plan_problems(model, hw, training, plan)
    if problems:
        return None, "; ".join(problems)
    return estimate_time(model, hw, training, plan).step_time_s, plan.label()


def scorer(run: dict, hw) -> tuple[float | None, str]:
    model, training, _ = _job(run, "megatron")
    # the scorer states no kernel and no compile: plan3d's defaults
    training = training.model_copy(update={"attention": "flash", "compile": False, "compile_components": ("model", "loss")})
    pins = Pins(tp=run["tp"], pp=run["pp"], cp=run["cp"], recompute=run["ac"])
    best = search(model, hw, training, SearchSpace(pins=pins)).best
    if best is None:
        return None, "MISS: no plan fits"
    return estimate_time(model, hw, training, best).step_time_s, best.label()


def main() -> None:
    data = json.loads(DATA.read_text())
    hw = load_hardware("h100-sxm-80gb")
    sums: dict[str, list[float]] = {"pinned": [], "scorer": []}
    for run in data["runs"]:
        _, training, _ = _job(run, "torchtitan")
        measured = training.global_batch_size * training.seq_len / (run["tps_per_gpu"] * run["gpus"])
        print(f"Table {run['table']} {run['model']:<11} {run['gpus']:>3} GPUs {run['techniques'][:48]:<48} "
              f"measured {measured:7.2f} s")
        for how, fn in (("pinned", pinned), ("scorer", scorer)):
            t, label = fn(run, hw)
            if t is None:
                print(f"    {how:<7} {label}")
                continue
            err = t / measured - 1
            if run["modelled"]:
                sums[how].append(err)
            print(f"    {how:<7} predicted {t:7.2f} s  {100 * err:+6.1f} %  {label}{'' if run['modelled'] else '  (not summed)'}")
    for how, errs in sums.items():
        if errs:
            print(f"{how}: {len(errs)} modelled runs, mean |error| {100 * sum(map(abs, errs)) / len(errs):.1f} %, "
                  f"worst {100 * max(errs, key=abs):+.1f} %")


if __name__ == "__main__":
    main()
