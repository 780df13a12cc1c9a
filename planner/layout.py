"""Rank layout: which GPUs form each TP, CP, DP and PP group, and which link each group uses.

The layout is an explicit order string, fastest-varying axis first, as Megatron-LM's
``RankGenerator(order="tp-cp-ep-dp-pp")`` (``megatron/core/parallel_state.py``); the dense grid has no
ep axis, so the default order is ``"tp-cp-dp-pp"``. Mixture-of-experts layers use a second grid over
the same ranks (Megatron-Core "parallel folding"): ETP x EP x EDP x PP in that order, fastest first
(``RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")``), so an EP group
is ``ep`` ranks ``etp`` apart inside a block of ``etp*ep`` consecutive ranks (:func:`expert_span`).
Ranks are laid out with ``np.arange(world).reshape(...)`` and groups are slices of that grid (as
nanotron does).

Worked example: 16 GPUs on 2 nodes of 8, TP=2, PP=4, DP=2 (order tp-cp-dp-pp)::

    node 0: g0  g1  g2  g3  g4  g5  g6  g7      node 1: g8  g9  g10 g11 g12 g13 g14 g15
    TP groups: [g0,g1] [g2,g3] [g4,g5] [g6,g7] [g8,g9] [g10,g11] [g12,g13] [g14,g15]
    DP groups: [g0,g2] [g1,g3] [g4,g6] [g5,g7] [g8,g10] [g9,g11] [g12,g14] [g13,g15]
    PP groups: [g0,g4,g8,g12] [g1,g5,g9,g13] [g2,g6,g10,g14] [g3,g7,g11,g15]

TP pairs sit on NVLink; the DP pairs here share a node too (intra-node all-reduce); pipeline
stage 0 -> 1 stays in node 0 while 1 -> 2 crosses to node 1, so the slowest PP hop is inter-node.
A group whose ranks span several nodes with several ranks on each node is "mixed": its
collectives run hierarchically (intra-node first, then across nodes; see ``planner.comm``).

"Node" here is the **NVLink domain** (``HardwareSpec.nvlink_domain``): the GPUs that reach each other
at NVLink speed. It is the host (8 GPUs) on DGX H100/B200, but the whole rack on GB200/GB300 NVL72,
where 18 trays of 4 GPUs share one NVLink switch domain of 72: there a TP group of 8 spans two
trays and still runs on NVLink. The ``gpus_per_node`` parameters below take that domain size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from planner.specs import Plan

AXES = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"


def parse_order(order: str) -> tuple[str, ...]:
    axes = tuple(order.split("-"))
    if sorted(axes) != sorted(AXES):
        raise ValueError(f"order: '{order}' must name each of {', '.join(AXES)} once, e.g. {DEFAULT_ORDER}")
    return axes


def rank_grid(plan: Plan, order: str = DEFAULT_ORDER) -> np.ndarray:
    """World ranks as an array indexed ``[tp, cp, dp, pp]`` (always this index order).

    ``order`` names the axes from fastest- to slowest-varying rank, as Megatron's RankGenerator.
    """
    axes = parse_order(order)
    sizes = {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp}
    # reshape is row-major (last index fastest), so reverse the fastest-first order
    grid = np.arange(plan.world_size).reshape([sizes[a] for a in reversed(axes)])
    return np.transpose(grid, [list(reversed(axes)).index(a) for a in AXES])


def stage_ranks(plan: Plan, stage: int, order: str = DEFAULT_ORDER) -> list[int]:
    """The world ranks that hold pipeline stage ``stage`` (all their tp, cp and dp coordinates)."""
    return sorted(map(int, rank_grid(plan, order)[:, :, :, stage].ravel()))


def ranges_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``"0-3, 8-9"``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def groups(plan: Plan, axis: str, order: str = DEFAULT_ORDER) -> list[list[int]]:
    """Every group of ``axis``: the ranks that differ only in that axis's coordinate."""
    grid = rank_grid(plan, order)
    k = AXES.index(axis)
    moved = np.moveaxis(grid, k, -1).reshape(-1, grid.shape[k])
    return [list(map(int, row)) for row in moved]


@dataclass(frozen=True)
class GroupSpan:
    """How one communication group sits on the nodes."""

    size: int  # ranks in the group
    nodes: int  # distinct nodes it touches
    per_node: int  # ranks of the group on each node (the largest count)

    @property
    def intra_node(self) -> bool:
        return self.nodes == 1

    @property
    def mixed(self) -> bool:
        """Spans nodes with more than one rank per node: hierarchical collectives."""
        return self.nodes > 1 and self.per_node > 1


def span(ranks: list[int], gpus_per_node: int) -> GroupSpan:
    nodes = [r // gpus_per_node for r in ranks]
    counts = np.bincount(nodes)
    return GroupSpan(size=len(ranks), nodes=int((counts > 0).sum()), per_node=int(counts.max()))


def _worst(spans) -> GroupSpan:
    return max(spans, key=lambda s: (s.nodes, -s.per_node))


def group_span(plan: Plan, axis: str, gpus_per_node: int, order: str = DEFAULT_ORDER) -> GroupSpan:
    """The worst-placed group of ``axis`` (most nodes touched), from the full grid."""
    return _worst(span(g, gpus_per_node) for g in groups(plan, axis, order))


def axis_span(plan: Plan, axis: str, gpus_per_node: int, order: str = DEFAULT_ORDER) -> GroupSpan:
    """Same as :func:`group_span` without building the grid (fast enough for the search).

    A group of ``axis`` is the progression ``r0 + k * stride`` (``k < n``), where ``stride`` is the
    product of the faster axes' sizes. Its placement depends only on ``r0 mod gpus_per_node``;
    ``r0`` takes every offset below ``stride`` plus the multiples of ``stride * n`` below the world size.
    """
    stride, n = _axis_progression(plan, axis, order)
    return _progression_span(stride, n, plan.world_size // (stride * n), gpus_per_node)


def _axis_progression(plan: Plan, axis: str, order: str = DEFAULT_ORDER) -> tuple[int, int]:
    """(stride, size) of the groups of ``axis``: the product of the faster axes' sizes, and the axis's own."""
    axes = parse_order(order)
    sizes = {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp}
    return math.prod(sizes[a] for a in axes[:axes.index(axis)]), sizes[axis]


@functools.lru_cache(maxsize=4096)
def _progression_span(stride: int, n: int, outer: int, g: int) -> GroupSpan:
    starts = {(a + b * stride * n) % g for a in range(min(stride, g)) for b in range(min(outer, g))}
    k = np.arange(n)
    return _worst(span(list(r0 + k * stride), g) for r0 in sorted(starts))


def expert_span(plan: Plan, axis: str, gpus_per_node: int) -> GroupSpan:
    """The worst-placed group of ``axis`` ("etp", "ep", "edp", or "etp_ep": the expert-TP and EP ranks together,
    Megatron-Core's ``tp_ep_group`` over which the allgather token dispatcher gathers) of the expert grid
    ETP x EP x EDP x PP (module docstring; Megatron-Core ``parallel_state.initialize_model_parallel``, expert rank
    generator with order ``tp-cp-ep-dp-pp``): strides 1, ``etp`` and ``etp*ep`` (and 1 for ``etp_ep``)."""
    stride, n = _expert_progression(plan, axis)
    return _progression_span(stride, n, plan.world_size // (stride * n), gpus_per_node)


@functools.lru_cache(maxsize=1024)
def block_domain_counts(size: int, world: int, domain: int) -> frozenset[int]:
    """The numbers of ranks the consecutive blocks of ``size`` ranks of a ``world``-rank job put in each ``domain``-GPU
    NVLink domain they touch: every placement of a stride-1 group, such as the ``etp_ep`` groups of
    :func:`expert_span` (Megatron-Core's ``tp_ep_group``, expert TP then EP innermost). One value: every group sits the
    same way on the domains it touches (HybridEP's rule, ``specs.hybridep_domain_problem``)."""
    out = set()
    for start in range(0, max(world, size), size):
        first, last = start // domain, (start + size - 1) // domain
        for d in range(first, last + 1):
            out.add(min(start + size, (d + 1) * domain) - max(start, d * domain))
    return frozenset(out)


def _expert_progression(plan: Plan, axis: str) -> tuple[int, int]:
    """(stride, size) of the groups of ``axis`` ("etp", "ep", "edp" or "etp_ep") of the expert grid
    (:func:`expert_span`)."""
    etp, ep = plan.expert_tp, plan.ep
    edp = plan.tp * plan.cp * plan.dp // (etp * ep)
    return {"etp": (1, etp), "ep": (etp, ep), "edp": (etp * ep, edp), "etp_ep": (1, etp * ep)}[axis]


def partial_dp_spans(plan: Plan, instances: int, gpus_per_node: int, order: str = DEFAULT_ORDER,
                     expert: bool = False) -> tuple[GroupSpan, GroupSpan]:
    """(intra-instance, inter-instance) groups of a distributed optimizer split into ``instances`` copies
    (``TrainingSpec.dist_optimizer_instances``): Megatron-Core core_v0.16.1 ``parallel_state.py`` cuts each
    data-parallel group (dp x cp ranks, or the expert-data-parallel group with ``expert``) into ``instances``
    consecutive slices (``ranks_with_cp[i * intra:(i + 1) * intra]``), the intra groups, and the ranks at the same
    place in each slice form the inter groups: progressions of stride ``s`` and ``s x intra``, ``s`` the data-parallel
    group's own stride."""
    stride, size = _expert_progression(plan, "edp") if expert else \
        _axis_progression(plan.model_copy(update={"dp": plan.dp * plan.cp, "cp": 1}), "dp", order)
    intra = size // instances
    world = plan.world_size
    return (_progression_span(stride, intra, world // (stride * intra), gpus_per_node),
            _progression_span(stride * intra, instances, world // (stride * size), gpus_per_node))


def pp_hop_crosses_nodes(plan: Plan, gpus_per_node: int, order: str = DEFAULT_ORDER) -> bool:
    """Whether some consecutive pipeline stages sit on different nodes (then P2P uses the network)."""
    # the ranks of a PP group increase along the pipeline, so it crosses a node boundary
    # between some pair of consecutive stages exactly when it touches more than one node
    return axis_span(plan, "pp", gpus_per_node, order).nodes > 1


def placement_line(plan: Plan, domain: int, order: str = DEFAULT_ORDER) -> str:
    """Where each parallel group sits, for the estimate's layout line: ``TP 8 inside one NVLink domain
    of 72 GPUs; DP 9 across 9 domains`` (the worst-placed group of each axis of size > 1). A MoE plan
    (ep > 1) adds its expert groups (:func:`expert_span`): EP, expert TP where it differs from TP, and the
    expert-data-parallel group its expert gradients are reduced over."""
    def where(g: GroupSpan) -> str:
        return "inside one NVLink domain" if g.nodes == 1 else f"across {g.nodes} domains ({g.per_node} per domain)"

    parts = []
    for axis in parse_order(order):
        size = {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp}[axis]
        if size > 1:
            parts.append(f"{axis.upper()} {size} {where(axis_span(plan, axis, domain, order))}")
    if plan.ep > 1:
        edp = plan.tp * plan.cp * plan.dp // (plan.expert_tp * plan.ep)
        for axis, label, size in (("ep", "EP", plan.ep), ("etp", "expert TP", plan.expert_tp),
                                  ("edp", "expert DP", edp)):
            if size > 1 and not (axis == "etp" and plan.expert_tp == plan.tp):
                parts.append(f"{label} {size} {where(expert_span(plan, axis, domain))}")
    return f"Layout ({order}, NVLink domain of {domain} GPUs): " + ("; ".join(parts) or "one GPU")
