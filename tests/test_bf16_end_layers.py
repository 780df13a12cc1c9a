"""Megatron --first-last-layers-bf16 (TrainingSpec.bf16_layers_at_start/end, memory.bf16_layers_extra_bytes).

core_v0.16.1 fp8_utils.py: ``is_first_last_bf16_layer`` (global layer numbers below num_layers_at_start_in_bf16 or
from num_layers - num_layers_at_end_in_bf16 on, 1 and 1 by default) makes ``get_fp8_context`` return a null context,
so those layers run in bf16 and Transformer Engine saves their GEMM inputs in 16 bits where the FP8 layers save
FP8 copies. Until 2026-12-05 plan3d's Megatron reader ignored the flag (every layer counted at 1 B per GEMM input);
for a stop it refused the file."""

from __future__ import annotations

import pytest

from planner import memory
from planner.candidates import SearchSpace
from planner.check import check_paths
from planner.presets import load_hardware, load_model
from planner.search import build_tables
from planner.specs import Plan, TrainingSpec, job_problems

SCRIPT = """#!/bin/bash
torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py \\
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \\
  --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \\
  --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \\
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B \\
  --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 64 \\
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size {pp} --sequence-parallel \\
  --use-distributed-optimizer --bf16 --fp8-format hybrid --fp8-recipe tensorwise \\
  --no-create-attention-mask-in-dataloader {extra}
"""


def _check(tmp_path, extra: str, pp: int = 4):
    path = tmp_path / f"run{len(list(tmp_path.iterdir()))}.sh"
    path.write_text(SCRIPT.format(pp=pp, extra=extra))
    (r,) = check_paths([str(path)], load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors, r.errors
    return r


@pytest.mark.parametrize("extra, start, end", [
    ("--first-last-layers-bf16", 1, 1),
    ("--first-last-layers-bf16 --num-layers-at-start-in-bf16 2 --num-layers-at-end-in-bf16 0", 2, 0),
])
def test_end_layers_save_16_bit_gemm_inputs(tmp_path, extra, start, end):
    """pp 4 (1F1B: 4, 3, 2, 1 micro-batches in flight on ranks 0-3): rank 0 holds ``start`` layers x 4 micro-batches
    and rank 3 ``end`` x 1 of one layer's bf16 activations over its fp8 ones more; ranks 1-2 nothing."""
    base, on = _check(tmp_path, ""), _check(tmp_path, extra)
    tr = on.scenario.training
    assert (tr.bf16_layers_at_start, tr.bf16_layers_at_end) == (start, end)
    plan = on.scenario.resolved_plan()
    fp8 = memory.saved_bytes_per_layer_kind(on.scenario.model, tr, plan)[0]
    bf16 = memory.saved_bytes_per_layer_kind(on.scenario.model, tr.model_copy(update={"precision": "bf16"}), plan)[0]
    assert bf16 > fp8
    a, b = memory.estimate_scenario_memory(on.scenario), memory.estimate_scenario_memory(base.scenario)
    expected = [start * 4 * (bf16 - fp8), 0.0, 0.0, end * 1 * (bf16 - fp8)]
    for r, (x, y) in enumerate(zip(a.stages, b.stages)):
        assert x.total_bytes - y.total_bytes == pytest.approx(expected[r], abs=1.0), r


def test_rules_megatron_and_plan3d_keep():
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")

    def problems(**kw):
        tr = TrainingSpec(**({"num_gpus": 8, "global_batch_size": 8, "seq_len": 4096, "precision": "fp8",
                              "fp8_recipe": "tensorwise", "bf16_layers_at_start": 1} | kw))
        return [x for x in job_problems(model, hw, tr) if x.startswith("bf16_layers")]
    assert not problems()
    assert problems(fp8_recipe="delayed")  # TransformerConfig: 'Delayed scaling does not support ...'
    assert problems(precision="bf16", fp8_recipe="delayed")
    assert problems(framework="torchtitan")
    assert problems(fp8_params=True)


def test_search_tables_carry_them():
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=8192, precision="fp8", fp8_recipe="tensorwise",
                      bf16_layers_at_start=2, bf16_layers_at_end=1)
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=2))
    keys = legal_keys(tables)
    checked = [assert_entry_is_estimate(model, hw, tr, tables, k) for k in keys[:: max(1, len(keys) // 40)]]
    assert {p.pp > 1 for p in checked} == {True, False}


def test_emitted_launch_carries_the_counts(tmp_path):
    from planner.emit import render_all
    from planner.io import write_all
    from planner.specs import Scenario

    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=8192, precision="fp8",
                                        fp8_recipe="tensorwise", bf16_layers_at_start=2, bf16_layers_at_end=1),
                  plan=Plan(tp=4, pp=2, dp=2, micro_batch_size=1, sequence_parallel=True, zero_stage=1))
    for script in write_all(tmp_path / "out", render_all(sc, ["torchrun", "megatron"])):
        if script.suffix == ".json":
            continue
        (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
        assert not r.errors, r.errors
        assert (r.scenario.training.bf16_layers_at_start, r.scenario.training.bf16_layers_at_end) == (2, 1)
        assert r.memory().stages == memory.estimate_scenario_memory(sc).stages


def test_search_keeps_megatrons_per_stage_limit():
    """Megatron allows at most num_layers // pp bf16 layers at each end (TransformerConfig.__post_init__): with 4 at
    the start of Llama-3-8B's 32 layers, the search tabulates pp 16 shapes but none of their entries is legal."""
    from tests.table_checks import legal_keys

    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=4096, precision="fp8", fp8_recipe="tensorwise",
                      bf16_layers_at_start=4)
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=1))
    assert any(sh[3].pp == 16 for sh in tables.shapes), "no pp-16 shape: the test cannot fail"
    legal_pps = {tables.plan(k).pp for k in legal_keys(tables)}
    assert legal_pps and max(legal_pps) <= 8, legal_pps
