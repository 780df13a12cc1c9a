"""Autograd functions that save for backward exactly what the fused GPU kernels of Megatron-LM save.

Used by the validate model and by the tests that measure saved activations:

* RMSNorm saves its input and the fp32 rstd (Apex/Transformer Engine fused RMSNorm); torch's
  composite ``F.rms_norm`` on the CPU would keep three more tensors.
* LayerNorm saves its input and the fp32 mean and rstd, in bf16 training too, as torch's CUDA kernel
  does (``aten/src/ATen/native/cuda/layer_norm_kernel.cu`` ``layer_norm_cuda``: ``mean``/``rstd`` of
  ``acc_type``, fp32 for a bf16 input). torch's CPU ``F.layer_norm`` keeps them in the input's dtype when
  input and weight share it (``aten/src/ATen/native/layer_norm.cpp`` ``layer_norm_cpu``:
  ``param_scalar_type``), 2 B each under FSDP2's bf16 parameters.
* SwiGLU saves only the FC1 output (Megatron ``bias_swiglu_impl``).
* Dropout saves a 1-byte bool mask, as CUDA's ``native_dropout`` does.
* RoPE saves nothing (Megatron's fused RoPE); cos/sin are constants kept on the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xf, gf = x.float(), grad.float()
        xhat = xf * rstd
        gw = (gf * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gx_hat = gf * weight.float()
        gx = rstd * (gx_hat - xhat * (gx_hat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class LayerNormFn(torch.autograd.Function):
    """LayerNorm over the last dimension that saves the input and the fp32 mean and rstd (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.has_bias = bias is not None  # a LayerNorm without bias (ModelSpec.norm_bias False) saves the same
        y = ((xf - mean) * rstd).to(x.dtype) * weight
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight = ctx.saved_tensors
        gf = grad.float()
        xhat = (x.float() - mean) * rstd
        h = x.shape[-1]
        gw = (gf * xhat).reshape(-1, h).sum(0).to(weight.dtype)
        gb = gf.reshape(-1, h).sum(0).to(weight.dtype) if ctx.has_bias else None
        gx_hat = gf * weight.float()
        gx = rstd * (gx_hat - gx_hat.mean(-1, keepdim=True) - xhat * (gx_hat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, gb, None


class SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up, saving only the FC1 output."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        gate, up = y.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        g = grad.float()
        d_gate = g * up * sig * (1 + gate * (1 - sig))
        d_up = g * gate * sig
        return torch.cat([d_gate, d_up], dim=-1).to(y.dtype)


class GeGLUFn(torch.autograd.Function):
    """gelu(gate) * up (the tanh GeLU, Gemma's ``gelu_pytorch_tanh``), saving only the FC1 output, as
    :class:`SwiGLUFn` and the fused GLU kernels (``planner.memory``: the activation input is the FC1 output)."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        gate, up = y.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        gate, up = y.float().chunk(2, dim=-1)
        with torch.enable_grad():  # the GeLU's derivative from autograd on the fp32 gate (a local graph)
            g = gate.detach().requires_grad_(True)
            act = F.gelu(g, approximate="tanh")
            (d_act,) = torch.autograd.grad(act, g, grad.float() * up)
        d_up = grad.float() * act.detach()
        return torch.cat([d_act, d_up], dim=-1).to(y.dtype)


class DropoutFn(torch.autograd.Function):
    """Dropout that saves a 1-byte bool mask."""

    @staticmethod
    def forward(ctx, x, p):
        mask = torch.rand_like(x, dtype=torch.float32) >= p
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(mask)
        return x * mask * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None


class RopeFn(torch.autograd.Function):
    """Rotary position embedding on ``[b, s, heads, d]`` (cos/sin ``[s, 1, d/2]``); the backward rotates
    the gradient back. Working before the heads are moved forward keeps the attention output in the
    ``[b, s, heads, d]`` layout, so the output projection's input is a view of it (one copy, as in Megatron)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.cos, ctx.sin = cos, sin
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        g1, g2 = grad.chunk(2, dim=-1)
        cos, sin = ctx.cos, ctx.sin
        return torch.cat([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1), None, None


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0, dtype=torch.float32, device="cpu"):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class KeepFn(torch.autograd.Function):
    """Identity that holds its inputs for backward, as a recompute checkpoint holds its inputs.

    ``torch.utils.checkpoint(use_reentrant=False)`` (the only kind torch's pipeline schedules allow)
    keeps the inputs of the recomputed region by reference, outside ``saved_tensors_hooks``. Passing
    them through this function first costs no memory (same storages) and makes the hooks see them.
    """

    @staticmethod
    def forward(ctx, *xs):
        ctx.save_for_backward(*xs)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.saved_tensors  # noqa: B018 - release the held inputs (and let saved_tensors_hooks see it)
        return grads
