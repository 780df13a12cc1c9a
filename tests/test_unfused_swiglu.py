"""Megatron-LM --no-bias-swiglu-fusion (TrainingSpec.unfused_swiglu): the dense MLP runs core_v0.16.1 mlp.py's eager
glu, ``silu(x_glu) * (x_linear + glu_linear_offset)``, whose multiply saves the SiLU output and the offset sum, two
new tensors of f/tp elements per token. Until 2026-12-05 plan3d's Megatron reader ignored the flag and counted the
fused kernel's saved input only. The flags are the ones Megatron's own parser takes (core_v0.16.1 arguments.py:
``--no-bias-swiglu-fusion`` store_false dest bias_swiglu_fusion; ``--use-te-activation-func`` from
TransformerConfig)."""

from __future__ import annotations

import pytest

from planner.check import check_paths
from planner.memory import saved_bytes_per_layer_kind
from planner.presets import load_hardware, load_model
from planner.specs import TrainingSpec, job_problems

SCRIPT = """#!/bin/bash
torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \\
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \\
  --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \\
  --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \\
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B \\
  --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 2 --global-batch-size 64 \\
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --sequence-parallel \\
  --use-distributed-optimizer --bf16 --no-create-attention-mask-in-dataloader {extra}
"""


def _scenario(tmp_path, extra: str):
    path = tmp_path / f"run{len(list(tmp_path.iterdir()))}.sh"
    path.write_text(SCRIPT.format(extra=extra))
    (r,) = check_paths([str(path)], load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors, r.errors
    return r.scenario


@pytest.mark.parametrize("recompute, extra_per_token", [("", 2), ("--recompute-granularity full "
                                                                  "--recompute-method uniform --recompute-num-layers 1", 0)])
def test_eager_glu_saves_two_more_ffn_wide_tensors(tmp_path, recompute, extra_per_token):
    """Per layer and micro-batch: 2 x (s x b) x f/tp x 2 bytes more (none under full recompute, which keeps the
    layer input only); --use-te-activation-func takes Transformer Engine's path first, as fused."""
    fused, eager, te = (_scenario(tmp_path, f"{recompute} {x}") for x in (
        "", "--no-bias-swiglu-fusion", "--no-bias-swiglu-fusion --use-te-activation-func"))
    assert eager.training.unfused_swiglu and not fused.training.unfused_swiglu and not te.training.unfused_swiglu
    layer = [saved_bytes_per_layer_kind(sc.model, sc.training, sc.resolved_plan())[0] for sc in (fused, eager, te)]
    assert layer[1] - layer[0] == pytest.approx(extra_per_token * 8192 * 2 * (14336 / 4) * 2)
    assert layer[2] == layer[0]


def test_refused_where_it_is_not_modelled():
    hw = load_hardware("h100-sxm-80gb")
    for model, fw in (("llama3-8b", "torchtitan"), ("mixtral-8x7b", "megatron"), ("gpt3-175b", "megatron")):
        tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, framework=fw, unfused_swiglu=True)
        assert any(x.startswith("unfused_swiglu:") for x in job_problems(load_model(model), hw, tr)), (model, fw)
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, unfused_swiglu=True)
    assert not job_problems(load_model("llama3-8b"), hw, tr)


def test_megatron_deepspeed_swiglu_is_eager():
    """Megatron-DeepSpeed's ParallelMLP defines SwiGLU as ``F.silu(x[0]) * x[1]`` (microsoft/Megatron-DeepSpeed
    1e3fc81, megatron/model/transformer.py), so the deepspeed profile keeps the SiLU output too: s x b x f/tp x 2 bytes
    per layer more than Megatron-LM's fused kernel (until 2026-12-05 it was counted as fused)."""
    from planner.specs import Plan

    model = load_model("llama3-8b")
    plan = Plan(tp=2, pp=1, dp=4, micro_batch_size=1)
    per_layer = {fw: saved_bytes_per_layer_kind(model, TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096,
                                                                    framework=fw), plan)[0]
                 for fw in ("megatron", "deepspeed")}
    assert per_layer["deepspeed"] - per_layer["megatron"] == pytest.approx(4096 * model.ffn_size / 2 * 2)
