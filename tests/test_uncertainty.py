"""Prediction ranges (planner/uncertainty.py): the calibration ranges (dense and MoE) are recomputed from their
runs, so they cannot go stale; the sources range and the lead test follow their stated rules."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner import uncertainty as U
from tests.bench_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _calibration_module():
    return load_benchmark("calibration")


def test_calibration_ratio_matches_the_calibration_runs():
    """CALIBRATION_RATIO is the 10th/90th percentile of measured/predicted over the runs the benchmark scores
    (published step times: Narayanan 2021, Korthikanti 2022, NeMo 24.07; sources in the data files)."""
    bench = _calibration_module()
    runs = bench.scored_runs()
    assert len(runs) >= 30
    lo, hi = bench.ratio_deciles(runs)
    assert (lo, hi) == pytest.approx(U.CALIBRATION_RATIO, abs=0.005), (
        f"the cost model changed: set CALIBRATION_RATIO = ({lo:.3f}, {hi:.3f}) in planner/uncertainty.py")


def test_moe_calibration_ratio_matches_the_megatron_bridge_moe_runs():
    """MOE_CALIBRATION_RATIO is the 10th/90th percentile of measured/predicted over the scored MoE runs of NVIDIA's
    Megatron-Bridge performance summary (benchmarks/data/megatron_bridge_perf.json, each run with its source)."""
    bench = load_benchmark("megatron_bridge")
    results = bench.scored_results()
    assert sum(o["scored"] and o["family"] == "MoE" for o in results) >= 60
    lo, hi = bench.moe_ratio_deciles(results)
    assert (lo, hi) == pytest.approx(U.MOE_CALIBRATION_RATIO, abs=0.005), (
        f"the cost model changed: set MOE_CALIBRATION_RATIO = ({lo:.3f}, {hi:.3f}) in planner/uncertainty.py")


def test_a_moe_estimate_takes_the_moe_calibration_range():
    job = ["--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "16", "--seq-len", "256", "--pp", "1",
           "--json"]
    for model, tp, ratio, kind in (("tiny-moe", "1", U.MOE_CALIBRATION_RATIO, "moe"),
                                   ("llama3-8b", "2", U.CALIBRATION_RATIO, "dense")):
        out = subprocess.run([sys.executable, "-m", "planner.cli", "estimate", "--model", model, "--tp", tp, *job],
                             capture_output=True, text=True, cwd=ROOT, check=True)
        time = json.loads(out.stdout)["time"]
        r = time["range"]
        assert r["calibration_set"] == kind
        assert r["calibration_s"] == pytest.approx([time["step_time_s"] * ratio[0], time["step_time_s"] * ratio[1]])
        assert r["high_s"] >= time["step_time_s"] * ratio[1]


def test_sources_range_sums_term_spreads():
    breakdown = {"compute": 1.0, "tp_comm": 0.5, "new_term": 0.2}
    r = U.time_range(1.7, breakdown)
    half = 0.05 * 1.0 + 0.13 * 0.5 + 0.25 * 0.2
    assert r["sources_s"] == pytest.approx([1.7 - half, 1.7 + half])
    assert r["low_s"] == min(1.7 - half, 1.7 * U.CALIBRATION_RATIO[0])
    assert r["high_s"] == max(1.7 + half, 1.7 * U.CALIBRATION_RATIO[1])


def test_lead_within_range_uses_the_best_plans_sources_range():
    best = {"compute": 10.0, "tp_comm": 1.0}  # sources half-width 0.05 * 10 + 0.13 * 1 = 0.63 s
    assert U.lead_within_range(best, 11.0, {"compute": 10.5, "tp_comm": 1.1}, 11.6)
    assert not U.lead_within_range(best, 11.0, {"compute": 10.6, "tp_comm": 1.1}, 11.7)


def test_search_json_reports_range_and_marks_close_alternatives():
    out = subprocess.run([sys.executable, "-m", "planner.cli", "search", "--model", "llama3-8b", "--hardware",
                          "h100-sxm-80gb", "--gpus", "16", "--global-batch", "64", "--seq-len", "4096", "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    data = json.loads(out.stdout)
    r = data["time"]["range"]
    assert r["low_s"] <= data["time"]["step_time_s"] <= r["high_s"]
    assert data["alternatives"] and all(isinstance(a["lead_within_range"], bool) for a in data["alternatives"])
