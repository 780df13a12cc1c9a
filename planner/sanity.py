"""Sanity bounds on a prediction: the best model-FLOPs utilisation published for a GPU and precision.

A predicted MFU above every published run on that GPU says more about the model's blind spots than
about the plan (issue 12: the search exploits them). ``plan3d estimate`` and ``search`` print a note
when a plan's MFU exceeds the figure here; ``benchmarks/calibration.py`` flags calibration runs the
same way. Model FLOPs over the dense peak of that precision, each figure with its source.
"""

from __future__ import annotations

BEST_PUBLISHED_MFU: dict[tuple[str, str], tuple[float, str]] = {
    # llm-foundry's MPT benchmarks (benchmarks/data/llm_foundry_mpt.json): MPT-3B at 512 tokens on 8 GPUs, 12,127
    # (80 GB) and 11,324 (40 GB) tokens/s per GPU, by plan3d's count of its model FLOPs (the README's own count, with
    # full s x s attention, gives 63.7 and 59.5 %); above Korthikanti et al. 2022's 54.2 % (530B GPT on 2,240 A100),
    # the figure here before 2026-12-07 (tests/test_llm_foundry_data.py)
    ("a100-80gb", "bf16"): (0.627, "llm-foundry MPT benchmarks: 3B at 512 tokens, 12,127 tokens/s per GPU on 8 A100 80GB"),
    ("a100-40gb", "bf16"): (0.585, "llm-foundry MPT benchmarks: 3B at 512 tokens, 11,324 tokens/s per GPU on 8 A100 40GB"),
    ("h100-sxm-80gb", "bf16"): (0.47, "Megatron-LM README: up to 47 % MFU on H100 clusters; Llama 3 Table 4: 38-43 %"),
    ("h100-sxm-80gb", "fp8"): (842 / 1978.9, "NeMo 24.07 performance summary: 842 TFLOP/s, GPT-3 175B FP8 on 512 H100"),
    # Blackwell: the best dense (Llama 3 / 3.1) row of NVIDIA's Megatron-Bridge performance summary, model
    # TFLOP/s per GPU over the profile's dense peak (benchmarks/data/megatron_bridge_perf.json)
    ("b200-180gb", "fp8"): (1676 / 4500, "Megatron-Bridge 25.09: 1,676 TFLOP/s, Llama 3.1 405B FP8 on 128 B200"),
    ("b200-180gb", "mxfp8"): (1576 / 4500, "Megatron-Bridge 25.11: 1,576 TFLOP/s, Llama 3.1 405B MXFP8 on 128 B200"),
    ("gb200-nvl72", "fp8"): (2126 / 5000, "Megatron-Bridge 26.04: 2,126 TFLOP/s, Llama 3.1 405B FP8 on 256 GB200"),
    ("gb200-nvl72", "mxfp8"): (2002 / 5000, "Megatron-Bridge 26.04: 2,002 TFLOP/s, Llama 3.1 405B MXFP8 on 256 GB200"),
    ("gb200-nvl72", "nvfp4"): (2891 / 10000, "Megatron-Bridge 26.02: 2,891 TFLOP/s, Llama 3.1 405B NVFP4 on 256 GB200"),
    ("gb300-nvl72", "fp8"): (2615 / 5000, "Megatron-Bridge 26.04: 2,615 TFLOP/s, Llama 3.1 405B FP8 on 256 GB300"),
    ("gb300-nvl72", "mxfp8"): (2443 / 5000, "Megatron-Bridge 26.04: 2,443 TFLOP/s, Llama 3.1 405B MXFP8 on 256 GB300"),
    ("gb300-nvl72", "nvfp4"): (3594 / 15000, "Megatron-Bridge 26.04: 3,594 TFLOP/s, Llama 3.1 405B NVFP4 on 256 GB300"),
}


def mfu_note(hardware_name: str, precision: str, mfu: float) -> str | None:
    """A one-line note when ``mfu`` is above the best published for this GPU and precision, else None."""
    best = BEST_PUBLISHED_MFU.get((hardware_name, precision))
    if best is None or mfu <= best[0]:
        return None
    return (f"note: predicted MFU {100 * mfu:.1f} % is above the best published for {hardware_name} {precision} "
            f"({100 * best[0]:.1f} %, {best[1]}): treat this prediction as optimistic")
