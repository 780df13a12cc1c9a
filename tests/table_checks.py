"""A check several search tests share: a table entry of the search equals estimate_time and stage_memory of
its plan (one cost model, one memory model)."""

from __future__ import annotations

import numpy as np
import pytest


def assert_entry_is_estimate(model, hw, training, tables, key: int):
    """Table entry ``key`` (a flat index of ``tables.legal``): its step time is ``cost.estimate_time`` of its
    plan (to the nanosecond rounding) and its memory per stage kind ``memory.stage_memory``; returns the plan."""
    from planner import memory
    from planner.cost import estimate_time
    from planner.search import INFEASIBLE, KIB, _stage_rows

    plan = tables.plan(int(key))
    s, u, z = tables.unindex(int(key))
    if tables.time_ns[s, u, z] >= INFEASIBLE:  # a zero-bubble schedule is simulated only where the entry fits
        assert plan.pipeline_schedule is not None and tables.mem_kib[s, u, z].max() > tables.usable_kib, plan
    else:
        assert tables.time_ns[s, u, z] == pytest.approx(estimate_time(model, hw, training, plan).step_time_s * 1e9,
                                                        abs=1.0)
    m = training.global_batch_size // (plan.micro_batch_size * plan.dp)
    layers = plan.stage_layers(model.num_layers)
    for kind, (r, n) in enumerate(_stage_rows(tables.shapes[s][3])):
        # the middle kind is the fullest middle stage (search._memory_rows), the others their own stage
        stages = range(1, plan.pp - 1) if kind == 1 and plan.pp > 2 else [r]
        expect = max(memory.stage_memory(model, training, plan, m, q, layers[q], hw).total_bytes for q in stages)
        assert_same_kib(tables.mem_kib[s, u, z, kind], expect, (plan, r))
    return plan


def assert_same_kib(table_kib: float, expect_bytes: float, context=None) -> None:
    """A table's memory (whole KiB, rounded up) is ``expect_bytes``: the same sum, which the search adds up in
    another order (vectorised), so float rounding may move it across a KiB boundary by one part in 10^12, no more."""
    from planner.search import KIB

    low, high = np.ceil(expect_bytes / KIB * (1 - 1e-12)), np.ceil(expect_bytes / KIB * (1 + 1e-12))
    assert low <= table_kib <= high, (table_kib, expect_bytes / KIB, context)


def legal_keys(tables):
    return [int(k) for k in np.flatnonzero(tables.legal.ravel())]
