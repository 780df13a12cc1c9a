"""benchmarks/data/megatron_bridge_perf.json: the layout identities of every run, and two parenthesised rows
re-read by hand from the page (docs/performance-summary.md of NVIDIA-NeMo/Megatron-Bridge at commit
df0289c180dd20ff26933455c7a0a11084f6a36f)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RUNS = json.loads((Path(__file__).resolve().parent.parent / "benchmarks/data/megatron_bridge_perf.json").read_text())["runs"]
# the rows whose own figures disagree, as the data file flags them (checked against the page by hand)
FLAGGED = {("25.11", "DGX-GB300", "Qwen3_235B_a22B", "main"), ("25.11", "DGX-H100", "GPT OSS 120B", "main"),
           ("25.09", "DGX-GB200", "LLAMA3_70B", "parenthesised"), ("25.09", "DGX-GB200", "DeepSeekV3", "parenthesised")}


def key(r: dict) -> tuple:
    return r["release"], r["system"], r["model_published"], r["variant"]


@pytest.mark.parametrize("r", RUNS, ids=lambda r: "-".join(map(str, key(r))) + f"-{r['precision']}-{r['mbs']}")
def test_layout_identities(r):
    """gpus = tp*pp*cp*dp for an integer dp, gbs = mbs*dp*ga, and EP divides tp*cp*dp (Megatron-Core
    parallel_state draws the expert-parallel group from one pipeline stage's ranks), unless the row is flagged."""
    mp = r["tp"] * r["pp"] * r["cp"]
    assert r["gpus"] % mp == 0
    dp = r["gpus"] // mp
    ok = r["gbs"] == r["mbs"] * dp * r["ga"] and (not r["ep"] or (r["gpus"] // r["pp"]) % r["ep"] == 0)
    assert ok != (key(r) in FLAGGED)
    assert ("inconsistent" in r) == (key(r) in FLAGGED)


def find(release, system, model, variant):
    (r,) = [r for r in RUNS if key(r) == (release, system, model, variant)]
    return r


def test_parenthesised_split_25_11_b200_405b():
    # page, 25.11, DGX-B200: "| LLAMA3.1_405B | 128 | FP8-CS (FP8-MX) | 64 | 1 | 8192 | 0 | 4 | 8 | 2 | 8 | 1 | 32 |
    # 661 (624) | 1667 (1576) |"
    main = find("25.11", "DGX-B200", "LLAMA3.1_405B", "main")
    par = find("25.11", "DGX-B200", "LLAMA3.1_405B", "parenthesised")
    shape = dict(gpus=128, gbs=64, mbs=1, seq=8192, fsdp=0, tp=4, pp=8, cp=2, vp=8, ep=1, ga=32)
    assert {k: main[k] for k in shape} == shape == {k: par[k] for k in shape}
    assert (main["precision_published"], main["precision"], main["tokens_per_s_per_gpu"], main["model_tflops_per_gpu"]) \
        == ("FP8-CS", "fp8", 661, 1667)
    assert (par["precision_published"], par["precision"], par["tokens_per_s_per_gpu"], par["model_tflops_per_gpu"]) \
        == ("FP8-MX", "mxfp8", 624, 1576)


def test_parenthesised_split_25_09_gb200_405b():
    # page, 25.09, DGX-GB200 (no precision column): "| LLAMA3.1_405B | 128 | 64 | 1 | 8192 | 1 (0) | 2 (4) | 1 (8) |
    # 1 (2) | 1 (8) | 1 | 1 (32) | 729 (578) | 1840 (1458) |"
    main = find("25.09", "DGX-GB200", "LLAMA3.1_405B", "main")
    par = find("25.09", "DGX-GB200", "LLAMA3.1_405B", "parenthesised")
    cols = ("fsdp", "tp", "pp", "cp", "vp", "ga", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "precision")
    assert tuple(main[k] for k in cols) == (1, 2, 1, 1, 1, 1, 729, 1840, "fp8")
    assert tuple(par[k] for k in cols) == (0, 4, 8, 2, 8, 32, 578, 1458, "mxfp8")
    assert main["precision_published"] is None and par["precision_published"] is None
    assert (main["gbs"], main["mbs"], main["ep"]) == (par["gbs"], par["mbs"], par["ep"]) == (64, 1, 1)


RECIPE_KEYS = {"repo": str, "file": str, "commit": str, "config": str, "cpu_offloading_num_layers": int,
               "use_megatron_fsdp": bool}


@pytest.mark.parametrize("r", RUNS, ids=lambda r: "-".join(map(str, key(r))) + f"-{r['precision']}-{r['mbs']}")
def test_recipe_memory_switches(r):
    """Every run names the Megatron-Bridge performance config it is read against (or says why none) and carries that
    config's memory switches, as scripts/performance/utils/overrides.py applies them (the data file's notes)."""
    rc = r["recipe"]
    if rc["config"] is None:
        assert isinstance(rc["why"], str) and rc["why"]
        return
    for k, t in RECIPE_KEYS.items():
        assert isinstance(rc[k], t), k
    assert len(rc["commit"]) == 40 and int(rc["commit"], 16) >= 0
    assert rc["file"].startswith("scripts/performance/configs/") and rc["file"].endswith("_workload_base_configs.py")
    assert rc["cpu_offloading_num_layers"] >= 0
    n = rc["recompute_num_layers"]
    assert n is None or (isinstance(n, int) and not isinstance(n, bool) and n > 0)
    mods = rc["recompute_modules"]
    assert mods is None or (isinstance(mods, list) and all(isinstance(m, str) for m in mods))
    # overrides.py: recompute_num_layers -> full/block; a recompute_modules list -> selective (set last)
    granularity = "selective" if mods is not None else ("full" if n is not None else None)
    assert rc["recompute_granularity"] == granularity
    assert rc["recompute_method"] == ("block" if n is not None else None)
    assert rc["layout_differs_from_row"] is None or isinstance(rc["layout_differs_from_row"], str)


def test_recipe_405b_gb200_fp8cs_offloads_92_layers():
    """NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs/llama/llama31_workload_base_configs.py at
    0013c9a8ed4d655cd4e8ad8f918b11588e53c85d, LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V1: num_gpus=128,
    tensor_model_parallel_size=2, global_batch_size=64, use_megatron_fsdp=True, cpu_offloading_num_layers=92 (the 25.09
    GB200 row: 128 GPUs, GBS 64, FSDP, TP 2)."""
    rc = find("25.09", "DGX-GB200", "LLAMA3.1_405B", "main")["recipe"]
    assert (rc["config"], rc["commit"]) == ("LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V1",
                                            "0013c9a8ed4d655cd4e8ad8f918b11588e53c85d")
    assert (rc["cpu_offloading_num_layers"], rc["use_megatron_fsdp"], rc["recompute_num_layers"]) == (92, True, None)
    assert rc["layout_differs_from_row"] is None


def test_recipe_8b_h100_recomputes_5_layers_in_full():
    """NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs/llama/llama3_workload_base_configs.py at
    00919dcf1fe13c0acf65e131f244378f0a6cd2b5, LLAMA3_8B_PRETRAIN_CONFIG_H100_FP8_CS_V1: BASE_LLAMA3_8B_CONFIG (8 GPUs,
    GBS 128), context_parallel_size=1, recompute_num_layers=5; scripts/performance/utils/overrides.py
    (00538e26aa5419eb94c4fab3629b99059867a135) turns that into recompute_granularity 'full', recompute_method 'block'.
    The row ran with FSDP, which this config does not set."""
    rc = find("25.11", "DGX-H100", "LLAMA3_8B", "main")["recipe"]
    assert (rc["config"], rc["commit"]) == ("LLAMA3_8B_PRETRAIN_CONFIG_H100_FP8_CS_V1",
                                            "00919dcf1fe13c0acf65e131f244378f0a6cd2b5")
    assert (rc["recompute_num_layers"], rc["recompute_granularity"], rc["recompute_method"]) == (5, "full", "block")
    assert (rc["cpu_offloading_num_layers"], rc["use_megatron_fsdp"]) == (0, False)
    assert "FSDP" in rc["layout_differs_from_row"]


def _bridge_benchmark():
    from tests.bench_modules import load_benchmark

    return load_benchmark("megatron_bridge")


def test_a2a_overlap_only_where_megatron_runs_it():
    """Megatron-Core's TransformerConfig (core_v0.16.1) asserts a virtual pipeline for the MoE all-to-all overlap when
    pp > 1, so a row whose recipe turns the overlap on for another layout runs without it at PP > 1 with no VP
    (before 2026-12-02 the DGX-B300 DeepSeek-V3 rows, PP16 without VP, were read against a PP8 VP2 recipe with the
    overlap; their own configs at 8e0fe90 / d063066b turn it off, test_recipes_read_at_the_pages_own_commit). The
    26.02 GB200 row (PP4 VP4, its recipe's own layout at NVIDIA 04264182) keeps it; PP1 rows need no VP."""
    a2a = _bridge_benchmark().a2a_overlap
    gb200 = find("26.02", "DGX-GB200", "DeepSeekV3", "main")
    assert gb200["a2a_overlap"] and (gb200["pp"], gb200["vp"]) == (4, 4) and a2a(gb200)
    assert not a2a({"a2a_overlap": True, "pp": 16, "vp": None})
    assert a2a({"a2a_overlap": True, "pp": 1, "vp": None}) and not a2a({"a2a_overlap": False, "pp": 4, "vp": 4})


def test_recipes_read_at_the_pages_own_commit():
    """26.04 rows are read against radixark/Megatron-Bridge d063066b, 26.02.01 rows against zidanehuang001 8e0fe90,
    the commits whose docs/performance-summary.md publishes them. There, deepseek_workload_base_configs.py has
    DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_FP8_MX_V2 = GB300_V2 = GB300_V1 with global_batch_size 4096: micro_batch_size 2,
    PP 2, VP 8, EP 32, pp_layout "Et*4|(t*4|)*14tmL", hybridep, moe_a2a_overlap False, cuda_graph_scope [] and no
    cuda_graph_impl, recompute_modules ["mla_up_proj"] (the rows' own layout; NVIDIA 04264182 has micro-batch 1,
    recompute [], the overlap and a full-iteration graph). GB200_FP8_MX_V2 = GB200_V2: PP 4, VP 4, EP 64, hybridep,
    no overlap, TE graphs of attn, moe_router, moe_preprocess, recompute ["mlp"] at d063066b, ["mla_up_proj"] at
    8e0fe90. Qwen3-235B's B300 and H100 builders at 8e0fe90 set moe_token_dispatcher_type "alltoall"
    (qwen3_llm_pretrain.py), so the backend BASE_QWEN3_235B_A22B_CONFIG names ("deepep") does not run there."""
    commit = {"26.04": "d063066b4d66853c4c9308caf321a9c5b8836915", "26.02.01": "8e0fe90db6d83e179c775922836921443fda0435"}
    commit["26.02"] = commit["26.02.01"]  # the 26.02 GB300 row's layout is 8e0fe90's config, not 04264182's
    for release in ("26.04", "26.02.01", "26.02"):
        gb300 = find(release, "DGX-GB300", "DeepSeekV3", "main")
        rc = gb300["recipe"]
        assert rc["commit"] == commit[release] and gb300["mbs"] == 2 and rc["layout_differs_from_row"] is None
        assert (rc["recompute_modules"], rc["moe_a2a_overlap"], rc["cuda_graph"]) == (["mla_up_proj"], False, None)
        assert not gb300["a2a_overlap"] and gb300["dispatcher"] == "deepep"
    for release, mlp_recompute in (("26.04", ["mlp"]), ("26.02.01", ["mla_up_proj"])):
        gb200 = find(release, "DGX-GB200", "DeepSeekV3", "main")["recipe"]
        assert (gb200["commit"], gb200["recompute_modules"], gb200["moe_a2a_overlap"], gb200["cuda_graph"]) == \
            (commit[release], mlp_recompute, False, "transformer_engine [attn, moe_router, moe_preprocess]")
    for system in ("DGX-B300", "DGX-H100"):
        r = find("26.02.01", system, "Qwen3_235B_a22B", "main")
        assert r["recipe"]["moe_token_dispatcher_type"] == "alltoall" and r["dispatcher"] == "alltoall"
    assert find("26.04", "DGX-B300", "Qwen3_235B_a22B", "main")["dispatcher"] == "deepep"  # its builder sets flex


def test_every_run_published_with_its_recipes_layout_fits():
    """NVIDIA ran every row of the performance summary; where the row's layout is its recipe's (no
    ``layout_differs_from_row``), the recipe's memory switches are the ones that ran, so plan3d must predict the
    run to fit (a false out-of-memory on a configuration that ran, issue 13). The rows whose layout differs from
    the recipe (a micro-batch of 2 where the recipe has 1, PP 1 where it has PP 4) are left out: the switches that
    ran with them are not known. Before GB200's capacity was read as 186e9 B (173.2 GiB, where the device reports
    189,471 MiB), its 405B and 70B-FSDP rows failed here."""
    bench = _bridge_benchmark()
    models = set(bench.preset_names(bench.MODEL_DIRNAME))
    checked, too_big = 0, []
    for r in RUNS:
        if (r.get("recipe") or {}).get("layout_differs_from_row") or bench.not_modelled(r, models):
            continue
        o = bench.score(r, models, memory=True)
        if "fits" not in o:  # refused by plan3d's layout rules (printed as such by the benchmark)
            continue
        checked += 1
        if not o["fits"]:
            too_big.append(f"{r['release']} {r['system']} {r['model']} {r['precision']} {o['label']}: "
                           f"{o['peak_gib']:.1f} of {o['usable_gib']:.1f} GiB")
    assert checked >= 100 and not too_big, too_big


def test_token_dropping_rows_are_scored_as_padded_capacity_over_alltoall(monkeypatch):
    """The 25.09 "(tokendrop)" rows ran Megatron-Bridge's apply_moe_token_drop: capacity 1.0, padded, alltoall
    dispatcher (DeepEP disabled). They are scored as such, also where the row's recipe names DeepEP (the GB200
    DeepSeek-V3 row): before 2026-12-06 they were left out as "plan3d costs dropless routing"."""
    bench = _bridge_benchmark()
    models = set(bench.preset_names(bench.MODEL_DIRNAME))
    seen = []
    real = bench.estimate_time

    def spy(model, hw, training, plan, *a, **k):
        seen.append((model.capacity_factor, training.moe_token_dispatcher))
        return real(model, hw, training, plan, *a, **k)

    monkeypatch.setattr(bench, "estimate_time", spy)
    rows = [r for r in RUNS if r.get("model_note") == "tokendrop"]
    scored = [bench.score(r, models, memory=False) for r in rows]
    assert sum(o["scored"] for o in scored) >= 10
    assert seen and all(s == (1.0, "alltoall") for s in seen), seen
    deepep = [o for r, o in zip(rows, scored) if r["dispatcher"] == "deepep" and r["model"] == "deepseek-v3"
              and not r.get("inconsistent")]
    assert deepep and all(o["scored"] for o in deepep)
