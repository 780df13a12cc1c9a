"""The zero-bubble schedules (planner/schedules.py, docs/schedules.md) hooked into the plan: the plan rule,
memory (in-flight chunks, the V placement), time (the bubble), the search knob, emit and read-back."""

from __future__ import annotations

import shlex

import numpy as np
import pytest

from planner import cost, memory
from planner.candidates import Pins, SearchSpace
from planner.cost import estimate_time
from planner.memory import estimate_memory
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec, padded_vocab_size, plan_problems

H100 = load_hardware("h100-sxm-80gb")
L8 = load_model("llama3-8b")  # 32 layers
TINY = load_model("tiny-gpt")  # 8 layers


def _tr(framework: str, gpus: int = 32, batch: int = 64, seq: int = 4096) -> TrainingSpec:
    return TrainingSpec(num_gpus=gpus, global_batch_size=batch, seq_len=seq, framework=framework)


def _plan(**kw) -> Plan:
    return Plan(**({"tp": 4, "pp": 4, "dp": 2, "micro_batch_size": 1} | kw))


# --- the plan ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework,vpp,named", [("torchtitan", 1, "1f1b"), ("megatron", 2, "interleaved")])
def test_naming_the_default_schedule_changes_nothing(framework, vpp, named):
    tr = _tr(framework)
    default, explicit = _plan(vpp=vpp), _plan(vpp=vpp, pipeline_schedule=named)
    assert not plan_problems(L8, H100, tr, explicit)
    assert estimate_memory(L8, H100, tr, default) == estimate_memory(L8, H100, tr, explicit)
    assert estimate_time(L8, H100, tr, default).step_time_s == estimate_time(L8, H100, tr, explicit).step_time_s


def test_plan_rules_are_the_frameworks():
    problems = plan_problems(L8, H100, _tr("megatron"), _plan(vpp=2, pipeline_schedule="zbv"))
    assert "schedule: megatron does not run zbv; it runs 1f1b, interleaved" in problems
    problems = plan_problems(L8, H100, _tr("torchtitan"), _plan(vpp=1, pipeline_schedule="zbv"))
    assert any(p.startswith("vpp: zbv runs exactly 2 chunks per rank") for p in problems)
    # torchtitan refuses multi-stage schedules with one stage per rank (pipeline_parallel.py)
    problems = plan_problems(L8, H100, _tr("torchtitan"), _plan(vpp=1, pipeline_schedule="interleaved_zb"))
    assert any("at least 2 stages per rank" in p for p in problems)
    # dualpipev needs m >= 2p: 64 / (1 * 2) = 32 micro-batches fine, 8 not
    assert not plan_problems(L8, H100, _tr("torchtitan"), _plan(vpp=2, pipeline_schedule="dualpipev"))
    problems = plan_problems(L8, H100, _tr("torchtitan", batch=16), _plan(vpp=2, micro_batch_size=2,
                                                                          pipeline_schedule="dualpipev"))
    assert any(p.startswith("num_microbatches: dualpipev needs at least 2*pp = 8") for p in problems)
    with pytest.raises(ValueError, match="uneven V layouts are not modelled"):
        _plan(vpp=2, pipeline_schedule="zbv", layers_per_stage=(7, 9, 9, 7))
    with pytest.raises(ValueError, match="microbatch_group_size: applies to the interleaved schedule only"):
        _plan(vpp=2, pipeline_schedule="interleaved_zb", microbatch_group_size=4)


# --- memory -----------------------------------------------------------------------------------------

# docs/schedules.md "Activations in flight", torch's runtime (w_fraction = 1, measured on gloo in
# tests/test_schedules_zb.py): interleaved_zb min(m v, (v - 1) N + p) on every rank, N = m // max(1, m // p);
# zbv min(2p, 2m, m + 1 + r). p = 4, v = 2.
@pytest.mark.parametrize("schedule,batch,expected", [
    ("interleaved_zb", 16, [8, 8, 8, 8]),  # m = 8: N = 4, min(16, 4 + 4)
    ("interleaved_zb", 8, [8, 8, 8, 8]),  # m = 4: N = 4, min(8, 8)
    ("zbv", 8, [5, 6, 7, 8]),  # m = 4: min(8, 8, 5 + r)
    ("zbv", 16, [8, 8, 8, 8]),  # m = 8: min(8, 16, 9 + r)
    # interleaved in torch's order: 2 (p - r - 1) + (v - 1) N + 1, N = m // max(1, m // p) micro-batches per round
    ("interleaved", 16, [11, 9, 7, 5]),  # m = 8: N = 4 = p, Megatron's count
    ("interleaved", 20, [12, 10, 8, 6]),  # m = 10: flex rounds, N = 5 (Megatron's N = p order would hold 11 on rank 0)
    ("interleaved", 14, [14, 12, 10, 8]),  # m = 7: N = 7, min(14, 6 + 7 + 1)
])
def test_in_flight_chunks_of_the_torch_schedules(schedule, batch, expected):
    tr = _tr("torchtitan", batch=batch)
    plan = _plan(vpp=2, pipeline_schedule=schedule)
    m = batch // plan.dp
    assert [int(memory.stage_in_flight_chunks(tr, plan, m, r)) for r in range(4)] == expected
    dense_b, _ = memory.saved_bytes_per_layer_kind(L8, tr, plan)
    for r in range(4):  # 32 layers, 8 per rank, 4 per chunk
        assert memory.stage_saved_bytes(L8, tr, plan, m, r, 8) == pytest.approx(expected[r] * 4 * dense_b)


def test_v_placement_puts_the_loss_on_rank_0():
    tr = _tr("torchtitan")
    v, loop = _plan(vpp=2, pipeline_schedule="zbv"), _plan(vpp=2, pipeline_schedule="interleaved_zb")
    # rank r holds stages r and 2p - 1 - r (torch style="v"): 4 layers per stage
    assert v.chunk_starts(32) == ((0, 28), (4, 24), (8, 20), (12, 16))
    assert loop.chunk_starts(32) == ((0, 16), (4, 20), (8, 24), (12, 28))
    assert (v.loss_stage, loop.loss_stage) == (0, 3)
    head = padded_vocab_size(L8.vocab_size, 4) * L8.hidden_size / 4 + L8.norm_params  # untied output + final norm
    assert memory.stage_params_per_rank(L8, v, 0, 8) - memory.stage_params_per_rank(L8, loop, 0, 8) == head
    assert memory.stage_params_per_rank(L8, loop, 3, 8) - memory.stage_params_per_rank(L8, v, 3, 8) == head
    out = memory.output_bytes(L8, tr, v)
    m = 32
    # rank 3 holds neither the embedding's inputs nor the loss: only torch.distributed.pipelining's receive
    # buffers (memory.pipeline_buffer_bytes); under V placement both ends sit on rank 0, whose chunks each lack one kind
    buffers = memory.pipeline_buffer_bytes(L8, tr, v, m, 3)
    assert buffers > 0 and memory.stage_other_bytes(L8, tr, v, m, 3) == buffers
    assert memory.pipeline_receiving_chunks(v, 0) == (1, 1) and memory.pipeline_receiving_chunks(v, 3) == (2, 2)
    assert memory.pipeline_receiving_chunks(loop, 0) == (1, 2) and memory.pipeline_receiving_chunks(loop, 3) == (2, 1)
    assert memory.stage_other_bytes(L8, tr, v, m, 0) > out
    est = estimate_memory(L8, H100, tr, v)
    # with the hardware, PyTorch's cuBLAS workspaces of the forward and autograd threads (memory.gemm_workspace_bytes)
    assert est.stages[3].other_bytes == buffers + 2 * 32 * 2**20


# --- time -------------------------------------------------------------------------------------------

def test_wgrad_factor_is_the_weight_gradient_gemms():
    from planner.cost import Rates, _linear_shapes, gemm_fwd_bwd_s, layer_time

    tr = _tr("torchtitan")
    plan = _plan()
    lt = layer_time(L8, H100, tr, plan)
    rates = Rates.of(H100, "bf16")
    tokens = plan.micro_batch_size * tr.seq_len
    expect = sum(gemm_fwd_bwd_s(tokens, k, n, rates)[2] for k, n, _ in _linear_shapes(L8, plan).values())
    assert lt.wgrad == pytest.approx(expect)
    assert 0 < lt.wgrad < lt.bwd_compute


def test_zb_h1_bubble_is_qi_et_al():
    """ZB-H1 (interleaved_zb, v = 1; plain torch runs it, torchtitan does not): bubble (p - 1)(f + i - w)
    per micro-batch (Qi et al. 2024, arXiv:2401.10241 section 2.1), f, i, w of a mean stage."""
    tr = _tr("torch")
    zb = estimate_time(L8, H100, tr, _plan(pipeline_schedule="interleaved_zb"))
    plain = estimate_time(L8, H100, tr, _plan())
    f = np.mean([s.fwd for s in zb.stages])
    w = np.mean([s.wgrad for s in zb.stages])
    i = np.mean([s.total for s in zb.stages]) - f - w
    assert w <= min(f, i)  # the closed form's condition
    assert zb.breakdown["bubble"] == pytest.approx(3 * (f + i - w), rel=1e-9)
    assert plain.breakdown["bubble"] == pytest.approx(3 * (f + i + w), rel=1e-9)  # Narayanan: (p - 1)(F + B)
    assert sum(zb.breakdown.values()) == pytest.approx(zb.step_time_s)


@pytest.mark.parametrize("schedule,p,v,m,family", [("zbv", 4, 2, 8, "torch"), ("zbv", 3, 2, 5, "torch"),
                                                   ("dualpipev", 4, 2, 8, "torch"), ("dualpipev", 3, 2, 7, "deepspeed"),
                                                   ("interleaved_zb", 4, 2, 6, "torch"),
                                                   ("interleaved_zb", 4, 1, 8, "torch")])
def test_vectorised_simulation_is_schedules_simulate(schedule, p, v, m, family):
    from planner import schedules

    rng = np.random.default_rng(7)
    f, i, w = rng.uniform(0.2, 2.0, (3, 6))
    got = cost.simulated_bubble_s(schedule, p, v, m, f, i, w, family)
    want = [schedules.bubble_s(schedule, p, v, m, float(a), float(b), float(c), 0.0, family) for a, b, c in zip(f, i, w)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_batched_bubbles_are_plan_by_plan_bubbles():
    """The search asks cost.ZeroBubbleBatch for every shape and runs each action program once over all of them;
    each bubble is the one schedule_bubble_s gives that shape alone, bit for bit: m < 1 not asked (inf), a count
    the schedule refuses (inf), the closed form where it holds (ZB-H1 with w <= min(f, i)), simulations else."""
    rng = np.random.default_rng(11)
    asks = [("zbv", 4, 2, np.array([[8], [0], [6]])), ("zbv", 4, 2, np.array([[8], [12], [3]])),
            ("dualpipev", 4, 2, np.array([[8], [4], [16]])), ("interleaved_zb", 4, 2, np.array([[8], [9], [6]])),
            ("interleaved_zb", 4, 1, np.array([[8], [4], [16]]))]
    batch, parts = cost.ZeroBubbleBatch(), []
    for schedule, p, v, m in asks:
        fwd, wgrad, rest = rng.uniform(0.5, 2.0, (3, 3, 2))
        if v == 1:  # ZB-H1's closed form holds while w <= min(f, i)
            wgrad = 0.1 * fwd
        total = fwd + wgrad + rest
        want = cost.schedule_bubble_s(schedule, p, v, m, fwd, wgrad, total)
        got = batch(schedule, p, v, m, fwd, wgrad, total)
        parts.append((want, got, batch.owed()))
    batch.run()
    for want, got, owed in parts:
        total = got if owed is None else got + owed
        assert np.array_equal(np.isinf(want), np.isinf(total))
        assert np.array_equal(want[np.isfinite(want)], total[np.isfinite(want)])
    assert np.isinf(parts[0][0][1]).all() and np.isfinite(parts[0][0][0]).all()  # m = 0: not asked
    assert np.isinf(parts[3][0][1]).all()  # interleaved_zb refuses m = 9 at pp 4 (9 % max(1, 9 // 4))
    assert parts[4][2] is None and parts[0][2] is not None  # ZB-H1's closed form: nothing owed


def test_zbv_bubble_from_the_action_lists():
    """zbv: no closed form applies; with the stage's own f, i, w the simulated bubble lies under interleaved
    1F1B's (p - 1)(f + i + w) per chunk and at least (p - 1) f (the last rank's first forward waits)."""
    tr = _tr("torchtitan")
    zbv = estimate_time(L8, H100, tr, _plan(vpp=2, pipeline_schedule="zbv"))
    f = np.mean([s.fwd for s in zbv.stages]) / 2
    w = np.mean([s.wgrad for s in zbv.stages]) / 2
    i = np.mean([s.total for s in zbv.stages]) / 2 - f - w
    assert 3 * f <= zbv.breakdown["bubble"] < 3 * (f + i + w)
    assert sum(zbv.breakdown.values()) == pytest.approx(zbv.step_time_s)


def test_moe_plan_with_a_zero_bubble_schedule():
    moe = load_model("tiny-moe")
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=256, framework="torchtitan")
    plan = Plan(tp=1, pp=2, dp=4, vpp=2, micro_batch_size=1, ep=2, zero_stage=3, pipeline_schedule="zbv")
    assert not plan_problems(moe, H100, tr, plan)
    assert plan.stage_moe_layers(moe) == (1, 2)  # rank 0: layers 0 (dense, first_k_dense = 1) and 3; rank 1: 1, 2
    t = estimate_time(moe, H100, tr, plan)
    assert t.breakdown["bubble"] > 0 and sum(t.breakdown.values()) == pytest.approx(t.step_time_s)


# --- search -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pins", [Pins(pp=4), Pins(pp=2, pipeline_schedule="zbv")])
def test_search_matches_brute_force_with_the_schedule_knob(pins):
    from planner.search import exhaustive, search

    tr = TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=256, framework="torchtitan")
    space = SearchSpace(pins=pins, max_micro_batch_size=4, max_cp=1)
    res = search(TINY, H100, tr, space)
    ref, ref_t, n = exhaustive(TINY, H100, tr, space)
    assert res.status == "OPTIMAL" and res.candidates == n
    assert estimate_time(TINY, H100, tr, res.best).step_time_s == pytest.approx(ref_t, rel=1e-6), (res.best, ref)
    if pins.pipeline_schedule:
        assert res.best.pipeline_schedule == pins.pipeline_schedule


def test_search_tables_equal_stage_memory_with_zero_bubble_schedules():
    from planner.search import _stage_rows, build_tables
    from tests.table_checks import assert_same_kib

    tr = TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=256, framework="torchtitan")
    tables = build_tables(TINY, H100, tr, SearchSpace(pins=Pins(pp=4, tp=1), max_micro_batch_size=2, max_cp=1))
    assert {sh[3].schedule for sh in tables.shapes} == {None, "interleaved_zb", "zbv", "dualpipev"}
    checked = 0
    for key in np.flatnonzero(tables.legal.ravel()):
        plan = tables.plan(int(key))
        if plan.pipeline_schedule is None:
            continue
        s, u, z = tables.unindex(int(key))
        m = tr.global_batch_size // (plan.micro_batch_size * plan.dp)
        for kind, (r, n) in enumerate(_stage_rows(tables.shapes[s][3])):
            expect = memory.stage_memory(TINY, tr, plan, m, r, n, H100).total_bytes  # the tables' hardware
            assert_same_kib(tables.mem_kib[s, u, z, kind], expect, (plan, r))
        checked += 1
    assert checked > 10


def test_megatron_search_is_unchanged():
    """Megatron runs none of the zero-bubble schedules: no shape carries one, and CP-SAT's pick is still the
    brute-force optimum over the same space (the reference ``exhaustive`` costs every plan with
    ``estimate_time``)."""
    from planner.search import build_tables, exhaustive, search

    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096, framework="megatron")
    space = SearchSpace(pins=Pins(pp=4), max_micro_batch_size=2)
    tables = build_tables(L8, H100, tr, space)
    assert {sh[3].schedule for sh in tables.shapes} == {None}
    best = search(L8, H100, tr, space).best
    reference, _, _ = exhaustive(L8, H100, tr, space)
    assert best.pipeline_schedule is None and reference.pipeline_schedule is None
    assert estimate_time(L8, H100, tr, best).step_time_s == pytest.approx(
        estimate_time(L8, H100, tr, reference).step_time_s, rel=1e-6)


def test_megatron_pin_of_a_zero_bubble_schedule_finds_nothing():
    from planner.candidates import schedule_pin_problems

    assert schedule_pin_problems("megatron", "zbv") == \
        "--pipeline-schedule: megatron does not run zbv; it runs 1f1b, interleaved"
    assert schedule_pin_problems("torchtitan", "zbv") is None


# --- emit and read back -----------------------------------------------------------------------------

def _zbv_scenario() -> Scenario:
    return Scenario(model=L8, hardware=H100, training=_tr("torchtitan"), plan=_plan(vpp=2, pipeline_schedule="zbv"))


def test_megatron_and_deepspeed_refuse_a_zero_bubble_schedule():
    from planner.emit import render_all

    for fmt in ("megatron", "torchrun", "slurm"):
        with pytest.raises(SpecError, match="--emit megatron: schedule: megatron does not run zbv"):
            render_all(_zbv_scenario(), [fmt])
    with pytest.raises(SpecError, match="--emit deepspeed: schedule: deepspeed does not run zbv"):
        render_all(_zbv_scenario(), ["deepspeed"])


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zb", "dualpipev"])
def test_torchtitan_accepts_the_schedule_and_check_reads_it_back(tmp_path, schedule):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (requirements-consumers.txt)")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.config.manager import ConfigManager

    from planner.check import check_file
    from planner.emit import render_all
    from planner.io import write_all
    from planner.schedules import TORCHTITAN_SCHEDULE_NAMES

    sc = Scenario(model=L8, hardware=H100, training=_tr("torchtitan"), plan=_plan(vpp=2, pipeline_schedule=schedule))
    (script,) = write_all(tmp_path, render_all(sc, ["torchtitan"]))
    text = script.read_text().replace("\\\n", " ")  # as tests/test_emit_check.py reads the launch line
    words = shlex.split(next(ln for ln in text.splitlines() if "torchtitan.train" in ln))
    argv = [w for w in words[words.index("torchtitan.train") + 1:] if w != "$@"]
    cfg = ConfigManager().parse_args(argv)  # tyro parse + Trainer.Config.__post_init__
    assert cfg.parallelism.pipeline_parallel_schedule == TORCHTITAN_SCHEDULE_NAMES[schedule]
    assert get_schedule_class(cfg.parallelism.pipeline_parallel_schedule).__name__ == {
        "zbv": "ScheduleZBVZeroBubble", "interleaved_zb": "ScheduleInterleavedZeroBubble",
        "dualpipev": "ScheduleDualPipeV"}[schedule]
    back = check_file(script, H100, None, None)
    assert back.scenario is not None, back
    assert back.scenario.plan.pipeline_schedule == schedule and back.scenario.plan.vpp == 2


def test_validate_refuses_a_zero_bubble_plan_it_would_not_run():
    from planner.validate.launch import refusal

    assert refusal(_zbv_scenario()).startswith("plan: pipeline_schedule=zbv: the validate worker runs 1F1B")
    assert refusal(Scenario(model=L8, hardware=H100, training=_tr("torchtitan"), plan=_plan(vpp=2))) is None


def test_estimate_json_names_the_schedule():
    from planner.estimate import PLAN_KEYS, estimate

    est = estimate(_zbv_scenario()).to_dict()["plan"]
    assert tuple(est) == PLAN_KEYS
    assert est["pipeline_schedule"] == "zbv" and est["microbatch_group_size"] is None
    plain = estimate(Scenario(model=L8, hardware=H100, training=_tr("megatron"), plan=_plan(vpp=2))).to_dict()["plan"]
    assert plain["pipeline_schedule"] is None and plain["microbatch_group_size"] == 4


def test_cli_pipeline_schedule_option():
    """`--pipeline-schedule` on search and estimate: pinned where the framework runs it, refused where not."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def plan3d(*args):
        return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])

    job = ["--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "16", "--global-batch", "64",
           "--seq-len", "4096"]
    p = plan3d("search", *job, "--pipeline-schedule", "zbv")
    assert p.returncode == 2 and "--pipeline-schedule: megatron does not run zbv" in p.stderr
    p = plan3d("search", *job, "--pipeline-schedule", "zbv", "--framework", "torchtitan", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["plan"]["pipeline_schedule"] == "zbv"
    p = plan3d("estimate", *job, "--tp", "1", "--pp", "2", "--vpp", "2", "--pipeline-schedule", "zbv",
               "--framework", "torchtitan", "--zero-stage", "1", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["plan"]["pipeline_schedule"] == "zbv"
