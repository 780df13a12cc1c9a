"""The Megatron-LM reader against Megatron-LM itself (core_v0.16.1, from ../shared/consumers).

For every Megatron-LM launch in tests/data/launch (each branch) the arguments `plan3d check` found are
given to Megatron's own ``parse_args`` and ``validate_args``; the sizes Megatron derives (FFN width,
query groups, sequence parallelism at tp 1, global batch, data-parallel size, virtual stages, padded
vocabulary) must be the ones plan3d's scenario carries. Stand-ins, as ../shared/consumers/README.md
allows: ``get_device_arch_version`` answers 9 (Hopper) because there is no CUDA device here, and so does
``torch.cuda.get_device_capability`` (asked under ``--moe-grouped-gemm``); data and
checkpoint paths (``--data-path``, ``--save``, ...) are dropped since nothing is read or written.
"""

import os
import sys
import warnings
from pathlib import Path

import pytest

from planner.check import check_file_branches, read_flags
from planner.presets import load_hardware
from planner.readers.args import megatron_flag_table
from planner.readers.bash import is_unknown

LAUNCH = Path(__file__).parent / "data" / "launch"
MEGATRON_LM_FILES = ["megatron_gpt3_175b.sh", "megatron_llama3_8b_fp8.sh", "megatron_llama2_7b_swiglu_default.sh",
                     "megatron_gqa_default.sh", "megatron_size_case.sh", "megatron_if_branch.sh",
                     "megatron_llama3_70b.slurm", "megatron_moe.sh",
                     # real public files (tests/data/launch/real/README.md)
                     "real/megatron_lm_train_gpt3_857m_distributed.sh",
                     "real/megatron_lm_train_mixtral_8x7b_distributed.sh",
                     "real/megatron_lm_train_deepseek2_lite_h100_fp8.sh",
                     "real/megatron_lm_train_llama3_8b_h100_fp8.sh"]
DROPPED = ("--save", "--load", "--data-path", "--tensorboard-dir", "--vocab-file", "--merge-file", "--data-cache-path")


@pytest.fixture(scope="module")
def megatron_arguments(megatron_lm_root):
    for module in ("torch", "six", "regex", "einops"):
        pytest.importorskip(module, reason=f"Megatron-LM's argument module imports {module} "
                                           "(requirements-consumers.txt)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training import arguments
        from megatron.training.tokenizer import tokenizer
    arguments.get_device_arch_version = lambda: 9  # stand-in: no CUDA device on CI
    yield arguments, tokenizer


def _words(args) -> list[str]:
    out = []
    for flag, value in args.values.items():
        if flag in DROPPED or (isinstance(value, str) and is_unknown(value)):
            continue
        out.append(flag)
        out += value if isinstance(value, list) else [] if value is None else [value]
    return out


def _megatron(arguments, words, world, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))  # stand-in: no CUDA device
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + words)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = arguments.parse_args()
    arguments.validate_args(args)
    return args


def test_flag_table_matches_megatron(megatron_arguments):
    import argparse

    arguments, _ = megatron_arguments
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    switches = {o for a in parser._actions if a.nargs == 0 for o in a.option_strings}
    nargs = {o: a.nargs for a in parser._actions if a.nargs not in (None, 0) for o in a.option_strings}
    ours_switches, ours_nargs = megatron_flag_table()
    assert switches <= ours_switches
    assert nargs == ours_nargs


@pytest.mark.parametrize("name", MEGATRON_LM_FILES)
def test_reader_agrees_with_megatron_validate_args(megatron_arguments, name, monkeypatch, capsys):
    arguments, tokenizer = megatron_arguments
    path = LAUNCH / name
    results = check_file_branches(path, load_hardware("h200-141gb"), None, None)
    assert results and not any(r.errors for r in results)
    for r in results:
        args = read_flags(path) if r.branch is None else _branch_args(path, r.branch)
        sc = r.scenario
        plan = sc.resolved_plan()
        m = _megatron(arguments, _words(args), sc.training.num_gpus, monkeypatch)
        capsys.readouterr()
        assert m.ffn_hidden_size == sc.model.ffn_size, name
        if m.multi_latent_attention:  # MLA's widths are its own flags; --kv-channels is unused there
            assert (m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.q_lora_rank) == (
                sc.model.kv_lora_rank, sc.model.qk_nope_head_dim, sc.model.qk_rope_head_dim, sc.model.v_head_dim,
                sc.model.q_lora_rank)
        else:
            assert m.kv_channels == sc.model.kv_channels
        assert (m.num_query_groups if m.group_query_attention else m.num_attention_heads) == sc.model.kv_heads
        assert m.sequence_parallel == plan.sequence_parallel
        assert m.data_parallel_size == plan.dp and m.global_batch_size == sc.training.global_batch_size
        assert (m.virtual_pipeline_model_parallel_size or 1) == plan.vpp
        assert (m.recompute_granularity or "none") == plan.recompute
        precision = "fp8" if m.fp8 else "bf16" if (m.bf16 or m.fp16) else "fp32"
        assert precision == sc.training.precision
        assert m.num_experts == sc.model.num_experts and m.expert_model_parallel_size == plan.ep
        assert m.expert_tensor_parallel_size == plan.expert_tp  # validate_args: absent = tp
        if m.num_experts:
            assert (m.moe_router_topk, m.moe_ffn_hidden_size) == (sc.model.top_k, sc.model.moe_ffn_size)
        if m.tokenizer_type == "NullTokenizer":  # the real tokenizer class, padded by Megatron's own function
            size = tokenizer._NullTokenizer(m.vocab_size).vocab_size
            assert tokenizer._vocab_size_with_padding(size, m, logging_enabled=False) == \
                _padded(sc.model.vocab_size, plan.tp)


def _padded(vocab: int, tp: int) -> int:
    from planner.specs import padded_vocab_size

    return padded_vocab_size(vocab, tp)


def _branch_args(path, branch):
    from planner.readers.bash import evaluate, sbatch_env
    from planner.readers.launch import find_launches

    for w in evaluate(path.read_text(), str(path), env=sbatch_env({})):
        if all(part in w.branch for part in branch.split("; ")):
            return find_launches(w.commands, path)[0].args
    raise AssertionError(branch)


def test_sequence_parallel_at_tp1_is_turned_off_by_megatron_too(megatron_arguments, monkeypatch, capsys):
    arguments, _ = megatron_arguments
    args = read_flags(LAUNCH / "megatron_llama3_8b_fp8.sh")
    assert args.has("--sequence-parallel")
    m = _megatron(arguments, _words(args), 8, monkeypatch)
    capsys.readouterr()
    assert m.sequence_parallel is False and m.tensor_model_parallel_size == 1
    os.environ.pop("WORLD_SIZE", None)


def _megatron_config_refusal(megatron_arguments, path, monkeypatch, capsys) -> str:
    """What Megatron-Core's own config build (``core_transformer_config_from_args`` after ``validate_args``) raises for
    the launch at ``path``; "" when it accepts it."""
    from megatron.training.arguments import core_transformer_config_from_args

    arguments, _ = megatron_arguments
    args = _megatron(arguments, _words(read_flags(path)), 8, monkeypatch)
    refusal = ""
    try:
        core_transformer_config_from_args(args)
    except ValueError as err:
        refusal = str(err)
    capsys.readouterr()
    os.environ.pop("WORLD_SIZE", None)
    return refusal


RECOMPUTE_CASES = [  # (extra flags, Megatron-Core accepts them)
    (["--recompute-granularity", "full"], False),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], False),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], True),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"], True),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], False),
    (["--recompute-activations", "--recompute-num-layers", "1"], False),
    (["--recompute-activations"], True),
]


@pytest.mark.parametrize("extra,accepted", RECOMPUTE_CASES)
def test_recompute_refusals_match_megatron_core(megatron_arguments, extra, accepted, tmp_path, monkeypatch, capsys):
    """`check` refuses (exit 2) exactly the recompute settings Megatron-Core's own TransformerConfig refuses
    before training starts (core_v0.16.1 transformer_config.py __post_init__)."""
    # --no-rope-fusion: the fused RoPE needs Transformer Engine, which this CPU machine does not have; it is
    # not what the test is about
    flags = " ".join(["--no-rope-fusion", *extra])
    path = tmp_path / "job.sh"
    path.write_text((LAUNCH / "megatron_gqa_default.sh").read_text().rstrip() + f" \\\n    {flags}\n")
    results = check_file_branches(path, load_hardware("h200-141gb"), None, None)
    refusal = _megatron_config_refusal(megatron_arguments, path, monkeypatch, capsys)
    assert (not refusal) is accepted, refusal
    assert accepted or "recompute" in refusal, refusal
    assert (not results[0].errors) is accepted, results[0].errors
    if not accepted:
        assert "Megatron-Core refuses it" in results[0].errors[0]


@pytest.mark.parametrize("grouped, accepted", [(True, True), (False, False)])
def test_moe_act_recompute_needs_grouped_experts_as_in_megatron_core(megatron_arguments, grouped, accepted, tmp_path,
                                                                    monkeypatch, capsys):
    """core_v0.16.1 TransformerConfig: "moe_act in recompute_modules is only supported with moe_grouped_gemm"; `check`
    refuses the same launch (it was read and judged, a launch Megatron does not start)."""
    text = (LAUNCH / "megatron_moe.sh").read_text()
    if not grouped:
        text = text.replace("    --moe-grouped-gemm\n", "")
    path = tmp_path / "job.sh"
    path.write_text(text.replace("--bf16", "--bf16 --no-rope-fusion --recompute-granularity selective "
                                           "--recompute-modules moe_act", 1))
    results = check_file_branches(path, load_hardware("h100-sxm-80gb"), None, None)
    refusal = _megatron_config_refusal(megatron_arguments, path, monkeypatch, capsys)
    assert (not refusal) is accepted, refusal
    assert (not results[0].errors) is accepted, results[0].errors
    if not accepted:
        assert "only supported with moe_grouped_gemm" in refusal and "moe_grouped_gemm" in results[0].errors[0]
