"""HBM traffic and kernel launches of torchtitan's eager Llama 3 block and loss, counted on torchtitan's own code
on the CPU (issue 12: memory-bound operations as the framework runs them).

The block is torchtitan 0.3.0's ``Llama3TransformerBlock`` built by its own ``_build_llama3_layers`` (fused QKV, as
``model_registry`` builds every Llama 3 flavour; ``ComplexRoPE``; ``nn.RMSNorm``; ``FeedForward``
``w2(silu(w1 x) * w3 x)``), in bf16 as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` runs it, wrapped by
torchtitan's own activation checkpointing (``SelectiveAC`` / ``FullAC`` ``_wrap_block``: op-level SAC saves mm and
attention outputs, every second mm recomputed). A ``TorchDispatchMode`` records every ATen operator the forward and
the backward (recompute included) run. What is counted: each operator that launches a memory-bound kernel, with the
bytes of the tensors it reads and writes (a broadcast input at its storage size; the module's parameters, read once
per call, are left out: per token they vanish). What is not: GEMMs (``mm``), the attention kernel (costed by
``planner.cost`` from the measured kernel tables) and view or metadata operators (aliasing outputs,
``_unsafe_view``, ``detach``), which launch nothing.

Two stand-ins, each because the CPU build cannot run the GPU kernel:

* the attention core (torchtitan 0.3.0 runs FlexAttention; any kernel, the operators around it are the block's):
  a custom autograd function over ``F.scaled_dot_product_attention`` whose operators are not counted;
* the norms: on CUDA ``F.rms_norm`` is one fused kernel each way since torch 2.8 (``aten::_fused_rms_norm`` and
  ``_fused_rms_norm_backward``, pytorch/pytorch#153666), while the CPU build decomposes it into about a dozen
  elementwise operators. Each norm is counted as that fused pair with the tensors of its schema (forward: input and
  weight in, output and fp32 ``rstd`` out; backward: output gradient, input, ``rstd`` and weight in, input and
  weight gradients out). ``fused_norm=False`` counts the decomposed operators instead, as CUDA ran them before 2.8
  (torchtitan's published December 2024 runs).

Gather and scatter operators read or write only the selected elements: ``nll_loss_forward`` is counted with its
target indices and output, ``nll_loss_backward`` with its output (the gradient it zero-fills and scatters into).

planner.frameworks.torchtitan carries the per-token coefficients these counts give (``EAGER_BLOCK_BYTES``,
``EAGER_LOSS_BYTES_PER_LOGIT``); tests/test_eager_traffic.py runs this probe and checks them. torch is imported
inside the functions: the planner never imports this module.
"""

from __future__ import annotations

GEMM_OPS = frozenset({"mm", "addmm", "bmm", "linear"})
NO_KERNEL_OPS = frozenset({"_unsafe_view", "detach", "alias", "lift_fresh", "_reshape_alias"})


def _nbytes(t) -> int:
    """Bytes a kernel touches of ``t``: its elements, or its storage where it broadcasts (an expanded view)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class _Counter:
    """Rows (phase, op, bytes read, bytes written) of the kernel-launching memory-bound operators."""

    def __init__(self, torch, params) -> None:
        self.torch = torch
        self.rows: list[tuple[str, str, int, int]] = []
        self.phase = "fwd"
        self.mute = 0
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}

    def add(self, name: str, inputs, outputs) -> None:
        if self.mute:
            return
        read = sum(_nbytes(t) for t in inputs if t.untyped_storage().data_ptr() not in self.param_ptrs)
        self.rows.append((self.phase, name, read, sum(_nbytes(t) for t in outputs)))

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        torch, counter = self.torch, self

        def tensors(x):
            return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func._schema.name.split("::")[1]
                aliases = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
                if counter.mute or aliases or name in GEMM_OPS or name in NO_KERNEL_OPS:
                    return out
                if name.startswith("nll_loss_forward"):  # gathers one logit per row: targets in, loss out
                    counter.add(name, tensors(args[1]), tensors(out))
                elif name.startswith("nll_loss_backward"):  # zero-fills and scatters its output
                    counter.add(name, [], tensors(out))
                else:
                    counter.add(name, tensors((args, kwargs)), tensors(out))
                return out

        return Mode()


def _stand_ins(torch, counter: _Counter):
    """(attention function, fused RMSNorm function): autograd functions whose inner operators are not counted."""
    F = torch.nn.functional

    def sdpa(q, k, v, scale, gqa):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, scale=scale, enable_gqa=gqa).transpose(1, 2)

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale, gqa):
            counter.mute += 1
            try:
                with torch.no_grad():
                    out = sdpa(q, k, v, scale, gqa)
            finally:
                counter.mute -= 1
            ctx.save_for_backward(q, k, v)
            ctx.scale, ctx.gqa = scale, gqa
            return out

        @staticmethod
        def backward(ctx, grad):
            counter.mute += 1
            try:
                q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
                with torch.enable_grad():
                    grads = torch.autograd.grad(sdpa(q, k, v, ctx.scale, ctx.gqa), (q, k, v), grad)
            finally:
                counter.mute -= 1
            return (*grads, None, None)

    def rms(x, w, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * rstd).to(x.dtype) * w, rstd

    class FusedRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, eps):
            counter.mute += 1
            try:
                with torch.no_grad():
                    y, rstd = rms(x, w, eps)
            finally:
                counter.mute -= 1
            counter.add("_fused_rms_norm", [x, w], [y, rstd])
            ctx.save_for_backward(x, w, rstd)
            ctx.eps = eps
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, rstd = ctx.saved_tensors
            counter.mute += 1
            try:
                xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
                with torch.enable_grad():
                    dx, dw = torch.autograd.grad(rms(xx, ww, ctx.eps)[0], (xx, ww), dy)
            finally:
                counter.mute -= 1
            counter.add("_fused_rms_norm_backward", [dy, x, rstd, w], [dx, dw])
            return dx, dw, None

    return Attention, FusedRMSNorm


def block_traffic(recompute: str = "none", fused_norm: bool = True, b: int = 1, s: int = 512, h: int = 256,
                  heads: int = 8, kv_heads: int = 2, ffn: int = 768) -> list[tuple[str, str, int, int]]:
    """Rows (phase "fwd"/"bwd", op, bytes read, bytes written) of one torchtitan Llama 3 block's forward and
    backward (the recompute of ``recompute`` "selective" or "full" inside "bwd") on a ``b x s`` bf16 input.
    Runs forward and backward once to warm up, then once counted (module docstring)."""
    import types

    import torch
    from torchtitan.distributed import activation_checkpoint as ac
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers

    torch.manual_seed(0)
    config = _build_llama3_layers(
        n_layers=1, dim=h, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=ffn, fuse_qkv=True, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=h // heads, max_seq_len=s, theta=500000, scaling="llama"))[0]
    block = config.build()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block = block.to(torch.bfloat16)
    block.attention.rope.cache = block.attention.rope._precompute_cache()
    params = list(block.parameters())
    counter = _Counter(torch, params)
    attention, fused_rms = _stand_ins(torch, counter)

    class StandIn(torch.nn.Module):
        def forward(self, q, k, v, attention_masks=None, scale=None, enable_gqa=False):
            return attention.apply(q, k, v, scale, enable_gqa)

    block.attention.inner_attention = StandIn()
    if fused_norm:
        for m in block.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.forward = types.MethodType(lambda self, x: fused_rms.apply(x, self.weight, self.eps or 1e-5), m)
    if recompute == "selective":
        block = ac.SelectiveAC(ac.SelectiveAC.Config())._wrap_block(block)
    elif recompute == "full":
        block = ac.FullAC(ac.FullAC.Config())._wrap_block(block)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    counter.mute += 1
    block(x, None).sum().backward()  # warm-up, not counted
    counter.mute -= 1
    for p in params:
        p.grad = None
    x.grad = None  # the block's input gradient is written, not accumulated: a leaf's .grad would add an add_
    y = block(x, None)
    grad = torch.ones_like(y)
    counter.rows.clear()
    with counter.mode():
        y = block(x, None)
        counter.phase = "bwd"
        y.backward(grad)
    return counter.rows


def loss_traffic(tokens: int = 512, vocab: int = 4096) -> list[tuple[str, str, int, int]]:
    """Rows of torchtitan 0.3.0's ``cross_entropy_loss`` (``components/loss.py``: ``F.cross_entropy`` over the
    logits cast to fp32, sum reduction) on bf16 logits of ``tokens x vocab``, forward and backward."""
    import torch
    from torchtitan.components.loss import cross_entropy_loss

    torch.manual_seed(0)
    pred = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    counter = _Counter(torch, [])
    with counter.mode():
        loss = cross_entropy_loss(pred, labels)
        counter.phase = "bwd"
        loss.backward(torch.ones_like(loss))
    return counter.rows


def per_token(rows, tokens: int) -> dict[str, float]:
    """Bytes per token and launches of ``rows``, by phase: {"fwd": ..., "bwd": ..., "fwd_kernels": ..., ...}."""
    out = {}
    for phase in ("fwd", "bwd"):
        mine = [r for r in rows if r[0] == phase]
        out[phase] = sum(r[2] + r[3] for r in mine) / tokens
        out[f"{phase}_kernels"] = len(mine)
    return out
