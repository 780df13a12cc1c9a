"""Chunks of no transformer layer: rank 0's embedding chunk and the last rank's loss chunk (issue 14 item 1).

Megatron-LM core_v0.16.1 ``get_num_layers_to_build`` with ``--account-for-embedding/loss-in-pipeline-split``;
Llama 3.1 405B on PP16 x VP8: 126 layers + E + L = 128 slots, one per virtual stage (hand arithmetic).
"""

from __future__ import annotations

import pytest

from planner.cost import estimate_time
from planner.memory import estimate_memory, saved_bytes_per_layer_kind, stage_saved_bytes
from planner.presets import load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec, min_stage_layers

LPS = (7,) + (8,) * 14 + (7,)


def _sc(**plan):
    return Scenario(model=load_model("llama3-405b"), hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=1024, global_batch_size=1536, seq_len=8192, precision="fp8"),
                    plan=Plan(**({"tp": 4, "pp": 16, "dp": 16, "vpp": 8, "micro_batch_size": 1,
                                  "layers_per_stage": LPS} | plan)))


def test_405b_pp16_vpp8_chunks_by_hand():
    p = _sc().plan
    chunks = p.chunk_layers(126)
    assert chunks[0] == (0, 1, 1, 1, 1, 1, 1, 1)  # chunk 0 of rank 0: the embedding only
    assert chunks[15] == (1, 1, 1, 1, 1, 1, 1, 0)  # chunk 7 of rank 15: the loss only
    assert all(c == (1,) * 8 for c in chunks[1:15])
    starts = p.chunk_starts(126)
    assert starts[0][0] == 0 and starts[1][0] == 0 and starts[2][0] == 1  # virtual stage 0 holds nothing
    assert starts[0][1] == 15  # virtual stage 16: after 15 layers of virtual stages 1..15
    assert starts[15][7] == 126  # virtual stage 127: past the last layer


def test_min_stage_layers():
    assert min_stage_layers(16, 8) == (7,) + (8,) * 14 + (7,)
    assert min_stage_layers(4, 1) == (0, 1, 1, 0)
    assert min_stage_layers(2, 2) == (1, 1)


@pytest.mark.parametrize("lps", [(8, 7) + (8,) * 12 + (7, 8),  # a middle stage short: its chunk would be empty
                                 (6,) + (8,) * 14 + (8,),  # two chunks of rank 0 empty
                                 (8,) + (8,) * 14 + (6,)])
def test_other_empty_chunks_are_refused_in_one_line(lps):
    with pytest.raises(ValueError) as err:  # pydantic's ValidationError carries the one line
        Plan(tp=4, pp=16, dp=16, vpp=8, micro_batch_size=1, layers_per_stage=lps)
    (msg,) = [ln for ln in str(err.value).splitlines() if "layers_per_stage:" in ln]
    assert str(err.value).count("layers_per_stage:") == 1
    assert "at least vpp(8) layers per stage, 7 on the first and last" in msg


def test_memory_counts_layers_not_chunks_in_flight():
    """Megatron's interleaved order, p = 16, v = 8, N = 16, m = 96, one layer per chunk (hand count):
    rank 1 holds 2(p-2) + 7N + 1 = 141 chunk forwards = 141 layers at its peak. Rank 0 runs
    2(p-1) + 7N + 1 = 143 forwards: chunks 0..7 of micro-batches 0..15 and chunk 0 of 16..30, of which the
    31 chunk-0 forwards hold nothing: 112 layers. Rank 15 warms up 7N = 112 forwards (chunks 0..6),
    then pairs F(chunk 7, no layer) with B(chunk 7) for 16 steps, then F(chunk 0 of mb 16) before
    B(chunk 6 of mb 0): 113 layers."""
    sc = _sc()
    dense_b, _ = saved_bytes_per_layer_kind(sc.model, sc.training, sc.plan)
    m = sc.num_microbatches
    assert m == 96
    got = [stage_saved_bytes(sc.model, sc.training, sc.plan, m, r, LPS[r]) / dense_b for r in (0, 1, 15)]
    assert got == pytest.approx([112, 141, 113])
    mem = estimate_memory(sc.model, sc.hardware, sc.training, sc.plan)
    assert all(st.total_bytes > 0 for st in mem.stages)


def test_uneven_chunks_without_an_empty_one():
    """p = 4, v = 2, m = 8 (N = 4), layers (3, 4, 4, 3), Megatron's order, counted by hand. Rank 3, chunks
    (2, 1): 4 warm-up forwards of chunk 0 (8 layers), F/B pairs of chunk 1 (9), then F(chunk 0 of mb 4)
    before B(chunk 0 of mb 0): 10 (the mean chunk: 5 x 1.5 = 7.5). Rank 0, chunks (1, 2): 10 warm-up
    forwards = mbs 0..3 on both chunks (12) and chunk 0 of mbs 4, 5 (2), then F(chunk 0 of mb 6): 15
    (11 x 1.5 = 16.5). Rank 1, chunks (2, 2): (2 x 2 + 4 + 1) x 2 = 18."""
    model, training = load_model("llama3-405b"), TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=1024)
    plan = Plan(tp=1, pp=4, dp=1, vpp=2, micro_batch_size=1, layers_per_stage=(3, 4, 4, 3))
    dense_b, _ = saved_bytes_per_layer_kind(model, training, plan)
    got = [stage_saved_bytes(model, training, plan, 8, r, n) / dense_b for r, n in enumerate((3, 4, 4, 3))]
    assert got == pytest.approx([15, 18, 18 - 2 * 2, 10])  # rank 2: (2 x 1 + 4 + 1) x 2 = 14


def test_step_time_finite_and_empty_chunk_hides_no_transfer():
    sc = _sc()
    t = estimate_time(sc.model, sc.hardware, sc.training, sc.plan)
    assert 0 < t.step_time_s < float("inf")
    assert t.step_time_s == pytest.approx(sum(t.breakdown.values()))
    st = {s.stage: s for s in t.stages}
    # the same 7 layers spread as the even 8-layer stages' chunks, minus one: the empty chunk's
    # transfer is exposed whole, so stage 0 exposes more P2P than stage 1 though it computes less
    assert st[0].compute < st[1].compute
    assert st[0].pp_comm > st[1].pp_comm
    assert st[15].pp_comm > st[1].pp_comm


CLI = ["estimate", "--model", "llama3-405b", "--hardware", "h100-sxm-80gb", "--gpus", "1024", "--global-batch",
       "1536", "--seq-len", "8192", "--tp", "8", "--sequence-parallel", "--pp", "16", "--vpp", "8", "--precision", "fp8", "--recompute", "full", "--zero-stage", "1"]


def test_cli_estimate_accepts_the_405b_layout_and_refuses_a_short_middle(runner):
    from planner.cli import app

    res = runner.invoke(app, CLI + ["--layers-per-stage", ",".join(map(str, LPS))])
    assert res.exit_code == 0, res.output
    assert "Step time" in res.output
    res = runner.invoke(app, CLI + ["--layers-per-stage", ",".join(map(str, (8, 7) + (8,) * 12 + (7, 8)))])
    assert res.exit_code == 2
    assert "layers_per_stage: every chunk needs a transformer layer" in res.output


def test_search_tables_equal_estimate_with_empty_chunks():
    """The search proposes rank 0's embedding chunk and the last rank's loss chunk empty (14 layers on pp 4 x
    vpp 4: 3 + 4 + 4 + 3, specs.min_stage_layers), and its tables equal estimate_time and stage_memory there:
    one cost model, one memory model."""
    from planner.candidates import Pins, SearchSpace
    from planner.presets import load_hardware, load_model
    from planner.search import build_tables
    from planner.specs import TrainingSpec
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("llama3-8b").model_copy(update={"num_layers": 14})
    hw = load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=1024)
    tables = build_tables(model, hw, tr, SearchSpace(pins=Pins(pp=4, vpp=4, tp=1), max_micro_batch_size=2, max_cp=1))
    checked = 0
    for key in legal_keys(tables):
        if tables.plan(key).stage_layers(14) != (3, 4, 4, 3):
            continue
        plan = assert_entry_is_estimate(model, hw, tr, tables, key)
        assert plan.chunk_layers(14)[0][0] == 0 and plan.chunk_layers(14)[-1][-1] == 0
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("vpp", [4, 8])
def test_search_tables_equal_estimate_on_two_uneven_interleaved_stages(vpp):
    """15 layers on pp 2 (DeepSeek-V3's odd 61 on PP2 x VP4/VP8 in NVIDIA's runs): 7 + 8, 6 + 9, ... in vpp
    chunks (with vpp 8 the embedding or loss chunk of a 7-layer stage is empty); tables equal estimate."""
    from planner.candidates import Pins, SearchSpace
    from planner.presets import load_hardware, load_model
    from planner.search import build_tables
    from planner.specs import TrainingSpec
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("llama3-8b").model_copy(update={"num_layers": 15})
    hw = load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=1024)
    tables = build_tables(model, hw, tr, SearchSpace(pins=Pins(pp=2, vpp=vpp, tp=1), max_micro_batch_size=2, max_cp=1))
    keys = legal_keys(tables)
    for key in keys:
        plan = assert_entry_is_estimate(model, hw, tr, tables, key)
        assert plan.layers_per_stage is None or sum(plan.layers_per_stage) == 15
    assert len(keys) >= 2
