"""How much of its burst GEMM rate one CUDA GPU keeps when it multiplies without pause (issue 12 item 1).

Run on a GPU machine: ``python3 benchmarks/gpu_sustained.py OUT.json [SECONDS]``. For each shape it runs the
GEMM back to back for SECONDS (default 20) and records, per window of about 0.25 s (CUDA events around a batch
of launches): the achieved TFLOP/s and, where NVML answers (``pynvml``, nvidia-ml-py), the SM clock (MHz), the
board power (W), the enforced power limit (W) and the temperature (C) read at the end of the window.

What the cost model can read from it: ``burst_tflops`` (median of the first three windows, what a short
microbenchmark such as the MAMF sweep or ``benchmarks/gpu_kernels.py`` reports) against
``sustained_tflops`` (median of the second half of the run, the rate a training step's GEMMs get once
clocks settle under the power limit), and their ratio. ``hardware_profiles/*.yaml``'s ``sustained_fraction``
is fitted on published runs; this measures one of the effects it stands for (clock throttling under power),
and nothing else (kernel gaps, communication contention and host stalls are not in a back-to-back GEMM loop).

Data: ``torch.randn`` bf16 inputs (random data draws more power than zeros: 788 against 894 TFLOP/s on an
H200, /work/.library/device/KINDS.md), fp8 e4m3 with per-tensor scales through ``torch._scaled_mm`` as in
``benchmarks/gpu_kernels.py``. FLOPs 2*M*N*K per GEMM.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_kernels import fp8_gemm, launches_ms  # noqa: E402

# (name, dtype, M, K, N): the MAMF square shape, and two of Megatron's Llama-3-70B TP-8 linears at 8,192 tokens
SHAPES = (("square_8192", "bf16", 8192, 8192, 8192),
          ("llama70b_tp8_fc1", "bf16", 8192, 8192, 2 * 28672 // 8),
          ("llama70b_tp8_fc2", "bf16", 8192, 28672 // 8, 8192),
          ("square_8192", "fp8", 8192, 8192, 8192))


def _nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

        def read() -> dict:
            return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                    "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
                    "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)}
        read()
        return read
    except Exception as err:  # noqa: BLE001 - NVML is optional: the rates are measured without it
        print(f"gpu_sustained: no NVML readings ({type(err).__name__}: {err})", flush=True)
        return lambda: {}


def _gemm(dtype: str, m: int, k: int, n: int):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return (lambda: a @ b) if dtype == "bf16" else fp8_gemm(a, b)


def run_shape(name: str, dtype: str, m: int, k: int, n: int, seconds: float, read) -> dict:
    fn = _gemm(dtype, m, k, n)
    flops = 2.0 * m * n * k
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    batch = max(1, int(250.0 / (launches_ms(fn, 5) / 5)))  # launches per window: about 0.25 s at the first rate
    windows = []
    t0 = time.time()
    while time.time() - t0 < seconds:
        ms = launches_ms(fn, batch)
        windows.append({"t_s": round(time.time() - t0, 3), "tflops": flops * batch / ms / 1e9, **read()})
    late = windows[len(windows) // 2:]  # the second half: the steady state
    burst = statistics.median(w["tflops"] for w in windows[:3])
    sustained = statistics.median(w["tflops"] for w in late)
    row = {"shape": name, "dtype": dtype, "m": m, "k": k, "n": n, "launches_per_window": batch,
           "burst_tflops": burst, "sustained_tflops": sustained, "sustained_over_burst": sustained / burst,
           "windows": windows}
    clocks = [w["sm_clock_mhz"] for w in late if "sm_clock_mhz" in w]
    if clocks:
        row["sustained_sm_clock_mhz"] = statistics.median(clocks)
        row["sustained_power_w"] = statistics.median(w["power_w"] for w in late)
    print(f"{name:<20}{dtype:<6} burst {burst:7.1f}  sustained {sustained:7.1f} TFLOP/s  ratio {sustained / burst:.3f}"
          + (f"  SM {row['sustained_sm_clock_mhz']:.0f} MHz  {row['sustained_power_w']:.0f} W" if clocks else ""),
          flush=True)
    return row


def main() -> None:
    if not torch.cuda.is_available():  # `make bench` runs every benchmark; this one needs the GPU
        print(f"{__file__.rsplit('/', 1)[-1]}: needs a CUDA GPU; skipped")
        return
    out_path = sys.argv[1] if len(sys.argv) > 1 else "gpu_sustained.json"
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    read = _nvml()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d"), "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
            "seconds_per_shape": seconds, "idle": read()}
    rows = []
    for shape in SHAPES:
        if shape[1] == "fp8" and not hasattr(torch, "_scaled_mm"):
            continue
        rows.append(run_shape(*shape, seconds=seconds, read=read))
        with open(out_path, "w") as fh:  # partial results survive a time limit
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"-> {out_path}")


if __name__ == "__main__":
    main()
