"""Sanity bounds on a prediction: the best model-FLOPs utilisation published for a GPU and precision.

A predicted MFU above every published run on that GPU says more about the model's blind spots than
about the plan (issue 12: the search exploits them). ``plan3d estimate`` and ``search`` print a note
when a plan's MFU exceeds the figure here; ``benchmarks/calibration.py`` flags calibration runs the
same way. Model FLOPs over the dense peak of that precision, each figure with its source.
"""

from __future__ import annotations

BEST_PUBLISHED_MFU: dict[tuple[str, str], tuple[float, str]] = {
    ("a100-80gb", "bf16"): (0.542, "Korthikanti et al. 2022 (arXiv:2205.05198) abstract: 530B GPT on 2,240 A100"),
    ("h100-sxm-80gb", "bf16"): (0.47, "Megatron-LM README: up to 47 % MFU on H100 clusters; Llama 3 Table 4: 38-43 %"),
    ("h100-sxm-80gb", "fp8"): (842 / 1978.9, "NeMo 24.07 performance summary: 842 TFLOP/s, GPT-3 175B FP8 on 512 H100"),
}


def mfu_note(hardware_name: str, precision: str, mfu: float) -> str | None:
    """A one-line note when ``mfu`` is above the best published for this GPU and precision, else None."""
    best = BEST_PUBLISHED_MFU.get((hardware_name, precision))
    if best is None or mfu <= best[0]:
        return None
    return (f"note: predicted MFU {100 * mfu:.1f} % is above the best published for {hardware_name} {precision} "
            f"({100 * best[0]:.1f} %, {best[1]}): treat this prediction as optimistic")
