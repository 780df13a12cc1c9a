"""The search with EP and ETP knobs: Megatron's folding rules, pins, CP-SAT against brute force on tiny-moe,
and dense models unchanged (ep 1, no etp)."""

import pytest

from planner.candidates import Pins, SearchSpace, enumerate_plans, valid_expert
from planner.cost import estimate_time
from planner.presets import load_hardware, load_model
from planner.search import exhaustive, search
from planner.specs import TrainingSpec, plan_problems

H100 = load_hardware("h100-sxm-80gb")
TINY = load_model("tiny-moe")
DSV3 = load_model("deepseek-v3")
# a small space keeps the brute force quick: no uneven splits, two ZeRO stages, micro-batches up to 2
SMALL = dict(allow_uneven=False, zero_stages=(0, 1), max_micro_batch_size=2, max_cp=1)


def test_valid_expert_follows_megatron_folding():
    pairs = valid_expert(DSV3, H100, tp=2, cp=1, dp=64)  # etp = tp comes back as None (Megatron's default)
    assert pairs and all(256 % ep == 0 and 128 % ((etp or 2) * ep) == 0 and etp in (1, None) for ep, etp in pairs)
    assert (64, 1) in pairs and (64, None) in pairs and (128, 1) in pairs and (128, None) not in pairs
    # a pinned etp may be any divisor of the NVLink domain that divides the expert width; never past the domain
    assert {etp for _, etp in valid_expert(DSV3, H100, 2, 1, 64, Pins(etp=4))} == {4}
    assert valid_expert(DSV3, H100, 2, 1, 64, Pins(etp=16)) == []
    assert valid_expert(load_model("llama3-8b"), H100, 2, 1, 4) == [(1, None)]


def test_search_equals_brute_force_on_tiny_moe():
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024)
    space = SearchSpace(**SMALL)
    res = search(TINY, H100, tr, space)
    best, best_t, n = exhaustive(TINY, H100, tr, space)
    assert n > 100 and res.status == "OPTIMAL"
    assert estimate_time(TINY, H100, tr, res.best).step_time_s == pytest.approx(best_t, rel=1e-9)
    assert not plan_problems(TINY, H100, tr, res.best)


@pytest.mark.parametrize("framework", ["megatron", "nemo", "torchtitan", "deepspeed", "torch"])
def test_search_proposes_only_what_the_framework_runs(framework):
    """Each framework's expert rules (FrameworkProfile.allows_expert: DeepSpeed as emitted has no EP, torchtitan
    runs etp 1 under EP; allows_zero: torchtitan's EP needs its FSDP mesh unless ep divides cp x tp) bound the
    search as they bound the brute force: its best is a plan the framework runs and as fast as the brute
    force's. Before, `plan3d search --framework deepspeed` on a MoE model picked ep 8 and failed with a
    traceback when the plan was built."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024, framework=framework)
    space = SearchSpace(**(SMALL | {"zero_stages": (0, 1, 3)}))
    res = search(TINY, H100, tr, space)
    best, best_t, _ = exhaustive(TINY, H100, tr, space)
    assert res.best is not None and best is not None
    assert not plan_problems(TINY, H100, res.training or tr, res.best)
    assert estimate_time(TINY, H100, res.training or tr, res.best).step_time_s == pytest.approx(best_t, rel=1e-9)


def test_torchtitan_ep_without_fsdp_only_inside_cp_x_tp():
    """torchtitan draws EP from dp_shard x cp x tp: at ZeRO 0 (no FSDP) an ep of 2 needs cp x tp >= 2."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024, framework="torchtitan")
    for pins, legal in ((Pins(zero_stage=0, ep=2, tp=1, cp=1), False), (Pins(zero_stage=0, ep=2, tp=2), True)):
        space = SearchSpace(pins=pins, **(SMALL | {"zero_stages": (0, 1)}))
        assert (search(TINY, H100, tr, space).best is not None) is legal
        assert (exhaustive(TINY, H100, tr, space)[0] is not None) is legal


def test_pinned_ep_and_etp_are_on_the_plan():
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024)
    res = search(TINY, H100, tr, SearchSpace(pins=Pins(ep=4, etp=2), **SMALL))
    assert (res.best.ep, res.best.etp) == (4, 2)
    best, best_t, _ = exhaustive(TINY, H100, tr, SearchSpace(pins=Pins(ep=4, etp=2), **SMALL))
    assert estimate_time(TINY, H100, tr, res.best).step_time_s == pytest.approx(best_t, rel=1e-9)
    # ep must divide the 8 experts: ep 3 leaves no legal plan
    assert search(TINY, H100, tr, SearchSpace(pins=Pins(ep=3), **SMALL)).best is None


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    # Megatron-Core moe_layer.py refuses MoE + TP without SP in training; the brute force and the search agree
    tr = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=1024)
    plans = list(enumerate_plans(TINY, H100, tr, SearchSpace(pins=Pins(tp=2), **SMALL)))
    assert plans and all(p.sequence_parallel for p in plans)
    assert search(TINY, H100, tr, SearchSpace(pins=Pins(tp=2), **SMALL)).best.sequence_parallel


def test_dense_search_has_no_expert_knobs():
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=512)
    best = search(load_model("tiny-gpt"), H100, tr, SearchSpace(**SMALL)).best
    assert best.ep == 1 and best.etp is None
    assert search(load_model("tiny-gpt"), H100, tr, SearchSpace(pins=Pins(ep=2), **SMALL)).best is None


def test_moe_table_times_are_estimate_time_when_dense_layers_spill():
    """One cost model: with 3 dense-first layers and 1-layer chunks the dense layers reach ranks 1 and 2,
    so the middle stages differ; every legal table entry is still estimate_time of its plan."""
    import numpy as np

    from planner.search import build_tables
    from planner.specs import ModelSpec

    model = ModelSpec(name="spill", num_layers=8, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=512, vocab_size=512, activation="swiglu", norm="rmsnorm", num_experts=8,
                      top_k=2, moe_ffn_hidden_size=64, first_k_dense=3)
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024)
    tables = build_tables(model, H100, tr, SearchSpace(pins=Pins(pp=4), max_micro_batch_size=2, max_cp=1))
    legal = np.flatnonzero(tables.legal.ravel())
    assert legal.size > 50
    seen_spill = False
    for k in legal[:: max(1, legal.size // 60)]:
        plan = tables.plan(int(k))
        s, u, z = tables.unindex(int(k))
        seen_spill |= len(set(plan.stage_moe_layers(model)[1:-1])) > 1
        assert tables.time_ns[s, u, z] == pytest.approx(estimate_time(model, H100, tr, plan).step_time_s * 1e9,
                                                        abs=1.0), plan
    assert seen_spill


def test_table_memory_covers_every_stage_when_dense_layers_spill():
    """Dense-first layers on ranks 0-1 (8 layers, 2 dense, pp 4 x vpp 2: one layer per chunk) make the
    middle stages differ: the table's middle kind must bound the worst of them, or the search would call a
    plan that does not fit a fit (found on DeepSeek-V3, PP16 VPP2: stage 2 at 78 GiB of 73.6)."""
    import numpy as np

    from planner.memory import estimate_memory
    from planner.search import KIB, build_tables

    model = TINY.model_copy(update={"num_layers": 8, "first_k_dense": 2})
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=1024)
    tables = build_tables(model, H100, tr, SearchSpace(pins=Pins(pp=4, vpp=2), max_micro_batch_size=4))
    legal = np.flatnonzero(tables.legal.ravel())
    assert len(legal) > 0
    for k in legal:
        plan = tables.plan(int(k))
        assert plan.stage_moe_layers(model) != (2,) * 4  # the middle stages really differ
        peak = max(s.total_bytes for s in estimate_memory(model, H100, tr, plan).stages)
        s, u, z = tables.unindex(int(k))
        assert tables.mem_kib[s, u, z].max() * KIB >= peak - KIB, plan


@pytest.mark.parametrize("pattern", [(0, 1) * 4, (1, 0, 0, 1, 1, 0, 1, 1)])
def test_table_equals_estimate_and_bounds_memory_with_a_moe_layer_pattern(pattern):
    """Experts in some layers only (``moe_layer_pattern``: every other layer as Llama-4 Maverick and Megatron's
    --moe-layer-freq 2, or an irregular one): the stages differ, and every legal table entry is still
    estimate_time of its plan and bounds the peak of every stage."""
    import numpy as np

    from planner.memory import estimate_memory
    from planner.search import KIB, build_tables

    model = TINY.model_copy(update={"num_layers": 8, "first_k_dense": 0, "moe_layer_pattern": pattern})
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=1024)
    tables = build_tables(model, H100, tr, SearchSpace(pins=Pins(pp=4), max_micro_batch_size=2, max_cp=1))
    legal = np.flatnonzero(tables.legal.ravel())
    assert legal.size > 20
    for k in legal[:: max(1, legal.size // 60)]:
        plan = tables.plan(int(k))
        assert sum(plan.stage_moe_layers(model)) == sum(pattern)
        s, u, z = tables.unindex(int(k))
        assert tables.time_ns[s, u, z] == pytest.approx(estimate_time(model, H100, tr, plan).step_time_s * 1e9,
                                                        abs=1.0), plan
        peak = max(st.total_bytes for st in estimate_memory(model, H100, tr, plan).stages)
        assert tables.mem_kib[s, u, z].max() * KIB >= peak - KIB, plan
