"""Rank layout: groups are a partition of the ranks, TP stays inside a node, the docstring example holds."""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.layout import axis_span, group_span, groups, pp_hop_crosses_nodes, rank_grid, ranges_text, stage_ranks
from planner.specs import Plan


def _plan(tp, pp, dp, cp=1):
    return Plan(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch_size=1)


def test_worked_16_gpu_example_from_docstring():
    plan = _plan(2, 4, 2)
    assert sorted(groups(plan, "tp")) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert sorted(groups(plan, "dp")) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert sorted(groups(plan, "pp")) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert group_span(plan, "tp", 8).intra_node and group_span(plan, "dp", 8).intra_node
    assert pp_hop_crosses_nodes(plan, 8)


def test_megatron_order_string():
    plan = _plan(2, 2, 2)
    # order dp-fastest puts DP peers next to each other instead of TP peers
    assert sorted(groups(plan, "dp", order="dp-tp-cp-pp"))[0] == [0, 1]
    assert rank_grid(plan).shape == (2, 1, 2, 2)


plans = st.builds(_plan, tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 3, 4]),
                  dp=st.sampled_from([1, 2, 3, 4, 8]), cp=st.sampled_from([1, 2]))


@settings(max_examples=100, deadline=None)
@given(plans, st.sampled_from([4, 8]))
def test_every_rank_in_exactly_one_group_of_each_kind(plan, gpus_per_node):
    for axis in ("tp", "cp", "dp", "pp"):
        ranks = sorted(r for g in groups(plan, axis) for r in g)
        assert ranks == list(range(plan.world_size))


@settings(max_examples=100, deadline=None)
@given(plans, st.sampled_from([4, 8]))
def test_tp_groups_never_cross_a_node(plan, gpus_per_node):
    if plan.tp <= gpus_per_node:
        for g in groups(plan, "tp"):
            assert len({r // gpus_per_node for r in g}) == 1


@settings(max_examples=100, deadline=None)
@given(plans, st.sampled_from([2, 4, 8]))
def test_fast_span_equals_grid_span(plan, gpus_per_node):
    for axis in ("tp", "cp", "dp", "pp"):
        assert axis_span(plan, axis, gpus_per_node) == group_span(plan, axis, gpus_per_node)


def test_dp_group_mixed_when_peers_share_nodes():
    plan = _plan(2, 1, 16)  # 32 GPUs on 4 nodes: each DP group has 4 ranks on each of 4 nodes
    s = axis_span(plan, "dp", 8)
    assert (s.size, s.nodes, s.per_node, s.mixed) == (16, 4, 4, True)
    s8 = axis_span(_plan(8, 1, 4), "dp", 8)
    assert (s8.nodes, s8.per_node, s8.mixed) == (4, 1, False)


def test_stage_ranks_are_the_pp_groups_columns():
    plan = Plan(tp=2, pp=4, dp=2, cp=2, micro_batch_size=1)
    # Megatron order tp-cp-dp-pp: each stage is a contiguous block of tp x cp x dp = 8 ranks
    assert stage_ranks(plan, 1) == list(range(8, 16))
    assert ranges_text(stage_ranks(plan, 3)) == "24-31"
    # the stage of every rank agrees with its position in its pipeline group
    for group in groups(plan, "pp"):
        for stage, rank in enumerate(group):
            assert rank in stage_ranks(plan, stage)
    assert ranges_text([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


# --- the expert grid against Megatron-Core's own RankGenerator (core_v0.16.1, ../shared/consumers) ---------



@pytest.fixture(scope="module")
def rank_generator(megatron_import):
    def load():
        from megatron.core.parallel_state import RankGenerator
        return RankGenerator

    yield megatron_import(load)


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", [
    (2, 1, 64, 8, 64, 1), (2, 1, 64, 8, 32, 2), (1, 1, 16, 2, 8, 1), (4, 2, 8, 2, 8, 2), (8, 1, 8, 4, 16, 4),
    (2, 1, 16, 8, 32, 1),
])
def test_expert_span_matches_megatron_rank_generator(rank_generator, tp, cp, dp, pp, ep, etp):
    """layout.expert_span places the ETP, EP and expert-DP groups where Megatron-Core's expert rank
    generator (``initialize_model_parallel``: tp=etp, ep, dp=expert_dp, pp, cp=1, order tp-cp-ep-dp-pp) does."""
    from planner.layout import _worst, expert_span, span

    plan = Plan(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, micro_batch_size=1, sequence_parallel=tp > 1)
    gen = rank_generator(tp=etp, ep=ep, dp=plan.expert_dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for axis, token in (("etp", "tp"), ("ep", "ep"), ("edp", "dp")):
        for domain in (4, 8):
            want = _worst(span(g, domain) for g in gen.get_ranks(token))
            assert expert_span(plan, axis, domain) == want, (axis, domain)
