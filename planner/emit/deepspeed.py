"""DeepSpeed JSON config plus the Megatron-DeepSpeed flags for a plan.

Keys are DeepSpeed's (``deepspeed/runtime/config.py``): ``train_batch_size`` =
``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x data-parallel size,
``zero_optimization.stage``, ``bf16.enabled`` / ``fp16.enabled``. Megatron-DeepSpeed's pipeline
engine supports ZeRO stage 0 or 1 only, and it has no context parallelism.
"""

from __future__ import annotations

import json

from planner.emit import megatron
from planner.presets import SpecError
from planner.specs import Scenario


def config(sc: Scenario) -> dict:
    p = sc.resolved_plan()
    return {
        "train_batch_size": sc.training.global_batch_size,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.num_microbatches,
        "zero_optimization": {"stage": p.zero_stage, "overlap_comm": sc.training.overlap_grad_reduce,
                              "contiguous_gradients": True},
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }


def check_supported(sc: Scenario) -> None:
    p = sc.plan
    if p.cp > 1:
        raise SpecError(f"--emit deepspeed: Megatron-DeepSpeed has no context parallelism (plan has cp={p.cp})")
    if p.pp > 1 and p.zero_stage > 1:
        raise SpecError(f"--emit deepspeed: DeepSpeed's pipeline engine takes ZeRO 0 or 1, not {p.zero_stage} with pp={p.pp}")
    if sc.training.precision == "fp8":
        raise SpecError("--emit deepspeed: the Megatron-DeepSpeed config written here has no fp8 recipe; use bf16")


def render_config(sc: Scenario) -> str:
    check_supported(sc)
    return json.dumps(config(sc), indent=2) + "\n"


def render_args(sc: Scenario, config_name: str) -> str:
    """Megatron-DeepSpeed ``pretrain_gpt.py`` flags: the Megatron model/TP/PP flags plus DeepSpeed's."""
    check_supported(sc)
    drop = {"--use-distributed-optimizer", "--overlap-param-gather", "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy", "--attention-backend", "--context-parallel-size"}
    flags = [f for f in megatron.megatron_flags(sc) if f[0] not in drop]
    flags += [("--deepspeed", None), ("--deepspeed_config", config_name), ("--zero-stage", str(sc.plan.zero_stage))]
    body = megatron.args_block(flags, indent="").replace('"${TRAIN_ITERS:-20}"', "20")
    return megatron.header(sc, "Megatron-DeepSpeed pretrain_gpt.py arguments") + body + "\n"
