"""Hugging Face import of mixture-of-experts, MLA and Qwen3 configs (planner/hf.py).

References, never recomputed here from the formula under test:

* ``transformers`` itself: each published ``config.json`` (tests/data/hf/, Hub repository in
  tests/data/README.md) is built with the real ``*ForCausalLM`` class on the meta device, and
  ``sum(p.numel())`` over its parameters must equal ``ModelSpec.num_params`` exactly. Skipped where
  ``transformers`` is not installed (it is not a plan3d dependency; checked with 5.24.0).
* Published totals and activated counts from the model cards and reports, to the card's last
  digit (less than one unit of its last printed digit away), as in tests/test_hf_import.py.
"""

import json
from pathlib import Path

import pytest

from planner.presets import SpecError, load_model
from planner.specs import ModelSpec

HF = Path(__file__).resolve().parent / "data" / "hf"

MOE_FIXTURES = ["mixtral-8x7b.json", "qwen1.5-moe-a2.7b.json", "qwen3-30b-a3b.json", "qwen3-235b-a22b.json",
                "qwen3-8b.json", "deepseek-v2-lite.json", "deepseek-v2.json", "deepseek-v3.json",
                "gpt-oss-20b.json", "gpt-oss-120b.json", "glm-4.5.json", "olmoe-1b-7b.json",
                "llama4-scout-17b-16e.json", "llama4-maverick-17b-128e.json"]


def _load(name: str) -> ModelSpec:
    return load_model(str(HF / name))


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def _transformers_count(data: dict) -> int:
    """Parameters of the ``transformers`` model of ``data``, built on the meta device (no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    data = dict(data)
    # Remote-code pointers and checkpoint quantization are not model structure (planner/hf.py docstring).
    for key in ("auto_map", "quantization_config"):
        data.pop(key, None)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# --- exact against transformers, full-size published configs ------------------------------------

@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_published_config_count_equals_transformers_on_meta(name):
    data = json.loads((HF / name).read_text())
    assert _load(name).num_params == _transformers_count(data)


# --- exact against transformers, scaled-down variants that exercise each reader path ------------

def _small(name: str, *dropped: str, **over) -> dict:
    """A fixture with keys replaced (``over``) and keys removed (``dropped``: absent, so the class default applies;
    transformers' Glm4MoeConfig does not take an explicit null ``head_dim``)."""
    data = json.loads((HF / name).read_text())
    return {k: v for k, v in (data | over).items() if k not in dropped}


SMALL = {
    # Class defaults: every optional key absent (MixtralConfig: 8 experts, top 2, 8 KV heads, 14336).
    "mixtral-defaults": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,
                         "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000},
    "mixtral-head-dim-tied": _small("mixtral-8x7b.json", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    head_dim=64, num_local_experts=4, tie_word_embeddings=True, vocab_size=1000),
    "qwen2-moe-defaults": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 256,
                           "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": 1000},
    "qwen2-moe-no-qkv-bias-dense-first": _small(
        "qwen1.5-moe-a2.7b.json", hidden_size=256, num_hidden_layers=4, num_experts=8, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, intermediate_size=320, qkv_bias=False, mlp_only_layers=[1, 0]),
    # experts in every other layer ((i + 1) % 2 == 0: layers 1 and 3) and around dense middle layers
    "qwen3-moe-sparse-step-2": _small("qwen3-30b-a3b.json", hidden_size=256, num_hidden_layers=4, num_experts=8,
                                      decoder_sparse_step=2, vocab_size=1000),
    "qwen2-moe-dense-middle-layers": _small("qwen1.5-moe-a2.7b.json", hidden_size=256, num_hidden_layers=5,
                                            num_experts=8, moe_intermediate_size=64, intermediate_size=320,
                                            mlp_only_layers=[3, 1], vocab_size=1000),
    "qwen2-moe-zero-experts-is-dense": _small("qwen1.5-moe-a2.7b.json", hidden_size=256, num_hidden_layers=2,
                                              num_experts=0, vocab_size=1000),
    "qwen3-moe-defaults": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
                           "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000},
    "qwen3-moe-bias-dense-first": _small("qwen3-30b-a3b.json", hidden_size=256, num_hidden_layers=3, num_experts=16,
                                         attention_bias=True, mlp_only_layers=[0], vocab_size=1000),
    "qwen3-moe-num-local-experts-key": {
        k: v for k, v in _small("qwen3-30b-a3b.json", num_hidden_layers=2, num_local_experts=16,
                                vocab_size=1000).items() if k != "num_experts"},
    "qwen3-dense-defaults-tied": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
                                  "num_hidden_layers": 2, "num_attention_heads": 32, "vocab_size": 1000,
                                  "tie_word_embeddings": True},
    "qwen3-dense-kv-heads-null": _small("qwen3-8b.json", num_hidden_layers=2, num_key_value_heads=None,
                                        vocab_size=1000),
    "qwen3-dense-attention-bias": _small("qwen3-8b.json", num_hidden_layers=2, attention_bias=True, vocab_size=1000),
    "deepseek-v3-defaults": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                             "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 1000},
    "deepseek-v3-no-q-rank-no-shared": _small("deepseek-v3.json", hidden_size=512, num_hidden_layers=3,
                                              num_attention_heads=8, n_routed_experts=16, q_lora_rank=None,
                                              n_shared_experts=0, first_k_dense_replace=1, vocab_size=1000),
    "deepseek-v2-defaults": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                             "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
                             "vocab_size": 1000, "num_experts_per_tok": 4},
    "deepseek-v2-three-shared": _small("deepseek-v2-lite.json", num_hidden_layers=3, n_routed_experts=8,
                                       n_shared_experts=3, first_k_dense_replace=2, vocab_size=1000),
    "gpt-oss-defaults": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
                         "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000},
    "gpt-oss-no-attention-bias": _small("gpt-oss-20b.json", num_hidden_layers=2, layer_types=None,
                                        attention_bias=False, num_local_experts=8, num_experts_per_tok=2,
                                        pad_token_id=None, vocab_size=1000),
    # Glm4MoeConfig defaults: 128 experts of 1408, top 8, one shared expert, one dense layer of 10944, 8 KV heads.
    "glm4-moe-defaults": {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 256,
                          "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000},
    "glm4-moe-no-bias-qk-norm-shared-tied": _small(
        "glm-4.5.json", "head_dim", hidden_size=256, num_hidden_layers=3, num_attention_heads=8, n_routed_experts=16,
        n_shared_experts=0, use_qk_norm=False, attention_bias=False, first_k_dense_replace=2, vocab_size=1000,
        tie_word_embeddings=True),
    # OlmoeConfig defaults: 64 experts of 2048, top 8, MHA
    "olmoe-defaults": {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 256,
                       "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000},
    "olmoe-gqa-bias-tied": _small("olmoe-1b-7b.json", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                                  num_key_value_heads=2, attention_bias=True, num_experts=8, tie_word_embeddings=True,
                                  vocab_size=1000),
    # Llama4TextConfig defaults: 16 experts of 8192, top 1, a shared expert, dense MLPs of 16384, head_dim 128
    "llama4-defaults": {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 256,
                        "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000},
    "llama4-interleaved-bias-tied": _small("llama4-maverick-17b-128e.json", hidden_size=256, num_hidden_layers=4,
                                           num_local_experts=8, intermediate_size=64, intermediate_size_mlp=128,
                                           head_dim=32, attention_bias=True, tie_word_embeddings=True,
                                           vocab_size=1000, pad_token_id=None),
    "llama4-explicit-moe-layers": _small("llama4-scout-17b-16e.json", hidden_size=256, num_hidden_layers=5,
                                         num_local_experts=4, intermediate_size=64, intermediate_size_mlp=96,
                                         moe_layers=[0, 3, 4], num_experts_per_tok=2, vocab_size=1000, pad_token_id=None),
    "glm4-moe-two-shared-num-local-experts-key": _small(
        "glm-4.5.json", "n_routed_experts", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_local_experts=8, n_shared_experts=2, first_k_dense_replace=0, vocab_size=1000),
}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # n_shared_experts 0: a 0-wide MLP
@pytest.mark.parametrize("case", SMALL)
def test_scaled_variant_count_equals_transformers_on_meta(tmp_path, case):
    data = SMALL[case]
    assert load_model(_write(tmp_path, data)).num_params == _transformers_count(data)


# --- structure read from the published configs ---------------------------------------------------

def test_mixtral_structure():
    spec = _load("mixtral-8x7b.json")
    assert (spec.num_experts, spec.top_k, spec.moe_ffn_size, spec.first_k_dense) == (8, 2, 14336, 0)
    assert spec.shared_expert_ffn_hidden_size is None and not spec.router_bias and not spec.has_qkv_bias


def test_qwen2_moe_shared_expert_and_gate():
    spec = _load("qwen1.5-moe-a2.7b.json")
    assert (spec.num_experts, spec.top_k, spec.moe_ffn_size) == (60, 4, 1408)
    assert spec.shared_expert_ffn_hidden_size == 5632 and spec.shared_expert_gate
    assert spec.has_qkv_bias and not spec.has_out_proj_bias and not spec.has_mlp_bias


def test_qwen3_per_head_qk_norm():
    dense, moe = _load("qwen3-8b.json"), _load("qwen3-235b-a22b.json")
    assert dense.qk_norm == moe.qk_norm == "head" and not dense.is_moe
    assert (moe.num_experts, moe.top_k, moe.moe_ffn_size, moe.kv_channels) == (128, 8, 1536, 128)


def test_deepseek_v3_mla_and_dense_first():
    spec = _load("deepseek-v3.json")
    assert spec.is_mla and (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim,
                            spec.v_head_dim) == (1536, 512, 64, 128, 128)
    assert (spec.first_k_dense, spec.num_moe_layers, spec.num_experts, spec.top_k) == (3, 58, 256, 8)
    assert spec.shared_expert_ffn_hidden_size == 1 * 2048 and spec.ffn_size == 18432


@pytest.mark.parametrize("name, groups", [
    ("deepseek-v3.json", (8, 4)),        # DeepseekV3TopkRouter: n_group 8, topk_group 4
    ("deepseek-v2.json", (8, 3)),        # topk_method group_limited_greedy
    ("deepseek-v2-lite.json", (None, None)),  # topk_method greedy: no group limit
    ("kimi-k2.json", (None, None)),      # n_group 1
    ("glm-4.5.json", (None, None)),      # n_group 1
])
def test_group_limited_routing_read_from_the_router(name, groups):
    spec = _load(name)
    assert (spec.router_num_groups, spec.router_group_topk) == groups


@pytest.mark.parametrize("over,key", [
    ({"n_group": 7}, "n_group: 7 must be a whole number of groups dividing the 256 routed experts"),
    ({"topk_group": 9}, "topk_group: 9 must be 1 to n_group (8)"),
])
def test_bad_routing_groups_refused(tmp_path, over, key):
    data = json.loads((HF / "deepseek-v3.json").read_text()) | over
    assert key in _refusal(tmp_path, data)


@pytest.mark.parametrize("name, total_b, pattern", [
    # Meta's model cards: Scout 17B active of 109B, Maverick 17B active of 400B, the vision tower included (so the
    # text model's total is compared for Maverick only, where the tower is within the card's rounding)
    ("llama4-scout-17b-16e.json", None, None),
    ("llama4-maverick-17b-128e.json", 400, (0, 1) * 24),
])
def test_llama4_experts_and_interleaving(name, total_b, pattern):
    spec = _load(name)
    assert spec.shared_expert_ffn_hidden_size == spec.moe_ffn_size == 8192 and spec.ffn_size == 16384
    assert spec.top_k == 1 and spec.moe_layer_pattern == pattern
    assert abs(spec.num_active_params / 1e9 - 17) <= 0.5 + 0.17
    if total_b is not None:
        assert abs(spec.num_params / 1e9 - total_b) <= 0.5 + 0.01 * total_b


def test_llama4_conditional_generation_names_its_text_config(tmp_path):
    data = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
            "text_config": json.loads((HF / "llama4-scout-17b-16e.json").read_text())}
    assert "save its text_config as a config.json" in _refusal(tmp_path, data)


def test_deepseek_v2_lite_full_q_projection_and_two_shared_experts():
    spec = _load("deepseek-v2-lite.json")
    assert spec.is_mla and spec.q_lora_rank is None
    assert spec.shared_expert_ffn_hidden_size == 2 * 1408 and spec.first_k_dense == 1


def test_gpt_oss_biases_sinks_and_router_bias():
    spec = _load("gpt-oss-120b.json")
    assert spec.has_qkv_bias and spec.has_out_proj_bias and spec.has_mlp_bias
    assert spec.attention_sinks and spec.router_bias and spec.activation == "swiglu"
    assert (spec.num_experts, spec.top_k, spec.moe_ffn_size, spec.kv_channels) == (128, 4, 2880, 64)


def test_glm45_grouped_query_attention_shared_expert_and_dense_first():
    """GLM-4.5 (tests/data/hf/glm-4.5.json): 96 heads of 128 over a 5120-wide model, 8 KV heads, q/k/v biases without
    an o_proj bias, per-head Q/K norms, 3 dense layers of 12288 then 89 MoE layers of 160 experts of 1536 (top 8) and
    one shared expert, one MTP layer; the same figures as the Megatron arguments of slime's
    scripts/models/glm4.5-355B-A32B.sh (--num-layers 3+89, --kv-channels 128, --num-query-groups 8, --add-qkv-bias,
    --qk-layernorm, --num-experts 160, --moe-shared-expert-intermediate-size 1536)."""
    spec = _load("glm-4.5.json")
    assert (spec.num_attention_heads, spec.kv_channels, spec.num_kv_heads) == (96, 128, 8)
    assert spec.has_qkv_bias and not spec.has_out_proj_bias and not spec.has_mlp_bias and spec.qk_norm == "head"
    assert (spec.first_k_dense, spec.num_moe_layers, spec.num_experts, spec.top_k, spec.moe_ffn_size) == (3, 89, 160, 8,
                                                                                                        1536)
    assert spec.shared_expert_ffn_hidden_size == 1536 and not spec.shared_expert_gate and not spec.router_bias
    assert spec.ffn_size == 12288 and spec.mtp_num_layers == 1 and not spec.megatron_gaps()
    assert spec.rotary_percent == 0.5  # partial_rotary_factor; Megatron --rotary-percent 0.5 in slime's script


def test_olmoe_full_width_qk_norm_and_mixtral_style_experts():
    """OLMoE-1B-7B: 64 experts as wide as intermediate_size (1024), top 8, no shared expert; Q/K norms over the whole
    projection (OLMoE section 2, as OLMo 2), which Megatron-LM's per-head --qk-layernorm cannot build."""
    spec = _load("olmoe-1b-7b.json")
    assert (spec.num_experts, spec.top_k, spec.moe_ffn_size, spec.kv_heads) == (64, 8, 1024, 16)
    assert spec.qk_norm == "full" and spec.shared_expert_ffn_hidden_size is None and spec.first_k_dense == 0
    assert any(gap.startswith("qk_norm:") for gap in spec.megatron_gaps())


def test_gpt_oss_keeps_its_yarn_rope_scaling(tmp_path):
    """config.json: rope_scaling.rope_type "yarn" (factor 32 over 4096 positions); the preset says the same."""
    assert _load("gpt-oss-120b.json").rope_scaling == "yarn" == load_model("gpt-oss-120b").rope_scaling
    assert _load("gpt-oss-20b.json").rope_scaling == "yarn" == load_model("gpt-oss-20b").rope_scaling
    # another scaling, or none, is not YaRN
    assert _load("qwen3-30b-a3b.json").rope_scaling is None
    data = json.loads((HF / "gpt-oss-20b.json").read_text())
    data["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert load_model(_write(tmp_path, data)).rope_scaling is None


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b",
                                  "llama4-scout-17b-16e", "llama4-maverick-17b-128e"])
def test_hf_import_agrees_with_the_preset(name):
    """The hand-written presets (model_specs/) and the import of the published config are one model."""
    hf, preset = _load(f"{name}.json"), load_model(name)
    assert (hf.num_params, hf.num_active_params) == (preset.num_params, preset.num_active_params)
    assert hf.model_dump(exclude={"name", "qkv_bias", "out_proj_bias", "mlp_bias"}) == \
        preset.model_dump(exclude={"name", "qkv_bias", "out_proj_bias", "mlp_bias"})
    assert (hf.has_qkv_bias, hf.has_out_proj_bias, hf.has_mlp_bias) == \
        (preset.has_qkv_bias, preset.has_out_proj_bias, preset.has_mlp_bias)


# --- published totals and activated counts -------------------------------------------------------

# file, total, activated (None: not published), the figures' rounding step, source
CARDS = [
    ("mixtral-8x7b.json", 46.7e9, 12.9e9, 0.1e9),  # Mistral AI, "Mixtral of experts" (2023-12-11): 46.7B / 12.9B
    ("qwen1.5-moe-a2.7b.json", 14.3e9, 2.7e9, 0.1e9),  # Qwen blog "Qwen1.5-MoE" (2024-03-28): 14.3B / 2.7B
    ("qwen3-30b-a3b.json", 30.5e9, 3.3e9, 0.1e9),  # Qwen3 report (arXiv:2505.09388) Table 2; Hub card 30.5B / 3.3B
    ("qwen3-235b-a22b.json", 235e9, 22e9, 1e9),  # Qwen3 report Table 2; Hub card 235B / 22B
    ("qwen3-8b.json", 8.2e9, None, 0.1e9),  # Qwen/Qwen3-8B card: 8.2B
    ("deepseek-v2-lite.json", 15.7e9, None, 0.1e9),  # deepseek-ai/DeepSeek-V2-Lite card: 15.7B total
    ("deepseek-v2.json", 236e9, 21e9, 1e9),  # DeepSeek-V2 (arXiv:2405.04434) abstract: 236B / 21B
    ("deepseek-v3.json", 671e9, 37e9, 1e9),  # DeepSeek-V3 (arXiv:2412.19437) abstract: 671B / 37B
    ("olmoe-1b-7b.json", 6.9e9, 1.3e9, 0.1e9),  # OLMoE (arXiv:2409.02060) Table 1: 6.9B total / 1.3B active
]


@pytest.mark.parametrize("name,total,active,step", CARDS)
def test_counts_round_to_the_published_figures(name, total, active, step):
    spec = _load(name)
    assert abs(spec.num_params - total) < step
    if active is not None:
        assert abs(spec.num_active_params - active) < step


def test_qwen3_8b_non_embedding_count_from_the_card():
    # Qwen/Qwen3-8B card: "Number of Paramaters (Non-Embedding): 6.95B"; untied 151936 x 4096 in and out.
    spec = _load("qwen3-8b.json")
    assert abs(spec.num_params - 2 * 151936 * 4096 - 6.95e9) < 0.01e9


# gpt-oss model card (OpenAI 2025, arXiv:2508.10925) Table 1: total 116.83B / 20.91B and active
# 5.13B / 3.61B per token (text: "116.8B total parameters (5.1B active)", "20.9B (3.6B active)").
# The card's active count is the routed top-4 experts, attention, router and norms of every layer
# plus the unembedding; the input embedding (a table lookup, 201088 x 2880) is not counted: Table 1
# lists "Embed + Unembed" 1.16B = 2 x 0.58B, and 5.13B = total - 124 of 128 experts - one 0.58B matrix.
# Tolerance: the table's last digit (0.01B).
@pytest.mark.parametrize("name,total,active", [("gpt-oss-120b.json", 116.83e9, 5.13e9),
                                               ("gpt-oss-20b.json", 20.91e9, 3.61e9)])
def test_gpt_oss_total_and_active_from_the_model_card(name, total, active):
    spec = _load(name)
    embedding = 201088 * 2880
    assert abs(spec.num_params - total) < 0.01e9
    assert abs(spec.num_active_params - embedding - active) < 0.01e9


# --- the configs the scorer runs load ------------------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek-v3.json", "qwen3-30b-a3b.json", "qwen3-235b-a22b.json",
                                  "gpt-oss-120b.json"])
def test_scored_configs_load_as_moe(tmp_path, name):
    # The scorer passes .../<repo>/config.json: the directory names the model.
    path = tmp_path / name.removesuffix(".json") / "config.json"
    path.parent.mkdir()
    path.write_text((HF / name).read_text())
    spec = load_model(str(path))
    assert spec.is_moe and spec.name == name.removesuffix(".json")


# --- refusals: one line naming the key -----------------------------------------------------------

def _refusal(tmp_path, data) -> str:
    with pytest.raises(SpecError) as exc:
        load_model(_write(tmp_path, data))
    assert len(exc.value.lines) == 1
    return exc.value.lines[0]


@pytest.mark.parametrize("over,key", [
    ({"mlp_only_layers": list(range(48))}, "every layer is dense"),
    ({"decoder_sparse_step": 49}, "every layer is dense"),
    ({"mlp_only_layers": [1, "2"]}, "mlp_only_layers: expected a list of layer indices"),
])
def test_qwen_moe_layer_patterns_without_experts_refused(tmp_path, over, key):
    data = json.loads((HF / "qwen3-30b-a3b.json").read_text()) | over
    assert key in _refusal(tmp_path, data)


@pytest.mark.parametrize("over,first_k_dense,pattern", [
    ({"mlp_only_layers": [1, 0]}, 2, None),  # a leading run stays first_k_dense
    ({"decoder_sparse_step": 2}, 0, (0, 1) * 24),  # (i + 1) % 2 == 0: the odd layers
    ({"mlp_only_layers": [3, 5]}, 0, tuple(int(i not in (3, 5)) for i in range(48))),
    ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, 0, tuple(int(i != 2 and (i + 1) % 3 == 0) for i in range(48))),
])
def test_qwen_moe_layer_patterns_read_exactly(tmp_path, over, first_k_dense, pattern):
    """Qwen{2,3}MoeDecoderLayer's rule (``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``), refused
    before 2026-12-07 unless it was a leading run of dense layers."""
    data = json.loads((HF / "qwen3-30b-a3b.json").read_text()) | over
    spec = load_model(_write(tmp_path, data))
    assert (spec.first_k_dense, spec.moe_layer_pattern) == (first_k_dense, pattern)
    assert spec.num_moe_layers == (48 - first_k_dense if pattern is None else sum(pattern))


@pytest.mark.parametrize("over,key", [
    ({"attention_bias": True}, "attention_bias: biases on MLA"),
    ({"moe_layer_freq": 2}, "moe_layer_freq: 2 is not modelled"),
])
def test_deepseek_structures_not_modelled_refused(tmp_path, over, key):
    data = json.loads((HF / "deepseek-v3.json").read_text()) | over
    assert key in _refusal(tmp_path, data)


def test_deepseek_v2_mlp_bias_refused(tmp_path):
    data = json.loads((HF / "deepseek-v2-lite.json").read_text()) | {"mlp_bias": True}
    assert "mlp_bias: biases on the dense and shared MLPs" in _refusal(tmp_path, data)


def test_deepseek_v2_without_top_k_names_the_key(tmp_path):
    data = json.loads((HF / "deepseek-v2-lite.json").read_text())
    del data["num_experts_per_tok"]  # DeepseekV2Config's default is None: no model
    assert "num_experts_per_tok: missing in the Hugging Face config" in _refusal(tmp_path, data)


@pytest.mark.parametrize("arch,key", [
    ("DbrxForCausalLM", "architectures"), ("ArcticForCausalLM", "architectures"), ("GrokForCausalLM", "architectures"),
    ("DeepseekV32ForCausalLM", "architectures"),
])
def test_unmodelled_moe_architectures_refused_by_name(tmp_path, arch, key):
    data = {"architectures": [arch], "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
            "vocab_size": 1000}
    line = _refusal(tmp_path, data)
    assert line.endswith(f"{key}: {arch}: this mixture-of-experts architecture is not modelled; plan3d reads the "
                         "MoE classes of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GPT-OSS, GLM-4.5, OLMoE and Llama 4")


def test_expert_keys_of_an_unknown_moe_class_refused(tmp_path):
    # Qwen3-Next (Qwen/Qwen3-Next-80B-A3B config.json): 512 experts in hybrid linear-attention layers.
    data = {"architectures": ["Qwen3NextForCausalLM"], "num_experts": 512, "hidden_size": 2048,
            "num_hidden_layers": 48, "num_attention_heads": 16, "vocab_size": 151936}
    assert "num_experts: 512 experts in Qwen3NextForCausalLM: this mixture-of-experts architecture is not " \
           "modelled" in _refusal(tmp_path, data)


def test_single_routed_expert_refused(tmp_path):
    data = json.loads((HF / "mixtral-8x7b.json").read_text()) | {"num_local_experts": 1}
    assert "num_local_experts: a single routed expert is not modelled" in _refusal(tmp_path, data)


def test_mixtral_without_experts_refused(tmp_path):
    # MixtralSparseMoeBlock with 0 experts has no MLP at all (unlike Qwen-MoE's 0 = dense MLP).
    data = json.loads((HF / "mixtral-8x7b.json").read_text()) | {"num_local_experts": 0}
    assert "num_local_experts: 0 experts leaves MixtralSparseMoeBlock without an MLP" in _refusal(tmp_path, data)


def test_cli_reads_a_moe_config_and_refuses_an_unknown_one(runner, tmp_path):
    from planner.cli import app

    res = runner.invoke(app, ["show", str(HF / "gpt-oss-120b.json")])
    assert res.exit_code == 0 and "num_experts" in res.output, res.output
    bad = _write(tmp_path, {"architectures": ["DbrxForCausalLM"], "hidden_size": 6144})
    res = runner.invoke(app, ["show", bad])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "mixture-of-experts architecture is not modelled" in lines[0]


def test_kimi_k2_preset_is_its_config():
    """The kimi-k2 preset (model_specs/kimi-k2.yaml) is what the Kimi K2 config.json imports to (the DeepSeek-V3
    architecture with 64 heads, 384 experts and one dense layer), field by field and in its counts; about 1T in
    total and 32B activated, as the report (arXiv:2507.20534) rounds them."""
    spec, preset = _load("kimi-k2.json"), load_model("kimi-k2")
    assert (spec.num_experts, spec.top_k, spec.first_k_dense, spec.num_attention_heads) == (384, 8, 1, 64)
    assert (spec.num_params, spec.num_active_params) == (preset.num_params, preset.num_active_params)
    assert spec.model_dump(exclude={"name", "max_seq_len"}) == preset.model_dump(exclude={"name", "max_seq_len"})
    assert 0.95e12 <= spec.num_params <= 1.05e12 and 31.5e9 <= spec.num_active_params <= 33.5e9
