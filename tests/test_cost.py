"""Cost model: hand-computed formula checks, properties, and the golden test on published Megatron runs."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import cost
from planner.cost import estimate_time, gemm_time_s, overlapped_s
from planner.presets import load_hardware, load_model
from planner.published import published_runs
from planner.specs import ModelSpec, Plan, TrainingSpec

A100 = load_hardware("a100-80gb")
RUNS = {r.name: r for r in published_runs("tests/data/calibration_runs.json")}

# Acceptance (issue 4): mean absolute iteration-time error <= 5 %, maximum <= 10 %, over the
# Narayanan et al. 2021 Tables 1-2 and Korthikanti et al. 2022 Table 5 runs (A100, Selene).
MEAN_TOLERANCE = 0.05
MAX_TOLERANCE = 0.10
RATIO_TOLERANCE = 0.05


def _predicted(name):
    return estimate_time(*(lambda sc: (sc.model, sc.hardware, sc.training, sc.plan))(RUNS[name].scenario)).step_time_s


def test_golden_published_megatron_runs():
    errors = {name: _predicted(name) / run.published_time_s - 1 for name, run in RUNS.items()}
    assert len(errors) == 24
    mean = sum(abs(e) for e in errors.values()) / len(errors)
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert mean <= MEAN_TOLERANCE, f"mean error {mean:.1%}"
    assert abs(errors[worst]) <= MAX_TOLERANCE, f"{worst}: {errors[worst]:+.1%}"


def _pair(prefix):
    (sel,) = [n for n in RUNS if n.startswith(prefix) and "selective" in n and "full" not in n]
    (full,) = [n for n in RUNS if n.startswith(prefix) and "full" in n]
    return sel, full


@pytest.mark.parametrize("model", ["Korthikanti 22B", "Korthikanti 175B", "Korthikanti 530B", "Korthikanti 1T"])
def test_ranking_selective_vs_full_recompute(model):
    sel, full = _pair(model)
    measured = RUNS[full].published_time_s / RUNS[sel].published_time_s
    predicted = _predicted(full) / _predicted(sel)
    assert predicted > 1 and measured > 1  # same order
    assert abs(predicted / measured - 1) <= RATIO_TOLERANCE


def test_ranking_2240_vs_560_gpus():
    big = "PTD-P GPT 529.6B, 2240 GPUs, fixed batch 2240 (Table 2)"
    small = "PTD-P GPT 529.6B, 560 GPUs, fixed batch 2240 (Table 2)"
    measured = RUNS[big].published_time_s / RUNS[small].published_time_s
    predicted = _predicted(big) / _predicted(small)
    assert predicted < 1 and measured < 1
    assert abs(predicted / measured - 1) <= RATIO_TOLERANCE


# --- formulas, hand-computed --------------------------------------------------------------------
def _gpt(**kw):
    base = dict(name="g", num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32000)
    return ModelSpec(**(base | kw))


def test_bubble_1f1b_is_p_minus_1_stage_times():
    model = _gpt()
    tr = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=1024)
    plan = Plan(tp=1, pp=4, dp=1, micro_batch_size=1)
    t = estimate_time(model, A100, tr, plan)
    per_mb = [s.total for s in t.stages]
    assert t.breakdown["bubble"] == pytest.approx(3 * sum(per_mb) / 4)


def test_interleaving_divides_the_bubble_and_multiplies_messages():
    model = _gpt()
    tr = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=1024)
    plain = estimate_time(model, A100, tr, Plan(tp=1, pp=4, dp=1, micro_batch_size=1))
    inter = estimate_time(model, A100, tr, Plan(tp=1, pp=4, dp=1, vpp=2, micro_batch_size=1))
    assert inter.stages[0].pp_comm == pytest.approx(2 * plain.stages[0].pp_comm)
    ratio = inter.breakdown["bubble"] / plain.breakdown["bubble"]
    assert ratio == pytest.approx(0.5 * sum(s.total for s in inter.stages) / sum(s.total for s in plain.stages))


def test_overlap_exposes_only_the_excess_plus_contention():
    assert overlapped_s(3.0, 2.0, 0.0) == 1.0
    assert overlapped_s(1.0, 2.0, 0.0) == 0.0
    assert overlapped_s(1.0, 2.0, 0.1) == pytest.approx(0.1)


def test_gemm_wave_quantisation_hand_computed():
    rates = cost.Rates(gemm_flops=100e12, sm_count=108, gemm_overhead_s=0.0, attention_flops=1e12,
                       hbm_bytes_per_s=1e15)
    # 2048 x 4096 output = 8 x 32 = 256 tiles of 256 x 128 -> 3 waves of 108 tiles
    expected = 3 * 108 * 2 * 256 * 128 * 1024 / 100e12
    assert gemm_time_s(2048, 1024, 4096, rates) == pytest.approx(expected)
    # exactly 108 tiles: one full wave, no loss
    assert gemm_time_s(256 * 108, 1024, 128, rates) == pytest.approx(2 * 256 * 108 * 1024 * 128 / 100e12)


def test_dp_overlap_hides_gradient_sync():
    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=64, global_batch_size=512, seq_len=4096)
    plan = Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=1)
    hidden = estimate_time(model, load_hardware("h100-sxm-80gb"), tr, plan)
    exposed = estimate_time(model, load_hardware("h100-sxm-80gb"), tr.model_copy(update={"overlap_grad_reduce": False}), plan)
    assert exposed.breakdown["dp_comm_exposed"] == pytest.approx(exposed.dp_comm_s)
    assert hidden.breakdown["dp_comm_exposed"] < exposed.breakdown["dp_comm_exposed"]


def test_mfu_uses_model_flops():
    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096)
    t = estimate_time(model, A100, tr, Plan(tp=2, pp=1, dp=4, micro_batch_size=1, recompute="full"))
    assert t.hfu > t.mfu > 0
    assert t.tokens_per_s == pytest.approx(64 * 4096 / t.step_time_s)
    assert math.isclose(sum(t.breakdown.values()), t.step_time_s)


# --- properties -----------------------------------------------------------------------------------
@st.composite
def setups(draw):
    model = _gpt(num_layers=draw(st.sampled_from([8, 16])), hidden_size=draw(st.sampled_from([1024, 2048, 4096])),
                 num_attention_heads=16, activation=draw(st.sampled_from(["gelu", "swiglu"])))
    tp, pp, dp = draw(st.sampled_from([1, 2, 8])), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 8]))
    mbs, m = draw(st.sampled_from([1, 2])), draw(st.sampled_from([4, 8]))
    tr = TrainingSpec(num_gpus=tp * pp * dp, global_batch_size=mbs * m * dp, seq_len=draw(st.sampled_from([1024, 4096])),
                      overlap_grad_reduce=draw(st.booleans()))
    plan = Plan(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, sequence_parallel=tp > 1 and draw(st.booleans()),
                recompute=draw(st.sampled_from(["none", "selective", "full"])), zero_stage=draw(st.sampled_from([0, 1, 3])))
    return model, tr, plan


@settings(max_examples=120, deadline=None)
@given(setups(), st.sampled_from(["intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"]),
       st.sampled_from([0.5, 0.25, 0.1]))
def test_slower_link_never_speeds_up_a_step(setup, link, factor):
    model, tr, plan = setup
    slow = A100.model_copy(update={link: getattr(A100, link) * factor})
    assert estimate_time(model, slow, tr, plan).step_time_s >= estimate_time(model, A100, tr, plan).step_time_s - 1e-12


@settings(max_examples=120, deadline=None)
@given(setups(), st.sampled_from([2, 3]))
def test_bigger_batch_never_speeds_up_a_step(setup, factor):
    model, tr, plan = setup
    bigger = tr.model_copy(update={"global_batch_size": tr.global_batch_size * factor})
    assert estimate_time(model, A100, bigger, plan).step_time_s >= estimate_time(model, A100, tr, plan).step_time_s
