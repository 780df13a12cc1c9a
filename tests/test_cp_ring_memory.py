"""Transformer Engine's ring attention (Megatron context parallelism) holds every step's output and every K/V chunk
until its forward ends (memory.cp_ring_transient_bytes): counted once, in the layer's working set, by hand."""

import pytest

from planner.memory import cp_ring_transient_bytes, estimate_memory, layer_recompute_working_bytes
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec

LLAMA8B = load_model("llama3-8b")  # h 4096, 32 query heads and 8 K/V heads of 128


def test_ring_buffers_by_hand():
    """Llama-3-8B at 131,072 tokens, CP 8, TP 1: a rank's 16,384 tokens. One output O = 16384 x 4096 x 2 B =
    128 MiB, one K/V chunk 2 x 16384 x 1024 x 2 B = 64 MiB, one step's log-sum-exp 16384 x 32 x 4 B = 2 MiB:
    8 outputs + the fp32 accumulator (2 O) + 7 received chunks + 8 log-sum-exps = 1,744 MiB."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=131072)
    plan = Plan(tp=1, pp=1, dp=1, cp=8, micro_batch_size=1)
    mib = 2**20
    assert cp_ring_transient_bytes(LLAMA8B, tr, plan) == (8 * 128 + 2 * 128 + 7 * 64 + 8 * 2) * mib
    assert layer_recompute_working_bytes(LLAMA8B, tr, plan) == cp_ring_transient_bytes(LLAMA8B, tr, plan)
    # TP 2 halves every head count on the rank
    tp2 = Plan(tp=2, pp=1, dp=1, cp=4, micro_batch_size=1, sequence_parallel=True)
    assert cp_ring_transient_bytes(LLAMA8B, tr.model_copy(update={"num_gpus": 8}), tp2) == \
        (4 * 128 + 2 * 128 + 3 * 64 + 4 * 2) * mib  # 32,768 tokens a rank, half the heads


@pytest.mark.parametrize("case", ["cp1", "torchtitan", "materialized"])
def test_no_ring_buffers_elsewhere(case):
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=32768,
                      **({"framework": "torchtitan"} if case == "torchtitan" else {}),
                      **({"attention": "materialized"} if case == "materialized" else {}))
    plan = Plan(tp=1, pp=1, dp=8 if case == "cp1" else 4, cp=1 if case == "cp1" else 2, micro_batch_size=1)
    assert cp_ring_transient_bytes(LLAMA8B, tr, plan) == 0.0


def test_the_estimate_counts_them_once(monkeypatch):
    """Once per stage (one layer's forward at a time), not per layer or per micro-batch in flight: the peak rises
    by at most the buffers (less where the loss phase, not the layer phase, sets it)."""
    import planner.memory as memory

    hw = load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=16, seq_len=131072)
    plan = Plan(tp=2, pp=2, dp=1, cp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    ring = cp_ring_transient_bytes(LLAMA8B, tr, plan)
    with_ring = estimate_memory(LLAMA8B, hw, tr, plan).stages
    monkeypatch.setattr(memory, "cp_ring_transient_bytes", lambda *a: 0.0)
    without = estimate_memory(LLAMA8B, hw, tr, plan).stages
    rises = [a.total_bytes - b.total_bytes for a, b in zip(with_ring, without)]
    assert ring > 0 and all(0 <= r <= ring + 1 for r in rises) and rises[0] == pytest.approx(ring)
