"""Pipeline schedules against the frameworks' own schedule code (issue 14, item 3).

* torch: the action lists (``pipeline_order``) that ``torch.distributed.pipelining``'s
  ``Schedule1F1B``, ``ScheduleGPipe`` and ``ScheduleInterleaved1F1B`` build, for stand-in stages
  (the schedules read only ``stage_index``, ``num_stages``, ``group_size``, ``group_rank`` at
  construction; nothing runs);
* Megatron-Core core_v0.16.1: ``get_schedule_table`` and ``get_pp_rank_microbatches`` from the
  pinned source in ``../shared/consumers`` (skipped with the reason where it is absent), with a
  stand-in ``p2p_communicator`` for the process-group queries;
* the memory model: the in-flight count the estimator charges (``memory.in_flight_chunks``) is the
  peak the action lists reach.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from planner import schedules as S
from planner.memory import in_flight_chunks
from planner.specs import Plan

GRID = [(p, v, m) for p in (2, 3, 4, 8) for v in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p + (p // 2), 4 * p)]


def _torch_order(p: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as TS

    def stage(i: int, r: int):
        return NS(stage_index=i, num_stages=p * v, group_size=p, group_rank=r, is_first=i == 0,
                  is_last=i == p * v - 1, submod=torch.nn.Identity())

    out = {}
    for r in range(p):
        if v == 1:
            sched = TS.Schedule1F1B(stage(r, r), n_microbatches=m)
        else:
            sched = TS.ScheduleInterleaved1F1B([stage(r + c * p, r) for c in range(v)], n_microbatches=m)
        kinds = {"F": "F", "B": "B"}
        out[r] = [(kinds[a.computation_type.value], a.microbatch_index, a.stage_index // p)
                  for a in sched.pipeline_order[r] if a is not None and a.computation_type.value in kinds]
    return out


def _torch_valid(p: int, v: int, m: int) -> bool:
    return v == 1 or m % max(1, m // p) == 0


# counts torch runs as flex rounds (not a multiple of p, but of max(1, m // p)); GRID's off-multiple counts are ones
# torch refuses
FLEX = [(2, 2, 3), (3, 2, 4), (3, 2, 5), (4, 2, 5), (4, 2, 6), (4, 3, 7), (4, 2, 10), (4, 2, 15), (8, 2, 12)]


@pytest.mark.parametrize("p,v,m", [g for g in GRID if _torch_valid(*g)] + FLEX)
def test_torch_family_matches_torch_pipelining_action_lists(p, v, m):
    theirs = _torch_order(p, v, m)
    for r in range(p):
        ours = S.rank_actions("torch", p, v, m, r)
        if v == 1 and r == p - 1:
            # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1
            # (``forward_mb = 0`` then ``+= 1`` before the first one when there is no warm-up); its
            # runtime (_step_microbatches) runs 0..m-1. Compare the kinds and the backwards there.
            assert [k for k, _, _ in ours] == [k for k, _, _ in theirs[r]]
            assert [a for a in ours if a[0] == "B"] == [a for a in theirs[r] if a[0] == "B"]
        else:
            assert ours == theirs[r], (p, v, m, r)
        assert S.measured_peak(theirs[r]) == S.peak_in_flight("torch", p, v, m, r)
        # what the estimator charges a torchtitan/torch stage (memory.in_flight_chunks in torch's order), also at
        # counts that are not a multiple of p (torch's flex rounds)
        plan = Plan(tp=1, pp=p, dp=1, vpp=v, micro_batch_size=1, pipeline_schedule="interleaved" if v > 1 else None)
        assert int(np.asarray(in_flight_chunks(plan, m, r, family="torch"))) == S.measured_peak(theirs[r]), (p, v, m, r)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 6)])
def test_gpipe_matches_torch(p, m):
    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as TS

    for r in range(p):
        st = NS(stage_index=r, num_stages=p, group_size=p, group_rank=r, is_first=r == 0, is_last=r == p - 1,
                submod=torch.nn.Identity())
        theirs = [(a.computation_type.value, a.microbatch_index, 0) for a in TS.ScheduleGPipe(st, n_microbatches=m)
                  .pipeline_order[r] if a is not None and a.computation_type.value in ("F", "B")]
        ours = S.rank_actions("torch", p, 1, m, r, schedule="gpipe")
        assert ours == theirs
        assert S.measured_peak(ours) == m  # GPipe holds every micro-batch


@pytest.mark.parametrize("p,v,m", [g for g in GRID if not S.interleaved_problems(*g)])
def test_memory_model_charges_the_megatron_peak(p, v, m):
    """The estimator's in-flight count is the peak of Megatron's own order, rank by rank (default group p)."""
    plan = Plan(tp=1, pp=p, dp=1, vpp=v, micro_batch_size=1)
    for r in range(p):
        peak = S.measured_peak(S.rank_actions("megatron", p, v, m, r))
        assert peak == S.peak_in_flight("megatron", p, v, m, r) == int(np.asarray(in_flight_chunks(plan, m, r)))


# --- Megatron-Core's own schedule code -------------------------------------------------------------


@pytest.mark.parametrize("p,v,m,group", [(2, 2, 4, None), (4, 2, 8, None), (4, 3, 12, None), (4, 2, 10, 10),
                                         (4, 2, 12, 6), (8, 2, 16, None), (8, 4, 24, 12), (4, 4, 9, 9),
                                         # Meta's Llama 3 405B (benchmarks/meta_405b.py): PP 16 x VP 8, 32 and
                                         # 16 micro-batches per DP rank, N = 16 or 32
                                         (16, 8, 32, None), (16, 8, 32, 32), (16, 8, 16, None)])
def test_megatron_family_matches_megatron_core(megatron_schedules, p, v, m, group):
    MS = megatron_schedules
    n = group or p
    assert S.interleaved_problems(p, v, m, group) == []
    table = MS.get_schedule_table(m, v, n)
    for r in range(p):
        comm = NS(pp_group=NS(size=lambda: p, rank=lambda r=r: r), virtual_pipeline_model_parallel_size=v)
        total, _, warmup, _ = MS.get_pp_rank_microbatches(m, v, n, p2p_communicator=comm)
        assert total == m * v
        assert warmup == S.warmup_forwards("megatron", p, v, m, r, group)
        ours = S.rank_actions("megatron", p, v, m, r, group)
        assert [(mb, c) for k, mb, c in ours if k == "F"] == list(table)
        assert [(mb, c) for k, mb, c in ours if k == "B"] == [(mb, v - 1 - c) for mb, c in table]


def test_interleaved_problems_follow_megatron():
    assert S.interleaved_problems(4, 2, 8) == []
    assert ">= pp(4)" in S.interleaved_problems(4, 2, 3)[0]             # m < p
    assert "divisible by pp(4)" in S.interleaved_problems(4, 2, 10)[0]  # default N = 4 leaves 2 < p
    assert "must lie in" in S.interleaved_problems(4, 2, 10, group=3)[0]
    assert "neither 0 nor" in S.interleaved_problems(4, 2, 10, group=4)[0]
    assert S.interleaved_problems(4, 2, 10, group=10) == []             # Meta's tunable N
    assert S.interleaved_problems(4, 2, 14, group=5) == []              # remainder 4 >= p
    assert S.peak_in_flight("megatron", 4, 2, 10, 0, group=10) == 2 * 3 + 10 + 1
    plan = Plan(tp=1, pp=4, dp=1, vpp=2, micro_batch_size=1, microbatch_group_size=10)
    assert int(np.asarray(in_flight_chunks(plan, 10, 0))) == 2 * 3 + 10 + 1  # the estimator uses N


def test_torch_interleaved_counts_off_the_pp_multiple_are_counted_in_torchs_order():
    """torch's ScheduleInterleaved1F1B also runs micro-batch counts that are not a multiple of pp (flex rounds of
    m // max(1, m // pp) micro-batches, when m is a multiple of max(1, m // pp)). Its order then holds more chunks
    in flight than Megatron's order with its default N = pp (p 2, v 2, m 3: 6 on rank 0 against 5): the torchtitan
    and torch profiles are charged torch's count, Megatron keeps its own, and only the counts torch itself
    refuses are refused. At multiples of pp the two orders hold the same peak on every rank."""
    plan = Plan(tp=1, pp=2, dp=1, vpp=2, micro_batch_size=1, pipeline_schedule="interleaved")
    assert int(np.asarray(in_flight_chunks(plan, 3, 0, family="torch"))) == 6
    assert int(np.asarray(in_flight_chunks(plan, 3, 0))) == 5  # Megatron's order, N = pp
    for fw in ("torchtitan", "torch"):
        assert S.schedule_problems("interleaved", fw, 2, 2, 3) == []
        assert S.schedule_problems("interleaved", fw, 2, 2, 4) == []
        assert "multiple of max(1, m // pp) = 2" in S.schedule_problems("interleaved", fw, 4, 2, 9)[0]
    assert S.schedule_problems("interleaved", "megatron", 2, 2, 3) == S.interleaved_problems(2, 2, 3) != []
    for p in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p, 4 * p):
                plan = Plan(tp=1, pp=p, dp=1, vpp=v, micro_batch_size=1)
                for r in range(p):
                    assert S.peak_in_flight("torch", p, v, m, r) == int(np.asarray(in_flight_chunks(plan, m, r)))
                    assert int(np.asarray(in_flight_chunks(plan, m, r, family="torch"))) == \
                        int(np.asarray(in_flight_chunks(plan, m, r)))