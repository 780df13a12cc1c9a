"""A launch script's CUBLAS_WORKSPACE_CONFIG sets PyTorch's cuBLAS workspace per GEMM thread, which the Megatron
profile counts (memory.gemm_workspace_bytes): NVIDIA's deterministic Megatron-LM functional tests export ``:4096:8``
(32 MiB) on every GPU. Expected sizes are PyTorch's own parse (aten/src/ATen/cuda/CublasHandlePool.cpp,
``parseChosenWorkspaceSize``: the sum of the ``:SIZE:COUNT`` pairs, SIZE in KiB), by hand."""

from planner.check import check_file
from planner.presets import load_hardware

A100 = load_hardware("a100-80gb")  # PyTorch's default before Hopper: :4096:2:16:8 = 8.125 MiB
LAUNCH = ("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 4 --hidden-size 512 --num-attention-heads 8 "
          "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32 --bf16 "
          "--vocab-size 50257 --tokenizer-type NullTokenizer\n")
MIB = 2**20


def _other(tmp_path, prefix: str, name: str):
    path = tmp_path / name
    path.write_text("#!/bin/bash\n" + prefix + LAUNCH)
    r = check_file(path, A100, None, None)
    assert not r.errors, r.errors
    return r.memory().stages[-1].other_bytes, r.notes


def test_the_scripts_workspace_config_replaces_the_profiles(tmp_path):
    base, notes = _other(tmp_path, "", "plain.sh")
    assert not any("CUBLAS_WORKSPACE_CONFIG" in n for n in notes)
    # the loss stage runs torch GEMMs on two threads (forward, autograd): 2 x (32 - 8.125) MiB more
    exported, notes = _other(tmp_path, "export CUBLAS_WORKSPACE_CONFIG=:4096:8\n", "exported.sh")
    assert exported - base == 2 * (32 - 8.125) * MIB
    assert any(n.startswith("CUBLAS_WORKSPACE_CONFIG=:4096:8: PyTorch's cuBLAS workspace 32 MiB") for n in notes)
    # a prefix on the launch itself; two pairs add up: 16 KiB x 8 + 4096 KiB x 1 = 4.125 MiB
    prefixed, _ = _other(tmp_path, "CUBLAS_WORKSPACE_CONFIG=:16:8:4096:1 ", "prefixed.sh")
    assert prefixed - base == 2 * (4.125 - 8.125) * MIB


def test_a_value_pytorch_would_not_parse_or_the_script_does_not_set_keeps_the_profile(tmp_path):
    base, _ = _other(tmp_path, "", "plain.sh")
    bad, notes = _other(tmp_path, "export CUBLAS_WORKSPACE_CONFIG=4096\n", "bad.sh")
    assert bad == base and any("does not parse as :SIZE:COUNT pairs" in n for n in notes)
    unknown, notes = _other(tmp_path, "export CUBLAS_WORKSPACE_CONFIG=$CFG\n", "unknown.sh")
    assert unknown == base and any("CUBLAS_WORKSPACE_CONFIG comes from" in n for n in notes)
