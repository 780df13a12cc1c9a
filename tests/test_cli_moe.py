"""The MoE options on the command line: what a user (and the scorer of measured MoE runs) types.

`plan3d search --model <HF config.json> ... --ep N` with the published layout pinned must give a plan
with that ep in its JSON, and a step time that counts the all-to-all (the `ep_comm` term)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "data" / "hf"


def plan3d(*args):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("config,gpus,pins", [
    ("gpt-oss-120b", 64, ["--tp", "1", "--pp", "1", "--ep", "8"]),
    ("qwen3-30b-a3b", 16, ["--tp", "1", "--pp", "2", "--vpp", "12", "--ep", "8", "--micro-batch-size", "1"]),
])
def test_search_an_hf_moe_config_with_the_layout_pinned(tmp_path, config, gpus, pins):
    folder = tmp_path / config
    folder.mkdir()
    shutil.copy(HF / f"{config}.json", folder / "config.json")
    p = plan3d("search", "--model", str(folder / "config.json"), "--hardware", "h100-sxm-80gb", "--gpus", str(gpus),
               "--global-batch", "512", "--seq-len", "4096", "--precision", "bf16", *pins, "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["plan"]["ep"] == 8 and data["plan"]["tp"] == int(pins[1])
    assert data["time"]["breakdown"]["ep_comm"] > 0
    assert data["time"]["step_time_s"] == pytest.approx(sum(data["time"]["breakdown"].values()), rel=1e-6)


def test_estimate_reports_ep_and_options_are_checked():
    job = ["--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "16", "--seq-len", "256"]
    p = plan3d("estimate", "--model", "tiny-moe", *job, "--tp", "1", "--pp", "1", "--ep", "4", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["plan"]["ep"] == 4
    p = plan3d("search", "--model", "llama3-8b", *job, "--ep", "2")
    assert p.returncode == 2 and "--ep: applies to mixture-of-experts models" in p.stderr
    p = plan3d("estimate", "--model", "tiny-moe", *job, "--tp", "1", "--pp", "1", "--ep", "3")
    assert p.returncode == 2 and "num_experts(8) is not divisible by ep(3)" in p.stderr
    p = plan3d("search", "--model", "tiny-moe", *job, "--moe-dispatcher", "nccl")
    assert p.returncode == 2 and "--moe-dispatcher: 'nccl' is not one of alltoall, allgather, deepep" in p.stderr


@pytest.mark.parametrize("command", ["search", "estimate"])
@pytest.mark.parametrize("option,expected", [
    (["--moe-a2a-overlap"], "--moe-a2a-overlap: applies to mixture-of-experts models; llama3-8b is dense"),
    (["--moe-dispatcher", "deepep"], "--moe-dispatcher: applies to mixture-of-experts models; llama3-8b is dense"),
    (["--moe-load-imbalance", "1.2"], "--moe-load-imbalance: applies to mixture-of-experts models"),
    (["--cuda-graph-modules", "attn,moe_router"], "--cuda-graph-modules: moe_router applies to mixture-of-experts"),
])
def test_moe_only_options_on_a_dense_model_are_refused(command, option, expected):
    """As --ep is: before, --moe-a2a-overlap ran and the plan line said "a2a overlap" for a dense model, a MoE
    CUDA-graph scope gave "no legal plan ... check --gpus and --global-batch", and the other two were ignored."""
    job = ["--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "8",
           "--seq-len", "1024"] + (["--tp", "1", "--pp", "1"] if command == "estimate" else [])
    p = plan3d(command, *job, *option)
    assert p.returncode == 2 and expected in p.stderr and p.stderr.count("\n") == 1, p.stderr
    # what a dense model can take of the same options still runs
    harmless = ["--no-moe-a2a-overlap"] if option[0] == "--moe-a2a-overlap" else \
        ["--cuda-graph-modules", "attn"] if option[0] == "--cuda-graph-modules" else []
    if harmless:
        p = plan3d(command, *job, *harmless, "--json")
        assert p.returncode in (0, 1), p.stderr


def test_state_options_reach_the_estimate():
    """--grad-reduce-in-bf16, --fp8-params, --optimizer-dtype: NVIDIA's Nemotron-4 340B recipe settings
    (tests/test_published_fits.py has the citations) bring its plan under the usable memory."""
    job = ["--model", "llama3-70b", "--hardware", "h100-sxm-80gb", "--gpus", "64", "--global-batch", "64",
           "--seq-len", "4096", "--tp", "8", "--pp", "4", "--sequence-parallel", "--zero-stage", "1",
           "--precision", "fp8", "--framework", "nemo", "--json"]
    base = json.loads(plan3d("estimate", *job).stdout)["memory"]["stages"][0]
    p = plan3d("estimate", *job, "--grad-reduce-in-bf16", "--fp8-params", "--optimizer-dtype", "bf16-apex")
    lean = json.loads(p.stdout)["memory"]["stages"][0]
    assert lean["grads_gib"] < base["grads_gib"] and lean["weights_gib"] < base["weights_gib"]
    assert lean["optimizer_gib"] < base["optimizer_gib"]
    p = plan3d("estimate", *job, "--optimizer-dtype", "fp16")
    assert p.returncode == 2 and "--optimizer-dtype: 'fp16' is not one of fp32, bf16, bf16-apex" in p.stderr


def test_cross_entropy_fusion_option_reaches_the_last_stage():
    """--cross-entropy-fusion te: the last stage holds 2 B per logit in place of 6 (planner/frameworks/megatron.py):
    4 B x 4096 tokens x 128256 / tp 8 = 0.245 GiB less; a bad value exits 2 naming the option."""
    job = ["--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "16", "--global-batch", "16",
           "--seq-len", "4096", "--tp", "8", "--pp", "2", "--json"]
    base = json.loads(plan3d("estimate", *job).stdout)["memory"]["stages"][-1]
    te = json.loads(plan3d("estimate", *job, "--cross-entropy-fusion", "te").stdout)["memory"]["stages"][-1]
    assert base["other_gib"] - te["other_gib"] == pytest.approx(4 * 4096 * 128256 / 8 / 2**30, abs=2e-3)
    p = plan3d("estimate", *job, "--cross-entropy-fusion", "fused")
    assert p.returncode == 2 and "--cross-entropy-fusion: 'fused' is not one of none, native, te" in p.stderr


@pytest.mark.parametrize("pins,expected", [
    (["--ep", "3"], "ep: num_experts(8) is not divisible by ep(3)"),
    (["--etp", "5"], "etp: moe_ffn_hidden_size("),
    (["--ep", "8", "--etp", "2", "--pp", "2"], "ep: etp(2) * ep(8) = 16 does not divide tp(1) * cp(1) * dp(4) = 4"),
])
def test_search_names_the_expert_pin_that_no_plan_can_meet(pins, expected):
    """A pinned ep or etp that no split of the GPUs can take is named in the 'no legal plan' line (exit 3), as the
    other pins are (candidates.pinned_layout_problems), not left to the generic 'check your pins'."""
    p = plan3d("search", "--model", "tiny-moe", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "16",
               "--seq-len", "256", *pins)
    assert p.returncode == 3, p.stderr
    first = p.stderr.splitlines()[0]
    assert first.startswith("error: no legal plan for 8 GPUs with these pins:") and expected in first, first


def test_search_says_when_deepep_would_be_faster():
    """DeepSeek-V3 on 1,024 H100s with NVIDIA's layout pinned (EP64 across 8 nodes): priced with plan3d's default
    all-to-all, DeepEP would be much faster (one copy per destination node, node-limited routing); the search says
    so on stderr with both step times. Not when the dispatcher is given, nor in --json or --quiet output."""
    job = ["search", "--model", "deepseek-v3", "--hardware", "h100-sxm-80gb", "--gpus", "1024", "--global-batch",
           "8192", "--seq-len", "4096", "--precision", "fp8", "--tp", "2", "--pp", "8", "--vpp", "4", "--ep", "64",
           "--micro-batch-size", "1"]
    p = plan3d(*job)
    assert p.returncode == 0, p.stderr
    (note,) = [ln for ln in p.stderr.splitlines() if "--moe-dispatcher deepep" in ln]
    assert note.startswith("note: with --moe-dispatcher deepep") and "per step instead of" in note
    assert "--moe-dispatcher deepep" not in plan3d(*job, "--moe-dispatcher", "alltoall").stderr
    assert "--moe-dispatcher deepep" not in plan3d(*job, "--quiet").stderr


def test_search_names_hybridep_on_nvl72():
    """On GB200 NVL72 racks NVIDIA's MoE tuning guide puts HybridEP, not DeepEP: Qwen3-235B with EP 128 over two
    racks' 64-GPU segments, priced with the all-to-all across the racks' network, would be about twice as fast with
    one copy per destination rack; the note names --moe-dispatcher hybridep, and none is given when the job already
    runs it."""
    job = ["search", "--model", "qwen3-235b-a22b", "--hardware", "gb200-nvl72", "--gpus", "256", "--global-batch",
           "4096", "--seq-len", "4096", "--precision", "mxfp8", "--tp", "1", "--pp", "2", "--ep", "128",
           "--micro-batch-size", "1", "--recompute", "full"]
    p = plan3d(*job)
    assert p.returncode == 0, p.stderr
    (note,) = [ln for ln in p.stderr.splitlines() if ln.startswith("note: with --moe-dispatcher")]
    assert note.startswith("note: with --moe-dispatcher hybridep (Megatron's flex dispatcher with HybridEP")
    assert "note: with --moe-dispatcher" not in plan3d(*job, "--moe-dispatcher", "hybridep").stderr
