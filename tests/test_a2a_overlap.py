"""The MoE all-to-all overlap (Megatron --overlap-moe-expert-parallel-comm) where Megatron-Core runs it: its rules
(core_v0.16.1 TransformerConfig), its extra warm-up forward and merged-step layer in memory, and one model in the
estimate and the search tables."""

from types import SimpleNamespace as NS

import numpy as np
import pytest

from planner.candidates import Pins, SearchSpace
from planner.cost import estimate_time, layer_time
from planner.memory import (a2a_overlap_active, estimate_memory, in_flight_chunks, saved_bytes_per_layer_kind,
                            stage_saved_bytes)
from planner.presets import load_hardware, load_model
from planner.search import KIB, build_tables, exhaustive, search
from planner.specs import Plan, TrainingSpec

H100 = load_hardware("h100-sxm-80gb")
TINY = load_model("tiny-moe")


def _tr(overlap: bool = True, **kw) -> TrainingSpec:
    return TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=1024, moe_a2a_overlap=overlap, **kw)


@pytest.mark.parametrize("plan, framework, mtp, runs", [
    (dict(pp=1, dp=8, ep=8), "megatron", 0, True),
    (dict(pp=2, dp=4, ep=4, vpp=2), "nemo", 0, True),
    (dict(pp=1, dp=8, ep=1), "megatron", 0, False),                       # "only supported with expert parallelism"
    (dict(pp=2, dp=4, ep=4), "megatron", 0, False),                       # pp > 1 needs virtual pipeline stages
    (dict(pp=1, dp=8, ep=8, recompute="full"), "megatron", 0, False),     # "disable full recomputation"
    (dict(pp=1, dp=8, ep=8), "megatron", 1, False),                       # one MTP layer needs pp > 1
    (dict(pp=2, dp=4, ep=4, vpp=2), "megatron", 1, True),
    (dict(pp=2, dp=4, ep=4, vpp=2), "megatron", 2, False),                # "MTP layernum only supports 1"
    (dict(pp=1, dp=8, ep=8), "torchtitan", 0, False),                     # Megatron-Core's schedule only
])
def test_overlap_runs_where_megatron_core_accepts_it(plan, framework, mtp, runs):
    model = TINY.model_copy(update={"mtp_num_layers": mtp})
    p = Plan(tp=1, micro_batch_size=1, **plan)
    assert a2a_overlap_active(model, _tr(framework=framework), p) is runs
    assert not a2a_overlap_active(model, _tr(False, framework=framework), p)
    assert not a2a_overlap_active(load_model("llama3-8b"), _tr(framework=framework), p)  # a dense model


def test_overlap_time_only_where_it_runs():
    """A pp > 1 plan without virtual stages runs the all-to-all exposed even when the job asks for the overlap
    (before, the cost model hid it and only the launch file refused the flag)."""
    for plan, hidden in ((Plan(tp=1, pp=2, dp=4, ep=4, vpp=2, micro_batch_size=1), True),
                         (Plan(tp=1, pp=2, dp=4, ep=4, micro_batch_size=1), False)):
        on = layer_time(TINY, H100, _tr(), plan, moe=True)
        off = layer_time(TINY, H100, _tr(False), plan, moe=True)
        assert (on.ep < off.ep) is hidden and (on.ep == off.ep) is not hidden


def test_megatron_runs_one_more_warmup_forward(megatron_schedules):
    """Megatron-Core's own count (get_pp_rank_microbatches with overlap_moe_expert_parallel_comm) against
    in_flight_chunks(warmup_extra=1): every rank one more chunk in flight, never past m x v."""
    MS = megatron_schedules
    for p, v, m in ((2, 2, 4), (4, 2, 8), (4, 3, 12), (2, 4, 2)):
        plan = Plan(tp=1, pp=p, dp=1, vpp=v, micro_batch_size=1)
        for r in range(p):
            comm = NS(pp_group=NS(size=lambda: p, rank=lambda r=r: r), virtual_pipeline_model_parallel_size=v)
            _, _, warmup, _ = MS.get_pp_rank_microbatches(m, v, p, overlap_moe_expert_parallel_comm=True,
                                                          p2p_communicator=comm)
            assert int(np.asarray(in_flight_chunks(plan, m, r, warmup_extra=1))) == min(m * v, warmup + 1)


def test_memory_counts_the_extra_chunk_and_the_merged_layer():
    """Hand count on tiny-moe without its dense first layer (every layer a MoE layer saving b bytes). pp 1: one
    micro-batch's L layers plus one layer of the next (the merged forward/backward step). pp 2 x vpp 2 (one layer
    a chunk), 8 micro-batches, rank 0: Megatron's 2(p-1) + (v-1)p + 1 = 5 chunks, one more warm-up chunk, and
    one layer."""
    model = TINY.model_copy(update={"first_k_dense": 0})
    L = model.num_layers
    tr_on, tr_off = _tr(), _tr(False)
    p1 = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    _, b = saved_bytes_per_layer_kind(model, tr_on, p1)
    on, off = (stage_saved_bytes(model, t, p1, 4, 0, L) for t in (tr_on, tr_off))
    assert off == pytest.approx(L * b) and on == pytest.approx((L + 1) * b)
    p2 = Plan(tp=1, pp=2, dp=4, ep=4, vpp=2, micro_batch_size=1)
    _, b2 = saved_bytes_per_layer_kind(model, tr_on, p2)
    on, off = (stage_saved_bytes(model, t, p2, 8, 0, L // 2) for t in (tr_on, tr_off))
    assert off == pytest.approx(5 * b2) and on == pytest.approx((6 + 1) * b2)
    # a job that asks for the overlap on a plan Megatron runs without it holds what it holds without it
    p3 = Plan(tp=1, pp=2, dp=4, ep=4, micro_batch_size=1)
    assert stage_saved_bytes(model, tr_on, p3, 8, 0, L // 2) == stage_saved_bytes(model, tr_off, p3, 8, 0, L // 2)
    # with the dense first layer, the extra layer is counted at the heavier kind (here the MoE layer)
    dense_b, moe_b = saved_bytes_per_layer_kind(TINY, tr_on, p1)
    on, off = (stage_saved_bytes(TINY, t, p1, 4, 0, L) for t in (tr_on, tr_off))
    assert on - off == pytest.approx(max(dense_b, moe_b))


@pytest.mark.parametrize("pins", [Pins(pp=1), Pins(pp=2)])
def test_search_tables_hold_the_estimates_with_the_overlap(pins):
    """One model: every legal table entry is estimate_time of its plan, and its memory at least the estimate's
    peak (the overlap's extra chunk and layer included); the search's best equals the brute force's."""
    tr = _tr()
    space = SearchSpace(pins=pins, max_micro_batch_size=2, max_cp=1, allow_uneven=False, zero_stages=(0, 1))
    tables = build_tables(TINY, H100, tr, space)
    legal = np.flatnonzero(tables.legal.ravel())
    assert legal.size > 10
    active = 0
    for k in legal:  # every entry: the factors are shared by shapes, and the overlap's depend on the pipeline
        plan = tables.plan(int(k))
        s, u, z = tables.unindex(int(k))
        active += a2a_overlap_active(TINY, tr, plan)
        assert tables.time_ns[s, u, z] == pytest.approx(estimate_time(TINY, H100, tr, plan).step_time_s * 1e9,
                                                        abs=1.0), plan
        peak = max(st.total_bytes for st in estimate_memory(TINY, H100, tr, plan).stages)
        assert tables.mem_kib[s, u, z].max() * KIB >= peak - KIB, plan
        assert tables.mem_kib[s, u, z].max() * KIB <= peak + KIB, plan
    assert active
    res = search(TINY, H100, tr, space)
    best, best_t, _ = exhaustive(TINY, H100, tr, space)
    assert estimate_time(TINY, H100, res.training or tr, res.best).step_time_s == pytest.approx(best_t, rel=1e-9)


@pytest.mark.parametrize("extra, says", [
    (["--pp", "2"], "needs virtual pipeline stages"),
    (["--pp", "1", "--recompute", "full"], "refuses full recomputation"),
    (["--pp", "1", "--ep", "1"], "needs expert parallelism"),
    (["--pp", "1", "--framework", "torchtitan", "--ep", "1"], "framework torchtitan does not run it"),
])
def test_estimate_refuses_the_overlap_where_megatron_does(extra, says):
    """What Megatron-Core's TransformerConfig asserts with --overlap-moe-expert-parallel-comm is a one-line error,
    exit 2, in estimate (and so in check and the search), not a prediction of a run that would not start."""
    from typer.testing import CliRunner

    from planner.cli import app

    base = ["estimate", "--model", "tiny-moe", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "32",
            "--seq-len", "1024", "--tp", "1", "--moe-a2a-overlap"]
    extra = extra if "--ep" in extra else extra + ["--ep", "4"]
    res = CliRunner().invoke(app, base + extra)
    assert res.exit_code == 2, res.output
    assert says in res.output and "Traceback" not in res.output
    ok = CliRunner().invoke(app, base + ["--pp", "1", "--ep", "8"])
    assert ok.exit_code == 0, ok.output


def test_the_overlap_extra_layer_counts_with_activation_offloading():
    """Megatron-Core allows --cpu-offloading-num-layers with the all-to-all overlap (TransformerConfig refuses neither
    with the other), and the merged step's extra forward layer is on the GPU either way: the estimate counts it with
    offloading too, as the search tables did (until 2026-12-05 the estimate left it out there, 360 of 600 table
    entries of this sweep above the estimate)."""
    hw = load_hardware("gb200-nvl72")
    tr = TrainingSpec(num_gpus=16, global_batch_size=16, seq_len=1024, moe_a2a_overlap=True)
    plan = Plan(tp=1, pp=1, dp=16, ep=8, micro_batch_size=1, zero_stage=1, recompute="none", cpu_offload_layers=1)
    off_tr = tr.model_copy(update={"moe_a2a_overlap": False})
    on, off = (estimate_memory(TINY, hw, t, plan).stages[0].activations_bytes for t in (tr, off_tr))
    dense_b, moe_b = saved_bytes_per_layer_kind(TINY, tr, plan)
    assert on - off == pytest.approx(max(dense_b, moe_b))  # one layer more, the heavier kind
    tables = build_tables(TINY, hw, tr, SearchSpace(pins=Pins(pp=1), max_micro_batch_size=4, max_cp=1))
    offloaded = 0
    for k in np.flatnonzero(tables.legal.ravel()):
        p = tables.plan(int(k))
        s, u, z = tables.unindex(int(k))
        offloaded += p.cpu_offload_layers > 0
        peak = max(st.total_bytes for st in estimate_memory(TINY, hw, tr, p).stages)
        assert abs(int(tables.mem_kib[s, u, z].max()) * KIB - peak) <= KIB, p
    assert offloaded
