"""Context parallelism on CPU ranks: torch's own ring attention around the CPU flash-attention kernel.

torch's public ``context_parallel`` only dispatches the CUDA SDPA ops (``_sdpa_handler`` in
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, torch 2.13); on a CPU,
``F.scaled_dot_product_attention`` calls ``aten._scaled_dot_product_flash_attention_for_cpu``, which it
does not handle. :class:`RingAttention` calls the same ring templates that torch's CUDA handlers call
(``_templated_ring_attention`` / ``_templated_ring_attention_backward``, ``_attention.py`` lines 317 and
488) with the CPU forward and backward kernels as the per-block op. The K/V blocks rotate with
``_RotateMethod.ALL_TO_ALL`` (``_AllToAllRotater``: each step sends the current K/V to the next cp
rank, a ring as Megatron-Core's ``--cp-comm-type p2p``); the inputs are sharded by torch's head-tail
load balancer (:func:`shard_sequence`), so each rank holds chunks ``r`` and ``2cp-1-r`` of ``2cp``.

GQA: the CPU kernels take K and V with fewer heads than Q (checked by tests/test_validate_cp.py), so
the ring exchanges K/V at their own width, as Megatron-Core does.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

aten = torch.ops.aten


def _cpu_forward(query, key, value, *, is_causal: bool, **kwargs):
    """The per-block op of ``_templated_ring_attention``: ``(out, logsumexp)`` of one Q block against one
    K/V block (``aten._scaled_dot_product_flash_attention_for_cpu``; its logsumexp is ``[b, heads, s]``
    fp32, which ``_SDPAMerger`` unsqueezes to merge)."""
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, bool(is_causal), **kwargs)


def _cpu_backward(*, grad_out, query, key, value, out, logsumexp, is_causal: bool, **kwargs):
    """The per-block op of ``_templated_ring_attention_backward`` (keyword arguments, ``grad_out_name``
    "grad_out"): ``(grad_q, grad_k, grad_v)`` from ``aten._scaled_dot_product_flash_attention_for_cpu_backward``.
    The template hands it half-blocks cut along the sequence (``chunk``): made contiguous for the kernel."""
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), query.contiguous(), key.contiguous(), value.contiguous(), out.contiguous(),
        logsumexp.contiguous(), 0.0, bool(is_causal), **kwargs)


@contextlib.contextmanager
def ring_options():
    """torch's global ``_cp_options`` set explicitly for the run and restored after: load balancing on
    (the inputs are head-tail sharded), fp32 merges (``convert_to_f32``, torch's default), and the
    all-to-all rotater (a ring)."""
    opts = cp_attention._cp_options
    old = (opts.enable_load_balance, opts.convert_to_f32, opts.rotate_method)
    opts.enable_load_balance, opts.convert_to_f32 = True, True
    opts.rotate_method = cp_attention._RotateMethod.ALL_TO_ALL
    try:
        yield
    finally:
        opts.enable_load_balance, opts.convert_to_f32, opts.rotate_method = old


class RingAttention(torch.autograd.Function):
    """Causal ring attention over ``group`` on ``[b, heads, s/cp, d]`` Q and ``[b, kv_heads, s/cp, d]`` K, V
    (load-balanced local shards). Saves Q, K, V, the output and the fp32 logsumexp, as the CPU flash
    kernel's own autograd node does (``ScaledDotProductFlashAttentionForCpuBackward0``)."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        with ring_options():
            out, lse = cp_attention._templated_ring_attention(group, 2, _cpu_forward, q, k, v, is_causal=True)
        out = like_query_layout(out)
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with ring_options():
            dq, dk, dv = cp_attention._templated_ring_attention_backward(
                ctx.group, 2, _cpu_backward, grad_out, "grad_out", q, k, v, out, lse, is_causal=True)
        return dq, dk, dv, None


def like_query_layout(out):
    """``out`` in the ``[b, s, heads, d]`` memory layout that the CPU flash kernel gives its output when the
    query is a transposed ``[b, s, heads, d]`` tensor (the model's case), so that the output projection's
    ``transpose(1, 2).reshape`` is a view and the output is saved once, as without cp. The merge of a
    partial block (``_partial_update``, ``_attention.py`` line 113: ``torch.cat`` of the two halves) returns
    a contiguous ``[b, heads, s, d]`` tensor on the ranks whose later steps update only the second half."""
    if out.transpose(1, 2).is_contiguous():
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def ring_attention(q, k, v, group):
    return RingAttention.apply(q, k, v, group)


def shard_sequence(cp_mesh, buffers: list, seq_dims: list[int], seq_len: int) -> list:
    """This cp rank's tokens of each buffer by torch's head-tail load balancer (``_HeadTailLoadBalancer``,
    ``_load_balancer.py``; chunks ``r`` and ``2cp-1-r`` of ``2cp``), through torch's ``_context_parallel_shard``."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_shard
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    device = buffers[0].device
    balancer = _HeadTailLoadBalancer(seq_len, cp_mesh.size(), device)
    mode = cp_attention._dispatch_mode  # a global that _context_parallel_shard sets: restored
    try:
        return _context_parallel_shard(cp_mesh, buffers, seq_dims, load_balancer=balancer)
    finally:
        cp_attention._dispatch_mode = mode


def ring_exchange(buf, group):
    """One step of the ring as the all-to-all rotater runs it (``_AllToAllRotater.exchange_buffers``:
    ``permute_tensor`` to the next rank), waited for; for the microbenchmark."""
    rotater = cp_attention._create_rotater(group, 2, method=cp_attention._RotateMethod.ALL_TO_ALL)
    rotater.exchange_buffers(buf)
    return rotater.next_buffer()


__all__ = ["RingAttention", "ring_attention", "ring_exchange", "ring_options", "shard_sequence"]
