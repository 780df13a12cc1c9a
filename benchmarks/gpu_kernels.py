"""Measure the kernel efficiencies the cost model needs on the one CUDA GPU of this machine.

Run on a GPU machine: ``python3 benchmarks/gpu_kernels.py OUT.json``. It writes one row per
measurement (shape, dtype, median time over timed repetitions after warm-up, achieved TFLOP/s)
for:

* dense GEMMs ``(M, K) x (K, N)`` in bf16 (``torch.matmul``) and fp8 e4m3 with per-tensor scales
  (``torch._scaled_mm``, the call Transformer Engine / torchao tensorwise recipes reduce to), at the
  shapes of Megatron's linear layers for common hidden sizes sliced by TP 1-8;
* attention forward and backward (``F.scaled_dot_product_attention``, causal, bf16) with the
  FlashAttention-2 and cuDNN backends torch ships, by sequence length, head dim and GQA ratio;
* a whole Llama-style block (RMSNorm, QKV, RoPE-free SDPA, output projection, SwiGLU MLP) forward +
  backward, so the time of everything that is not a GEMM or attention (norms, activations, residual
  adds, copies, launch gaps) can be read as block time minus the sum of its GEMMs and attention;
* device-to-device copy bandwidth (the memory-bound ceiling).

FLOP conventions: GEMM 2*M*N*K; causal attention forward 2 * 2 * b * h * s^2 * d / 2 (two matmuls,
half the scores), backward 2.5x the forward (FlashAttention-2 paper, Dao 2023, section 4: five
matmuls against two). Timing: CUDA events around ``reps`` launches, median of ``trials``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def launches_ms(fn, reps: int) -> float:
    """Milliseconds of ``reps`` back-to-back launches of ``fn``, CUDA events around them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def timed_ms(fn, reps: int = 10, trials: int = 5, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(launches_ms(fn, reps) / reps for _ in range(trials))


def fp8_gemm(a, b):
    """``a @ b`` (bf16 inputs) as an fp8 e4m3 GEMM with per-tensor scales 1.0 and a bf16 output: the call
    ``torch._scaled_mm`` that Transformer Engine / torchao tensorwise recipes reduce to. Returns the launch."""
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.tensor(1.0, device=a.device)
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def gemm_rows() -> list[dict]:
    rows = []
    dev = "cuda"
    hiddens = [(2048, 8192), (4096, 14336), (5120, 13824), (8192, 28672), (12288, 49152), (16384, 53248)]
    tokens = [2048, 4096, 8192, 16384]
    fp8 = hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")
    for h, f in hiddens:
        for tp in (1, 2, 4, 8):
            # Megatron's linears of one layer, forward shapes (M = tokens, K, N): QKV (MHA-sized), proj, fc1 (gated 2f), fc2
            shapes = {"qkv": (h, 3 * h // tp), "proj": (h // tp, h), "fc1": (h, 2 * f // tp), "fc2": (f // tp, h)}
            for m in tokens:
                for name, (k, n) in shapes.items():
                    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
                    ms = timed_ms(lambda: a @ b, reps=5, trials=3)
                    flops = 2.0 * m * n * k
                    rows.append({"kind": "gemm", "dtype": "bf16", "op": name, "hidden": h, "tp": tp, "m": m, "k": k,
                                 "n": n, "ms": ms, "tflops": flops / ms / 1e9})
                    if fp8 and k % 16 == 0 and n % 16 == 0:
                        try:
                            ms8 = timed_ms(fp8_gemm(a, b), reps=5, trials=3)
                            rows.append({"kind": "gemm", "dtype": "fp8", "op": name, "hidden": h, "tp": tp, "m": m,
                                         "k": k, "n": n, "ms": ms8, "tflops": flops / ms8 / 1e9})
                        except Exception as err:  # noqa: BLE001 - record and go on
                            rows.append({"kind": "gemm", "dtype": "fp8", "error": str(err)[:200]})
                            fp8 = False
                    del a, b
    return rows


def attention_rows() -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    for d in (64, 128):
        for s in (1024, 2048, 4096, 8192, 16384, 32768):
            for heads, kv in ((32, 32), (32, 8), (64, 8)):
                b = max(1, 16384 // s)
                q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                fwd_flops = 4.0 * b * heads * s * s * d / 2
                for name, backend in backends.items():
                    try:
                        with sdpa_kernel([backend]):
                            def fwd():
                                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
                            ms_f = timed_ms(fwd, reps=5, trials=3)
                            o = fwd()
                            g = torch.randn_like(o)

                            def fwd_bwd():
                                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
                                out.backward(g)
                            ms_fb = timed_ms(fwd_bwd, reps=5, trials=3)
                        ms_b = ms_fb - ms_f
                        rows.append({"kind": "attention", "backend": name, "dtype": "bf16", "causal": True, "b": b,
                                     "heads": heads, "kv_heads": kv, "seq": s, "head_dim": d, "fwd_ms": ms_f,
                                     "bwd_ms": ms_b, "fwd_tflops": fwd_flops / ms_f / 1e9,
                                     "bwd_tflops": 2.5 * fwd_flops / ms_b / 1e9})
                    except Exception as err:  # noqa: BLE001
                        rows.append({"kind": "attention", "backend": name, "seq": s, "head_dim": d, "heads": heads,
                                     "kv_heads": kv, "error": str(err)[:200]})
                del q, k, v
    return rows


class Block(torch.nn.Module):
    """A Llama block as Megatron/torchtitan build it (bias-free, RMSNorm, GQA, SwiGLU)."""

    def __init__(self, h: int, heads: int, kv: int, f: int):
        super().__init__()
        self.h, self.heads, self.kv, self.d = h, heads, kv, h // heads
        self.n1, self.n2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, (heads + 2 * kv) * self.d, bias=False)
        self.proj = torch.nn.Linear(h, h, bias=False)
        self.fc1 = torch.nn.Linear(h, 2 * f, bias=False)
        self.fc2 = torch.nn.Linear(f, h, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = q.view(b, s, self.heads, self.d).transpose(1, 2)
        k = k.view(b, s, self.kv, self.d).transpose(1, 2)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, self.h))
        a, g = self.fc1(self.n2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(a) * g)


def block_rows() -> list[dict]:
    rows = []
    for h, heads, kv, f, s in ((2048, 16, 8, 8192, 4096), (4096, 32, 8, 14336, 4096), (4096, 32, 8, 14336, 8192),
                               (8192, 64, 8, 28672, 4096)):
        blk = Block(h, heads, kv, f).cuda().to(torch.bfloat16)
        x = torch.randn(1, s, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ms_f = timed_ms(lambda: blk(x), reps=5, trials=3)
        g = torch.randn(1, s, h, device="cuda", dtype=torch.bfloat16)

        def step():
            blk(x).backward(g)
        ms_fb = timed_ms(step, reps=5, trials=3)
        d = h // heads
        gemm_flops = 2.0 * s * h * ((heads + 2 * kv) * d + h + 2 * f) + 2.0 * s * f * h
        attn_flops = 4.0 * heads * s * s * d / 2
        rows.append({"kind": "block", "dtype": "bf16", "hidden": h, "heads": heads, "kv_heads": kv, "ffn": f,
                     "seq": s, "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "gemm_flops_fwd": gemm_flops,
                     "attn_flops_fwd": attn_flops,
                     "model_tflops": 3 * (gemm_flops + attn_flops) / ms_fb / 1e9})
        del blk, x
    return rows


def copy_rows() -> list[dict]:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = timed_ms(lambda: b.copy_(a))
    return [{"kind": "copy", "bytes_moved": 2 * n, "ms": ms, "gbps": 2 * n / ms / 1e6}]


def main() -> None:
    if not torch.cuda.is_available():  # `make bench` runs every benchmark; this one needs the GPU
        print(f"{__file__.rsplit('/', 1)[-1]}: needs a CUDA GPU; skipped")
        return
    out_path = sys.argv[1] if len(sys.argv) > 1 else "gpu_kernels.json"
    t0 = time.time()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d"), "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}
    rows = []
    for part in (copy_rows, gemm_rows, attention_rows, block_rows):
        t = time.time()
        rows += part()
        print(f"{part.__name__}: {time.time() - t:.1f} s", flush=True)
        with open(out_path, "w") as fh:  # partial results survive a time limit
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"total {time.time() - t0:.1f} s, {len(rows)} rows -> {out_path}")


if __name__ == "__main__":
    main()
