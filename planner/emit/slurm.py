"""A Slurm batch script for a plan: one torchrun per node through srun, running Megatron-LM or `plan3d validate`.

Slurm's own directives (``sbatch`` man page): ``--nodes``, ``--ntasks-per-node``, ``--gpus-per-node``,
``--exclusive``, and ``--segment`` on NVL72 hardware (:func:`segment_nodes`). NCCL environment: ``NCCL_DEBUG`` and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (PyTorch),
``CUDA_DEVICE_MAX_CONNECTIONS`` as Megatron-LM's ``validate_args`` demands (``megatron.env_lines``).
The job name is the file stem, a slug (``planner.names.slug``): nothing from a model name reaches
the shell unquoted.
"""

from __future__ import annotations

from planner.emit import megatron, torchrun
from planner.names import slug
from planner.specs import Scenario


def segment_nodes(sc: Scenario) -> int | None:
    """Nodes per segment for Slurm's block topology (``sbatch --segment``) on hardware whose NVLink domain spans
    nodes (GB200/GB300 NVL72: 18 trays of 4 GPUs), so that the job is placed as the plan assumes, each
    ``HardwareSpec.job_nvlink_domain`` inside one rack: 16 nodes (64 GPUs) for a job in 64-GPU segments, 18 for
    one that fills whole racks, the whole job when it fits in one. Slurm's topology/block plugin places a job's
    segments each inside one block (NVIDIA technical blog on Slurm block scheduling for GB200 NVL72; CoreWeave
    SUNK docs: one block per NVL72 rack, 16 to 18 nodes). None where the domain is one node (DGX/HGX) or the
    node count is not a multiple of the segment (Slurm allocates whole segments)."""
    hw = sc.hardware
    if hw.nvlink_domain <= hw.gpus_per_node:
        return None
    n, per_node = torchrun.nodes(sc)
    segment = min(n, hw.job_nvlink_domain(sc.training.num_gpus) // per_node)
    return segment if n % segment == 0 else None


def render(sc: Scenario, plan_file: str) -> str:
    n, per_node = torchrun.nodes(sc)
    segment = segment_nodes(sc)
    topology = (f"#SBATCH --segment={segment}            # topology/block: {segment} nodes inside one NVLink domain, "
                "as the plan's layout assumes\n") if segment else ""
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
{topology}{megatron.header(sc, "Slurm job")}# MODE=train (default) runs Megatron-LM pretrain_gpt.py; MODE=validate runs `plan3d validate` on the plan file.
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
