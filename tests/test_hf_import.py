"""Hugging Face config.json import: golden parameter counts from the published checkpoints, the
structure each architecture implies (and its effect on memory), and refusals of what is not modelled.

Expected counts are the published totals, never recomputed here from the formula under test:

* ``safetensors total``: the element count the Hugging Face Hub reports for the checkpoint (model
  API field ``safetensors.total``, or ``model.safetensors.index.json`` ``metadata.total_size``
  divided by the bytes of the stored dtype). A tied output layer is stored once in safetensors.
* ``card``: the model card or paper figure, rounded as published.

Each source is listed, with the Hub path of every config file, in tests/data/README.md.
Tolerance: exact where a checkpoint total exists. Against a card figure the count must agree to the
card's last digit (less than one unit of it away: Qwen truncates 7.6156B to 7.61B, OLMo rounds
7.2986B to 7.3B); Falcon-40B, which has no exact published total, also within 0.5 %.
"""

import json
from pathlib import Path

import pytest

from planner.flops import gemm_flops_per_token_per_layer
from planner.memory import layer_activation_terms, output_bytes, stage_params_per_rank
from planner.presets import SpecError, load_model
from planner.specs import ModelSpec, Plan, TrainingSpec

HF = Path(__file__).resolve().parent / "data" / "hf"

# file, exact parameter count, how it was published
EXACT = [
    # Qwen/Qwen2.5-0.5B-Instruct model.safetensors: 988,065,536 B in bf16 (tied embedding stored once).
    ("qwen2.5-0.5b.json", 988_065_536 // 2),
    # Qwen/Qwen2.5-7B-Instruct model.safetensors.index.json total_size 15,231,233,024 B, bf16.
    ("qwen2.5-7b.json", 15_231_233_024 // 2),
    # Qwen/Qwen2.5-72B-Instruct model.safetensors.index.json total_size 145,412,407,296 B, bf16.
    ("qwen2.5-72b.json", 145_412_407_296 // 2),
    # google/gemma-2-9b model.safetensors.index.json total_size 18,483,411,968 B, bf16, 464 tensors.
    ("gemma-2-9b.json", 18_483_411_968 // 2),
    # microsoft/Phi-3-mini-4k-instruct model.safetensors.index.json total_size 7,642,159,104 B, bf16.
    ("phi-3-mini-4k-instruct.json", 7_642_159_104 // 2),
    # allenai/OLMo-2-1124-7B: Hub model API safetensors.total (F32), revision 7df9a825.
    ("olmo-2-1124-7b.json", 7_298_617_344),
    # allenai/OLMo-2-1124-13B model.safetensors.index.json total_size 54,864,793,600 B, float32.
    ("olmo-2-1124-13b.json", 54_864_793_600 // 4),
    # meta-llama/Llama-3.1-405B: Hub model API safetensors.total, revision b906e4dc.
    ("llama-3.1-405b.json", 405_853_388_800),
    # mistralai/Mistral-7B-Instruct-v0.2 model.safetensors.index.json total_size 14,483,464,192 B, bf16;
    # the same shapes as v0.1 (the configs differ in rope_theta and sliding_window only).
    ("mistral-7b.json", 14_483_464_192 // 2),
    # openai-community/gpt2 safetensors total 137,022,720 F32 elements, of which 12 x 1024 x 1024
    # are the causal masks h.N.attn.bias (buffers, not parameters).
    ("gpt2.json", 137_022_720 - 12 * 1024 * 1024),
]

# file, card figure in parameters, the card's rounding step
CARDS = [
    ("qwen2.5-0.5b.json", 0.49e9, 0.01e9),  # Qwen2.5-0.5B card: "Number of Parameters: 0.49B"
    ("qwen2.5-7b.json", 7.61e9, 0.01e9),  # Qwen2.5-7B card: 7.61B
    ("qwen2.5-72b.json", 72.7e9, 0.1e9),  # Qwen2.5-72B card: 72.7B
    ("gemma-2-9b.json", 9.24e9, 0.01e9),  # Hub page google/gemma-2-9b: 9.24B params
    ("phi-3-mini-4k-instruct.json", 3.8e9, 0.1e9),  # Phi-3 report (arXiv:2404.14219): 3.8B
    ("olmo-2-1124-7b.json", 7.3e9, 0.1e9),  # HF model page: 7.3B params
    ("llama-3.1-405b.json", 405e9, 1e9),  # Llama 3 paper (arXiv:2407.21783) Table 3: 405B
    ("gpt2.json", 124e6, 1e6),  # openai-community/gpt2 card: 124M parameters
    ("falcon-40b.json", 41.3e9, 0.1e9),  # issue 13's reference figure for Falcon-40B (tied)
]


def _load(name: str) -> ModelSpec:
    return load_model(str(HF / name))


@pytest.mark.parametrize("name,expected", EXACT)
def test_golden_exact_counts_from_published_checkpoints(name, expected):
    assert _load(name).num_params == expected


@pytest.mark.parametrize("name,card,step", CARDS)
def test_golden_counts_round_to_the_card_figure(name, card, step):
    n = _load(name).num_params
    assert abs(n - card) < step  # agrees with the card to its last digit (cards round or truncate)
    if name == "falcon-40b.json":  # no exact published total: also within 0.5 %
        assert abs(n / card - 1) <= 0.005


def test_falcon_40b_matches_its_checkpoint_with_the_tied_head_written_twice():
    # tiiuae/falcon-40b pytorch_model.bin.index.json total_size 83,671,941,120 B in bf16 lists
    # lm_head.weight in shard 9 and word_embeddings in shard 1: torch.save writes the tied matrix
    # once per shard, so the files hold the parameters plus one more V x h copy.
    spec = _load("falcon-40b.json")
    assert spec.tied_embeddings and spec.kv_heads == 8 and spec.parallel_attention
    assert spec.num_params + 65024 * 8192 == 83_671_941_120 // 2


def test_gemma2_9b_non_embedding_count_from_the_report():
    # Gemma 2 report (arXiv:2408.00118) Table 2: 8,324,201,984 non-embedding parameters for 9B (its
    # embedding count uses the 256,128-entry vocabulary; the Hub config has 256,000 rows).
    spec = _load("gemma-2-9b.json")
    assert spec.num_params - 256000 * 3584 == 8_324_201_984


def test_pythia_160m_non_embedding_count_from_the_paper():
    # Biderman et al. 2023 (Pythia, arXiv:2304.01373) Table 1: 85,056,000 non-embedding parameters;
    # embed_in and embed_out are untied 50304 x 768 matrices (EleutherAI/pythia-160m config.json).
    spec = _load("pythia-160m.json")
    assert spec.num_params - 2 * 50304 * 768 == 85_056_000


def test_rotated_share_of_a_head_is_read_where_the_config_states_it(tmp_path):
    """RoPE over part of each head: Pythia's ``rotary_pct`` 0.25 (EleutherAI/pythia-160m config.json; Biderman et al.
    2023 section 2: "rotary embeddings ... applied to the first 25% of embedding vector dimensions"), a Llama-family
    ``partial_rotary_factor`` (transformers' _compute_default_rope_parameters reads it for every RoPE model), and
    none (1) where the config says nothing. A learned position embedding takes no rotary share."""
    assert _load("pythia-160m.json").rotary_percent == 0.25
    assert _load("phi-3-mini-4k-instruct.json").rotary_percent == 1.0
    data = json.loads((HF / "phi-3-mini-4k-instruct.json").read_text()) | {"partial_rotary_factor": 0.75}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert load_model(str(path)).rotary_percent == 0.75
    with pytest.raises(ValueError, match="rotary_percent: 0.5 applies to rope position embeddings"):
        ModelSpec(**(load_model("gpt3-175b").model_dump() | {"rotary_percent": 0.5}))


def test_gemma2_structure():
    spec = _load("gemma-2-9b.json")
    assert spec.kv_channels == 256 and spec.q_size == 4096 != spec.hidden_size
    assert spec.tied_embeddings and spec.norm_placement == "sandwich" and spec.norms_per_layer == 4
    assert spec.activation == "geglu" and spec.gated_mlp
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (50.0, 30.0)
    # Gemma 2 report (arXiv:2408.00118) 2.2: local sliding-window (4096) and global attention in every other
    # layer; 42 layers: 21 local
    assert (spec.sliding_window, spec.sliding_window_layers) == (4096, 21)


def test_qwen2_biases_on_qkv_only():
    spec = _load("qwen2.5-7b.json")
    assert spec.has_qkv_bias and not spec.has_out_proj_bias and not spec.has_mlp_bias


def test_olmo2_structure():
    spec = _load("olmo-2-1124-13b.json")
    assert spec.norm_placement == "post" and spec.qk_norm == "full" and not spec.tied_embeddings


# --- structure flows into memory and FLOPs --------------------------------------------------------

def _training(**kw):
    return TrainingSpec(**({"num_gpus": 8, "global_batch_size": 8, "seq_len": 4096} | kw))


def test_head_dim_sets_projection_sizes_in_flops():
    # Gemma-2-9B: q = 16 x 256 = 4096 and K, V = 8 x 256 each, not derived from h = 3584.
    spec = _load("gemma-2-9b.json")
    h, f = 3584, 14336
    assert gemm_flops_per_token_per_layer(spec) == 2 * (h * (4096 + 2 * 2048) + 4096 * h + 3 * h * f)


def test_tied_embedding_duplicated_on_the_last_stage_only_with_pp():
    # Megatron keeps a copy of a tied embedding on the last stage when pp > 1 (formulas.md A2).
    spec = _load("qwen2.5-0.5b.json")  # tied; 151936 is already a multiple of 128
    v_h, norm = 151936 * 896, 896
    one = Plan(tp=1, pp=1, dp=8, micro_batch_size=1)
    two = Plan(tp=1, pp=2, dp=4, micro_batch_size=1)
    per_layer = spec.layer_params()
    assert stage_params_per_rank(spec, one, 0, 24) - 24 * per_layer == v_h + norm  # one copy
    assert stage_params_per_rank(spec, two, 0, 12) - 12 * per_layer == v_h
    assert stage_params_per_rank(spec, two, 1, 12) - 12 * per_layer == v_h + norm  # the duplicate


def test_sandwich_norms_add_two_saved_outputs_per_layer():
    gemma = _load("gemma-2-9b.json")
    plain = gemma.model_copy(update={"norm_placement": "pre"})
    plan, training = Plan(tp=1, pp=1, dp=8, micro_batch_size=1), _training()
    extra = sum(t.bytes for t in layer_activation_terms(gemma, training, plan)) - \
        sum(t.bytes for t in layer_activation_terms(plain, training, plan))
    sb, h = 4096, 3584
    assert extra == 2 * (sb * h * 2 + sb * 4)  # two bf16 norm inputs + their fp32 rstd


def test_final_logit_softcap_stores_the_tanh_output():
    gemma = _load("gemma-2-9b.json")
    plan, training = Plan(tp=1, pp=1, dp=8, micro_batch_size=1), _training()
    uncapped = gemma.model_copy(update={"final_logit_softcap": None})
    assert output_bytes(gemma, training, plan) - output_bytes(uncapped, training, plan) == 2 * 4096 * 256000


def test_parallel_attention_saves_the_layer_input_once():
    neox = _load("pythia-160m.json")
    sequential = neox.model_copy(update={"parallel_attention": False})
    plan, training = Plan(tp=1, pp=1, dp=8, micro_batch_size=1), _training(seq_len=2048)
    names = {t.name for t in layer_activation_terms(neox, training, plan)}
    assert "norm2 input" not in names and "norm2 statistics" in names
    assert "norm2 input" in {t.name for t in layer_activation_terms(sequential, training, plan)}


def test_qk_norm_params_split_with_the_heads_under_tp():
    olmo = _load("olmo-2-1124-7b.json")
    base = olmo.model_copy(update={"qk_norm": "none"})
    from planner.memory import layer_params_per_rank
    assert layer_params_per_rank(olmo, 4) - layer_params_per_rank(base, 4) == (4096 + 4096) / 4


# --- refusals: one line naming the field ---------------------------------------------------------

def _refusal(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError) as exc:
        load_model(str(path))
    assert len(exc.value.lines) == 1
    return exc.value.lines[0]


# Mixture-of-experts configs of the supported classes are read (tests/test_hf_moe.py); other MoE
# classes and expert keys on a class without experts are refused.
@pytest.mark.parametrize("arch", ["DbrxForCausalLM", "ArcticForCausalLM", "GraniteMoeForCausalLM"])
def test_unmodelled_moe_architectures_refused_by_name(tmp_path, arch):
    data = json.loads((HF / "qwen2.5-7b.json").read_text()) | {"architectures": [arch]}
    line = _refusal(tmp_path, data)
    assert "architectures: " in line and "mixture-of-experts architecture is not modelled" in line


def test_expert_count_refused_on_a_dense_architecture(tmp_path):
    data = json.loads((HF / "llama-3.1-405b.json").read_text()) | {"num_experts": 16}
    assert "num_experts: 16 experts in LlamaForCausalLM: this mixture-of-experts architecture is not modelled" \
        in _refusal(tmp_path, data)


def test_single_expert_is_dense(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads((HF / "qwen2.5-7b.json").read_text()) | {"num_experts": 1}))
    assert load_model(str(path)).num_params == 15_231_233_024 // 2


@pytest.mark.parametrize("data,field", [
    ({"architectures": ["MambaForCausalLM"], "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280},
     "architectures"),
    ({"architectures": ["JambaForCausalLM"], "num_experts": 1, "hidden_size": 4096}, "architectures"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M*-", "hidden_size": 4096}, "model_type"),
])
def test_state_space_and_hybrid_refused(tmp_path, data, field):
    line = _refusal(tmp_path, data)
    assert "state-space (Mamba) and hybrid" in line


def test_unknown_architecture_refused_with_the_supported_list(tmp_path):
    line = _refusal(tmp_path, {"architectures": ["OPTForCausalLM"], "hidden_size": 64})
    assert "architectures: OPTForCausalLM is not modelled; plan3d reads LlamaForCausalLM" in line


def test_falcon_remote_code_config_refused(tmp_path):
    # tiiuae/falcon-40b config.json before the transformers port (model_type RefinedWeb, n_head_kv).
    data = {"architectures": ["RWForCausalLM"], "model_type": "RefinedWeb", "n_head": 128, "n_head_kv": 8,
            "n_layer": 60, "hidden_size": 8192, "vocab_size": 65024, "parallel_attn": True}
    assert "architectures: RWForCausalLM is Falcon's remote-code class" in _refusal(tmp_path, data)


def test_missing_core_size_names_the_field(tmp_path):
    data = json.loads((HF / "phi-3-mini-4k-instruct.json").read_text())
    del data["hidden_size"]
    assert "hidden_size: missing in the Hugging Face config" in _refusal(tmp_path, data)


def test_unmodelled_gate_refused(tmp_path):
    data = json.loads((HF / "mistral-7b.json").read_text()) | {"hidden_act": "relu"}
    assert "hidden_act: 'relu' gate is not modelled" in _refusal(tmp_path, data)


# --- defaults of the transformers configuration classes ------------------------------------------

def test_class_defaults_fill_absent_keys(tmp_path):
    path = tmp_path / "config.json"
    gemma = json.loads((HF / "gemma-2-9b.json").read_text())
    for key in ("head_dim", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation", "hidden_act"):
        del gemma[key]
    path.write_text(json.dumps(gemma))
    spec = load_model(str(path))  # Gemma2Config: head_dim 256, caps 50 and 30, gelu_pytorch_tanh, tied
    assert (spec.kv_channels, spec.attn_logit_softcap, spec.final_logit_softcap) == (256, 50.0, 30.0)
    assert spec.activation == "geglu" and spec.tied_embeddings
    falcon = json.loads((HF / "falcon-40b.json").read_text())
    path.write_text(json.dumps(falcon | {"ffn_hidden_size": None}))
    assert load_model(str(path)).ffn_size == 4 * 8192  # FalconConfig: ffn_hidden_size None = 4h


def test_falcon_7b_style_multi_query_with_one_shared_norm(tmp_path):
    # tiiuae/falcon-7b config.json (FalconForCausalLM): multi_query, parallel_attn, one input norm.
    data = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544,
            "num_attention_heads": 71, "num_hidden_layers": 32, "vocab_size": 65024, "multi_query": True,
            "parallel_attn": True, "new_decoder_architecture": False, "bias": False, "alibi": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    spec = load_model(str(path))
    assert spec.kv_heads == 1 and spec.shared_input_norm and spec.norms_per_layer == 1
    # The published module printout: query_key_value 4544 -> 4672 = 4544 + 2 x 64, no bias.
    assert spec.q_size + 2 * spec.kv_heads * spec.kv_channels == 4672
    # transformers 5.17.0 FalconForCausalLM of this config on the meta device (H200 session,
    # 2026-11-30; tests/data/README.md): 6,921,720,704 distinct parameters, tied head counted once.
    assert spec.num_params == 6_921_720_704


def test_cli_refusal_is_one_line_and_exit_2(runner, tmp_path):
    from planner.cli import app

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 6144}))
    res = runner.invoke(app, ["estimate", "--model", str(path), "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "4096", "--tp", "8", "--pp", "1"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "mixture-of-experts architecture is not modelled" in lines[0]


# --- the new structures measured in torch (tests/torch_ref.py: saved tensors, parameter counts) ---
# Miniatures with the structure each reader produces, small enough for the CPU. Gemma's is MHA: with
# materialised GQA attention the estimator also counts the un-expanded K and V, which torch's
# repeat_interleave path does not keep (a pre-existing, conservative term, 3-6 % of a layer here).
# OLMo-2 with materialised attention measures 5 % above the estimate: the reference layer's fused
# QKV output stays alive through the Q/K-norm input views and the bmm copies V again; OLMo-2's
# separate q/k/v projections (and flash attention, exact here) keep no such second copy.
_MINI = dict(name="mini", num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=512, ffn_hidden_size=512)
STRUCTURES = {
    "gemma2-sandwich-geglu-headdim-softcap": dict(
        head_dim=64, activation="geglu", norm="rmsnorm", norm_placement="sandwich",
        attn_logit_softcap=50.0, final_logit_softcap=30.0, tied_embeddings=True),
    "olmo2-post-qknorm-full": dict(activation="swiglu", norm="rmsnorm", norm_placement="post", qk_norm="full"),
    "qknorm-per-head-gqa": dict(num_kv_heads=2, activation="swiglu", norm="rmsnorm", qk_norm="head"),
    "neox-parallel-two-norms": dict(activation="gelu", norm="layernorm", parallel_attention=True,
                                    qkv_bias=True, out_proj_bias=True, mlp_bias=True),
    "falcon7b-parallel-shared-norm-mqa": dict(num_kv_heads=1, activation="gelu", norm="layernorm",
                                              parallel_attention=True, shared_input_norm=True),
    "llama-attention-bias": dict(num_kv_heads=2, activation="swiglu", norm="rmsnorm", qkv_bias=True,
                                 out_proj_bias=True, mlp_bias=False),
    # Nemotron-4: squared ReLU (relu then pow saves the ReLU output once, as GeLU saves its input), LayerNorm, GQA
    "nemotron-squared-relu-layernorm-gqa": dict(num_kv_heads=2, activation="squared_relu", norm="layernorm",
                                                linear_bias=False),
    # Cohere: one bias-free LayerNorm (norm_bias False) feeding attention and a SwiGLU MLP in parallel; MPT: bias-free
    # LayerNorms and linears, ALiBi
    "cohere-parallel-biasfree-layernorm": dict(activation="swiglu", norm="layernorm", norm_bias=False,
                                               parallel_attention=True, shared_input_norm=True, tied_embeddings=True),
    "mpt-biasfree-layernorm-alibi": dict(activation="gelu", norm="layernorm", norm_bias=False, linear_bias=False,
                                         position_embedding="alibi", tied_embeddings=True),
}
TORCH_CASES = [(n, tp, sp, attn) for n in STRUCTURES for tp, sp in ((1, False), (2, False), (2, True))
               for attn in ("flash", "materialized")]


@pytest.mark.parametrize("name", STRUCTURES)
@pytest.mark.parametrize("tp", [1, 2])
def test_structure_parameter_counts_match_torch_modules(name, tp):
    torch = pytest.importorskip("torch")
    from planner.memory import layer_params_per_rank
    from tests.torch_ref import RefLayer

    model = ModelSpec(**(_MINI | STRUCTURES[name]))
    layer = RefLayer(model, tp=tp, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in layer.parameters()) == layer_params_per_rank(model, tp)


@pytest.mark.parametrize("name,tp,sp,attention", TORCH_CASES)
def test_structure_saved_activations_match_torch_within_5_percent(name, tp, sp, attention):
    torch = pytest.importorskip("torch")
    from planner.memory import saved_bytes_per_layer
    from tests.torch_ref import RefLayer, layer_input, saved_activation_bytes

    torch.manual_seed(0)
    model, seq, batch = ModelSpec(**(_MINI | STRUCTURES[name])), 128, 2
    layer = RefLayer(model, tp=tp, sequence_parallel=sp, attention=attention)
    measured = saved_activation_bytes(layer, layer_input(model, seq, batch, tp, sp))
    training = TrainingSpec(num_gpus=tp, global_batch_size=batch, seq_len=seq, attention=attention)
    plan = Plan(tp=tp, pp=1, dp=1, micro_batch_size=batch, sequence_parallel=sp)
    predicted = saved_bytes_per_layer(layer_activation_terms(model, training, plan), "none")
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)


# --- cross-check with transformers itself, where it is installed ----------------------------------

@pytest.mark.parametrize("name", [name for name, _ in EXACT] + ["falcon-40b.json", "pythia-160m.json",
                                                                 "nemotron-4-4b.json", "olmo-3-7b.json"])
def test_transformers_builds_the_same_count_on_the_meta_device(name):
    """The real ``transformers`` modules of each config, built on the meta device (no memory):
    ``sum(p.numel())`` over distinct parameters (a tied head counted once) equals ``num_params``.
    Skipped where ``transformers`` is not installed (it is not a plan3d dependency)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    data = json.loads((HF / name).read_text())
    data.pop("auto_map", None)  # Phi-3's remote-code pointers; the transformers class is built in
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == _load(name).num_params


# --- the per-rank count and the total agree for every structure --------------------------------

def _structures():
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        a = draw(st.sampled_from([4, 8, 16]))
        parallel = draw(st.booleans())
        return ModelSpec(
            name="m", num_layers=draw(st.integers(2, 8)), hidden_size=64 * draw(st.integers(1, 4)),
            num_attention_heads=a, num_kv_heads=draw(st.sampled_from([x for x in (1, 2, 4, a) if a % x == 0])),
            head_dim=draw(st.sampled_from([None, 16, 32])), ffn_hidden_size=128 * draw(st.integers(1, 4)),
            vocab_size=draw(st.integers(100, 2000)), activation=draw(st.sampled_from(["gelu", "swiglu", "geglu", "squared_relu"])),
            norm=draw(st.sampled_from(["layernorm", "rmsnorm"])), parallel_attention=parallel,
            shared_input_norm=parallel and draw(st.booleans()),
            norm_placement="pre" if parallel else draw(st.sampled_from(["pre", "post", "sandwich"])),
            qk_norm=draw(st.sampled_from(["none", "head", "full"])), tied_embeddings=draw(st.booleans()),
            linear_bias=draw(st.booleans()), qkv_bias=draw(st.sampled_from([None, True, False])),
            out_proj_bias=draw(st.sampled_from([None, True, False])),
            mlp_bias=draw(st.sampled_from([None, True, False])), output_bias=draw(st.booleans()),
            norm_bias=draw(st.sampled_from([None, False])))
    return build()


def test_stage_counts_add_up_to_num_params_for_every_structure():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from planner.memory import layer_params_per_rank

    @settings(max_examples=60, deadline=None)
    @given(model=_structures(), pp=st.sampled_from([1, 2]))
    def check(model, pp):
        assert layer_params_per_rank(model, 1) == model.layer_params()
        layers = model.num_layers
        plan = Plan(tp=1, pp=pp, dp=1, micro_batch_size=1,
                    layers_per_stage=tuple(layers // pp + (r < layers % pp) for r in range(pp)))
        total = sum(stage_params_per_rank(model, plan, r, n) for r, n in enumerate(plan.layers_per_stage))
        v, h = model.vocab_size, model.hidden_size
        pad_rows = -(-v // 128) * 128 - v  # Megatron pads the vocabulary to a multiple of 128
        padding = pad_rows * h
        bias_padding = pad_rows if model.output_bias else 0  # the output bias is padded with the rows, once
        if model.tied_embeddings and pp == 1:
            assert total == model.num_params + padding + bias_padding
        elif model.tied_embeddings:  # the last stage keeps a duplicate of the tied embedding
            assert total == model.num_params + v * h + 2 * padding + bias_padding
        else:
            assert total == model.num_params + 2 * padding + bias_padding

    check()


# --- what Megatron-LM cannot build (for the emitters; not wired yet) -----------------------------

@pytest.mark.parametrize("name,fields", [
    ("llama-3.1-405b.json", []), ("qwen2.5-7b.json", []), ("mistral-7b.json", []),
    ("phi-3-mini-4k-instruct.json", []), ("gpt2.json", []),
    ("gemma-2-9b.json", ["activation", "norm_placement", "attn_logit_softcap", "final_logit_softcap",
                         "sliding_window"]),
    ("gemma-3-1b-pt.json", ["activation", "norm_placement", "sliding_window"]),
    # GPT-OSS: biases on every linear layer and the router (Megatron's --add-bias-linear, no gap), but YaRN has no
    # Megatron-LM flag outside MLA, and plan3d writes neither its windows nor its clamped activation
    ("gpt-oss-20b.json", ["rope_scaling", "sliding_window", "swiglu_limit"]),
    ("olmo-2-1124-7b.json", ["norm_placement", "qk_norm"]),
    ("falcon-40b.json", ["parallel_attention"]), ("pythia-160m.json", ["parallel_attention"]),
])
def test_megatron_gaps_name_each_unbuildable_field(name, fields):
    gaps = _load(name).megatron_gaps()
    assert [g.split(":")[0] for g in gaps] == fields


def test_megatron_gaps_attention_bias_without_mlp_bias():
    # Llama with attention_bias (q/k/v/o biases) and no MLP biases: no Megatron flag combination.
    llama = _load("llama-3.1-405b.json").model_copy(update={"qkv_bias": True, "out_proj_bias": True})
    assert [g.split(":")[0] for g in llama.megatron_gaps()] == ["out_proj_bias, mlp_bias"]


# --- Gemma 3 (text) ------------------------------------------------------------------------------

def test_gemma3_1b_counts_from_the_report():
    # Gemma 3 report (arXiv:2503.19786) Table 1, 1B: 302M embedding and 698M non-embedding parameters, no vision
    # encoder, each rounded to 1M; the embedding is tied (vocab_size x hidden_size, stored once)
    spec = _load("gemma-3-1b-pt.json")
    embedding = spec.vocab_size * spec.hidden_size
    assert abs(embedding - 302e6) < 0.5e6
    assert abs(spec.num_params - embedding - 698e6) < 0.5e6


def test_gemma3_structure():
    """Gemma3TextConfig / modeling_gemma3.py: Gemma 2's sandwich norms and GeGLU, per-head q/k RMSNorm, no
    soft-capping; 5 local layers (window 512 in the 1B config) for every global one (sliding_window_pattern 6)."""
    spec = _load("gemma-3-1b-pt.json")
    assert (spec.activation, spec.norm_placement, spec.qk_norm, spec.tied_embeddings) == \
        ("geglu", "sandwich", "head", True)
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (None, None)
    assert (spec.head_dim, spec.kv_heads) == (256, 1)
    assert (spec.sliding_window, spec.sliding_window_layers) == (512, 26 - 26 // 6)


def test_gemma3_layer_types_list_and_model_type_only(tmp_path):
    """Newer configs list layer_types (transformers 4.53+); a config with model_type gemma3_text and no
    architectures reads the same class."""
    data = json.loads((HF / "gemma-3-1b-pt.json").read_text())
    data["layer_types"] = ["sliding_attention"] * 20 + ["full_attention"] * 6
    del data["architectures"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    spec = load_model(str(path))
    assert spec.sliding_window_layers == 20 and spec.qk_norm == "head"
    assert spec.num_params == _load("gemma-3-1b-pt.json").num_params


def test_gemma3_multimodal_checkpoint_is_refused_in_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                "text_config": json.loads((HF / "gemma-3-1b-pt.json").read_text())}))
    with pytest.raises(SpecError, match=r"architectures: Gemma3ForConditionalGeneration carries a SigLIP vision "
                                        r"tower, which is not modelled; .*text_config"):
        load_model(str(path))


def test_olmo3_windows():
    """Olmo3ForCausalLM: OLMo 2's layer with a 4,096-token window on the sliding_attention entries of layer_types
    (the 7B: 24 of 32), or, without layer_types, Olmo3Config's own pattern (every layer but each fourth)."""
    path = HF / "olmo-3-7b.json"
    m = load_model(str(path))
    assert (m.norm_placement, m.qk_norm, m.sliding_window, m.sliding_window_layers) == ("post", "full", 4096, 24)
    data = json.loads(path.read_text())
    data.pop("layer_types")
    data["num_hidden_layers"] = 10
    from planner.hf import hf_fields

    fields = hf_fields(data, "o", "config.json")
    assert (fields["sliding_window"], fields["sliding_window_layers"]) == (4096, 8)  # layers 3 and 7 are full
