"""Transformer Engine's userbuffers under Megatron's TP communication overlap (planner.memory.
tp_comm_overlap_buffer_bytes): their size by hand, on every stage of the estimate, in the search's tables alike, and
read from a launch with --tp-comm-overlap."""

from pathlib import Path

import pytest

from planner.check import check_file_branches
from planner.memory import GIB, estimate_memory, tp_comm_overlap_buffer_bytes
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec

H100 = load_hardware("h100-sxm-80gb")
LAUNCH = Path(__file__).parent / "data" / "launch"


@pytest.mark.parametrize("framework, precision, overlap, tp, sp, cp, want_gib", [
    # 12 buffers of (8192 x 1 / cp) x 8192 elements: 2 B each in bf16; under fp8 the 8 all-gather ones take 1 B
    ("nemo", "bf16", None, 4, True, 1, 12 * 8192 * 8192 * 2 / GIB),   # NeMo's recipes overlap by default
    ("nemo", "fp8", None, 4, True, 1, (8 * 1 + 4 * 2) * 8192 * 8192 / GIB),
    ("nemo", "bf16", None, 4, True, 2, 12 * 4096 * 8192 * 2 / GIB),
    ("megatron", "bf16", None, 4, True, 1, 0.0),      # Megatron-LM: off unless --tp-comm-overlap
    ("megatron", "bf16", True, 4, True, 1, 12 * 8192 * 8192 * 2 / GIB),
    ("nemo", "bf16", None, 1, False, 1, 0.0),         # no TP, no overlap
    ("nemo", "bf16", None, 4, False, 1, 0.0),         # the overlap needs SP
    ("torchtitan", "bf16", True, 4, True, 1, 0.0),    # async TP: not Transformer Engine's userbuffers
])
def test_buffer_bytes_by_hand(framework, precision, overlap, tp, sp, cp, want_gib):
    training = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192, framework=framework,
                            precision=precision, tp_comm_overlap=overlap)
    plan = Plan(tp=tp, pp=1, dp=64 // (tp * cp), cp=cp, micro_batch_size=1, sequence_parallel=sp)
    assert tp_comm_overlap_buffer_bytes(training, plan, 8192) / GIB == pytest.approx(want_gib)


def test_every_stage_holds_them():
    model = load_model("llama3-70b")
    plan = Plan(tp=4, pp=4, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1, recompute="selective")
    on = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192, framework="megatron", tp_comm_overlap=True)
    off = on.model_copy(update={"tp_comm_overlap": False})
    with_ub, without = estimate_memory(model, H100, on, plan), estimate_memory(model, H100, off, plan)
    for a, b in zip(with_ub.stages, without.stages):
        # the 1.5 GiB of userbuffers and Transformer Engine's workspace repeated for two more overlap streams
        # (memory.gemm_workspace_bytes, TE_UB_STREAMS: 2 x 32 MiB)
        assert (a.other_bytes - b.other_bytes) / GIB == pytest.approx(1.5 + 2 * 32 / 1024)


def test_search_tables_count_them_as_the_estimate():
    from planner.candidates import Pins, SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("llama3-8b")
    training = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework="nemo")
    tables = build_tables(model, H100, training, SearchSpace(max_micro_batch_size=2, pins=Pins(tp=2)))
    keys = legal_keys(tables)
    assert keys
    for k in keys[:: max(1, len(keys) // 30)]:
        assert_entry_is_estimate(model, H100, training, tables, k)


def test_check_counts_them_for_a_launch_with_tp_comm_overlap(tmp_path):
    """megatron_llama3_70b.slurm (TP 8, SP, bf16) with --tp-comm-overlap added: 1.5 GiB more on every stage, and
    Transformer Engine's cuBLAS workspace kept for three overlap streams, not one (2 x 32 MiB more)."""
    base = (LAUNCH / "megatron_llama3_70b.slurm").read_text()
    plain, overlap = tmp_path / "plain.slurm", tmp_path / "overlap.slurm"
    plain.write_text(base)
    overlap.write_text(base.replace("--sequence-parallel \\", "--sequence-parallel --tp-comm-overlap \\", 1))
    (a,) = check_file_branches(plain, H100, None, None)
    (b,) = check_file_branches(overlap, H100, None, None)
    assert not a.errors and not b.errors and b.scenario.training.tp_comm_overlap
    ma, mb = (estimate_memory(r.scenario.model, H100, r.scenario.training, r.scenario.plan) for r in (a, b))
    for x, y in zip(ma.stages, mb.stages):
        assert (y.other_bytes - x.other_bytes) / GIB == pytest.approx(12 * 8192 * 8192 * 2 / GIB + 2 * 32 / 1024)
