"""A reference transformer layer in plain torch, built as one tensor-parallel rank of Megatron-LM builds it.

Used by tests/test_memory_torch.py to measure what the estimator predicts: parameter bytes,
saved-activation bytes (``torch.autograd.graph.saved_tensors_hooks``) and FLOPs
(``torch.utils.flop_counter.FlopCounterMode``).

Layout is batch-first ``[b, s, h]``; one rank holds ``heads / tp`` query heads, ``max(g / tp, 1)``
KV heads, ``f / tp`` of the MLP. Sequence parallelism is simulated in one process: the norms
and dropouts see ``s / tp`` tokens; the column-parallel linear saves its sequence-sharded input
and re-gathers it in backward, as Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
does; the row-parallel output is "reduce-scattered" to ``s / tp`` tokens. Values are not those of
a real multi-rank run, shapes and saved tensors are.

Kernel assumptions, where this differs from Megatron on a GPU:

* Dropout, RMSNorm and SwiGLU are the autograd Functions of ``planner.validate.kernels``: they save
  what the fused GPU kernels save (a bool mask; input + rstd; the FC1 output only).
* ``torch.nn.functional.layer_norm`` on a bf16 CPU tensor saves mean/rstd in bf16, where Apex/TE
  keep them in fp32 (4 B per token less here; the estimator counts fp32).
* Attention is ``scaled_dot_product_attention``: on the CPU its flash kernel
  (``_scaled_dot_product_flash_attention_for_cpu``) saves q, k, v, the output and the fp32
  log-sum-exp, like FlashAttention-2 on a GPU. ``FlopCounterMode`` does not count that CPU kernel,
  so FLOPs are measured on the ``materialized`` path (two batched matmuls, no causal saving).
* No RoPE: Megatron's fused RoPE saves nothing extra; an unfused RoPE would keep rotated copies of Q, K.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.specs import ModelSpec


from planner.validate.kernels import DropoutFn as _Dropout  # noqa: E402
from planner.validate.kernels import RMSNormFn as _RMSNorm  # noqa: E402
from planner.validate.kernels import SwiGLUFn as _SwiGLU  # noqa: E402


class _SPColumnLinear(torch.autograd.Function):
    """Sequence-parallel column linear: saves the s/t shard, all-gathers (here: repeats) in forward and backward."""

    @staticmethod
    def forward(ctx, x_shard, weight, tp):
        ctx.tp = tp
        ctx.save_for_backward(x_shard, weight)
        return F.linear(x_shard.repeat(1, tp, 1), weight)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        x_full = x_shard.repeat(1, ctx.tp, 1)
        gw = grad.reshape(-1, grad.shape[-1]).t() @ x_full.reshape(-1, x_full.shape[-1])
        gx = (grad @ weight).reshape(grad.shape[0], ctx.tp, -1, weight.shape[1]).sum(1)
        return gx, gw, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Row-parallel output to s/t tokens (stands in for the reduce-scatter); saves nothing."""

    @staticmethod
    def forward(ctx, y, tp):
        ctx.tp = tp
        return y.reshape(y.shape[0], tp, -1, y.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, grad):
        return grad.repeat(1, ctx.tp, 1), None


class RefLayer(nn.Module):
    """One transformer layer as one TP rank holds it."""

    def __init__(self, model: ModelSpec, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                 attention: str = "flash", dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.m, self.tp, self.sp, self.recompute, self.attention = model, tp, sequence_parallel, recompute, attention
        h, d = model.hidden_size, model.kv_channels
        self.heads = model.num_attention_heads // tp
        self.kv = max(model.kv_heads // tp, 1)
        f = model.ffn_size // tp
        fc1 = 2 * f if model.gated_mlp else f
        kw = dict(dtype=dtype, device=device)
        self.layernorm = model.norm == "layernorm"
        biased = model.norm_weights_per_channel == 2  # a LayerNorm with bias (not norm_bias False, not RMSNorm)

        def norm(width):  # (weight, bias or None), registered as parameters
            return (nn.Parameter(torch.ones(width, **kw)), nn.Parameter(torch.zeros(width, **kw)) if biased else None)

        # pre/post: norm1 (attention), norm2 (MLP); sandwich: both before and after; shared: norm1 only
        self.norm1_w, self.norm1_b = norm(h)
        if not model.shared_input_norm:
            self.norm2_w, self.norm2_b = norm(h)
        if model.norm_placement == "sandwich":
            self.norm3_w, self.norm3_b = norm(h)
            self.norm4_w, self.norm4_b = norm(h)
        qk_widths = {"full": (self.heads * d, self.kv * d), "head": (d, d)}.get(model.qk_norm)
        if qk_widths:
            self.qnorm_w, self.qnorm_b = norm(qk_widths[0])
            self.knorm_w, self.knorm_b = norm(qk_widths[1])
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv) * d, bias=model.has_qkv_bias, **kw)
        self.proj = nn.Linear(self.heads * d, h, bias=model.has_out_proj_bias, **kw)
        self.fc1 = nn.Linear(h, fc1, bias=model.has_mlp_bias, **kw)
        self.fc2 = nn.Linear(f, h, bias=model.has_mlp_bias, **kw)
        if device != "meta":
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

    # -- pieces ----------------------------------------------------------------------------------
    def _norm(self, x, w, b):
        if self.layernorm:  # with or without its bias
            return F.layer_norm(x, (x.shape[-1],), w, b)
        return _RMSNorm.apply(x, w, 1e-5)

    def _column(self, x, lin):
        if self.sp:
            out = _SPColumnLinear.apply(x, lin.weight, self.tp)
            return out + lin.bias if lin.bias is not None else out
        return lin(x)

    def _row(self, x, lin):
        out = F.linear(x, lin.weight)
        if self.sp:
            out = _ReduceScatterSeq.apply(out, self.tp)
        return out + lin.bias if lin.bias is not None else out

    def _dropout(self, x):
        return _Dropout.apply(x, 0.1) if self.m.dropout else x

    def core_attention(self, q, k, v):
        """[b, a, s, d] -> [b, a, s, d] (flash) or the materialised scores path."""
        if self.attention == "flash":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        if self.kv != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv, dim=1) for t in (k, v))
        s = q.shape[2]
        mask = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
        if self.m.attn_logit_softcap is not None:  # Gemma-2 eager: cap * tanh(scores / cap)
            scores = torch.tanh(scores / self.m.attn_logit_softcap) * self.m.attn_logit_softcap
        scores = scores + mask
        probs = self._dropout(torch.softmax(scores, dim=-1))
        return probs @ v

    def _qk_norm(self, q, k):
        """OLMo-2 ``full``: over the a*d_h (g*d_h) channels before the heads split; ``head``: per head."""
        if self.m.qk_norm == "none":
            return q, k
        return self._norm(q, self.qnorm_w, self.qnorm_b), self._norm(k, self.knorm_w, self.knorm_b)

    def attention_block(self, x, normed=False):
        """Input norm (pre / sandwich, unless ``normed``), attention, output norm (post / sandwich), dropout."""
        b = x.shape[0]
        d = self.m.kv_channels
        if self.m.norm_placement != "post" and not normed:
            x = self._norm(x, self.norm1_w, self.norm1_b)
        y = self._column(x, self.qkv)
        s = y.shape[1]
        q, k, v = y.split([self.heads * d, self.kv * d, self.kv * d], dim=-1)
        if self.m.qk_norm == "full":
            q, k = self._qk_norm(q, k)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        if self.m.qk_norm == "head":
            q, k = self._qk_norm(q, k)
        if self.recompute == "selective":
            o = checkpoint(self.core_attention, q, k, v, use_reentrant=True)
        else:
            o = self.core_attention(q, k, v)
        o = self._row(o.transpose(1, 2).reshape(b, s, self.heads * d), self.proj)
        if self.m.norm_placement == "post":
            o = self._norm(o, self.norm1_w, self.norm1_b)
        elif self.m.norm_placement == "sandwich":
            o = self._norm(o, self.norm3_w, self.norm3_b)
        return self._dropout(o)

    def mlp_block(self, x, normed=False):
        """Input norm, MLP (GeGLU's fused kernel saves what SwiGLU's does: the FC1 output), output norm, dropout."""
        if self.m.norm_placement != "post" and not normed:
            x = self._norm(x, self.norm2_w, self.norm2_b)
        y = self._column(x, self.fc1)
        if self.m.gated_mlp:
            y = _SwiGLU.apply(y)
        elif self.m.activation == "squared_relu":  # Megatron-Core activations.squared_relu: pow(relu(x), 2)
            y = torch.pow(F.relu(y), 2)
        else:
            y = F.gelu(y)
        y = self._row(y, self.fc2)
        if self.m.norm_placement == "post":
            y = self._norm(y, self.norm2_w, self.norm2_b)
        elif self.m.norm_placement == "sandwich":
            y = self._norm(y, self.norm4_w, self.norm4_b)
        return self._dropout(y)

    def _layer(self, x):
        if self.m.parallel_attention:  # both read the layer input (Falcon-7B: through one shared norm)
            if self.m.shared_input_norm:
                n = self._norm(x, self.norm1_w, self.norm1_b)
                return x + self.attention_block(n, normed=True) + self.mlp_block(n, normed=True)
            return x + self.attention_block(x) + self.mlp_block(x)
        x = x + self.attention_block(x)
        return x + self.mlp_block(x)

    def forward(self, x):
        if self.recompute == "full":
            return checkpoint(self._layer, x, use_reentrant=True)
        return self._layer(x)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: views of one buffer share it (fake tensors too)


def saved_activation_bytes(module: nn.Module, x: torch.Tensor, backward: bool = True) -> int:
    """Bytes of distinct storages the forward saves for backward, parameters excluded.

    With ``backward=False`` it works under ``FakeTensorMode`` (real shapes, no memory).
    """
    params = {_storage_key(p) for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if _storage_key(t) not in params:
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    if backward:
        out.float().sum().backward()
    return sum(seen.values())


def layer_input(model: ModelSpec, seq_len: int, batch: int, tp: int, sequence_parallel: bool, dtype=torch.bfloat16):
    s = seq_len // tp if sequence_parallel else seq_len
    return torch.randn(batch, s, model.hidden_size, dtype=dtype, requires_grad=True)
