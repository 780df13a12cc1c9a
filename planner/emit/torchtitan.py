"""A torchtitan launch for a plan, in the form torchtitan 0.3 accepts: ``--module``/``--config`` plus
``--section.option`` overrides parsed by its ``ConfigManager`` (tyro).

Option names are torchtitan's (``torchtitan/config/configs.py::ParallelismConfig``, ``TrainingConfig``;
``activation_checkpoint:{none,selective,full}`` subcommands). Mapping: DP without ZeRO is
``data_parallel_replicate_degree``; ZeRO 2/3 is FSDP2 over ``data_parallel_shard_degree``
(``fsdp_reshard_after_forward = never`` for 2). torchtitan has no optimizer-only sharding, so
ZeRO 1 is written as ZeRO 2. torchtitan's selective recompute is per-op SAC, not Megatron's
attention-core recompute.
"""

from __future__ import annotations

from planner.emit import megatron, torchrun
from planner.presets import SpecError
from planner.specs import Scenario

# plan3d preset -> (torchtitan --module, --config)
REGISTRY = {"llama3-8b": ("llama3", "llama3_8b"), "llama3-70b": ("llama3", "llama3_70b"),
            "llama3-405b": ("llama3", "llama3_405b")}


def args(sc: Scenario) -> list[str]:
    if sc.model.name not in REGISTRY:
        raise SpecError(f"--emit torchtitan: torchtitan ships no model for {sc.model.name}; "
                        f"it has {', '.join(sorted(REGISTRY))} among plan3d's presets")
    p, tr = sc.resolved_plan(), sc.training
    module, config = REGISTRY[sc.model.name]
    sharded = p.zero_stage >= 1 and p.dp > 1
    out = ["--module", module, "--config", config,
           "--parallelism.data_parallel_replicate_degree", str(1 if sharded else p.dp),
           "--parallelism.data_parallel_shard_degree", str(p.dp if sharded else 1),
           "--parallelism.fsdp_reshard_after_forward", "default" if p.zero_stage >= 3 else "never",
           "--parallelism.tensor_parallel_degree", str(p.tp),
           "--parallelism.enable-sequence-parallel" if p.sequence_parallel else "--parallelism.no-enable-sequence-parallel",
           "--parallelism.pipeline_parallel_degree", str(p.pp),
           "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B" if p.vpp > 1 else "1F1B",
           "--parallelism.pipeline_parallel_microbatch_size", str(p.micro_batch_size),
           "--parallelism.context_parallel_degree", str(p.cp),
           "--training.local_batch_size", str(p.micro_batch_size * p.num_microbatches),
           "--training.global_batch_size", str(tr.global_batch_size),
           "--training.seq_len", str(tr.seq_len)]
    if p.pp > 1:
        if sc.plan.layers_per_stage is None:
            out += ["--parallelism.pipeline_parallel_layers_per_stage", str(sc.model.num_layers // (p.pp * p.vpp)),
                    "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
                    "--parallelism.pipeline_parallel_last_stage_less_layers", "0"]
        else:
            mid = p.layers_per_stage[1] if p.pp > 2 else max(p.layers_per_stage)
            if max(p.layers_per_stage[0], p.layers_per_stage[-1]) > mid:
                raise SpecError("--emit torchtitan: torchtitan can only give the first and last stages fewer "
                                f"layers, not {list(p.layers_per_stage)}")
            out += ["--parallelism.pipeline_parallel_layers_per_stage", str(mid),
                    "--parallelism.pipeline_parallel_first_stage_less_layers", str(mid - p.layers_per_stage[0]),
                    "--parallelism.pipeline_parallel_last_stage_less_layers", str(mid - p.layers_per_stage[-1])]
        out.append("--training.disable_cuda_graphs")  # torchtitan: CUDA graphs do not support PP yet
    out.append(f"activation_checkpoint:{p.recompute}")
    return out


def render(sc: Scenario) -> str:
    lines = " \\\n  ".join(args(sc))
    return f"""#!/usr/bin/env bash
{megatron.header(sc, "torchtitan training")}set -euo pipefail
{torchrun.launcher(sc)} -m torchtitan.train \\
  {lines} "$@"
"""
