"""The CP-SAT search against brute-force enumeration, and the candidate generators."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.candidates import Pins, SearchSpace, valid_cp, valid_splits, valid_tp
from planner.cost import estimate_time
from planner.memory import estimate_memory
from planner.presets import load_hardware, load_model
from planner.search import exhaustive, parse_gpu_counts, search
from planner.specs import HardwareSpec, ModelSpec, Plan, TrainingSpec

REL = 1e-6  # the tables hold nanoseconds; ties closer than that may pick either plan


def _check_same_optimum(model, hw, training, space):
    res = search(model, hw, training, space)
    ref_plan, ref_t, n = exhaustive(model, hw, training, space)
    if ref_plan is None:
        assert res.best is None, res.best
        return None
    assert res.best is not None, f"solver found nothing; exhaustive found {ref_plan}"
    assert res.status == "OPTIMAL"
    got = estimate_time(model, hw, training, res.best).step_time_s
    assert got == pytest.approx(ref_t, rel=REL), (res.best, ref_plan)
    assert estimate_memory(model, hw, training, res.best).fits
    assert res.candidates == n
    return res


def _hw(memory_gib, gpus_per_node=8):
    return HardwareSpec(name="test", gpu_memory_gib=memory_gib, peak_bf16_tflops=300, hbm_bandwidth_gbps=2000,
                        gpus_per_node=gpus_per_node, intra_node_bandwidth_gbps=200, intra_node_latency_us=2,
                        inter_node_bandwidth_gbps=20, inter_node_latency_us=5, cuda_context_gib=0, nccl_buffers_gib=0,
                        fragmentation_headroom=0)


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([2, 4, 8]))
    model = ModelSpec(name="r", num_layers=draw(st.sampled_from([2, 3, 4, 6, 8])), hidden_size=heads * 32,
                      num_attention_heads=heads, num_kv_heads=draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0])),
                      vocab_size=draw(st.sampled_from([1000, 5000])), activation=draw(st.sampled_from(["gelu", "swiglu"])))
    n = draw(st.sampled_from([1, 2, 4, 8]))
    training = TrainingSpec(num_gpus=n, global_batch_size=n * draw(st.sampled_from([1, 2, 4])),
                            seq_len=draw(st.sampled_from([256, 2048])), overlap_grad_reduce=draw(st.booleans()))
    hw = _hw(draw(st.sampled_from([0.01, 0.03, 0.1, 1.0])), draw(st.sampled_from([2, 4, 8])))
    return model, hw, training


SMALL = SearchSpace(max_micro_batch_size=4, max_cp=2)


def test_solver_and_estimate_agree_at_the_capacity_edge():
    """A case hypothesis found: TP1 x DP2 at ZeRO 3 needs 102.4 MiB of a 0.1 GiB device to within a fraction of a KiB.
    The search's tables judge in whole KiB (the peak rounded up, the device down) and refused it while the estimate,
    judging bytes, passed it, so the brute force picked a plan the solver could not. ``MemoryEstimate.fits`` judges
    in the tables' KiB since: both refuse it."""
    model = ModelSpec(name="r", num_layers=8, hidden_size=64, num_attention_heads=2, num_kv_heads=1, vocab_size=1000,
                      activation="gelu")
    training = TrainingSpec(num_gpus=2, global_batch_size=2, seq_len=256, overlap_grad_reduce=False)
    edge = Plan(tp=1, pp=1, dp=2, micro_batch_size=1, recompute="full", zero_stage=3)
    est = estimate_memory(model, _hw(0.1, 2), training, edge)
    assert abs(est.peak.peak_bytes - est.usable_gib * 2**30) < 2 * 1024 and not est.fits
    _check_same_optimum(model, _hw(0.1, 2), training, SMALL)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_solver_matches_brute_force_on_random_small_cases(case):
    model, hw, training = case
    _check_same_optimum(model, hw, training, SMALL)


@pytest.mark.parametrize("name,hw,gpus,batch,seq", [
    ("tiny-gpt", "cpu-gloo", 8, 16, 256),
    ("llama3-8b", "h100-sxm-80gb", 16, 32, 4096),
    ("mistral-7b", "a100-40gb", 8, 16, 2048),
    ("megatron-gpt-1.7b", "a100-80gb", 8, 64, 2048),
])
def test_solver_matches_brute_force_on_bundled_presets(name, hw, gpus, batch, seq):
    _check_same_optimum(load_model(name), load_hardware(hw), TrainingSpec(num_gpus=gpus, global_batch_size=batch,
                                                                          seq_len=seq), SearchSpace(max_micro_batch_size=4))


def test_pins_are_respected():
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096)
    pins = Pins(tp=4, recompute="selective", zero_stage=1, micro_batch_size=1)
    res = search(model, hw, tr, SearchSpace(pins=pins))
    p = res.best
    assert (p.tp, p.recompute, p.zero_stage, p.micro_batch_size) == (4, "selective", 1, 1)
    _check_same_optimum(model, hw, tr, SearchSpace(pins=pins, max_micro_batch_size=4))


def test_pinned_sequence_parallel_means_sp_wherever_there_is_tp():
    """Megatron-LM turns --sequence-parallel off at tp 1 (core_v0.16.1 arguments.py validate_args), so a pin of
    SP leaves the tp-1 plans (without SP) in the space, for a library caller as for the CLI; tp > 1 plans keep it."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096)
    res = search(model, hw, tr, SearchSpace(pins=Pins(tp=1, sequence_parallel=True)))
    assert res.best is not None and (res.best.tp, res.best.sequence_parallel) == (1, False)
    _check_same_optimum(model, hw, tr, SearchSpace(pins=Pins(tp=1, sequence_parallel=True), max_micro_batch_size=4))
    for tp in (None, 2):  # unpinned tp: every tp > 1 candidate has SP, tp 1 ones none
        space = SearchSpace(pins=Pins(tp=tp, sequence_parallel=True), max_micro_batch_size=4)
        res = _check_same_optimum(model, hw, tr, space)
        assert all(p.sequence_parallel == (p.tp > 1) for p in [res.best, *res.alternatives])
    res = search(model, hw, tr, SearchSpace(pins=Pins(sequence_parallel=False)))
    assert not res.best.sequence_parallel and not any(p.sequence_parallel for p in res.alternatives)


def test_alternatives_have_other_shapes_and_are_slower():
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096)
    res = search(model, hw, tr, top_k=3)
    shapes = [(p.tp, p.pp, p.cp) for p in [res.best, *res.alternatives]]
    assert len(set(shapes)) == len(shapes) == 4
    times = [estimate_time(model, hw, tr, p).step_time_s for p in [res.best, *res.alternatives]]
    assert times == sorted(times)


def test_uneven_first_and_last_stage_can_win():
    """Llama-3-8B's 128k vocabulary makes the last stage heavy; an uneven split should be among the legal plans
    and the solver should take one when the plain 1F1B schedule is pinned."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096)
    res = search(model, hw, tr, SearchSpace(pins=Pins(tp=1, pp=8, cp=1, vpp=1, zero_stage=1)))
    assert res.best.layers_per_stage is not None and res.best.layers_per_stage[-1] < res.best.layers_per_stage[1]
    even = estimate_time(model, hw, tr, res.best.model_copy(update={"layers_per_stage": None})).step_time_s
    assert estimate_time(model, hw, tr, res.best).step_time_s < even


def test_infeasible_reports_closest():
    model, hw = load_model("gpt3-175b"), load_hardware("a100-80gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=2048)
    res = search(model, hw, tr)
    assert res.best is None and res.status == "INFEASIBLE" and res.closest is not None


# --- generators ---------------------------------------------------------------------------------
def test_tp_divides_heads_kv_and_stays_in_node():
    model = load_model("llama3-70b")  # 64 heads, 8 KV heads, ffn 28672
    assert valid_tp(model, load_hardware("h100-sxm-80gb"), 64) == [1, 2, 4, 8]
    gqa1 = ModelSpec(name="x", num_layers=2, hidden_size=96, num_attention_heads=6, num_kv_heads=3, vocab_size=10,
                     ffn_hidden_size=96)
    assert valid_tp(gqa1, _hw(1, gpus_per_node=6), 24) == [1, 3, 6]  # 2 does not divide 3 KV heads; 6 replicates them 2x
    assert valid_tp(gqa1, _hw(1, gpus_per_node=8), 24) == [1]  # tp must also divide the node


def test_cp_divides_the_sequence():
    assert valid_cp(TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)) == [1, 2, 4, 8]
    assert valid_cp(TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=1024)) == [1]


def test_splits_even_and_uneven():
    model = load_model("llama3-8b")  # 32 layers
    splits = valid_splits(model, 4)
    assert any(s.vpp == 8 for s in splits) and any(s.vpp == 2 for s in splits)
    uneven = [s for s in splits if s.layers()]
    assert all(sum(s.layers()) == 32 for s in uneven)
    assert all(abs(s.first - s.middle) <= 3 and abs(s.last - s.middle) <= 3 for s in uneven)
    assert any(s.last < s.middle for s in uneven)
    # uneven and interleaved together (Meta's layout): vpp divides the middle stages, each end has a
    # layer per chunk at least but for rank 0's embedding chunk and the last rank's loss chunk, which may
    # be empty (specs.min_stage_layers: vpp - 1 layers on an end)
    interleaved = [s for s in uneven if s.vpp > 1]
    assert interleaved and all(s.middle % s.vpp == 0 and min(s.first, s.last) >= s.vpp - 1 for s in interleaved)
    assert any(s.first % s.vpp for s in interleaved)
    # a pinned vpp 8 on 30 layers: 7 + 8 + 8 + 7, the embedding and loss chunks empty (NVIDIA's 405B shape)
    pinned = [s for s in valid_splits(model.model_copy(update={"num_layers": 30}), 4, max_vpp=8)
              if s.layers() and s.vpp > 1]
    assert any((s.first, s.middle, s.last, s.vpp) == (7, 8, 7, 8) for s in pinned)
    assert not any(s.vpp > 4 for s in interleaved)  # unpinned: vpp <= MAX_UNEVEN_VPP
    # two stages: no middle to divide, any vpp up to an end's layers + 1; each is a plan specs accepts
    two = [s for s in valid_splits(model, 2) if s.layers() and s.vpp > 1]
    assert two and all(s.vpp <= min(s.first, s.last) + 1 for s in two)
    for s in interleaved[:20] + pinned[:20] + two[:20]:
        plan = Plan(tp=1, pp=s.pp, dp=1, vpp=s.vpp, micro_batch_size=1, layers_per_stage=s.layers())
        total = sum(s.layers())
        assert sum(map(sum, plan.chunk_layers(total))) == total


def test_parse_gpu_counts():
    assert parse_gpu_counts("64") == [64]
    assert parse_gpu_counts("256,64,128") == [64, 128, 256]
    assert parse_gpu_counts("64..512") == [64, 128, 256, 512]
    with pytest.raises(ValueError):
        parse_gpu_counts("64..8")


def test_table_times_are_estimate_time():
    """One cost model: every legal table entry is estimate_time of its plan (to the nanosecond rounding)."""
    import numpy as np

    from planner.search import build_tables
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=8192)
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=2))
    legal = np.flatnonzero(tables.legal.ravel())
    assert legal.size > 100
    for k in legal[:: max(1, legal.size // 60)]:
        plan = tables.plan(int(k))
        s, u, z = tables.unindex(int(k))
        assert tables.time_ns[s, u, z] == pytest.approx(estimate_time(model, hw, tr, plan).step_time_s * 1e9, abs=1.0), plan


def test_search_confirms_its_pick_by_the_reference_memory_estimate(monkeypatch):
    """Under torchtitan the tables hold the allocated peak and the estimate judges by the replayed reserved peak
    (planner/allocator_trace.py): on Llama-3-70B, 16 H100, 32 x 4096 the fastest plan by the tables (TP 4, full AC)
    reserves 73.7 GiB of 73.6 usable. The search drops it and returns a plan the estimate accepts."""
    from planner.memory import estimate_memory
    from planner.search import search

    model, hw = load_model("llama3-70b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096, framework="torchtitan")
    best = search(model, hw, tr).best
    assert best is not None and estimate_memory(model, hw, tr, best).fits
    refused = Plan(tp=4, pp=1, dp=4, micro_batch_size=1, recompute="full", zero_stage=3)
    assert not estimate_memory(model, hw, tr, refused).fits
    import planner.search as search_module

    # the tables alone pick the refused plan
    tables = search_module.build_tables(model, hw.for_job(16), tr, SearchSpace())
    pick = search_module.solve(tables, Pins(), search_module.pareto_by_group(tables)).plan
    assert (pick.tp, pick.dp, pick.recompute) == (4, 4, "full") and pick != best
    # past the refusals allowed one by one, a refused pick drops every candidate as full as itself; the plan
    # returned is still confirmed by the estimate
    monkeypatch.setattr(search_module, "MAX_REFERENCE_REJECTIONS", 0)
    banded = search(model, hw, tr).best
    assert banded is not None and estimate_memory(model, hw, tr, banded).fits


def test_cp_sat_is_imported_without_pandas_and_keeps_its_series_helpers():
    """``search.cp_model_module`` imports ortools' CP-SAT module without pandas (0.4 s of a search process on two
    cores); the module still solves, and its pandas-based helpers still find the real pandas on first use. Run in a
    fresh interpreter, where neither module is imported yet."""
    import subprocess
    import sys

    code = """
import sys
from planner.search import cp_model_module
cp = cp_model_module()
assert "pandas" not in sys.modules, "pandas imported"
m = cp.CpModel()
x = m.NewIntVar(0, 10, "x")
m.Add(x >= 3)
m.Minimize(x)
s = cp.CpSolver()
assert s.Solve(m) == cp.OPTIMAL and s.Value(x) == 3
assert "pandas" not in sys.modules
import pandas
series = m.new_int_var_series(name="v", index=pandas.Index(range(2)), lower_bounds=0, upper_bounds=1)
assert isinstance(series, pandas.Series) and len(series) == 2
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
