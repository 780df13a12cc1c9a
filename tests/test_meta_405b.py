"""Meta's Llama 3 405B layout as benchmarks/meta_405b.py maps it (issue 14): the settings the Llama 3 paper
states (Dubey et al. 2024, arXiv:2407.21783, section 3.3.2; quoted in benchmarks/data/llama3_405b_meta.json)
and what Megatron-Core's interleaved schedule keeps in flight on them, counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.memory import GIB, saved_bytes_per_layer_kind, stage_saved_bytes
from planner.presets import load_hardware, load_model
from planner.schedules import measured_peak, rank_actions
from planner.specs import Scenario, TrainingSpec
from tests.bench_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "benchmarks/data/llama3_405b_meta.json").read_text())
bench = load_benchmark("meta_405b")


def _sc(run: dict, group: int | None = None) -> Scenario:
    return Scenario(model=load_model(DATA["model"]), hardware=load_hardware(DATA["hardware"]),
                    training=TrainingSpec(num_gpus=run["gpus"], global_batch_size=run["global_batch"],
                                          seq_len=run["seq"]),
                    plan=bench.meta_plan(run, DATA["stated"], group))


def test_stated_settings_are_mapped():
    """vpp 8: one layer off a stage of 8 empties its first chunk only with one layer per chunk ("the first
    model chunk on the first stage has only the embedding"); ZeRO-2 ("shards optimizer states and
    gradients"); no recompute ("without activation checkpointing")."""
    for run in DATA["runs"]:
        plan = _sc(run).plan
        got = (plan.tp, plan.pp, plan.dp, plan.vpp, plan.zero_stage, plan.recompute)
        assert got == (8, 16, run["dp"], 8, 2, "none")
        chunks = plan.chunk_layers(126)
        assert chunks[0] == (0,) + (1,) * 7 and chunks[15] == (1,) * 7 + (0,)
        assert run["global_batch"] // run["dp"] == run["batch_per_dp"]  # Table 4: 32 and 16


@pytest.mark.parametrize("m, groups", [(32, [16, 32]), (16, [16])])
def test_group_sizes_megatron_runs(m, groups):
    """Megatron-Core core_v0.16.1 forward_backward_pipelining_with_interleaving: pp <= N <= m, and m % N either
    0 or >= pp. m = 32: N = 16 and 32 (N = 17..31 leave 15..1 micro-batches in the last group); m = 16: 16."""
    assert bench.group_sizes(_sc(DATA["runs"][0]).plan, m) == groups


def test_layer_bytes_by_hand():
    """One layer, s = 8192, b = 1, h = 16384, t = 8 with SP, bf16: s b h / t x 2 B = 32 MiB per [s/t, h] tensor.
    Saved: norm1 input, QKV input, Q, out-proj input, norm2 input, FC1 input (6 x 32 MiB), K and V
    (2 x 8 heads x 128 / 16384 = 0.125 of one), SwiGLU input 2 x 53248 / 16384 = 6.5 and FC2 input 3.25 of one:
    15.875 x 32 MiB; the log-sum-exp 128 / 8 heads x 8192 x 4 B and two norm statistics 1024 x 4 B."""
    sc = _sc(DATA["runs"][0])
    dense_b, _ = saved_bytes_per_layer_kind(sc.model, sc.training, sc.plan)
    assert dense_b == 15.875 * 32 * 2**20 + 16 * 8192 * 4 + 2 * 1024 * 4
    assert dense_b / GIB == pytest.approx(0.4966, abs=1e-4)


@pytest.mark.parametrize("run_i, m, expected", [
    # m = 32: rank 1 warms up 2 (p - 2) + 7 N = 140 chunk forwards, + 1 = 141, one layer each; rank 0 143
    # forwards of which the 31 of chunk 0 (the embedding) hold no layer: 112; rank 15 112 warm-up forwards
    # (chunks 0..6 of micro-batches 0..15) then F(chunk 7, no layer) / B(chunk 7) pairs, then F(chunk 0 of
    # mb 16) before B(chunk 6 of mb 0): 113.
    (0, 32, [112, 141, 113]),
    # m = 16 = p: the warm-ups of ranks 0 and 1 (142, 140) exceed m v = 128, so every forward runs before the
    # first backward (get_pp_rank_microbatches: are_all_microbatches_in_warmup): 16 x 7 = 112 and 16 x 8 = 128
    # layers; rank 15 112 forwards of chunks 0..6, then only chunk-7 forwards (no layer): 112.
    (1, 16, [112, 128, 112]),
])
def test_layers_in_flight_by_hand(run_i, m, expected):
    sc = _sc(DATA["runs"][run_i])
    assert sc.num_microbatches == m
    dense_b, _ = saved_bytes_per_layer_kind(sc.model, sc.training, sc.plan)
    got = [stage_saved_bytes(sc.model, sc.training, sc.plan, m, r, (7, 8, 7)[i]) / dense_b
           for i, r in enumerate((0, 1, 15))]
    assert got == pytest.approx(expected)
    # rank 1 (one layer per chunk): the same count walking Megatron's action list
    assert measured_peak(rank_actions("megatron", 16, 8, m, 1, 16)) == expected[1]


def test_uneven_chunks_counted_over_the_action_list():
    """vpp 4 on the 7 + 14 x 8 + 7 layout (the benchmark's former mapping), m = 32, N = 16, Megatron's order.
    Rank 15, chunks (2, 2, 2, 1): 48 warm-up forwards, chunks 0..2 of micro-batches 0..15 = 96 layers; pairs
    F(chunk 3) / B(chunk 3) hold 97; F(chunk 0 of mb 16, 2 layers) before B(chunk 2 of mb 0): 98. Rank 0,
    chunks (1, 2, 2, 2): 78 warm-up forwards = micro-batches 0..15 on all chunks (112 layers) and chunk 0 of
    16..29 (14), then F(chunk 0 of mb 30): 127. The mean chunk gave 49 x 7/4 = 85.75 and 79 x 7/4 = 138.25."""
    run = DATA["runs"][0]
    sc = _sc(run).model_copy(update={"plan": bench.meta_plan(run, DATA["stated"] | {"vpp": 4})})
    dense_b, _ = saved_bytes_per_layer_kind(sc.model, sc.training, sc.plan)
    got = [stage_saved_bytes(sc.model, sc.training, sc.plan, 32, r, n) / dense_b for r, n in ((0, 7), (1, 8), (15, 7))]
    assert got == pytest.approx([127, 154, 98])  # rank 1: (2 x 14 + 3 x 16 + 1) chunks x 2 layers


@pytest.mark.parametrize("m, peak", [(32, 141), (16, 128)])
def test_torch_pipelining_holds_the_same(m, peak):
    """torch.distributed.pipelining's ScheduleInterleaved1F1B (the same tunable-N idea: micro-batches per round
    m // max(1, m // p) = 16, warm-up (v - 1) 16 + 2 (p - 1 - r)) holds as many chunks on rank 1 as Megatron's
    order, walking torch's own pipeline_order."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace as NS

    from torch.distributed.pipelining import schedules as TS

    p, v, r = 16, 8, 1
    stages = [NS(stage_index=r + c * p, num_stages=p * v, group_size=p, group_rank=r, is_first=False,
                 is_last=False, submod=torch.nn.Identity()) for c in range(v)]
    order = TS.ScheduleInterleaved1F1B(stages, n_microbatches=m).pipeline_order[r]
    actions = [(a.computation_type.value, a.microbatch_index, a.stage_index // p) for a in order
               if a is not None and a.computation_type.value in ("F", "B")]
    assert measured_peak(actions) == peak == measured_peak(rank_actions("torch", p, v, m, r))
