"""Hugging Face import of the dense architectures added on 2026-12-08: Gemma (1), Granite, SmolLM3, StarCoder2,
StableLM, GPTBigCode (SantaCoder, StarCoder), BLOOM, Phi (1, 1.5, 2), GPT-J, Cohere (Command R), MPT, GLM-4 (both
classes), Seed-OSS and EXAONE 4, and the two fields Phi, GPT-J, Cohere and MPT need (``ModelSpec.norm_bias``,
``ModelSpec.output_bias``). Each is read exactly or refused (``planner.hf``).

References, never recomputed here from the formula under test:

* the Gemma report (arXiv:2403.08295) Table 2, non-embedding parameters of Gemma 2B and 7B (its embedding figures
  count 256,128 vocabulary rows, the Hub checkpoints 256,000; tests/data/README.md);
* ``transformers`` itself (a dev dependency, 5.24.0 in CI): each configuration built with
  ``AutoModelForCausalLM.from_config`` on the meta device, ``sum(p.numel())`` over its distinct parameters (a tied
  head counted once), for the bundled configs and for each class's own defaults with the structural switches
  flipped (biases, tying, GQA, parallel residual, multi-query).
"""

import json
from pathlib import Path

import pytest

from planner.presets import SpecError, load_model

HF = Path(__file__).resolve().parent / "data" / "hf"


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("name,non_embedding", [("gemma-2b.json", 1_981_884_416), ("gemma-7b.json", 7_751_248_896)])
def test_gemma_non_embedding_counts_from_the_report(name, non_embedding):
    spec = load_model(str(HF / name))
    assert spec.tied_embeddings and spec.activation == "geglu" and spec.norm == "rmsnorm"
    assert spec.kv_channels == 256  # head_dim 256 on both, not h / a (Gemma report Table 1: head size 256)
    assert spec.num_params - spec.vocab_size * spec.hidden_size == non_embedding


def test_gemma_2b_is_multi_query_and_7b_multi_head():
    # Gemma report Table 1: "Num KV heads" 1 (2B) and 16 (7B)
    assert load_model(str(HF / "gemma-2b.json")).kv_heads == 1
    assert load_model(str(HF / "gemma-7b.json")).kv_heads == 16


def test_bloom_176b_count_from_the_model_card():
    """bigscience/bloom model card: "176,247,271,424 parameters: 3,596,615,680 embedding parameters, 70 layers, 112
    attention heads, hidden layers are 14336-dimensional"; the import reads what the bundled preset states."""
    spec = load_model(str(HF / "bloom-176b.json"))
    assert spec.num_params == 176_247_271_424 and spec.vocab_size * spec.hidden_size == 3_596_615_680
    assert (spec.position_embedding, spec.embedding_norm, spec.linear_bias) == ("alibi", True, True)
    preset = load_model("bloom-176b")
    differ = {k for k, v in spec.model_dump().items() if preset.model_dump()[k] != v}
    # the config's dropouts are 0.0 and it states no sequence length (ALiBi has no position table); the preset sets
    # dropout and its 2,048 tokens itself
    assert differ == {"dropout", "max_seq_len"}


def test_starcoder2_structure():
    """StarCoder2's layer (Starcoder2ForCausalLM: q/k/v/o and c_fc/c_proj all with ``use_bias``, LayerNorm with bias,
    a non-gated GeLU MLP, GQA), tied by the class default; its 4,096-token window is ignored (over-estimate)."""
    spec = load_model(str(HF / "starcoder2-3b.json"))
    assert (spec.activation, spec.norm, spec.linear_bias, spec.tied_embeddings) == ("gelu", "layernorm", True, True)
    assert spec.kv_heads == 2 and spec.ffn_size == 12288 and spec.sliding_window is None
    assert spec.dropout  # attention, residual and embedding dropout 0.1 in the config


# --- against transformers itself ----------------------------------------------------------------------------

ARCH = {"gemma": "GemmaForCausalLM", "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM",
        "starcoder2": "Starcoder2ForCausalLM", "stablelm": "StableLmForCausalLM",
        "gpt_bigcode": "GPTBigCodeForCausalLM",
        "bloom": "BloomForCausalLM", "phi": "PhiForCausalLM", "gptj": "GPTJForCausalLM", "cohere": "CohereForCausalLM",
        "mpt": "MptForCausalLM", "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "seed_oss": "SeedOssForCausalLM",
        "exaone4": "Exaone4ForCausalLM"}
CONFIG_CLASS = {"gemma": "GemmaConfig", "granite": "GraniteConfig", "smollm3": "SmolLM3Config",
                "starcoder2": "Starcoder2Config", "stablelm": "StableLmConfig", "gpt_bigcode": "GPTBigCodeConfig",
                "bloom": "BloomConfig", "phi": "PhiConfig", "gptj": "GPTJConfig", "cohere": "CohereConfig",
                "mpt": "MptConfig", "glm": "GlmConfig", "glm4": "Glm4Config", "seed_oss": "SeedOssConfig",
                "exaone4": "Exaone4Config"}
STRUCTURAL = ("vocab_size", "hidden_size", "n_embed", "d_model", "n_heads", "n_layers", "max_seq_len", "rotary_dim",
              "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions", "n_inner")
VARIANTS = [
    ("gemma", {}), ("gemma", {"attention_bias": True}), ("gemma", {"tie_word_embeddings": False}),
    ("gemma", {"num_key_value_heads": 1, "head_dim": 128}),
    ("granite", {}), ("granite", {"attention_bias": True, "mlp_bias": True}),
    ("granite", {"tie_word_embeddings": True, "num_key_value_heads": 8}),
    ("smollm3", {}), ("smollm3", {"attention_bias": True}),
    ("smollm3", {"mlp_bias": True, "tie_word_embeddings": False}),
    ("starcoder2", {}), ("starcoder2", {"use_bias": False}), ("starcoder2", {"tie_word_embeddings": False}),
    ("stablelm", {}), ("stablelm", {"use_qkv_bias": True}), ("stablelm", {"use_parallel_residual": True}),
    ("stablelm", {"num_key_value_heads": 8, "tie_word_embeddings": True}),
    ("gpt_bigcode", {}), ("gpt_bigcode", {"multi_query": False}),
    ("gpt_bigcode", {"n_inner": 1000, "tie_word_embeddings": False}),
    ("bloom", {}), ("bloom", {"tie_word_embeddings": False}),
    ("phi", {}), ("phi", {"qk_layernorm": True}), ("phi", {"tie_word_embeddings": True}),
    ("phi", {"num_key_value_heads": 8}),
    ("gptj", {}), ("gptj", {"n_inner": 1000}), ("gptj", {"tie_word_embeddings": True}),
    ("cohere", {}), ("cohere", {"attention_bias": True}),
    ("cohere", {"num_key_value_heads": 8, "tie_word_embeddings": False}),
    ("mpt", {}), ("mpt", {"tie_word_embeddings": False}),
    ("glm", {}), ("glm", {"attention_bias": False}), ("glm", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("glm4", {}), ("glm4", {"attention_bias": False, "head_dim": 64}),
    ("seed_oss", {}), ("seed_oss", {"attention_out_bias": True, "mlp_bias": True}),
    ("seed_oss", {"attention_bias": False}),
    ("exaone4", {}), ("exaone4", {"tie_word_embeddings": True}), ("exaone4", {"num_key_value_heads": 8}),
]


def _meta_count(model_type: str, data: dict) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["gemma-2b.json", "gemma-7b.json", "starcoder2-3b.json", "bloom-176b.json"])
def test_bundled_configs_match_transformers_on_the_meta_device(name):
    data = json.loads((HF / name).read_text())
    data.pop("architectures")
    assert _meta_count(data.pop("model_type"), data) == load_model(str(HF / name)).num_params


@pytest.mark.parametrize("model_type,switches", VARIANTS)
def test_class_defaults_and_switches_match_transformers_on_the_meta_device(tmp_path, model_type, switches):
    """The configuration class's own defaults (each documents the checkpoint they resemble: google/gemma-7b,
    ibm-granite/granite-3.0-8b-base, HuggingFaceTB/SmolLM3-3B, bigcode/starcoder2-7b, stabilityai/stablelm-3b-4e1t,
    bigcode/gpt_bigcode-santacoder) with a structural switch flipped; plan3d reads the same keys, absent ones from
    its own copy of the class defaults."""
    transformers = pytest.importorskip("transformers")
    defaults = getattr(transformers, CONFIG_CLASS[model_type])().to_dict()
    data = {k: defaults[k] for k in STRUCTURAL if defaults.get(k) is not None} | switches
    expected = _meta_count(model_type, dict(data))
    assert load_model(_write(tmp_path, {"architectures": [ARCH[model_type]], **data})).num_params == expected
    # the same file without its class-default keys: plan3d's defaults are the class's
    minimal = {k: v for k, v in data.items() if k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                        "num_attention_heads", "n_embd", "n_layer", "n_head",
                                                        "d_model", "n_layers", "n_heads")}
    assert load_model(_write(tmp_path, {"architectures": [ARCH[model_type]], **minimal, **switches})).num_params \
        == expected


# --- what each reader keeps and refuses -----------------------------------------------------------------------

def test_stablelm_rotary_share_and_parallel_residual(tmp_path):
    """StableLM applies RoPE to ``partial_rotary_factor`` of each head (class default 0.25; older configs at the top
    level, transformers 5 in ``rope_parameters``) and, with ``use_parallel_residual``, runs attention and MLP on one
    shared input norm (``post_attention_layernorm`` is None in modeling_stablelm.py)."""
    core = {"architectures": ["StableLmForCausalLM"], "vocab_size": 50304, "hidden_size": 2560,
            "num_hidden_layers": 32, "num_attention_heads": 32}
    assert load_model(_write(tmp_path, core)).rotary_percent == 0.25
    assert load_model(_write(tmp_path, core | {"partial_rotary_factor": 0.5})).rotary_percent == 0.5
    assert load_model(_write(tmp_path, core | {"rope_parameters": {"partial_rotary_factor": 0.75}})).rotary_percent \
        == 0.75
    spec = load_model(_write(tmp_path, core | {"use_parallel_residual": True}))
    assert spec.parallel_attention and spec.shared_input_norm and spec.norms_per_layer == 1


def test_starcoder_15b_rounds_to_its_published_size(tmp_path):
    """StarCoder (Li et al. 2023, arXiv:2305.06161, abstract: "15.5B parameter models with 8K context length ...
    multi-query attention"; its model section: 40 layers, 48 heads, hidden 6,144, a 49,152-token vocabulary) as a
    GPTBigCode config: the published figure to its last digit."""
    data = {"architectures": ["GPTBigCodeForCausalLM"], "n_embd": 6144, "n_layer": 40, "n_head": 48,
            "n_positions": 8192, "vocab_size": 49152, "multi_query": True}
    assert abs(load_model(_write(tmp_path, data)).num_params - 15.5e9) < 0.1e9


@pytest.mark.parametrize("what,data,card,step", [
    # microsoft/phi-2 card: "Phi-2 is a Transformer with 2.7 billion parameters" (its config: 2,560 wide, 32 layers
    # of 32 heads, MLP 10,240, vocabulary 51,200, RoPE on 0.4 of each head)
    ("phi-2", {"architectures": ["PhiForCausalLM"], "hidden_size": 2560, "num_hidden_layers": 32,
               "num_attention_heads": 32, "intermediate_size": 10240, "vocab_size": 51200,
               "partial_rotary_factor": 0.4}, 2.7e9, 0.1e9),
    # mosaicml/mpt-7b card: "6.7B" parameters (d_model 4,096, 32 heads, 32 layers, vocabulary 50,432)
    ("mpt-7b", {"architectures": ["MPTForCausalLM"], "d_model": 4096, "n_heads": 32, "n_layers": 32,
                "vocab_size": 50432, "max_seq_len": 2048}, 6.7e9, 0.1e9),
    # CohereForAI/c4ai-command-r-v01 card: "a 35 billion parameter" model (CohereConfig's defaults, which it
    # documents as Command R's: 8,192 wide, 40 layers of 64 heads, MLP 22,528, vocabulary 256,000, tied)
    ("command-r", {"architectures": ["CohereForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 40,
                   "num_attention_heads": 64, "intermediate_size": 22528, "vocab_size": 256000}, 35e9, 1e9),
])
def test_published_sizes_to_their_last_digit(tmp_path, what, data, card, step):
    assert abs(load_model(_write(tmp_path, data)).num_params - card) < step, what


def test_phi_gptj_cohere_mpt_structure(tmp_path):
    """What each reader keeps of its class (modeling_phi.py, modeling_gptj.py, modeling_cohere.py, modeling_mpt.py)."""
    phi = load_model(_write(tmp_path, {"architectures": ["PhiForCausalLM"], "hidden_size": 2048, "vocab_size": 51200,
                                       "num_hidden_layers": 24, "num_attention_heads": 32}))
    assert phi.output_bias and phi.parallel_attention and phi.shared_input_norm and phi.linear_bias
    assert (phi.norm, phi.norm_bias, phi.rotary_percent, phi.activation) == ("layernorm", None, 0.5, "gelu")
    gptj = load_model(_write(tmp_path, {"architectures": ["GPTJForCausalLM"], "n_embd": 4096, "n_layer": 28,
                                        "n_head": 16, "vocab_size": 50400}))  # EleutherAI/gpt-j-6b's shapes
    assert gptj.output_bias and gptj.shared_input_norm and gptj.has_mlp_bias and not gptj.has_qkv_bias
    assert gptj.rotary_percent == 64 / 256  # rotary_dim 64 of a 256-wide head
    cohere = load_model(_write(tmp_path, {"architectures": ["CohereForCausalLM"], "hidden_size": 1024,
                                          "vocab_size": 1000, "num_hidden_layers": 2, "num_attention_heads": 8}))
    assert (cohere.norm, cohere.norm_bias, cohere.norm_params) == ("layernorm", False, 1024)
    assert cohere.tied_embeddings and cohere.shared_input_norm and cohere.activation == "swiglu"
    mpt = load_model(_write(tmp_path, {"architectures": ["MPTForCausalLM"], "d_model": 1024, "n_heads": 8,
                                       "n_layers": 2, "vocab_size": 1000, "attn_config": {"clip_qkv": 8}}))
    assert (mpt.norm_bias, mpt.position_embedding, mpt.linear_bias, mpt.ffn_size) == (False, "alibi", False, 4096)


@pytest.mark.parametrize("pattern,layer_types", [(4, None), ("LLLG", None), (3, None), (None, "explicit")])
def test_exaone4_windowed_layers_as_transformers_lays_them(tmp_path, pattern, layer_types):
    """EXAONE 4's local layers: ``sliding_window_pattern`` (a number, default 4, or a string of L and G as the 32B
    config writes it) or ``layer_types``; the count plan3d reads equals the ``"sliding_attention"`` entries of the
    ``layer_types`` transformers builds (Exaone4Config.__post_init__), where it builds them from a number."""
    transformers = pytest.importorskip("transformers")
    core = {"architectures": ["Exaone4ForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
            "num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 8}
    data = dict(core)
    if layer_types:
        data["layer_types"] = ["sliding_attention", "full_attention"] * 5
    elif pattern is not None:
        data["sliding_window_pattern"] = pattern
    spec = load_model(_write(tmp_path, data))
    if isinstance(pattern, str):
        expected = sum("LLLG"[i % 4] == "L" for i in range(10))
    else:
        types = data.get("layer_types") or transformers.Exaone4Config(
            **{k: v for k, v in data.items() if k != "architectures"}).layer_types
        expected = types.count("sliding_attention")
    assert (spec.sliding_window, spec.sliding_window_layers) == (4096, expected)
    assert load_model(_write(tmp_path, core | {"sliding_window": None})).sliding_window is None


def test_gpt_bigcode_multi_query_and_learned_positions(tmp_path):
    data = {"architectures": ["GPTBigCodeForCausalLM"], "n_embd": 2048, "n_layer": 24, "n_head": 16,
            "n_positions": 2048, "vocab_size": 49280}
    spec = load_model(_write(tmp_path, data))
    assert spec.kv_heads == 1 and spec.position_embedding == "learned" and spec.max_seq_len == 2048
    assert load_model(_write(tmp_path, data | {"multi_query": False})).kv_heads == 16


@pytest.mark.parametrize("data,line", [
    ({"architectures": ["StableLmForCausalLM"], "qk_layernorm": True},
     "qk_layernorm: StableLM's per-head LayerNorms"),
    ({"architectures": ["Starcoder2ForCausalLM"], "hidden_act": "relu"},
     "hidden_act: 'relu' is not modelled for Starcoder2ForCausalLM's MLP"),
    ({"architectures": ["GPTBigCodeForCausalLM"], "activation_function": "relu"},
     "activation_function: 'relu' is not modelled for GPTBigCodeForCausalLM's MLP"),
    ({"architectures": ["GPTBigCodeForCausalLM"], "add_cross_attention": True},
     "add_cross_attention: cross-attention layers are not modelled"),
    ({"architectures": ["GemmaForCausalLM"], "hidden_act": "relu"}, "hidden_act: 'relu' gate is not modelled"),
    ({"architectures": ["BloomForCausalLM"], "apply_residual_connection_post_layernorm": True},
     "apply_residual_connection_post_layernorm: a residual taken after the norm is not modelled"),
    ({"architectures": ["CohereForCausalLM"], "use_qk_norm": True}, "use_qk_norm: Cohere's per-head query/key"),
    ({"architectures": ["MptForCausalLM"], "no_bias": False}, "no_bias: false (biases on the linears and norms)"),
    ({"architectures": ["MptForCausalLM"], "expansion_ratio": 2}, "expansion_ratio: 2 is not modelled"),
    ({"architectures": ["MptForCausalLM"], "attn_config": {"qk_ln": True}}, "attn_config.qk_ln: MPT's query/key"),
    ({"architectures": ["MptForCausalLM"], "attn_config": {"alibi": False}}, "attn_config.alibi: false"),
    ({"architectures": ["MPTForCausalLM"], "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2}},
     "attn_config.attn_type: 'grouped_query_attention' is not what transformers' MptForCausalLM builds"),
    ({"architectures": ["MPTForCausalLM"], "ffn_config": {"ffn_type": "mptglu"}},
     "ffn_config.ffn_type: 'mptglu' is not what transformers' MptForCausalLM builds"),
    ({"architectures": ["PhiForCausalLM"], "hidden_act": "relu"},
     "hidden_act: 'relu' is not modelled for PhiForCausalLM"),
    ({"architectures": ["GPTJForCausalLM"], "activation_function": "relu"},
     "activation_function: 'relu' is not modelled for GPTJForCausalLM"),
])
def test_refusals_name_the_field(tmp_path, data, line):
    core = {"vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "n_embd": 256, "n_layer": 2, "n_head": 4, "d_model": 256, "n_layers": 2, "n_heads": 4}
    with pytest.raises(SpecError, match=line.replace("(", r"\(").replace(")", r"\)")):
        load_model(_write(tmp_path, core | data))


@pytest.mark.parametrize("model_type,arch", sorted(ARCH.items()))
def test_model_type_alone_names_the_class(tmp_path, model_type, arch):
    """A config without ``architectures`` is read by its ``model_type`` (planner.hf.MODEL_TYPES)."""
    core = {"model_type": model_type, "vocab_size": 1000, "hidden_size": 1024, "num_hidden_layers": 2,
            "num_attention_heads": 32, "n_embd": 1024, "n_layer": 2, "n_head": 32, "d_model": 1024, "n_layers": 2,
            "n_heads": 32}  # 32 heads: every class's KV default divides it
    with_arch = load_model(_write(tmp_path, core | {"architectures": [arch]})).num_params
    assert load_model(_write(tmp_path, core)).num_params == with_arch


# --- the two fields: a LayerNorm without bias, a bias on the output layer ---------------------------------------

def _biasfree(**extra):
    from planner.specs import ModelSpec

    fields = dict(name="m", num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, vocab_size=1000,
                  activation="gelu", norm="layernorm", norm_bias=False, output_bias=True, linear_bias=True)
    return ModelSpec(**(fields | extra))


def test_norm_bias_is_a_layernorm_field():
    from planner.specs import ModelSpec

    with pytest.raises(ValueError, match="norm_bias: RMSNorm has no bias"):
        ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, norm="rmsnorm",
                  norm_bias=True)
    assert _biasfree().norm_params == 128 and _biasfree(norm_bias=None).norm_params == 256


def test_output_bias_sits_on_the_loss_stage_split_with_the_vocabulary():
    """The bias is the output layer's own parameter: on the loss stage only, tied or not, its padded vocabulary split
    over TP as the layer's rows are (Megatron's ColumnParallelLinear would split a bias so; DTensor's ColwiseParallel
    in plan3d validate does)."""
    from planner.memory import stage_param_split
    from planner.specs import Plan, padded_vocab_size

    for tied in (False, True):
        with_bias, without = _biasfree(tied_embeddings=tied), _biasfree(tied_embeddings=tied, output_bias=False)
        assert with_bias.num_params - without.num_params == 1000
        plan = Plan(tp=2, pp=2, dp=1, micro_batch_size=1)
        for stage in (0, 1):
            extra = stage_param_split(with_bias, plan, stage, 2)[0] - stage_param_split(without, plan, stage, 2)[0]
            assert extra == (padded_vocab_size(1000, 2) / 2 if stage == 1 else 0)


def test_megatron_cannot_build_either():
    gaps = " | ".join(_biasfree().megatron_gaps())
    assert "norm_bias: Megatron-LM's LayerNorm has a bias" in gaps and "output_bias: Megatron-LM's output layer" in gaps
    assert not _biasfree(norm_bias=None, output_bias=False).megatron_gaps()


@pytest.mark.parametrize("tp", [1, 2])
def test_deepspeed_module_tree_holds_the_output_bias(tp):
    """Megatron-DeepSpeed's module tree plan3d replays for ZeRO-3 (frameworks.deepspeed.zero3_tree) holds the GPU's
    parameters as planner.memory counts them, bias-free norms and the output bias included."""
    from planner.frameworks.deepspeed import zero3_shape, zero3_tree
    from planner.frameworks.deepspeed_zero3 import Module
    from planner.memory import stage_params_per_rank
    from planner.specs import Plan

    def flatten(m: Module):
        yield m
        for child in m.children:
            yield from flatten(child)

    model = _biasfree()
    held = {pid: n for m in flatten(zero3_tree(zero3_shape(model, tp))) for pid, n in m.params}
    want = stage_params_per_rank(model, Plan(tp=tp, pp=1, dp=1, micro_batch_size=1), 0, model.num_layers)
    assert sum(held.values()) == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("tied", [False, True])
def test_validate_model_builds_the_counted_parameters(tied):
    """plan3d validate's torch model (planner/validate/model.py) of a model with bias-free LayerNorms and an output bias
    holds exactly ``num_params`` distinct parameters."""
    pytest.importorskip("torch")
    from planner.validate.model import build_chunks

    model = _biasfree(tied_embeddings=tied, linear_bias=False)
    chunks = build_chunks(model, [model.num_layers])
    params = {id(p): p.numel() for c in chunks for p in c.parameters()}
    assert sum(params.values()) == model.num_params
