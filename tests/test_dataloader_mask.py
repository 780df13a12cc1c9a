"""Megatron-LM's dataloader attention mask (TrainingSpec.attention_mask_in_dataloader, memory.dataloader_mask_bytes).

Megatron-LM core_v0.16.1 builds a ``micro_batch x 1 x s x s`` bool mask for every micro-batch unless the launch passes
``--no-create-attention-mask-in-dataloader`` (training/arguments.py: store_false, dest
create_attention_mask_in_dataloader), and puts it on every TP rank of the first and the last pipeline stage
(training/utils.py get_batch_on_this_tp_rank: ``data["attention_mask"].cuda()`` on TP rank 0, ``torch.empty((mbs, 1,
s, s), dtype=torch.bool)`` on the others); under CP each rank keeps its s/cp queries of it (core/utils.py
get_batch_on_this_cp_rank, ``seq_dim = 2`` for the mask). Until 2026-12-05 plan3d counted none of it: 64 MiB at 8K
tokens, 16 GiB at 128K without CP, on the stage that usually peaks."""

from __future__ import annotations

import pytest

from planner import memory
from planner.check import check_paths
from planner.presets import load_hardware, load_model
from planner.search import build_tables
from planner.candidates import SearchSpace
from planner.specs import Plan, Scenario, TrainingSpec

SCRIPT = """#!/bin/bash
torchrun --nproc_per_node 8 --nnodes {nodes} pretrain_gpt.py \\
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \\
  --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \\
  --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \\
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B \\
  --seq-length {seq} --max-position-embeddings {seq} --micro-batch-size {mbs} --global-batch-size 64 \\
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size {pp} --context-parallel-size {cp} \\
  --sequence-parallel --use-distributed-optimizer --bf16 {extra}
"""


def _check(tmp_path, extra: str = "", seq: int = 8192, mbs: int = 1, pp: int = 2, cp: int = 1):
    path = tmp_path / f"run{len(list(tmp_path.iterdir()))}.sh"
    path.write_text(SCRIPT.format(nodes=pp * cp, seq=seq, mbs=mbs, pp=pp, cp=cp, extra=extra))
    (r,) = check_paths([str(path)], load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors, r.errors
    return r


@pytest.mark.parametrize("seq, mbs, pp, cp", [(8192, 1, 2, 1), (16384, 2, 4, 1), (32768, 1, 2, 2), (8192, 1, 1, 1)])
def test_the_mask_is_mbs_by_s_over_cp_by_s_bytes_on_the_first_and_last_stage(tmp_path, seq, mbs, pp, cp):
    """A script without the flag holds ``mbs x (s/cp) x s`` bytes more than the same script with it, on the first and
    the last stage only (once where they are one stage), and says so in a note."""
    on, off = _check(tmp_path, "", seq, mbs, pp, cp), _check(tmp_path, "--no-create-attention-mask-in-dataloader",
                                                              seq, mbs, pp, cp)
    assert on.scenario.training.attention_mask_in_dataloader and not off.scenario.training.attention_mask_in_dataloader
    assert any("--no-create-attention-mask-in-dataloader" in n for n in on.notes)
    mask = mbs * (seq // cp) * seq
    a, b = memory.estimate_scenario_memory(on.scenario), memory.estimate_scenario_memory(off.scenario)
    for r, (x, y) in enumerate(zip(a.stages, b.stages)):
        assert x.total_bytes - y.total_bytes == pytest.approx(mask if r in (0, pp - 1) else 0.0, abs=1.0), r


def test_other_frameworks_build_none():
    from planner.specs import job_problems

    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    for fw, refused in (("torchtitan", True), ("deepspeed", True), ("megatron", False), ("nemo", False)):
        tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192, framework=fw,
                          attention_mask_in_dataloader=True)
        assert any(x.startswith("attention_mask_in_dataloader:") for x in job_problems(model, hw, tr)) == refused


def test_search_tables_carry_the_mask():
    """Each table entry of a search of a job with the mask is memory.stage_memory of its plan (first stages and
    loss stages, pp 1 and more), so the search sees what check counts."""
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=8192, attention_mask_in_dataloader=True)
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=2, max_cp=2))
    keys = legal_keys(tables)
    checked = [assert_entry_is_estimate(model, hw, tr, tables, k) for k in keys[:: max(1, len(keys) // 40)]]
    assert {p.pp > 1 for p in checked} == {True, False} and any(p.cp > 1 for p in checked)


def test_emitted_megatron_launches_turn_it_off(tmp_path):
    """plan3d's Megatron-LM launch files pass --no-create-attention-mask-in-dataloader (the plan was sized without the
    mask), and check reads them back without it."""
    from planner.emit import render_all
    from planner.io import write_all

    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=8192),
                  plan=Plan(tp=4, pp=2, dp=2, micro_batch_size=1, sequence_parallel=True, zero_stage=1))
    for script in write_all(tmp_path / "out", render_all(sc, ["megatron", "torchrun", "slurm"])):
        if script.suffix == ".json":
            continue
        assert "--no-create-attention-mask-in-dataloader" in script.read_text(), script
        (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
        assert not r.errors and not r.scenario.training.attention_mask_in_dataloader, script
