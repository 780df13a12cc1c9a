"""`plan3d search` through the CLI: pins, top-K, infeasible exit 3, sweeps, JSON, plan files."""

import json

from planner.cli import app

JOB = ["--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--global-batch", "64", "--seq-len", "4096"]


def _json(runner, args):
    res = runner.invoke(app, ["search", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_search_json_schema(runner):
    d = _json(runner, [*JOB, "--gpus", "16", "--top", "2"])
    assert set(d) >= {"plan", "memory", "flops", "time", "alternatives", "solver"}
    assert d["solver"]["status"] == "OPTIMAL" and d["solver"]["candidates"] > 100 and d["solver"]["wall_s"] > 0
    assert len(d["alternatives"]) == 2
    for alt in d["alternatives"]:
        assert set(alt) >= {"plan", "memory", "time", "loses_on"}
        assert alt["time"]["step_time_s"] >= d["time"]["step_time_s"]
        assert alt["loses_on"]["term"] in d["time"]["breakdown"]
    assert d["memory"]["fits"]


def test_pins(runner):
    d = _json(runner, [*JOB, "--gpus", "16", "--tp", "4", "--recompute", "full", "--zero-stage", "1",
                       "--micro-batch-size", "1", "--no-sequence-parallel", "--top", "0"])
    p = d["plan"]
    assert (p["tp"], p["recompute"], p["zero_stage"], p["micro_batch_size"], p["sequence_parallel"]) == \
        (4, "full", 1, 1, False)
    d = _json(runner, [*JOB, "--gpus", "16", "--pp", "2", "--vpp", "2", "--top", "0"])
    assert (d["plan"]["pp"], d["plan"]["vpp"]) == (2, 2)


def test_table_shows_alternatives_and_reasons(runner):
    res = runner.invoke(app, ["search", *JOB, "--gpus", "16", "--top", "2"])
    assert res.exit_code == 0, res.output
    assert "Best plan and alternatives" in res.output and "OPTIMAL" in res.output
    assert " +" in res.output  # each alternative names the term it loses on


def test_quiet_prints_only_the_best_plan(runner):
    res = runner.invoke(app, ["search", *JOB, "--gpus", "16", "--top", "2", "--quiet"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("best: ") and "step" in lines[0] and "GiB" in lines[0]
    assert "Best plan and alternatives" not in res.output


def test_infeasible_exit_3_names_binding_constraint_and_smallest_cluster(runner):
    res = runner.invoke(app, ["search", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "2048"])
    assert res.exit_code == 3
    assert "needing" in res.output and "GiB usable" in res.output
    assert "the smallest GPU count that fits is 64" in res.output


def test_sweep_list_and_range(runner):
    d = _json(runner, [*JOB, "--gpus", "8..32"])
    assert [r["gpus"] for r in d["sweep"]] == [8, 16, 32]
    assert d["smallest_fitting_gpus"] == 8
    assert all(r["fits"] and r["time"]["tokens_per_s"] > 0 for r in d["sweep"])
    res = runner.invoke(app, ["search", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "8,64",
                              "--global-batch", "64", "--seq-len", "2048", "--quiet"])
    assert res.exit_code == 0 and "no plan fits" in res.output and "Smallest GPU count that fits: 64" in res.output


def test_exhaustive_flag_agrees(runner):
    a = _json(runner, [*JOB, "--gpus", "8", "--top", "0"])
    b = _json(runner, [*JOB, "--gpus", "8", "--exhaustive"])
    assert b["solver"]["status"] == "EXHAUSTIVE"
    assert abs(a["time"]["step_time_s"] / b["time"]["step_time_s"] - 1) < 1e-6


def test_out_writes_plan_file_that_estimate_reads(runner, tmp_path):
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["search", *JOB, "--gpus", "16", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    again = runner.invoke(app, ["estimate", str(out), "--json"])
    assert again.exit_code == 0, again.output
    est = json.loads(again.stdout)
    assert est["plan"]["tp"] * est["plan"]["pp"] * est["plan"]["dp"] * est["plan"]["cp"] == 16
    # never overwrite without --force
    before = out.read_text()
    res = runner.invoke(app, ["search", *JOB, "--gpus", "8", "--out", str(out)])
    assert res.exit_code == 2 and "--force" in res.output and out.read_text() == before
    res = runner.invoke(app, ["search", *JOB, "--gpus", "8", "--out", str(out), "--force", "--quiet"])
    assert res.exit_code == 0 and out.read_text() != before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary files left


def test_bad_search_input(runner):
    for args, needle in ((["--gpus", "abc"], "--gpus"), (["--gpus", "64..8"], "--gpus"),
                         (["--gpus", "8", "--recompute", "half"], "--recompute")):
        res = runner.invoke(app, ["search", *JOB, *args])
        assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output


def test_json_silences_the_spinner(runner):
    res = runner.invoke(app, ["search", *JOB, "--gpus", "8", "--json", "--top", "0"])
    json.loads(res.stdout)  # nothing but JSON on stdout
