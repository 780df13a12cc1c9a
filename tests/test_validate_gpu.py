"""One GPU runs one rank's share of a real plan at real dimensions: one tensor-parallel shard (t = 8)
of two Llama-3-70B layers, sequence 8192, micro-batch 1, communication excluded. Compares
torch.cuda.max_memory_allocated and the compute time with the estimate.

Run on a machine with a GPU: ``pytest tests/test_validate_gpu.py -s``. Skipped without CUDA.
"""

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from planner.cost import layer_time  # noqa: E402
from planner.memory import layer_activation_terms, recompute_working_bytes, saved_bytes_per_layer  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.specs import Plan, TrainingSpec  # noqa: E402
from tests.torch_ref import RefLayer  # noqa: E402

MEMORY_TOLERANCE = 0.10  # allocator rounding and cuBLAS workspaces come on top of the tensors
TIME_TOLERANCE = 0.30


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_one_tp_shard_of_llama3_70b_on_one_gpu(recompute):
    model, hw = load_model("llama3-70b"), load_hardware("h200-141gb")
    tp, layers, seq = 8, 2, 8192
    training = TrainingSpec(num_gpus=tp, global_batch_size=1, seq_len=seq)
    plan = Plan(tp=tp, pp=1, dp=1, micro_batch_size=1, recompute=recompute)
    blocks = torch.nn.Sequential(*[RefLayer(model, tp=tp, recompute=recompute, device="cuda") for _ in range(layers)])
    x = torch.randn(1, seq, model.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    blocks(x).float().sum().backward()  # warm-up (cuBLAS handles, kernels)
    for p in blocks.parameters():
        p.grad = None
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    blocks(x).float().sum().backward()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - static
    terms = layer_activation_terms(model, training, plan)
    grads = sum(p.numel() * 2 for p in blocks.parameters())
    predicted = layers * saved_bytes_per_layer(terms, recompute) + recompute_working_bytes(terms, recompute) + grads
    print(f"\nmeasured peak {peak / 2**30:.3f} GiB, predicted {predicted / 2**30:.3f} GiB; "
          f"measured {elapsed * 1e3:.1f} ms")
    assert abs(peak / predicted - 1) < MEMORY_TOLERANCE
    lt = layer_time(model, hw, training, plan)
    predicted_s = layers * (lt.fwd_compute + lt.bwd_compute + lt.recompute)
    print(f"predicted compute {predicted_s * 1e3:.1f} ms")
    assert abs(elapsed / predicted_s - 1) < TIME_TOLERANCE
