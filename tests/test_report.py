"""Report figures: non-trivial files, the estimate's numbers drawn, and the HTML page in headless Chromium."""

import shutil
import subprocess

import pytest

pytest.importorskip("matplotlib")

from planner.cli import app  # noqa: E402
from planner.cost import stage_times  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.render import scenario_json  # noqa: E402
from planner.report import simulate_timeline, write_report  # noqa: E402
from planner.specs import GIB, Plan, Scenario, TrainingSpec  # noqa: E402

PLANS = {
    "gpt3-175b-interleaved": Scenario(
        model=load_model("gpt3-175b"), hardware=load_hardware("a100-80gb"),
        training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048, attention="materialized"),
        plan=Plan(tp=8, pp=8, dp=1, vpp=3, micro_batch_size=1, recompute="selective", sequence_parallel=True)),
    "llama3-8b-uneven-1f1b": Scenario(
        model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
        training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096),
        plan=Plan(tp=2, pp=4, dp=2, micro_batch_size=1, zero_stage=1, layers_per_stage=(7, 9, 9, 7))),
}


def _nonblank_png(path, min_bytes=5000):
    import matplotlib.image as mpimg

    assert path.stat().st_size > min_bytes, path
    img = mpimg.imread(path)
    assert img.std() > 0.02, f"{path} looks blank"
    return img


@pytest.fixture(scope="module", params=list(PLANS))
def rendered(request, tmp_path_factory):
    sc = PLANS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    figures = write_report(sc, out, sweep=[sc.training.num_gpus // 2, sc.training.num_gpus, 2 * sc.training.num_gpus])
    return sc, out, figures


def test_every_figure_written_as_png_and_svg(rendered):
    _, out, figures = rendered
    for name in ("timeline", "memory", "map", "scaling"):
        png, svg = figures[name]["paths"]
        _nonblank_png(png)
        assert svg.stat().st_size > 5000 and svg.read_text().lstrip().startswith("<?xml")


def test_memory_figure_draws_the_estimate(rendered):
    sc, _, figures = rendered
    mem = estimate_memory(sc.model, sc.hardware, sc.training, sc.plan)
    drawn = figures["memory"]
    for i, stage in enumerate(mem.stages):
        assert drawn["stacks"]["activations"][i] == stage.activations_bytes / GIB
        assert drawn["totals"][i] == pytest.approx(stage.total_bytes / GIB, rel=1e-12)
    assert drawn["usable_gib"] == mem.usable_gib


def test_timeline_draws_the_cost_model_times(rendered):
    sc, _, figures = rendered
    ops = figures["timeline"]["ops"]
    p = sc.resolved_plan()
    times = stage_times(sc.model, sc.hardware, sc.training, p)
    assert len(ops) == 2 * p.num_microbatches * p.vpp * p.pp
    for op in ops:
        t = times[op.stage]
        expected = (t.fwd if op.kind == "F" else t.bwd) - t.pp_comm / 2
        assert op.end_s - op.start_s == pytest.approx(expected / p.vpp, rel=1e-9)
    # no stage runs two things at once, and every stage starts its first backward after its warm-up
    for r in range(p.pp):
        mine = sorted((o for o in ops if o.stage == r), key=lambda o: o.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))


def test_timeline_1f1b_makespan_matches_the_bubble_formula():
    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=4096),
                  plan=Plan(tp=1, pp=4, dp=1, micro_batch_size=1, layers_per_stage=(8, 8, 8, 8)))
    ops = simulate_timeline(sc)
    times = stage_times(sc.model, sc.hardware, sc.training, sc.plan)
    # stages differ only by the logits on the last one: (m + p - 1) slots of the slowest stage bound the step
    slot = max(t.fwd + t.bwd for t in times)
    assert max(o.end_s for o in ops) <= (8 + 4 - 1) * slot + 1e-9


def test_timeline_backward_includes_deepspeeds_accumulation_passes():
    """Under DeepSpeed each micro-batch's backward ends with BF16_Optimizer's accumulation passes (26 B per local
    parameter on the last stage, 28 on the one before it; tests/test_cost_deepspeed.py derives the parameter counts
    of Llama-3-8B's two stages), which the step time counts: the timeline draws them in every backward."""
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    params = (16 * layer + 128256 * 4096, 16 * layer + 4096 + 128256 * 4096)  # stage 0, stage 1
    rate = 3350e9 * 0.8  # h100-sxm-80gb: hbm_bandwidth_gbps x hbm_efficiency
    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework="deepspeed"),
                  plan=Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=0))
    times = stage_times(sc.model, sc.hardware, sc.training, sc.plan)
    ops = simulate_timeline(sc)
    for r, (per_param, n) in enumerate(zip((28, 26), params)):
        backward = [o.end_s - o.start_s for o in ops if o.stage == r and o.kind == "B"]
        assert len(backward) == 8
        expected = times[r].bwd - times[r].pp_comm / 2 + per_param * n / rate
        assert backward == pytest.approx([expected] * 8, rel=1e-9)
    megatron = sc.model_copy(update={"training": sc.training.model_copy(update={"framework": "megatron"})})
    t0 = stage_times(megatron.model, megatron.hardware, megatron.training, megatron.plan)[0]
    drawn = [o.end_s - o.start_s for o in simulate_timeline(megatron) if o.stage == 0 and o.kind == "B"]
    assert drawn == pytest.approx([t0.bwd - t0.pp_comm / 2] * 8, rel=1e-12)  # Megatron accumulates in the GEMM


def test_map_marks_infeasible_cells_with_a_reason(rendered):
    _, _, figures = rendered
    cells = figures["map"]["cells"]
    assert any(c["tokens_per_s"] for c in cells.values())
    assert all(c["reason"] for c in cells.values() if not c["tokens_per_s"])


def test_html_is_self_contained(rendered):
    _, out, figures = rendered
    page = figures["html"].read_text()
    assert page.count("data:image/png;base64,") >= 4
    assert "src=\"http" not in page and "href=\"http" not in page


def test_html_page_in_headless_chromium(rendered, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (Debian package chromium; .ci/run installs it)")
    _, _, figures = rendered
    shot = tmp_path / "page.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400", f"--screenshot={shot}",
           figures["html"].as_uri()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    img = _nonblank_png(shot, min_bytes=20000)
    assert img.shape[0] >= 2000


def test_report_cli(runner, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(scenario_json(PLANS["llama3-8b-uneven-1f1b"]))
    res = runner.invoke(app, ["report", str(plan), "--out", str(tmp_path / "r"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r" / "report.html").exists() and (tmp_path / "r" / "memory.svg").exists()
    res = runner.invoke(app, ["report", str(plan), "--validate", str(plan), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--validate" in res.output
    res = runner.invoke(app, ["search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "16", "--seq-len", "4096", "--report", str(tmp_path / "s"), "--quiet"])
    assert res.exit_code == 0 and (tmp_path / "s" / "timeline.png").exists()


def test_validate_figure(tmp_path):
    from planner.report import validate_figure

    report = {"memory": [{"metric": "weights_bytes", "stage": 0, "rank": 0, "predicted": 2**20, "measured": 2**20,
                          "rel_error": 0.0}],
              "step_time": {"predicted_s": 0.5, "measured_s": 0.6}}
    drawn = validate_figure(report, tmp_path)
    assert drawn["predicted"] == [1.0, 0.5] and drawn["measured"] == [1.0, 0.6]
    _nonblank_png(drawn["paths"][0], min_bytes=3000)
