"""Megatron --defer-embedding-wgrad-compute (TrainingSpec.defer_embedding_wgrad, memory.deferred_wgrad_bytes).

core_v0.16.1 tensor_parallel/layers.py: with the flag, the output layer's backward appends its logits gradient
(``grad_output_buffer.append(grad_output)``, s x b x V/tp) instead of running the wgrad GEMM, and its forward keeps
its input (``embedding_activation_buffer.append(input_parallel)``), for ``--wgrad-deferral-limit`` micro-batches (0,
the default: all), until the pipeline flush. NeMo's large-model performance recipes turn it on. Until 2026-12-05
plan3d's reader ignored the flag: Llama-3-70B at tp 8, 8K tokens, 16 micro-batches deferred are 4.2 GiB on the
last stage that was not counted (0.26 GiB each)."""

from __future__ import annotations

import numpy as np
import pytest

from planner import memory
from planner.candidates import SearchSpace
from planner.check import check_paths
from planner.presets import load_hardware, load_model
from planner.search import build_tables
from planner.specs import TrainingSpec

SCRIPT = """#!/bin/bash
torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py \\
  --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \\
  --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \\
  --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \\
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-70B \\
  --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 32 \\
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size {pp} --sequence-parallel \\
  --use-distributed-optimizer --bf16 --no-create-attention-mask-in-dataloader {extra}
"""


def _check(tmp_path, extra: str, pp: int = 4):
    path = tmp_path / f"run{len(list(tmp_path.iterdir()))}.sh"
    path.write_text(SCRIPT.format(pp=pp, extra=extra))
    (r,) = check_paths([str(path)], load_hardware("h100-sxm-80gb"), None, None)
    return r


@pytest.mark.parametrize("limit, deferred", [("", 16), ("--wgrad-deferral-limit 5", 5), ("--wgrad-deferral-limit 40", 16)])
def test_last_stage_keeps_each_deferred_logits_gradient_and_input(tmp_path, limit, deferred):
    """pp 4, dp 2, 32 sequences: 16 micro-batches per step; the last stage holds ``deferred`` x (s x V_pad/8 + s x
    h/8) x 2 bytes more, the others nothing more."""
    base, on = _check(tmp_path, ""), _check(tmp_path, f"--defer-embedding-wgrad-compute {limit}")
    assert not base.errors and not on.errors, on.errors
    assert on.scenario.training.defer_embedding_wgrad and on.scenario.num_microbatches == 16
    v_pad = memory.padded_vocab_size(128256, 8)
    per_mb = 8192 * v_pad / 8 * 2 + 8192 * 8192 / 8 * 2
    a, b = memory.estimate_scenario_memory(on.scenario), memory.estimate_scenario_memory(base.scenario)
    for r, (x, y) in enumerate(zip(a.stages, b.stages)):
        assert x.total_bytes - y.total_bytes == pytest.approx(deferred * per_mb if r == 3 else 0.0, abs=1.0), r


def test_refused_as_megatron_refuses_it(tmp_path):
    r = _check(tmp_path, "--defer-embedding-wgrad-compute", pp=1)
    assert r.errors and "pipeline parallelism" in r.errors[0]
    r = _check(tmp_path, "--defer-embedding-wgrad-compute --no-gradient-accumulation-fusion")
    assert r.errors and "gradient accumulation fusion" in r.errors[0]


def test_search_tables_carry_it():
    """Each table entry of a search of a job that defers is memory.stage_memory of its plan; no pp-1 plan is legal."""
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=8192, defer_embedding_wgrad=True,
                      wgrad_deferral_limit=3)
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=2))
    keys = legal_keys(tables)
    assert keys and all(tables.plan(k).pp > 1 for k in keys)
    checked = [assert_entry_is_estimate(model, hw, tr, tables, k) for k in keys[:: max(1, len(keys) // 40)]]
    assert np.unique([p.micro_batch_size for p in checked]).size == 2


def test_emitted_launch_defers_as_the_plan_was_sized(tmp_path):
    """plan3d's Megatron-LM launch of a job that defers passes both flags, and check reads the same job back: the
    same memory, stage by stage."""
    from planner.emit import render_all
    from planner.io import write_all
    from planner.specs import Plan, Scenario

    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=8192, defer_embedding_wgrad=True,
                                        wgrad_deferral_limit=4),
                  plan=Plan(tp=4, pp=2, dp=2, micro_batch_size=1, sequence_parallel=True, zero_stage=1))
    for script in write_all(tmp_path / "out", render_all(sc, ["torchrun", "megatron"])):
        if script.suffix == ".json":
            continue
        text = script.read_text()
        assert "--defer-embedding-wgrad-compute" in text and "--wgrad-deferral-limit" in text, script
        (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
        assert not r.errors, r.errors
        assert (r.scenario.training.defer_embedding_wgrad, r.scenario.training.wgrad_deferral_limit) == (True, 4)
        assert r.memory().stages == memory.estimate_scenario_memory(sc).stages
