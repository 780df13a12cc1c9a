"""plan3d validate and calibrate on this machine: eight torch.distributed ranks on the gloo backend.

Each run starts torchrun with TP2 x PP2 x DP2 (8 CPU processes) on a miniature of the plan. GPU
checks (one rank's share of a real plan on a GPU) are in test_validate_gpu.py and skip without CUDA.
"""

import json
import math
import re

import pytest

pytest.importorskip("torch")

from planner.cli import app  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.render import scenario_json  # noqa: E402
from planner.specs import Plan, Scenario, TrainingSpec  # noqa: E402
from planner.validate.launch import MEMORY_TOLERANCE, miniature, validate_local  # noqa: E402
from tests.torchrun_jobs import error_lines, run_torchrun  # noqa: E402

RUN_LIMIT_S = 120  # acceptance: each variant completes in under 2 minutes


def _scenario(model="llama3-8b", framework="megatron", **plan):
    base = dict(tp=2, pp=2, dp=16, micro_batch_size=1, recompute="none", sequence_parallel=False, zero_stage=0)
    return Scenario(model=load_model(model), hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048, framework=framework),
                    plan=Plan(**(base | plan)))


VARIANTS = {
    "tp2-pp2-dp2": {},
    "interleaved-vpp2": {"vpp": 2},
    "sequence-parallel": {"sequence_parallel": True, "zero_stage": 1},
    "selective-recompute": {"recompute": "selective", "sequence_parallel": True},
    "gpt-full-recompute-zero3": {"model": "megatron-gpt-1.7b", "recompute": "full", "zero_stage": 3},
    "uneven-stages": {"layers_per_stage": (15, 17), "recompute": "selective"},
    # Megatron's block recompute: the first layer of each 2-layer stage recomputed, the other keeps everything
    "block-recompute": {"recompute": "full", "recompute_num_layers": 1},
    # torchtitan's per-layer AC: the second layer of each rank's two recomputed, the first keeps everything
    "layer-interval-recompute": {"framework": "torchtitan", "recompute": "full", "recompute_interval": 2,
                                 "zero_stage": 3},
    # rank 0's first chunk holds only the embedding (specs.min_stage_layers): chunks (0, 1, 1, 1) and (3, 3, 3, 3)
    "empty-embedding-chunk": {"vpp": 4, "layers_per_stage": (3, 29)},
}


@pytest.mark.parametrize("name", VARIANTS)
def test_validate_miniature(name):
    spec = dict(VARIANTS[name])
    sc = _scenario(spec.pop("model", "llama3-8b"), spec.pop("framework", "megatron"), **spec)
    mini, outcome = validate_local(sc, steps=3, timeout_s=RUN_LIMIT_S)
    assert outcome.ok, outcome.message
    report = outcome.report
    assert report["wall_s"] < RUN_LIMIT_S
    p = mini.plan
    assert (p.tp, p.pp, p.dp, p.vpp) == (2, 2, 2, sc.plan.vpp) and p.recompute == sc.plan.recompute
    assert (p.recompute_num_layers, p.recompute_interval) == (sc.plan.recompute_num_layers, sc.plan.recompute_interval)
    assert p.sequence_parallel == sc.plan.sequence_parallel
    if sc.plan.layers_per_stage and sc.plan.vpp == 1:  # the lighter first stage stays lighter in the miniature
        assert p.layers_per_stage == (1, 3)
    if name == "empty-embedding-chunk":  # and its embedding-only chunk stays empty
        assert p.layers_per_stage == (3, 12) and p.chunk_layers(mini.model.num_layers) == ((0, 1, 1, 1), (3, 3, 3, 3))
    # memory: weights, gradients, optimizer states and saved activations, every rank
    assert len(report["memory"]) == 8 * 4
    for row in report["memory"]:
        assert abs(row["rel_error"]) <= MEMORY_TOLERANCE, row
    # gradients flow through TP, PP and DP together: finite loss that falls on a fixed batch
    losses = report["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    # the distributed model computes what one process computes with the same weights
    assert abs(report["reference"]["rel_error"]) < 1e-4
    assert report["step_time"]["measured_s"] > 0 and report["step_time"]["predicted_s"] > 0
    assert {"tp_all_reduce", "pp_send_recv", "dp_all_reduce"} <= set(report["microbenchmarks"])


def test_a_killed_rank_fails_cleanly_within_the_timeout(monkeypatch):
    monkeypatch.setenv("PLAN3D_VALIDATE_FAULT", "5:step 1")
    import time

    t0 = time.perf_counter()
    _, outcome = validate_local(_scenario(), steps=3, timeout_s=90)
    assert time.perf_counter() - t0 < 90
    assert not outcome.ok
    text = "\n".join(outcome.message)
    assert "a rank failed" in text and "phase" in text and "injected fault" in text


def test_a_stalled_rank_is_named_at_the_wall_clock_limit(monkeypatch):
    monkeypatch.setenv("PLAN3D_VALIDATE_FAULT", "3:build:hang")
    import time

    t0 = time.perf_counter()
    # 4 ranks and 30 s: 8 ranks importing torch on a loaded 2-core machine did not all reach 'init' in 25 s
    _, outcome = validate_local(_scenario(), steps=3, max_ranks=4, timeout_s=30)
    assert time.perf_counter() - t0 < 45  # killed at the limit, not left hanging
    assert not outcome.ok
    message = outcome.message[0]
    assert "timed out after 30 s" in message
    stalled = re.search(r"ranks? ([\d, ]+) in phase 'build'", message)
    assert stalled and "3" in stalled.group(1).split(", "), message


def test_validate_cli_exit_codes(runner, tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    plan.write_text(scenario_json(_scenario()))
    big = tmp_path / "big.json"
    big.write_text(scenario_json(_scenario(tp=8, pp=4, dp=2)))
    res = runner.invoke(app, ["validate", str(big), "--quiet"])
    assert res.exit_code == 2 and "exceed the 8 local processes" in res.output
    assert runner.invoke(app, ["validate", str(tmp_path / "missing.json")]).exit_code == 2
    monkeypatch.setenv("PLAN3D_VALIDATE_FAULT", "0:build")
    res = runner.invoke(app, ["validate", str(plan), "--quiet", "--timeout", "60"])
    assert res.exit_code == 1 and "rank 0" in res.output


def test_miniature_keeps_the_plan_shape():
    sc = _scenario(vpp=2, recompute="selective", sequence_parallel=True, zero_stage=3)
    mini = miniature(sc)
    assert (mini.plan.tp, mini.plan.pp, mini.plan.vpp, mini.plan.recompute, mini.plan.sequence_parallel) == \
        (2, 2, 2, "selective", True)
    assert mini.training.num_gpus == 8 and mini.training.precision == "fp32"
    assert mini.model.num_layers % (2 * 2) == 0 and mini.model.kv_heads < mini.model.num_attention_heads  # GQA kept


def test_calibrate_writes_a_profile_that_search_and_validate_use(runner, tmp_path):
    profile = tmp_path / "local.yaml"
    res = runner.invoke(app, ["calibrate", "--backend", "gloo", "--out", str(profile), "--quiet"])
    assert res.exit_code == 0, res.output
    text = profile.read_text()
    assert "measured by plan3d calibrate" in text
    res = runner.invoke(app, ["search", "--model", "tiny-gpt", "--hardware", str(profile), "--gpus", "8",
                              "--global-batch", "16", "--seq-len", "256", "--json", "--top", "0"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["time"]["step_time_s"] > 0
    plan = tmp_path / "plan.json"
    plan.write_text(scenario_json(_scenario()))
    report = tmp_path / "report.json"
    # 8 ranks on CI's 2 cores: the miniature's step measured 4.26x its prediction there once (2.4x here), past
    # gloo's default then (4x, now 8x: launch.TIME_FACTOR). The judgement's own test is test_validate_verdict
    # (2 ranks); this one checks that the calibrated profile reaches validate and that the step is judged.
    res = runner.invoke(app, ["validate", str(plan), "--hardware", str(profile), "--out", str(report), "--quiet",
                              "--time-factor", "20"])
    assert res.exit_code == 0, res.output
    assert "step time (s)" in res.output  # predicted next to measured
    data = json.loads(report.read_text())
    assert data["miniature"]["hardware"]["name"] == "cpu-gloo-calibrated"
    assert data["step_time"]["predicted_s"] > 0 and data["step_time"]["measured_s"] > 0
    assert data["step_time"]["judged"] and data["tolerances"]["step_time_factor"] == 20


def test_inside_torchrun_validate_runs_the_plan_itself(tmp_path):
    """The path a Slurm job takes: torchrun starts `plan3d validate` on every rank, rank 0 reports."""
    import sys

    plan = tmp_path / "mini.plan.json"
    plan.write_text(scenario_json(miniature(_scenario(recompute="selective", sequence_parallel=True))))
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
           "-m", "planner.cli", "validate", str(plan), "--backend", "gloo", "--out", str(report)]
    res = run_torchrun(cmd, RUN_LIMIT_S)  # retried after gloo's native abort (tests/torchrun_jobs.py)
    assert res.returncode == 0, error_lines(res.stderr) + res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["memory_max_abs_error"] <= MEMORY_TOLERANCE and len(data["memory"]) == 32
    assert "Predicted against measured" in res.stdout




def test_chunk_layer_counts_follow_the_plans_own_split():
    """The worker builds each chunk as Plan.chunk_layers splits its stage, in virtual-stage order (chunk c // pp of
    rank c mod pp): 6 layers on pp 2 x vpp 4 are (0, 1, 1, 1) on rank 0 and (1, 1, 1, 0) on rank 1, the embedding's
    and the loss's chunks empty; 7 + 9 layers on vpp 2 split (3, 4) and (5, 4). The old rule (stage // vpp per
    chunk) built 0 and 3/4 layers there."""
    from planner.validate.worker import chunk_layer_counts

    model = load_model("tiny-gpt")
    for layers, lps, vpp, want in ((6, (3, 3), 4, [0, 1, 1, 1, 1, 1, 1, 0]), (16, (7, 9), 2, [3, 5, 4, 4])):
        sc = Scenario(model=model.model_copy(update={"num_layers": layers}), hardware=load_hardware("cpu-gloo"),
                      training=TrainingSpec(num_gpus=2, global_batch_size=8, seq_len=128),
                      plan=Plan(tp=1, pp=2, dp=1, vpp=vpp, micro_batch_size=1, layers_per_stage=lps))
        assert chunk_layer_counts(sc) == want
