"""torch.distributed.pipelining's per-micro-batch receive buffers in the torchtitan profile
(planner.memory.pipeline_buffer_bytes), the search tables that carry them, and torchtitan 9dec370's
default pipeline split of its published runs (planner.frameworks.torchtitan)."""

from __future__ import annotations

import pytest

from planner import memory
from planner.candidates import SearchSpace
from planner.frameworks import torchtitan
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec


def _tt(seq=4096, gpus=64, batch=64, framework="torchtitan"):
    return TrainingSpec(num_gpus=gpus, global_batch_size=batch, seq_len=seq, framework=framework)


def test_buffer_bytes_by_hand():
    """Llama-3-70B, TP 8 with SP, pp 4, 16 micro-batches of 1 x 4096 tokens: the boundary tensor is
    4096 x 8192 x 2 B / 8 = 8 MiB. Rank 0 receives no input and holds 16 gradient buffers; rank 3 (the last)
    holds 16 input buffers, of which its 1 in-flight micro-batch is already a saved layer input; the middle
    ranks both kinds, less their 4 - r in flight."""
    model = load_model("llama3-70b")
    plan = Plan(tp=8, pp=4, dp=2, micro_batch_size=1, recompute="full", sequence_parallel=True, zero_stage=3)
    tr = _tt(batch=32)  # 32 / (1 x dp 2) = 16 micro-batches
    mib = 2**20
    got = [memory.pipeline_buffer_bytes(model, tr, plan, 16, r) / mib for r in range(4)]
    assert got == [16 * 8, (16 - 3 + 16) * 8, (16 - 2 + 16) * 8, (16 - 1) * 8]
    megatron = _tt(batch=32, framework="megatron")
    assert all(memory.pipeline_buffer_bytes(model, megatron, plan, 16, r) == 0 for r in range(4))


def test_buffers_match_torch_pipelining():
    """The count the estimate charges is what torch's PipelineStage allocates: a 2-rank gloo pipeline on this CPU,
    m micro-batches, the receive buffers torch made after one step (``args_recv_info`` / ``grad_recv_info``)."""
    from tests.pipeline_recv_probe import run_probe

    counts = run_probe(microbatches=5)
    buffers = {r: {k: c[k] for k in ("input", "grad")} for r, c in counts.items()}
    assert buffers == {0: {"input": 0, "grad": 5}, 1: {"input": 5, "grad": 0}}, counts


def test_search_tables_carry_the_buffers():
    """Each table entry of a torchtitan pipeline search is memory.stage_memory of its plan (with the buffers)."""
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = _tt(gpus=16, batch=64)
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=2))
    keys = [k for k in legal_keys(tables) if tables.plan(k).pp > 1]
    assert len(keys) > 20
    checked = [assert_entry_is_estimate(model, hw, tr, tables, k) for k in keys[:: max(1, len(keys) // 40)]]
    assert any(memory.pipeline_buffer_bytes(model, tr, p, 64 // (p.micro_batch_size * p.dp), 0) > 0 for p in checked)


@pytest.mark.parametrize("pp,vpp,want", [
    (8, 1, (15, 16, 16, 16, 16, 16, 16, 15)),  # generate_split_points: 126 // 8 = 15, 6 middle stages one more
    (8, 2, (15, 16, 16, 16, 16, 16, 16, 15)),  # 16 stages of 7 + 14 x 8 + 7, rank r holding r and r + 8
    (4, 1, None),  # 32 layers of Llama 3.1 8B: even
])
def test_torchtitan_9dec370_split(pp, vpp, want):
    layers = 32 if want is None else 126
    assert torchtitan.published_layers_per_stage(layers, pp, vpp) == want
    assert torchtitan.published_microbatches(pp, vpp) == pp * vpp


def test_torchtitan_runs_uneven_interleaved_when_only_the_end_virtual_stages_are_short():
    """torchtitan shortens only the first and last virtual stage (first/last_stage_less_layers): 15/16/.../15 at
    vpp 2 is 7 + 14 x 8 + 7 and runs; 14/16/.../16 would make a middle virtual stage short and does not."""
    from planner.specs import plan_problems

    model, hw = load_model("llama3-405b"), load_hardware("h100-sxm-80gb")
    tr = _tt(seq=8192, gpus=512, batch=256)
    ok = Plan(tp=8, pp=8, dp=8, vpp=2, micro_batch_size=2, recompute="full", sequence_parallel=True, zero_stage=3,
              layers_per_stage=torchtitan.published_layers_per_stage(126, 8, 2))
    assert not [x for x in plan_problems(model, hw, tr, ok) if x.startswith("layers_per_stage")]
    bad = ok.model_copy(update={"layers_per_stage": (14,) + (16,) * 6 + (16,)})
    assert [x for x in plan_problems(model, hw, tr, bad) if x.startswith("layers_per_stage")]
