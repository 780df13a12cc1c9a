"""One estimate of a scenario: memory per stage, FLOPs and step time.

``Estimate.to_dict`` is the JSON contract of ``plan3d estimate --json`` (docs/estimate-json.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost import TimeEstimate, estimate_time
from planner.memory import MemoryEstimate, estimate_memory
from planner.specs import Scenario

PLAN_KEYS = ("tp", "pp", "dp", "cp", "vpp", "micro_batch_size", "num_microbatches", "recompute", "recompute_num_layers",
             "recompute_interval", "recompute_group_layers", "sequence_parallel", "zero_stage", "layers_per_stage", "microbatch_group_size", "ep",
             "etp", "pipeline_schedule", "cpu_offload_layers")


@dataclass(frozen=True)
class Estimate:
    scenario: Scenario
    memory: MemoryEstimate
    model_flops_per_step: float
    hardware_flops_per_step: float
    time: TimeEstimate

    def plan_dict(self) -> dict:
        plan = self.scenario.resolved_plan().model_dump()
        if self.scenario.plan.schedule == "interleaved" and plan["microbatch_group_size"] is None:
            plan["microbatch_group_size"] = plan["pp"]  # Megatron's default N (planner/schedules.py)
        return {k: (list(plan[k]) if k == "layers_per_stage" else plan[k]) for k in PLAN_KEYS}

    def to_dict(self) -> dict:
        return {
            "plan": self.plan_dict(),
            "memory": self.memory.to_dict(),
            "flops": {"model_flops_per_step": self.model_flops_per_step,
                      "hardware_flops_per_step": self.hardware_flops_per_step},
            "time": self.time.to_dict() | {"range": self.time_range()},
        }

    def time_range(self) -> dict:
        """The step time's range from the spread of its sources and the calibration runs (planner/uncertainty.py)."""
        from planner.uncertainty import time_range

        return time_range(self.time.step_time_s, self.time.breakdown, moe=self.scenario.model.is_moe)


def estimate(sc: Scenario) -> Estimate:
    """Memory, FLOPs and step time of a scenario (pure); the FLOPs are the ones the step time's rates are of
    (``cost.TimeEstimate``: Megatron's count at its padded vocabulary, with and without the recompute)."""
    time = estimate_time(sc.model, sc.hardware, sc.training, sc.plan)
    return Estimate(
        scenario=sc,
        memory=estimate_memory(sc.model, sc.hardware, sc.training, sc.plan),
        model_flops_per_step=time.model_flops_per_step,
        hardware_flops_per_step=time.hardware_flops_per_step,
        time=time,
    )
