"""BLOOM-176B's measured training step under Megatron-DeepSpeed against plan3d's prediction (DeepSpeed's time model).

Run: python benchmarks/bloom_deepspeed.py

Data: benchmarks/data/bloom_176b_tr11.json (BigScience's tr11-176B-ml README: the log line of iteration 85376, 104.70
s per step of 2048 x 2048 tokens on 384 A100 80GB, 149.77 hardware TFLOP/s). The plan is read from the run's own
Slurm script (tests/data/launch/real/bigscience_tr11-176B-ml.slurm) by ``plan3d check``'s reader, as a user would:
TP 4, PP 12 (DeepSpeed's ``type:transformer|embedding`` partition: 5, 6 x 10, 5), DP 8, micro-batch 2, full
recompute, no sequence parallelism, materialised ALiBi attention, bf16 with BF16_Optimizer at ZeRO stage 0, DeepSpeed's
bf16 gradient reduction (its default ``communication_data_type``). The run's GPUs are the a100-80gb profile's; its
network is Jean Zay's Omni-Path (4 x 100 Gb/s per node of 8 GPUs), given as the profile with that per-GPU rate and,
for comparison, the profile's DGX A100 InfiniBand as it is.

Prints the predicted step, its error against the measured one (negative: plan3d is optimistic), the breakdown, and
the predicted memory next to the run's stated reading. Nothing is fitted to this run; it asserts nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.check import check_file_branches  # noqa: E402
from planner.cost import estimate_time  # noqa: E402
from planner.memory import GIB, estimate_scenario_memory  # noqa: E402
from planner.presets import load_hardware  # noqa: E402

DATA = ROOT / "benchmarks/data/bloom_176b_tr11.json"
LAUNCH = ROOT / "tests/data/launch/real/bigscience_tr11-176B-ml.slurm"


def main() -> None:
    data = json.loads(DATA.read_text())
    measured = data["measured"]["step_time_s"]
    base = load_hardware(data["hardware"]["base"])
    networks = {"Jean Zay Omni-Path": base.model_copy(
        update={"inter_node_bandwidth_gbps": data["hardware"]["inter_node_bandwidth_gbps"]}),
        "profile as is (DGX A100 InfiniBand)": base}
    print(f"BLOOM-176B, 384 x A100 80GB, Megatron-DeepSpeed: measured {measured:.2f} s per step "
          f"({data['measured']['tflops_per_gpu_hardware']} hardware TFLOP/s)")
    for name, hw in networks.items():
        (r,) = check_file_branches(LAUNCH, hw, None, None)
        sc = r.scenario
        t = estimate_time(sc.model, sc.hardware, sc.training, sc.plan)
        terms = ", ".join(f"{k} {v:.2f}" for k, v in t.breakdown.items() if v)
        print(f"  {name:38s} {sc.plan.label()} ({sc.training.framework}, ZeRO {sc.plan.zero_stage}, "
              f"{'bf16' if sc.training.grad_reduce_in_bf16 else 'fp32'} reduction): predicted {t.step_time_s:6.2f} s, "
              f"error {100 * (t.step_time_s / measured - 1):+5.1f} %  ({terms}; HFU {100 * t.hfu:.1f} %)")
    mem = estimate_scenario_memory(sc)
    reading = data["memory_reading"]
    print(f"  memory: predicted peak {mem.peak_gib:.1f} GiB ({mem.peak_gib * GIB / 1e9:.1f} GB) allocated on stage "
          f"{mem.peak.stage}, usable {mem.usable_gib:.1f} GiB; stated reading {reading['gb_per_gpu']} GB per GPU "
          f"({reading['note']})")


if __name__ == "__main__":
    main()
