"""Every row of NVIDIA's Megatron-Bridge performance summary against plan3d's predicted throughput.

Run: python benchmarks/megatron_bridge.py [--by-term] [--json PATH] [--no-memory]

Data and sources: benchmarks/data/megatron_bridge_perf.json (the performance summary of the 26.04, 26.02.01,
26.02, 25.11 and 25.09 NeMo containers, and the Megatron-Bridge performance recipes for the per-run switches the
table leaves out; each run names its source). Each run's plan is pinned to the published layout and costed
by ``planner.cost.estimate_time``; its memory by ``planner.memory.estimate_memory`` (``--no-memory`` skips it).
Nothing was fitted to these runs. Error = predicted tokens/s/GPU / published - 1 (positive: plan3d is
optimistic). A run is scored only when its own two figures agree (tokens/s/GPU x the page's model FLOPs per token,
``page_flops_per_token``, within 10 % of its published model TFLOP/s/GPU, the rule of
benchmarks/data/moe_published.json),
when plan3d models its precision and model, and when ``plan_problems`` accepts its layout. Prints each run,
then mean |error| and worst signed error per system, precision, family and overall; it asserts nothing.

Mapping (the brief of this benchmark; the table gives no ZeRO stage, recompute or SP): framework nemo;
zero_stage 3 when FSDP is on, else 1 (Megatron distributed optimizer), or 0 under the recipe's Muon (Kimi-K2:
``TrainingSpec.optimizer`` dist_muon, which runs without the distributed optimizer); sequence parallelism when TP > 1;
recompute: the recipe's full recompute (the two recipes with recompute_method block: Plan.recompute_num_layers),
else its recompute_modules as Megatron's selective recompute of those modules, else none; the recipe's
cpu_offloading_num_layers as ``Plan.cpu_offload_layers``; bf16 gradients (``grad_reduce_in_bf16``: every model's perf script sets
``cfg.ddp.grad_reduce_in_fp32 = False``, e.g. ``set_llama3_common_configs`` in
scripts/performance/configs/llama/llama3_llm_pretrain.py, ``set_qwen3_common_configs``, ``set_gpt_oss_common_configs``);
fp8 weights with no bf16 copy (``fp8_params``) in every fp8 and mxfp8 run: the perf scripts take their precision from
``get_precision_config`` (scripts/performance/utils/precision.py), whose fp8 delayed, fp8 current-scaling and
mxfp8 recipes all set ``fp8_param_gather = True`` (src/megatron/bridge/training/mixed_precision.py, commit 0509780:
``bf16_with_fp8_delayed_scaling_mixed``, ``bf16_with_fp8_current_scaling_mixed``, ``bf16_with_mxfp8_mixed``, the last
with ``reuse_grad_buf_for_mxfp8_param_ag``), and scripts/performance/utils/overrides.py leaves it; plan3d counts it
under the distributed optimizer and, per-tensor fp8 only, under Megatron-FSDP (``MixedPrecisionConfig.setup`` copies
``fp8_param_gather`` into the DDP config: uint8 sharded weights, ``planner.frameworks.megatron``); Transformer Engine's
fused cross entropy (``cross_entropy_fusion='te'``): ``GPTModelProvider.cross_entropy_loss_fusion`` defaults to True
(src/megatron/bridge/models/gpt_provider.py, commit 0254ddd) and ``_set_common_perf_overrides`` sets
``cross_entropy_fusion_impl = "te"`` for every model (scripts/performance/utils/overrides.py, commit 00538e2);
vpp = VP or 1; EP from
the row, ETP 1 (the recipes' expert_tensor_parallel_size=1); dispatcher (hybridep/deepep backends ->
plan3d 'deepep'), MoE all-to-all overlap (where Megatron-Core accepts it for the row's layout, ``a2a_overlap``),
CUDA-graph scopes (``graph_modules``) and pipeline layout from the run's ``recipe``. FP8-CS (per-tensor current
scaling) is ``fp8_recipe='tensorwise'``; the 25.09 table names no precision and is read as delayed, TE's default;
its parenthesised H100 DeepSeek-V3 "FP8 blockwise" row is ``fp8_recipe='blockwise'`` (``recipe_of``).
The 25.09 rows marked (tokendrop) train with expert capacity 1.0, padded, over the alltoall dispatcher, as
Megatron-Bridge's ``apply_moe_token_drop`` sets them (``token_drop``).
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
from planner.presets import MODEL_DIRNAME, load_hardware, load_model, preset_names  # noqa: E402
from planner.specs import Plan, TrainingSpec, plan_problems  # noqa: E402

DATA = ROOT / "benchmarks/data/megatron_bridge_perf.json"
CONSISTENCY = 0.10  # benchmarks/data/moe_published.json's consistency_rule
MODELLED_PRECISIONS = ("bf16", "fp8", "fp8_blockwise", "mxfp8", "nvfp4")  # planner.specs.Precision, less fp32


def recipe_of(r: dict) -> tuple[str, str]:
    """(``TrainingSpec.precision``, ``fp8_recipe``) of a row: FP8 block scaling is fp8 with the blockwise recipe
    (Transformer Engine Float8BlockScaling, Megatron --fp8-recipe blockwise), FP8-CS the tensorwise one."""
    if r["precision"] == "fp8_blockwise":
        return "fp8", "blockwise"
    return r["precision"], "tensorwise" if (r.get("precision_published") or "").startswith("FP8-CS") else "delayed"


def run_label(r: dict) -> str:
    lab = f"TP{r['tp']} PP{r['pp']} CP{r['cp']} VP{r['vp'] or '-'} EP{r['ep'] or '-'} mbs{r['mbs']} gbs{r['gbs']}"
    return lab + (" fsdp" if r["fsdp"] else "")


GRAPH_MODULES = ("attn", "moe_router", "moe_preprocess")


def graph_modules(r: dict) -> tuple[str, ...]:
    """The recipe's CUDA-graph capture as plan3d's ``cuda_graph_modules``: the TE scopes plan3d knows;
    ``full_iteration`` (the whole step in one graph) as all of them, the nearest plan3d can say."""
    graph = (r.get("recipe") or {}).get("cuda_graph") or ""
    if "full_iteration" in graph:
        return GRAPH_MODULES
    return tuple(m for m in GRAPH_MODULES if m in graph.replace(",", " ").replace("[", " ").replace("]", " ").split())


def plan_of(r: dict, moe: bool) -> Plan:
    dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
    lps = tuple(r["layers_per_stage"]) if r.get("layers_per_stage") else None
    experts = {"ep": r["ep"] or 1, "etp": 1} if moe else {}  # dense rows print EP 1 or n/a: no expert layers
    return Plan(tp=r["tp"], pp=r["pp"], dp=dp, cp=r["cp"], vpp=r["vp"] or 1, micro_batch_size=r["mbs"],
                **recompute_of(r), sequence_parallel=r["tp"] > 1,
                zero_stage=3 if r["fsdp"] else (0 if "muon" in optimizer_of(r) else 1), layers_per_stage=lps,
                cpu_offload_layers=(r.get("recipe") or {}).get("cpu_offloading_num_layers") or 0, **experts)


def a2a_overlap(r: dict) -> bool:
    """The recipe's MoE all-to-all overlap (``moe_a2a_overlap``, Megatron's ``overlap_moe_expert_parallel_comm``)
    where the row's layout lets Megatron-Core run it: ``TransformerConfig.__post_init__`` (core_v0.16.1
    transformer_config.py, the overlap's asserts) refuses it with pipeline parallelism and no virtual pipeline
    ("If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when
    pipeline_model_parallel_size > 1"), the rule ``planner.emit.megatron.moe_plan_refusals`` applies. A row
    published with PP > 1 and no VP therefore ran without it, whatever the recipe of another layout says (the
    DGX-B300 DeepSeek-V3 rows: PP16 without VP in the table, the B300 MXFP8 recipe's PP8 VP2 with overlap)."""
    return bool(r["a2a_overlap"]) and not (r["pp"] > 1 and (r["vp"] or 1) == 1)


def recompute_of(r: dict) -> dict:
    """The recipe's recompute as plan fields: full recompute by Megatron's block method (``recompute_method``
    block, ``recompute_num_layers`` K: ``Plan.recompute_num_layers``), else selective recompute of its
    ``recompute_modules``, else none."""
    recipe = r.get("recipe") or {}
    if recipe.get("recompute_granularity") == "full":
        k = recipe.get("recompute_num_layers") if recipe.get("recompute_method") == "block" else None
        return {"recompute": "full", "recompute_num_layers": k}
    return {"recompute": "selective" if recompute_modules(r) else "none"}


def recompute_modules(r: dict) -> tuple[str, ...]:
    """The recipe's ``recompute_modules`` (Megatron's selective recompute of those modules); none recorded or an
    empty list: no recompute."""
    return tuple((r.get("recipe") or {}).get("recompute_modules") or ())


def page_flops_per_token(model, seq: int) -> float:
    """Model FLOPs per token as the page counts them, for the consistency rule. plan3d's own count
    (``planner.flops``), except GPT-OSS: Megatron-Bridge's ``flop_utils.transformer_flops`` (0.3.0, L231-232 and
    L309-315) counts its gated quick-GELU experts as two GEMMs (the 3/2 factor is applied only to SiLU GLUs) and
    every layer's attention as full causal (no sliding window); Megatron-Bridge PRs #3029 and #3947 fixed both
    after 26.02. That reproduces the page's figures (27.2 GFLOP per token at 4096, 30.8 at 8192)."""
    if model.name.startswith("gpt-oss"):
        model = model.model_copy(update={"activation": "gelu", "sliding_window": None, "sliding_window_layers": None})
    return flops.model_flops_per_token(model, seq)


#: Megatron-Bridge's ``apply_moe_token_drop`` (src/megatron/bridge/training/utils/moe_token_drop.py), which its
#: performance scripts apply to a "tokendrop" run (scripts/performance: ``if args.use_tokendrop is True: recipe.model =
#: apply_moe_token_drop(recipe.model)``): ``moe_expert_capacity_factor = 1.0`` and
#: ``moe_pad_expert_input_to_capacity = True`` by default, and it asserts the alltoall dispatcher ("Using token drop,
#: disabling DeepEP", the DeepSeek-V3 perf configs).
TOKEN_DROP_CAPACITY_FACTOR = 1.0


def token_drop(model):
    """A 25.09 "(tokendrop)" row's model and dispatcher: expert capacity ``TOKEN_DROP_CAPACITY_FACTOR`` x the even
    share, each expert's input padded to it (``ModelSpec.capacity_factor``: no host sync of the token counts, fixed
    shapes), over the alltoall dispatcher."""
    return model.model_copy(update={"capacity_factor": TOKEN_DROP_CAPACITY_FACTOR}), "alltoall"


def hybridep_of(r: dict) -> str:
    """The row's dispatcher as plan3d names it: ``hybridep`` where the data file's ``deepep`` (the flex dispatcher) runs
    with the recipe's ``moe_flex_dispatcher_backend: hybridep`` (every such row of the page), so its memory holds
    HybridEP's buffer (``memory.hybridep_buffer_bytes``) rather than DeepEP's; the traffic is priced alike."""
    backend = (r.get("recipe") or {}).get("moe_flex_dispatcher_backend")
    return "hybridep" if r["dispatcher"] == "deepep" and backend == "hybridep" else r["dispatcher"]


def not_modelled(r: dict, models: set[str]) -> str | None:
    if r.get("inconsistent"):
        return f"row inconsistent ({r['inconsistent']})"
    if r["precision"] not in MODELLED_PRECISIONS:
        return f"precision {r['precision']} not modelled ({r['precision_published'] or '25.09 parenthesised'})"
    if r["model"] not in models:
        return f"no plan3d preset {r['model']}"
    if optimizer_of(r) not in ("adam", "muon", "dist_muon"):
        return f"optimizer {optimizer_of(r)} not modelled"
    return None


def optimizer_of(r: dict) -> str:
    """The recipe's optimizer: Kimi-K2's perf recipes train with Megatron-Core's dist_muon (the data file's notes:
    no distributed optimizer, so ZeRO 0, and no fp8 parameter gather), the others with Adam."""
    return (r.get("recipe") or {}).get("optimizer") or "adam"


def score(r: dict, models: set[str], memory: bool, hardware_update: dict | None = None) -> dict:
    """One run against plan3d; ``hardware_update`` overrides profile fields (``benchmarks/blackwell_sustained.py``)."""
    out = {k: r[k] for k in ("release", "system", "hardware", "model", "model_note", "variant", "precision",
                             "precision_published", "gpus", "tokens_per_s_per_gpu", "model_tflops_per_gpu")}
    out["label"] = run_label(r)
    out["family"] = None
    why = not_modelled(r, models)
    if why:
        return out | {"scored": False, "reason": why}
    model, hw = load_model(r["model"]), load_hardware(r["hardware"])
    if r.get("model_update"):  # a row run past the preset's context (its max_seq_len: positions, no parameters)
        model = model.model_copy(update=r["model_update"])
    if hardware_update:
        hw = hw.model_copy(update=hardware_update)
    out["family"] = "MoE" if model.is_moe else "dense"
    dispatcher = hybridep_of(r)
    if r.get("model_note") == "tokendrop":
        model, dispatcher = token_drop(model)
    precision, fp8_recipe = recipe_of(r)
    training = TrainingSpec(num_gpus=r["gpus"], global_batch_size=r["gbs"], seq_len=r["seq"], precision=precision,
                            framework="nemo", moe_token_dispatcher=dispatcher, moe_a2a_overlap=a2a_overlap(r),
                            cuda_graph_modules=graph_modules(r), recompute_modules=recompute_modules(r) or ("core_attn",),
                            grad_reduce_in_bf16=True, optimizer=optimizer_of(r),
                            # Megatron-Bridge's bf16_with_fp8_subchannel_scaling_mixed sets fp8_param_gather False
                            fp8_params=precision in ("fp8", "mxfp8") and optimizer_of(r) == "adam"
                            and fp8_recipe != "blockwise",
                            cross_entropy_fusion="te", fp8_recipe=fp8_recipe)
    plan = plan_of(r, model.is_moe)
    problems = plan_problems(model, hw, training, plan)
    if problems:
        return out | {"scored": False, "reason": "plan refused: " + "; ".join(problems)}
    implied = r["tokens_per_s_per_gpu"] * page_flops_per_token(model, r["seq"]) / 1e12
    est = estimate_time(model, hw, training, plan)
    predicted = est.tokens_per_s / r["gpus"]
    out |= {"predicted_tokens_per_s_per_gpu": predicted, "error": predicted / r["tokens_per_s_per_gpu"] - 1,
            "published_step_s": r["gbs"] * r["seq"] / (r["tokens_per_s_per_gpu"] * r["gpus"]),
            "predicted_step_s": est.step_time_s, "predicted_tflops_per_gpu": est.tflops_per_gpu,
            "implied_tflops_per_gpu": implied, "breakdown_s": dict(est.breakdown), "mfu": est.mfu}
    if memory:
        mem = estimate_memory(model, hw, training, plan)
        out |= {"peak_gib": mem.peak_gib, "usable_gib": mem.usable_gib, "fits": mem.fits}
    if abs(implied / r["model_tflops_per_gpu"] - 1) > CONSISTENCY:
        return out | {"scored": False, "reason": f"page inconsistent (implied {implied:.0f} vs published "
                                                 f"{r['model_tflops_per_gpu']} TFLOP/s)"}
    return out | {"scored": True, "reason": None}


def line(o: dict) -> str:
    head = (f"{o['release']:<8} {o['system']:<9} {o['precision']:<13} {o['model']:<16} {o['variant'][:5]:<5} "
            f"{o['label']:<44} published {o['tokens_per_s_per_gpu']:>6}")
    if "predicted_tokens_per_s_per_gpu" not in o:
        return f"{head}  unscored: {o['reason']}"
    s = f"{head}  predicted {o['predicted_tokens_per_s_per_gpu']:>7.0f}  {100 * o['error']:+6.1f}%"
    if "peak_gib" in o:
        s += f"  mem {o['peak_gib']:6.1f}/{o['usable_gib']:.1f} GiB fits {'yes' if o['fits'] else 'NO'}"
    return s if o["scored"] else f"{s}  unscored: {o['reason']}"


def breakdown_line(o: dict) -> str:
    b = o["breakdown_s"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in b.items() if v)
    return (f"    step published {o['published_step_s']:.2f} s, predicted {o['predicted_step_s']:.2f} s "
            f"(MFU {100 * o['mfu']:.0f} %): {parts} s")


def summary(results: list[dict]) -> None:
    scored = [o for o in results if o["scored"]]
    groups: dict[str, list[dict]] = defaultdict(list)
    for o in scored:
        groups[f"system {o['system']}"].append(o)
        groups[f"precision {o['precision']}"].append(o)
        groups[f"family {o['family']}"].append(o)
        groups[f"model {o['model']}"].append(o)
        groups["overall"].append(o)
    print(f"\n{'group':<24} {'runs':>4} {'mean |err|':>10} {'worst':>8}")
    for key in sorted(groups, key=lambda k: (k == "overall", k)):
        errs = [o["error"] for o in groups[key]]
        worst = max(errs, key=abs)
        print(f"{key:<24} {len(errs):>4} {100 * sum(map(abs, errs)) / len(errs):>9.1f}% {100 * worst:>+7.1f}%")
    reasons: dict[str, int] = defaultdict(int)
    for o in results:
        if not o["scored"]:
            reasons[o["reason"].split(" (")[0].split(":")[0]] += 1
    print(f"\nscored {len(scored)}, unscored {len(results) - len(scored)} of {len(results)} runs: "
          + ", ".join(f"{n} {k}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])))


def scored_results(memory: bool = False) -> list[dict]:
    """Every run of the data file through :func:`score` (no memory estimates by default)."""
    models = set(preset_names(MODEL_DIRNAME))
    return [score(r, models, memory) for r in json.loads(DATA.read_text())["runs"]]


def moe_ratio_deciles(results: list[dict]) -> tuple[float, float]:
    """10th and 90th percentile of measured / predicted step time over the scored MoE runs
    (``planner/uncertainty.MOE_CALIBRATION_RATIO``, by ``uncertainty.ratio_deciles``): the measured step is
    ``gbs * seq / (tokens/s/GPU * GPUs)``, so measured / predicted = predicted / published tokens/s = 1 + error."""
    from planner.uncertainty import ratio_deciles

    return ratio_deciles(1 + o["error"] for o in results if o["scored"] and o["family"] == "MoE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--by-term", action="store_true", help="print each scored run's step-time breakdown")
    ap.add_argument("--json", metavar="PATH", help="write the per-run results here")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory estimates")
    args = ap.parse_args()
    data = json.loads(DATA.read_text())
    models = set(preset_names(MODEL_DIRNAME))
    results = []
    for r in data["runs"]:
        o = score(r, models, not args.no_memory)
        results.append(o)
        print(line(o))
        if args.by_term and o["scored"]:
            print(breakdown_line(o))
    summary(results)
    lo, hi = moe_ratio_deciles(results)
    print(f"measured / predicted step time, 10th-90th percentile of the scored MoE runs: {lo:.3f}-{hi:.3f} "
          "(planner/uncertainty.MOE_CALIBRATION_RATIO)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
