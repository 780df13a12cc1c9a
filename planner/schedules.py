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

A third family, torch's split-backward schedules (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, and DeepSpeed's ``DualPipeVSchedule``), adds kinds
``"I"`` and ``"W"`` (:func:`schedule_actions`); on top of the action lists sit a step simulator
(:func:`simulate`, :func:`bubble_s`), in-flight peaks (:func:`peak_in_flight_of`, closed forms in
:func:`peak_in_flight`) and which framework runs what (:func:`schedule_problems`). docs/schedules.md.
"""

from __future__ import annotations

import functools
from typing import Literal

Action = tuple[str, int, int]
Family = Literal["megatron", "torch", "deepspeed"]


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


def peak_in_flight_1f1b(family: Family, p: int, v: int, m: int, r: int, group: int | None = None) -> int:
    """Chunk-micro-batches whose activations rank ``r`` holds at its peak: the warm-up forwards plus the
    one forward of the first 1F1B pair, at most all ``m * v`` (both families run F before B in a pair)."""
    return min(m * v, warmup_forwards(family, p, v, m, r, group) + 1)  # also peak_in_flight(family, ...)


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


# --- torch's zero-bubble family and DualPipe-V ------------------------------------------------------
# Actions here use four kinds: "F" forward, "I" input-gradient backward (torch BACKWARD_INPUT, the
# zero-bubble paper's "B"), "W" weight-gradient backward (BACKWARD_WEIGHT), and "B" a full backward
# (I and W in one call, torch FULL_BACKWARD). ``chunk`` is the local stage; ``stage_index`` maps it to
# the global stage for the schedule's placement.

SCHEDULES = ("1f1b", "interleaved", "interleaved_zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


def stage_index(schedule: str, p: int, r: int, chunk: int) -> int:
    """Global stage of rank ``r``'s local ``chunk``.

    Looped placement (1F1B, interleaved, interleaved_zb): ``chunk * p + r`` (torch
    ``generate_stage_to_rank_mapping(style="loop")``, Megatron's virtual pipeline). V placement (zbv,
    dualpipev): rank ``r`` holds stages ``r`` and ``2p - 1 - r`` (torch ``style="v"``), so the first and
    the last stage sit on rank 0 and the turn (stages ``p - 1`` and ``p``) on rank ``p - 1``.
    """
    if schedule in V_SHAPED:
        return r if chunk == 0 else 2 * p - 1 - r
    return chunk * p + r


def _interleaved_zb_actions(p: int, v: int, m: int, r: int) -> list[Action]:
    """torch 2.13 ``ScheduleInterleavedZeroBubble._calculate_single_rank_operations`` (ZB1P of Qi et al.
    2024, arXiv:2401.10241, generalised to ``v`` looped chunks): ``_get_warmup_ops`` with
    ``multiply_factor=1`` warms up ``(v - 1) N + (p - 1 - r)`` chunk forwards (``N`` micro-batches per
    round); then F-I pairs, rank ``r`` deferring its first ``r`` weight backwards
    (``num_1f1b_microbatches = rank``) and running one W (oldest first) after every later I; the
    deferred W's run last (``_get_1f1b_rank_ops(enable_zero_bubble=True)``)."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"interleaved_zb: num_microbatches({m}) must be a multiple of the number of rounds "
                         f"max(1, m // pp) = {rounds} (torch ScheduleInterleavedZeroBubble)")
    n = m // rounds
    warmup = min((v - 1) * n + (p - 1 - r), m * v)
    total = m * v

    def fwd_chunk(op: int) -> int:
        return (op // n) % v

    def bwd_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // n) % v

    count: dict[tuple[str, int], int] = {}

    def act(kind: str, c: int) -> Action:
        mb = count.get((kind, c), 0)
        count[(kind, c)] = mb + 1
        return (kind, mb, c)

    order: list[Action] = []
    backs: list[int] = []  # chunk of each I, in order: W follows the same order
    w_done = 0
    for op in range(total + warmup):  # warm-up + steady (m v - warmup) + cool-down (warmup) = m v + warmup
        if op < warmup:
            order.append(act("F", fwd_chunk(op)))
            continue
        if op < total:
            order.append(act("F", fwd_chunk(op)))
        order.append(act("I", bwd_chunk(op)))
        backs.append(bwd_chunk(op))
        if op - warmup >= r:
            order.append(act("W", backs[w_done]))
            w_done += 1
    while w_done < len(backs):
        order.append(act("W", backs[w_done]))
        w_done += 1
    return order


def _zbv_actions(p: int, m: int, r: int) -> list[Action]:
    """torch 2.13 ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (ZB-V, Qi et al. 2024
    arXiv:2401.10241 v2 section 6): two chunks in a V; warm-up ``2(p - r) - 1`` chunk-0 forwards, ``r``
    (F1, F0) pairs, ``p - r`` (F1 I1 W1) triples; steady (F0 I0 W0 F1 I1 W1); cool-down ``r`` (I0 I1)
    pairs, ``p - r`` (I0 W0) pairs, then the remaining W1's and W0's. torch plans with
    ``max(2p - 1, m)`` micro-batches and drops the actions of those ``>= m``."""
    n = max(2 * p - 1, m)
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - r) - 1):
        out.append(("F", f0, 0)); f0 += 1
    for _ in range(r):
        out.append(("F", f1, 1)); f1 += 1
        out.append(("F", f0, 0)); f0 += 1
    for _ in range(p - r):
        out += [("F", f1, 1), ("I", b1, 1), ("W", b1, 1)]; f1 += 1; b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(("F", f0, 0)); f0 += 1
        out += [("I", b0, 0), ("W", b0, 0)]; b0 += 1
        out += [("F", f1, 1), ("I", b1, 1), ("W", b1, 1)]; f1 += 1; b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [("I", b0, 0), ("I", b1, 1)]; b0 += 1; b1 += 1
    for _ in range(p - r):
        out += [("I", b0, 0), ("W", w0, 0)]; b0 += 1; w0 += 1
    out += [("W", i, 1) for i in range(w1, b1)] + [("W", i, 0) for i in range(w0, b0)]
    return [a for a in out if a[1] < m]


def _dualpipev_actions(p: int, m: int, r: int) -> list[Action]:
    """torch 2.13 ``ScheduleDualPipeV._calculate_single_rank_operations`` (after DeepSeek's DualPipeV,
    https://github.com/deepseek-ai/DualPipe; DualPipe in DeepSeek-V3 report arXiv:2412.19437 section
    3.2.1). Chunk 0 is stage ``r``, chunk 1 stage ``2p - 1 - r``. Steps: ``2(p - r - 1)`` F0; ``r + 1``
    (F0 F1); ``p - r - 1`` (I1 W F1); ``m - 2p + r + 1`` overlapped pairs (F0+B1, F1+B0); ``p - r - 1``
    (B1, F1+B0); ``r + 1`` (B1 B0) switching to I for the second half; ``p - r - 1`` (W B0); ``r + 1`` W.
    W's come from a queue of earlier I's, oldest first. torch runs an overlapped pair (OVERLAP_F_B) as
    its forward then its backward (``_PipelineScheduleRuntime._step_microbatches``), so the pair is
    written as those two actions. Needs ``m >= 2p``."""
    if m < 2 * p:
        raise ValueError(f"dualpipev: num_microbatches({m}) must be at least the number of stages 2*pp = {2 * p} "
                         "(torch ScheduleDualPipeV)")
    out: list[Action] = []
    cnt: dict[tuple[str, int], int] = {}
    wq: list[tuple[int, int]] = []

    def add(kind: str, c: int) -> None:
        key = ("I" if kind == "B" else kind, c)
        mb = cnt.get(key, 0)
        cnt[key] = mb + 1
        out.append((kind, mb, c))
        if kind == "I":
            wq.append((mb, c))

    def pending_w() -> None:
        if wq:
            mb, c = wq.pop(0)
            out.append(("W", mb, c))

    for _ in range(2 * (p - r - 1)):
        add("F", 0)
    for _ in range(r + 1):
        add("F", 0); add("F", 1)
    for _ in range(p - r - 1):
        add("I", 1); pending_w(); add("F", 1)
    for _ in range(m - 2 * p + r + 1):
        add("F", 0); add("B", 1)  # rank p-1's first pair is not overlapped in torch; same order either way
        add("F", 1); add("B", 0)
    for _ in range(p - r - 1):
        add("B", 1)
        add("F", 1); add("B", 0)
    zb = False
    steps6 = r + 1
    for i in range(steps6):
        if i == steps6 // 2 and r % 2 == 1:
            zb = True
        add("I" if zb else "B", 1)
        if i == steps6 // 2 and r % 2 == 0:
            zb = True
        add("I" if zb else "B", 0)
    for _ in range(p - r - 1):
        pending_w(); add("I" if zb else "B", 0)
    for _ in range(r + 1):
        pending_w()
    return out


def schedule_actions(schedule: str, p: int, m: int, r: int, v: int | None = None, family: Family = "torch",
                     group: int | None = None) -> list[Action]:
    """Rank ``r``'s actions for one of :data:`SCHEDULES`, in execution order (idle slots left out).

    ``v`` (chunks per rank) is 1 for 1f1b, 2 for zbv and dualpipev, and the virtual-pipeline size for
    interleaved and interleaved_zb. ``family`` and ``group`` choose Megatron's or torch's order for
    1f1b and interleaved (:func:`rank_actions`); the zero-bubble schedules are torch's, DualPipe-V is
    torch's or (``family="deepspeed"``) DeepSpeed's, which has no split backward.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not 0 <= r < p:
        raise ValueError(f"rank: {r} must lie in [0, pp({p}))")
    if family == "deepspeed" and schedule != "dualpipev":
        raise ValueError(f"schedule: DeepSpeed's pipeline engine runs {schedule!r} as its own TrainSchedule, "
                         "not modelled here; only dualpipev has a DeepSpeed order")
    if schedule == "1f1b":
        return rank_actions(family, p, 1, m, r, group)
    if schedule == "interleaved":
        return rank_actions(family, p, v or 2, m, r, group)
    if schedule == "interleaved_zb":
        return _interleaved_zb_actions(p, v or 1, m, r)
    if v not in (None, 2):
        raise ValueError(f"{schedule}: runs exactly 2 chunks per rank (got vpp = {v}; torch raises the same)")
    if schedule == "zbv":
        return _zbv_actions(p, m, r)
    acts = _dualpipev_actions(p, m, r)
    if family == "deepspeed":
        # DeepSpeed's DualPipeVSchedule (deepspeed/runtime/pipe/schedule.py, 0.19.8) runs the same steps
        # but "keeps [weight gradients] inside BackwardPass": every I is a full backward, every W a no-op.
        acts = [("B", mb, c) if k == "I" else (k, mb, c) for k, mb, c in acts if k != "W"]
    return acts


def chunks_per_rank(schedule: str, v: int | None) -> int:
    """Local chunks of one rank: 2 for the V schedules, ``v`` (default 1 for 1f1b/interleaved_zb, 2 for
    interleaved) otherwise."""
    if schedule in V_SHAPED:
        return 2
    if schedule == "1f1b":
        return 1
    return v or (2 if schedule == "interleaved" else 1)


def in_flight_trace(actions: list[Action]) -> list[tuple[int, int]]:
    """After each action: (chunks whose forward has run and whose input backward (I or B) has not,
    chunks whose I has run and whose W has not).

    The first count holds a chunk's whole saved activations. The second holds what the weight gradient
    still needs: the inputs of the chunk's weight GEMMs (torch ``stage_backward_input`` keeps the
    autograd nodes between the stage input and the weights alive in ``param_groups`` until
    ``stage_backward_weight``; Qi et al. 2024 Table 1 counts W's memory as the GEMM inputs only)."""
    full = pend = 0
    out = []
    for kind, _, _ in actions:
        if kind == "F":
            full += 1
        elif kind == "B":
            full -= 1
        elif kind == "I":
            full -= 1
            pend += 1
        elif kind == "W":
            pend -= 1
        out.append((full, pend))
    return out


def peak_in_flight_actions(actions: list[Action], w_fraction: float = 0.0) -> float:
    """The most ``full + w_fraction * pending_w`` over the action list (:func:`in_flight_trace`);
    ``w_fraction`` is the share of a chunk's saved activations that a pending W keeps alive."""
    return max((f + w_fraction * w for f, w in in_flight_trace(actions)), default=0)


def peak_in_flight_layers(actions: list[Action], chunk_layers: tuple[int, ...] | list[int],
                          w_fraction: float = 0.0) -> float:
    """The most transformer layers' saved activations held at once walking ``actions``: each chunk
    between its F and its I/B holds ``chunk_layers[chunk]`` layers, one waiting for its W
    ``w_fraction`` of them (:func:`in_flight_trace`, weighted by chunk). With equal chunks it is
    :func:`peak_in_flight_actions` x the chunk's layers; it differs where a chunk holds no layer (rank 0's
    embedding chunk, the last rank's loss chunk: ``specs.min_stage_layers``), which is in flight but
    holds nothing."""
    full = pend = peak = 0.0
    for kind, _, c in actions:
        n = chunk_layers[c]
        if kind == "F":
            full += n
        elif kind == "B":
            full -= n
        elif kind == "I":
            full -= n
            pend += n
        elif kind == "W":
            pend -= n
        peak = max(peak, full + w_fraction * pend)
    return peak


# What a pending W keeps alive, as a share of the chunk's saved activations, per runtime.
TORCH_W_FRACTION = 1.0
"""torch.distributed.pipelining (2.13): ``stage_backward_input`` runs autograd with ``retain_graph=True``
and holds the nodes leading to the weights in ``param_groups`` until ``stage_backward_weight``, and those
nodes reach the whole chunk graph: every saved tensor stays alive until W. Measured on gloo in
tests/test_schedules_zb.py::test_saved_activation_peak_matches_torch (the peaks differ from
``w_fraction = 0`` there)."""


def peak_in_flight_of(schedule: str, p: int, v: int | None, m: int, r: int, w_fraction: float = 0.0,
                      family: Family = "torch", group: int | None = None) -> float:
    """Peak in-flight chunk-micro-batches on rank ``r`` under ``schedule``, from its action list: a chunk
    whose forward has run and whose input backward (I or B) has not counts 1, one waiting for its W
    counts ``w_fraction`` (:func:`in_flight_trace`). ``w_fraction = 0`` is the count of full activations
    (Qi et al. 2024 Table 1 keeps only the weight-GEMM inputs for W); torch's runtime keeps all of them
    (:data:`TORCH_W_FRACTION`). A chunk is ``layers / (p * chunks_per_rank)`` layers."""
    return peak_in_flight_actions(schedule_actions(schedule, p, m, r, v, family, group), w_fraction)


# --- a discrete-event simulator of one pipeline step ------------------------------------------------
Durations = float | list[float] | tuple[float, ...]


def _per_stage(x: Durations, stage: int) -> float:
    return float(x) if isinstance(x, (int, float)) else float(x[stage])


def simulate(schedule: str, p: int, m: int, f_s: Durations, i_s: Durations, w_s: Durations, hop_s: float = 0.0,
             v: int | None = None, family: Family = "torch", group: int | None = None) -> dict:
    """Run the per-rank action lists of ``schedule`` against each other and time one step.

    Each rank runs its actions in list order (torch's ``_PipelineScheduleRuntime`` and Megatron's
    schedules do; neither reorders), each action as soon as the rank is free and its inputs are there:

    * F of stage ``s`` for micro-batch ``k`` after F of stage ``s - 1`` for ``k``;
    * I (or a full backward B) of stage ``s`` after I/B of stage ``s + 1`` for ``k``; on the last stage
      after its own F (the loss);
    * W of stage ``s`` after I of stage ``s`` for ``k``;
    * ``hop_s`` added where the producer is on another rank (one P2P transfer; V placements keep the turn
      at stages ``p - 1``/``p`` on one rank, so it costs nothing there). Transfers do not occupy the
      compute stream (torch posts them as async ``batch_isend_irecv``).

    Durations are per chunk and per micro-batch: a scalar, or one value per global stage (uneven
    layouts). A full backward B lasts ``i_s + w_s``; DualPipe-V's overlapped F+B pairs are timed as F
    then B, as torch runs them.

    Returns ``step_s`` (the last action's end; all ranks start at 0 and the optimizer step waits for all,
    as torchtitan's and Megatron's cross-stage gradient-norm reduction does), ``work_s`` per rank,
    ``bubble_s = step_s - max(work_s)`` (Narayanan et al. 2021, arXiv:2104.04473 section 2.2: the time the
    busiest rank is idle within the step), and ``span_idle_s`` per rank: idle time between the rank's
    first action's start and its last action's end (the bubble as Qi et al. 2024 count it, where
    optimizer post-validation, "bypassing optimizer synchronizations", lets each rank start the next step
    on its own).

    Results are cached on the arguments (a search asks the same schedule many times; one call is
    about 0.1 s at p = 16, m = 512).
    """
    def key(x: Durations):
        return float(x) if isinstance(x, (int, float)) else tuple(float(e) for e in x)

    res = _simulate(schedule, p, m, key(f_s), key(i_s), key(w_s), float(hop_s), v, family, group)
    return {k: list(val) if isinstance(val, tuple) else val for k, val in res.items()}


@functools.lru_cache(maxsize=4096)
def action_program(schedule: str, p: int, m: int, v: int | None = None, family: Family = "torch",
                   group: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The per-rank action lists of ``schedule`` as one fixed program, in an order where every action's
    input comes first (the rules of :func:`simulate`): per action its kind (0 F, 1 I, 2 W, 3 B), global
    stage, rank, the action it waits for (-1: none) and the one before it on its rank (-1: none); and
    each rank's last action. The order and the dependencies do not depend on the durations, so one
    program times any durations (:func:`simulate`, and ``cost.simulated_bubble_s`` on arrays)."""
    nv = chunks_per_rank(schedule, v)
    n_stages = p * nv
    acts = [schedule_actions(schedule, p, m, r, v, family, group) for r in range(p)]
    # each action as (kind 0-3, its stage, the key it waits for or -1, the key(s) it completes), a key being
    # (kind F 0 / I 1 / W 2) * stride + stage * m + micro-batch, so the lookups below index a list
    stride = n_stages * m
    code = {"F": 0, "I": 1, "W": 2, "B": 3}
    coded = []
    for r in range(p):
        at = [stage_index(schedule, p, r, c) for c in range(nv)]
        rank_coded = []
        for kind, mb, c in acts[r]:
            s = at[c]
            k = code[kind]
            if k == 0:
                dep = (s - 1) * m + mb if s > 0 else -1
            elif k == 2:
                dep = stride + s * m + mb
            else:  # I or B: the next stage's I, or the loss stage's own F
                dep = stride + (s + 1) * m + mb if s < n_stages - 1 else s * m + mb
            own = k * stride + s * m + mb if k < 3 else stride + s * m + mb
            rank_coded.append((k, s, dep, own))
        coded.append(rank_coded)
    ptr, last = [0] * p, [-1] * p
    done = [-1] * (3 * stride)  # key -> action index (-1: not yet listed)
    kinds, stages, ranks, deps, prevs = [], [], [], [], []
    add_kind, add_stage, add_rank, add_dep, add_prev = (kinds.append, stages.append, ranks.append, deps.append,
                                                       prevs.append)
    idx = 0
    remaining = sum(len(a) for a in acts)
    while remaining:
        progressed = False
        for r in range(p):
            rank_coded, i, n_r, q = coded[r], ptr[r], len(coded[r]), last[r]
            first = i
            while i < n_r:
                k, s, dep, own = rank_coded[i]
                if dep >= 0:
                    waited = done[dep]
                    if waited < 0:
                        break
                else:
                    waited = -1
                add_kind(k)
                add_stage(s)
                add_rank(r)
                add_dep(waited)
                add_prev(q)
                q = idx
                done[own] = idx
                if k == 3:  # a full backward is both I and W
                    done[own + stride] = idx
                idx += 1
                i += 1
            if i > first:
                last[r] = q
                remaining -= i - first
                ptr[r] = i
                progressed = True
        if not progressed:
            stuck = {r: acts[r][ptr[r]] for r in range(p) if ptr[r] < len(acts[r])}
            raise ValueError(f"{schedule}: the action lists deadlock at {stuck}")
    return tuple(kinds), tuple(stages), tuple(ranks), tuple(deps), tuple(prevs), tuple(last)


@functools.lru_cache(maxsize=4096)
def _simulate(schedule: str, p: int, m: int, f_s: Durations, i_s: Durations, w_s: Durations, hop_s: float,
              v: int | None, family: Family, group: int | None) -> dict:
    """The body of :func:`simulate` on hashable arguments: :func:`action_program` timed."""
    kinds, stages, ranks, deps, prevs, last = action_program(schedule, p, m, v, family, group)
    end = [0.0] * len(kinds)
    first: list[float | None] = [None] * p
    work = [0.0] * p
    for a, (k, s, r, d, q) in enumerate(zip(kinds, stages, ranks, deps, prevs)):
        if k == 0:
            dur = _per_stage(f_s, s)
        elif k == 2:
            dur = _per_stage(w_s, s)
        else:  # I, or a full backward B = I + W
            dur = _per_stage(i_s, s) + (_per_stage(w_s, s) if k == 3 else 0.0)
        ready = 0.0 if d < 0 else end[d] + (hop_s if ranks[d] != r else 0.0)
        start = max(end[q] if q >= 0 else 0.0, ready)
        end[a] = start + dur
        if first[r] is None:
            first[r] = start
        work[r] += dur
    clock = [end[a] if a >= 0 else 0.0 for a in last]
    step = max(clock)
    return {"step_s": step, "work_s": tuple(work), "bubble_s": step - max(work),
            "span_idle_s": tuple(clock[r] - (first[r] or 0.0) - work[r] for r in range(p))}


def bubble_s(schedule: str, p: int, v: int | None, m: int, f_s: Durations, i_s: Durations, w_s: Durations,
             hop_s: float = 0.0, family: Family = "torch", group: int | None = None) -> float:
    """Pipeline bubble of one step (seconds): step time minus the busiest rank's compute, from
    :func:`simulate` (per-chunk, per-micro-batch durations ``f_s``, ``i_s``, ``w_s``; ``hop_s`` per P2P).

    Checked in tests/test_schedules_zb.py against the closed forms: 1F1B ``(p - 1)(F + B)`` and
    interleaved ``(p - 1)(F + B) / v`` per whole-stage times (Narayanan et al. 2021, arXiv:2104.04473
    section 2.2), ZB-H1 ``(p - 1)(T_F + T_B - T_W)`` (Qi et al. 2024, arXiv:2401.10241 section 2.1),
    DeepSeek-V3's ZB1P row ``(PP - 1)(F + B - 2W)`` with B a full backward (arXiv:2412.19437 Table 2).
    """
    return simulate(schedule, p, m, f_s, i_s, w_s, hop_s, v, family, group)["bubble_s"]


def step_s(schedule: str, p: int, v: int | None, m: int, f_s: Durations, i_s: Durations, w_s: Durations,
           hop_s: float = 0.0, family: Family = "torch", group: int | None = None) -> float:
    """Time of one pipeline step (seconds), from :func:`simulate`."""
    return simulate(schedule, p, m, f_s, i_s, w_s, hop_s, v, family, group)["step_s"]



def peak_in_flight(schedule_or_family: str, p: int, v: int | None, m, r: int, group: int | None = None,
                   w_fraction: float = 0.0, family: Family = "torch"):
    """Closed forms of the in-flight peaks, for the search (``m`` may be a numpy array).

    Called with a family (``"megatron"``/``"torch"``) first, it is the original 1F1B/interleaved count
    (:func:`peak_in_flight_1f1b`). Called with a schedule name it gives, for rank ``r``:

    * ``1f1b``: ``min(m, p - r)``; ``interleaved``: warm-up + 1 (:func:`warmup_forwards`) in ``family``;
    * ``interleaved_zb`` (torch, N micro-batches per round): ``min(m v, (v - 1) N + p - r)`` chunks with
      full activations (``w_fraction = 0``); with torch's runtime (``w_fraction = 1``, a pending W keeps
      the chunk alive) ``min(m v, (v - 1) N + p)`` on every rank: rank ``r`` defers ``r`` W's;
    * ``zbv``: ``min(2p, 2m, m + 1 + r)`` for either fraction (no W is pending at the peak);
    * ``dualpipev``: ``2p + 1`` (``m >= 2p``) for either fraction.

    Each is checked against the action lists' own peak in tests/test_schedules_zb.py, and those against
    torch's saved-tensor peaks on gloo. ``w_fraction`` must be 0 or 1 here; use
    :func:`peak_in_flight_of` for other fractions.
    """
    import numpy as np

    if schedule_or_family in ("megatron", "torch"):
        return peak_in_flight_1f1b(schedule_or_family, p, v or 1, m, r, group)
    if w_fraction not in (0, 1):
        raise ValueError("w_fraction: the closed forms hold for 0 or 1; use peak_in_flight_of for others")
    name = schedule_or_family
    m = np.asarray(m)
    if name == "1f1b":
        return np.minimum(m, p - r)
    if name == "interleaved":
        vv = v or 2
        n = p if group is None else group
        if family == "torch":
            n = m // np.maximum(1, m // p)
        return np.minimum(m * vv, 2 * (p - r - 1) + (vv - 1) * n + 1)
    if name == "interleaved_zb":
        vv = v or 1
        n = m // np.maximum(1, m // p)
        return np.minimum(m * vv, (vv - 1) * n + p - (0 if w_fraction else r))
    if name == "zbv":
        return np.minimum(np.minimum(2 * p, 2 * m), m + 1 + r)
    if name == "dualpipev":
        return np.full_like(m, 2 * p + 1)
    raise ValueError(f"schedule: {name!r} is not one of {', '.join(SCHEDULES)}")


def bubble_closed_form_s(schedule: str, p: int, v: int | None, f_s, i_s, w_s):
    """The published closed forms of the bubble (uniform stages, no P2P time; numpy arrays welcome),
    or None where none applies; :func:`bubble_s` simulates every case.

    * ``1f1b``: ``(p - 1)(f + i + w)`` (Narayanan et al. 2021, arXiv:2104.04473 section 2.2.1);
    * ``interleaved``: ``(p - 1)(f + i + w)`` per chunk, i.e. ``(p - 1)(t_f + t_b) / v`` per whole stage
      (ibid. section 2.2.2);
    * ``interleaved_zb`` with ``v = 1`` (ZB-H1): ``(p - 1)(f + i - w)`` (Qi et al. 2024,
      arXiv:2401.10241 section 2.1; DeepSeek-V3 Table 2's ZB1P row ``(PP - 1)(F + B - 2W)`` with B a
      full backward), which torch's order reaches while ``w <= min(f, i)``: the deferred W's must fit in
      the gaps they fill. None otherwise.
    """
    import numpy as np

    f, i, w = (np.asarray(x, dtype=float) for x in (f_s, i_s, w_s))
    if schedule in ("1f1b", "interleaved"):
        return (p - 1) * (f + i + w)
    if schedule == "interleaved_zb" and (v or 1) == 1 and bool(np.all(w <= np.minimum(f, i))):
        return (p - 1) * (f + i - w)
    return None


# --- which framework runs which schedule -------------------------------------------------------------
FRAMEWORK_SCHEDULES: dict[str, tuple[str, ...]] = {
    # Megatron-Core core_v0.16.1 megatron/core/pipeline_parallel/schedules.py: 1F1B and interleaved only
    # (no zero-bubble or DualPipe schedule); NeMo runs Megatron-Core's schedules.
    "megatron": ("1f1b", "interleaved"),
    "nemo": ("1f1b", "interleaved"),
    # torchtitan 0.3.0 passes parallelism.pipeline_parallel_schedule to torch's get_schedule_class.
    "torchtitan": SCHEDULES,
    "torch": SCHEDULES,
    # DeepSpeed 0.19.8: PipelineEngine (TrainSchedule) and DualPipeVEngine (runtime/pipe/dualpipev.py).
    "deepspeed": ("1f1b", "dualpipev"),
}
"""Schedules each framework runs (docs/schedules.md lists the sources)."""

TORCHTITAN_SCHEDULE_NAMES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                             "interleaved_zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble",
                             "dualpipev": "DualPipeV"}
"""torchtitan ``--parallelism.pipeline_parallel_schedule`` values (torch ``get_schedule_class`` keys)."""


def framework_family(framework: str) -> Family:
    """Whose order a framework runs: Megatron's (megatron, nemo), DeepSpeed's, or torch's."""
    return {"megatron": "megatron", "nemo": "megatron", "deepspeed": "deepspeed"}.get(framework, "torch")


def schedule_problems(schedule: str, framework: str, p: int, v: int, m: int, group: int | None = None) -> list[str]:
    """One-line reasons ``framework`` cannot run ``schedule`` with ``p`` ranks, ``v`` chunks per rank and
    ``m`` micro-batches; empty when it can. The rules are the frameworks' own checks:

    * the schedule must be one the framework has (:data:`FRAMEWORK_SCHEDULES`);
    * zbv, dualpipev: exactly 2 chunks per rank (torch raises for any other count); dualpipev needs
      ``m >= 2p`` (torch ``ScheduleDualPipeV``, DeepSpeed ``DualPipeVEngine``);
    * torch's interleaved and interleaved_zb: ``m`` a multiple of ``max(1, m // p)`` (other counts than multiples
      of ``p`` run as torch's flex rounds, which ``memory.in_flight_chunks`` counts in torch's order);
    * torchtitan: single-stage schedules (1f1b) need 1 chunk per rank and multi-stage ones at least 2
      (``_get_pipeline_metadata``), so ZB-H1 (interleaved_zb with v = 1) runs in plain torch only;
    * Megatron's interleaved: :func:`interleaved_problems`.
    """
    if schedule not in SCHEDULES:
        return [f"schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}"]
    allowed = FRAMEWORK_SCHEDULES.get(framework, SCHEDULES)
    if schedule not in allowed:
        return [f"schedule: {framework} does not run {schedule}; it runs {', '.join(allowed)}"]
    errors = []
    if schedule == "1f1b" and v != 1:
        errors.append(f"vpp: 1f1b runs one chunk per rank (got {v}); use interleaved for vpp > 1")
    if schedule == "interleaved" and v < 2:
        errors.append("vpp: interleaved needs at least 2 chunks per rank")
    if schedule in V_SHAPED and v != 2:
        errors.append(f"vpp: {schedule} runs exactly 2 chunks per rank (got {v})")
    if schedule == "dualpipev" and m < 2 * p:
        errors.append(f"num_microbatches: dualpipev needs at least 2*pp = {2 * p} micro-batches (got {m})")
    if framework_family(framework) == "torch" and schedule in ("interleaved", "interleaved_zb"):
        rounds = max(1, m // p)
        if m % rounds:
            errors.append(f"num_microbatches: torch's {schedule} needs num_microbatches({m}) to be a multiple of "
                          f"max(1, m // pp) = {rounds}; choose {m - m % rounds} or {m + rounds - m % rounds}")
    if framework == "torchtitan" and schedule == "interleaved_zb" and v < 2:
        errors.append("vpp: torchtitan runs multi-stage schedules (InterleavedZeroBubble) with at least 2 stages "
                      "per rank; use vpp >= 2")
    if framework_family(framework) == "megatron" and schedule == "interleaved":
        errors += interleaved_problems(p, v, m, group)
    return errors
