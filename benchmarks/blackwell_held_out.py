"""Held-out check on Blackwell: predicted against published Llama-3-70B pre-training throughput on
GB200/GB300 NVL72 in NVFP4 and MXFP8 (issue 18).

Run: python benchmarks/blackwell_held_out.py

Data, source and what the table leaves out: benchmarks/data/nemo_blackwell.json. Nothing in
planner/ or hardware_profiles/ was fitted to these rows. Prints each run's error, fit and the mean
and worst absolute error; it asserts nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.estimate import estimate  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.specs import Plan, Scenario, TrainingSpec  # noqa: E402


def main() -> None:
    data = json.loads((ROOT / "benchmarks/data/nemo_blackwell.json").read_text())
    errors = []
    for r in data["runs"]:
        dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
        training = TrainingSpec(num_gpus=r["gpus"], global_batch_size=r["gbs"], seq_len=r["seq"],
                                precision=r["precision"], framework="nemo")
        plan = Plan(tp=r["tp"], pp=r["pp"], dp=dp, cp=r["cp"], vpp=r["vp"], micro_batch_size=r["mbs"],
                    sequence_parallel=r["tp"] > 1, zero_stage=1)
        est = estimate(Scenario(model=load_model(r["model"]), hardware=load_hardware(r["hardware"]),
                                training=training, plan=plan))
        predicted = est.time.tokens_per_s / r["gpus"]
        err = predicted / r["tokens_per_s_per_gpu"] - 1
        errors.append(err)
        print(f"{r['system']:<10} {r['precision']:<6} {plan.label():<24} published {r['tokens_per_s_per_gpu']:>6} "
              f"tokens/s/GPU, predicted {predicted:>7.0f} ({100 * err:+6.1f} %), peak {est.memory.peak_gib:6.1f} of "
              f"{est.memory.usable_gib:.1f} GiB ({'fits' if est.memory.fits else 'does NOT fit'})")
    mean = sum(abs(e) for e in errors) / len(errors)
    print(f"mean |error| {100 * mean:.1f} %, worst {100 * max(errors, key=abs):+.1f} % over {len(errors)} runs "
          "(issue 18 target: mean <= 10 %, worst <= 25 %)")


if __name__ == "__main__":
    main()
