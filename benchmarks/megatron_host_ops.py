"""Count the operators Megatron-Core's own MoE layer issues per micro-batch, forward and backward, on the CPU.

Run: PYTHONPATH=<Megatron-LM checkout> python benchmarks/megatron_host_ops.py [--json]

Why: a MoE layer with small per-expert GEMMs can be bound by the host (each operator costs CPU time to
dispatch and launch, and the dropless all-to-all dispatcher synchronises host and device every layer), so
``planner.cost`` needs the number of operators the framework issues. This script measures it on the real
library rather than counting by hand: it builds Megatron-Core's ``MoELayer`` (``--moe-token-dispatcher-type
alltoall``, ``SequentialMLP`` experts: the path that runs without Transformer Engine) in one gloo process,
runs a forward and a backward under a ``TorchDispatchMode`` that records every aten operator, and splits them
into operators that launch a kernel on a GPU and view/metadata operators (``OpOverload.is_view`` and the
aliasing ops ``t``/``detach``/``split``), which launch nothing. CUDA streams and events, which the dispatcher
uses to copy the token counts to the host, are stood in by no-op objects (there is no GPU here); that changes
no operator count. The counts are linear in the number of local experts, so the script reports a base and a
per-expert slope, fitted on two expert counts and checked on a third.

Prints (or with ``--json`` writes to stdout) ``{"fwd_kernel_base": ..., "fwd_kernel_per_expert": ...,
"fwd_view_base": ..., ...}``, and the host time per kernel-launching operator measured on this CPU
(``host_us_per_kernel_op_this_cpu``, :func:`host_us_per_op`), the figure ``host_launch_us`` stands for. ``tests/test_host_overhead.py`` runs it and checks the constants that
``planner.cost`` carries (``MOE_HOST_OPS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import warnings
from collections import Counter

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _NoStream:
    """Stands in for torch.cuda.Stream/Event on a CPU-only build (no operator is issued by them)."""

    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: self

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _shim_cuda() -> None:
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a: _NoStream()
    torch.cuda.current_device = lambda: "cpu"


_ALIASING = {"t", "detach", "split", "split_with_sizes", "chunk", "unbind", "alias", "_unsafe_view"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernel, self.view = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        (self.view if func.is_view or name in _ALIASING else self.kernel)[name] += 1
        return func(*args, **(kwargs or {}))


def _layer(local_experts: int, top_k: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
                            num_moe_experts=local_experts, moe_router_topk=top_k, moe_ffn_hidden_size=64,
                            moe_token_dispatcher_type="alltoall", gated_linear_unit=True, add_bias_linear=False,
                            normalization="RMSNorm", use_cpu_initialization=True, params_dtype=torch.float32,
                            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3)
    spec = get_gpt_layer_local_spec(num_experts=local_experts, moe_grouped_gemm=False, normalization="RMSNorm")
    return TransformerLayer(cfg, spec.submodules).mlp


#: The forward's kernel count when the dispatcher reaches its host sync (see :func:`_mark_sync`).
_AT_SYNC: list[int] = []


def _mark_sync(active: list) -> None:
    """Record, in ``_AT_SYNC``, how many kernel-launching operators the forward has issued when the alltoall
    dispatcher reaches ``before_ep_alltoall``: the point where, with expert parallelism (ep > 1, the runs plan3d
    costs), it waits for the token counts it copied to the host (``MoEAlltoAllTokenDispatcher.preprocess`` sets
    ``cuda_sync_point = "before_ep_alltoall"`` when ep > 1; ``_maybe_dtoh_and_synchronize`` then calls
    ``d2h_event.synchronize()``). This one-rank run has ep 1, so the sync itself falls later, but the operators
    issued after that point (the all-to-all, the sort by local expert, the experts, the unsort, the combine) are
    the same; only the position is read here."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    orig = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
    if getattr(orig, "_marked", False):
        return

    def marked(self, point, tokens_per_expert=None):
        if point == "before_ep_alltoall" and active:
            _AT_SYNC.append(sum(active[-1].kernel.values()))
        return orig(self, point, tokens_per_expert)

    marked._marked = True
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = marked


_ACTIVE: list = []


def count(local_experts: int, top_k: int = 2) -> dict[str, int]:
    """Operators of one MoE layer's forward and backward with ``local_experts`` experts on this rank; ``fwd_after_
    sync_kernel``: the forward's kernel-launching operators issued after the dispatcher's host sync."""
    moe = _layer(local_experts, top_k)
    _mark_sync(_ACTIVE)
    x = torch.randn(64, 2, 128, requires_grad=True)
    for _ in range(2):  # the second pass is the one counted (first-call caches settle)
        _AT_SYNC.clear()
        with _Count() as f:
            _ACTIVE.append(f)
            out, _ = moe(x)
            _ACTIVE.pop()
        with _Count() as b:
            out.sum().backward()
    if len(_AT_SYNC) != 1:
        raise SystemExit(f"expected one pass through before_ep_alltoall in the forward, got {len(_AT_SYNC)}")
    out = {"fwd_kernel": sum(f.kernel.values()), "fwd_view": sum(f.view.values()),
           "bwd_kernel": sum(b.kernel.values()), "bwd_view": sum(b.view.values()),
           "fwd_after_sync_kernel": sum(f.kernel.values()) - _AT_SYNC[0]}
    # the router alone (Megatron's ``moe_router`` CUDA-graph scope): its forward, and the backward from its probs
    for _ in range(2):
        with _Count() as f:
            probs, _ = moe.router(x.detach().requires_grad_())
        with _Count() as b:
            probs.sum().backward()
    out |= {"router_fwd_kernel": sum(f.kernel.values()), "router_fwd_view": sum(f.view.values()),
            "router_bwd_kernel": sum(b.kernel.values()), "router_bwd_view": sum(b.view.values())}
    return out


def linear_in_experts(counts: dict[int, dict[str, int]], prefix: str = "") -> dict[str, int]:
    """Each count of ``counts`` (measured at 4, 8 and 16 local experts) as ``<prefix><key>_base`` and
    ``_per_expert``: the slope from 4 to 8 experts, checked at 16 (a count not linear in the experts stops)."""
    a, b, c = counts[4], counts[8], counts[16]
    out = {}
    for key in a:
        slope = (b[key] - a[key]) / 4
        base = a[key] - 4 * slope
        if base + 16 * slope != c[key]:
            raise SystemExit(f"{prefix}{key}: not linear in the expert count ({a[key]}, {b[key]}, {c[key]})")
        out[f"{prefix}{key}_base"], out[f"{prefix}{key}_per_expert"] = int(base), int(slope)
    return out


def host_us_per_op(local_experts: int = 16, repeats: int = 50) -> tuple[float, float]:
    """(forward, backward) wall-clock microseconds per kernel-launching operator of one MoE layer on this CPU,
    with tensors so small that the time is the host's: Python, Megatron's own code, the aten dispatcher and
    the view operators between the kernels, not yet the CUDA launch itself (a few microseconds more on a GPU
    host). One thread; the second and later passes are timed."""
    import time

    torch.set_num_threads(1)
    moe = _layer(local_experts, 2)
    x = torch.randn(8, 1, 128, requires_grad=True)
    for _ in range(5):
        out, _ = moe(x)
        out.sum().backward()
    fwd = bwd = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, _ = moe(x)
        t1 = time.perf_counter()
        out.sum().backward()
        fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
    ops = count(local_experts)
    return 1e6 * fwd / repeats / ops["fwd_kernel"], 1e6 * bwd / repeats / ops["bwd_kernel"]


def measure() -> dict:
    _shim_cuda()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # core_v0.16.1 names it only when TE imports
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(1, 1)
    out = linear_in_experts({e: count(e) for e in (4, 8, 16)})
    out["megatron"] = "core_v0.16.1 MoELayer, alltoall dispatcher, SequentialMLP, aux-loss router, top-2"
    fwd_us, bwd_us = host_us_per_op()
    out["host_us_per_kernel_op_this_cpu"] = {"fwd": round(fwd_us, 1), "bwd": round(bwd_us, 1)}
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    try:
        import megatron.core  # noqa: F401
    except ImportError:  # `make bench` runs every benchmark; this one needs a Megatron-LM checkout
        print("megatron_host_ops: skipped, Megatron-LM is not importable (put a checkout, e.g. the one in "
              "../shared/consumers, on PYTHONPATH)")
        sys.exit(0)
    result = measure()
    print(json.dumps(result, indent=1) if "--json" in sys.argv else
          "\n".join(f"{k:24} {v}" for k, v in result.items()))
