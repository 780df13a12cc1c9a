"""A Slurm batch script for a plan: one torchrun per node through srun, running Megatron-LM or `plan3d validate`.

Slurm's own directives (``sbatch`` man page): ``--nodes``, ``--ntasks-per-node``, ``--gpus-per-node``,
``--exclusive``. NCCL environment: ``NCCL_DEBUG`` and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (PyTorch),
``CUDA_DEVICE_MAX_CONNECTIONS`` as Megatron-LM's ``validate_args`` demands (``megatron.env_lines``).
The job name is the file stem, a slug (``planner.names.slug``): nothing from a model name reaches
the shell unquoted.
"""

from __future__ import annotations

from planner.emit import megatron, torchrun
from planner.names import slug
from planner.specs import Scenario


def render(sc: Scenario, plan_file: str) -> str:
    n, per_node = torchrun.nodes(sc)
    stem = f"{slug(sc.model.name)}_{sc.plan.label()}"
    if slug(plan_file) != plan_file:  # written inside double quotes below: only slug characters may appear
        raise ValueError(f"plan file name {plan_file!r} is not a slug")
    return f"""#!/bin/bash
#SBATCH --job-name=plan3d-{stem}
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
{megatron.header(sc, "Slurm job")}# MODE=train (default) runs Megatron-LM pretrain_gpt.py; MODE=validate runs `plan3d validate` on the plan file.
set -euo pipefail
MODE="${{MODE:-train}}"
PLAN_FILE="${{PLAN_FILE:-{plan_file}}}"
MEGATRON_LM="${{MEGATRON_LM:-$PWD/Megatron-LM}}"

MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${{MASTER_PORT:-29500}}"
export MASTER_ADDR MASTER_PORT
{megatron.env_lines(sc)}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_DEBUG="${{NCCL_DEBUG:-WARN}}"
# Cluster-specific: set NCCL_SOCKET_IFNAME / NCCL_IB_HCA here if NCCL does not pick the right interfaces.

LAUNCH=(torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {per_node}
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID")

MEGATRON_ARGS=(
{megatron.args_block(megatron.megatron_flags(sc))}
)

if [ "$MODE" = validate ]; then
  srun "${{LAUNCH[@]}}" -m planner.cli validate "$PLAN_FILE" --backend nccl
else
  srun "${{LAUNCH[@]}}" "$MEGATRON_LM/pretrain_gpt.py" "${{MEGATRON_ARGS[@]}}"
fi
"""
