"""alpha-beta collective costs, checked against hand-computed values."""

import pytest

from planner import comm
from planner.layout import GroupSpan
from planner.presets import load_hardware

HW = load_hardware("a100-80gb")  # intra 230 GB/s, 1.5 us; inter 24 GB/s, 5 us


def test_bus_factors_as_nccl_tests():
    assert comm.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert comm.bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert comm.bus_factor("all_gather", 4) == pytest.approx(3 / 4)


def test_ring_all_reduce_hand_computed():
    # 1 GB over 8 ranks at 230 GB/s: 14 steps x 1.5 us + 1.75 x 1e9 / 230e9 s
    t = comm.ring_time_s("all_reduce", 1e9, 8, 230.0, 1.5)
    assert t == pytest.approx(14 * 1.5e-6 + 1.75 / 230)


def test_single_rank_costs_nothing():
    assert comm.collective_time_s("all_reduce", 1e9, GroupSpan(1, 1, 1), HW) == 0.0


def test_inter_node_one_rank_per_node_uses_network():
    t = comm.collective_time_s("all_reduce", 1e9, GroupSpan(size=4, nodes=4, per_node=1), HW)
    assert t == pytest.approx(6 * 5e-6 + 1.5 * 1e9 / 24e9)


def test_hierarchical_all_reduce_for_mixed_group():
    g = GroupSpan(size=16, nodes=4, per_node=4)
    rs = comm.ring_time_s("reduce_scatter", 1e9, 4, 230.0, 1.5)
    ar = comm.ring_time_s("all_reduce", 1e9 / 4, 4, 24.0, 5.0)
    ag = comm.ring_time_s("all_gather", 1e9, 4, 230.0, 1.5)
    assert comm.collective_time_s("all_reduce", 1e9, g, HW) == pytest.approx(rs + ar + ag)
    # and it beats a flat ring over the network
    assert comm.collective_time_s("all_reduce", 1e9, g, HW) < comm.ring_time_s("all_reduce", 1e9, 16, 24.0, 5.0)


def test_p2p():
    assert comm.p2p_time_s(24e6, True, HW) == pytest.approx(5e-6 + 1e-3)
    assert comm.p2p_time_s(0, True, HW) == 0.0
