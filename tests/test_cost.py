"""Cost model: hand-computed formula checks, properties, and the golden test on published Megatron runs."""

import json
import math
from pathlib import Path

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
    tr = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=1024, overlap_p2p_comm=False)
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


# --- attention kernel speed, ring attention (CP), overlap switches (issue 12) -----------------------
# Measured on one H200 SXM, torch 2.11.0+cu130, 2026-11-30 (benchmarks/data/h200_kernels.json,
# measured by benchmarks/gpu_kernels.py): GEMMs of Megatron layers (bf16 and
# fp8 via torch._scaled_mm), causal SDPA on the cuDNN backend, full Llama blocks.
H200_KERNELS = json.loads((Path(__file__).parents[1] / "benchmarks/data/h200_kernels.json").read_text())
# Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, Figure 5(b) and 5(e): cuDNN forward bars,
# H100 80GB SXM5, BF16, head dim 128, TFLOP/s at 512 ... 16k, without and with causal mask.
FA3_CUDNN_FWD = {False: (497, 574, 617, 609, 600, 595), True: (315, 410, 484, 518, 529, 539)}
H100 = load_hardware("h100-sxm-80gb")
# The kernel tables were measured in back-to-back benchmark loops on one GPU, not through a training run:
# the model reproduces them at sustained_fraction 0.87 (the A100 calibration, which these tables also
# support: mean GEMM bias within 5 %). Training runs on Hopper lose about 6 % more (the profiles' 0.82,
# fit on the NeMo 24.07 H100 runs, docs/cost-model.md), which a kernel loop does not see.
KERNEL_LOOP_SUSTAINED = 0.87
H200 = load_hardware("h200-141gb").model_copy(update={"sustained_fraction": KERNEL_LOOP_SUSTAINED})


def _h200_rows(kind, **match):
    return [r for r in H200_KERNELS["rows"] if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_attention_table_reproduces_the_measured_h200_rows(pass_):
    rows = _h200_rows("attention", backend="cudnn", heads=32, kv_heads=8, head_dim=128)
    assert len(rows) == 6
    for r in rows:
        got = cost.attention_shape(r["seq"], True, pass_) * cost.ATTENTION_REFERENCE
        assert got == pytest.approx(r[f"{pass_}_tflops"], rel=0.05), r["seq"]
        assert cost.attention_in_table(r["seq"])
    assert not cost.attention_in_table(256) and not cost.attention_in_table(65536)


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_attention_at_head_dim_64_reproduces_the_measured_h200_rows(pass_):
    """The head-dim-64 cuDNN rows of the same H200 run (32 query / 8 KV heads, batch x seq = 16k)."""
    rows = _h200_rows("attention", backend="cudnn", heads=32, kv_heads=8, head_dim=64)
    assert len(rows) == 6
    for r in rows:
        got = cost.attention_shape(r["seq"], True, pass_, head_dim=64) * cost.ATTENTION_REFERENCE
        assert got == pytest.approx(r[f"{pass_}_tflops"], rel=0.05), r["seq"]


def test_attention_head_dim_64_is_slower_and_other_widths_interpolate():
    # measured at 4096 (h200_kernels.json, cudnn, 32/8 heads): forward 430.4 vs 608.0 TFLOP/s, backward 358.1 vs 465.6
    assert cost.attention_shape(4096, True, "fwd", 64) / cost.attention_shape(4096, True, "fwd", 128) == \
        pytest.approx(430.4 / 608.0, rel=0.01)
    assert cost.attention_shape(4096, True, "bwd", 64) / cost.attention_shape(4096, True, "bwd", 128) == \
        pytest.approx(358.1 / 465.6, rel=0.01)
    # d 96 lies at log2(96/64) / log2(128/64) = 0.585 of the way from the 64 table to the 128 table
    lo, hi = cost.attention_shape(4096, True, "fwd", 64), cost.attention_shape(4096, True, "fwd", 128)
    assert cost.attention_shape(4096, True, "fwd", 96) == pytest.approx(lo + 0.585 * (hi - lo), rel=1e-3)
    # no wider table: MLA's 192 keeps the head-dim-128 speed (as before), narrower than 64 the 64 table
    assert cost.attention_shape(4096, True, "fwd", 192) == cost.attention_shape(4096, True, "fwd")
    assert cost.attention_shape(4096, True, "fwd", 32) == lo


def test_attention_core_of_a_head_dim_64_model_runs_at_the_head_dim_64_speed():
    """Two models alike but for the head width (64 heads of 64 vs 32 heads of 128: the same FLOPs): the narrow
    heads' attention core takes 608.0/430.4 forward and 465.6/358.1 backward as long (the measured ratios at 4k),
    less the launch overheads both pay alike."""
    base = dict(num_layers=2, hidden_size=4096, ffn_hidden_size=8192, vocab_size=32000, max_seq_len=4096,
                num_kv_heads=8)
    narrow = ModelSpec(name="n", num_attention_heads=64, head_dim=64, **base)
    wide = ModelSpec(name="w", num_attention_heads=32, head_dim=128, **base)
    hw = load_hardware("h200-141gb")  # the profile whose attention table holds the ratios above
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, precision="bf16")
    plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=1)
    rates = cost.Rates.of(hw, "bf16")
    (nf, nb), (wf, wb) = (cost._attention_core_s(m, tr, plan, rates) for m in (narrow, wide))
    o = rates.gemm_overhead_s
    assert (nf - o) / (wf - o) == pytest.approx(608.0 / 430.4, rel=0.01)
    assert (nb - 3 * o) / (wb - 3 * o) == pytest.approx(465.6 / 358.1, rel=0.01)


def test_attention_non_causal_over_causal_follows_the_fa3_paper():
    for s, c, n in zip((512, 1024, 2048, 4096, 8192, 16384), FA3_CUDNN_FWD[True], FA3_CUDNN_FWD[False]):
        ratio = cost.attention_shape(s, False, "fwd") / cost.attention_shape(s, True, "fwd")
        assert ratio == pytest.approx(n / c, rel=0.05)


def test_attention_interpolates_between_rows_and_is_slower_when_short():
    lo, hi = cost.attention_shape(2048, True, "fwd"), cost.attention_shape(4096, True, "fwd")
    assert lo < cost.attention_shape(math.sqrt(2048 * 4096), True, "fwd") < hi
    assert cost.attention_shape(1024, True, "bwd") < cost.attention_shape(8192, True, "bwd")
    # causal kernels waste the diagonal blocks: slower per counted FLOP than non-causal at equal length
    assert cost.attention_shape(2048, True, "fwd") < cost.attention_shape(2048, False, "fwd")


@pytest.mark.parametrize("dtype,mean_tol", [("bf16", 0.05), ("fp8", 0.05)])
def test_gemm_model_against_the_measured_h200_gemms(dtype, mean_tol):
    """Wave-quantised MAMF model against 384 measured GEMM shapes per dtype (TP slices of widths 2k-16k)."""
    rates = cost.Rates.of(H200, dtype)
    errors = [gemm_time_s(r["m"], r["k"], r["n"], rates) / (r["ms"] * 1e-3) - 1 for r in _h200_rows("gemm", dtype=dtype)]
    assert len(errors) == 384
    assert abs(sum(errors) / len(errors)) <= mean_tol  # no bias
    assert sum(map(abs, errors)) / len(errors) <= 0.15  # and a bounded spread


def _block_time_over_measured(row, hw) -> float:
    """The cost model's forward + backward time of one measured Llama block (a "block" row of gpu_kernels.py: batch
    1, one GPU, no communication) over the measured time."""
    model = ModelSpec(name="b", num_layers=1, hidden_size=row["hidden"], num_attention_heads=row["heads"],
                      num_kv_heads=row["kv_heads"], ffn_hidden_size=row["ffn"], vocab_size=1000, activation="swiglu",
                      norm="rmsnorm")
    lt = cost.layer_time(model, hw, TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=row["seq"]),
                         Plan(tp=1, pp=1, dp=1, micro_batch_size=1))
    return (lt.fwd_compute + lt.bwd_compute) / (row["fwd_bwd_ms"] * 1e-3)


def test_layer_compute_against_the_measured_h200_blocks():
    """One Llama block forward + backward on one GPU (no communication), batch 1: within 5 %."""
    for r in _h200_rows("block"):
        assert _block_time_over_measured(r, H200) == pytest.approx(1, abs=0.05), r


# --- the same kernels measured on one H100 SXM (issue 12 item 1: a table per bundled GPU) ---------------------
# NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-12-05, two leases of the device tool: benchmarks/gpu_kernels.py
# (benchmarks/data/h100_kernels.json), its attention part twice more (h100_attention_repeat.json), and
# benchmarks/gpu_sustained.py (h100_sustained.json, 20 s of back-to-back GEMMs per shape). None of these numbers was
# used to set a constant of the GEMM or block model: those tests are held out.
_DATA = Path(__file__).parents[1] / "benchmarks/data"
H100_KERNELS = json.loads((_DATA / "h100_kernels.json").read_text())
H100_ATTENTION_RUNS = [H100_KERNELS["rows"], *json.loads((_DATA / "h100_attention_repeat.json").read_text())["runs"]]
H100_SUSTAINED = json.loads((_DATA / "h100_sustained.json").read_text())
H100_KERNEL_LOOP = H100.model_copy(update={"sustained_fraction": KERNEL_LOOP_SUSTAINED})


def _h100_attention_median(backend, head_dim, seq, pass_):
    values = [r[f"{pass_}_tflops"] for run in H100_ATTENTION_RUNS for r in run
              if r["kind"] == "attention" and r.get("backend") == backend and r.get("heads") == 32
              and r.get("kv_heads") == 8 and r.get("head_dim") == head_dim and r.get("seq") == seq]
    assert len(values) == 3, (backend, head_dim, seq)
    return sorted(values)[1]


@pytest.mark.parametrize("kernel,backend", [("fused", "cudnn"), ("fa2", "flash")])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_h100_attention_table_reproduces_the_median_of_its_three_runs(kernel, backend, pass_, head_dim):
    for seq in (1024, 2048, 4096, 8192, 16384, 32768):  # read against the one reference, the H200's 16k forward
        got = cost.attention_shape(seq, True, pass_, head_dim, kernel, table="h100") * cost.ATTENTION_REFERENCE
        assert got == pytest.approx(_h100_attention_median(backend, head_dim, seq, pass_), rel=0.001), seq


def test_h100_profile_takes_its_own_attention_table():
    assert H100.attention_table == "h100" and cost.Rates.of(H100, "bf16").attention_table == "h100"
    assert load_hardware("a100-80gb").attention_table == "h200"  # not measured here: the H200's shape, as before
    # the measured difference: the backward is 13-14 % slower at 1k and 8-12 % at 2k on the H100, in each of its runs
    for seq, below in ((1024, 0.9), (2048, 0.95)):
        h200 = _h200_rows("attention", backend="cudnn", heads=32, kv_heads=8, head_dim=128, seq=seq)[0]["bwd_tflops"]
        assert all(r["bwd_tflops"] < below * h200 for run in H100_ATTENTION_RUNS for r in run
                   if r["kind"] == "attention" and r.get("backend") == "cudnn" and r.get("heads") == 32
                   and r.get("kv_heads") == 8 and r.get("head_dim") == 128 and r.get("seq") == seq)
    assert (cost.attention_shape(2048, True, "bwd", table="h100")
            < 0.95 * cost.attention_shape(2048, True, "bwd", table="h200"))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gemm_model_against_the_measured_h100_gemms_held_out(dtype):
    """The wave-quantised MAMF model, built on the H200 measurement and the H100 profile's MAMF, against 384 GEMM
    shapes per dtype measured on an H100 it never saw: measured bias +0.9 % bf16, +2.0 % fp8."""
    rates = cost.Rates.of(H100_KERNEL_LOOP, dtype)
    rows = [r for r in H100_KERNELS["rows"] if r["kind"] == "gemm" and r.get("dtype") == dtype]
    errors = [gemm_time_s(r["m"], r["k"], r["n"], rates) / (r["ms"] * 1e-3) - 1 for r in rows]
    assert len(errors) == 384
    assert abs(sum(errors) / len(errors)) <= 0.05
    assert sum(map(abs, errors)) / len(errors) <= 0.15


def test_layer_compute_against_the_measured_h100_blocks_held_out():
    """One Llama block forward + backward on the H100 (batch 1, no communication), the H100 profile: within 5 %
    (measured 0.954-1.027 of the block time); the same blocks ran 2-8 % slower than on the H200."""
    rows = [r for r in H100_KERNELS["rows"] if r["kind"] == "block"]
    assert len(rows) == 4
    for r in rows:
        assert _block_time_over_measured(r, H100_KERNEL_LOOP) == pytest.approx(1, abs=0.05), r


def test_kernel_loop_rate_is_the_power_capped_steady_state():
    """20 s of back-to-back GEMMs on the H100: the board sits at its 700 W limit with the SM clock near 1,350 MHz
    (of 1,980), and the GEMM model at the kernel-loop fraction (0.87) gives that steady rate within 6 %; a training
    run's further loss (the profile's 0.82) is not clock throttling, which the loop already has."""
    rows = H100_SUSTAINED["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["sustained_power_w"] >= 0.97 * r["windows"][-1]["power_limit_w"]
        assert r["sustained_sm_clock_mhz"] <= 1400
        rates = cost.Rates.of(H100_KERNEL_LOOP, r["dtype"])
        model_tflops = 2.0 * r["m"] * r["n"] * r["k"] / gemm_time_s(r["m"], r["k"], r["n"], rates) / 1e12
        assert model_tflops == pytest.approx(r["sustained_tflops"], rel=0.06), r["shape"]


def test_attention_wave_factor_hand_computed():
    # 1024 queries = 8 tiles of 128, x 8 heads = 64 blocks on 132 SMs: one wave, 64/132 busy;
    # the table's runs (16k queries x 32 heads = 4096 blocks) keep 4096 / (32 * 132) busy
    assert cost.attention_wave_factor(1024, 8, 132) == pytest.approx((64 / 132) / (4096 / (32 * 132)))
    assert cost.attention_wave_factor(8192, 32, 132) == 1.0


def _llama_cp(cp, seq=8192, **training):
    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=seq, **training)
    plan = Plan(tp=1, pp=1, dp=8 // cp, cp=cp, micro_batch_size=1)
    return model, tr, plan


def test_ring_attention_costs_more_than_the_same_tokens_without_cp_at_8k():
    """At 8K the ring's short, non-causal chunks, merges and launches cost more than one causal kernel."""
    model, tr, plan = _llama_cp(4)
    ring = cost.ring_attention(model, H100, tr, plan)
    no_cp_f, no_cp_b = cost._attention_core_s(model, tr, plan.model_copy(update={"cp": 1}), cost.Rates.of(H100, "bf16"))
    # the same rank does 1/cp of the attention FLOPs, so compare with 1/cp of the unsplit kernel time
    assert ring.fwd_compute > no_cp_f / 4 and ring.bwd_compute > no_cp_b / 4
    assert ring.bwd_exposed >= ring.fwd_exposed >= 0


def test_ring_exchange_is_exposed_on_a_slow_link():
    model, tr, plan = _llama_cp(8, seq=8192)
    fast = cost.ring_attention(model, H100, tr, plan)
    slow = cost.ring_attention(model, H100.model_copy(update={"intra_node_bandwidth_gbps": 1.0}), tr, plan)
    assert slow.fwd_exposed > 10 * max(fast.fwd_exposed, 1e-9)
    # each of the cp-1 forward exchanges moves 2 * b * s/cp * g * d_h * 2 bytes; on a 1 GB/s link that dominates
    kv = 2 * 1024 * 8 * 128 * 2
    assert slow.fwd_exposed == pytest.approx(7 * kv / 1e9, rel=0.1)


def test_framework_defaults_and_overrides():
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=2048)
    assert cost.resolved_overlap(tr) == cost.Overlap(tp_comm_overlap=False, overlap_p2p_comm=True)
    torch_tr = tr.model_copy(update={"framework": "torch"})
    assert cost.resolved_overlap(torch_tr) == cost.Overlap(tp_comm_overlap=False, overlap_p2p_comm=False)
    assert cost.framework_defaults("nemo") == cost.Overlap(tp_comm_overlap=True, overlap_p2p_comm=True)
    assert cost.framework_defaults("unknown") == cost.framework_defaults("megatron")
    on = tr.model_copy(update={"tp_comm_overlap": True, "overlap_p2p_comm": False})
    assert cost.resolved_overlap(on) == cost.Overlap(tp_comm_overlap=True, overlap_p2p_comm=False)


def test_tp_comm_overlap_hides_tp_collectives_only_with_sp():
    model = load_model("llama3-70b")
    tr = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192)
    plan = Plan(tp=4, pp=4, dp=4, vpp=5, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    off = cost.layer_time(model, H100, tr, plan)
    on = cost.layer_time(model, H100, tr.model_copy(update={"tp_comm_overlap": True}), plan)
    assert on.tp_fwd < 0.5 * off.tp_fwd and on.tp_bwd < off.tp_bwd
    assert on.fwd_compute == off.fwd_compute  # the GEMMs are not made faster, only the comm hidden
    no_sp = plan.model_copy(update={"sequence_parallel": False})
    assert cost.layer_time(model, H100, tr.model_copy(update={"tp_comm_overlap": True}), no_sp).tp == \
        cost.layer_time(model, H100, tr, no_sp).tp  # Megatron requires SP for --tp-comm-overlap


def test_p2p_overlap_applies_to_interleaved_schedules_only():
    model = _gpt()
    tr = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=1024)
    off = tr.model_copy(update={"overlap_p2p_comm": False})
    inter = Plan(tp=1, pp=4, dp=1, vpp=2, micro_batch_size=1)
    plain = Plan(tp=1, pp=4, dp=1, micro_batch_size=1)
    assert estimate_time(model, A100, tr, inter).stages[0].pp_comm < estimate_time(model, A100, off, inter).stages[0].pp_comm
    assert estimate_time(model, A100, tr, plain).stages[0].pp_comm == estimate_time(model, A100, off, plain).stages[0].pp_comm
    # exposed = what exceeds the chunk's compute plus the SM contention share of the overlap
    hop = estimate_time(model, A100, off, inter).stages[0].pp_comm / (2 * 2)
    lt = cost.layer_time(model, A100, tr, inter)
    c = cost.contention(A100)
    expected = 2 * (overlapped_s(hop, 1 * lt.fwd_compute, c) + overlapped_s(hop, 1 * lt.bwd_compute, c))
    assert estimate_time(model, A100, tr, inter).stages[0].pp_comm == pytest.approx(expected)


def test_memory_bound_ops_are_never_faster_than_their_launches():
    tiny = _gpt(num_layers=1, hidden_size=64, num_attention_heads=1)
    tr = TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=16)
    lt = cost.layer_time(tiny, A100, tr, Plan(tp=1, pp=1, dp=1, micro_batch_size=1))
    k_f, k_b = cost._elementwise_kernels(tiny)
    assert (k_f, k_b) == (7, 9)  # 2 norms, 2 residual adds, activation, RoPE on Q and K; backward +2
    launch = A100.kernel_overhead_us * 1e-6
    assert lt.fwd_compute >= (4 + 1 + k_f) * launch  # 4 GEMMs, 1 attention kernel, 7 memory-bound


def test_fp8_casts_hand_computed():
    model = _gpt(hidden_size=1024, num_attention_heads=16)  # gelu, f = 4h, MHA
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1)
    linears = list(cost._linear_shapes(model, plan).values())
    fwd, bwd = cost._fp8_cast_bytes_per_token(model, plan, linears)
    h, c = 1024, cost.LOW_PRECISION_CAST_BYTES["fp8_delayed"]  # bytes per element: tests/test_blackwell.py derives it
    assert fwd == pytest.approx(c * (h + h + h + 4 * h))  # inputs of QKV, proj, FC1, FC2
    assert bwd == pytest.approx(c * (3 * h + h + 4 * h + h))  # output grads of the same


def test_dp_sync_parts_by_zero_stage():
    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=64, global_batch_size=512, seq_len=4096)
    parts = {z: cost.dp_sync_parts_s(model, H100, tr, Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=z), 0, 32)
             for z in (0, 1, 3)}
    assert parts[0][1] == 0.0 and parts[3][1] == 0.0  # all-reduce only; FSDP gathers per micro-batch instead
    assert parts[1][1] > 0 and parts[1][0] == parts[3][0]  # reduce-scatter, then the weight all-gather
    assert parts[0][0] > parts[1][0]  # an all-reduce moves twice a reduce-scatter's bytes


def test_param_gather_hides_under_the_next_forward_not_the_backward():
    """With overlap, the gradient reduce-scatter hides under the backward drain and the weight all-gather
    under the first forward; on a slow network the exposed part is the excess over each window."""
    model = load_model("llama3-8b")
    slow = H100.model_copy(update={"inter_node_bandwidth_gbps": 2.0})
    tr = TrainingSpec(num_gpus=16, global_batch_size=16, seq_len=4096)
    plan = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=1)
    t = estimate_time(model, slow, tr, plan)
    rs, ag = cost.dp_sync_parts_s(model, slow, tr, plan, 0, 32)
    st = t.stages[0]
    c = cost.contention(slow)
    expected = overlapped_s(rs, st.bwd, c) + overlapped_s(ag, st.fwd, c)
    assert t.breakdown["dp_comm_exposed"] == pytest.approx(expected)
    assert ag > st.fwd and rs > st.bwd  # the case is communication-bound: both parts are partly exposed


def test_fp8_params_all_gather_one_byte_per_weight():
    """--fp8-param-gather: the distributed optimizer all-gathers fp8 weights (1 B), not bf16 (2 B)."""
    from planner.cost import dp_sync_parts_s

    hw, model = load_hardware("h100-sxm-80gb"), load_model("llama3-8b")
    plan = Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=1)
    bf16 = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=4096, precision="fp8")
    fp8 = bf16.model_copy(update={"fp8_params": True})
    _, gather_bf16 = dp_sync_parts_s(model, hw, bf16, plan, 0, 32)
    grads_fp8, gather_fp8 = dp_sync_parts_s(model, hw, fp8, plan, 0, 32)
    assert grads_fp8 == dp_sync_parts_s(model, hw, bf16, plan, 0, 32)[0]
    assert gather_fp8 < gather_bf16 and gather_fp8 == pytest.approx(gather_bf16 / 2, rel=0.02)  # alpha terms aside


def test_mxfp8_params_all_gather_bf16():
    """--fp8-param-gather under mxfp8: the distributed optimizer all-gathers bf16 values into the shared
    gradient buffer and casts them into the MXFP8Tensors (core_v0.16.1 param_and_grad_buffer.py), so the
    gather moves 2 B per weight, as without fp8 parameters."""
    from planner.cost import dp_sync_parts_s

    hw, model = load_hardware("b200-180gb"), load_model("llama3-8b")
    plan = Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=1)
    mx = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=4096, precision="mxfp8")
    assert dp_sync_parts_s(model, hw, mx.model_copy(update={"fp8_params": True}), plan, 0, 32) == \
        dp_sync_parts_s(model, hw, mx, plan, 0, 32)


def test_torchtitan_selective_ac_recomputes_every_second_matmul():
    """torchtitan's op-level SAC (activation_checkpoint.py::_get_custom_policy) recomputes every second aten.mm of
    a block in forward order: Q, K, V, O, W1, W3, W2 -> K, O, W3. For Llama-3-8B on one TP rank the recomputed
    GEMMs are K 4096 -> 1024, O 4096 -> 4096 and W3 4096 -> 14336 (hand-read from its config), plus the forward of
    the memory-bound ops; the attention kernel is saved."""
    model = load_model("llama3-8b")
    tt = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=8192, framework="torchtitan")
    plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=2, zero_stage=3, recompute="selective")
    rates = cost.Rates.of(H100, "bf16")
    tokens = 2 * 8192
    gemms = sum(gemm_time_s(tokens, k, n, rates) for k, n in ((4096, 1024), (4096, 4096), (4096, 14336)))
    assert cost.op_sac_recompute_s(model, tt, plan, rates, tokens, 0.0, 0) == pytest.approx(gemms, rel=1e-12)
    gelu = model.model_copy(update={"activation": "gelu"})  # Q, K, V, O, W1, W2: K, O and W2 (14336 -> 4096)
    w2 = sum(gemm_time_s(tokens, k, n, rates) for k, n in ((4096, 1024), (4096, 4096), (14336, 4096)))
    assert cost.op_sac_recompute_s(gelu, tt, plan, rates, tokens, 0.0, 0) == pytest.approx(w2, rel=1e-12)
    # in the layer: more than Megatron's selective recompute (the attention core only), less than full
    lt = cost.layer_time(model, H100, tt, plan)
    meg = cost.layer_time(model, H100, tt.model_copy(update={"framework": "megatron"}), plan)
    full = cost.layer_time(model, H100, tt, plan.model_copy(update={"recompute": "full"}))
    assert meg.recompute < gemms < lt.recompute < full.recompute


@pytest.mark.parametrize("precision, framework, ag_bytes", [
    ("bf16", "megatron", 2), ("fp8", "megatron", 1), ("mxfp8", "nemo", 1 + 1 / 32), ("nvfp4", "nemo", 0.5 + 1 / 16),
    ("fp8", "torchtitan", 2),  # DTensor SP gathers the 16-bit tensor
])
def test_sp_all_gather_moves_the_quantised_input(precision, framework, ag_bytes):
    """Transformer Engine gathers the column-parallel input after quantising it (gather_along_first_dim with the
    input quantizer); the reduce-scatters stay 16-bit. Without TP overlap a dense layer's forward exposes two
    all-gathers and two reduce-scatters of tokens x h elements (Korthikanti et al. 2022 section 4.2.2)."""
    from planner import comm
    from planner.layout import axis_span

    model = load_model("llama3-70b")
    hw = load_hardware("b200-180gb")
    tr = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192, precision=precision, framework=framework,
                      tp_comm_overlap=False)
    plan = Plan(tp=4, pp=4, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    tokens_h = 8192 * model.hidden_size
    group = axis_span(plan, "tp", hw.nvlink_domain)
    expected = 2 * (comm.collective_time_s("all_gather", tokens_h * ag_bytes, group, hw)
                    + comm.collective_time_s("reduce_scatter", tokens_h * 2, group, hw))
    assert cost.sp_gather_bytes_per_element(tr) == pytest.approx(ag_bytes)
    assert cost.layer_time(model, hw, tr, plan).tp_fwd == pytest.approx(expected, rel=1e-12)


def test_sp_output_gradient_all_gather_is_quantised_too(monkeypatch):
    """Backward: the row-parallel output gradient's all-gather (exposed without TP overlap, one per TP region) is
    gathered quantised as well (TE base.py grad_output_preprocess, "FP8 with all-gather"): forcing 16-bit
    all-gathers must add at least those two exposed all-gathers' difference to the backward."""
    from planner import comm
    from planner.layout import axis_span

    model = load_model("llama3-70b")
    hw = load_hardware("b200-180gb")
    tr = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192, precision="fp8", tp_comm_overlap=False)
    plan = Plan(tp=4, pp=4, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    group = axis_span(plan, "tp", hw.nvlink_domain)
    quantised = cost.layer_time(model, hw, tr, plan).tp_bwd
    monkeypatch.setattr(cost, "sp_gather_bytes_per_element", lambda training: 2)
    wide = cost.layer_time(model, hw, tr, plan).tp_bwd
    tokens_h = 8192 * model.hidden_size
    exposed_diff = 2 * (comm.collective_time_s("all_gather", tokens_h * 2, group, hw)
                        - comm.collective_time_s("all_gather", tokens_h * 1, group, hw))
    assert wide - quantised >= exposed_diff * (1 - 1e-9) > 0
