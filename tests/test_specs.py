"""Invariant tests (one per rule) and golden parameter counts for the specs."""

import pytest

from planner.presets import (HARDWARE_DIRNAME, MODEL_DIRNAME, SpecError, build, load_hardware, load_model,
                             preset_names)
from planner.memory import layer_activation_terms
from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec, padded_vocab_size

ALL_MODELS = preset_names(MODEL_DIRNAME)
ALL_HARDWARE = preset_names(HARDWARE_DIRNAME)


def test_every_required_preset_is_bundled():
    assert {"a100-40gb", "a100-80gb", "h100-sxm-80gb", "h200-141gb", "b200-180gb", "mi300x-192gb",
            "cpu-gloo"} <= set(ALL_HARDWARE)
    megatron = {f"megatron-gpt-{x}" for x in ("1.7b", "3.6b", "7.5b", "18.4b", "39.1b", "76.1b", "145.6b",
                                              "310.1b", "529.6b", "1t")}
    assert {"gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b",
            "mistral-7b", "gpt-neox-20b", "bloom-176b", "tiny-gpt"} | megatron <= set(ALL_MODELS)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_every_model_preset_loads(name):
    spec = load_model(name)
    assert spec.name == name and spec.num_params > 0


@pytest.mark.parametrize("name", ALL_HARDWARE)
def test_every_hardware_preset_loads(name):
    spec = load_hardware(name)
    assert spec.name == name and 0 < spec.usable_memory_gib < spec.gpu_memory_gib + 1e-9


@pytest.mark.parametrize("name", ALL_HARDWARE)
def test_every_hardware_figure_names_its_source(name):
    from planner.presets import preset_dir

    for line in (preset_dir(HARDWARE_DIRNAME) / f"{name}.yaml").read_text().splitlines():
        if line.strip() and not line.startswith(("#", "name:")):
            assert "#" in line, f"{name}: no source comment on: {line}"


# Golden parameter counts. Llama: the published model cards' exact totals; GPT-3: Narayanan et
# al. 2021 (Megatron-LM) Table 1/2 report 174.6B for the 96-layer, h=12288 model.
@pytest.mark.parametrize("name,expected", [
    ("llama2-7b", 6_738_415_616),
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
])
def test_golden_exact_parameter_counts(name, expected):
    assert load_model(name).num_params == expected


def test_golden_gpt3_parameter_count_within_0_1_percent():
    assert abs(load_model("gpt3-175b").num_params / 174.6e9 - 1) < 0.001


def test_hf_config_import_matches_presets():
    for cfg, preset in (("tests/data/llama3-8b.config.json", "llama3-8b"),
                        ("tests/data/mistral-7b.config.json", "mistral-7b")):
        imported, bundled = load_model(cfg), load_model(preset)
        assert imported.num_params == bundled.num_params
        assert imported.kv_heads == bundled.kv_heads == 8
        assert imported.activation == "swiglu" and imported.norm == "rmsnorm"


def test_hf_gpt2_config(tmp_path):
    # GPT-2 small (openai-community/gpt2 config.json): 124,439,808 parameters, tied embeddings.
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,'
                   ' "vocab_size": 50257, "n_inner": null}')
    assert load_model(str(cfg)).num_params == 124_439_808


# --- invariants, one per rule ---------------------------------------------------------------------
def _model(**kw):
    base = dict(name="m", num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1000)
    return ModelSpec(**(base | kw))


def _scenario(plan, model=None, gpus=8, batch=16, seq=128, hardware="a100-80gb"):
    return {"model": (model or _model()).model_dump(), "hardware": load_hardware(hardware).model_dump(),
            "training": {"num_gpus": gpus, "global_batch_size": batch, "seq_len": seq}, "plan": plan}


def _errors(data):
    with pytest.raises(SpecError) as exc:
        build(Scenario, data, "t")
    return "\n".join(exc.value.lines)


def test_unknown_key_rejected():
    with pytest.raises(SpecError, match="hidden_sise: unknown key"):
        build(ModelSpec, {"name": "m", "num_layers": 2, "hidden_sise": 4, "hidden_size": 4,
                          "num_attention_heads": 1, "vocab_size": 3}, "x")


def test_specs_are_frozen():
    with pytest.raises(Exception):
        _model().num_layers = 3


def test_world_size_product_message():
    msg = _errors(_scenario({"tp": 2, "pp": 2, "dp": 3, "micro_batch_size": 1}))
    assert "tp(2) * pp(2) * dp(3) * cp(1) = 12 != num_gpus(8)" in msg


def test_batch_divisibility_message():
    msg = _errors(_scenario({"tp": 2, "pp": 1, "dp": 4, "micro_batch_size": 3}))
    assert "global_batch_size: 16 is not divisible by micro_batch_size(3) * dp(4) = 12" in msg


def test_heads_divisible_by_tp():
    msg = _errors(_scenario({"tp": 8, "pp": 1, "dp": 1, "micro_batch_size": 1}, model=_model(num_attention_heads=4, hidden_size=256)))
    assert "num_attention_heads(4) is not divisible by tp(8)" in msg


def test_kv_heads_replicated_when_tp_exceeds_them():
    data = _scenario({"tp": 8, "pp": 1, "dp": 1, "micro_batch_size": 1}, model=_model(num_kv_heads=2))
    assert build(Scenario, data, "t").plan.tp == 8  # 8 % 2 == 0: KV heads replicated 4x


def test_kv_heads_neither_divisible():
    model = _model(num_attention_heads=12, hidden_size=384, num_kv_heads=3)
    msg = _errors(_scenario({"tp": 4, "pp": 1, "dp": 2, "micro_batch_size": 1}, model=model))
    assert "num_kv_heads(3) is not divisible by tp(4)" in msg


def test_layers_split_over_pp_and_vpp():
    msg = _errors(_scenario({"tp": 1, "pp": 4, "vpp": 3, "dp": 2, "micro_batch_size": 1}))
    assert "num_layers(8) is not divisible by pp(4) * vpp(3) = 12" in msg


def test_uneven_layers_must_sum():
    msg = _errors(_scenario({"tp": 1, "pp": 2, "dp": 4, "micro_batch_size": 1, "layers_per_stage": [3, 4]}))
    assert "layers_per_stage: sum 7 != num_layers(8)" in msg


def test_every_problem_reported_at_once():
    msg = _errors(_scenario({"tp": 3, "pp": 3, "dp": 1, "micro_batch_size": 5}))
    assert msg.count("\n") >= 3


def test_sequence_parallel_needs_tp():
    with pytest.raises(ValueError, match="sequence_parallel: needs tp > 1"):
        Plan(tp=1, pp=1, dp=1, micro_batch_size=1, sequence_parallel=True)


def test_fp8_needs_hardware_support():
    data = _scenario({"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1}, hardware="a100-80gb")
    data["training"]["precision"] = "fp8"
    assert "a100-80gb has no fp8 peak" in _errors(data)


def test_learned_positions_need_max_seq_len():
    with pytest.raises(ValueError, match="max_seq_len: required"):
        _model(position_embedding="learned")


def test_num_microbatches_is_derived():
    sc = build(Scenario, _scenario({"tp": 2, "pp": 2, "dp": 2, "micro_batch_size": 2}), "t")
    assert sc.resolved_plan().num_microbatches == 16 // (2 * 2)
    assert sc.resolved_plan().layers_per_stage == (4, 4)


def test_padded_vocab_as_megatron():
    assert padded_vocab_size(50257, 1) == 50304  # GPT-2 vocab padded to a multiple of 128
    assert padded_vocab_size(50257, 8) == 51200
    assert padded_vocab_size(128256, 8) == 128 * 8 * 126 - 1024 + 1024  # 129024


def test_training_spec_rejects_zero():
    with pytest.raises(Exception):
        TrainingSpec(num_gpus=0, global_batch_size=1, seq_len=1)


def test_dropout_default_follows_the_architecture_family():
    """Not given: Megatron-LM's 0.1 for learned-position GPT models (its ``--hidden-dropout`` default, NeMo's
    GPT-3 configs), none for RoPE and ALiBi models (their configs' 0.0); given: as given."""
    base = dict(name="x", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    assert ModelSpec(**base, position_embedding="learned", max_seq_len=128).dropout is True
    assert ModelSpec(**base).dropout is False
    assert ModelSpec(**base, position_embedding="alibi").dropout is False
    assert ModelSpec(**base, position_embedding="learned", max_seq_len=128, dropout=False).dropout is False
    assert ModelSpec(**base, dropout=True).dropout is True
    gpt = ModelSpec(**base, position_embedding="learned", max_seq_len=128)
    training = TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=128)
    terms = {t.name for t in layer_activation_terms(gpt, training, Plan(tp=1, pp=1, dp=1, micro_batch_size=1))}
    assert "attention residual dropout mask" in terms  # the masks are stored (planner.memory)
