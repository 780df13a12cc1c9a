"""Count the operators torchtitan's own MoE layer issues per micro-batch, forward and backward, on the CPU.

Run: python benchmarks/torchtitan_host_ops.py [--json]

Why: ``planner.cost.moe_host_s`` charges a MoE layer the host time to issue its operators where the host, not the
GPU, bounds it. The counts it had came from Megatron-Core's MoE layer (``benchmarks/megatron_host_ops.py``: 6
forward and 13 backward operators per local expert, each expert its own GEMMs) and were charged to every framework.
torchtitan runs its routed experts as three ``torch._grouped_mm`` calls over all local experts at once
(``torchtitan/models/common/moe.py`` ``GroupedExperts``), so its count does not grow with the local experts. This
script measures it on the real library, as the Megatron script does: it builds torchtitan 0.3.0's ``MoE``
(``make_moe_config``, the ``standard`` token dispatcher, softmax router with route_norm, top-2, no shared experts) in
one gloo process, runs a forward and a backward under the same ``TorchDispatchMode`` (kernel-launching operators
apart from view and aliasing operators), once without expert parallelism (``LocalTokenDispatcher``: the EP 1 path)
and once with the all-to-all dispatcher wired to a one-rank EP mesh (``AllToAllTokenDispatcher``: the path of every
ep > 1 run; its collectives and its host copy of the token counts are issued all the same on one rank). The EP
path runs under torchtitan's ``partial_dtensor`` SPMD backend (functional-collective all-to-alls); its default
``spmd_types`` backend issues the same collectives through ``spmd.all_to_all``. Each count is taken at 4, 8 and 16
local experts and reported as a base and a per-expert slope (both measured slopes are 0).

``fwd_after_sync``: the forward operators issued after the host sync of the EP path (``AllToAllTokenDispatcher.
_sync_token_count_exchange``: ``output_splits.to("cpu", non_blocking=False)`` then ``.tolist()``): the dispatch
all-to-all, the permutation, the experts, the combine. The EP 1 path copies nothing to the host.

Prints (or with ``--json`` writes to stdout) the counts; ``tests/test_host_overhead.py`` runs it and checks the
constants that ``planner.cost`` carries (``TORCHTITAN_MOE_HOST_OPS``).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_host_ops import _Count, linear_in_experts  # noqa: E402  (the same operator classification)

DIM, HIDDEN, TOP_K, TOKENS = 128, 64, 2, (2, 64)  # 16-byte aligned rows for torch._grouped_mm on the CPU

#: The forward's kernel count when the EP dispatcher's host sync returns (see :func:`_mark_sync`).
_AT_SYNC: list[int] = []
_ACTIVE: list = []


def _mark_sync() -> None:
    """Record, in ``_AT_SYNC``, how many kernel-launching operators the forward has issued when
    ``AllToAllTokenDispatcher._sync_token_count_exchange`` (the blocking copy of the token counts to the host)
    returns."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    orig = AllToAllTokenDispatcher._sync_token_count_exchange
    if getattr(orig, "_marked", False):
        return

    def marked(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if _ACTIVE:
            _AT_SYNC.append(sum(_ACTIVE[-1].kernel.values()))
        return out

    marked._marked = True
    AllToAllTokenDispatcher._sync_token_count_exchange = marked


def _layer(local_experts: int, ep_mesh):
    from torch import nn
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config

    init = {"weight": functools.partial(nn.init.normal_, std=0.02)}
    cfg = make_moe_config(
        num_experts=local_experts,
        router=make_router_config(dim=DIM, num_experts=local_experts, gate_param_init=init, top_k=TOP_K,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=DIM, hidden_dim=HIDDEN, num_experts=local_experts, top_k=TOP_K,
                                                  param_init=init, comm_backend="standard"))
    moe = cfg.build()
    for p in moe.parameters():
        nn.init.normal_(p, std=0.02)
    for b in moe.buffers():
        b.zero_()
    if ep_mesh is not None:
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return moe.train()


def count(local_experts: int, ep_mesh=None) -> dict[str, int]:
    """Operators of one MoE layer's forward and backward with ``local_experts`` experts; with ``ep_mesh`` the EP
    path and ``fwd_after_sync_kernel``."""
    moe = _layer(local_experts, ep_mesh)
    x = torch.randn(*TOKENS, DIM, requires_grad=True)
    for _ in range(2):  # the second pass is the one counted (first-call caches settle)
        _AT_SYNC.clear()
        with _Count() as f:
            _ACTIVE.append(f)
            out = moe(x)
            _ACTIVE.pop()
        with _Count() as b:
            out.float().sum().backward()
    out = {"fwd_kernel": sum(f.kernel.values()), "fwd_view": sum(f.view.values()),
           "bwd_kernel": sum(b.kernel.values()), "bwd_view": sum(b.view.values())}
    if ep_mesh is not None:
        if len(_AT_SYNC) != 1:
            raise SystemExit(f"expected one host sync in the EP forward, got {len(_AT_SYNC)}")
        out["fwd_after_sync_kernel"] = out["fwd_kernel"] - _AT_SYNC[0]
    elif _AT_SYNC:
        raise SystemExit("the EP 1 forward went through the EP dispatcher's host sync")
    return out


def measure() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    import torchtitan
    import torchtitan.distributed.utils as tt_dist
    from torch.distributed.device_mesh import init_device_mesh

    _mark_sync()
    tt_dist.set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    out = linear_in_experts({e: count(e) for e in (4, 8, 16)}, "local_")
    out |= linear_in_experts({e: count(e, mesh) for e in (4, 8, 16)}, "ep_")
    out["torchtitan"] = (f"torchtitan {getattr(torchtitan, '__version__', '?')} MoE (make_moe_config), standard "
                         "dispatcher, softmax router with route_norm, top-2, no shared experts; torch "
                         f"{torch.__version__}")
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    try:
        import torchtitan  # noqa: F401
    except ImportError:  # `make bench` runs every benchmark; this one needs torchtitan (requirements-consumers.txt)
        print("torchtitan_host_ops: skipped, torchtitan is not importable (pip install -r requirements-consumers.txt)")
        sys.exit(0)
    result = measure()
    print(json.dumps(result, indent=1) if "--json" in sys.argv else
          "\n".join(f"{k:32} {v}" for k, v in result.items()))
