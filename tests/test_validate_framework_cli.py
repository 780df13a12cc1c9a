"""`plan3d validate PLAN --framework ...`: the CLI wiring of planner/validate/framework_run.py."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "logs"


def _plan3d(*args, cwd):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "120"})


def _plan(tmp_path) -> Path:
    out = tmp_path / "plan.json"
    p = _plan3d("search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch",
                "128", "--seq-len", "4096", "--tp", "4", "--pp", "2", "--micro-batch-size", "1", "--recompute", "none",
                "--zero-stage", "0", "--no-sequence-parallel", "--out", str(out), "--quiet", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    return out


def test_megatron_without_cuda_is_a_skip_with_its_reason(tmp_path):
    p = _plan3d("validate", str(_plan(tmp_path)), "--framework", "megatron", cwd=tmp_path)
    assert p.returncode == 77, p.stderr
    assert "megatron: skipped: Megatron-LM cannot run here" in p.stderr and "CUDA" in p.stderr


def test_logs_of_a_run_elsewhere_are_judged_and_written(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "job.out").write_text((DATA / "megatron_pretrain_gpt.log").read_text())
    out = tmp_path / "report.json"
    p = _plan3d("validate", str(_plan(tmp_path)), "--framework", "megatron", "--logs", str(logs), "--out", str(out),
                cwd=tmp_path)
    assert p.returncode in (0, 1), p.stderr
    report = json.loads(out.read_text())
    assert report["framework"] == "megatron" and report["status"] in ("pass", "fail")
    assert {r["rank"] for r in report["device_memory"]} == {0, 4}
    assert p.returncode == (0 if report["status"] == "pass" else 1)


def test_framework_options_are_checked(tmp_path):
    plan = _plan(tmp_path)
    p = _plan3d("validate", str(plan), "--framework", "deepspeed", cwd=tmp_path)
    assert p.returncode == 2 and "--framework: 'deepspeed' is not one of torchtitan, megatron" in p.stderr
    p = _plan3d("validate", str(plan), "--logs", str(tmp_path), cwd=tmp_path)
    assert p.returncode == 2 and "--logs: applies with --framework only" in p.stderr
