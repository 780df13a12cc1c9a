"""The three input specs (model, hardware, training) and the output plan.

Units and prefixes (one convention, used everywhere):

* memory in GiB (2**30 bytes) in spec fields (``_gib``), bytes (``_bytes``) inside formulas;
* bandwidth in GB/s (10**9 bytes/s) (``_gbps``); compute in TFLOP/s (10**12) (``_tflops``);
* latency in microseconds (``_us``); time in seconds (``_s``).

Conversions to base units happen once, in properties of the spec (``*_bytes``, ``*_flops``,
``*_bytes_per_s``), never inside formulas.

Glossary:

* **layer**: one transformer block (attention + MLP). **stage**: the layers one pipeline rank holds;
  with interleaving (``vpp > 1``) a stage is split into ``vpp`` **chunks** (virtual stages).
* **micro-batch**: ``micro_batch_size`` sequences that go through the pipeline together;
  **global batch**: all sequences of one optimizer step, over all data-parallel replicas.
* **axis**: one parallel dimension (tp, cp, dp, pp); its **degree** is its size.

Short names (``tp``, ``pp``, ``dp``, ``cp``, ``vpp``) are used in all working code; the long
names of a target framework appear only in ``planner/emit``.
"""

from __future__ import annotations

import functools
import math
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from planner.errors import MAX_COUNT, MAX_GPUS

GIB = 2**30

Activation = Literal["gelu", "swiglu", "geglu", "squared_relu"]
Norm = Literal["layernorm", "rmsnorm"]
NormPlacement = Literal["pre", "post", "sandwich"]
QKNorm = Literal["none", "head", "full"]
PositionEmbedding = Literal["learned", "rope", "alibi"]
Precision = Literal["bf16", "fp8", "mxfp8", "nvfp4", "fp32"]
#: Block-scaled formats (OCP MX and NVIDIA NVFP4): Blackwell (sm_100) tensor cores only.
BLOCK_SCALED = ("mxfp8", "nvfp4")
Recompute = Literal["none", "selective", "full"]
# Megatron-Core core_v0.16.1 TransformerConfig.recompute_modules choices (TrainingSpec.recompute_modules)
RecomputeModule = Literal["core_attn", "mla_up_proj", "mlp", "moe_act", "moe", "shared_experts", "layernorm"]
RECOMPUTE_MODULES: tuple[str, ...] = typing.get_args(RecomputeModule)
AttentionKernel = Literal["flash", "flash2", "materialized"]
KeptOutputs = Literal["none", "last", "all"]
#: the attention kernels that store no s x s scores (TrainingSpec.attention)
FLASH_ATTENTION: tuple[str, ...] = ("flash", "flash2")
#: the MoE token dispatchers that are Megatron-Core's flex dispatcher (``--moe-token-dispatcher-type flex``) with one of
#: its two backends (``--moe-flex-dispatcher-backend``, core_v0.16.1 ``TransformerConfig.moe_flex_dispatcher_backend``)
FLEX_DISPATCHERS: tuple[str, ...] = ("deepep", "hybridep")


class _Spec(BaseModel):
    # allow_inf_nan=False: ``.inf`` or ``.nan`` in a YAML profile is refused, not carried into the arithmetic.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)


def _problems(errors: list[str]) -> None:
    """Raise one ValueError carrying every problem found, one per line."""
    if errors:
        raise ValueError("\n".join(errors))


class ModelSpec(_Spec):
    """A decoder-only transformer (GPT / Llama family), as Megatron-LM builds it."""

    name: str = Field(min_length=1, description="Short name, used in output file names.")
    num_layers: int = Field(ge=1, description="Transformer layers (L).")
    hidden_size: int = Field(ge=1, description="Model width (h).")
    num_attention_heads: int = Field(ge=1, description="Query heads (a).")
    num_kv_heads: int | None = Field(
        default=None, ge=1,
        description="Key/value heads (g). Default: equal to num_attention_heads (MHA); fewer = GQA.")
    head_dim: int | None = Field(
        default=None, ge=1, description="Width of one head (d_h). Default: hidden_size / num_attention_heads.")
    ffn_hidden_size: int | None = Field(
        default=None, ge=1,
        description="MLP intermediate width per branch (f). Default: 4 * hidden_size.")
    vocab_size: int = Field(ge=1, description="Vocabulary size (V), before padding.")
    max_seq_len: int | None = Field(
        default=None, ge=1, description="Longest sequence the model supports; required for learned positions.")
    activation: Activation = Field(
        default="gelu",
        description="MLP type: gelu (2 matrices, any non-gated activation), squared_relu (2 matrices, ReLU squared: "
                    "Nemotron-4, Megatron --squared-relu; saves as GeLU does) or a gated unit with 3 matrices: "
                    "swiglu (SiLU gate, Llama) or geglu (GeLU gate, Gemma).")
    norm: Norm = Field(default="layernorm", description="layernorm (weight + bias) or rmsnorm (weight only).")
    norm_placement: NormPlacement = Field(
        default="pre",
        description="pre: a norm before attention and before the MLP (GPT-2, Llama); post: a norm on the "
                    "attention and MLP outputs, before the residual add (OLMo-2); sandwich: both, 4 per layer "
                    "(Gemma-2).")
    parallel_attention: bool = Field(
        default=False,
        description="Attention and MLP both read the layer input and their outputs are added (GPT-J, "
                    "GPT-NeoX use_parallel_residual, Falcon parallel_attn).")
    shared_input_norm: bool = Field(
        default=False,
        description="With parallel_attention: one input norm feeds both attention and MLP (Falcon-7B); "
                    "default two (GPT-NeoX, Falcon-40B).")
    qk_norm: QKNorm = Field(
        default="none",
        description="Norm on queries and keys before attention: head (one d_h-wide norm each, shared by the "
                    "heads; Megatron --qk-layernorm) or full (over all a*d_h and g*d_h channels; OLMo-2).")
    attn_logit_softcap: float | None = Field(
        default=None, gt=0,
        description="Attention scores soft-capped as cap * tanh(x / cap) (Gemma-2). No parameters; stores one "
                    "more s x s tensor when attention is materialized.")
    final_logit_softcap: float | None = Field(
        default=None, gt=0,
        description="Output logits soft-capped as cap * tanh(x / cap) (Gemma-2). No parameters; stores the "
                    "tanh output of the logits.")
    tied_embeddings: bool = Field(default=False, description="Output layer shares the input embedding matrix.")
    position_embedding: PositionEmbedding = Field(
        default="rope", description="learned (max_seq_len x h table), rope or alibi (no parameters).")
    rope_scaling: Literal["yarn"] | None = Field(
        default=None,
        description="RoPE frequency scaling of the Hugging Face config (rope_scaling.rope_type; GPT-OSS 'yarn'). "
                    "No parameters; Megatron-Bridge runs a YaRN model's RoPE unfused (planner.cost).")
    rotary_percent: float = Field(
        default=1.0, gt=0, le=1,
        description="Share of each head's dimensions that RoPE rotates (Hugging Face partial_rotary_factor, GPT-NeoX "
                    "rotary_pct; Megatron --rotary-percent, written to its launch files). No parameters.")
    linear_bias: bool = Field(default=False, description="Linear layers carry biases (GPT-2/3 style).")
    qkv_bias: bool | None = Field(
        default=None, description="Bias on the Q/K/V projection (Qwen2: only there). Default: same as linear_bias.")
    out_proj_bias: bool | None = Field(
        default=None, description="Bias on the attention output projection. Default: same as linear_bias.")
    mlp_bias: bool | None = Field(
        default=None, description="Biases on the MLP matrices. Default: same as linear_bias.")
    embedding_norm: bool = Field(default=False, description="A norm right after the word embedding (BLOOM).")
    norm_bias: bool | None = Field(
        default=None,
        description="With norm 'layernorm': whether each LayerNorm has a bias (beta). Default: it has (GPT-2, BLOOM, "
                    "Megatron's LayerNorm). False: weight only (MPT's no_bias, Cohere); the norm still centres, so "
                    "it saves the mean as LayerNorm does. RMSNorm has none either way.")
    output_bias: bool = Field(
        default=False,
        description="The output layer (LM head) has a bias of vocab_size, split over TP with its rows (Phi-1/1.5/2, "
                    "GPT-J). Tied or not, the bias is its own parameter.")
    dropout: bool = Field(
        default=False,
        description="Dropout active in training (stores 1-byte masks). Not given: on for learned-position (GPT-2/3 "
                    "style) models, off otherwise; see ModelSpec._dropout_default.")
    swiglu_limit: float | None = Field(
        default=None, gt=0,
        description="Clamp of the gated activation's inputs (GPT-OSS ``swiglu_limit``: gate <= limit, linear in "
                    "[-limit, limit]); Megatron-Core runs it as eager clamp and cat kernels before the fused "
                    "activation (``fused_bias_geglu.weighted_bias_quick_geglu_impl``), costed in MoE experts.")
    attention_sinks: bool = Field(
        default=False,
        description="One learned sink logit per query head and layer (GPT-OSS ``sinks``; Xiao et al. 2023).")
    sliding_window: int | None = Field(
        default=None, ge=1,
        description="Keys a query attends to in a windowed layer, itself included (Hugging Face semantics: "
                    "transformers masking_utils.sliding_window_overlay keeps kv_idx > q_idx - sliding_window; "
                    "GPT-OSS 128). None: every layer attends over the full causal window.")
    sliding_window_layers: int | None = Field(
        default=None, ge=0,
        description="How many layers are windowed (GPT-OSS: the 'sliding_attention' entries of layer_types, "
                    "every other layer starting with the first). Default with sliding_window: all layers "
                    "(Mistral-7B v0.1). Only the count matters: the estimator averages attention over the layers.")
    attention_chunk: int | None = Field(
        default=None, ge=1,
        description="Chunked attention (Llama 4's attention_chunk_size, 8192): a chunked layer's queries attend "
                    "causally within their own block of this many tokens only. None: no chunked layer.")
    chunked_layers: int | None = Field(
        default=None, ge=0,
        description="How many layers are chunked (Llama 4: the 'chunked_attention' entries of layer_types, the "
                    "layers with RoPE, 3 of every 4). Default with attention_chunk: all layers. As for windows, only "
                    "the count matters.")
    # --- mixture of experts (Megatron-Core ``--num-experts`` ...; docs/moe.md) ---------------------
    num_experts: int | None = Field(
        default=None, ge=2, le=65536,
        description="Routed experts per MoE layer (E; Megatron --num-experts). None: a dense model.")
    top_k: int = Field(
        default=2, ge=1, description="Experts each token is routed to (k; Megatron --moe-router-topk, default 2).")
    moe_ffn_hidden_size: int | None = Field(
        default=None, ge=1,
        description="Intermediate width of one routed expert (Megatron --moe-ffn-hidden-size). Default: ffn_hidden_size.")
    shared_expert_ffn_hidden_size: int | None = Field(
        default=None, ge=1,
        description="Total intermediate width of the shared experts every token goes through (Megatron "
                    "--moe-shared-expert-intermediate-size; DeepSeek: n_shared_experts * moe_intermediate_size). "
                    "None: no shared expert.")
    shared_expert_gate: bool = Field(
        default=False, description="A sigmoid gate (h -> 1 linear) scales the shared expert (Qwen2-MoE; "
                                   "Megatron --moe-shared-expert-gate).")
    first_k_dense: int = Field(
        default=0, ge=0,
        description="The first k layers have a dense MLP of ffn_hidden_size instead of experts (DeepSeek "
                    "first_k_dense_replace; Megatron --moe-layer-freq '([0]*k+[1]*(L-k))').")
    moe_layer_pattern: tuple[Literal[0, 1], ...] | None = Field(
        default=None,
        description="Which layers have experts, one entry per layer, 1 = MoE, 0 = a dense MLP of ffn_hidden_size "
                    "(Megatron --moe-layer-freq in its list form, e.g. '[0,1,0,1]'; Qwen2/3-MoE decoder_sparse_step "
                    "and mlp_only_layers; Llama-4's interleave_moe_layer_step). None: MoE in every layer after the "
                    "first_k_dense. Set it or first_k_dense, not both.")
    router_bias: bool = Field(default=False, description="The router linear layer has a bias (GPT-OSS).")
    router_num_groups: int | None = Field(
        default=None, ge=2,
        description="Group-limited routing: the experts split into this many equal groups of consecutive experts and "
                    "each token's top-k drawn from router_group_topk of them (DeepSeek-V3 n_group 8: node-limited "
                    "routing, arXiv:2412.19437 section 2.1.2; Megatron --moe-router-num-groups). Changes no "
                    "parameter; bounds the nodes DeepEP sends a token to (planner.cost.deepep_time_s). None: no "
                    "group limit.")
    router_group_topk: int | None = Field(
        default=None, ge=1,
        description="Groups each token may use under router_num_groups (DeepSeek-V3 topk_group 4: at most 4 of "
                    "8 nodes; Megatron --moe-router-group-topk).")
    mtp_num_layers: int = Field(
        default=0, ge=0, le=8,
        description="Multi-token-prediction modules trained on the last pipeline stage (DeepSeek-V3 "
                    "num_nextn_predict_layers 1, arXiv:2412.19437 section 2.2; Megatron --mtp-num-layers). Each is "
                    "one more layer of the last layer's kind, a 2h -> h projection, three norms and a second pass "
                    "of the output layer and loss; not counted in num_parameters (DeepSeek's 671B leaves its 14B "
                    "out), counted in memory, step time and model FLOPs (planner.memory, planner.cost, "
                    "planner.flops). Megatron-LM and NeMo only.")
    router_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32", description="Precision of the router logits and probabilities (Megatron --moe-router-dtype).")
    capacity_factor: float | None = Field(
        default=None, gt=0,
        description="Expert capacity as a multiple of the even share (Megatron --moe-expert-capacity-factor; "
                    "tokens over capacity are dropped). None: dropless (Megatron's default).")
    # --- multi-head latent attention (DeepSeek-V2 arXiv:2405.04434 section 2.1) -------------------
    q_lora_rank: int | None = Field(
        default=None, ge=1, description="MLA: rank of the query down-projection (None: a full q projection).")
    kv_lora_rank: int | None = Field(
        default=None, ge=1, description="MLA: rank of the joint key/value compression; set = MLA attention.")
    qk_rope_head_dim: int | None = Field(default=None, ge=1, description="MLA: rotary part of a query/key head.")
    qk_nope_head_dim: int | None = Field(default=None, ge=1, description="MLA: non-rotary part of a query/key head.")
    v_head_dim: int | None = Field(default=None, ge=1, description="MLA: width of one value head.")

    @model_validator(mode="before")
    @classmethod
    def _dropout_default(cls, data):
        """A spec that does not say gets the dropout its architecture family is trained with: 0.1 for
        learned-position (GPT-2/3 style) models, none for RoPE and ALiBi models.

        Sources: Megatron-LM's own defaults are ``--attention-dropout 0.1 --hidden-dropout 0.1``
        (``megatron/training/arguments.py``; ``planner.readers.megatron`` reads a launch that omits them the same
        way); NVIDIA's GPT-3 configs keep them (NeMo-Framework-Launcher ``conf/training/gpt3/175b.yaml``:
        ``hidden_dropout: 0.1``), as do GPT-2's and OPT's Hugging Face configs (``resid_pdrop``/``dropout`` 0.1).
        The RoPE families' Hugging Face configs set it to 0 (Llama, Mistral, Qwen ``attention_dropout`` 0.0;
        GPT-J ``resid_pdrop`` 0.0). An explicit ``dropout`` always wins; Hugging Face import reads it from the
        config (``planner.hf``)."""
        if isinstance(data, dict) and data.get("dropout") is None:
            data = {**data, "dropout": data.get("position_embedding") == "learned"}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        a, g, h = self.num_attention_heads, self.kv_heads, self.hidden_size
        errors = []
        mla = (self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim)
        if any(x is not None for x in mla) and any(x is None for x in mla):
            errors.append("kv_lora_rank: MLA needs kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim and v_head_dim "
                          "together")
        if self.q_lora_rank is not None and self.kv_lora_rank is None:
            errors.append("q_lora_rank: applies to MLA only; set kv_lora_rank and the MLA head widths")
        if self.is_moe:
            if self.top_k > self.num_experts:
                errors.append(f"top_k: {self.top_k} > num_experts({self.num_experts})")
            if self.first_k_dense >= self.num_layers:
                errors.append(f"first_k_dense: {self.first_k_dense} leaves no MoE layer of num_layers({self.num_layers})")
            pattern = self.moe_layer_pattern
            if pattern is not None:
                if len(pattern) != self.num_layers:
                    errors.append(f"moe_layer_pattern: {len(pattern)} entries for num_layers({self.num_layers}); "
                                  "give one 0 (dense) or 1 (MoE) per layer")
                elif not any(pattern):
                    errors.append("moe_layer_pattern: no layer has experts; mark at least one layer 1, or drop "
                                  "num_experts for a dense model")
                if self.first_k_dense:
                    errors.append("first_k_dense: give the dense layers in moe_layer_pattern (its leading 0s) or "
                                  "first_k_dense, not both")
            groups, group_topk = self.router_num_groups, self.router_group_topk
            if (groups is None) != (group_topk is None):
                errors.append("router_num_groups: group-limited routing needs router_num_groups and "
                              "router_group_topk together (Megatron: 'moe_router_num_groups must be specified')")
            elif groups is not None:
                if self.num_experts % groups:
                    errors.append(f"router_num_groups: {groups} does not divide num_experts({self.num_experts}) "
                                  "(Megatron asserts it)")
                if group_topk > groups:
                    errors.append(f"router_group_topk: {group_topk} > router_num_groups({groups})")
        else:
            moe_only = {"moe_ffn_hidden_size": self.moe_ffn_hidden_size is not None,
                        "shared_expert_ffn_hidden_size": self.shared_expert_ffn_hidden_size is not None,
                        "shared_expert_gate": self.shared_expert_gate, "first_k_dense": self.first_k_dense > 0,
                        "moe_layer_pattern": self.moe_layer_pattern is not None,
                        "router_num_groups": self.router_num_groups is not None,
                        "router_group_topk": self.router_group_topk is not None, "router_bias": self.router_bias, "capacity_factor": self.capacity_factor is not None}
            errors += [f"{k}: applies to MoE models only; set num_experts or remove it" for k, v in moe_only.items() if v]
        if self.sliding_window_layers is not None:
            if self.sliding_window is None:
                errors.append("sliding_window_layers: needs sliding_window (the window those layers use)")
            elif self.sliding_window_layers > self.num_layers:
                errors.append(f"sliding_window_layers: {self.sliding_window_layers} > num_layers({self.num_layers})")
        if self.chunked_layers is not None:
            if self.attention_chunk is None:
                errors.append("chunked_layers: needs attention_chunk (the chunk those layers attend within)")
            elif self.chunked_layers + self.windowed_layers > self.num_layers:
                errors.append(f"chunked_layers: {self.chunked_layers} chunked and {self.windowed_layers} windowed "
                              f"layers > num_layers({self.num_layers})")
        elif self.attention_chunk is not None and self.windowed_layers:
            errors.append("chunked_layers: a model with sliding-window layers says how many layers are chunked")
        if self.shared_expert_gate and self.shared_expert_ffn_hidden_size is None:
            errors.append("shared_expert_gate: needs shared_expert_ffn_hidden_size")
        if self.rotary_percent != 1 and (self.position_embedding != "rope" or mla[0] is not None):
            errors.append(f"rotary_percent: {self.rotary_percent} applies to rope position embeddings outside MLA "
                          "(MLA's rotary part is qk_rope_head_dim); remove it")
        if self.head_dim is None and h % a:
            errors.append(f"hidden_size({h}) is not divisible by num_attention_heads({a}); set head_dim")
        if a % g:
            errors.append(f"num_attention_heads({a}) is not divisible by num_kv_heads({g})")
        if self.position_embedding == "learned" and self.max_seq_len is None:
            errors.append("max_seq_len: required when position_embedding is 'learned'")
        if self.shared_input_norm and not self.parallel_attention:
            errors.append("shared_input_norm: needs parallel_attention (one norm can feed both only in parallel)")
        if self.norm_bias and self.norm == "rmsnorm":
            errors.append("norm_bias: RMSNorm has no bias; remove norm_bias or use norm 'layernorm'")
        if self.parallel_attention and self.norm_placement != "pre":
            errors.append(f"parallel_attention: modelled with norm_placement 'pre' only, got '{self.norm_placement}'")
        _problems(errors)
        return self

    # --- derived sizes (Megatron names in comments) ---------------------------------------
    @property
    def kv_heads(self) -> int:
        """g: key/value heads (Megatron ``num_query_groups``)."""
        return self.num_kv_heads or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """d_h: width of one head (Megatron ``kv_channels``)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """a * d_h: query projection width (Megatron ``query_projection_size``)."""
        return self.num_attention_heads * self.kv_channels

    @property
    def ffn_size(self) -> int:
        """f: MLP intermediate width per branch."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    # --- MLA and MoE sizes ----------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from a low-rank latent."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head in the score product: ``nope + rope`` under MLA, else d_h."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.kv_channels

    @property
    def v_dim(self) -> int:
        """Width of one value head: ``v_head_dim`` under MLA, else d_h."""
        return self.v_head_dim if self.is_mla else self.kv_channels

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def windowed_layers(self) -> int:
        """Layers with a sliding window: ``sliding_window_layers``, all layers when only the window is set,
        0 without a window."""
        if self.sliding_window is None:
            return 0
        return self.num_layers if self.sliding_window_layers is None else self.sliding_window_layers

    @property
    def chunked(self) -> int:
        """Layers with chunked attention: ``chunked_layers``, all layers when only the chunk is set, 0 without."""
        if self.attention_chunk is None:
            return 0
        return self.num_layers if self.chunked_layers is None else self.chunked_layers

    @property
    def moe_ffn_size(self) -> int:
        """Intermediate width of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def num_moe_layers(self) -> int:
        """Layers with experts: the 1s of ``moe_layer_pattern``, else all but the ``first_k_dense`` (0 for a dense
        model)."""
        if not self.is_moe:
            return 0
        return sum(self.moe_layer_pattern) if self.moe_layer_pattern is not None else \
            self.num_layers - self.first_k_dense

    @property
    def moe_layer_flags(self) -> tuple[int, ...]:
        """1 for each layer with experts, 0 for each dense one (all 0 for a dense model): ``moe_layer_pattern``, or
        ``first_k_dense`` 0s then 1s. Hashable, for the caches of :func:`_stage_moe_layers`."""
        if not self.is_moe:
            return (0,) * self.num_layers
        if self.moe_layer_pattern is not None:
            return tuple(self.moe_layer_pattern)
        return (0,) * self.first_k_dense + (1,) * (self.num_layers - self.first_k_dense)

    def mtp_is_moe(self) -> bool:
        """Whether the multi-token-prediction layers (``mtp_num_layers``) have experts: they take the last decoder
        layer's kind (Megatron-Core core_v0.16.1 ``gpt_layer_specs.get_gpt_mtp_block_spec`` builds them from the
        decoder's last layer spec; ``training.py`` counts them as MoE where the last layer is)."""
        return self.is_moe_layer(self.num_layers - 1)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has experts: its ``moe_layer_pattern`` entry, else DeepSeek's
        ``first_k_dense_replace`` rule (every layer from ``first_k_dense`` on)."""
        if not self.is_moe:
            return False
        if self.moe_layer_pattern is not None:
            return bool(self.moe_layer_pattern[index])
        return index >= self.first_k_dense

    @property
    def has_qkv_bias(self) -> bool:
        return self.linear_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def has_out_proj_bias(self) -> bool:
        return self.linear_bias if self.out_proj_bias is None else self.out_proj_bias

    @property
    def has_mlp_bias(self) -> bool:
        return self.linear_bias if self.mlp_bias is None else self.mlp_bias

    @property
    def all_linear_biases(self) -> bool:
        """Q/K/V, output projection and MLP all carry biases: Megatron-LM's ``--add-bias-linear`` (its default), which
        also gives a MoE router its bias (core_v0.16.1 ``moe/router.py``)."""
        return self.has_qkv_bias and self.has_out_proj_bias and self.has_mlp_bias

    @property
    def gated_mlp(self) -> bool:
        """FC1 is two matrices (gate and up), as in SwiGLU and GeGLU (Shazeer 2020, arXiv:2002.05202)."""
        return self.activation in ("swiglu", "geglu")

    @property
    def norm_weights_per_channel(self) -> int:
        """2 for LayerNorm (gamma, beta), 1 for RMSNorm (gamma) and a LayerNorm without bias (``norm_bias`` False)."""
        return 2 if self.norm == "layernorm" and self.norm_bias is not False else 1

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: 2h for LayerNorm (gamma, beta), h for RMSNorm or a bias-free LayerNorm."""
        return self.norm_weights_per_channel * self.hidden_size

    @property
    def norms_per_layer(self) -> int:
        """h-wide norms in one layer: 2 (pre or post), 4 (sandwich, Gemma-2), 1 (Falcon-7B's shared norm)."""
        if self.norm_placement == "sandwich":
            return 4
        return 1 if self.shared_input_norm else 2

    def qk_norm_params(self, q_width: float | None = None, kv_width: float | None = None) -> float:
        """Parameters of the query and key norms: ``q + g*d_h`` channels (full, OLMo-2 ``q_norm``/``k_norm``)
        or ``2*d_h`` (per head). ``q_width``/``kv_width`` give the widths held by one TP rank."""
        n = self.norm_weights_per_channel
        if self.qk_norm == "head":
            return n * 2 * self.kv_channels
        if self.qk_norm == "full":
            q = self.q_size if q_width is None else q_width
            k = self.kv_heads * self.kv_channels if kv_width is None else kv_width
            return n * (q + k)
        return 0

    def attention_params(self) -> int:
        """Parameters of one layer's attention block (projections, their biases, Q/K norms, sinks).

        Standard/GQA: ``h*q + 2*h*g*d_h + q*h`` (formulas.md A2, Megatron ``theoretical_memory_usage.py``),
        biases QKV ``q + 2*g*d_h`` and O ``h``. MLA (DeepSeek-V2, arXiv:2405.04434 section 2.1; Hugging
        Face ``modeling_deepseek_v3.py``): ``q_a_proj`` ``h*r_q`` + ``q_a_layernorm`` ``r_q`` + ``q_b_proj``
        ``r_q*a*(nope+rope)`` (or ``q_proj`` ``h*a*(nope+rope)`` without a q rank), ``kv_a_proj_with_mqa``
        ``h*(r_kv+rope)`` + ``kv_a_layernorm`` ``r_kv`` + ``kv_b_proj`` ``r_kv*a*(nope+v)``, ``o_proj`` ``a*v*h``.
        """
        h, a = self.hidden_size, self.num_attention_heads
        sinks = a if self.attention_sinks else 0
        if self.is_mla:
            n = self.norm_weights_per_channel
            rq, rkv, dqk = self.q_lora_rank, self.kv_lora_rank, self.qk_head_dim
            q = (h * rq + n * rq + rq * a * dqk) if rq else h * a * dqk
            kv = h * (rkv + self.qk_rope_head_dim) + n * rkv + rkv * a * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + a * self.v_head_dim * h + sinks
        q = self.q_size
        kv = 2 * self.kv_heads * self.kv_channels
        bias = (q + kv if self.has_qkv_bias else 0) + (h if self.has_out_proj_bias else 0)
        return h * (q + kv) + q * h + bias + int(self.qk_norm_params()) + sinks

    def mlp_params(self, ffn: int | None = None) -> int:
        """One MLP of intermediate width ``ffn`` (default f): FC1 ``h*f`` (``2*h*f`` gated) + FC2 ``f*h``,
        biases FC1 ``f`` (``2f``) and FC2 ``h`` (formulas.md A2). A routed expert is one such MLP."""
        h, f = self.hidden_size, ffn or self.ffn_size
        mlp_in = 2 * f if self.gated_mlp else f
        return h * mlp_in + f * h + ((mlp_in + h) if self.has_mlp_bias else 0)

    def router_params(self) -> int:
        """The router: an ``h x E`` linear layer (+ E biases with ``router_bias``; Megatron ``TopKRouter``)."""
        return self.num_experts * (self.hidden_size + (1 if self.router_bias else 0)) if self.is_moe else 0

    def shared_expert_params(self) -> int:
        """The shared experts as one MLP of their total width, plus the ``h -> 1`` gate (Qwen2-MoE)."""
        if self.shared_expert_ffn_hidden_size is None:
            return 0
        return self.mlp_params(self.shared_expert_ffn_hidden_size) + (self.hidden_size if self.shared_expert_gate else 0)

    def expert_params(self) -> int:
        """All routed experts of one MoE layer: ``E`` MLPs of width ``moe_ffn_hidden_size``."""
        return self.num_experts * self.mlp_params(self.moe_ffn_size) if self.is_moe else 0

    def layer_params(self, moe: bool | None = None) -> int:
        """Parameters of one transformer layer; ``moe`` picks a MoE or a dense layer (default: MoE when the
        model has experts).

        Source: formulas.md A2 [code] Megatron-LM ``theoretical_memory_usage.py``: attention
        ``h*q + 2*h*g*d_h + q*h``, MLP ``2*h*f`` (GeLU) or ``3*h*f`` (gated: SwiGLU, GeGLU), two norms;
        biases [derived]: QKV ``q + 2*g*d_h``, O ``h``, FC1 ``f`` (``2f`` gated), FC2 ``h``. Extra norms
        as the Hugging Face modules define them: Gemma-2 ``pre/post_feedforward_layernorm`` (4 per
        layer), OLMo-2 ``q_norm`` (``a*d_h``) and ``k_norm`` (``g*d_h``), Falcon-7B one shared norm.
        A MoE layer replaces the MLP by the router, ``E`` routed experts and the shared experts
        (Megatron-Core ``MoELayer``; docs/moe.md).
        """
        moe = self.is_moe if moe is None else moe
        norms = self.norms_per_layer * self.norm_params
        mlp = (self.router_params() + self.expert_params() + self.shared_expert_params()) if moe else self.mlp_params()
        return self.attention_params() + mlp + norms

    def active_layer_params(self, moe: bool | None = None) -> int:
        """Parameters one token goes through in a layer: ``top_k`` of the routed experts (DeepSeek-V3
        report's "activated parameters"; Mixtral's "active parameters")."""
        moe = self.is_moe if moe is None else moe
        if not moe:
            return self.layer_params(False)
        return self.layer_params(True) - self.expert_params() + self.top_k * self.mlp_params(self.moe_ffn_size)

    def embedding_params(self, vocab_size: int | None = None) -> int:
        """Input-side parameters: word embedding, learned positions, embedding norm."""
        v = vocab_size or self.vocab_size
        h = self.hidden_size
        positions = self.max_seq_len * h if self.position_embedding == "learned" else 0
        return v * h + positions + (self.norm_params if self.embedding_norm else 0)

    def output_params(self, vocab_size: int | None = None) -> int:
        """Output-side parameters: final norm, (untied) LM head and its bias (``output_bias``, Phi and GPT-J's
        ``lm_head.bias``)."""
        v = vocab_size or self.vocab_size
        head = 0 if self.tied_embeddings else v * self.hidden_size
        return self.norm_params + head + (v if self.output_bias else 0)

    @property
    def num_params(self) -> int:
        """Exact parameter count (formulas.md A2), embeddings included, tied head counted once; MoE
        models count every expert (the "total parameters" of the Mixtral, DeepSeek-V3 and Qwen3 reports)."""
        dense = self.num_layers - self.num_moe_layers
        return (dense * self.layer_params(False) + self.num_moe_layers * self.layer_params(True)
                + self.embedding_params() + self.output_params())

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses (embeddings included, as Mixtral's 12.9B and DeepSeek-V3's 37B count
        them): the dense count for a dense model."""
        dense = self.num_layers - self.num_moe_layers
        return (dense * self.layer_params(False) + self.num_moe_layers * self.active_layer_params(True)
                + self.embedding_params() + self.output_params())

    def megatron_gaps(self) -> list[str]:
        """What Megatron-LM's GPT model, as its command-line flags configure it, cannot build: one line
        per field. Flags read in Megatron-LM core_v0.16.1 ``megatron/training/arguments.py``
        (``--swiglu``, ``--normalization``, ``--add-bias-linear``/``--disable-bias-linear`` with
        ``--add-qkv-bias``, ``--position-embedding-type``) and ``core/transformer/attention.py`` (the
        Q/K layernorms are ``hidden_size_per_attention_head`` wide). For emitters and ``check``."""
        gaps = []
        if self.activation == "geglu":
            gaps.append("activation: geglu has no Megatron-LM flag (--swiglu is the SiLU gate only)")
        if self.norm_placement != "pre":
            gaps.append(f"norm_placement: {self.norm_placement} norms are not a Megatron-LM GPT layer option")
        if self.parallel_attention:
            gaps.append("parallel_attention: Megatron-LM's GPT layer runs attention and MLP in sequence")
        if self.qk_norm == "full":
            gaps.append("qk_norm: Megatron-LM's Q/K layernorms are per head (--qk-layernorm), not full width")
        for field in ("attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, field) is not None:
                gaps.append(f"{field}: Megatron-LM has no soft-capping flag for training")
        biases = (self.has_qkv_bias, self.has_out_proj_bias, self.has_mlp_bias)
        if biases != (True, True, True) and (self.has_out_proj_bias or self.has_mlp_bias):
            gaps.append("out_proj_bias, mlp_bias: Megatron-LM has biases on every linear layer (--add-bias-linear) "
                        "or on none (--disable-bias-linear, optionally --add-qkv-bias)")
        if self.position_embedding == "alibi":
            gaps.append("position_embedding: alibi is not a Megatron-LM --position-embedding-type")
        if self.norm == "layernorm" and self.norm_bias is False:
            gaps.append("norm_bias: Megatron-LM's LayerNorm has a bias; no flag removes it")
        if self.output_bias:
            gaps.append("output_bias: Megatron-LM's output layer has no bias (ColumnParallelLinear, bias=False)")
        if self.rope_scaling == "yarn" and not self.is_mla:
            # GPTModel takes position_embedding_type 'yarn' only from code (Megatron-Bridge's GPT-OSS provider)
            gaps.append("rope_scaling: yarn is not a Megatron-LM --position-embedding-type (core_v0.16.1 choices: "
                        "learned_absolute, rope, mrope, relative, none; --rope-type yarn is MLA's)")
        if self.sliding_window is not None:
            gaps.append("sliding_window: plan3d does not write Megatron-LM's --window-size / --window-attn-skip-freq; "
                        "the launch would attend to every key")
        if self.swiglu_limit is not None:
            gaps.append("swiglu_limit: plan3d writes --swiglu, not GPT-OSS's clamped activation (Megatron-LM "
                        "--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value)")
        if self.mtp_num_layers and self.position_embedding == "learned":  # arguments.py validate_args
            gaps.append("mtp_num_layers: Megatron-LM's multi-token prediction needs rope position embeddings, "
                        "not learned")
        return gaps + self._megatron_moe_gaps()

    def _megatron_moe_gaps(self) -> list[str]:
        """MoE and MLA fields Megatron-LM core_v0.16.1 cannot build: the router has a bias exactly when
        every linear layer has one (``moe/router.py``: ``if config.add_bias_linear``); MLA's projections
        take ``--add-bias-linear`` but the spec's MLA has no biases; MLA's only Q/K norms are its latent
        norms (``--qk-layernorm``, ``gpt_layer_specs.py``)."""
        gaps = []
        if self.is_moe and self.router_bias != self.all_linear_biases:
            gaps.append("router_bias: Megatron-LM's router has a bias exactly when every linear layer has one "
                        "(--add-bias-linear)")
        if self.is_mla and self.all_linear_biases:
            gaps.append("linear_bias: plan3d's MLA attention has no biases; Megatron-LM would add them (--add-bias-linear)")
        if self.is_mla and self.qk_norm != "none":
            gaps.append("qk_norm: Megatron-LM's MLA has only its latent norms (--qk-layernorm), no Q/K head norms")
        return gaps


#: cuBLAS's default workspace per thread and stream that runs a GEMM on Hopper and Blackwell, MiB
#: (aten/src/ATen/cuda/CublasHandlePool.cpp, ``parseChosenWorkspaceSize``: 4096 KiB x 8 on compute capability
#: 9.x/10.x/12.x; ``:4096:2:16:8`` = 8.125 MiB before): ``HardwareSpec.blas_workspace_mib``'s default and the
#: fake-rank harness's (``planner.fake_rank.HOPPER_BLAS_WORKSPACE_BYTES``), which has no profile.
HOPPER_BLAS_WORKSPACE_MIB = 32.0


class HardwareSpec(_Spec):
    """One kind of GPU node and the network between nodes.

    Bandwidths are *achievable* nccl-tests bus bandwidths per GPU (formulas.md C1, C5), not line
    rates: the cost model divides bytes-on-the-wire by them directly.
    """

    name: str = Field(min_length=1, description="Short name of the profile.")
    gpu_memory_gib: float = Field(gt=0, le=1e6, description="Device memory per GPU as the runtime reports it, GiB.")
    peak_bf16_tflops: float = Field(gt=0, description="Dense (non-sparse) BF16 tensor-core peak, TFLOP/s.")
    peak_fp8_tflops: float | None = Field(
        default=None, gt=0, description="Dense FP8 peak, TFLOP/s; absent when the GPU has no FP8 units.")
    peak_fp4_tflops: float | None = Field(
        default=None, gt=0,
        description="Dense FP4 (NVFP4/MXFP4 block-scaled) tensor peak, TFLOP/s; absent before Blackwell.")
    peak_fp32_tflops: float | None = Field(
        default=None, gt=0, description="Dense FP32 (TF32 tensor-core on GPUs) peak, TFLOP/s; for fp32 training.")
    fp8_any_layout_gemm: bool = Field(
        default=False,
        description="FP8 GEMMs take operands in any layout (Blackwell sm_100/sm_103: Transformer Engine's "
                    "nvte_is_non_tn_fp8_gemm_supported), so TE keeps no fp8 transpose of a per-tensor-scaled "
                    "weight (planner/frameworks/megatron.py); Hopper needs TN layouts and keeps one.")
    hbm_bandwidth_gbps: float = Field(gt=0, description="Peak HBM bandwidth, GB/s.")
    gpus_per_node: int = Field(ge=1, le=4096, description="GPUs per host (one torchrun / Slurm task group; --nproc-per-node).")
    nvlink_domain_size: int | None = Field(
        default=None, ge=1, le=4096,
        description="GPUs that share one NVLink (scale-up) domain: 8 on DGX/HGX H100 and B200, 72 on GB200/GB300 "
                    "NVL72 racks (18 trays of 4). Default: gpus_per_node. Groups inside one domain use the intra "
                    "figures, groups across domains the inter figures.")
    nvlink_domain_segment: int | None = Field(
        default=None, ge=1, le=4096,
        description="GPUs of one domain a job fills when it does not fill whole domains: 64 on NVL72 racks, where "
                    "jobs run on 16 of the 18 trays (HardwareSpec.for_job). Default: whole domains only.")
    intra_node_bandwidth_gbps: float = Field(
        gt=0, description="Achievable ring bus bandwidth per GPU inside a node (nccl-tests busbw), GB/s.")
    intra_node_latency_us: float = Field(ge=0, description="Per-step latency of an intra-node collective, us.")
    inter_node_bandwidth_gbps: float = Field(
        gt=0, description="Achievable ring bus bandwidth per GPU across nodes (NICs x rate / GPUs), GB/s.")
    inter_node_latency_us: float = Field(ge=0, description="Per-step latency of an inter-node collective, us.")
    # PCIe Gen5 x16: 32 GT/s per lane x 16 lanes, 128b/130b encoding = 63 GB/s per direction, the "64 GB/s"
    # of the PCI-SIG PCI Express 5.0 specification announcement (pcisig.com, 2019)
    host_link_gbps: float = Field(
        default=64.0, gt=0,
        description="Host-device link per GPU per direction, GB/s (pinned-memory copies): the activation offload "
                    "of Plan.cpu_offload_layers. Default: PCIe Gen5 x16 (64 GB/s, PCI-SIG).")
    cuda_context_gib: float = Field(default=0.5, ge=0, description="CUDA context and kernels per process, GiB.")
    nccl_buffers_gib: float = Field(default=1.5, ge=0, description="NCCL communicator buffers per process, GiB.")
    fragmentation_headroom: float = Field(
        default=0.05, ge=0, lt=1, description="Fraction of memory kept free for allocator fragmentation.")
    gemm_efficiency_max: float = Field(
        default=0.8, gt=0, le=1,
        description="Maximum achievable matmul FLOP/s over the dense peak (MAMF: best shape, measured).")
    fp8_gemm_efficiency_max: float | None = Field(
        default=None, gt=0, le=1,
        description="Maximum achievable FP8 matmul FLOP/s over the dense FP8 peak. None: gemm_efficiency_max x "
                    "the FP8/BF16 MAMF ratio measured on Hopper (planner.cost.FP8_MAMF_RATIO).")
    sustained_fraction: float = Field(
        default=1.0, gt=0, le=1,
        description="Fraction of the burst (MAMF) compute rate a GPU holds through a long training run: "
                    "power-capped clocks and kernel gaps. Calibrated, see docs/cost-model.md.")
    sm_count: int = Field(
        default=108, ge=1, description="Streaming multiprocessors (compute units): sets GEMM wave quantisation.")
    nccl_channels: int = Field(
        default=16, ge=0,
        description="SMs a running NCCL collective occupies (one thread block per channel): compute that "
                    "overlaps communication loses this share of the GPU.")
    kernel_overhead_us: float = Field(
        default=5.0, ge=0, description="Fixed cost per GEMM kernel (launch, prologue, epilogue), us.")
    host_launch_us: float = Field(
        default=20.0, ge=0,
        description="CPU time to issue one kernel from the framework, us. The launch call alone takes 5-20 us "
                    "on the CPU side (HolisticTraceAnalysis docs, cuda_kernel_launch_stats); each operator also "
                    "passes Python and the ATen dispatcher (eager split: 3.3 us, pytorch/pytorch#32194), so the "
                    "upper end is taken for the whole. Bites where the host must wait for the device every layer "
                    "(dropless MoE dispatch): planner.cost.moe_host_s.")
    attention_efficiency: float = Field(
        default=0.5, gt=0, le=1,
        description="Achieved fraction of peak in the fused (flash) attention forward kernel.")
    attention_bwd_efficiency: float | None = Field(
        default=None, gt=0, le=1,
        description="Level of the fused attention backward kernels, as attention_efficiency is of the forward; "
                    "None: the same as the forward. Set where the two passes have different bottlenecks (Blackwell "
                    "Ultra doubles the exponential units that bound the forward, not the shared-memory traffic that "
                    "bounds the backward).")
    attention_beyond_fa2: bool = Field(
        default=False,
        description="The attention level above (attention_efficiency) is a kernel faster than FlashAttention-2 "
                    "(Hopper's cuDNN / FlashAttention-3, which use its wgmma and TMA units). A job that runs "
                    "FlashAttention-2 (TrainingSpec.attention 'flash2') then gets FlashAttention-2's measured speed "
                    "(planner.cost, _H200_FA2_CAUSAL). False: that kernel is the level itself (A100), or it was not "
                    "measured here (Blackwell).")
    attention_table: Literal["h200", "h100"] = Field(
        default="h200",
        description="The GPU whose measured attention kernels (planner.cost.ATTENTION_TABLES: cuDNN and "
                    "FlashAttention-2, forward and backward, by sequence length and head dim) give the speed's shape "
                    "by sequence length; attention_efficiency sets its level. h100 and h200 were each measured "
                    "(benchmarks/data/h100_kernels.json, h200_kernels.json); other GPUs use the H200's shape.")
    hbm_efficiency: float = Field(
        default=0.7, gt=0, le=1, description="Achieved fraction of HBM bandwidth in memory-bound kernels.")
    blas_workspace_mib: float = Field(
        default=HOPPER_BLAS_WORKSPACE_MIB, ge=0,
        description="cuBLAS's workspace per thread that runs GEMMs, MiB: PyTorch's default is 32 on Hopper and "
                    "Blackwell and 8.125 before (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize; "
                    "CUBLAS_WORKSPACE_CONFIG changes it), 32 on ROCm, 128 on MI300 (gfx942). One for the forward's "
                    "thread and one for autograd's on every stage whose layers are torch GEMMs (torchtitan, "
                    "DeepSpeed, validate's miniature), on the loss and MoE stages under Megatron and NeMo "
                    "(planner.memory.gemm_workspace_bytes); torchtitan's reserved-memory replay makes the same two "
                    "(planner.allocator_trace).")
    te_workspace_mib: float = Field(
        default=32.0, ge=0,
        description="Transformer Engine's cuBLAS workspace, MiB: 32 on compute capability 9 and later (Hopper, "
                    "Blackwell), 4 before (transformer_engine/pytorch/module/base.py, get_cublas_workspace_size_bytes; "
                    "recent releases add 256 B-1 KiB of scales). One per process (get_workspace), three in its place "
                    "where TP communication overlap runs (initialize_ub), four more where its GroupedLinear runs the "
                    "routed experts (get_multi_stream_cublas_workspace); counted under the Megatron and NeMo profiles "
                    "(planner.memory.gemm_workspace_bytes).")

    @model_validator(mode="after")
    def _check(self) -> HardwareSpec:
        if self.nvlink_domain % self.gpus_per_node:
            _problems([f"nvlink_domain_size: {self.nvlink_domain} is not a multiple of gpus_per_node({self.gpus_per_node})"])
        seg = self.nvlink_domain_segment
        if seg and (seg % self.gpus_per_node or seg > self.nvlink_domain):
            _problems([f"nvlink_domain_segment: {seg} must be a multiple of gpus_per_node({self.gpus_per_node}) "
                       f"and at most the NVLink domain ({self.nvlink_domain})"])
        if self.usable_memory_gib <= 0:
            _problems([f"gpu_memory_gib: {self.gpu_memory_gib:g} GiB leaves {self.usable_memory_gib:.2f} GiB usable "
                       f"after cuda_context_gib({self.cuda_context_gib:g}), nccl_buffers_gib({self.nccl_buffers_gib:g}) "
                       f"and fragmentation_headroom({self.fragmentation_headroom:g}); raise it or lower those"])
        return self

    @property
    def nvlink_domain(self) -> int:
        """GPUs of one NVLink domain (consecutive global ranks): ``nvlink_domain_size`` or ``gpus_per_node``."""
        return self.nvlink_domain_size or self.gpus_per_node

    def job_nvlink_domain(self, num_gpus: int) -> int:
        """The NVLink domain as a job of ``num_gpus`` GPUs fills it: consecutive global ranks fill one domain,
        then the next. A job that fills whole domains (or fits in one) sees ``nvlink_domain``; one that does not,
        but fills whole segments of ``nvlink_domain_segment`` GPUs, sees the segment: on GB200/GB300 NVL72 racks
        jobs run on 64 of the 72 GPUs (16 of 18 compute trays), which is why every published Megatron-Bridge
        GB200/GB300 run uses 8, 64, 128 or 256 GPUs (benchmarks/data/megatron_bridge_perf.json) and none a
        multiple of 72. A group of ranks 64..95 then sits in one rack, not across two."""
        d, seg = self.nvlink_domain, self.nvlink_domain_segment
        if num_gpus <= d or num_gpus % d == 0 or not seg or num_gpus % seg:
            return d
        return seg

    def for_job(self, num_gpus: int) -> HardwareSpec:
        """This profile with the NVLink domain a job of ``num_gpus`` GPUs sees (:meth:`job_nvlink_domain`)."""
        size = self.job_nvlink_domain(num_gpus)
        return self if size == self.nvlink_domain else self.model_copy(update={"nvlink_domain_size": size})

    def tp_straddles(self, tp: int, num_gpus: int | None = None) -> str | None:
        """Why TP groups of ``tp`` would straddle NVLink domains (neither a divisor nor a multiple of one), or None.
        A job of ``num_gpus`` that fits in one domain straddles none, whatever ``tp`` (32 GPUs of a GB200 NVL72
        rack with TP 16: the search's own rule, ``candidates.valid_tp``, takes tp up to min(GPUs, domain))."""
        n = self.nvlink_domain
        if num_gpus is not None and num_gpus <= n:
            return None
        if n % tp and tp % n:
            return (f"neither divides nor is a multiple of the NVLink domain ({n} GPUs) of {self.name}, so TP "
                    f"groups would straddle domains; choose a divisor of {n}")
        return None

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB

    @property
    def usable_memory_gib(self) -> float:
        """Capacity minus fixed overheads and fragmentation headroom (formulas.md A6)."""
        return self.gpu_memory_gib * (1 - self.fragmentation_headroom) - self.cuda_context_gib - self.nccl_buffers_gib

    def peak_flops(self, precision: Precision) -> float:
        """Dense peak in FLOP/s for the training precision.

        fp8 (per-tensor scaling, Transformer Engine ``DelayedScaling``/``Float8CurrentScaling``) and
        mxfp8 (``MXFP8BlockScaling``: E4M3 with one E8M0 scale per 32 values) run at the FP8 tensor rate;
        nvfp4 (``NVFP4BlockScaling``: E2M1 with an E4M3 scale per 16 values and a per-tensor FP32
        scale) at the FP4 rate (NVIDIA Blackwell architecture technical brief; Transformer Engine
        1.13/2.x recipes). The block-scaled formats need Blackwell tensor cores: a profile without an
        FP4 peak (Hopper and older) has none.
        """
        if precision in BLOCK_SCALED and self.peak_fp4_tflops is None:
            raise ValueError(f"precision: {precision} needs Blackwell block-scaled tensor cores; {self.name} has "
                             "none (no peak_fp4_tflops); use fp8 or bf16")
        tflops = {"fp8": self.peak_fp8_tflops, "mxfp8": self.peak_fp8_tflops, "nvfp4": self.peak_fp4_tflops,
                  "fp32": self.peak_fp32_tflops}.get(precision, self.peak_bf16_tflops)
        if tflops is None:
            raise ValueError(f"precision: {self.name} has no {precision} peak (peak_{precision}_tflops); use bf16")
        return tflops * 1e12


class DeepSpeedZero(_Spec):
    """The DeepSpeed config keys that set what its engine allocates beside the model states (deepspeed 0.19.8
    ``runtime/zero/config.py`` ``DeepSpeedZeroConfig`` and ``data_types``; read by ``plan3d check`` from a
    Megatron-DeepSpeed launch's config, written by ``plan3d emit deepspeed``). Only the deepspeed framework reads
    them (planner/frameworks/deepspeed.py)."""

    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        default=None,
        description="data_types.grad_accum_dtype; None: DeepSpeed's default, the model's own dtype (0.19.8 "
                    "engine.py get_data_types). With bf16 it picks the optimizer wrapper: fp32 at ZeRO stage 1 runs "
                    "BF16_Optimizer instead of the ZeRO optimizer (engine.py _do_optimizer_sanity_check).")
    contiguous_gradients: bool = Field(
        default=True,
        description="zero_optimization.contiguous_gradients (DeepSpeed's default true): the ZeRO optimizers copy "
                    "gradients into reduce buckets of reduce_bucket_elements each; false allocates none.")
    reduce_bucket_elements: int = Field(
        default=500_000_000, gt=0, le=10**13,
        description="zero_optimization.reduce_bucket_size, in elements (DeepSpeed's default 5e8).")
    prefetch_bucket_elements: int = Field(
        default=50_000_000, ge=0, le=10**13,
        description="zero_optimization.stage3_prefetch_bucket_size, in elements (DeepSpeed's default 5e7); ZeRO-3 "
                    "only.")
    max_live_elements: int = Field(
        default=1_000_000_000, ge=0, le=10**13,
        description="zero_optimization.stage3_max_live_parameters, in elements (DeepSpeed's default 1e9): the "
                    "ZeRO-3 prefetcher stops while this many are gathered. ZeRO-3 only.")
    max_reuse_elements: int = Field(
        default=1_000_000_000, ge=0, le=10**13,
        description="zero_optimization.stage3_max_reuse_distance, in elements (DeepSpeed's default 1e9): ZeRO-3 "
                    "keeps a parameter gathered when the trace uses it again within this many. ZeRO-3 only.")
    persistence_threshold_elements: int = Field(
        default=100_000, ge=0, le=10**13,
        description="zero_optimization.stage3_param_persistence_threshold, in elements (DeepSpeed's default 1e5): "
                    "ZeRO-3 never partitions a parameter this small. ZeRO-3 only.")
    pipeline_engine: bool | None = Field(
        default=None,
        description="The model is a DeepSpeed PipelineModule, so the engine is its PipelineEngine even on one stage "
                    "(Megatron-DeepSpeed's pretrain_gpt.py builds GPTModelPipe unless --no-pipeline-parallel); None: "
                    "exactly when pp > 1. It picks BF16_Optimizer for bf16 at ZeRO 0 and refuses ZeRO 2-3.")


class TrainingSpec(_Spec):
    """What one optimizer step processes."""

    num_gpus: int = Field(ge=1, le=MAX_GPUS, description="GPUs in the job (world size).")
    global_batch_size: int = Field(ge=1, le=MAX_COUNT, description="Sequences per optimizer step, over all replicas.")
    seq_len: int = Field(ge=1, le=MAX_COUNT, description="Tokens per sequence.")
    precision: Precision = Field(
        default="bf16",
        description="bf16, fp8 (per-tensor scaling), mxfp8 or nvfp4 (Blackwell block scaling) mixed precision "
                    "(Transformer Engine recipes), or fp32 (the CPU validate run).")
    attention: AttentionKernel = Field(
        default="flash",
        description="flash: fused attention that stores no s x s scores (Dao et al. 2022), at the speed of the "
                    "GPU's fastest kernel (cuDNN / FlashAttention-3 on Hopper: HardwareSpec.attention_efficiency); "
                    "flash2: the same kernel family at FlashAttention-2's measured speed (the flash-attn 2 package; "
                    "torch's SDPA on Hopper until torch 2.9 made cuDNN its default, pytorch/pytorch#162073), slower "
                    "where HardwareSpec.attention_beyond_fa2; materialized: the scores and softmax are stored, as in "
                    "Korthikanti et al. 2022.")
    framework: Literal["megatron", "nemo", "torchtitan", "deepspeed", "torch"] = Field(
        default="megatron",
        description="The framework that runs the plan: sets how weights, gradients, optimizer states and "
                    "logits are held (planner/frameworks) and what the search may propose. megatron "
                    "(Megatron-Core), nemo (NeMo on Megatron-Core), torchtitan (FSDP2, DTensor, torch "
                    "pipelining), deepspeed (ZeRO engine, Megatron-DeepSpeed); torch: torchtitan's "
                    "torch.distributed semantics with plan3d validate's fused kernels.")
    compile: bool = Field(
        default=False,
        description="torch.compile as torchtitan applies it (--compile.enable, components model and loss: each "
                    "TransformerBlock and the loss function compiled; torchtitan 0.3.0 distributed/compile.py "
                    "apply_compile, components/loss.py BaseLoss._maybe_compile). Changes what a block and the loss "
                    "save (planner.compile_probe measures it); torchtitan only.")
    compile_components: tuple[Literal["model", "loss"], ...] = Field(
        default=("model", "loss"),
        description="What compile covers (torchtitan --compile.components; 0.3.0 default model and loss). "
                    "torchtitan 9dec370 (Dec 2024, its published benchmark) compiled the blocks only.")
    overlap_grad_reduce: bool = Field(
        default=True,
        description="Overlap the data-parallel gradient reduction with the last micro-batch's backward "
                    "(Megatron --overlap-grad-reduce, since 2023; Megatron-LM 2021 did not; DeepSpeed overlap_comm). "
                    "FSDP2 (torchtitan, torch) always overlaps it, so there it changes nothing "
                    "(planner.cost.overlap_grad_reduce_of).")
    tp_comm_overlap: bool | None = Field(
        default=None,
        description="Overlap the TP all-gathers/reduce-scatters with the GEMMs next to them (Megatron "
                    "--tp-comm-overlap, needs sequence parallelism; torchtitan async TP). None: the "
                    "framework's default (off for megatron and torch).")
    overlap_p2p_comm: bool | None = Field(
        default=None,
        description="Overlap pipeline send/receive with the next chunk's compute in the interleaved schedule "
                    "(Megatron --no-overlap-p2p-communication turns it off). None: the framework's default "
                    "(on for megatron, off for torch).")
    fp16: bool = Field(
        default=False,
        description="The 16-bit format is fp16, not bf16 (Megatron --fp16, DeepSpeed fp16.enabled): costed as bf16 "
                    "(2 bytes a value); only DeepSpeed's ZeRO-0 optimizer differs (FP16_Optimizer keeps the fp32 "
                    "master and Adam states whole, BF16_Optimizer shards them: planner/frameworks/deepspeed.py).")
    grad_reduce_in_bf16: bool = Field(
        default=False,
        description="Keep and reduce gradients in 16 bits (Megatron --grad-reduce-in-bf16; fp16 training "
                    "in 2021); default fp32 main grads.")
    fp8_params: bool = Field(
        default=False,
        description="Keep the GEMM weights in fp8, with no bf16 copy (Megatron --fp8-param-gather, NeMo "
                    "fp8_params / transformer_engine.pytorch.fp8_model_init); needs precision fp8 or mxfp8 (MXFP8Tensor "
                    "weights, with --reuse-grad-buf-for-mxfp8-param-ag) and the megatron or nemo framework "
                    "(planner/frameworks/megatron.py).")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise"] = Field(
        default="delayed",
        description="Scaling of fp8: delayed (Transformer Engine DelayedScaling, an amax history; "
                    "Megatron's default --fp8-recipe delayed), tensorwise (Float8CurrentScaling, the amax of each "
                    "tensor itself: Megatron --fp8-recipe tensorwise, NVIDIA's FP8-CS recipes) or blockwise "
                    "(Float8BlockScaling: a scale per 1x128 tile of activations and gradients and per 128x128 block "
                    "of weights, DeepSeek-V3's recipe: Megatron --fp8-recipe blockwise, Megatron-Bridge's "
                    "bf16_with_fp8_subchannel_scaling_mixed; megatron and nemo only). The cast cost differs "
                    "(planner.cost.LOW_PRECISION_CAST_BYTES), and blockwise saves a 4-byte scale per 128 values "
                    "of each GEMM input (planner.memory.LINEAR_INPUT_BYTES); on Blackwell Transformer Engine runs "
                    "it through MXFP8's kernels (planner.cost.gemm_precision) and keeps both weight directions.")
    cross_entropy_fusion: Literal["none", "native", "te"] = Field(
        default="none",
        description="Megatron's loss kernel: none (vocab_parallel_cross_entropy, Megatron-LM's default), native "
                    "(--cross-entropy-loss-fusion: fused_vocab_parallel_cross_entropy) or te (--cross-entropy-loss-fusion "
                    "--cross-entropy-fusion-impl te: Transformer Engine's Triton parallel cross entropy, which writes "
                    "the gradient into the bf16 logits in place; Megatron-Bridge's Llama recipes and performance "
                    "scripts). Memory only: 2 B per logit with te, else 6 (planner/frameworks/megatron.py); megatron "
                    "and nemo only.")
    optimizer_dtype: Literal["fp32", "bf16", "bf16-apex"] = Field(
        default="fp32",
        description="Adam state dtype. fp32: Megatron's distributed optimizer (fp32 master copy, m, v). "
                    "bf16 (megatron, and nemo: NeMo 2 and Megatron-Bridge run Megatron-Core's optimizer): the "
                    "precision-aware optimizer (--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype "
                    "bf16: m and v in bf16, the master as TE's int16 remainder in bf16 training, else fp32; "
                    "distributed optimizer only, planner/frameworks/megatron.py). bf16-apex (nemo only): NeMo 1's "
                    "Apex DistributedFusedAdam, optim.name distributed_fused_adam with optim.dtype bf16 (NeMo "
                    "launcher YAMLs; m and v in bf16, a bf16 master copy only with fp8_params; "
                    "planner/frameworks/nemo.py). Other frameworks: fp32 only.")
    optimizer: Literal["adam", "muon", "dist_muon"] = Field(
        default="adam",
        description="The optimizer: adam (AdamW, every framework's default) or Megatron-Core's Muon (megatron and nemo; "
                    "--optimizer muon / dist_muon, core_v0.16.1 optimizer/muon.py): Newton-Schulz-orthogonalised "
                    "momentum (one fp32 state) on every 2-D weight but the embedding and output layer, AdamW on the "
                    "rest. Megatron runs it without the distributed optimizer and without gradient-reduce or "
                    "param-gather overlap (arguments.py validate_args asserts all three), so ZeRO 0 only; dist_muon "
                    "deals whole parameters over the data-parallel ranks (layer_wise_optimizer.py "
                    "LayerWiseDistributedOptimizer) and all-gathers them after the step (planner/frameworks/megatron.py, "
                    "planner/cost.py muon_step_s).")
    dist_optimizer_instances: int = Field(
        default=1, ge=1, le=MAX_GPUS,
        description="Copies of Megatron's distributed optimizer across the data-parallel domain "
                    "(--num-distributed-optimizer-instances N, megatron and nemo, ZeRO 1 only): each shards its states "
                    "over dp x cp / N ranks (core_v0.16.1 parallel_state.py intra_partial_data_parallel_size), the "
                    "gradients are reduce-scattered within an instance and all-reduced across the N "
                    "(param_and_grad_buffer.py). Default 1: one optimizer over all dp x cp ranks.")
    step_cuda_graph: bool | None = Field(
        default=None,
        description="torchtitan captures each forward+backward in one CUDA graph (its trainer's wrap_with_cuda_graph, "
                    "pytorch/torchtitan#3559, August 2026; off with --training.disable_cuda_graphs, and its trainer "
                    "refuses it with PP or with EP's standard token dispatcher) and then zeroes the gradients without "
                    "freeing them (optimizers.zero_grad(set_to_none=disable_cuda_graphs)). None: torchtitan's default, "
                    "on where it runs (pp 1, no EP); TOML-era torchtitan (before its config registry) had none. "
                    "torchtitan only (planner/frameworks/torchtitan.py).")
    deepspeed: DeepSpeedZero = Field(
        default_factory=DeepSpeedZero,
        description="DeepSpeed's gradient-accumulation dtype and ZeRO bucket settings (DeepSpeedZero); the deepspeed "
                    "framework only.")
    moe_token_dispatcher: Literal["alltoall", "allgather", "deepep", "hybridep"] = Field(
        default="alltoall",
        description="MoE token dispatch: alltoall (Megatron --moe-token-dispatcher-type alltoall, what plan3d "
                    "emits and searches with), allgather (Megatron-Core's own default when the flag is left out: "
                    "every token of the etp x ep group gathered to every rank of it, reduce-scattered back; "
                    "cost.moe_layer_extra, memory.moe_allgather_buffer_bytes; Megatron and NeMo only), deepep "
                    "(--moe-token-dispatcher-type flex with DeepEP: one copy per destination node across the "
                    "network; its buffer in memory, memory.deepep_buffer_bytes; Megatron and NeMo only) or hybridep "
                    "(the flex dispatcher with --moe-flex-dispatcher-backend hybridep, NVIDIA's HybridEP: the same "
                    "traffic as deepep, its worst-case-sized buffer in memory, memory.hybridep_buffer_bytes; "
                    "Megatron and NeMo only).")
    hybridep_ranks_per_domain: int | None = Field(
        default=None, ge=1, le=MAX_GPUS,
        description="Ranks of the expert group HybridEP is told share one NVLink domain "
                    "(NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN, formerly NUM_OF_RANKS_PER_NVLINK_DOMAIN; HybridEP's "
                    "own default 8), which sets its buffers (memory.hybridep_buffer_bytes); it must divide etp x ep. "
                    "None: the ranks the layout puts in one domain (memory.hybridep_domain_ranks), what plan3d emit "
                    "writes. plan3d check reads it from the launch script's environment.")
    cuda_graph_modules: tuple[Literal["attn", "moe_router", "moe_preprocess", "moe"], ...] = Field(
        default=(),
        description="Per-layer parts captured in CUDA graphs (Megatron --cuda-graph-impl transformer_engine "
                    "--cuda-graph-scope; Megatron-Bridge cuda_graph_scope): a captured part is replayed with one "
                    "launch instead of one per kernel, which matters only where the host bounds the layer "
                    "(planner.cost.moe_host_s). moe: the whole MoE layer (its pre-MLP norm, router, dispatch, "
                    "experts and combine), which Megatron captures only with drop-and-pad routing "
                    "(ModelSpec.capacity_factor), never together with moe_router. Megatron and NeMo only.")

    @property
    def optimizer_key(self) -> str:
        """What decides the ZeRO stages the framework runs the optimizer with (``FrameworkProfile.optimizer_zero_stages``):
        Muon's name, else Adam's state dtype."""
        return self.optimizer_dtype if self.optimizer == "adam" else self.optimizer

    @property
    def compiled_blocks(self) -> bool:
        """torch.compile covers each TransformerBlock (torchtitan ``apply_compile``)."""
        return self.compile and "model" in self.compile_components

    @property
    def compiled_loss(self) -> bool:
        """torch.compile covers the loss function (torchtitan ``BaseLoss._maybe_compile``)."""
        return self.compile and "loss" in self.compile_components

    @field_validator("cuda_graph_modules")
    @classmethod
    def _graph_modules(cls, v: tuple) -> tuple:
        if "moe_preprocess" in v and "moe_router" not in v:  # Megatron arguments.py, --cuda-graph-scope help
            raise ValueError("moe_preprocess must be captured together with moe_router; add moe_router")
        if "moe" in v and "moe_router" in v:  # core_v0.16.1 TransformerConfig.__post_init__
            raise ValueError("moe and moe_router cannot both be captured (Megatron: 'cuda_graph_scope must not "
                             "contain both moe and moe_router'); moe holds the router already, keep one")
        return tuple(dict.fromkeys(v))
    recompute_modules: tuple[RecomputeModule, ...] = Field(
        default=("core_attn",),
        description="What selective recompute recomputes (Megatron --recompute-granularity selective "
                    "--recompute-modules, default core_attn; Megatron-Bridge recompute_modules): core_attn, mla_up_proj "
                    "(MLA up-projections and RoPE), mlp (the dense layers' MLP), moe_act (the experts' activation), "
                    "moe (the whole MoE layer), shared_experts, layernorm (accepted, modelled as saving nothing). "
                    "megatron and nemo only (planner.memory.apply_recompute_modules).")

    @field_validator("recompute_modules")
    @classmethod
    def _recompute_modules(cls, v: tuple) -> tuple:
        return tuple(dict.fromkeys(v))
    distribute_saved_activations: bool = Field(
        default=False,
        description="Under full recompute, each checkpoint keeps only its 1/tp share of the layer input and "
                    "all-gathers it over the TP group before recomputing (Megatron --distribute-saved-activations; "
                    "core_v0.16.1 tensor_parallel/random.py CheckpointFunction; DeepSpeed partition_activations, "
                    "which also splits a sequence-parallel shard). Megatron's rules: tp > 1, recompute full, no "
                    "sequence parallelism; DeepSpeed's: recompute full. megatron, nemo and deepspeed.")
    bf16_layers_at_start: int = Field(
        default=0, ge=0,
        description="Megatron --first-last-layers-bf16 with --num-layers-at-start-in-bf16 N: the first N transformer "
                    "layers run outside Transformer Engine's FP8/FP4 context (core_v0.16.1 fp8_utils.py "
                    "is_first_last_bf16_layer, get_fp8_context), so they save 16-bit GEMM inputs "
                    "(planner.memory.bf16_layers_extra_bytes). Their time is costed at the job's precision. "
                    "fp8 (tensorwise), mxfp8 or nvfp4; megatron and nemo.")
    bf16_layers_at_end: int = Field(
        default=0, ge=0, description="The last N layers likewise (--num-layers-at-end-in-bf16).")
    defer_embedding_wgrad: bool = Field(
        default=False,
        description="Megatron --defer-embedding-wgrad-compute (ModelParallelConfig.defer_embedding_wgrad_compute): "
                    "the output layer's weight-gradient GEMMs wait for the pipeline flush, so the last stage keeps "
                    "each deferred micro-batch's logits gradient (s x b x V/tp) and output-layer input "
                    "(core_v0.16.1 tensor_parallel/layers.py: grad_output_buffer, embedding_activation_buffer; "
                    "planner.memory.deferred_wgrad_bytes). Megatron refuses it without PP. megatron and nemo.")
    wgrad_deferral_limit: int = Field(
        default=0, ge=0,
        description="Megatron --wgrad-deferral-limit: how many micro-batches defer_embedding_wgrad defers, 0 (its "
                    "default) for all of them.")
    unfused_swiglu: bool = Field(
        default=False,
        description="Megatron-LM --no-bias-swiglu-fusion (TransformerConfig.bias_activation_fusion False, without "
                    "--use-te-activation-func): the MLP runs core_v0.16.1 mlp.py's eager glu, "
                    "silu(x_glu) * (x_linear + glu_linear_offset), whose multiply saves the SiLU output and the "
                    "offset sum, two new f/tp-wide tensors per token, beside the FC1 output the SiLU saves "
                    "(planner.memory._layer_activation_terms). Dense models, megatron and nemo.")
    attention_mask_in_dataloader: bool = Field(
        default=False,
        description="Megatron-LM's data path builds a boolean causal mask of micro_batch x 1 x s x s per micro-batch "
                    "and moves it to every TP rank of the first and the last pipeline stage, sliced to s/cp queries "
                    "under CP (core_v0.16.1 training/arguments.py: --no-create-attention-mask-in-dataloader, "
                    "store_false, so on by default; training/utils.py get_batch_on_this_tp_rank; core/utils.py "
                    "get_batch_on_this_cp_rank; planner.memory.dataloader_mask_bytes). plan3d's Megatron launch "
                    "files turn it off; plan3d check reads it from a script. megatron and nemo.")
    pipeline_kept_outputs: KeptOutputs = Field(
        default="none",
        description="Which pipeline stages of torch.distributed.pipelining keep every micro-batch's output until the "
                    "step ends (planner.memory.pipeline_kept_output_bytes): none (torchtitan 0.3.0, which calls "
                    "schedule.step(..., return_outputs=False); plan3d validate likewise), last (the loss stage: "
                    "torch's own default, return_outputs=True, which also concatenates them at the end of step()), "
                    "all (torch before pytorch#153383, May 2025: every stage, as torchtitan's published Dec 2024 "
                    "runs ran). torchtitan and torch only.")
    moe_a2a_overlap: bool = Field(
        default=False,
        description="Overlap the MoE dispatch/combine all-to-all with another micro-batch's compute (Megatron "
                    "--overlap-moe-expert-parallel-comm, 1F1B all-to-all overlap); off by default.")
    moe_grouped_gemm: bool = Field(
        default=True,
        description="Megatron --moe-grouped-gemm (what plan3d emits): the routed experts as Transformer Engine's "
                    "GroupedLinear (TEGroupedMLP), one cuBLAS GEMM per local expert on TE's streams and their "
                    "workspaces. False: Megatron-Core's default without the flag, SequentialMLP, each expert's "
                    "linears one after another on the main stream (planner.frameworks.expert_gemm_streams). "
                    "Megatron and NeMo only; torchtitan's grouped_mm is not this switch.")
    # 1.0 (balanced) by default: NVIDIA's published Megatron-Bridge MoE throughput is measured with the
    # routing forced to balance ("In MoE training benchmarks, we force-balance the token distribution among
    # experts", docs/performance-summary.md, Megatron-Bridge 25.11 and 26.02), and DeepSeek-V3 trains with
    # auxiliary-loss-free balancing that keeps every batch near balance (arXiv:2412.19437 section 2.1.2).
    moe_load_imbalance: float = Field(
        default=1.0, ge=1.0,
        description="Tokens on the busiest expert-parallel rank over the mean; 1.0 = balanced (NVIDIA's MoE "
                    "benchmarks force balance).")


def offload_problems(cpu_offload_layers: int, pp: int, recompute: str) -> list[str]:
    """Activation offloading's limits (``Plan.cpu_offload_layers``): Megatron-LM core_v0.16.1
    transformer_config.py ``__post_init__``: "Currently there is no support for Pipeline parallelism with CPU
    offloading"; "CPU offloading does not work when activation recomputation is enabled"."""
    errors = []
    if cpu_offload_layers and pp > 1:
        errors.append(f"cpu_offload_layers: Megatron offloads activations only without pipeline parallelism "
                      f"(pp is {pp}); set pp 1 or cpu_offload_layers 0")
    if cpu_offload_layers and recompute != "none":
        errors.append(f"cpu_offload_layers: Megatron offloads activations only without recomputation "
                      f"(recompute is {recompute}); set recompute none or cpu_offload_layers 0")
    return errors


class Plan(_Spec):
    """How a job is split: the output of `plan3d search`, the input of estimate/emit/check/validate."""

    tp: int = Field(ge=1, description="Tensor-parallel degree; 1 = off.")
    pp: int = Field(ge=1, description="Pipeline-parallel degree (stages); 1 = off.")
    dp: int = Field(ge=1, description="Data-parallel degree (replicas); 1 = off.")
    cp: int = Field(default=1, ge=1, description="Context-parallel degree; 1 = off.")
    vpp: int = Field(default=1, ge=1, description="Virtual stages (chunks) per pipeline rank; 1 = plain 1F1B.")
    micro_batch_size: int = Field(ge=1, description="Sequences per micro-batch.")
    num_microbatches: int | None = Field(
        default=None, ge=1,
        description="Micro-batches per step per pipeline; derived as global_batch / (micro_batch_size * dp).")
    recompute: Recompute = Field(
        default="none", description="Activation recomputation: none, selective (attention core) or full (layer).")
    recompute_num_layers: int | None = Field(
        default=None, ge=1,
        description="With recompute full: Megatron's block method, --recompute-method block --recompute-num-layers "
                    "K: only the first K transformer layers of each model chunk are recomputed, the others keep "
                    "every activation (core_v0.16.1 transformer_block.py _checkpointed_forward: \"checkpoint the "
                    "input activation of only a set number of individual Transformer layers and skip the rest\"). "
                    "None: every layer (--recompute-method uniform --recompute-num-layers 1). Megatron, NeMo and "
                    "plan3d validate's torch runs; estimated, emitted and read by check, not proposed by search.")
    recompute_interval: int | None = Field(
        default=None, ge=1,
        description="With recompute full: torchtitan's per-layer selective AC, --activation_checkpoint.mode selective "
                    "--activation_checkpoint.selective_ac_option N: every N-th transformer layer a pipeline rank builds "
                    "is fully checkpointed, the others keep every activation (torchtitan "
                    "distributed/activation_checkpoint.py _apply_layer_sac: one process-wide counter over the rank's "
                    "blocks, checkpoint where counter % N == 0). None: every layer. torchtitan and plan3d validate's "
                    "torch runs; estimated and read by check, not proposed by search, and written by no emitter "
                    "(torchtitan 0.3.0's selective AC is per-op only).")
    recompute_group_layers: int | None = Field(
        default=None, ge=2,
        description="With recompute full: Megatron's uniform method with groups of N > 1 layers, --recompute-method "
                    "uniform --recompute-num-layers N: each model chunk's layers run in groups of N (the last one "
                    "shorter), each group checkpointed at its input and recomputed whole in the backward "
                    "(core_v0.16.1 transformer_block.py _checkpointed_forward, 'uniform'), so a chunk of n layers "
                    "keeps ceil(n / N) inputs and its backward holds N layers' activations at once. None: groups of "
                    "one. Megatron and NeMo; estimated, emitted and read by check, not proposed by search.")
    sequence_parallel: bool = Field(default=False, description="Megatron sequence parallelism (needs tp > 1).")
    cpu_offload_layers: int = Field(
        default=0, ge=0,
        description="Transformer layers whose saved activations go to pinned host memory after their forward and "
                    "come back before their backward (Megatron --cpu-offloading-num-layers; Transformer Engine "
                    "get_cpu_offload_context): 0 = off. Needs pp 1, recompute none, fewer than num_layers and "
                    "the megatron or nemo framework (Megatron-LM core_v0.16.1 transformer_config.py).")
    zero_stage: int = Field(
        default=0, ge=0, le=3,
        description="Optimizer sharding over DP: 0 none, 1 optimizer states (Megatron distributed optimizer), "
                    "2 + gradients, 3 + weights (FSDP).")
    layers_per_stage: tuple[int, ...] | None = Field(
        default=None,
        description="Layers on each pipeline stage, for uneven pipelines; default: even split. With vpp > 1 a "
                    "stage need not split evenly: see Plan.chunk_layers.")
    ep: int = Field(
        default=1, ge=1,
        description="Expert-parallel degree: each MoE layer's experts are split over ep GPUs, drawn from the "
                    "tp x cp x dp ranks (Megatron-Core parallel folding, --expert-model-parallel-size); 1 = off.")
    etp: int | None = Field(
        default=None, ge=1,
        description="Expert tensor-parallel degree: each expert's matrices split over etp GPUs, independent of "
                    "the attention tp (Megatron --expert-tensor-parallel-size). Default: tp.")
    microbatch_group_size: int | None = Field(
        default=None, ge=1,
        description="Interleaved 1F1B: micro-batches run through one virtual stage before the next (Megatron "
                    "--microbatch-group-size-per-virtual-pipeline-stage; Meta's N). Default: pp. Must lie in "
                    "[pp, num_microbatches]; more holds more activations, and lets num_microbatches % pp != 0.")
    pipeline_schedule: Literal["1f1b", "interleaved", "interleaved_zb", "zbv", "dualpipev"] | None = Field(
        default=None,
        description="Pipeline schedule (docs/schedules.md): 1f1b, interleaved (1F1B with vpp chunks), "
                    "interleaved_zb (torch ScheduleInterleavedZeroBubble), zbv (ScheduleZBVZeroBubble, 2 chunks "
                    "in a V), dualpipev (DualPipe-V, 2 chunks in a V). Default: 1f1b, or interleaved when vpp > 1.")

    @model_validator(mode="after")
    def _check(self) -> Plan:
        errors = []
        if self.sequence_parallel and self.tp == 1:
            errors.append("sequence_parallel: needs tp > 1 (tp is 1); drop --sequence-parallel or raise tp")
        if self.vpp > 1 and self.pp == 1:
            errors.append(f"vpp: vpp({self.vpp}) > 1 needs pp > 1 (pp is 1)")
        errors += offload_problems(self.cpu_offload_layers, self.pp, self.recompute)
        if self.recompute_num_layers is not None and self.recompute != "full":
            errors.append(f"recompute_num_layers: the block method recomputes whole layers; it needs recompute full, "
                          f"not {self.recompute}")
        if self.recompute_interval is not None and self.recompute != "full":
            errors.append(f"recompute_interval: per-layer AC recomputes whole layers; it needs recompute full, "
                          f"not {self.recompute}")
        if self.recompute_group_layers is not None and self.recompute != "full":
            errors.append(f"recompute_group_layers: Megatron's uniform method recomputes whole layers; it needs "
                          f"recompute full, not {self.recompute}")
        if self.recompute_group_layers is not None and (self.recompute_num_layers is not None or
                                                        self.recompute_interval is not None):
            errors.append("recompute_group_layers: Megatron's uniform method, its block method (recompute_num_layers) "
                          "and torchtitan's per-layer AC (recompute_interval) exclude each other; give one")
        if self.recompute_interval is not None and self.recompute_num_layers is not None:
            errors.append("recompute_interval: Megatron's block method (recompute_num_layers) and torchtitan's "
                          "per-layer AC (recompute_interval) are two frameworks' forms; give one")
        if self.layers_per_stage is not None and len(self.layers_per_stage) != self.pp:
            errors.append(f"layers_per_stage: {len(self.layers_per_stage)} entries for pp({self.pp}) stages")
        if self.layers_per_stage is not None and len(self.layers_per_stage) == self.pp:
            errors += chunk_problems(self.layers_per_stage, self.vpp)
        if self.microbatch_group_size is not None and self.vpp == 1:
            errors.append("microbatch_group_size: applies to the interleaved schedule only (vpp > 1)")
        elif self.microbatch_group_size is not None and self.schedule != "interleaved":
            errors.append(f"microbatch_group_size: applies to the interleaved schedule only, not {self.schedule}")
        if self.v_shaped and self.layers_per_stage is not None and len(set(self.layers_per_stage)) > 1:
            errors.append(f"layers_per_stage: {self.schedule} places stages r and 2*pp-1-r on rank r; uneven V "
                          "layouts are not modelled, give an even split")
        _problems(errors)
        return self

    @property
    def schedule(self) -> str:
        """The pipeline schedule run: ``pipeline_schedule``, or 1f1b (interleaved when ``vpp > 1``)."""
        return self.pipeline_schedule or ("interleaved" if self.vpp > 1 else "1f1b")

    @property
    def v_shaped(self) -> bool:
        """Rank ``r`` holds stages ``r`` and ``2p - 1 - r`` (zbv, dualpipev; ``schedules.stage_index``)."""
        return self.pipeline_schedule in ("zbv", "dualpipev")

    @property
    def loss_stage(self) -> int:
        """The pipeline rank holding the output layer and the loss: ``pp - 1``, or 0 in a V (its stage 2p - 1)."""
        return 0 if self.v_shaped else self.pp - 1

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel degree: ``etp``, or tp when unset (Megatron's default)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel degree: ``tp*cp*dp / (etp*ep)``, the replicas of one expert shard per stage
        (Megatron-Core ``parallel_state``: expert-data-parallel group). Not an integer when the plan is invalid."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers per pipeline stage: the explicit list, or an even split."""
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        return (num_layers // self.pp,) * self.pp

    def chunk_layers(self, num_layers: int) -> tuple[tuple[int, ...], ...]:
        """Layers of each virtual stage, per pipeline rank (:func:`chunk_split` of the stage layers)."""
        return chunk_split(self.stage_layers(num_layers), self.vpp)

    def empty_chunks(self, num_layers: int) -> tuple[int, ...]:
        """Chunks of each pipeline rank that hold no transformer layer (:func:`empty_chunks`)."""
        return tuple(empty_chunks(n, self.vpp, first=r == 0) for r, n in enumerate(self.stage_layers(num_layers)))

    def recomputed_share(self, stage: int, layers: int) -> tuple[float, float]:
        """:func:`recomputed_share` of pipeline rank ``stage`` holding ``layers`` layers under this plan."""
        return recomputed_share(layers, self.vpp, stage == 0, self.recompute, self.recompute_num_layers,
                                self.recompute_interval)

    def grouped_share(self, stage: int, layers: int) -> float:
        """Saved activations of pipeline rank ``stage`` under Megatron's uniform groups
        (``recompute_group_layers`` N) over those of full recompute in groups of one: a chunk of n layers keeps
        ceil(n / N) inputs where groups of one keep n; the largest share of any of its chunks (exact for equal
        chunks, an upper bound otherwise). 1 without groups."""
        n_group = self.recompute_group_layers
        chunks = [c for c in stage_chunks(layers, self.vpp, stage == 0) if c]
        if self.recompute != "full" or n_group is None or not chunks:
            return 1.0
        return max(-(-c // n_group) / c for c in chunks)

    @property
    def partial_recompute(self) -> bool:
        """Full recompute of some layers only: Megatron's block method or torchtitan's per-layer AC."""
        return self.recompute == "full" and (self.recompute_num_layers is not None or
                                             self.recompute_interval is not None)

    def checkpointed_layers(self, stage: int, layers: int) -> tuple[bool, ...]:
        """Per layer of pipeline rank ``stage`` (in the order the rank builds them, chunk by chunk): fully
        recomputed or not (:func:`checkpointed_layers`)."""
        return checkpointed_layers(layers, self.vpp, stage == 0, self.recompute, self.recompute_num_layers,
                                   self.recompute_interval)

    def chunk_starts(self, num_layers: int) -> tuple[tuple[int, ...], ...]:
        """Index of the first layer of each virtual stage, per pipeline rank: chunk ``c`` of rank ``r`` is
        virtual stage ``c*pp + r`` (Megatron's interleaved assignment, Narayanan et al. 2021 section 2.2)."""
        from planner.schedules import stage_index

        chunks = self.chunk_layers(num_layers)
        order = sorted((stage_index(self.schedule, self.pp, r, c), r, c) for r in range(self.pp)
                       for c in range(self.vpp))
        starts, at = [[0] * self.vpp for _ in range(self.pp)], 0
        for _, r, c in order:
            starts[r][c] = at
            at += chunks[r][c]
        return tuple(tuple(x) for x in starts)

    def stage_moe_layers(self, model: ModelSpec) -> tuple[int, ...]:
        """MoE layers on each pipeline rank (dense layers, ``first_k_dense`` or the 0s of ``moe_layer_pattern``, are
        not counted)."""
        if not model.is_moe:
            return (0,) * self.pp
        return _stage_moe_layers(self.pp, self.vpp, self.stage_layers(model.num_layers), model.num_layers,
                                 model.moe_layer_flags, self.pipeline_schedule)

    def label(self) -> str:
        """Short identifier used in file names, e.g. ``tp8-pp4-dp16_mbs1``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp > 1 else []
        parts += [self.pipeline_schedule] if self.pipeline_schedule in ("interleaved_zb", "zbv", "dualpipev") else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"dp{self.dp}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp is not None and self.etp != self.tp else []
        return "-".join(parts) + f"_mbs{self.micro_batch_size}" + \
            (f"_offload{self.cpu_offload_layers}" if self.cpu_offload_layers else "")


def moe_layer_fields(flags) -> dict:
    """ModelSpec fields for a per-layer 0/1 list of which layers have experts (at least one 1): ``first_k_dense`` where
    the dense layers all come first (DeepSeek's ``first_k_dense_replace``), else ``moe_layer_pattern``. The one rule
    for the Hugging Face readers and the Megatron-LM reader (``--moe-layer-freq``)."""
    flags = tuple(int(x) for x in flags)
    k = flags.index(1)
    if flags == (0,) * k + (1,) * (len(flags) - k):
        return {"first_k_dense": k}
    return {"first_k_dense": 0, "moe_layer_pattern": flags}


@functools.lru_cache(maxsize=65536)
def _stage_moe_layers(pp: int, vpp: int, stage_layers: tuple[int, ...], num_layers: int, moe_flags: tuple[int, ...],
                      schedule: str | None = None) -> tuple[int, ...]:
    """MoE layers per rank: the layers of each chunk ``[start, start + n)`` whose ``moe_flags`` entry is 1
    (``ModelSpec.moe_layer_flags``), chunks placed as the schedule places them (cached: the search asks it for every
    shape and stage kind)."""
    probe = Plan.model_construct(tp=1, pp=pp, dp=1, cp=1, vpp=vpp, micro_batch_size=1, layers_per_stage=stage_layers,
                                 pipeline_schedule=schedule)
    chunks, starts = probe.chunk_layers(num_layers), probe.chunk_starts(num_layers)
    return tuple(sum(sum(moe_flags[s:s + n]) for s, n in zip(starts[r], chunks[r])) for r in range(pp))


def min_stage_layers(pp: int, vpp: int) -> tuple[int, ...]:
    """The fewest transformer layers each pipeline rank may hold: one per chunk, except that rank 0's
    chunk 0 may hold only the embedding and the last rank's last chunk only the loss (and output layer).

    Source: Megatron-LM core_v0.16.1 ``transformer_block.py::get_num_layers_to_build``: with
    ``--account-for-embedding-in-pipeline-split`` (``--account-for-loss-in-pipeline-split``) the first
    (last) virtual stage of the first (last) rank builds one layer fewer, asserting only ``>= 0``, and
    both may be empty at once (``transformer_config.py`` counts ``num_layers + 1 + 1`` slots); Llama 3.1
    405B on PP16 x VP8 is 126 layers + E + L = 128 slots, one per virtual stage (Dubey et al. 2024,
    section 3.3.2). No other chunk may be empty: the account_for rules take exactly one slot from those
    two chunks, ``--decoder-first/last-pipeline-num-layers`` must be > 0 and divisible by vpp, and a
    chunk that holds nothing but a P2P hop is no layout anyone runs (Megatron's
    ``--pipeline-model-parallel-layout`` grammar would accept one; plan3d does not write it).
    """
    return tuple(max(0, vpp - (r == 0) - (r == pp - 1)) for r in range(pp))


def chunk_problems(layers_per_stage: tuple[int, ...] | list[int], vpp: int) -> list[str]:
    """Stages with a chunk of no transformer layer other than the embedding's or the loss's
    (:func:`min_stage_layers`), as one line naming the field and the fix."""
    low = min_stage_layers(len(layers_per_stage), vpp)
    if all(n >= need for n, need in zip(layers_per_stage, low)):
        return []
    ends = f"{low[0]} on the first and last" if vpp > 1 else "0 on the first and last"
    return [f"layers_per_stage: every chunk needs a transformer layer except rank 0's first (the embedding) and the "
            f"last rank's last (the loss): at least vpp({vpp}) layers per stage, {ends}; got {list(layers_per_stage)}"]


def chunk_split(layers_per_stage: tuple[int, ...] | list[int], vpp: int) -> tuple[tuple[int, ...], ...]:
    """Layers of each virtual stage, per pipeline rank: ``out[r][c]`` is chunk ``c`` of rank ``r``.

    A stage of ``n`` layers splits into ``vpp`` chunks of ``n // vpp`` or one more. The shorter chunks
    go where the embedding and the loss sit, as Megatron's ``--account-for-embedding-in-pipeline-split``
    and ``--account-for-loss-in-pipeline-split`` count each as one layer (Megatron-LM core_v0.16.1
    ``transformer_config.py``): first on rank 0 (the embedding is in its chunk 0), last on every other
    rank (the loss ends the last rank's last chunk). Llama 3 405B (Dubey et al. 2024, section 3.3.2):
    126 layers on 16 stages, the first and the last stage one layer short: 7 + 14 x 8 + 7; at vpp 8
    rank 0's chunk 0 and rank 15's chunk 7 hold no transformer layer (:func:`min_stage_layers`).
    """
    return tuple(stage_chunks(n, vpp, first=r == 0) for r, n in enumerate(layers_per_stage))


def recomputed_share(layers: int, vpp: int, first: bool, recompute: str, num_layers: int | None,
                     interval: int | None = None) -> tuple[float, float]:
    """(share of a stage's layers whose forward runs again in the backward, smallest such share of any of its
    chunks that holds layers). (1, 1) under full recompute of every layer, (0, 0) under none or selective (whose
    recomputed modules are costed per layer). With ``num_layers`` K (``Plan.recompute_num_layers``, Megatron's
    block method) a chunk of n layers (:func:`stage_chunks`) recomputes its first min(K, n): the first share is
    the stage's recompute time over full recompute's, exactly; the second bounds its saved activations from
    above (``planner.memory.stage_saved_bytes``), exactly when the chunks are equal. With ``interval`` N
    (``Plan.recompute_interval``, torchtitan's per-layer AC) the rank's k-th layer (k = 1, 2, ... over its
    chunks) is recomputed where k % N == 0: floor(L / N) of its L layers, exactly; any n consecutive layers hold
    at least floor(n / N) of them, so the smallest chunk share is bounded by min floor(n / N) / n whatever order
    the framework splits the chunks in (exactly at vpp 1)."""
    if recompute != "full":
        return 0.0, 0.0
    chunks = [c for c in stage_chunks(layers, vpp, first) if c]
    if not chunks or (num_layers is None and interval is None):
        return 1.0, 1.0
    if interval is not None:
        return (layers // interval) / layers, min((c // interval) / c for c in chunks)
    return (sum(min(num_layers, c) for c in chunks) / sum(chunks),
            min(min(num_layers, c) / c for c in chunks))


def checkpointed_layers(layers: int, vpp: int, first: bool, recompute: str, num_layers: int | None,
                        interval: int | None = None) -> tuple[bool, ...]:
    """Per layer of a stage, in build order (chunk after chunk, :func:`stage_chunks`): recomputed whole in the
    backward or not. Full recompute: all; Megatron's block method (``num_layers`` K): the first K of each chunk
    (core_v0.16.1 ``transformer_block.py`` ``_checkpointed_forward``); torchtitan's per-layer AC (``interval``
    N): the k-th layer where k % N == 0 (``_apply_layer_sac``); none and selective: none."""
    if recompute != "full":
        return (False,) * layers
    if interval is not None:
        return tuple((k + 1) % interval == 0 for k in range(layers))
    if num_layers is None:
        return (True,) * layers
    return tuple(i < num_layers for c in stage_chunks(layers, vpp, first) for i in range(c))


def stage_chunks(layers: int, vpp: int, first: bool) -> tuple[int, ...]:
    """One stage's chunks as :func:`chunk_split` places them: the shorter first on rank 0 (``first``),
    last on every other rank."""
    q, rem = divmod(layers, vpp)
    long, short = [q + 1] * rem, [q] * (vpp - rem)
    return tuple(short + long) if first else tuple(long + short)


def uneven_chunks(layers: int, vpp: int, first: bool) -> bool:
    """Whether one stage's chunks (:func:`stage_chunks`) hold unequal numbers of layers: an empty (embedding or
    loss) chunk, or a stage whose layers ``vpp`` does not divide."""
    return vpp > 1 and len(set(stage_chunks(layers, vpp, first))) > 1


def empty_chunks(layers: int, vpp: int, first: bool) -> int:
    """Chunks of one stage that hold no transformer layer (:func:`stage_chunks`; only rank 0's embedding
    chunk and the last rank's loss chunk may, :func:`min_stage_layers`)."""
    return stage_chunks(layers, vpp, first).count(0) if vpp > 1 else 0


def fp8_blockwise_problems(hardware: HardwareSpec, training: TrainingSpec) -> list[str]:
    """Where ``fp8_recipe: blockwise`` cannot run as written. Megatron-Core builds Transformer Engine's
    ``Float8BlockScaling`` for ``--fp8-recipe blockwise`` (core_v0.16.1 ``fp8_utils.py`` ``get_fp8_recipe``); no other
    framework plan3d emits for has that recipe (torchtitan's float8 converters are torchao's tensorwise and rowwise).
    On Blackwell it runs, emulated through MXFP8 (``planner.cost.gemm_precision``; Megatron-LM's own functional test
    ``gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph`` trains with it on GB200)."""
    if training.precision != "fp8" or training.fp8_recipe != "blockwise":
        return []
    if training.framework not in ("megatron", "nemo"):
        return [f"fp8_recipe: blockwise is Transformer Engine's Float8BlockScaling (Megatron --fp8-recipe "
                f"blockwise), which {training.framework} does not run; use framework megatron or nemo, or "
                "fp8_recipe tensorwise"]
    return []


def job_problems(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec) -> list[str]:
    """What is wrong with the job whatever the plan: sequence too long, fp8 without fp8 units."""
    errors = whole_moe_graph_problems(model, training)
    if training.cuda_graph_modules and training.framework not in ("megatron", "nemo"):
        # Megatron's per-layer scopes (--cuda-graph-impl transformer_engine --cuda-graph-scope): no other framework's
        # launch file carries them, so their launch saving (cost.moe_host_s) would be claimed for a run without them
        errors.append(f"cuda_graph_modules: per-layer CUDA-graph scopes are Megatron's (--cuda-graph-impl "
                      f"transformer_engine --cuda-graph-scope); {training.framework} has none (torchtitan's whole-step "
                      f"graph is step_cuda_graph); drop --cuda-graph-modules or use framework megatron or nemo")
    if training.fp16 and training.framework == "torchtitan":
        from planner.frameworks.torchtitan import NO_FP16

        errors.append(f"fp16: {NO_FP16}; use precision bf16, or framework megatron, nemo or deepspeed")
    if model.max_seq_len is not None and training.seq_len > model.max_seq_len:
        # Megatron's validate_args asserts --max-position-embeddings >= --seq-length whatever the position type, and
        # torchtitan's decoder config refuses a training seq_len above its RoPE max_seq_len: a longer context is
        # another model file. A learned table grows with it (more parameters); RoPE and ALiBi hold nothing sized by it
        fix = ("its learned position table has that many rows, so a longer context is a model file with a larger "
               "max_seq_len (more parameters)" if model.position_embedding == "learned" else
               f"for longer-context training give a model file with max_seq_len >= {training.seq_len} (`plan3d show "
               f"MODEL --json > FILE` writes one to edit; {model.position_embedding} positions have no parameters, "
               "so nothing else changes: Megatron's --max-position-embeddings)")
        errors.append(f"seq_len: {training.seq_len} > max_seq_len({model.max_seq_len}) of {model.name}; {fix}, or "
                      f"a --seq-len of at most {model.max_seq_len}")
    if training.precision != "bf16":
        try:
            hardware.peak_flops(training.precision)
        except ValueError as err:
            errors.append(str(err))
    errors += fp8_blockwise_problems(hardware, training)
    from planner.frameworks import get as framework_profile

    if model.mtp_num_layers and training.framework not in ("megatron", "nemo"):
        errors.append(f"mtp_num_layers: {training.framework} trains no multi-token-prediction module (Megatron "
                      "--mtp-num-layers); use framework megatron or nemo, or set mtp_num_layers: 0 in the model spec")
    if training.cross_entropy_fusion != "none" and training.framework not in ("megatron", "nemo"):
        errors.append(f"cross_entropy_fusion: {training.framework} has no Megatron loss fusion "
                      "(--cross-entropy-loss-fusion); use framework megatron or nemo, or none")
    if training.moe_token_dispatcher in FLEX_DISPATCHERS and not framework_profile(training.framework).runs_deepep:
        # plan3d's DeepEP and HybridEP (cost.deepep_time_s, memory.deepep_buffer_bytes, memory.hybridep_buffer_bytes)
        # are Megatron-Core's flex dispatcher; torchtitan builds DeepEP v2's ElasticBuffer (torchtitan 0.3.0
        # models/common/config_utils.py), DeepSpeed has none, and neither emitter writes it
        errors.append(f"moe_token_dispatcher: {training.moe_token_dispatcher} is modelled as Megatron-Core's flex "
                      f"dispatcher, which {training.framework} does not run; use framework megatron or nemo, or "
                      "--moe-dispatcher alltoall")
    if training.moe_token_dispatcher == "deepep" and model.is_moe and model.capacity_factor is not None:
        # core_v0.16.1 TransformerConfig.__post_init__ (plan3d's capacity_factor is always padded)
        errors.append("moe_token_dispatcher: Megatron's flex dispatcher with DeepEP takes no drop-and-pad routing "
                      "('Flex token dispatcher with deepep backend does not support "
                      "moe_pad_expert_input_to_capacity'); use --moe-dispatcher alltoall, or drop capacity_factor from "
                      "the model spec")
    if training.moe_token_dispatcher == "allgather" and training.moe_a2a_overlap and model.is_moe:
        # core_v0.16.1 TransformerConfig.__post_init__: "overlap_moe_expert_parallel_comm is supported with
        # alltoall/flex token dispatcher"; a contradiction of the job's own switches, refused before any search
        errors.append("moe_a2a_overlap: Megatron runs the all-to-all overlap with the alltoall or flex dispatcher "
                      "only ('overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher'); "
                      "use --moe-dispatcher alltoall or drop --moe-a2a-overlap")
    if training.moe_token_dispatcher == "allgather" and training.framework not in ("megatron", "nemo"):
        # MoEAllGatherTokenDispatcher is Megatron-Core's (core_v0.16.1 moe/token_dispatcher.py)
        errors.append(f"moe_token_dispatcher: allgather is Megatron-Core's MoEAllGatherTokenDispatcher, which "
                      f"{training.framework} does not run; use framework megatron or nemo, or --moe-dispatcher "
                      "alltoall")
    mods = training.recompute_modules
    if mods != ("core_attn",):
        if training.framework not in ("megatron", "nemo"):
            errors.append(f"recompute_modules: {training.framework} has no per-module selective recompute "
                          "(Megatron --recompute-modules); use framework megatron or nemo, or drop it")
        if "mla_up_proj" in mods and not model.is_mla:  # core_v0.16.1 transformer_config.py __post_init__
            errors.append(f"recompute_modules: mla_up_proj needs multi-latent attention, which {model.name} has not; "
                          "drop mla_up_proj")
        if "moe_act" in mods and model.is_moe and not training.moe_grouped_gemm:  # ibid.
            errors.append("recompute_modules: Megatron recomputes moe_act only in the grouped experts ('moe_act in "
                          "recompute_modules is only supported with moe_grouped_gemm'); add --moe-grouped-gemm or drop "
                          "moe_act")
        if (training.precision == "fp8" and training.fp8_recipe == "delayed"
                and {"moe_act", "layernorm"} & set(mods)):  # ibid.: "Delayed scaling does not support ..."
            errors.append("recompute_modules: moe_act and layernorm recompute do not run with fp8 delayed scaling "
                          "(Megatron); use --fp8-recipe tensorwise or drop them")
    if training.distribute_saved_activations and training.framework not in ("megatron", "nemo", "deepspeed"):
        errors.append(f"distribute_saved_activations: {training.framework} has no distributed checkpoint (Megatron "
                      "--distribute-saved-activations, DeepSpeed partition_activations); use framework megatron, nemo "
                      "or deepspeed, or drop it")
    if training.bf16_layers_at_start or training.bf16_layers_at_end:
        where = "bf16_layers_at_start/end: Megatron's --first-last-layers-bf16"
        if training.precision not in ("fp8", "mxfp8", "nvfp4"):
            errors.append(f"{where} keeps layers out of FP8/FP4; the job is {training.precision}; drop them")
        elif training.precision == "fp8" and training.fp8_recipe == "delayed":  # TransformerConfig.__post_init__
            errors.append(f"{where}: Megatron refuses it with delayed scaling ('Delayed scaling does not support "
                          "first / last layer in BF16'); use fp8_recipe tensorwise")
        if training.framework not in ("megatron", "nemo"):
            errors.append(f"{where}; {training.framework} has none; use framework megatron or nemo, or drop them")
        if training.fp8_params:
            errors.append(f"{where} with fp8_params: the bf16 layers' 16-bit weights are not modelled; drop one")
        if training.bf16_layers_at_start + training.bf16_layers_at_end > model.num_layers:
            errors.append(f"{where}: {training.bf16_layers_at_start} + {training.bf16_layers_at_end} layers of "
                          f"{model.num_layers}")
    if training.defer_embedding_wgrad and training.framework not in ("megatron", "nemo"):
        errors.append(f"defer_embedding_wgrad: Megatron's deferred output-layer weight gradients; {training.framework} "
                      "has none; use framework megatron or nemo, or drop it")
    if training.unfused_swiglu and (training.framework not in ("megatron", "nemo") or model.is_moe
                                    or model.activation != "swiglu"):
        errors.append("unfused_swiglu: Megatron's eager SwiGLU (--no-bias-swiglu-fusion) is modelled for the dense "
                      f"SwiGLU MLP under megatron or nemo, not {model.name} under {training.framework}; drop it")
    if training.attention_mask_in_dataloader and training.framework not in ("megatron", "nemo"):
        errors.append(f"attention_mask_in_dataloader: Megatron-LM's dataloader mask; {training.framework} builds "
                      "none; use framework megatron or nemo, or drop it")
    if training.pipeline_kept_outputs != "none" and training.framework not in ("torchtitan", "torch"):
        errors.append(f"pipeline_kept_outputs: {training.framework} does not run torch.distributed.pipelining, whose "
                      "schedules keep the stage outputs; use framework torchtitan or torch, or drop it")
    if training.grad_reduce_in_bf16 and training.framework in ("torchtitan", "torch"):
        errors.append(f"grad_reduce_in_bf16: {training.framework} reduces gradients in float32 (torchtitan 0.3.0 "
                      "config/configs.py: training.mixed_precision_reduce takes only \"float32\"; FSDP2's "
                      "MixedPrecisionPolicy reduce_dtype float32, as plan3d validate runs it); drop grad_reduce_in_bf16")
    if training.step_cuda_graph and training.framework != "torchtitan":
        errors.append(f"step_cuda_graph: the whole-step CUDA graph is torchtitan's (--training.disable_cuda_graphs "
                      f"off); {training.framework} does not capture one here; use framework torchtitan or drop it")
    if training.deepspeed != DeepSpeedZero() and training.framework != "deepspeed":
        errors.append(f"deepspeed: DeepSpeed's engine settings are read for framework deepspeed only, and "
                      f"{training.framework} would ignore them; use framework deepspeed, or drop the deepspeed section")
    if training.tp_comm_overlap and training.framework == "torchtitan" and not training.compiled_blocks:
        errors.append("tp_comm_overlap: torchtitan's async TP is a torch.compile pass over the blocks (0.3.0 "
                      "CompileConfig: \"Async TP requires 'model' in --compile.components and --compile.enable\"); "
                      "add --compile or drop --tp-comm-overlap")
    if training.dist_optimizer_instances > 1 and training.framework not in ("megatron", "nemo"):
        errors.append(f"dist_optimizer_instances: partial distributed optimizers are Megatron-Core's "
                      f"(--num-distributed-optimizer-instances); {training.framework} has none; use framework megatron "
                      "or nemo, or 1")
    elif training.dist_optimizer_instances > 1 and training.optimizer_dtype == "bf16-apex":
        errors.append("dist_optimizer_instances: NeMo 1's Apex optimizer (optimizer_dtype bf16-apex) shards its own way; "
                      "partial distributed optimizers are Megatron-Core's, use optimizer_dtype fp32 or bf16, or 1")
    errors += muon_problems(training)
    if training.compile and training.framework not in ("torchtitan", "torch"):  # torch: torchtitan's code, as read
        errors.append(f"compile: torch.compile of the blocks and the loss is modelled for torchtitan only "
                      f"(--compile.enable); {training.framework} runs eager here, drop compile")
    return errors + framework_profile(training.framework).job_problems(training.precision, training.fp8_params,
                                                                        training.optimizer_dtype)


def muon_problems(training: TrainingSpec) -> list[str]:
    """What Megatron-Core core_v0.16.1 refuses of a job with Muon (``training.optimizer``), one line each:
    ``arguments.py`` validate_args asserts no distributed optimizer, no overlap of the gradient reduce or the
    parameter gather, no Megatron-FSDP or torch FSDP2 (the ZeRO stage: ``FrameworkProfile.optimizer_zero_stages``);
    ``optimizer/muon.py`` ``get_megatron_muon_optimizer`` raises for fp16 and has no precision-aware optimizer
    ("TODO(boxiangw): support precision aware optimizer"); ``--fp8-param-gather`` needs the distributed optimizer or
    Megatron-FSDP; partial distributed optimizers are the distributed optimizer's."""
    if training.optimizer == "adam":
        return []
    name = f"optimizer: {training.optimizer} (Megatron-Core's Muon)"
    if training.framework not in ("megatron", "nemo"):
        return [f"{name} is modelled for frameworks megatron and nemo; {training.framework} runs AdamW here; use "
                "framework megatron, or optimizer adam"]
    errors = []
    if training.optimizer_dtype != "fp32":
        errors.append(f"{name} keeps fp32 states (muon.py: no precision-aware optimizer); use optimizer_dtype fp32")
    if training.fp16:
        errors.append(f"{name} trains bf16, not fp16 (muon.py: 'muon with fp16 is not supported'); drop fp16")
    if training.fp8_params:
        errors.append(f"{name} runs without the distributed optimizer, which --fp8-param-gather needs; drop fp8_params")
    if training.dist_optimizer_instances > 1:
        errors.append(f"{name} runs without the distributed optimizer (validate_args); use dist_optimizer_instances 1")
    return errors


def plan_problems(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, plan: Plan) -> list[str]:
    """Every way ``plan`` does not fit ``model`` and ``training``, one line each, naming the field."""
    t, p, d, c, v = plan.tp, plan.pp, plan.dp, plan.cp, plan.vpp
    L, a, g = model.num_layers, model.num_attention_heads, model.kv_heads
    B, b, s = training.global_batch_size, plan.micro_batch_size, training.seq_len
    m = microbatch_count(B, b, d)  # read only where b * d divides B
    hardware = hardware.for_job(training.num_gpus)
    errors = []
    if plan.world_size != training.num_gpus:
        errors.append(f"plan: tp({t}) * pp({p}) * dp({d}) * cp({c}) = {plan.world_size} != num_gpus({training.num_gpus})")
    if B % (b * d):
        errors.append(f"global_batch_size: {B} is not divisible by micro_batch_size({b}) * dp({d}) = {b * d}")
    elif plan.num_microbatches is not None and plan.num_microbatches != m:
        errors.append(f"num_microbatches: {plan.num_microbatches} != global_batch_size({B}) / "
                      f"(micro_batch_size({b}) * dp({d})) = {m}")
    if a % t:
        errors.append(f"tp: num_attention_heads({a}) is not divisible by tp({t})")
    straddle = hardware.tp_straddles(t, training.num_gpus)
    if straddle:
        errors.append(f"tp: tp({t}) {straddle}")
    if g % t and t % g:
        errors.append(f"tp: num_kv_heads({g}) is not divisible by tp({t}), nor tp by num_kv_heads to replicate them")
    if model.ffn_size % t:
        errors.append(f"tp: ffn_hidden_size({model.ffn_size}) is not divisible by tp({t})")
    if plan.layers_per_stage is None and L % (p * v):
        errors.append(f"pp: num_layers({L}) is not divisible by pp({p}) * vpp({v}) = {p * v}; "
                      "choose other degrees or give layers_per_stage")
    if plan.layers_per_stage is not None:
        if sum(plan.layers_per_stage) != L:
            errors.append(f"layers_per_stage: sum {sum(plan.layers_per_stage)} != num_layers({L})")
    if plan.cpu_offload_layers >= L:
        # core_v0.16.1 transformer_config.py: "CPU offloading can be done only for layers less than num_layers"
        errors.append(f"cpu_offload_layers: {plan.cpu_offload_layers} must be less than num_layers({L}); "
                      f"give at most {L - 1}")
    errors += moe_plan_problems(model, hardware, plan)
    errors += deepep_group_problems(model, training, plan)
    hybridep = hybridep_domain_problem(model, training, plan.ep, plan.expert_tp, hardware)
    errors += [hybridep] if hybridep else []
    if c > 1 and s % (2 * c):
        errors.append(f"cp: seq_len({s}) is not divisible by 2 * cp({c}) = {2 * c} (load-balanced causal split)")
    if plan.pipeline_schedule is not None and B % (b * d) == 0:
        from planner.schedules import schedule_problems  # the framework's own rules (docs/schedules.md)

        errors += schedule_problems(plan.pipeline_schedule, training.framework, p, v, m,
                                    plan.microbatch_group_size)
        if p == 1 and plan.pipeline_schedule != "1f1b":
            errors.append(f"pipeline_schedule: {plan.pipeline_schedule} needs pp > 1 (pp is 1)")
    elif v > 1 and B % (b * d) == 0:  # the default interleaved schedule, by the framework's own rules
        from planner.schedules import framework_family, interleaved_problems, schedule_problems

        if framework_family(training.framework) == "torch":
            errors += schedule_problems("interleaved", training.framework, p, v, m)
        else:
            errors += interleaved_problems(p, v, m, plan.microbatch_group_size)
    errors += distributed_checkpoint_problems(training, plan)
    errors += pipeline_switch_problems(model, training, plan.pp)
    errors += a2a_overlap_problems(model, training, plan)
    errors += cuda_graph_problems(model, training, plan)
    from planner.frameworks import get as framework_profile
    from planner.frameworks.torchtitan import step_cuda_graph_by_default

    if training.step_cuda_graph and not step_cuda_graph_by_default(plan.pp, plan.ep):
        errors.append("step_cuda_graph: torchtitan's trainer refuses its CUDA graph with pipeline parallelism or "
                      "expert parallelism's standard token dispatcher (trainer.py _validate_cuda_graphs); set it "
                      "false (--training.disable_cuda_graphs)")
    if training.framework == "deepspeed" and training.deepspeed.pipeline_engine and plan.zero_stage >= 2:
        errors.append(f"zero_stage: DeepSpeed's pipeline engine (training.deepspeed.pipeline_engine) refuses ZeRO stage "
                      f"{plan.zero_stage} (deepspeed/runtime/pipe/engine.py); use stage 0/1, or a plain model "
                      "(Megatron-DeepSpeed --no-pipeline-parallel)")
    errors += framework_profile(training.framework).plan_problems(plan, model, training.optimizer_key)
    errors += dist_optimizer_problems(training, plan)
    return errors + job_problems(model, hardware, training)


def dist_optimizer_problems(training: TrainingSpec, plan: Plan) -> list[str]:
    """What Megatron-Core refuses of ``training.dist_optimizer_instances`` N > 1 under ``plan``, one line each:
    core_v0.16.1 ``parallel_state.py`` asserts that N divides dp x cp ("Data parallel size should be divisible by
    partial DistOpt shard factor") and the expert-data-parallel size; the instances are copies of the distributed
    optimizer, so ZeRO 1: core_v0.16.1 ``distributed_data_parallel.py`` refuses them without it ("Partial DistOpt cannot
    be used without DistOpt"), and plan3d does not model Megatron-FSDP's hybrid sharding, ZeRO 2/3, with them."""
    n = training.dist_optimizer_instances
    if n == 1:
        return []
    errors = []
    if plan.zero_stage != 1:
        errors.append(f"dist_optimizer_instances: {n} copies of the distributed optimizer are modelled with ZeRO 1 "
                      f"(--use-distributed-optimizer) only, not zero_stage {plan.zero_stage} (ZeRO 0: Megatron-Core "
                      "refuses it, 'Partial DistOpt cannot be used without DistOpt'; Megatron-FSDP's hybrid sharding, "
                      "ZeRO 2/3, is not modelled)")
    if (plan.dp * plan.cp) % n:
        errors.append(f"dist_optimizer_instances: {n} does not divide dp({plan.dp}) * cp({plan.cp}) (Megatron-Core "
                      "asserts it, parallel_state.py)")
    elif plan.ep > 1 and plan.expert_dp % n:
        errors.append(f"dist_optimizer_instances: {n} does not divide the expert-data-parallel size {plan.expert_dp} "
                      "(Megatron-Core asserts it, parallel_state.py)")
    return errors


def pipeline_kept_mode(training: TrainingSpec, plan: Plan) -> str | None:
    """``training.pipeline_kept_outputs`` where it applies: a pipeline (pp > 1) whose schedule keeps outputs; else None
    (planner.memory.pipeline_kept_output_bytes)."""
    kept = training.pipeline_kept_outputs
    return kept if plan.pp > 1 and kept != "none" else None


def a2a_overlap_problems(model: ModelSpec, training: TrainingSpec, plan: Plan) -> list[str]:
    """What Megatron-Core refuses of a MoE plan run with the all-to-all overlap (``training.moe_a2a_overlap``,
    ``--overlap-moe-expert-parallel-comm``), one line each: core_v0.16.1 ``TransformerConfig.__post_init__`` asserts
    expert parallelism, virtual pipeline stages when pp > 1, no full recomputation, at most one MTP layer and then
    pp > 1; and it is Megatron-Core's schedule (``combined_1f1b.py``), which only megatron and nemo run (its other
    assert, the alltoall or flex dispatcher, is a job problem: :func:`job_problems`). Empty for a dense model (the
    switch has nothing to overlap) or without the switch."""
    if not (training.moe_a2a_overlap and model.is_moe):
        return []
    if training.framework not in ("megatron", "nemo"):
        return [f"moe_a2a_overlap: Megatron-Core's --overlap-moe-expert-parallel-comm; framework {training.framework} "
                "does not run it; drop --moe-a2a-overlap"]
    errors = []
    if plan.ep == 1:
        errors.append("moe_a2a_overlap: Megatron's all-to-all overlap needs expert parallelism; give ep > 1 or "
                      "drop --moe-a2a-overlap")
    if plan.pp > 1 and plan.vpp == 1:
        errors.append(f"moe_a2a_overlap: with pp({plan.pp}) > 1 Megatron needs virtual pipeline stages for the "
                      "all-to-all overlap; give vpp > 1 or drop --moe-a2a-overlap")
    if plan.recompute == "full":
        errors.append("moe_a2a_overlap: Megatron refuses full recomputation with the all-to-all overlap; recompute "
                      "none or selective, or drop --moe-a2a-overlap")
    if model.mtp_num_layers > 1 or (model.mtp_num_layers == 1 and plan.pp == 1):
        errors.append(f"moe_a2a_overlap: Megatron takes at most one MTP layer with the all-to-all overlap, and then "
                      f"pp > 1 (mtp_num_layers {model.mtp_num_layers}, pp {plan.pp}); drop --moe-a2a-overlap")
    return errors


def cuda_graph_problems(model: ModelSpec, training: TrainingSpec, plan: Plan) -> list[str]:
    """What Megatron-Core refuses of a plan whose job captures parts of each layer in CUDA graphs
    (``training.cuda_graph_modules``, written as ``--cuda-graph-impl transformer_engine --cuda-graph-scope ...``),
    one line each, from core_v0.16.1 ``TransformerConfig.__post_init__``: no CPU offloading ("CUDA graphs not
    supported with CPU offloading"); full recompute only with the full-iteration graph, which plan3d does not write
    ("full recompute is only supported with full iteration CUDA graph"); the moe scopes only on a MoE model ("moe
    cuda graph is only supported for MoE"); under selective recompute, not the ``moe`` module with a graphed
    router ("moe recompute is not supported with moe_router CUDA graph"), nor, with attention dropout, the
    recomputed attention core inside a graphed attention ("attention dropout is not supported with graphed attention
    recomputation"). The whole-MoE-layer scope's rules hold whatever the plan (:func:`whole_moe_graph_problems`,
    part of :func:`job_problems`). Megatron's rules, so only for megatron and nemo; empty without graphs."""
    graphs = training.cuda_graph_modules
    if not graphs or training.framework not in ("megatron", "nemo"):
        return []
    errors = []
    fix = "or drop --cuda-graph-modules"
    if plan.cpu_offload_layers:
        errors.append(f"cuda_graph_modules: Megatron refuses CUDA graphs with CPU offloading (cpu_offload_layers "
                      f"{plan.cpu_offload_layers}); offload nothing {fix}")
    if plan.recompute == "full":
        errors.append(f"cuda_graph_modules: Megatron takes full recompute only with a full-iteration CUDA graph, not "
                      f"per-layer graphs; recompute none or selective {fix}")
    if not model.is_moe and any(g.startswith("moe") for g in graphs):
        errors.append(f"cuda_graph_modules: the moe_* scopes need a MoE model (Megatron: 'moe cuda graph is only "
                      f"supported for MoE'); keep attn {fix}")
    if plan.recompute == "selective":
        modules = training.recompute_modules
        if "moe" in modules and "moe_router" in graphs:
            errors.append("cuda_graph_modules: Megatron refuses the moe recompute module with a graphed moe_router; "
                          "drop moe from --recompute-modules or moe_router from --cuda-graph-modules")
        if model.dropout and "core_attn" in modules and "attn" in graphs:
            errors.append("cuda_graph_modules: Megatron refuses attention dropout with a recomputed attention core "
                          "inside a graphed attention; drop core_attn from --recompute-modules, or attn from "
                          "--cuda-graph-modules, or use a model without dropout")
    return errors


def whole_moe_graph_problems(model: ModelSpec, training: TrainingSpec) -> list[str]:
    """What Megatron-Core refuses of the whole-MoE-layer CUDA graph (``"moe"`` in ``training.cuda_graph_modules``,
    ``--cuda-graph-scope moe``), one line each, whatever the plan: dropless routing (core_v0.16.1
    ``TransformerConfig.__post_init__``: "moe cuda graph is only supported with drop-padding MoE"; plan3d's
    ``capacity_factor`` is always padded) and the all-to-all overlap (transformer_layer.py ``_te_cuda_graph_replay``:
    "EP overlap must be disabled when CUDA graph captures the whole MLP/MoE part"). plan3d also refuses it for a
    clamped activation (``swiglu_limit``), whose blocking host copy (``cost.activation_sync_split``) it cannot place
    in a capture. Megatron's rules, so only for megatron and nemo (the dense-model rule is
    :func:`cuda_graph_problems`')."""
    if not (model.is_moe and "moe" in training.cuda_graph_modules and training.framework in ("megatron", "nemo")):
        return []
    errors = []
    if model.capacity_factor is None:
        errors.append("cuda_graph_modules: Megatron captures the whole MoE layer only with drop-and-pad routing "
                      "('moe cuda graph is only supported with drop-padding MoE'); set capacity_factor in the model "
                      "spec, or capture moe_router instead of moe")
    if training.moe_a2a_overlap:
        errors.append("cuda_graph_modules: Megatron disables the all-to-all overlap when a graph holds the whole "
                      "MoE layer ('EP overlap must be disabled when CUDA graph captures the whole MLP/MoE part'); "
                      "drop --moe-a2a-overlap or capture moe_router instead of moe")
    if model.swiglu_limit is not None:
        errors.append("cuda_graph_modules: the whole-layer MoE graph of a clamped activation (swiglu_limit) is not "
                      "modelled: its blocking host copy (fused_bias_geglu.py weighted_bias_quick_geglu_impl) would "
                      "run inside the capture; capture moe_router instead of moe")
    return errors


def pipeline_switch_problems(model: ModelSpec, training: TrainingSpec, pp: int) -> list[str]:
    """Megatron's pipeline-depth rules for two job switches (the search's tables keep them too): at most
    num_layers // pp bf16 layers at each end (``TrainingSpec.bf16_layers_at_start/end``; core_v0.16.1
    ``TransformerConfig.__post_init__``), and no deferred embedding wgrad without PP (``defer_embedding_wgrad``;
    ``ModelParallelConfig.__post_init__``)."""
    errors = []
    bf16_most = model.num_layers // pp
    if max(training.bf16_layers_at_start, training.bf16_layers_at_end) > bf16_most:
        errors.append(f"pp: Megatron allows at most num_layers // pp = {bf16_most} bf16 layers at each end "
                      f"(bf16_layers_at_start/end {training.bf16_layers_at_start}/{training.bf16_layers_at_end})")
    if training.defer_embedding_wgrad and pp == 1:
        errors.append("pp: Megatron cannot defer the embedding wgrad without pipeline parallelism "
                      "(defer_embedding_wgrad); use pp > 1 or drop it")
    return errors


def distributed_checkpoint_problems(training: TrainingSpec, plan: Plan) -> list[str]:
    """The framework's rules for distributed checkpoints (``TrainingSpec.distribute_saved_activations``).

    Megatron ``--distribute-saved-activations``: core_v0.16.1 ``arguments.py::validate_args`` asserts
    tensor_model_parallel_size > 1 and recompute_granularity full; ``TransformerConfig.__post_init__`` raises with
    sequence parallelism. DeepSpeed's ``partition_activations`` (Megatron-DeepSpeed ``--deepspeed-activation-
    checkpointing --partition-activations``): its checkpoint function is the full-layer one, so recompute full;
    deepspeed 0.19.8 ``runtime/activation_checkpointing/checkpointing.py`` partitions whatever input it is handed
    over the model-parallel group (``partition_activations``: ``get_partition_size`` = numel / mp_size), a
    sequence-parallel shard too, and with one TP rank it keeps the whole input: no further rule."""
    if not training.distribute_saved_activations:
        return []
    errors = []
    deepspeed = training.framework == "deepspeed"
    if plan.tp == 1 and not deepspeed:
        errors.append("distribute_saved_activations: Megatron distributes the checkpointed inputs over the tensor-"
                      "parallel group only, so it needs tp > 1; set tp > 1 or drop --distribute-saved-activations")
    if plan.recompute != "full":
        errors.append(f"distribute_saved_activations: applies to full recompute only (recompute is "
                      f"{plan.recompute}); set recompute full or drop --distribute-saved-activations")
    if plan.sequence_parallel and not deepspeed:
        errors.append("distribute_saved_activations: Megatron refuses it with sequence parallelism (the inputs are "
                      "already split); drop --sequence-parallel or --distribute-saved-activations")
    return errors


def moe_plan_problems(model: ModelSpec, hardware: HardwareSpec, plan: Plan) -> list[str]:
    """Expert-parallel rules of Megatron-Core (``parallel_state.initialize_model_parallel`` and
    ``arguments.py::validate_args``, core_v0.16.1): ``etp*ep`` divides ``tp*cp*dp`` (parallel folding:
    the expert grid ETP x EP x EDP x PP reuses the same ranks as TP x CP x DP x PP); ``ep`` divides the
    experts; ``etp`` divides the expert width; and both need a MoE model."""
    errors = []
    t, c, d, e, et = plan.tp, plan.cp, plan.dp, plan.ep, plan.expert_tp
    if not model.is_moe:
        if e > 1 or plan.etp is not None:
            errors.append(f"ep: ep({e})/etp apply to mixture-of-experts models; {model.name} is dense (set ep 1)")
        return errors
    if model.num_experts % e:
        errors.append(f"ep: num_experts({model.num_experts}) is not divisible by ep({e})")
    if (t * c * d) % (et * e):
        errors.append(f"ep: etp({et}) * ep({e}) = {et * e} does not divide tp({t}) * cp({c}) * dp({d}) = {t * c * d} "
                      "(Megatron folds the expert ranks into the tp x cp x dp ranks)")
    if model.moe_ffn_size % et:
        errors.append(f"etp: moe_ffn_hidden_size({model.moe_ffn_size}) is not divisible by etp({et})")
    straddle = hardware.tp_straddles(et, plan.world_size)
    if straddle and plan.etp is not None:
        errors.append(f"etp: etp({et}) {straddle}")
    return errors


#: DeepEP's recommended configs (deepseek-ai/DeepEP ``deep_ep/buffer.py``, ``Buffer.get_dispatch_config`` and
#: ``get_combine_config``) by expert-group size (etp x ep ranks): the NVLink receive tokens per channel, the same in
#: both configs and in every stored version (the RDMA ones are 128 at every size; some versions also have 48 and 96
#: ranks, left out). Megatron-Core sizes its DeepEP buffer from these configs (core_v0.16.1
#: ``moe/fused_a2a.py::get_buffer``; ``memory.deepep_buffer_bytes``), and DeepEP asserts "Unsupported number of EP
#: ranks" for a size it has none for (:func:`deepep_group_problems`).
DEEPEP_NVL_RECV_TOKENS = {2: 256, 4: 256, 8: 256, 16: 288, 24: 288, 32: 288, 64: 288, 128: 560, 144: 720, 160: 720}
DEEPEP_GROUP_SIZES = tuple(DEEPEP_NVL_RECV_TOKENS)


def deepep_group_problems(model: ModelSpec, training: TrainingSpec, plan: Plan) -> list[str]:
    """The DeepEP dispatcher's own limits on the expert group it runs over (``etp x ep`` ranks: Megatron-Core's flex
    dispatcher communicates over ``tp_ep_group``, core_v0.16.1 ``moe/token_dispatcher.py::MoEFlexTokenDispatcher``):
    more than one rank (its assertion "Flex token dispatcher requires TPxEP > 1") and a size DeepEP has a config for
    (:data:`DEEPEP_GROUP_SIZES`). Only where the job asks for DeepEP on a MoE model."""
    problem = deepep_group_problem(model, training, plan.ep, plan.expert_tp)
    return [problem] if problem else []


def deepep_group_problem(model: ModelSpec, training: TrainingSpec, ep: int, etp: int) -> str | None:
    """:func:`deepep_group_problems` for ``ep`` and the expert TP degree ``etp`` (the search's shapes ask it before
    they build a plan, ``candidates.shapes``). HybridEP, the flex dispatcher's other backend, shares the first rule
    (and its own "The hybrid-ep kernel should be used with at least 2 ranks", deepseek-ai/DeepEP
    ``deep_ep/hybrid_ep_buffer.py``); it sizes its buffer for any group, so it has no table of sizes."""
    dispatcher = training.moe_token_dispatcher
    if dispatcher not in FLEX_DISPATCHERS or not model.is_moe:
        return None
    n = ep * etp
    if n == 1:
        return (f"moe_token_dispatcher: {dispatcher} needs an expert group of more than one rank (etp x ep = 1; "
                "Megatron's flex dispatcher requires TPxEP > 1); use --moe-dispatcher alltoall or ep > 1")
    domain = training.hybridep_ranks_per_domain
    if dispatcher == "hybridep" and domain is not None and n % domain:
        # deep_ep/hybrid_ep_buffer.py: "The number of ranks should be divisible by the number of ranks per node."
        return (f"hybridep_ranks_per_domain: HybridEP needs the expert group's {n} ranks (etp({etp}) x ep({ep})) to "
                f"divide into NVLink domains of {domain}; set NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN to a divisor "
                f"of {n}, or leave it to plan3d")
    if dispatcher == "deepep" and n not in DEEPEP_GROUP_SIZES:
        sizes = ", ".join(map(str, DEEPEP_GROUP_SIZES))
        return (f"moe_token_dispatcher: DeepEP has no buffer config for an expert group of {n} ranks (etp({etp}) x "
                f"ep({ep})); it supports {sizes}; use --moe-dispatcher alltoall or another ep")
    return None


def hybridep_domain_problem(model: ModelSpec, training: TrainingSpec, ep: int, etp: int,
                            hardware: HardwareSpec) -> str | None:
    """HybridEP's own rule on how its group sits on the NVLink domains: ``group_size % ranks_per_nvlink_domain == 0``
    (deepseek-ai/DeepEP hybrid-ep ``deep_ep/hybrid_ep_buffer.py``, "The number of ranks should be divisible by the
    number of ranks per node"). The ``etp x ep`` group is ``etp x ep`` consecutive ranks (Megatron-Core's expert grid,
    ``layout.block_domain_counts``); where the layout puts a different number of them in each domain the job's launch cannot
    say one count (``plan3d emit`` writes the layout's; ``memory.hybridep_domain_ranks``), and HybridEP asserts. A job
    that states its count (``hybridep_ranks_per_domain``) is checked by :func:`deepep_group_problem` instead."""
    if training.moe_token_dispatcher != "hybridep" or not model.is_moe or training.hybridep_ranks_per_domain is not None:
        return None
    from planner.layout import block_domain_counts  # layout imports this module

    domain, size = hardware.job_nvlink_domain(training.num_gpus), ep * etp
    counts = block_domain_counts(size, training.num_gpus, domain)
    if len(counts) <= 1:
        return None
    return (f"moe_token_dispatcher: HybridEP needs every expert group of {size} ranks (etp({etp}) x ep({ep})) to have "
            f"the same number of ranks in each NVLink domain it touches, but on {domain}-GPU domains they have "
            f"{', '.join(map(str, sorted(counts)))}; choose an etp x ep that divides {domain} or is a multiple of it, "
            "or --moe-dispatcher deepep")


class Scenario(_Spec):
    """A complete, consistent job: the specs plus a plan that fits them. This is a plan file."""

    model: ModelSpec
    hardware: HardwareSpec
    training: TrainingSpec
    plan: Plan

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        _problems(plan_problems(self.model, self.hardware, self.training, self.plan))
        return self

    @property
    def num_microbatches(self) -> int:
        """m = B / (b * d) (formulas.md shared symbols)."""
        return plan_microbatches(self.training, self.plan)

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return self.plan.stage_layers(self.model.num_layers)

    def resolved_plan(self) -> Plan:
        """The plan with ``num_microbatches`` and ``layers_per_stage`` filled in."""
        return self.plan.model_copy(update={"num_microbatches": self.num_microbatches,
                                            "layers_per_stage": self.stage_layers})


def microbatch_count(global_batch_size, micro_batch_size, dp):
    """m = B / (b * d): micro-batches each pipeline runs per step (formulas.md, shared symbols; Narayanan et al.
    2021, section 2.2). Integers or numpy arrays alike; exact only where b * d divides B, which
    :func:`plan_problems` requires of a plan."""
    return global_batch_size // (micro_batch_size * dp)


def plan_microbatches(training: TrainingSpec, plan: Plan) -> int:
    """:func:`microbatch_count` of ``plan`` under ``training``'s global batch."""
    return microbatch_count(training.global_batch_size, plan.micro_batch_size, plan.dp)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded as Megatron-LM pads it: to a multiple of ``multiple * tp``.

    Source: Megatron-LM ``megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding``
    (``--make-vocab-size-divisible-by``, default 128).
    """
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)
