"""Hugging Face ``config.json`` import: read exactly, or refused with one line naming the field.

Each supported architecture has a reader that maps the keys its ``transformers`` configuration
class reads to ModelSpec fields, using that class's defaults for absent keys (``None`` counts as
absent, as in ``transformers``), and the module structure of its ``modeling_*.py``: which linear
layers carry biases, how many norms a layer has and where, whether the output layer is tied. The
architecture is taken from ``architectures`` (else ``model_type``). Anything the estimator does
not model is refused: mixture-of-experts architectures without a reader (DBRX, Arctic, Grok, ...),
state-space and hybrid layers, unknown architectures, and options that change the structure in
ways the spec cannot express.

Mixture-of-experts readers (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GPT-OSS, GLM-4.5, OLMoE, Llama 4) follow the
``transformers`` 5.x classes (checked against 5.24.0): routed experts, top-k, shared experts, dense
layers first, router biases and multi-head latent attention (docs/moe.md). Read and deliberately
ignored, because they change no parameters: routing options (``norm_topk_prob``,
``routed_scaling_factor``, ``scoring_func``, auxiliary-loss
coefficients, ``router_jitter_noise``, GPT-OSS's ``swiglu_alpha``; but group-limited routing, ``n_group`` and
``topk_group`` with DeepSeek's ``topk_method``, is kept as ``router_num_groups`` / ``router_group_topk``: it bounds
the nodes a token is sent to) and
``quantization_config`` (GPT-OSS ships MXFP4 expert weights; the model class and the training
plan3d estimates hold them at the training precision).

The core sizes (layers, width, heads, vocabulary) are required even where ``transformers`` has a
default: a config without them is not a published model. Read and deliberately ignored, because
they change neither parameters nor saved activations: RoPE settings (but the rotated share of a head,
``partial_rotary_factor`` / GPT-NeoX ``rotary_pct``, is kept as ``rotary_percent`` for Megatron's
``--rotary-percent``), sliding windows other than
GPT-OSS's and Gemma-2/3's (Mistral, Qwen2 ``use_sliding_window``: their attention FLOPs are counted over the
whole causal window, an over-estimate), initialisation and generation settings. GPT-OSS's and Gemma-2/3's
windows (``sliding_window``, ``layer_types``) are read into ``sliding_window`` / ``sliding_window_layers``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.presets import SpecError
from planner.specs import moe_layer_fields

MOE_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
MOE_MESSAGE = ("this mixture-of-experts architecture is not modelled; plan3d reads the MoE classes of Mixtral, "
               "Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GPT-OSS, GLM-4.5, OLMoE and Llama 4")
SSM_NAME_PARTS = ("mamba", "jamba", "zamba", "bamba", "rwkv", "recurrentgemma", "falconh1", "nemotronh",
                  "hybrid", "xlstm", "lfm2")
SSM_KEYS = ("ssm_cfg", "mamba_d_state", "mamba_d_ssm", "hybrid_override_pattern", "layers_block_type",
            "attn_layer_period", "layer_types_ssm")
SSM_MESSAGE = "state-space (Mamba) and hybrid recurrent layers are not modelled; plan3d estimates transformers only"


def _get(data: dict, source: str, *keys: str, default: Any = ...) -> Any:
    """The first of ``keys`` present and not null, else ``default``; required when no default."""
    for k in keys:
        if data.get(k) is not None:
            return data[k]
    if default is ...:
        raise SpecError(f"{source}: {keys[0]}: missing in the Hugging Face config; it is required")
    return default


def _flag(data: dict, key: str, default: bool) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false, got {value!r}")
    return value


def _dropout(data: dict, *keys: str, default: float = 0.0) -> bool:
    """Dropout is active in training when any of the probabilities is above zero."""
    return any(float(_get(data, "", k, default=default)) > 0 for k in keys)


def _kv_heads(data: dict, default: int | None) -> int | None:
    """``num_key_value_heads``: the class default when absent; an explicit null is MHA (``None`` here),
    as the Llama, Mistral, Qwen2, Qwen3, Mixtral and GPT-OSS configs set it to ``num_attention_heads``."""
    return data.get("num_key_value_heads", default)


def _name(data: dict, default_name: str) -> str:
    return data.get("_name_or_path") or default_name


def _core(data: dict, source: str) -> dict:
    """Layers, width, query heads and vocabulary under their standard ``transformers`` names."""
    return {"num_layers": _get(data, source, "num_hidden_layers"), "hidden_size": _get(data, source, "hidden_size"),
            "num_attention_heads": _get(data, source, "num_attention_heads"),
            "vocab_size": _get(data, source, "vocab_size")}


def _gate(data: dict, source: str, key: str, default: str) -> str:
    """The gated MLP's activation: SiLU gate = SwiGLU, GeLU gate = GeGLU (3 matrices either way)."""
    act = str(_get(data, source, key, default=default)).lower()
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith("gelu"):
        return "geglu"
    raise SpecError(f"{source}: {key}: '{act}' gate is not modelled; plan3d models silu (SwiGLU) and gelu (GeGLU)")


# --- readers, one per architecture --------------------------------------------------------------

def _llama(data: dict, source: str, default_name: str, *, ffn_default: int = 11008, kv_default=None) -> dict:
    """LlamaForCausalLM (``modeling_llama.py``): q/k/v/o with ``attention_bias``, gate/up/down with
    ``mlp_bias``, RMSNorm before attention and MLP, ``head_dim`` default ``h // a``, untied by default.
    ``partial_rotary_factor`` (default 1; transformers' ``_compute_default_rope_parameters`` reads it for every
    RoPE model, Phi-4-mini sets 0.75) is kept as ``rotary_percent``.
    MistralForCausalLM has the same modules without biases (``modeling_mistral.py``)."""
    attention_bias = _flag(data, "attention_bias", False)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, kv_default),
            "head_dim": _get(data, source, "head_dim", default=None),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=ffn_default),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": _gate(data, source, "hidden_act", "silu"), "norm": "rmsnorm",
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias,
            "mlp_bias": _flag(data, "mlp_bias", False), "dropout": _dropout(data, "attention_dropout"),
            "rotary_percent": _get(data, source, "partial_rotary_factor", default=1.0)}


def _mistral(data: dict, source: str, default_name: str) -> dict:
    """MistralForCausalLM: MistralConfig defaults (``intermediate_size`` 14336, 8 KV heads), no biases."""
    fields = _llama(data, source, default_name, ffn_default=14336, kv_default=8)
    return fields | {"qkv_bias": False, "out_proj_bias": False, "mlp_bias": False}


def _qwen2(data: dict, source: str, default_name: str) -> dict:
    """Qwen2ForCausalLM (``modeling_qwen2.py``): biases on q/k/v only (``o_proj`` and the MLP have none);
    Qwen2Config defaults ``intermediate_size`` 22016, 32 KV heads, untied (Qwen2.5-0.5B sets it tied)."""
    fields = _llama(data, source, default_name, ffn_default=22016, kv_default=32)
    return fields | {"qkv_bias": True, "out_proj_bias": False, "mlp_bias": False}


def _nemotron(data: dict, source: str, default_name: str) -> dict:
    """NemotronForCausalLM (``modeling_nemotron.py``, NemotronConfig defaults; Nemotron-4, Minitron): q/k/v/o with
    ``attention_bias`` (default off), a non-gated MLP ``up_proj`` / ``down_proj`` with ``mlp_bias`` (default off) and
    ``hidden_act`` relu2 (squared ReLU, Megatron's ``--squared-relu``), ``NemotronLayerNorm1P`` before attention and
    MLP and at the end (a LayerNorm with weight and bias; the "1p" zero-centres the weight, no parameter more), RoPE on
    ``partial_rotary_factor`` of each head (default 0.5, ``NemotronConfig.__post_init__``; also read from
    ``rope_parameters``), ``head_dim`` default ``h // a``, MHA when ``num_key_value_heads`` is absent, untied."""
    act = str(_get(data, source, "hidden_act", default="relu2")).lower()
    activation = {"relu2": "squared_relu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu"}.get(act)
    if activation is None:
        raise SpecError(f"{source}: hidden_act: '{act}' is not modelled for NemotronForCausalLM; plan3d reads relu2 "
                        "(squared ReLU, Nemotron-4's) and gelu")
    attention_bias = _flag(data, "attention_bias", False)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, None),
            "head_dim": _get(data, source, "head_dim", default=None),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=24576),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=4096),
            "activation": activation, "norm": "layernorm",
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias,
            "mlp_bias": _flag(data, "mlp_bias", False), "dropout": _dropout(data, "attention_dropout"),
            "rotary_percent": _partial_rotary(data, source, 0.5)}


def _gemma2(data: dict, source: str, default_name: str) -> dict:
    """Gemma2ForCausalLM (``modeling_gemma2.py``): GeGLU MLP (``hidden_activation``), four RMSNorms per
    layer (input, post-attention, pre- and post-feedforward), ``head_dim`` default 256 (not ``h // a``),
    tied by default, attention and final-logit soft-capping, local and global layers alternating, the local
    first (Gemma 2 report, arXiv:2408.00118, 2.2: "sliding window size of 4096 tokens"; Gemma2Config
    ``sliding_window`` default 4096, ``layer_types`` default sliding where (i + 1) % 2, i.e. ceil(L / 2) layers)."""
    attention_bias = _flag(data, "attention_bias", False)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _get(data, source, "num_key_value_heads", default=4),
            "head_dim": _get(data, source, "head_dim", default=256),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=9216),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": _gate(data, source, "hidden_activation", "gelu_pytorch_tanh"),
            "norm": "rmsnorm", "norm_placement": "sandwich",
            "tied_embeddings": _flag(data, "tie_word_embeddings", True), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias, "mlp_bias": False,
            "attn_logit_softcap": data.get("attn_logit_softcapping", 50.0),  # null: no cap
            "final_logit_softcap": data.get("final_logit_softcapping", 30.0),
            "dropout": _dropout(data, "attention_dropout"),
            **_layer_windows(data, source, 4096, lambda layers: (layers + 1) // 2)}


def _phi3(data: dict, source: str, default_name: str) -> dict:
    """Phi3ForCausalLM (``modeling_phi3.py``): fused ``qkv_proj`` (``a*d_h + 2*g*d_h`` outputs) and fused
    ``gate_up_proj`` (``2f``): the same parameters as separate matrices; no biases; RMSNorm; untied."""
    fields = _llama(data, source, default_name, ffn_default=8192)
    return fields | {"qkv_bias": False, "out_proj_bias": False, "mlp_bias": False,
                     "dropout": _dropout(data, "attention_dropout", "resid_pdrop", "embd_pdrop")}


def _gemma3(data: dict, source: str, default_name: str) -> dict:
    """Gemma3ForCausalLM (``modeling_gemma3.py``, Gemma3TextConfig defaults; Gemma 3 report, arXiv:2503.19786
    section 2.1): Gemma 2's layer (GeGLU MLP, four RMSNorms per layer, ``head_dim`` default 256, tied by default,
    :func:`_gemma2`) with an RMSNorm over one head on queries and keys (``q_norm``/``k_norm`` of ``head_dim``:
    qk_norm "head") in place of soft-capping (``attn_logit_softcapping`` and ``final_logit_softcapping``
    default null); local layers with a sliding window (``sliding_window``, default 4096) and one global layer
    in every ``sliding_window_pattern`` (default 6: layer i is local where (i + 1) % 6 != 0; newer configs
    list ``layer_types``). The 4B-27B checkpoints are Gemma3ForConditionalGeneration, refused (:func:`refusal`)."""
    pattern = _count(data, source, "sliding_window_pattern", default=6, minimum=1)
    return _gemma2(data, source, default_name) | {
        "qk_norm": "head", "attn_logit_softcap": data.get("attn_logit_softcapping"),
        "final_logit_softcap": data.get("final_logit_softcapping"),
        **_layer_windows(data, source, 4096, lambda layers: layers - layers // pattern)}


def _olmo2(data: dict, source: str, default_name: str) -> dict:
    """Olmo2ForCausalLM (``modeling_olmo2.py``): RMSNorm on the attention and MLP outputs before the
    residual add (no input norm), RMSNorm ``q_norm`` over ``a*d_h`` and ``k_norm`` over ``g*d_h``
    channels (OLMo 2 report, arXiv:2501.00656, section 3.1), biases per ``attention_bias``, untied."""
    return _llama(data, source, default_name) | {"norm_placement": "post", "qk_norm": "full"}


def _olmo3(data: dict, source: str, default_name: str) -> dict:
    """Olmo3ForCausalLM (``modeling_olmo3.py``, Olmo3Config defaults): OLMo 2's layer (:func:`_olmo2`: norms on the
    attention and MLP outputs, RMSNorm ``q_norm`` / ``k_norm`` over the whole projections, biases per
    ``attention_bias``, untied) with sliding-window attention on the ``"sliding_attention"`` entries of
    ``layer_types`` (window ``sliding_window``, default 4096), by default three of every four layers
    (``Olmo3Config.__post_init__``: layer ``i`` slides unless ``(i + 1) % 4 == 0``). YaRN on the full layers changes no
    parameter."""
    return _olmo2(data, source, default_name) | _layer_windows(data, source, 4096, lambda layers: layers - layers // 4)


def _falcon(data: dict, source: str, default_name: str) -> dict:
    """FalconForCausalLM (``modeling_falcon.py``, FalconConfig defaults): fused ``query_key_value`` of
    ``(2g + a) d_h`` outputs with ``new_decoder_architecture`` (g = ``num_kv_heads``), ``h + 2 d_h`` with
    ``multi_query`` (g = 1), else ``3h``; ``bias`` on every linear layer; GeLU MLP of ``ffn_hidden_size``
    (default 4h); LayerNorm; parallel attention (``parallel_attn``) with ``num_ln_in_parallel_attn``
    norms (default 2 with the new architecture, else 1); tied by default; ALiBi or RoPE (``alibi``)."""
    h = _get(data, source, "hidden_size", "n_embed")
    a = _get(data, source, "num_attention_heads", "n_head")
    new_arch, multi_query = _flag(data, "new_decoder_architecture", False), _flag(data, "multi_query", True)
    parallel = _flag(data, "parallel_attn", True)
    norms_in_parallel = _get(data, source, "num_ln_in_parallel_attn", default=2 if new_arch else 1)
    if new_arch and not parallel:
        raise SpecError(f"{source}: parallel_attn: false with new_decoder_architecture is not a model "
                        "transformers can run (its forward needs the parallel norms)")
    if parallel and norms_in_parallel not in (1, 2) or (parallel and not new_arch and norms_in_parallel == 2):
        raise SpecError(f"{source}: num_ln_in_parallel_attn: {norms_in_parallel} is not modelled with "
                        f"new_decoder_architecture={str(new_arch).lower()}; FalconDecoderLayer uses 1 norm there")
    kv = _get(data, source, "num_kv_heads", default=a) if new_arch else (1 if multi_query else a)
    bias = _flag(data, "bias", False)
    return {"name": _name(data, default_name), "num_layers": _get(data, source, "num_hidden_layers", "n_layer"),
            "hidden_size": h, "num_attention_heads": a, "num_kv_heads": kv,
            "ffn_hidden_size": _get(data, source, "ffn_hidden_size", default=4 * h if isinstance(h, int) else None),
            "vocab_size": _get(data, source, "vocab_size"),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": "gelu", "norm": "layernorm", "parallel_attention": parallel,
            "shared_input_norm": parallel and norms_in_parallel == 1,
            "tied_embeddings": _flag(data, "tie_word_embeddings", True),
            "position_embedding": "alibi" if _flag(data, "alibi", False) else "rope", "linear_bias": bias,
            "dropout": _dropout(data, "hidden_dropout", "attention_dropout")}


def _gpt2(data: dict, source: str, default_name: str) -> dict:
    """GPT2LMHeadModel (``modeling_gpt2.py``, GPT2Config defaults): ``n_embd``/``n_layer``/``n_head``,
    learned positions (``n_positions``), biases on every Conv1D, LayerNorm, MLP ``n_inner`` (default
    4h), tied output layer, dropout 0.1 (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``)."""
    if _flag(data, "add_cross_attention", False):
        raise SpecError(f"{source}: add_cross_attention: cross-attention layers are not modelled; "
                        "decoder-only models only")
    h = _get(data, source, "n_embd", "hidden_size")
    return {"name": _name(data, default_name), "num_layers": _get(data, source, "n_layer", "num_hidden_layers"),
            "hidden_size": h, "num_attention_heads": _get(data, source, "n_head", "num_attention_heads"),
            "ffn_hidden_size": _get(data, source, "n_inner", default=4 * h if isinstance(h, int) else None),
            "vocab_size": _get(data, source, "vocab_size"),
            "max_seq_len": _get(data, source, "n_positions", "max_position_embeddings", default=1024),
            "activation": "gelu", "norm": "layernorm", "tied_embeddings": _flag(data, "tie_word_embeddings", True),
            "position_embedding": "learned", "linear_bias": True,
            "dropout": _dropout(data, "resid_pdrop", "embd_pdrop", "attn_pdrop", default=0.1)}


def _gpt_neox(data: dict, source: str, default_name: str) -> dict:
    """GPTNeoXForCausalLM (``modeling_gpt_neox.py``, GPTNeoXConfig defaults): fused ``query_key_value``
    and ``dense`` with ``attention_bias`` (default true), MLP always with biases, two LayerNorms,
    parallel residual (``use_parallel_residual``, default true), untied ``embed_out``, rotary over ``rotary_pct``
    (default 0.25; alias ``partial_rotary_factor``) of each head."""
    attention_bias = _flag(data, "attention_bias", True)
    return {**_core(data, source), "name": _name(data, default_name),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=24576),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": "gelu", "norm": "layernorm",
            "parallel_attention": _flag(data, "use_parallel_residual", True),
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias, "mlp_bias": True,
            "dropout": _dropout(data, "hidden_dropout", "attention_dropout"),
            "rotary_percent": _get(data, source, "rotary_pct", "partial_rotary_factor", default=0.25)}


def _gemma(data: dict, source: str, default_name: str) -> dict:
    """GemmaForCausalLM (``modeling_gemma.py``, GemmaConfig defaults, "similar ... to google/gemma-7b"): the Llama
    layer with a GeGLU MLP (``hidden_act``: the released configs' legacy ``gelu`` is read as the tanh GeLU,
    ``GemmaConfig.__post_init__``; either is a GeLU gate), q/k/v/o with ``attention_bias`` (default off), no MLP
    biases, two RMSNorms per layer (Gemma's ``1 + w`` scaling: no parameter more), ``head_dim`` default 256 (not
    ``h // a``), tied by default; the embedding is scaled by sqrt(h), no parameter (Gemma report,
    arXiv:2403.08295 section 2)."""
    attention_bias = _flag(data, "attention_bias", False)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, 16),
            "head_dim": _get(data, source, "head_dim", default=256),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=24576),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=8192),
            "activation": _gate(data, source, "hidden_act", "gelu_pytorch_tanh"), "norm": "rmsnorm",
            "tied_embeddings": _flag(data, "tie_word_embeddings", True), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias, "mlp_bias": False,
            "dropout": _dropout(data, "attention_dropout")}


def _granite(data: dict, source: str, default_name: str) -> dict:
    """GraniteForCausalLM (``modeling_granite.py``, GraniteConfig defaults, "similar ... to
    ibm-granite/granite-3.0-8b-base"): the Llama layer (:func:`_llama`: ``attention_bias`` on q/k/v/o, ``mlp_bias``
    on gate/up/down, both default off); its ``embedding_multiplier``, ``residual_multiplier``,
    ``attention_multiplier`` and ``logits_scaling`` are scalars, no parameters; untied by default (the 3.x checkpoints
    set ``tie_word_embeddings`` true)."""
    return _llama(data, source, default_name, ffn_default=11008)


def _smollm3(data: dict, source: str, default_name: str) -> dict:
    """SmolLM3ForCausalLM (``modeling_smollm3.py``, SmolLM3Config defaults, "similar ... to HuggingFaceTB/SmolLM3-3B"):
    the Llama layer (``attention_bias`` on q/k/v/o, ``mlp_bias`` on gate/up/down, both default off), 4 KV heads,
    ``intermediate_size`` default 11008, tied by default. Its ``no_rope_layers`` leave RoPE out of every fourth layer
    (NoPE): no parameters; the estimator applies RoPE's elementwise cost to every layer, a slight over-estimate."""
    fields = _llama(data, source, default_name, ffn_default=11008, kv_default=4)
    return fields | {"tied_embeddings": _flag(data, "tie_word_embeddings", True)}


def _gelu_mlp(data: dict, source: str, key: str, default: str, arch: str) -> str:
    """The activation of a non-gated MLP (``c_fc`` -> act -> ``c_proj``): any GeLU; others are refused."""
    act = str(_get(data, source, key, default=default)).lower()
    if not act.startswith("gelu"):
        raise SpecError(f"{source}: {key}: '{act}' is not modelled for {arch}'s MLP; plan3d reads the GeLU ones")
    return "gelu"


def _starcoder2(data: dict, source: str, default_name: str) -> dict:
    """Starcoder2ForCausalLM (``modeling_starcoder2.py``, Starcoder2Config defaults, "similar ... to
    bigcode/starcoder2-7b"): q/k/v/o and a non-gated GeLU MLP (``c_fc``/``c_proj``, ``hidden_act`` default the tanh
    GeLU), every linear with ``use_bias`` (default true), two LayerNorms with bias per layer and one at the end,
    GQA (default 2 KV heads), ``head_dim`` ``h // a``, RoPE, tied by default (StarCoder2 report, arXiv:2402.19173
    section 5). A ``sliding_window`` is read and ignored, as Mistral's (module docstring)."""
    bias = _flag(data, "use_bias", True)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, 2),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=12288),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=4096),
            "activation": _gelu_mlp(data, source, "hidden_act", "gelu_pytorch_tanh", "Starcoder2ForCausalLM"),
            "norm": "layernorm", "tied_embeddings": _flag(data, "tie_word_embeddings", True),
            "position_embedding": "rope", "linear_bias": bias,
            "dropout": _dropout(data, "attention_dropout", "residual_dropout", "embedding_dropout")}


def _stablelm(data: dict, source: str, default_name: str) -> dict:
    """StableLmForCausalLM (``modeling_stablelm.py``, StableLmConfig defaults, "similar ... to
    stabilityai/stablelm-3b-4e1t"): q/k/v with ``use_qkv_bias`` (default off), ``o_proj`` and the SwiGLU MLP without
    biases, LayerNorms with bias, RoPE on ``partial_rotary_factor`` of each head (default 0.25, top level or in
    ``rope_parameters``), untied by default; ``use_parallel_residual`` (StableLM 2 12B) runs attention and MLP on one
    shared norm (``post_attention_layernorm`` is None): parallel attention with one input norm. ``qk_layernorm``
    (one bias-free LayerNorm per head, each with its own weights) is refused: plan3d's query/key norms are one norm
    shared by the heads or one over all of them."""
    if _flag(data, "qk_layernorm", False):
        raise SpecError(f"{source}: qk_layernorm: StableLM's per-head LayerNorms (one per head, each with its own "
                        "weights) are not modelled; plan3d models a query/key norm shared by the heads or over all "
                        "of them (qk_norm in a model spec YAML, docs/specs.md)")
    parallel = _flag(data, "use_parallel_residual", False)
    qkv_bias = _flag(data, "use_qkv_bias", False)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, 32),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=6912),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=4096),
            "activation": _gate(data, source, "hidden_act", "silu"), "norm": "layernorm",
            "parallel_attention": parallel, "shared_input_norm": parallel,
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": qkv_bias, "out_proj_bias": False, "mlp_bias": False,
            "dropout": _dropout(data, "attention_dropout", "hidden_dropout"),
            "rotary_percent": _partial_rotary(data, source, 0.25)}


def _gpt_bigcode(data: dict, source: str, default_name: str) -> dict:
    """GPTBigCodeForCausalLM (``modeling_gpt_bigcode.py``, GPTBigCodeConfig defaults, "similar ... to
    bigcode/gpt_bigcode-santacoder"; SantaCoder, StarCoder): GPT-2's layer (learned positions ``n_positions``,
    biases on every linear, LayerNorm, GeLU MLP of ``n_inner``, default 4h, tied) with one fused ``c_attn`` of
    ``h + 2 d_h`` outputs under ``multi_query`` (default true: one KV head), else ``3h``: :func:`_gpt2`'s fields with
    its KV heads and its MLP's activation (``activation_function``, a GeLU)."""
    a = _get(data, source, "n_head", "num_attention_heads")
    return _gpt2(data, source, default_name) | {
        "num_kv_heads": 1 if _flag(data, "multi_query", True) else a,
        "activation": _gelu_mlp(data, source, "activation_function", "gelu_pytorch_tanh", "GPTBigCodeForCausalLM")}


def _bloom(data: dict, source: str, default_name: str) -> dict:
    """BloomForCausalLM (``modeling_bloom.py``, BloomConfig defaults; BLOOM, arXiv:2211.05100 section 3.2): fused
    ``query_key_value`` (3h) and ``dense`` with biases, a GeLU MLP of 4h with biases, two LayerNorms per layer, a
    LayerNorm on the word embedding (``word_embeddings_layernorm``), ALiBi (no position parameters), tied.
    ``apply_residual_connection_post_layernorm`` (the residual taken after the norm; no released BLOOM sets it) is
    refused: plan3d's layers add the residual before the norm."""
    if _flag(data, "apply_residual_connection_post_layernorm", False):
        raise SpecError(f"{source}: apply_residual_connection_post_layernorm: a residual taken after the norm is not "
                        "modelled; plan3d's pre-norm layers add it before")
    h = _get(data, source, "hidden_size", "n_embed")
    return {"name": _name(data, default_name), "num_layers": _get(data, source, "n_layer", "num_hidden_layers"),
            "hidden_size": h, "num_attention_heads": _get(data, source, "n_head", "num_attention_heads"),
            "ffn_hidden_size": 4 * h if isinstance(h, int) else None, "vocab_size": _get(data, source, "vocab_size"),
            "max_seq_len": _get(data, source, "seq_length", default=None),
            "activation": "gelu", "norm": "layernorm", "tied_embeddings": _flag(data, "tie_word_embeddings", True),
            "position_embedding": "alibi", "linear_bias": True, "embedding_norm": True,
            "dropout": _dropout(data, "hidden_dropout", "attention_dropout")}


def _phi(data: dict, source: str, default_name: str) -> dict:
    """PhiForCausalLM (``modeling_phi.py``, PhiConfig defaults; Phi-1, Phi-1.5, Phi-2): one LayerNorm (with bias)
    feeding attention and MLP in parallel, q/k/v and ``dense`` with biases, a GeLU MLP (``fc1``/``fc2``, biases) of
    ``intermediate_size``, RoPE on ``partial_rotary_factor`` of each head (default 0.5), a final LayerNorm and an
    ``lm_head`` with a bias (``output_bias``), untied by default. ``qk_layernorm``: one LayerNorm (weight and bias) of
    a head's width for the queries and one for the keys, shared by the heads (qk_norm "head")."""
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, None),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=8192),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=2048),
            "activation": _gelu_mlp(data, source, "hidden_act", "gelu_new", "PhiForCausalLM"), "norm": "layernorm",
            "parallel_attention": True, "shared_input_norm": True,
            "qk_norm": "head" if _flag(data, "qk_layernorm", False) else "none",
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": True, "output_bias": True,
            "dropout": _dropout(data, "resid_pdrop", "embd_pdrop", "attention_dropout"),
            "rotary_percent": _partial_rotary(data, source, 0.5)}


def _gptj(data: dict, source: str, default_name: str) -> dict:
    """GPTJForCausalLM (``modeling_gptj.py``, GPTJConfig defaults; GPT-J-6B): ``n_embd``/``n_layer``/``n_head``, one
    LayerNorm (``ln_1``, with bias) feeding attention and MLP in parallel, q/k/v/out without biases, a GeLU MLP
    (``fc_in``/``fc_out``, biases) of ``n_inner`` (default 4h), RoPE on ``rotary_dim`` channels of each head (default
    64; none: the whole head), a final LayerNorm and an ``lm_head`` with a bias (``output_bias``), untied by
    default."""
    h = _get(data, source, "n_embd", "hidden_size")
    a = _get(data, source, "n_head", "num_attention_heads")
    rotary = data.get("rotary_dim", 64)
    head = h // a if isinstance(h, int) and isinstance(a, int) and a else None
    return {"name": _name(data, default_name), "num_layers": _get(data, source, "n_layer", "num_hidden_layers"),
            "hidden_size": h, "num_attention_heads": a,
            "ffn_hidden_size": _get(data, source, "n_inner", default=4 * h if isinstance(h, int) else None),
            "vocab_size": _get(data, source, "vocab_size"),
            "max_seq_len": _get(data, source, "n_positions", "max_position_embeddings", default=2048),
            "activation": _gelu_mlp(data, source, "activation_function", "gelu_new", "GPTJForCausalLM"),
            "norm": "layernorm", "parallel_attention": True, "shared_input_norm": True,
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": False, "out_proj_bias": False, "mlp_bias": True, "output_bias": True,
            "dropout": _dropout(data, "resid_pdrop", "embd_pdrop", "attn_pdrop"),
            "rotary_percent": min(1.0, rotary / head) if rotary and head else 1.0}  # a slice past the head: all of it


def _cohere(data: dict, source: str, default_name: str) -> dict:
    """CohereForCausalLM (``modeling_cohere.py``, CohereConfig defaults; Command R): one ``CohereLayerNorm`` (a
    LayerNorm with weight only: ``norm_bias`` False) feeding attention and a SwiGLU MLP in parallel, q/k/v/o with
    ``attention_bias`` (default off), no MLP biases, MHA without ``num_key_value_heads``, tied by default; its
    ``logit_scale`` is a scalar. ``use_qk_norm`` (Command R+: a weight per head and channel, normalised per head)
    is refused: plan3d's query/key norms are one norm shared by the heads or one over all of them."""
    if _flag(data, "use_qk_norm", False):
        raise SpecError(f"{source}: use_qk_norm: Cohere's per-head query/key LayerNorms (a weight for each head and "
                        "channel) are not modelled; plan3d models a norm shared by the heads or over all of them "
                        "(qk_norm in a model spec YAML, docs/specs.md)")
    attention_bias = _flag(data, "attention_bias", False)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, None),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=22528),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": _gate(data, source, "hidden_act", "silu"), "norm": "layernorm", "norm_bias": False,
            "parallel_attention": True, "shared_input_norm": True,
            "tied_embeddings": _flag(data, "tie_word_embeddings", True), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias, "mlp_bias": False,
            "dropout": _dropout(data, "attention_dropout")}


def _mpt(data: dict, source: str, default_name: str) -> dict:
    """MptForCausalLM (``modeling_mpt.py``, MptConfig defaults; MosaicML's MPT, llm-foundry): ``d_model``,
    ``n_heads``, ``n_layers``; fused ``Wqkv`` (3h) and ``out_proj``, a GeLU MLP of 4h, all without biases, two
    LayerNorms per layer and a final one, all without bias (``norm_bias`` False), ALiBi, tied. The transformers class
    builds exactly that whatever the config says, so a config it would misread is refused: ``no_bias`` false,
    ``expansion_ratio`` other than 4, ``attn_config.qk_ln`` (Q/K LayerNorms), ``attn_config.alibi`` false (learned
    positions), an ``attn_config.attn_type`` other than multi-head (llm-foundry's grouped-query attention) or an
    ``ffn_config.ffn_type`` other than ``mptmlp`` (llm-foundry's GLU and MoE MLPs). ``clip_qkv`` and
    ``alibi_bias_max`` change no parameter."""
    attn = data.get("attn_config") if isinstance(data.get("attn_config"), dict) else {}
    if not _flag(data, "no_bias", True):
        raise SpecError(f"{source}: no_bias: false (biases on the linears and norms) is not what transformers' "
                        "MptForCausalLM builds; plan3d reads MPT without biases (write a model spec YAML for others)")
    if data.get("expansion_ratio", 4) != 4:
        raise SpecError(f"{source}: expansion_ratio: {data['expansion_ratio']} is not modelled; transformers' "
                        "MptForCausalLM builds an MLP of 4 x d_model (write a model spec YAML with ffn_hidden_size)")
    if _flag(attn, "qk_ln", False):
        raise SpecError(f"{source}: attn_config.qk_ln: MPT's query/key LayerNorms are not in transformers' "
                        "MptForCausalLM and not modelled; write a model spec YAML (qk_norm, docs/specs.md)")
    if not _flag(attn, "alibi", True):
        raise SpecError(f"{source}: attn_config.alibi: false (learned positions) is not what transformers' "
                        "MptForCausalLM builds; plan3d reads MPT with ALiBi")
    if attn.get("attn_type", "multihead_attention") != "multihead_attention":
        raise SpecError(f"{source}: attn_config.attn_type: {attn['attn_type']!r} is not what transformers' "
                        "MptForCausalLM builds (multihead_attention); write a model spec YAML (num_kv_heads)")
    ffn = data.get("ffn_config") if isinstance(data.get("ffn_config"), dict) else {}
    if ffn.get("ffn_type", "mptmlp") != "mptmlp":
        raise SpecError(f"{source}: ffn_config.ffn_type: {ffn['ffn_type']!r} is not what transformers' "
                        "MptForCausalLM builds (mptmlp, a GeLU MLP); write a model spec YAML (activation)")
    pdrop = (attn.get("attn_pdrop"), data.get("resid_pdrop"), data.get("emb_pdrop"))
    h = _get(data, source, "d_model", "hidden_size")
    return {"name": _name(data, default_name), "num_layers": _get(data, source, "n_layers", "num_hidden_layers"),
            "hidden_size": h,
            "num_attention_heads": _get(data, source, "n_heads", "num_attention_heads"),
            "ffn_hidden_size": 4 * h if isinstance(h, int) else None, "vocab_size": _get(data, source, "vocab_size"),
            "max_seq_len": _get(data, source, "max_seq_len", default=2048),
            "activation": "gelu", "norm": "layernorm", "norm_bias": False,
            "tied_embeddings": _flag(data, "tie_word_embeddings", True), "position_embedding": "alibi",
            "linear_bias": False, "dropout": any(float(x or 0) > 0 for x in pdrop)}


def _partial_rotary(data: dict, source: str, default: float) -> float:
    """``partial_rotary_factor`` at the top level (the released configs) or in ``rope_parameters`` (transformers 5)."""
    rope = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
    return _get(data, source, "partial_rotary_factor", default=rope.get("partial_rotary_factor", default))


def _glm(data: dict, source: str, default_name: str) -> dict:
    """GlmForCausalLM (``modeling_glm.py``, GlmConfig defaults; GLM-4-9B): the Llama layer with ``attention_bias`` on
    q/k/v only (default true; ``o_proj`` has none), a fused ``gate_up_proj`` (the same count as two matrices), no MLP
    biases, ``head_dim`` default 128, 2 KV heads, RoPE on ``partial_rotary_factor`` of each head (default 0.5),
    untied."""
    fields = _llama(data, source, default_name, ffn_default=13696, kv_default=2)
    return fields | {"head_dim": _get(data, source, "head_dim", default=128),
                     "qkv_bias": _flag(data, "attention_bias", True), "out_proj_bias": False, "mlp_bias": False,
                     "rotary_percent": _partial_rotary(data, source, 0.5)}


def _glm4(data: dict, source: str, default_name: str) -> dict:
    """Glm4ForCausalLM (``modeling_glm4.py``, Glm4Config defaults; GLM-4-0414): :func:`_glm`'s layer with two more
    RMSNorms, on the attention and MLP outputs (``post_self_attn_layernorm``, ``post_mlp_layernorm``): four per
    layer, norm_placement "sandwich"."""
    return _glm(data, source, default_name) | {"norm_placement": "sandwich"}


def _seed_oss(data: dict, source: str, default_name: str) -> dict:
    """SeedOssForCausalLM (``modeling_seed_oss.py``, SeedOssConfig defaults; ByteDance Seed-OSS-36B): the Llama
    layer with ``attention_bias`` on q/k/v (default true), ``attention_out_bias`` on ``o_proj`` (default false),
    ``mlp_bias`` (default false), ``head_dim`` default 128, 8 KV heads, untied."""
    fields = _llama(data, source, default_name, ffn_default=27648, kv_default=8)
    return fields | {"head_dim": _get(data, source, "head_dim", default=128),
                     "qkv_bias": _flag(data, "attention_bias", True),
                     "out_proj_bias": _flag(data, "attention_out_bias", False),
                     "mlp_bias": _flag(data, "mlp_bias", False)}


def _exaone4(data: dict, source: str, default_name: str) -> dict:
    """Exaone4ForCausalLM (``modeling_exaone4.py``, Exaone4Config defaults; EXAONE 4.0): no biases, RMSNorm on the
    attention and MLP outputs (``post_attention_layernorm``, ``post_feedforward_layernorm``: norm_placement
    "post", as OLMo 2), an RMSNorm of a head's width on queries and keys shared by the heads (qk_norm "head"),
    untied; local layers with ``sliding_window`` (default 4096) per ``layer_types``, else per
    ``sliding_window_pattern``: a number n (default 4: layer i is local where (i + 1) % n != 0) or a string of L
    (local) and G (global) repeated over the layers ("LLLG" in the 32B config); none when ``sliding_window`` is
    null."""
    fields = _llama(data, source, default_name, ffn_default=16384, kv_default=32)
    fields |= {"norm_placement": "post", "qk_norm": "head", "qkv_bias": False, "out_proj_bias": False,
               "mlp_bias": False}
    if data.get("sliding_window", 4096) is None:
        return fields
    pattern = data.get("sliding_window_pattern", 4)
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        def local(layers: int) -> int:
            return sum(pattern[i % len(pattern)] == "L" for i in range(layers))
    else:
        n = _count(data, source, "sliding_window_pattern", default=4, minimum=1)

        def local(layers: int) -> int:
            return layers - layers // n
    return fields | _layer_windows(data, source, 4096, local)


# --- mixture-of-experts and Qwen3 readers --------------------------------------------------------

def _count(data: dict, source: str, *keys: str, default: Any = ..., minimum: int = 0) -> int:
    """An integer size (``_get``), refused with one line when it is not a whole number >= ``minimum``."""
    value = _get(data, source, *keys, default=default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{source}: {keys[0]}: expected a whole number >= {minimum}, got {value!r}")
    return value


def _experts(data: dict, source: str, keys: tuple[str, ...], default: Any) -> int:
    """Routed experts per MoE layer; one routed expert is refused (plan3d's MoE needs two or more)."""
    n = _count(data, source, *keys, default=default)
    if n == 1:
        raise SpecError(f"{source}: {keys[0]}: a single routed expert is not modelled; plan3d models 2 or more "
                        "(or 0 for a dense model)")
    return n


def _moe_layers(data: dict, source: str, num_layers: Any) -> dict:
    """Which layers of Qwen2-MoE and Qwen3-MoE have experts, as ModelSpec fields.

    ``Qwen{2,3}MoeDecoderLayer`` (``modeling_qwen{2,3}_moe.py``) uses experts in layer ``i`` when
    ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``, else a dense MLP of
    ``intermediate_size``: ``first_k_dense`` where that is a leading run of dense layers (``decoder_sparse_step`` 1,
    the default, with ``mlp_only_layers`` empty or ``[0, ..., k-1]``), else ``moe_layer_pattern``.
    """
    step = _count(data, source, "decoder_sparse_step", default=1, minimum=1)
    only = _get(data, source, "mlp_only_layers", default=[])
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise SpecError(f"{source}: mlp_only_layers: expected a list of layer indices, got {only!r}")
    if not isinstance(num_layers, int):
        return {"first_k_dense": 0}  # _llama has refused it already
    pattern = [int(i not in only and (i + 1) % step == 0) for i in range(num_layers)]
    if not any(pattern):
        raise SpecError(f"{source}: mlp_only_layers / decoder_sparse_step: every layer is dense; use the dense "
                        "architecture's config")
    return moe_layer_fields(pattern)


def _mixtral(data: dict, source: str, default_name: str) -> dict:
    """MixtralForCausalLM (``modeling_mixtral.py``, MixtralConfig defaults): Mistral attention without
    biases (``head_dim`` default ``h // a``, 8 KV heads), ``num_local_experts`` (default 8, alias
    ``num_experts``) SwiGLU experts of ``intermediate_size`` (default 14336) in every layer, top
    ``num_experts_per_tok`` (default 2), a bias-free ``h x E`` router, RMSNorm, untied. Mixtral of
    experts, Jiang et al. 2024, arXiv:2401.04088 section 2.1."""
    fields = _mistral(data, source, default_name)
    experts = _experts(data, source, ("num_local_experts", "num_experts"), 8)
    if experts == 0:
        raise SpecError(f"{source}: num_local_experts: 0 experts leaves MixtralSparseMoeBlock without an MLP; "
                        "not a model plan3d (or Mixtral) describes")
    return fields | {"num_experts": experts, "top_k": _count(data, source, "num_experts_per_tok", default=2, minimum=1)}


def _qwen3(data: dict, source: str, default_name: str) -> dict:
    """Qwen3ForCausalLM (``modeling_qwen3.py``, Qwen3Config defaults): Llama structure with RMSNorm
    ``q_norm``/``k_norm`` over one head (``head_dim`` wide, shared by the heads: qk_norm "head"; Qwen3
    report, arXiv:2505.09388 section 2), ``head_dim`` default 128 (not ``h // a``), ``attention_bias``
    on q/k/v/o (default false), no MLP biases, ``intermediate_size`` default 22016, 32 KV heads, untied
    by default."""
    fields = _llama(data, source, default_name, ffn_default=22016, kv_default=32)
    return fields | {"head_dim": _get(data, source, "head_dim", default=128), "qk_norm": "head", "mlp_bias": False}


def _qwen_moe(data: dict, source: str, default_name: str, *, experts_default: int, top_k_default: int,
              moe_ffn_default: int, ffn_default: int, kv_default: int | None) -> dict:
    """The shared part of Qwen2-MoE and Qwen3-MoE: Llama-style attention (``head_dim`` default ``h // a``),
    ``num_experts`` routed SwiGLU experts of ``moe_intermediate_size``, a bias-free ``h x E`` router, the
    dense layers of ``intermediate_size`` (:func:`_moe_layers`), RMSNorm, untied by default.
    ``num_experts`` 0 is a dense model (``config.num_experts > 0`` in the decoder layer)."""
    fields = _llama(data, source, default_name, ffn_default=ffn_default, kv_default=kv_default)
    experts = _experts(data, source, ("num_experts", "num_local_experts"), experts_default)
    if experts == 0:
        return fields | {"mlp_bias": False}
    return fields | {"mlp_bias": False, "num_experts": experts,
                     "top_k": _count(data, source, "num_experts_per_tok", default=top_k_default, minimum=1),
                     "moe_ffn_hidden_size": _count(data, source, "moe_intermediate_size", default=moe_ffn_default,
                                                   minimum=1),
                     **_moe_layers(data, source, fields["num_layers"])}


def _qwen2_moe(data: dict, source: str, default_name: str) -> dict:
    """Qwen2MoeForCausalLM (``modeling_qwen2_moe.py``, Qwen2MoeConfig defaults): biases on q/k/v per
    ``qkv_bias`` (default true; ``o_proj`` has none), 16 KV heads, 60 experts of ``moe_intermediate_size``
    1408, top 4, and in every MoE layer one shared SwiGLU expert of ``shared_expert_intermediate_size``
    (default 5632) scaled by a sigmoid gate, ``shared_expert_gate`` (``h -> 1`` linear, no bias)."""
    fields = _qwen_moe(data, source, default_name, experts_default=60, top_k_default=4, moe_ffn_default=1408,
                       ffn_default=5632, kv_default=16)
    qkv_bias = _flag(data, "qkv_bias", True)
    fields |= {"qkv_bias": qkv_bias, "out_proj_bias": False}
    if "num_experts" not in fields:
        return fields
    shared = _count(data, source, "shared_expert_intermediate_size", default=5632)
    if shared == 0:
        raise SpecError(f"{source}: shared_expert_intermediate_size: 0 leaves only the shared expert's gate; "
                        "not modelled (plan3d's shared-expert gate needs a shared expert)")
    return fields | {"shared_expert_ffn_hidden_size": shared, "shared_expert_gate": True}


def _qwen3_moe(data: dict, source: str, default_name: str) -> dict:
    """Qwen3MoeForCausalLM (``modeling_qwen3_moe.py``, Qwen3MoeConfig defaults): Qwen3 attention (per-head
    ``q_norm``/``k_norm``, ``attention_bias`` on q/k/v/o, default false; ``head_dim`` default ``h // a``),
    4 KV heads, 128 experts (``num_experts``, alias ``num_local_experts``) of ``moe_intermediate_size``
    768, top 8, no shared expert (Qwen3 report, arXiv:2505.09388 section 2)."""
    fields = _qwen_moe(data, source, default_name, experts_default=128, top_k_default=8, moe_ffn_default=768,
                       ffn_default=6144, kv_default=4)
    return fields | {"qk_norm": "head"}


def _deepseek(data: dict, source: str, default_name: str, *, v3: bool) -> dict:
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (``modeling_deepseek_v{2,3}.py``, their config
    defaults): multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 section 2.1) of ``q_lora_rank``
    (null: a full ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` and
    ``v_head_dim``, with RMSNorms on the compressed q and kv; ``first_k_dense_replace`` dense SwiGLU
    layers of ``intermediate_size``, then MoE layers of ``n_routed_experts`` experts of
    ``moe_intermediate_size``, top ``num_experts_per_tok``, a bias-free fp32 ``h x E`` router, and
    ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts * moe_intermediate_size``;
    RMSNorm; untied by default. ``num_key_value_heads`` is not used by MLA (every head has its own
    key and value after ``kv_b_proj``): the spec's KV heads are the query heads.

    DeepSeek-V3's multi-token-prediction modules (``num_nextn_predict_layers``, 1; 14B, report
    arXiv:2412.19437 section 2.2, stored in the published checkpoint as layer 61; not part of the
    ``transformers`` model class) are read into ``mtp_num_layers``: trained, as DeepSeek and Megatron-Bridge's
    DeepSeek-V3 recipes train them, but not counted in the parameters (the report's 671B leaves them out).
    Not counted either: the router's ``e_score_correction_bias`` (a buffer, updated by the load balancer, not
    by gradients; report section 2.1.2). ``moe_layer_freq`` (read by the
    remote code, ignored by ``transformers``) must be 1, as in every published config.

    Defaults: V3 (DeepseekV3Config) 7168 wide, 128 heads, ranks 1536/512, 256 experts of 2048, top 8,
    1 shared, 3 dense layers of 18432; V2 (DeepseekV2Config) 4096 wide, 32 heads, 64 experts of 1407,
    2 shared, no dense layers, ``num_experts_per_tok`` required (no usable default).
    """
    if _flag(data, "attention_bias", False):
        raise SpecError(f"{source}: attention_bias: biases on MLA's q_a_proj, kv_a_proj_with_mqa and o_proj are "
                        "not modelled; the published DeepSeek configs set it false")
    if not v3 and _flag(data, "mlp_bias", False):
        raise SpecError(f"{source}: mlp_bias: biases on the dense and shared MLPs only (the routed experts have "
                        "none) are not modelled; the published DeepSeek-V2 configs set it false")
    freq = _get(data, source, "moe_layer_freq", default=1)
    if freq != 1:
        raise SpecError(f"{source}: moe_layer_freq: {freq} is not modelled (transformers' DeepSeek classes put "
                        "experts in every layer after first_k_dense_replace); set 1")
    d = {"hidden_size": 7168, "num_attention_heads": 128, "intermediate_size": 18432, "q_lora_rank": 1536,
         "n_routed_experts": 256, "moe_intermediate_size": 2048, "n_shared_experts": 1,
         "first_k_dense_replace": 3, "num_experts_per_tok": 8} if v3 else \
        {"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 11008, "q_lora_rank": 1536,
         "n_routed_experts": 64, "moe_intermediate_size": 1407, "n_shared_experts": 2,
         "first_k_dense_replace": 0, "num_experts_per_tok": ...}
    a = _get(data, source, "num_attention_heads")
    moe_ffn = _count(data, source, "moe_intermediate_size", default=d["moe_intermediate_size"], minimum=1)
    shared = _count(data, source, "n_shared_experts", default=d["n_shared_experts"])
    alias = ("n_routed_experts", "num_local_experts") if v3 else ("n_routed_experts", "num_experts")
    experts = _experts(data, source, alias, d["n_routed_experts"])
    if experts == 0:
        raise SpecError(f"{source}: n_routed_experts: 0 routed experts is not a model transformers can build")
    return {**_core(data, source), "name": _name(data, default_name), "num_kv_heads": a,
            "ffn_hidden_size": _count(data, source, "intermediate_size", default=d["intermediate_size"], minimum=1),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": _gate(data, source, "hidden_act", "silu"), "norm": "rmsnorm",
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "dropout": _dropout(data, "attention_dropout"),
            "q_lora_rank": data.get("q_lora_rank", d["q_lora_rank"]),  # an explicit null: a full q_proj
            "kv_lora_rank": _count(data, source, "kv_lora_rank", default=512, minimum=1),
            "qk_rope_head_dim": _count(data, source, "qk_rope_head_dim", default=64, minimum=1),
            "qk_nope_head_dim": _count(data, source, "qk_nope_head_dim", default=128, minimum=1),
            "v_head_dim": _count(data, source, "v_head_dim", default=128, minimum=1),
            "num_experts": experts,
            "top_k": _count(data, source, "num_experts_per_tok", default=d["num_experts_per_tok"], minimum=1),
            "moe_ffn_hidden_size": moe_ffn,
            "shared_expert_ffn_hidden_size": shared * moe_ffn if shared else None,
            "first_k_dense": _count(data, source, "first_k_dense_replace", default=d["first_k_dense_replace"]),
            "mtp_num_layers": _count(data, source, "num_nextn_predict_layers", default=0, minimum=0),
            # V3's router always limits to groups (defaults 8 / 4); V2's only with topk_method group_limited_greedy
            **_routing_groups(data, source, experts, 8 if v3 else None, 4 if v3 else None,
                              limited=v3 or data.get("topk_method", "greedy") == "group_limited_greedy")}


def _routing_groups(data: dict, source: str, experts: int, default_groups: int | None, default_topk: int | None,
                    limited: bool = True) -> dict:
    """Group-limited routing as ModelSpec fields (``router_num_groups``, ``router_group_topk``): ``n_group`` groups of
    consecutive experts, each token's experts drawn from ``topk_group`` of them (``DeepseekV3TopkRouter``,
    ``Glm4MoeTopkRouter``; DeepSeek-V2's router only with ``topk_method`` "group_limited_greedy"). One group, or a
    router that does not limit (``limited`` False), is no limit. ``n_group`` must divide the experts
    (the routers ``view`` the scores as ``[tokens, n_group, E / n_group]``)."""
    groups = _get(data, source, "n_group", default=default_groups)
    topk = _get(data, source, "topk_group", default=default_topk)
    if not limited or groups in (None, 1):
        return {}
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or experts % groups:
        raise SpecError(f"{source}: n_group: {groups!r} must be a whole number of groups dividing the {experts} "
                        "routed experts")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= groups:
        raise SpecError(f"{source}: topk_group: {topk!r} must be 1 to n_group ({groups})")
    return {"router_num_groups": groups, "router_group_topk": topk}


def _deepseek_v2(data: dict, source: str, default_name: str) -> dict:
    return _deepseek(data, source, default_name, v3=False)


def _deepseek_v3(data: dict, source: str, default_name: str) -> dict:
    return _deepseek(data, source, default_name, v3=True)


_deepseek_v2.__doc__ = _deepseek_v3.__doc__ = _deepseek.__doc__


def _gpt_oss(data: dict, source: str, default_name: str) -> dict:
    """GptOssForCausalLM (``modeling_gpt_oss.py``, GptOssConfig defaults; gpt-oss model card,
    arXiv:2508.10925 section 2): attention with biases on q/k/v/o (``attention_bias``, default true),
    ``head_dim`` default 64, 8 KV heads, and one learned sink logit per head (``sinks``); in every layer
    ``num_local_experts`` (default 128, alias ``num_experts``) gated experts of ``intermediate_size``
    (default 2880) with biases (``gate_up_proj_bias``, ``down_proj_bias``), top ``num_experts_per_tok``
    (default 4), a router with bias; RMSNorm; untied. The experts' clamped SwiGLU (``swiglu_limit``,
    ``swiglu_alpha``) has SwiGLU's three matrices; ``hidden_act`` is not used by the experts. ``swiglu_limit``
    (default 7.0) is kept: Megatron-Core clamps with eager kernels that cost time (``ModelSpec.swiglu_limit``).
    ``experts_per_token`` is OpenAI's own key for the same top-k; ``transformers`` reads
    ``num_experts_per_tok``. Sliding windows (``GptOssAttention.sliding_window`` is
    ``config.sliding_window`` in the ``"sliding_attention"`` layers of ``layer_types``): the window
    (default 128) and the count of windowed layers; ``layer_types`` absent: GptOssConfig's default,
    ``"sliding_attention"`` for even layer indices (``(i + 1) % 2``), i.e. ``ceil(L/2)`` layers. ``rope_scaling``
    (``rope_type`` yarn in the released configs) is kept as ``rope_scaling: yarn`` (:func:`_yarn`)."""
    attention_bias = _flag(data, "attention_bias", True)
    experts = _experts(data, source, ("num_local_experts", "num_experts"), 128)
    if experts == 0:
        raise SpecError(f"{source}: num_local_experts: 0 experts is not a model transformers can build")
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _kv_heads(data, 8),
            "head_dim": _get(data, source, "head_dim", default=64),
            "ffn_hidden_size": _count(data, source, "intermediate_size", default=2880, minimum=1),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": "swiglu", "norm": "rmsnorm", "tied_embeddings": _flag(data, "tie_word_embeddings", False),
            "position_embedding": "rope", "linear_bias": False, "qkv_bias": attention_bias,
            "out_proj_bias": attention_bias, "mlp_bias": True, "attention_sinks": True,
            "swiglu_limit": _get(data, source, "swiglu_limit", default=7.0), **_yarn(data),
            "dropout": _dropout(data, "attention_dropout"), "num_experts": experts,
            "top_k": _count(data, source, "num_experts_per_tok", default=4, minimum=1), "router_bias": True,
            **_gpt_oss_windows(data, source)}


def _olmoe(data: dict, source: str, default_name: str) -> dict:
    """OlmoeForCausalLM (``modeling_olmoe.py``, OlmoeConfig defaults; OLMoE, arXiv:2409.02060 section 2): the Llama
    pre-norm layer with RMSNorm ``q_norm`` over ``a*d_h`` and ``k_norm`` over ``g*d_h`` channels (qk_norm "full", as
    OLMo 2's), biases on q/k/v/o per ``attention_bias`` (default false), ``num_key_value_heads`` default the query
    heads; in every layer ``num_experts`` (default 64, alias ``num_local_experts``) SwiGLU experts of
    ``intermediate_size`` (default 2048), top ``num_experts_per_tok`` (default 8), a bias-free ``h x E`` router, no
    shared expert; untied by default. ``clip_qkv`` clamps activations (no parameters)."""
    fields = _llama(data, source, default_name, ffn_default=2048, kv_default=None)
    experts = _experts(data, source, ("num_experts", "num_local_experts"), 64)
    if experts == 0:
        raise SpecError(f"{source}: num_experts: 0 experts leaves OlmoeSparseMoeBlock without an MLP; "
                        "not a model plan3d (or OLMoE) describes")
    return fields | {"qk_norm": "full", "mlp_bias": False, "num_experts": experts,
                     "top_k": _count(data, source, "num_experts_per_tok", default=8, minimum=1)}


def _glm4_moe(data: dict, source: str, default_name: str) -> dict:
    """Glm4MoeForCausalLM (``modeling_glm4_moe.py``, Glm4MoeConfig defaults; GLM-4.5, arXiv:2508.06471, and the
    GLM-4.5-Air / 4.6 / 4.7 releases of the same class): grouped-query attention with biases on q/k/v only
    (``attention_bias``, default false; ``o_proj`` has none), ``head_dim`` default ``h // a`` (GLM-4.5 sets 128 with
    96 heads of a 5120-wide model), optional per-head RMSNorm ``q_norm``/``k_norm`` (``use_qk_norm``, default
    false: qk_norm "head"), 8 KV heads; ``first_k_dense_replace`` (default 1) dense SwiGLU layers of
    ``intermediate_size`` (default 10944), then in every layer ``n_routed_experts`` (default 128, alias
    ``num_local_experts``) SwiGLU experts of ``moe_intermediate_size`` (default 1408), top ``num_experts_per_tok``
    (default 8), a bias-free fp32 ``E x h`` router (its ``e_score_correction_bias`` is a buffer, as DeepSeek-V3's),
    and ``n_shared_experts`` (default 1) shared experts as one ungated MLP of ``n_shared_experts *
    moe_intermediate_size``; no MLP biases; RMSNorm; untied by default. ``partial_rotary_factor`` (default 0.5: RoPE
    on half of each head) is kept as ``rotary_percent`` (no parameters; Megatron's ``--rotary-percent``). The
    multi-token-prediction layers (``num_nextn_predict_layers``, alias ``num_mtp_layers``, default 1; stored in the
    published checkpoint after the last layer, not built by the ``transformers`` class) are read into
    ``mtp_num_layers``, as DeepSeek-V3's: trained with the model, not counted in its parameters."""
    fields = _llama(data, source, default_name, ffn_default=10944, kv_default=8)
    fields["rotary_percent"] = _get(data, source, "partial_rotary_factor", default=0.5)  # Glm4MoeConfig.__post_init__
    experts = _experts(data, source, ("n_routed_experts", "num_local_experts"), 128)
    if experts == 0:
        raise SpecError(f"{source}: n_routed_experts: 0 routed experts is not a model transformers can build")
    moe_ffn = _count(data, source, "moe_intermediate_size", default=1408, minimum=1)
    shared = _count(data, source, "n_shared_experts", default=1)
    return fields | {
        "out_proj_bias": False, "mlp_bias": False, "qk_norm": "head" if _flag(data, "use_qk_norm", False) else "none",
        "num_experts": experts, "top_k": _count(data, source, "num_experts_per_tok", default=8, minimum=1),
        "moe_ffn_hidden_size": moe_ffn, "shared_expert_ffn_hidden_size": shared * moe_ffn if shared else None,
        "first_k_dense": _count(data, source, "first_k_dense_replace", default=1),
        "mtp_num_layers": _count(data, source, "num_nextn_predict_layers", "num_mtp_layers", default=1),
        **_routing_groups(data, source, experts, 1, 1)}  # Glm4MoeConfig: n_group 1, topk_group 1 (GLM-4.5 too)


def _llama4(data: dict, source: str, default_name: str) -> dict:
    """Llama4ForCausalLM (``modeling_llama4.py``, Llama4TextConfig defaults; the language model of Llama 4 Scout and
    Maverick): Llama attention (``head_dim`` default 128, 8 KV heads, ``attention_bias`` on q/k/v/o, default false),
    two RMSNorms per layer, untied by default. A layer in ``moe_layers`` (default every ``interleave_moe_layer_step``-th
    from the ``step - 1``-th: Scout's step 1, every layer; Maverick's step 2, the odd layers) has
    ``num_local_experts`` (default 16) SwiGLU experts of ``intermediate_size`` (default 8192; ``gate_up_proj`` holds
    the gate and up matrices of ``Llama4TextExperts``), top ``num_experts_per_tok`` (default 1), a bias-free
    ``h x E`` router and one shared SwiGLU expert of ``intermediate_size``, ungated (``Llama4TextMoe``); the other
    layers a dense SwiGLU MLP of ``intermediate_size_mlp`` (default 16384). ``moe_layer_pattern`` holds the layout.

    The chunked attention of the RoPE layers is kept: ``attention_chunk_size`` (default 8192) as ``attention_chunk``,
    on the ``"chunked_attention"`` entries of ``layer_types``, or without it on the layers ``no_rope_layers`` marks
    1 (default: all but every ``no_rope_layer_interval``-th, 4), as ``Llama4TextConfig.__post_init__`` builds
    ``layer_types``. Read and ignored, as they hold no parameters: the query/key L2 norm (``use_qk_norm``:
    ``Llama4TextL2Norm`` has no weight; plan3d does not count its elementwise pass) and the attention temperature
    tuning. ``Llama4ForConditionalGeneration`` (the published checkpoints: a vision tower and projector too) is
    refused: its ``text_config`` is this config."""
    fields = _llama(data, source, default_name, ffn_default=16384, kv_default=8)
    layers = fields["num_layers"]
    experts = _experts(data, source, ("num_local_experts",), 16)
    if experts == 0:
        raise SpecError(f"{source}: num_local_experts: 0 experts is not a model Llama4TextMoe builds")
    step = _count(data, source, "interleave_moe_layer_step", default=1, minimum=1)
    moe = _get(data, source, "moe_layers", default=None)
    if moe is None:
        moe = list(range(step - 1, layers, step))
    if not isinstance(moe, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in moe):
        raise SpecError(f"{source}: moe_layers: expected a list of layer indices, got {moe!r}")
    pattern = [int(i in moe) for i in range(layers)]
    if not any(pattern):
        raise SpecError(f"{source}: moe_layers / interleave_moe_layer_step: no layer has experts")
    moe_ffn = _count(data, source, "intermediate_size", default=8192, minimum=1)
    return fields | _llama4_chunks(data, source, layers) | {
                     "ffn_hidden_size": _count(data, source, "intermediate_size_mlp", default=16384, minimum=1),
                     "head_dim": _get(data, source, "head_dim", default=128), "mlp_bias": False,
                     "num_experts": experts,
                     "top_k": _count(data, source, "num_experts_per_tok", default=1, minimum=1),
                     "moe_ffn_hidden_size": moe_ffn, "shared_expert_ffn_hidden_size": moe_ffn,
                     **moe_layer_fields(pattern)}


def _llama4_chunks(data: dict, source: str, layers: int) -> dict:
    """``attention_chunk`` / ``chunked_layers`` of a Llama 4 text config (:func:`_llama4`)."""
    chunk = data.get("attention_chunk_size", 8192)
    if chunk is None:
        return {}
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise SpecError(f"{source}: attention_chunk_size: expected a positive whole number of tokens, got {chunk!r}")
    types = data.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise SpecError(f"{source}: layer_types: expected one entry per layer ({layers}), got {types!r}")
        chunked = sum(t == "chunked_attention" for t in types)
    else:
        interval = _count(data, source, "no_rope_layer_interval", default=4, minimum=1)
        rope = data.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        if not isinstance(rope, list) or len(rope) != layers:
            raise SpecError(f"{source}: no_rope_layers: expected one 0/1 entry per layer ({layers}), got {rope!r}")
        chunked = sum(bool(x) for x in rope)
    return {"attention_chunk": chunk, "chunked_layers": chunked} if chunked else {}


def _yarn(data: dict) -> dict:
    """``rope_scaling: "yarn"`` where the config's ``rope_scaling`` names YaRN (``rope_type``, or the older ``type``
    key); nothing where it is absent or another scaling."""
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "yarn":
        return {"rope_scaling": "yarn"}
    return {}


def _gpt_oss_windows(data: dict, source: str) -> dict:
    """``sliding_window`` and ``sliding_window_layers`` of a GPT-OSS config (see :func:`_gpt_oss`); a null
    window is full attention in every layer (``GptOssAttention`` passes ``sliding_window=None``)."""
    return _layer_windows(data, source, 128, lambda layers: (layers + 1) // 2)


def _layer_windows(data: dict, source: str, window_default: int, windowed_default: Callable[[int], int]) -> dict:
    """``sliding_window`` and ``sliding_window_layers`` from ``sliding_window`` and ``layer_types`` (its
    ``"sliding_attention"`` entries), or, without ``layer_types``, ``windowed_default(num_hidden_layers)``
    windowed layers (the configuration class's own default pattern)."""
    layers = _get(data, source, "num_hidden_layers")
    window = data.get("sliding_window", window_default)
    if window is None:
        return {}
    window = _count(data, source, "sliding_window", default=window_default, minimum=1)
    types = data.get("layer_types")
    if types is None:
        if isinstance(layers, bool) or not isinstance(layers, int):
            return {"sliding_window": window}  # ModelSpec refuses num_layers with its own line
        return {"sliding_window": window, "sliding_window_layers": windowed_default(layers)}
    known = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or not all(t in known for t in types):
        raise SpecError(f"{source}: layer_types: expected a list of {' / '.join(known)}, got {types!r}")
    if len(types) != layers:
        raise SpecError(f"{source}: layer_types: {len(types)} entries for num_hidden_layers {layers}")
    return {"sliding_window": window, "sliding_window_layers": types.count("sliding_attention")}


READERS: dict[str, Callable[[dict, str, str], dict]] = {
    "LlamaForCausalLM": _llama, "MistralForCausalLM": _mistral, "Qwen2ForCausalLM": _qwen2,
    "Gemma2ForCausalLM": _gemma2, "Gemma3ForCausalLM": _gemma3, "Phi3ForCausalLM": _phi3, "FalconForCausalLM": _falcon,
    "Olmo2ForCausalLM": _olmo2, "GPT2LMHeadModel": _gpt2, "GPTNeoXForCausalLM": _gpt_neox,
    "Qwen3ForCausalLM": _qwen3, "MixtralForCausalLM": _mixtral, "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe, "DeepseekV2ForCausalLM": _deepseek_v2,
    "DeepseekV3ForCausalLM": _deepseek_v3, "GptOssForCausalLM": _gpt_oss, "Glm4MoeForCausalLM": _glm4_moe,
    "OlmoeForCausalLM": _olmoe, "Llama4ForCausalLM": _llama4, "NemotronForCausalLM": _nemotron,
    "Olmo3ForCausalLM": _olmo3,
    "GemmaForCausalLM": _gemma, "GraniteForCausalLM": _granite, "SmolLM3ForCausalLM": _smollm3,
    "Starcoder2ForCausalLM": _starcoder2, "StableLmForCausalLM": _stablelm, "GPTBigCodeForCausalLM": _gpt_bigcode,
    "BloomForCausalLM": _bloom, "PhiForCausalLM": _phi, "GPTJForCausalLM": _gptj, "CohereForCausalLM": _cohere,
    "MptForCausalLM": _mpt, "MPTForCausalLM": _mpt,
    "GlmForCausalLM": _glm, "Glm4ForCausalLM": _glm4, "SeedOssForCausalLM": _seed_oss,
    "Exaone4ForCausalLM": _exaone4,
}
#: Readers of mixture-of-experts classes: expert-count keys are theirs to read, not a reason to refuse.
MOE_READERS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
               "DeepseekV3ForCausalLM", "GptOssForCausalLM", "Glm4MoeForCausalLM", "OlmoeForCausalLM",
               "Llama4ForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "falcon": "FalconForCausalLM",
               "olmo2": "Olmo2ForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
               "olmoe": "OlmoeForCausalLM", "llama4_text": "Llama4ForCausalLM", "nemotron": "NemotronForCausalLM",
               "olmo3": "Olmo3ForCausalLM",
               "gemma": "GemmaForCausalLM", "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM",
               "starcoder2": "Starcoder2ForCausalLM", "stablelm": "StableLmForCausalLM",
               "gpt_bigcode": "GPTBigCodeForCausalLM",
               "bloom": "BloomForCausalLM", "phi": "PhiForCausalLM", "gptj": "GPTJForCausalLM",
               "cohere": "CohereForCausalLM", "mpt": "MptForCausalLM", "glm": "GlmForCausalLM",
               "glm4": "Glm4ForCausalLM", "seed_oss": "SeedOssForCausalLM", "exaone4": "Exaone4ForCausalLM"}


# --- dispatch and refusals ----------------------------------------------------------------------

def architecture(data: dict, source: str) -> tuple[str, str]:
    """(class name, the key it was read from): ``architectures``, else ``model_type``, else GPT-2 keys."""
    archs = data.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not all(isinstance(x, str) for x in archs):
            raise SpecError(f"{source}: architectures: expected a list of class names, got {archs!r}")
        if len(set(archs)) > 1:
            raise SpecError(f"{source}: architectures: several classes {archs}; keep the causal-LM one")
        return archs[0], "architectures"
    mtype = data.get("model_type")
    if isinstance(mtype, str) and mtype:
        return MODEL_TYPES.get(mtype, mtype), "model_type"
    if "n_embd" in data:
        return "GPT2LMHeadModel", "n_embd"
    raise SpecError(f"{source}: architectures: missing, and no model_type; add e.g. "
                    "\"architectures\": [\"LlamaForCausalLM\"]")


def refusal(data: dict, arch: str) -> tuple[str, str] | None:
    """(field, reason) when the config describes something plan3d does not model, else None."""
    name = arch.lower().replace("_", "")
    if arch not in MOE_READERS:
        for key in MOE_EXPERT_KEYS:
            n = data.get(key)
            if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 1:
                return key, f"{n} experts in {arch}: {MOE_MESSAGE}"
        if "moe" in name or name.startswith(("mixtral", "deepseek", "dbrx", "arctic", "grok", "gptoss")):
            return "architectures", f"{arch}: {MOE_MESSAGE}"
    if any(part in name for part in SSM_NAME_PARTS):
        return "architectures", f"{arch}: {SSM_MESSAGE}"
    for key in SSM_KEYS:
        if data.get(key) is not None:
            return key, SSM_MESSAGE
    if arch == "Gemma3ForConditionalGeneration" or data.get("model_type") == "gemma3":
        return "architectures", ("Gemma3ForConditionalGeneration carries a SigLIP vision tower, which is not modelled; "
                                 "for the language model alone, save its text_config as a config.json "
                                 "(\"architectures\": [\"Gemma3ForCausalLM\"])")
    if arch == "Llama4ForConditionalGeneration" or data.get("model_type") == "llama4":
        return "architectures", ("Llama4ForConditionalGeneration carries a vision tower and projector, which are not "
                                 "modelled; for the language model alone, save its text_config as a config.json "
                                 "(\"architectures\": [\"Llama4ForCausalLM\"])")
    if arch == "RWForCausalLM":
        return "architectures", ("RWForCausalLM is Falcon's remote-code class; use the config.json of the current "
                                 "Hub revision (FalconForCausalLM)")
    return None


def hf_fields(data: dict, default_name: str, source: str) -> dict:
    """ModelSpec fields for a Hugging Face ``config.json``, or a SpecError naming what is not modelled."""
    arch, key = architecture(data, source)
    refused = refusal(data, arch)
    if refused:
        raise SpecError(f"{source}: {refused[0]}: {refused[1]}")
    if arch not in READERS:
        raise SpecError(f"{source}: {key}: {arch} is not modelled; plan3d reads {', '.join(READERS)} "
                        "(or write a model spec YAML, see docs/specs.md)")
    return READERS[arch](data, source, default_name)
