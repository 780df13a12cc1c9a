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
