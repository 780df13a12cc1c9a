"""Pipeline schedules as the frameworks run them: the order of forward and backward actions on each
pipeline rank, and what that order implies (activations in flight at the peak, the bubble).

Two families, each written after the framework's own code so that tests can compare action for
action:

* **Megatron-Core** (``megatron/core/pipeline_parallel/schedules.py``, core_v0.16.1):
  ``forward_backward_pipelining_without_interleaving`` (1F1B: ``p - r - 1`` warm-up forwards) and
  ``forward_backward_pipelining_with_interleaving``, whose order is ``get_schedule_table`` over groups
  of ``N`` micro-batches (``--microbatch-group-size-per-virtual-pipeline-stage``, default ``p``) with
  ``2 (p - r - 1) + (v - 1) N`` warm-up chunk forwards (``get_pp_rank_microbatches``);
* **torch.distributed.pipelining** (``schedules.py``, torch 2.13): ``Schedule1F1B``, ``ScheduleGPipe``
  and ``ScheduleInterleaved1F1B``, which splits ``m`` micro-batches into ``max(1, m // p)`` rounds and
  warms up ``(v - 1) * (m / rounds) + 2 (p - 1 - r)`` chunk forwards (``_get_warmup_ops``).

An action is ``(kind, microbatch, chunk)`` with kind ``"F"`` or ``"B"`` and ``chunk`` the local
virtual stage (0 .. v-1); rank ``r``'s chunk ``c`` is the global virtual stage ``c * p + r``.
"""

from __future__ import annotations

from typing import Literal

Action = tuple[str, int, int]
Family = Literal["megatron", "torch"]


def megatron_group_size(p: int, m: int, group: int | None = None) -> int:
    """N: micro-batches per group of the interleaved schedule; Megatron's default is ``p``."""
    return p if group is None else group


def torch_group_size(p: int, m: int) -> int:
    """torch's ``microbatches_per_round``: ``m // max(1, m // p)`` (``ScheduleInterleaved1F1B.__init__``)."""
    return m // max(1, m // p)


def warmup_forwards(family: Family, p: int, v: int, m: int, r: int, group: int | None = None) -> int:
    """Chunk forwards rank ``r`` runs before its first backward, capped at ``m * v``.

    1F1B (v = 1): ``p - r - 1`` in both (Megatron ``get_pp_rank_microbatches``; torch
    ``Schedule1F1B._get_pipeline_order``). Interleaved: ``2 (p - r - 1) + (v - 1) N`` with ``N`` the
    group size (Megatron) or the micro-batches per round (torch ``_get_warmup_ops``).
    """
    if v == 1:
        return min(m, p - r - 1)
    n = megatron_group_size(p, m, group) if family == "megatron" else torch_group_size(p, m)
    return min(m * v, 2 * (p - r - 1) + (v - 1) * n)


def peak_in_flight(family: Family, p: int, v: int, m: int, r: int, group: int | None = None) -> int:
    """Chunk-micro-batches whose activations rank ``r`` holds at its peak: the warm-up forwards plus the
    one forward of the first 1F1B pair, at most all ``m * v`` (both families run F before B in a pair)."""
    return min(m * v, warmup_forwards(family, p, v, m, r, group) + 1)


def _interleaved_units(family: Family, p: int, v: int, m: int, group: int | None) -> tuple[list, list]:
    """The (micro-batch, chunk) sequence of forwards and of backwards on one rank."""
    if family == "megatron":
        n = megatron_group_size(p, m, group)
        table: list[tuple[int, int]] = []
        for start in range(0, m, n):  # Megatron get_schedule_table
            stop = m if start + n >= m else start + n
            table += [(mb, c) for c in range(v) for mb in range(start, stop)]
        fwd = table
        bwd = [(mb, v - 1 - c) for mb, c in table]
        return fwd, bwd
    n = torch_group_size(p, m)  # torch forward_stage_index / backward_stage_index, per-chunk counters
    seen_f: dict[int, int] = {}
    seen_b: dict[int, int] = {}
    fwd, bwd = [], []
    for step in range(m * v):
        c = (step // n) % v
        fwd.append((seen_f.get(c, 0), c))
        seen_f[c] = seen_f.get(c, 0) + 1
    for step in range(m * v):
        c = v - 1 - (step // n) % v
        bwd.append((seen_b.get(c, 0), c))
        seen_b[c] = seen_b.get(c, 0) + 1
    return fwd, bwd


def rank_actions(family: Family, p: int, v: int, m: int, r: int, group: int | None = None,
                 schedule: str = "1f1b") -> list[Action]:
    """The actions of pipeline rank ``r`` in execution order (idle slots left out).

    ``schedule`` is ``"1f1b"`` (interleaved when ``v > 1``) or ``"gpipe"`` (all forwards, then all
    backwards; torch ``ScheduleGPipe``).
    """
    if schedule == "gpipe":
        if v != 1:
            raise ValueError("gpipe runs one stage per rank (v = 1)")
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if v == 1:
        fwd = [(i, 0) for i in range(m)]
        bwd = [(i, 0) for i in range(m)]
    else:
        fwd, bwd = _interleaved_units(family, p, v, m, group)
    total = m * v
    warmup = warmup_forwards(family, p, v, m, r, group)
    order: list[Action] = [("F", *fwd[i]) for i in range(warmup)]
    f, b = warmup, 0
    while f < total:
        order.append(("F", *fwd[f]))
        f += 1
        order.append(("B", *bwd[b]))
        b += 1
    order += [("B", *bwd[i]) for i in range(b, total)]
    return order


def measured_peak(actions: list[Action]) -> int:
    """The most forwards whose backward has not run yet, walking ``actions`` in order."""
    live = peak = 0
    for kind, _, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def interleaved_problems(p: int, v: int, m: int, group: int | None = None) -> list[str]:
    """Megatron-Core's checks on an interleaved schedule (``forward_backward_pipelining_with_interleaving``):
    ``p <= N <= m``, and the last group either full or at least ``p`` micro-batches."""
    if v == 1:
        return []
    n = megatron_group_size(p, m, group)
    errors = []
    if group is None and (m < p or m % p):
        errors.append(f"vpp: the interleaved schedule with the default micro-batch group (pp = {p}) needs "
                      f"num_microbatches({m}) divisible by pp({p}) and at least pp; set microbatch_group_size "
                      f"(Megatron --microbatch-group-size-per-virtual-pipeline-stage) to {m} to run it")
        if m < p:
            errors[-1] = (f"vpp: the interleaved schedule needs num_microbatches({m}) >= pp({p}) "
                          "(Megatron-Core forward_backward_pipelining_with_interleaving)")
    elif not p <= n <= m:
        errors.append(f"microbatch_group_size: {n} must lie in [pp({p}), num_microbatches({m})] "
                      "(Megatron --microbatch-group-size-per-virtual-pipeline-stage)")
    elif 0 < m % n < p:
        errors.append(f"microbatch_group_size: num_microbatches({m}) % {n} = {m % n} is neither 0 nor >= pp({p}); "
                      f"choose a group size that divides {m}, or {m} itself")
    return errors
