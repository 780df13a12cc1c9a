"""alpha-beta costs of collectives and point-to-point transfers on the node/network hierarchy.

Ring algorithms (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009), with the bus
bandwidth convention of nccl-tests (``doc/PERFORMANCE.md``, formulas.md C1): a collective of a
full buffer of ``S`` bytes over ``n`` ranks takes

    t = steps * alpha + factor * S / busbw

where ``factor`` is ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for reduce-scatter and all-gather,
``steps`` is ``2(n-1)`` or ``n-1``, and ``busbw`` is the *achievable* bus bandwidth the hardware
profile gives (measured nccl-tests figures, formulas.md C5), so no further efficiency applies.

A group that spans nodes with several ranks on each node (``GroupSpan.mixed``) runs
hierarchically, as NCCL does: reduce-scatter inside each node, the cross-node collective on
``S / per_node`` bytes (every GPU drives its own NIC), then all-gather inside the node.

All-to-all (:func:`all_to_all_time_s`, MoE token dispatch and combine): every rank sends ``S/n`` of its
``S``-byte buffer to each other rank, so ``(n-1)/n`` of it leaves the rank (nccl-tests AlltoAll bus
factor ``(n-1)/n``, formulas.md C1). NCCL runs it as ``n-1`` grouped send/receive pairs posted at once
(NCCL user guide, "Point-to-point communication": all-to-all as ``ncclGroupStart``/``ncclSend``/
``ncclRecv``/``ncclGroupEnd``), so the latencies overlap: one alpha of the slowest link crossed.
"""

from __future__ import annotations

from typing import Literal

from planner.layout import GroupSpan
from planner.specs import HardwareSpec

Collective = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]


def bus_factor(kind: Collective, n: int) -> float:
    """nccl-tests bus-bandwidth factor: ``2(n-1)/n`` (all-reduce), ``(n-1)/n`` (RS, AG)."""
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


def ring_steps(kind: Collective, n: int) -> int:
    """Latency terms of a ring: ``2(n-1)`` for all-reduce, ``n-1`` for RS/AG."""
    return (2 if kind == "all_reduce" else 1) * (n - 1)


def ring_time_s(kind: Collective, size_bytes: float, n: int, bus_bandwidth_gbps: float, latency_us: float) -> float:
    """One flat ring collective of a ``size_bytes`` buffer over ``n`` ranks."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return ring_steps(kind, n) * latency_us * 1e-6 + bus_factor(kind, n) * size_bytes / (bus_bandwidth_gbps * 1e9)


def all_to_all_time_s(size_bytes: float, group: GroupSpan, hw: HardwareSpec) -> float:
    """One all-to-all of a ``size_bytes`` buffer per rank over ``group`` (module docstring).

    Inside one NVLink domain: ``alpha + (n-1)/n * S / busbw_intra``. Across domains the shares for the
    ``n - per_node`` ranks elsewhere go over the rank's own NIC and the ``per_node - 1`` local shares over
    NVLink at the same time: ``alpha_inter + max((n-per_node)/n * S / bw_inter, (per_node-1)/n * S / bw_intra)``.
    """
    n = group.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    if group.intra_node:
        return hw.intra_node_latency_us * 1e-6 + (n - 1) / n * size_bytes / (hw.intra_node_bandwidth_gbps * 1e9)
    local = group.per_node
    inter = (n - local) / n * size_bytes / (hw.inter_node_bandwidth_gbps * 1e9)
    intra = (local - 1) / n * size_bytes / (hw.intra_node_bandwidth_gbps * 1e9)
    return hw.inter_node_latency_us * 1e-6 + max(inter, intra)


def collective_time_s(kind: Collective, size_bytes: float, group: GroupSpan, hw: HardwareSpec) -> float:
    """A collective on a group placed as ``group`` says: intra-node, one rank per node, or mixed.
    ``all_to_all`` goes to :func:`all_to_all_time_s`."""
    if kind == "all_to_all":
        return all_to_all_time_s(size_bytes, group, hw)
    intra = (hw.intra_node_bandwidth_gbps, hw.intra_node_latency_us)
    inter = (hw.inter_node_bandwidth_gbps, hw.inter_node_latency_us)
    if group.size <= 1:
        return 0.0
    if group.intra_node:
        return ring_time_s(kind, size_bytes, group.size, *intra)
    if not group.mixed:
        return ring_time_s(kind, size_bytes, group.size, *inter)
    local, nodes = group.per_node, group.nodes
    shard = size_bytes / local
    if kind == "all_reduce":
        return (ring_time_s("reduce_scatter", size_bytes, local, *intra) + ring_time_s("all_reduce", shard, nodes, *inter)
                + ring_time_s("all_gather", size_bytes, local, *intra))
    return ring_time_s(kind, size_bytes, local, *intra) + ring_time_s(kind, shard, nodes, *inter)


def p2p_time_s(size_bytes: float, inter_node: bool, hw: HardwareSpec) -> float:
    """One point-to-point transfer: ``alpha + S / bandwidth`` on the link it crosses (formulas.md C3)."""
    if size_bytes <= 0:
        return 0.0
    if inter_node:
        return hw.inter_node_latency_us * 1e-6 + size_bytes / (hw.inter_node_bandwidth_gbps * 1e9)
    return hw.intra_node_latency_us * 1e-6 + size_bytes / (hw.intra_node_bandwidth_gbps * 1e9)
