"""Megatron-LM's own functional tests on DGX H100: plan3d's predicted peak allocated memory against NVIDIA's readings.

Run: python benchmarks/megatron_functional_memory.py

Data: benchmarks/data/megatron_functional_h100.json (NVIDIA/Megatron-LM ``tests/functional_tests/test_cases``: each
case's ``model_config.yaml`` as written and the ``mem-max-allocated-bytes`` of its ``golden_values_dev_dgx_h100.json``,
with the commits read). Each case's arguments are written as the ``torchrun pretrain_gpt.py`` line Megatron's test
runner builds from them and read by ``plan3d check`` (``planner.check.check_file``) on the h100-sxm-80gb profile and
the recipe's 8 GPUs, as a user's CI gate would read them. The reading is the peak allocated bytes of the last rank
(the TensorBoard writer's), so it is compared with the last pipeline stage's predicted total (allocated; no
fragmentation headroom, no CUDA context or NCCL buffers, which the caching allocator does not count). Nothing was set
from these readings. Error = predicted / measured - 1 (negative: plan3d under-predicts, the direction a false "fits"
comes from). Then the same for each case's DGX A100 and GB200 readings where its folder holds one (``case["a100"]``:
``golden_values_dev_dgx_a100.json`` or the LTS one, on the a100-80gb profile; ``case["gb200"]``:
``golden_values_dev_dgx_gb200.json``, on gb200-nvl72; ``OTHER_GPUS``). It asserts nothing
(``tests/test_megatron_functional_memory.py`` holds the figures).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.check import check_file  # noqa: E402
from planner.memory import GIB  # noqa: E402
from planner.presets import load_hardware  # noqa: E402

DATA = ROOT / "benchmarks/data/megatron_functional_h100.json"
MIB = 2**20
#: the other GPUs' readings of the same cases (``case[key]``) and the profile each is read on
OTHER_GPUS = (("a100", "a100-80gb"), ("gb200", "gb200-nvl72"))


def cases() -> list[dict]:
    return json.loads(DATA.read_text())["cases"]


def launch_script(case: dict) -> str:
    """The case as a bash launch: its ENV_VARS exported, then ``torchrun ... pretrain_gpt.py`` with MODEL_ARGS as
    NVIDIA's CI harness passes them (``tests/functional_tests/shell_test_utils/_run_training.sh`` at 02cf07f886):
    ``true`` as a bare flag, ``false`` left out, a value in square brackets as its space-separated words (the
    harness strips the brackets: ``--recompute-modules: "[moe_act mlp]"`` runs as ``--recompute-modules moe_act
    mlp``), every other value as one word as written."""
    words = []
    for key, value in case["model_args"].items():
        if value is True:
            words.append(key)
        elif isinstance(value, str) and re.fullmatch(r"\[[^]]+\]", value.strip()):
            words += [key, *value.strip()[1:-1].split()]
        elif value is not False:
            words += [key, str(value)]
    env = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in case["env_vars"].items())
    return (f"#!/bin/bash\n{env}torchrun --nproc-per-node {case['gpus']} pretrain_gpt.py "
            + " ".join(shlex.quote(w) for w in words) + "\n")


def predict(case: dict, folder: Path, hardware: str = "h100-sxm-80gb"):
    """(plan3d check's result, predicted bytes of the last pipeline stage) for one case on ``hardware`` (the case's
    DGX H100 reading; ``OTHER_GPUS`` for its other readings)."""
    path = folder / f"{case['case']}.sh"
    path.write_text(launch_script(case))
    result = check_file(path, load_hardware(hardware), None, case["gpus"])
    if result.errors or result.scenario is None:
        return result, None
    return result, result.memory().stages[-1].total_bytes


def main() -> None:
    errors = []
    with tempfile.TemporaryDirectory(prefix="plan3d-megatron-functional-") as tmp:
        for case in cases():
            result, predicted = predict(case, Path(tmp))
            measured = case["mem_max_allocated_bytes"]
            if predicted is None:
                print(f"{case['case'][:64]:64s} refused: {'; '.join(result.errors)[:120]}")
                continue
            err = predicted / measured - 1
            errors.append((case["case"], err, measured))
            gap = "  known gap" if "known_gap" in case else ""
            delta_mib = (predicted - measured) / MIB
            print(f"{case['case'][:64]:64s} {result.scenario.plan.label():30s} measured {measured / GIB:6.2f} GiB  "
                  f"predicted {predicted / GIB:6.2f} GiB  {100 * err:+6.1f} %  ({delta_mib:+7.1f} MiB){gap}")
    big = [e for _, e, m in errors if m >= 10 * GIB]
    print(f"{len(errors)} cases: mean |error| {100 * sum(abs(e) for _, e, _ in errors) / len(errors):.1f} %, worst "
          f"{100 * min(e for _, e, _ in errors):+.1f} %; the {len(big)} cases above 10 GiB: mean |error| "
          f"{100 * sum(abs(e) for e in big) / len(big):.1f} %")
    for key, profile in OTHER_GPUS:
        print(f"\nthe same cases' {key} readings (case['{key}']), on the {profile} profile:")
        errors = []
        with tempfile.TemporaryDirectory(prefix=f"plan3d-megatron-functional-{key}-") as tmp:
            for case in cases():
                if key not in case:
                    continue
                result, predicted = predict(case, Path(tmp), profile)
                measured = case[key]["mem_max_allocated_bytes"]
                if predicted is None:
                    print(f"{case['case'][:64]:64s} refused: {'; '.join(result.errors)[:120]}")
                    continue
                err = predicted / measured - 1
                if "known_gap" not in case:
                    errors.append(err)
                gap = "  known gap" if "known_gap" in case else ""
                kind = case[key]["golden_kind"][14:-5]
                print(f"{case['case'][:64]:64s} {kind:14s} measured {measured / GIB:6.2f} GiB  predicted "
                      f"{predicted / GIB:6.2f} GiB  {100 * err:+6.1f} %  ({(predicted - measured) / MIB:+7.1f} MiB){gap}")
        print(f"{len(errors)} {key} readings without the known gaps: mean |error| "
              f"{100 * sum(abs(e) for e in errors) / len(errors):.1f} %, worst {100 * max(errors, key=abs):+.1f} %"
              if errors else f"no {key} readings")


if __name__ == "__main__":
    main()
