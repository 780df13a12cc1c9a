"""How sure a step-time prediction is: a range from the spread of its sources (issue 12, item 5).

Two ranges, reported side by side and joined into one (``time_range``):

* **sources**: each term of the step-time breakdown is known only as well as the figures it is
  built from. ``TERM_SPREAD`` gives each term's relative half-width with the spread it comes
  from; the range is ``step * (1 -/+ sum(spread_k * term_k) / step)`` (the terms' errors taken as
  correlated, the conservative sum).
* **calibration**: how far measured step times fell from plan3d's predictions on published runs of the
  same kind, the 10th and 90th percentile of measured / predicted. Dense models: the project's
  calibration runs (34 published runs, A100 Megatron-LM and H100 NeMo FP8: ``benchmarks/calibration.py``).
  Mixture-of-experts models: the scored MoE runs of NVIDIA's Megatron-Bridge performance summary (68 runs,
  DeepSeek-V3, Qwen3-30B-A3B and 235B-A22B, GPT-OSS-120B on DGX H100, B200, B300, GB200 and GB300:
  ``benchmarks/megatron_bridge.py``), on which the MoE cost model is far less sure than the dense one is
  on its runs: the dense range would understate it. The model is optimistic on most runs of either set,
  so the range sits mostly above the prediction. ``tests/test_uncertainty.py`` recomputes both, so they
  cannot go stale when the cost model changes.

Whether a plan's lead over the runner-up is real (``lead_within_range``): the lead is *inside the
range* when the runner-up's predicted step time lies within the best plan's sources range
(``t_alt - t_best <= sum(spread_k * term_k of the best)``). The calibration range is left out of
this test: it is a bias the two predictions share.
"""

from __future__ import annotations

#: Relative half-width of each breakdown term, and the spread of sources it comes from.
TERM_SPREAD: dict[str, tuple[float, str]] = {
    "compute": (0.05, "GEMM rate: sustained_fraction refitted leaving one calibration family out spans 0.76-0.79 "
                      "(benchmarks/calibration.py); best BF16 GEMM measured at 0.82 of peak on one H200 against "
                      "gemm_efficiency_max 0.80 (benchmarks/data/h200_kernels.json)"),
    "recompute": (0.05, "the forward GEMMs again: as compute"),
    "bubble": (0.05, "idle time of the pipeline, a multiple of the stage compute: as compute"),
    "tp_comm": (0.13, "NVLink bus bandwidth: ~370 GB/s ring vs ~480 GB/s NVLS all-reduce on H100/H200 "
                      "(formulas.md C5; nccl-tests#212, #290)"),
    "cp_comm": (0.13, "NVLink or network bus bandwidth, as tp_comm"),
    "pp_comm": (0.13, "point-to-point bandwidth, as tp_comm"),
    "dp_comm_exposed": (0.13, "NVLink ring vs NVLS (as tp_comm); NDR InfiniBand 46-49 GB/s per NIC of 50 "
                              "(formulas.md C5; nccl-tests#267, #290)"),
    "optimizer": (0.25, "memory-bound Adam at hbm_efficiency 0.7, not measured: a wide stated range"),
    "param_passes": (0.25, "memory-bound passes at hbm_efficiency, as the optimizer: their bytes are DeepSpeed's "
                           "and FSDP2's own (tests/test_deepspeed_engine.py, tests/test_fsdp2_accumulation.py), "
                           "their rate not measured"),
}
#: A term not in the table (a new one) gets this spread: unmeasured, so wide.
DEFAULT_SPREAD = (0.25, "term without a measured source")

#: 10th and 90th percentile of measured / predicted step time over the calibration runs
#: (``benchmarks/calibration.py`` prints it; ``tests/test_uncertainty.py`` recomputes it).
CALIBRATION_RATIO = (1.008, 1.242)

#: The same percentiles over the scored mixture-of-experts runs of ``benchmarks/megatron_bridge.py`` (nothing in the
#: MoE cost model is fitted to them; it prints the figure and ``tests/test_uncertainty.py`` recomputes it).
MOE_CALIBRATION_RATIO = (1.021, 1.540)


def ratio_deciles(ratios) -> tuple[float, float]:
    """10th and 90th percentile of measured / predicted step times (inclusive quantiles): the rule both
    ``CALIBRATION_RATIO`` (``benchmarks/calibration.py``) and ``MOE_CALIBRATION_RATIO``
    (``benchmarks/megatron_bridge.py``) are computed by."""
    import statistics

    q = statistics.quantiles(list(ratios), n=10, method="inclusive")
    return q[0], q[8]


def spread(term: str) -> float:
    return TERM_SPREAD.get(term, DEFAULT_SPREAD)[0]


def sources_half_width_s(breakdown: dict[str, float]) -> float:
    """``sum(spread_k * |term_k|)``: how far the step could move if every term were off by its spread."""
    return sum(spread(k) * abs(v) for k, v in breakdown.items())


def time_range(step_time_s: float, breakdown: dict[str, float], moe: bool = False) -> dict:
    """The prediction's range (module docstring): ``low_s``/``high_s`` join the sources and calibration ranges;
    ``moe``: a mixture-of-experts model, whose calibration range is ``MOE_CALIBRATION_RATIO`` (``calibration_set``
    names which runs the range comes from: "dense" or "moe")."""
    half = sources_half_width_s(breakdown)
    lo_ratio, hi_ratio = MOE_CALIBRATION_RATIO if moe else CALIBRATION_RATIO
    sources = (step_time_s - half, step_time_s + half)
    calibration = (step_time_s * lo_ratio, step_time_s * hi_ratio)
    return {"low_s": min(sources[0], calibration[0]), "high_s": max(sources[1], calibration[1]),
            "sources_s": list(sources), "calibration_s": list(calibration),
            "calibration_set": "moe" if moe else "dense"}


def lead_within_range(best_breakdown: dict[str, float], best_step_s: float,
                      alt_breakdown: dict[str, float], alt_step_s: float) -> bool:
    """True when the alternative's predicted step lies inside the best plan's sources range (module docstring)."""
    return alt_step_s - best_step_s <= sources_half_width_s(best_breakdown)
