"""Megatron-LM with torch's FSDP2 (``--use-torch-fsdp2``): ZeRO 3, unless ``--torch-fsdp2-no-reshard-after-forward``
(core_v0.16.1 arguments.py: store_false dest torch_fsdp2_reshard_after_forward; training.py hands it to
TorchFullyShardedDataParallelConfig(reshard_after_forward=...)), which keeps the gathered weights whole from the
forward through the backward: read as ZeRO 2 (whole 16-bit weights, sharded gradients and states). Until 2026-12-05
the flag was ignored and such a launch judged with ZeRO 3's layer-at-a-time weights: Llama-3-8B on 8 GPUs about
12 GiB short of what it holds."""

from __future__ import annotations

from planner.check import check_paths
from planner.presets import load_hardware

SCRIPT = """#!/bin/bash
torchrun --nproc_per_node 8 pretrain_gpt.py \\
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \\
  --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \\
  --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \\
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B \\
  --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 64 \\
  --use-torch-fsdp2 --bf16 --no-create-attention-mask-in-dataloader --recompute-granularity full \\
  --recompute-method uniform --recompute-num-layers 1 {extra}
"""


def test_no_reshard_after_forward_keeps_the_whole_weights(tmp_path):
    out = {}
    for extra in ("", "--torch-fsdp2-no-reshard-after-forward"):
        path = tmp_path / f"run{len(out)}.sh"
        path.write_text(SCRIPT.format(extra=extra))
        (r,) = check_paths([str(path)], load_hardware("h100-sxm-80gb"), None, None)
        assert not r.errors, r.errors
        out[extra] = r
    resharded, whole = out[""], out["--torch-fsdp2-no-reshard-after-forward"]
    assert (resharded.scenario.plan.zero_stage, whole.scenario.plan.zero_stage) == (3, 2)
    w3, w2 = (r.memory().stages[0].weights_bytes for r in (resharded, whole))
    params = whole.scenario.model.num_params  # pp 1, tp 1: every weight on every rank, 2 bytes each
    assert w2 >= 2 * params > 4 * w3
