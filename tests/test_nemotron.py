"""Nemotron-4 (Hugging Face ``NemotronForCausalLM``): squared-ReLU MLPs, LayerNorm, partial RoPE; read from its
config, written as Megatron-LM's own flags, and read back from them.

Fixture ``tests/data/hf/nemotron-4-4b.json``: the Nemotron-4 4B config that NVIDIA/TensorRT-LLM's Nemotron test
transcribes (``tests/unittest/_torch/modeling/test_modeling_nemotron.py`` @ 8cb8331d, ``Nemotron_4_4B_CONFIG``; its
``kv_channels`` key, which transformers does not read, left out). Its parameter count is checked against transformers'
own class on the meta device (``tests/test_hf_import.py``: 4,190,509,056).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.hf import hf_fields
from planner.presets import SpecError, load_model
from tests.test_emit_consumers import megatron, megatron_validate  # noqa: F401 (the session fixture)

FIXTURE = Path(__file__).parent / "data" / "hf" / "nemotron-4-4b.json"


def _fields(**update) -> dict:
    data = json.loads(FIXTURE.read_text()) | update
    return hf_fields({k: v for k, v in data.items() if v is not None}, "n", "config.json")


def test_fields_of_the_4b_config():
    """relu2 is squared ReLU (two matrices), NemotronLayerNorm1P a LayerNorm with weight and bias, RoPE on half of
    each head, 8 KV heads of 128 channels, untied, no linear biases."""
    m = load_model(str(FIXTURE))
    assert (m.activation, m.norm, m.rotary_percent, m.num_kv_heads, m.kv_channels) == \
        ("squared_relu", "layernorm", 0.5, 8, 128)
    assert not m.tied_embeddings and not m.gated_mlp and not m.has_mlp_bias and not m.has_qkv_bias
    # 32 layers of q/o 3072^2, k/v 3072 x 1024, up/down 3072 x 9216 and two LayerNorms of 2 x 3072; untied 256,000-row
    # embedding and output layer; the final LayerNorm
    layer = 2 * 3072 * 3072 + 2 * 3072 * 1024 + 2 * 3072 * 9216 + 2 * 2 * 3072
    assert m.num_params == 32 * layer + 2 * 256_000 * 3072 + 2 * 3072 == 4_190_509_056


def test_class_defaults_and_refusals():
    """NemotronConfig's defaults: MHA without num_key_value_heads, RoPE on half of each head without
    partial_rotary_factor (or from rope_parameters, transformers 5's place for it); an activation other than relu2 or
    gelu is refused in one line."""
    assert _fields(num_key_value_heads=None)["num_kv_heads"] is None
    assert _fields(partial_rotary_factor=None)["rotary_percent"] == 0.5
    assert _fields(partial_rotary_factor=None, rope_parameters={"partial_rotary_factor": 0.25})["rotary_percent"] == 0.25
    assert _fields(model_type="nemotron", architectures=None)["activation"] == "squared_relu"
    with pytest.raises(SpecError, match="hidden_act: 'silu' is not modelled for NemotronForCausalLM"):
        _fields(hidden_act="silu")


def test_megatron_builds_it_from_the_emitted_flags(megatron, monkeypatch, tmp_path):  # noqa: F811
    """Megatron-LM core_v0.16.1's own validation and config build take the emitted launch: --squared-relu gives
    the squared_relu activation (arguments.py: activation_func = squared_relu), --rotary-percent 0.5, LayerNorm,
    no linear biases; `plan3d check` reads the same model back from the file."""
    from planner.check import check_file_branches
    from tests.test_emit_moe import _args_file_argv, scenario

    sc = scenario(str(FIXTURE), 8, 64, 4096, tp=2, pp=2, dp=2, sequence_parallel=True, zero_stage=1)
    argv = _args_file_argv(sc, tmp_path)
    args, config, _ = megatron_validate(megatron, monkeypatch, argv, "1")
    assert config.activation_func.__name__ == "squared_relu" and not config.gated_linear_unit
    assert (args.rotary_percent, config.normalization, config.add_bias_linear) == (0.5, "LayerNorm", False)
    (path,) = [p for p in (tmp_path / "args").iterdir()]
    (r,) = check_file_branches(path, None, None, None)
    assert r.scenario.model.activation == "squared_relu" and r.scenario.model.num_params == sc.model.num_params

