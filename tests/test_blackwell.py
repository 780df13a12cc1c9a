"""Issue 18: Blackwell profiles, NVLink domains larger than a node, block-scaled precisions.

Figures are the profiles' own, each cited in its YAML; hand-computed values below say where they
come from.
"""

from __future__ import annotations

import pytest

from planner.presets import load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec, job_problems


@pytest.mark.parametrize("name,domain,per_node", [("gb200-nvl72", 72, 4), ("gb300-nvl72", 72, 4),
                                                 ("b200-180gb", 8, 8), ("b300-288gb", 8, 8),
                                                 ("h100-sxm-80gb", 8, 8)])
def test_nvlink_domain_is_its_own_figure(name, domain, per_node):
    hw = load_hardware(name)
    assert (hw.nvlink_domain, hw.gpus_per_node) == (domain, per_node)


@pytest.mark.parametrize("name,precision,tflops", [
    ("gb200-nvl72", "bf16", 2500), ("gb200-nvl72", "fp8", 5000), ("gb200-nvl72", "mxfp8", 5000),
    ("gb200-nvl72", "nvfp4", 10000),     # 1,440 PF FP4 sparse per rack / 72 / 2
    ("gb300-nvl72", "nvfp4", 15000),     # 1,080 PF FP4 dense per rack / 72
    ("b300-288gb", "nvfp4", 13125), ("b200-180gb", "mxfp8", 4500), ("b200-180gb", "nvfp4", 9000),
])
def test_peak_rate_per_precision(name, precision, tflops):
    assert load_hardware(name).peak_flops(precision) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
def test_block_scaled_formats_need_blackwell(precision):
    hw, model = load_hardware("h100-sxm-80gb"), load_model("llama3-8b")
    problems = job_problems(model, hw, TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096,
                                                    precision=precision))
    assert problems and "Blackwell" in problems[0]


def test_tp_may_span_trays_inside_the_nvl72_domain():
    """TP 8 on GB200: 8 GPUs over two 4-GPU trays, legal because the NVLink domain is the rack."""
    sc = Scenario(model=load_model("llama3-70b"), hardware=load_hardware("gb200-nvl72"),
                  training=TrainingSpec(num_gpus=72, global_batch_size=72, seq_len=8192),
                  plan=Plan(tp=8, pp=1, dp=9, micro_batch_size=1))
    assert sc.plan.tp > sc.hardware.gpus_per_node
    with pytest.raises(ValueError, match="NVLink domain"):
        Scenario(model=load_model("llama3-70b"), hardware=load_hardware("gb200-nvl72"),
                 training=TrainingSpec(num_gpus=80, global_batch_size=80, seq_len=8192),
                 plan=Plan(tp=16, pp=1, dp=5, micro_batch_size=1))  # 16 does not divide 72


def _tp8_70b(hw):
    from planner.estimate import estimate

    return estimate(Scenario(model=load_model("llama3-70b"), hardware=hw,
                             training=TrainingSpec(num_gpus=144, global_batch_size=288, seq_len=8192),
                             plan=Plan(tp=8, pp=1, dp=18, micro_batch_size=1, sequence_parallel=True, zero_stage=1,
                                       recompute="selective")))


def test_tp_across_trays_is_fast_only_inside_the_domain():
    """The same TP-8 plan on GB200 NVL72 trays of 4: on the 72-GPU NVLink domain its collectives use NVLink
    (740 GB/s); were each tray its own domain (nvlink_domain_size 4 = gpus_per_node), they would go over the
    400 Gb/s NICs (46 GB/s, hierarchically: 4 per tray first) and TP would cost over twice as much."""
    rack = load_hardware("gb200-nvl72")
    trays = rack.model_copy(update={"nvlink_domain_size": 4, "nvlink_domain_segment": None})
    inside, across = _tp8_70b(rack), _tp8_70b(trays)
    assert inside.time.breakdown["tp_comm"] * 2 < across.time.breakdown["tp_comm"]
    assert inside.time.step_time_s < across.time.step_time_s


def test_layout_line_names_the_domain():
    from planner.layout import placement_line

    plan = Plan(tp=8, pp=1, dp=18, micro_batch_size=1)
    line = placement_line(plan, load_hardware("gb200-nvl72").nvlink_domain)
    assert "NVLink domain of 72" in line and "TP 8 inside one NVLink domain" in line
    assert "DP 18 across 2 domains" in line
    assert "TP 8 across 2 domains" in placement_line(plan, 4)


def test_layout_line_places_the_expert_groups():
    """A MoE plan's layout line names where its EP group sits (Megatron-Core's expert grid ETP x EP x EDP x PP:
    an EP group is ``ep`` ranks ``etp`` apart): TP 2 x EP 8 is ranks 0, 2, ..., 14, two 8-GPU nodes, but one
    NVL72 domain; expert TP is named only where it differs from TP."""
    from planner.layout import placement_line

    plan = Plan(tp=2, pp=2, dp=16, ep=8, micro_batch_size=1, sequence_parallel=True)
    assert "EP 8 across 2 domains (4 per domain)" in placement_line(plan, 8)
    assert "EP 8 inside one NVLink domain" in placement_line(plan, load_hardware("gb200-nvl72").nvlink_domain)
    assert "expert TP" not in placement_line(plan, 8)
    assert "expert TP 1 " not in placement_line(plan.model_copy(update={"etp": 1}), 8)  # size 1: not a group
    assert "EP" not in placement_line(Plan(tp=2, pp=2, dp=16, micro_batch_size=1), 8)


def test_search_on_nvl72_may_use_tp_beyond_a_tray():
    """With TP pinned to 8 on GB200 (4 GPUs per tray) the search finds plans; on trays as domains it
    could not place TP 8 inside one domain, and the pin is refused up front."""
    from planner.candidates import Pins, SearchSpace
    from planner.search import search

    tr = TrainingSpec(num_gpus=144, global_batch_size=288, seq_len=8192)
    res = search(load_model("llama3-70b"), load_hardware("gb200-nvl72"), tr, SearchSpace(pins=Pins(tp=8)))
    assert res.best is not None and res.best.tp == 8


@pytest.mark.parametrize("precision,tflops", [
    ("bf16", 2500 * 0.729),                       # stas00's GB200 BF16 MAMF, 1822 of 2500
    ("fp8", 5000 * 0.723),                        # stas00's GB200 FP8 MAMF, 3615.6 of 5000
    ("mxfp8", 5000 * 0.723 * 6.812 / 7.161),      # TE's B300 kernels: MXFP8 7.161 ms vs FP8 6.812 ms per layer
    ("nvfp4", 5000 * 0.723 * 6.812 / 3.764),      # NVFP4 3.764 ms: 1.81x FP8, under the datasheets' 2x
])
def test_gemm_rate_per_precision_hand_computed(precision, tflops):
    """GB200 profile GEMM rates, times the B200 die's sustained 0.76 (TE docs/examples/gemm_profiling, kernel-only
    B300 table)."""
    from planner.cost import Rates

    rate = Rates.of(load_hardware("gb200-nvl72"), precision).gemm_flops
    assert rate == pytest.approx(tflops * 1e12 * 0.76, rel=1e-9)


# Transformer Engine's GEMM benchmark, per layer (h 4096, f 16384, M 15,872): autocast minus kernel-only ms, at the
# GPU's HBM rate x 0.8, over the elements it quantises (both copies of the 4 inputs, 4 output gradients and the
# weights): 15872 x (28672 + 36864) + 201,326,592 = 1,241,513,984. Means over the GPUs measured.
_E = 15872 * (28672 + 36864) + 201326592
_BYTES = {
    "fp8": ((7.802 - 6.812) * 1e-3 * 6400e9 / _E + (18.978 - 16.785) * 1e-3 * 3840e9 / _E) / 2,  # delayed: B300, H200
    "mxfp8": (8.984 - 7.161) * 1e-3 * 6400e9 / _E,                                              # B300 only
    "nvfp4": (6.453 - 3.764) * 1e-3 * 6400e9 / _E,
}


@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_cast_bytes_per_precision_hand_computed(precision):
    """One linear of width k=4096 in, n=14336 out: forward casts its input (k), backward its output gradient (n),
    each at the bytes per element TE's own benchmark measures (above)."""
    from planner.cost import _fp8_cast_bytes_per_token

    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1)
    fwd, bwd = _fp8_cast_bytes_per_token(load_model("llama3-8b"), plan, [(4096, 14336, "fc1")], precision)
    assert (fwd, bwd) == (pytest.approx(_BYTES[precision] * 4096), pytest.approx(_BYTES[precision] * 14336))


def test_tensorwise_fp8_casts_cost_more_than_delayed():
    """Current scaling takes each tensor's amax first: TE measures 2.335 ms (B300) and 3.500 ms (H200) of
    quantisation per layer against delayed scaling's 0.990 and 2.193 ms."""
    from planner.cost import _fp8_cast_bytes_per_token

    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1)
    lin = [(4096, 14336, "fc1")]
    tw = _fp8_cast_bytes_per_token(load_model("llama3-8b"), plan, lin, "fp8", "tensorwise")[0] / 4096
    assert tw == pytest.approx(((9.147 - 6.812) * 6400e9 + (20.285 - 16.785) * 3840e9) * 1e-3 / _E / 2)
    assert tw > 1.9 * _BYTES["fp8"]


def test_nvfp4_step_is_faster_than_mxfp8_faster_than_bf16_on_gb200():
    from planner.estimate import estimate

    def step(precision):
        return estimate(Scenario(model=load_model("llama3-70b"), hardware=load_hardware("gb200-nvl72"),
                                 training=TrainingSpec(num_gpus=72, global_batch_size=72, seq_len=8192,
                                                       precision=precision),
                                 plan=Plan(tp=8, pp=1, dp=9, micro_batch_size=1, sequence_parallel=True,
                                           zero_stage=1, recompute="selective"))).time.step_time_s

    assert step("nvfp4") < step("mxfp8") < step("bf16")


@pytest.mark.parametrize("precision,saved_per_element", [("bf16", 2.0), ("fp8", 1.0), ("mxfp8", 1 + 1 / 32),
                                                         ("nvfp4", 0.5 + 1 / 16)])
def test_saved_gemm_inputs_per_precision_hand_computed(precision, saved_per_element):
    """The FC2 input (s b f / t elements) is saved in the recipe's quantised column-wise form:
    llama3-8b, s 8192, b 1, f 14336, t 8: 8192 * 14336 / 8 elements."""
    from planner.memory import layer_activation_terms

    training = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192, precision=precision)
    plan = Plan(tp=8, pp=1, dp=1, micro_batch_size=1, sequence_parallel=True)
    (fc2,) = [x for x in layer_activation_terms(load_model("llama3-8b"), training, plan) if x.name == "FC2 input"]
    assert fc2.bytes == pytest.approx(8192 * 14336 / 8 * saved_per_element)


@pytest.mark.parametrize("precision,cache_per_weight", [("bf16", 0), ("fp8", 1), ("mxfp8", 2 + 2 / 32),
                                                        ("nvfp4", 1.0)])
def test_te_weight_cache_per_precision_hand_computed(precision, cache_per_weight):
    """Megatron/TE keep quantised copies of every GEMM weight: weights bytes = 2 B bf16 + the cache. On a
    Blackwell GB200 per-tensor fp8 keeps the fp8 weight only (1 B: no transpose, fp8 GEMMs take any layout);
    mxfp8 both block-scaled directions; nvfp4 both directions at 0.5 B."""
    from planner.frameworks.megatron import linear_params_per_rank
    from planner.memory import estimate_scenario_memory

    model = load_model("llama3-8b")

    def weights(p):
        sc = Scenario(model=model, hardware=load_hardware("gb200-nvl72"),
                      training=TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, precision=p),
                      plan=Plan(tp=8, pp=1, dp=1, micro_batch_size=1, sequence_parallel=True))
        return estimate_scenario_memory(sc).stages[0].weights_bytes

    extra = weights(precision) - weights("bf16")
    assert extra == pytest.approx(cache_per_weight * linear_params_per_rank(model, 8, model.num_layers))


def test_nemo_runs_nvfp4_without_tp_overlap():
    """Megatron-Bridge's recipes: "tp_comm_overlap = False if precision == 'nvfp4'" (llama3_llm_pretrain.py);
    an explicit setting still wins."""
    from planner.cost import resolved_overlap

    def tp_overlap(**kw):
        return resolved_overlap(TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, **kw)).tp_comm_overlap

    assert tp_overlap(framework="nemo", precision="fp8") is True
    assert tp_overlap(framework="nemo", precision="nvfp4") is False
    assert tp_overlap(framework="nemo", precision="nvfp4", tp_comm_overlap=True) is True


def test_blackwell_ultra_attention_forward_and_backward_levels():
    """GB300: forward at FlashAttention-4's 1613 TFLOP/s (0.645 of 2500; the doubled SFU), backward at the
    B200 die's cuDNN 1240 TFLOP/s (0.496 of 2500); GB200 both at 0.496. Times sustained 0.87 (GB300) and 0.76
    (GB200, the B200 die's fit)."""
    from planner.cost import Rates

    gb300, gb200 = Rates.of(load_hardware("gb300-nvl72"), "bf16"), Rates.of(load_hardware("gb200-nvl72"), "bf16")
    assert gb300.attention_rate("fwd") == pytest.approx(2500e12 * 0.645 * 0.87, rel=1e-9)
    assert gb300.attention_rate("bwd") == pytest.approx(2500e12 * 0.496 * 0.87, rel=1e-9)
    assert gb200.attention_rate("fwd") == gb200.attention_rate("bwd") == pytest.approx(2500e12 * 0.496 * 0.76, rel=1e-9)


def test_b200_die_sustained_fraction_is_the_fit():
    """The B200-die profiles carry the value benchmarks/blackwell_sustained.py fits on the dense Megatron-Bridge
    runs: no neighbour on its 0.01 grid does better (the fit itself is printed by the script)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from blackwell_sustained import errors, mean_abs, runs_of

    value = load_hardware("b200-180gb").sustained_fraction
    assert load_hardware("gb200-nvl72").sustained_fraction == value
    runs = runs_of("B200")
    at = {x: mean_abs(errors(runs, x, "dense")) for x in (round(value - 0.01, 2), value, round(value + 0.01, 2))}
    assert at[value] == min(at.values()), at


def test_a_job_that_does_not_fill_whole_racks_fills_64_gpu_segments():
    """NVL72 racks: a job of a multiple of 72 GPUs (or at most 72) sees the 72-GPU domain; one of 256 GPUs, a
    multiple of 64 and not of 72, runs on 64 GPUs of each of 4 racks (nvlink_domain_segment: jobs use 16 of the 18
    trays), so ranks 64..95 share a rack. A count that is neither keeps the physical domain; DGX keeps its 8."""
    rack = load_hardware("gb200-nvl72")
    assert [rack.job_nvlink_domain(n) for n in (8, 64, 72, 144, 256, 2496, 100)] == [72, 72, 72, 72, 64, 64, 72]
    assert rack.for_job(72) is rack and rack.for_job(256).nvlink_domain == 64
    assert load_hardware("b200-180gb").job_nvlink_domain(256) == 8
    # EP 32 on 256 GPUs: with 72-GPU racks the group of ranks 64..95 would straddle two racks and pace the
    # all-to-all by the NICs; in 64-GPU segments every EP group is inside one rack
    from planner.layout import expert_span

    plan = Plan(tp=1, pp=8, dp=32, ep=32, micro_batch_size=1)
    assert expert_span(plan, "ep", rack.nvlink_domain).nodes == 2
    assert expert_span(plan, "ep", rack.job_nvlink_domain(256)).nodes == 1
    # TP 16 divides the job's 64-GPU segment, not the rack: legal for 256 GPUs, refused for 288 (4 full racks)
    model = load_model("llama3-70b")
    Scenario(model=model, hardware=rack, training=TrainingSpec(num_gpus=256, global_batch_size=256, seq_len=8192),
             plan=Plan(tp=16, pp=1, dp=16, micro_batch_size=1))
    with pytest.raises(ValueError, match="NVLink domain"):
        Scenario(model=model, hardware=rack, training=TrainingSpec(num_gpus=288, global_batch_size=288, seq_len=8192),
                 plan=Plan(tp=16, pp=1, dp=18, micro_batch_size=1))


def test_a_segment_larger_than_the_domain_is_refused():
    with pytest.raises(ValueError, match="nvlink_domain_segment"):
        load_hardware("gb200-nvl72").model_validate({**load_hardware("gb200-nvl72").model_dump(),
                                                     "nvlink_domain_segment": 80})


def test_the_layout_line_says_when_a_job_fills_segments(runner):
    from planner.cli import app

    res = runner.invoke(app, ["search", "-m", "llama3-70b", "-H", "gb200-nvl72", "--gpus", "256", "--global-batch",
                              "512", "--seq-len", "4096", "--tp", "8"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "NVLink domain of 64 GPUs" in res.output and "256 GPUs fill 64 of each 72-GPU domain" in res.output


def test_a_job_inside_one_nvlink_domain_takes_any_tp_the_search_takes():
    """32 GPUs of a GB200 NVL72 rack sit in one NVLink domain, so TP 16 straddles nothing: `plan_problems` and the
    pinned `search --tp 16` accept what the search's own rule offers (`candidates.valid_tp`: tp up to
    min(GPUs, domain)); at 144 GPUs (two racks) TP 16 groups would cross the racks and stay refused."""
    from planner.specs import plan_problems

    rack, model = load_hardware("gb200-nvl72"), load_model("llama3-8b")
    inside = TrainingSpec(num_gpus=32, global_batch_size=128, seq_len=4096)
    plan = Plan(tp=16, pp=1, dp=2, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    assert not [p for p in plan_problems(model, rack, inside, plan) if p.startswith("tp:")]
    across = TrainingSpec(num_gpus=144, global_batch_size=144, seq_len=4096)
    wide = Plan(tp=16, pp=1, dp=9, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    assert [p for p in plan_problems(model, rack, across, wide) if p.startswith("tp:")] == [
        "tp: tp(16) neither divides nor is a multiple of the NVLink domain (72 GPUs) of gb200-nvl72, so TP groups "
        "would straddle domains; choose a divisor of 72"]
