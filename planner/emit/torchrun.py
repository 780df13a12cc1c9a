"""torchrun command lines for a plan: single node (``--standalone``) or multi-node with c10d rendezvous.

torchrun's own option names (``torch.distributed.run``): ``--nnodes``, ``--nproc-per-node``,
``--rdzv-backend``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--standalone``.
"""

from __future__ import annotations

import math

from planner.emit import megatron
from planner.specs import Scenario


def nodes(sc: Scenario) -> tuple[int, int]:
    """(nodes, GPUs per node) the job needs."""
    per_node = min(sc.hardware.gpus_per_node, sc.training.num_gpus)
    return math.ceil(sc.training.num_gpus / per_node), per_node


def launcher(sc: Scenario) -> str:
    """The torchrun prefix; multi-node jobs read MASTER_ADDR/MASTER_PORT/JOB_ID from the environment."""
    n, per_node = nodes(sc)
    if n == 1:
        return f"torchrun --standalone --nnodes 1 --nproc-per-node {per_node}"
    return (f'torchrun --nnodes {n} --nproc-per-node {per_node} --rdzv-backend c10d '
            f'--rdzv-endpoint "${{MASTER_ADDR:?set MASTER_ADDR}}:${{MASTER_PORT:-29500}}" '
            f'--rdzv-id "${{JOB_ID:-plan3d}}"')


def render(sc: Scenario) -> str:
    """Megatron-LM under torchrun, runnable on each node as it is."""
    return megatron.render(sc, launcher(sc))
