"""Where a layer's backward peak comes from, on one CUDA GPU (issue 13's reserved/transient gap).

Run on a GPU machine from the repository root: ``python3 benchmarks/gpu_memory_probe.py [OUT.json]``.
For L = 0 (harness only), 1, 2 and 4 layers of one TP-8 shard of Llama-3-70B (tests/torch_ref.py
RefLayer, bf16, sequence 8192, micro-batch 1, no recompute) it records, above the static memory:
the memory after the forward (saved activations + the output), and the peak of forward + backward.
The slope over L of the after-forward memory is the saved activations per layer (to compare with
planner.memory.saved_bytes_per_layer); the peak minus the after-forward memory is what the
backward adds on top (gradients of parameters and inputs, the transients of one layer's backward).
"""

from __future__ import annotations

import json
import sys

import torch

from planner.memory import layer_activation_terms, saved_bytes_per_layer
from planner.presets import load_model
from planner.specs import Plan, TrainingSpec
from tests.torch_ref import RefLayer


def probe(layers: int, model, tp: int, seq: int) -> dict:
    blocks = torch.nn.Sequential(*[RefLayer(model, tp=tp, device="cuda") for _ in range(layers)])
    x = torch.randn(1, seq, model.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # warm-up: cuBLAS workspaces, kernels
        blocks(x).float().sum().backward()
        x.grad = None
        for p in blocks.parameters():
            p.grad = None
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = blocks(x)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated() - static
    fwd_peak = torch.cuda.max_memory_allocated() - static
    torch.cuda.reset_peak_memory_stats()
    out.float().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - static
    grads = sum(p.numel() * p.element_size() for p in blocks.parameters())
    del out, blocks
    x.grad = None
    torch.cuda.empty_cache()
    return {"layers": layers, "after_forward_bytes": after_forward, "forward_peak_bytes": fwd_peak,
            "backward_peak_bytes": peak, "param_grad_bytes": grads}


def main() -> None:
    if not torch.cuda.is_available():  # `make bench` runs every benchmark; this one needs the GPU
        print(f"{__file__.rsplit('/', 1)[-1]}: needs a CUDA GPU; skipped")
        return
    model, tp, seq = load_model("llama3-70b"), 8, 8192
    training = TrainingSpec(num_gpus=tp, global_batch_size=1, seq_len=seq)
    plan = Plan(tp=tp, pp=1, dp=1, micro_batch_size=1)
    predicted = saved_bytes_per_layer(layer_activation_terms(model, training, plan), "none")
    rows = [probe(n, model, tp, seq) for n in (0, 1, 2, 4)]
    gib = 2**30
    slope = (rows[3]["after_forward_bytes"] - rows[1]["after_forward_bytes"]) / 3
    print(f"saved per layer: measured {slope / gib:.4f} GiB, planner {predicted / gib:.4f} GiB "
          f"({100 * (slope / predicted - 1):+.1f} %)")
    for r in rows:
        extra = r["backward_peak_bytes"] - r["after_forward_bytes"] - r["param_grad_bytes"]
        print(f"L={r['layers']}: after forward {r['after_forward_bytes'] / gib:.3f} GiB, forward peak "
              f"{r['forward_peak_bytes'] / gib:.3f}, backward peak {r['backward_peak_bytes'] / gib:.3f}, "
              f"param grads {r['param_grad_bytes'] / gib:.3f}, backward adds beyond grads {extra / gib:.3f} GiB")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "predicted_saved_per_layer_bytes": predicted,
           "measured_saved_per_layer_bytes": slope, "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
