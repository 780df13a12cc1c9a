"""Hugging Face ``config.json`` import: read exactly, or refused with one line naming the field.

Each supported architecture has a reader that maps the keys its ``transformers`` configuration
class reads to ModelSpec fields, using that class's defaults for absent keys (``None`` counts as
absent, as in ``transformers``), and the module structure of its ``modeling_*.py``: which linear
layers carry biases, how many norms a layer has and where, whether the output layer is tied. The
architecture is taken from ``architectures`` (else ``model_type``). Anything the estimator does
not model is refused: mixture-of-experts, state-space and hybrid layers, unknown architectures,
and options that change the structure in ways the spec cannot express.

The core sizes (layers, width, heads, vocabulary) are required even where ``transformers`` has a
default: a config without them is not a published model. Read and deliberately ignored, because
they change neither parameters nor saved activations: RoPE settings, sliding windows (the
attention FLOPs are counted over the whole causal window, an over-estimate), initialisation and
generation settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.presets import SpecError

MOE_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
MOE_MESSAGE = "mixture-of-experts is not modelled yet; plan3d estimates dense models only"
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
    MistralForCausalLM has the same modules without biases (``modeling_mistral.py``)."""
    attention_bias = _flag(data, "attention_bias", False)
    return {**_core(data, source), "name": _name(data, default_name),
            "num_kv_heads": _get(data, source, "num_key_value_heads", default=kv_default),
            "head_dim": _get(data, source, "head_dim", default=None),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=ffn_default),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": _gate(data, source, "hidden_act", "silu"), "norm": "rmsnorm",
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias,
            "mlp_bias": _flag(data, "mlp_bias", False), "dropout": _dropout(data, "attention_dropout")}


def _mistral(data: dict, source: str, default_name: str) -> dict:
    """MistralForCausalLM: MistralConfig defaults (``intermediate_size`` 14336, 8 KV heads), no biases."""
    fields = _llama(data, source, default_name, ffn_default=14336, kv_default=8)
    return fields | {"qkv_bias": False, "out_proj_bias": False, "mlp_bias": False}


def _qwen2(data: dict, source: str, default_name: str) -> dict:
    """Qwen2ForCausalLM (``modeling_qwen2.py``): biases on q/k/v only (``o_proj`` and the MLP have none);
    Qwen2Config defaults ``intermediate_size`` 22016, 32 KV heads, untied (Qwen2.5-0.5B sets it tied)."""
    fields = _llama(data, source, default_name, ffn_default=22016, kv_default=32)
    return fields | {"qkv_bias": True, "out_proj_bias": False, "mlp_bias": False}


def _gemma2(data: dict, source: str, default_name: str) -> dict:
    """Gemma2ForCausalLM (``modeling_gemma2.py``): GeGLU MLP (``hidden_activation``), four RMSNorms per
    layer (input, post-attention, pre- and post-feedforward), ``head_dim`` default 256 (not ``h // a``),
    tied by default, attention and final-logit soft-capping (Gemma 2 report, arXiv:2408.00118, 2.2)."""
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
            "dropout": _dropout(data, "attention_dropout")}


def _phi3(data: dict, source: str, default_name: str) -> dict:
    """Phi3ForCausalLM (``modeling_phi3.py``): fused ``qkv_proj`` (``a*d_h + 2*g*d_h`` outputs) and fused
    ``gate_up_proj`` (``2f``): the same parameters as separate matrices; no biases; RMSNorm; untied."""
    fields = _llama(data, source, default_name, ffn_default=8192)
    return fields | {"qkv_bias": False, "out_proj_bias": False, "mlp_bias": False,
                     "dropout": _dropout(data, "attention_dropout", "resid_pdrop", "embd_pdrop")}


def _olmo2(data: dict, source: str, default_name: str) -> dict:
    """Olmo2ForCausalLM (``modeling_olmo2.py``): RMSNorm on the attention and MLP outputs before the
    residual add (no input norm), RMSNorm ``q_norm`` over ``a*d_h`` and ``k_norm`` over ``g*d_h``
    channels (OLMo 2 report, arXiv:2501.00656, section 3.1), biases per ``attention_bias``, untied."""
    return _llama(data, source, default_name) | {"norm_placement": "post", "qk_norm": "full"}


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
    parallel residual (``use_parallel_residual``, default true), untied ``embed_out``, rotary."""
    attention_bias = _flag(data, "attention_bias", True)
    return {**_core(data, source), "name": _name(data, default_name),
            "ffn_hidden_size": _get(data, source, "intermediate_size", default=24576),
            "max_seq_len": _get(data, source, "max_position_embeddings", default=None),
            "activation": "gelu", "norm": "layernorm",
            "parallel_attention": _flag(data, "use_parallel_residual", True),
            "tied_embeddings": _flag(data, "tie_word_embeddings", False), "position_embedding": "rope",
            "linear_bias": False, "qkv_bias": attention_bias, "out_proj_bias": attention_bias, "mlp_bias": True,
            "dropout": _dropout(data, "hidden_dropout", "attention_dropout")}


READERS: dict[str, Callable[[dict, str, str], dict]] = {
    "LlamaForCausalLM": _llama, "MistralForCausalLM": _mistral, "Qwen2ForCausalLM": _qwen2,
    "Gemma2ForCausalLM": _gemma2, "Phi3ForCausalLM": _phi3, "FalconForCausalLM": _falcon,
    "Olmo2ForCausalLM": _olmo2, "GPT2LMHeadModel": _gpt2, "GPTNeoXForCausalLM": _gpt_neox,
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM", "falcon": "FalconForCausalLM",
               "olmo2": "Olmo2ForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM"}


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
    for key in MOE_EXPERT_KEYS:
        n = data.get(key)
        if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 1:
            return key, f"{n} experts: {MOE_MESSAGE}"
    name = arch.lower().replace("_", "")
    if "moe" in name or name.startswith(("mixtral", "deepseekv2", "deepseekv3", "dbrx", "arctic", "grok")):
        return "architectures", f"{arch}: {MOE_MESSAGE}"
    if any(part in name for part in SSM_NAME_PARTS):
        return "architectures", f"{arch}: {SSM_MESSAGE}"
    for key in SSM_KEYS:
        if data.get(key) is not None:
            return key, SSM_MESSAGE
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
