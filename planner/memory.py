"""Memory per pipeline stage: weights, gradients, optimizer states, activations, other.

Choices where sources disagree (formulas.md, "Contradictions"):

* **Bytes per parameter** (contradiction 1): Megatron-LM's defaults for bf16 training, 2 B bf16
  weights + 4 B fp32 gradient buffer (``main_grad``) + 12 B optimizer (fp32 master, Adam m, v) =
  18 B, because plan3d emits Megatron launch flags. ZeRO sharding divides by the size of the group
  that holds identical weights, DP x CP (Megatron's distributed optimizer uses the DP group with
  context parallel), never by the total GPU count as DeepSpeed's and EleutherAI's estimators do.
  ZeRO-1 is Megatron's distributed optimizer (``6 + 12/d`` B/param), ZeRO-2 also shards gradients,
  ZeRO-3 also weights (FSDP) and keeps the working set of two gathered layers.
* **Activations** (contradiction 4): Korthikanti et al. 2022 section 4.1 accounting, term by term
  (see :func:`layer_activation_terms`), generalised to GQA, SwiGLU, no-dropout and FlashAttention
  by the same rule (formulas.md A3, "Modern-model adjustments"). No blanket x1.05 factor: every
  term is named.
* **Logits** (contradiction 5): the last stage holds ``6 * s * b * V / t`` bytes for one
  micro-batch: Megatron's vocab-parallel cross entropy upcasts the bf16 logits to fp32 (2 + 4 B
  per logit live together in forward; the fp32 gradient and its bf16 cast in backward).
* **In-flight micro-batches** (A4): 1F1B stage ``r`` holds ``min(m, p - r)``; the interleaved
  schedule holds ``min(m*v, 2*(p - r - 1) + (v - 1)*p + 1)`` chunk-micro-batches on rank ``r``
  (Megatron ``schedules.py`` warm-up count + 1).

All functions are pure; sizes are bytes per GPU unless the name says otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from planner import frameworks
from planner.layout import block_domain_counts
from planner.specs import (DEEPEP_NVL_RECV_TOKENS, FLASH_ATTENTION, GIB, HardwareSpec, ModelSpec, Plan, Scenario,
                           TrainingSpec, a2a_overlap_problems, distributed_checkpoint_problems, padded_vocab_size,
                           plan_microbatches, stage_chunks, uneven_chunks)

WEIGHT_BYTES = 2  # bf16 weights (fp8 training keeps bf16 weights, Transformer Engine casts per GEMM)
GRAD_BYTES = 4  # fp32 main_grad buffer, Megatron default for bf16 (arguments.py)
OPTIMIZER_BYTES = 12  # fp32 master weights 4 + Adam m 4 + v 4 (ZeRO paper section 3.1, K = 12)
ACT_BYTES = 2  # bf16 activations
FP32_BYTES = 4
KIB = 1024  # the unit the search's memory tables and MemoryEstimate.fits judge in


def usable_kib(usable_gib: float) -> int:
    """The usable memory in whole KiB, rounded down: what a stage's peak, rounded up to whole KiB, is judged against by
    :meth:`StageMemory.fits_in` and by the search's tables (``planner.search``), one rule for both."""
    return int(usable_gib * GIB // KIB)
TOKEN_ID_BYTES = 8  # int64 input ids and labels (Korthikanti section 4.3)


@dataclass(frozen=True)
class StageMemory:
    """Memory of one GPU of pipeline stage ``stage`` (all its TP/CP/DP peers are identical)."""

    stage: int
    layers: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    other_bytes: float
    # the caching allocator's peak reserved, where the framework models it (torchtitan:
    # planner.allocator_trace, never below total_bytes); None: the peak is the allocated total
    reserved_bytes: float | None = None
    # part of grads_bytes: what the optimizer step holds beyond the backward's peak (step_excess_bytes); > 0 where the
    # step's moment, not the backward's, sets the stage's peak
    step_excess_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.other_bytes

    @property
    def peak_bytes(self) -> float:
        """What the stage needs of the device: the reserved peak where modelled, else the allocated total."""
        return self.total_bytes if self.reserved_bytes is None else self.reserved_bytes

    def fits_in(self, usable_gib: float) -> bool:
        """Whether this stage's peak (:attr:`peak_bytes`: reserved where modelled, else allocated) fits ``usable_gib``,
        judged in whole KiB as the search's tables judge it (the peak rounded up, the usable memory down:
        ``planner.search``), so that a plan the estimate passes the search can choose too, and the other way round.
        The rounding can only refuse, by less than 2 KiB."""
        return math.ceil(self.peak_bytes / KIB) <= usable_kib(usable_gib)

    def as_gib(self) -> dict:
        out = {"stage": self.stage, "layers": self.layers,
               **{f"{k}_gib": getattr(self, f"{k}_bytes") / GIB
                  for k in ("weights", "grads", "optimizer", "activations", "other", "total")}}
        if self.reserved_bytes is not None:
            out["reserved_gib"] = self.reserved_bytes / GIB
        return out


@dataclass(frozen=True)
class MemoryEstimate:
    capacity_gib: float
    usable_gib: float
    stages: tuple[StageMemory, ...] = field(default_factory=tuple)

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.peak_bytes)

    @property
    def peak_gib(self) -> float:
        """The peak the framework's logs show: reserved where modelled (torchtitan), else allocated."""
        return self.peak.peak_bytes / GIB

    @property
    def fits(self) -> bool:
        """Whether the peak stage fits the usable memory (:meth:`StageMemory.fits_in`)."""
        return self.peak.fits_in(self.usable_gib)

    def to_dict(self) -> dict:
        """The estimate in GiB; each stage with its own verdict (``fits``, :meth:`StageMemory.fits_in`), the rule the
        whole estimate's ``fits`` applies to its peak stage."""
        return {"capacity_gib": self.capacity_gib, "usable_gib": self.usable_gib, "peak_gib": self.peak_gib,
                "peak_stage": self.peak.stage, "fits": self.fits,
                "stages": [s.as_gib() | {"fits": s.fits_in(self.usable_gib)} for s in self.stages]}


# --- parameters ---------------------------------------------------------------------------------

def kv_heads_per_rank(model: ModelSpec, tp: int) -> float:
    """KV heads on one TP rank: ``g / t``, or 1 when ``t > g`` and the KV heads are replicated."""
    return max(model.kv_heads / tp, 1.0)


@functools.lru_cache(maxsize=1024)
def attention_params_per_rank(model: ModelSpec, tp: int) -> float:
    """Parameters of one layer's attention block on one TP rank.

    Standard/GQA attention (formulas.md A2): QKV column-parallel (weights and biases / t, replicated
    KV heads when ``t > g``), the output projection row-parallel (weights / t, bias replicated),
    full-width QK norms split with their heads, per-head ones replicated; attention sinks (GPT-OSS)
    one per local head.

    MLA as Megatron-Core core_v0.16.1 builds it with Transformer Engine
    (``transformer/multi_latent_attention.py::MLASelfAttention.__init__``, spec
    ``models/gpt/gpt_layer_specs.py``): ``linear_q_down_proj`` ``h x r_q`` and ``linear_kv_down_proj``
    ``h x (r_kv + rope)`` are ``TELinear(parallel_mode="duplicated")``: **replicated** on every TP
    rank, as are the ``q_layernorm`` (``r_q``) and ``kv_layernorm`` (``r_kv``) weights fused into the
    up projections; ``linear_q_up_proj`` ``r_q x a*(nope+rope)`` (or ``linear_q_proj`` ``h x a*(nope+rope)``
    without a q rank) and ``linear_kv_up_proj`` ``r_kv x a*(nope+v)`` are column-parallel (/ t), and
    ``linear_proj`` ``a*v x h`` row-parallel (/ t).
    """
    h, a = model.hidden_size, model.num_attention_heads
    sinks = a / tp if model.attention_sinks else 0.0
    if model.is_mla:
        n = model.norm_weights_per_channel
        rq, rkv, dqk = model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim
        q = (h * rq + n * rq + rq * a * dqk / tp) if rq else h * a * dqk / tp
        kv = h * (rkv + model.qk_rope_head_dim) + n * rkv + rkv * a * (model.qk_nope_head_dim + model.v_head_dim) / tp
        return q + kv + a * model.v_head_dim * h / tp + sinks
    q, kv = model.q_size, 2 * model.kv_channels * kv_heads_per_rank(model, tp)
    bias = (q / tp + kv if model.has_qkv_bias else 0) + (h if model.has_out_proj_bias else 0)
    return h * (q / tp + kv) + (q / tp) * h + bias + model.qk_norm_params(q / tp, kv / 2) + sinks


def mlp_params_per_rank(model: ModelSpec, ffn: int, tp: int) -> float:
    """One MLP of intermediate width ``ffn`` split over ``tp`` ranks: FC1 column-parallel (weights and
    biases / t), FC2 row-parallel (weights / t, bias replicated) (Megatron ``mlp.py::MLP``; a routed
    expert in ``moe/experts.py::TEGroupedMLP`` is split the same way over the expert-TP group)."""
    h = model.hidden_size
    mlp_in = (2 if model.gated_mlp else 1) * ffn / tp
    return h * mlp_in + (ffn / tp) * h + ((mlp_in + h) if model.has_mlp_bias else 0)


@functools.lru_cache(maxsize=4096)
def layer_param_split(model: ModelSpec, tp: int, moe: bool = False, ep: int = 1, etp: int | None = None
                      ) -> tuple[float, float]:
    """(dense, expert) parameters of one layer on one GPU.

    Dense: attention (:func:`attention_params_per_rank`), the layer's norms (replicated), and either the
    dense MLP over ``tp`` or, in a MoE layer (Megatron-Core core_v0.16.1 ``moe/moe_layer.py::MoELayer``),
    the router ``E x h`` (+ E biases), replicated on every TP rank (``moe/router.py::Router.__init__``:
    a plain ``torch.nn.Parameter``, not TP-split) and the shared experts over the attention TP group
    (``moe/shared_experts.py::SharedExpertMLP`` is an ``MLP`` with ``tp_group=pg_collection.tp``), whose
    ``h -> 1`` gate is replicated. Expert: the ``E / ep`` routed experts of this EP rank
    (``BaseMoELayer``: ``num_local_experts = num_moe_experts // ep_size``), each split over the
    expert-TP group of ``etp`` ranks (``TEGroupedMLP`` with ``pg_collection.expt_tp``). Megatron's DDP
    treats the routed experts (``allreduce=False``) apart: their gradients and optimizer states live
    in the expert-data-parallel group (:func:`stage_state_bytes`).
    """
    dense = attention_params_per_rank(model, tp) + model.norms_per_layer * model.norm_params
    if not (moe and model.is_moe):
        return dense + mlp_params_per_rank(model, model.ffn_size, tp), 0.0
    dense += model.router_params()
    if model.shared_expert_ffn_hidden_size is not None:
        dense += mlp_params_per_rank(model, model.shared_expert_ffn_hidden_size, tp)
        dense += model.hidden_size if model.shared_expert_gate else 0
    et = etp or tp
    return dense, model.num_experts / ep * mlp_params_per_rank(model, model.moe_ffn_size, et)


def layer_params_per_rank(model: ModelSpec, tp: int, moe: bool | None = None, ep: int = 1,
                          etp: int | None = None) -> float:
    """Parameters of one layer on one TP rank (dense + expert parts of :func:`layer_param_split`).

    Megatron-LM sharding (formulas.md A2): QKV and FC1 are column-parallel (weights and biases
    / t), the output projection and FC2 row-parallel (weights / t, biases replicated); norms are
    replicated. Replicated KV heads (``t > g``) are stored on every rank that uses them. A full-width
    QK norm (OLMo-2) is split with the heads it normalises; a per-head one is replicated. ``moe``
    (default: a MoE layer when the model has experts) with ``ep``/``etp`` picks the layer kind and
    the expert split.
    """
    dense, expert = layer_param_split(model, tp, model.is_moe if moe is None else moe, ep, etp)
    return dense + expert


def plan_layer_params_per_rank(model: ModelSpec, plan: Plan, moe: bool) -> float:
    """Parameters of one dense (``moe=False``) or MoE layer on one GPU of ``plan``."""
    return layer_params_per_rank(model, plan.tp, moe, plan.ep, plan.expert_tp)


def stage_moe_layer_count(model: ModelSpec, plan: Plan, stage: int, layers: int) -> int:
    """MoE layers among the ``layers`` of stage ``stage`` (``Plan.stage_moe_layers``, vpp-aware); when
    ``layers`` is not the plan's count for that stage, its dense-first layers are kept and the rest are MoE."""
    if not model.is_moe:
        return 0
    counts, planned = plan.stage_moe_layers(model), plan.stage_layers(model.num_layers)
    if stage < len(planned) and layers == planned[stage]:
        return counts[stage]
    dense_here = planned[stage] - counts[stage] if stage < len(planned) else 0
    return max(0, min(layers, layers - dense_here))


def vocab_rows_params(model: ModelSpec, tp: int) -> float:
    """Parameters of one GPU's rows of the word embedding or of the (untied) output layer: the vocabulary padded as
    Megatron pads it (:func:`padded_vocab_size`, ``--make-vocab-size-divisible-by`` x tp), split over TP
    (``VocabParallelEmbedding``, ``ColumnParallelLinear``; torchtitan's embedding is row-sharded the same way)."""
    return padded_vocab_size(model.vocab_size, tp) * model.hidden_size / tp


def stage_param_split(model: ModelSpec, plan: Plan, stage: int, layers: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one GPU of pipeline stage ``stage`` (see :func:`stage_params_per_rank`)."""
    t, p = plan.tp, plan.pp
    moe_layers = stage_moe_layer_count(model, plan, stage, layers)
    dense_l, _ = layer_param_split(model, t, False)
    moe_dense, moe_expert = layer_param_split(model, t, True, plan.ep, plan.expert_tp) if moe_layers else (0.0, 0.0)
    dense = (layers - moe_layers) * dense_l + moe_layers * moe_dense
    rows = vocab_rows_params(model, t)
    if stage == 0:
        dense += rows + model.embedding_params() - model.vocab_size * model.hidden_size
    expert = moe_layers * moe_expert
    if stage == plan.loss_stage:  # rank p - 1, or rank 0 in a V (zbv, dualpipev)
        dense += model.norm_params
        if not model.tied_embeddings or (p > 1 and not plan.v_shaped):  # V: tied copy on the same rank
            dense += rows
        if model.output_bias:  # its own parameter, split over TP with the (padded) vocabulary rows
            dense += padded_vocab_size(model.vocab_size, t) / t
        mtp_dense, mtp_expert = mtp_param_split(model, plan, stage)
        dense, expert = dense + mtp_dense, expert + mtp_expert
    return dense, expert


def mtp_param_split(model: ModelSpec, plan: Plan, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters of the multi-token-prediction modules (``ModelSpec.mtp_num_layers``) on one
    GPU of the loss stage, where Megatron-Core places them (core_v0.16.1 ``multi_token_prediction.py``
    ``MultiTokenPredictionLayer``): per module a transformer layer of the last layer's kind
    (:func:`layer_param_split`), ``enorm``, ``hnorm`` and a final norm, and ``eh_proj``, a column-parallel
    ``2h -> h`` linear. The output layer is the main model's. Not on the first stage, the module also needs the
    word embedding there (``gpt_model.py``: ``if self.pre_process or self.mtp_process: self.embedding = ...``),
    a second copy unless the output layer already is the tied embedding."""
    n = model.mtp_num_layers
    if not n:
        return 0.0, 0.0
    t, h = plan.tp, model.hidden_size
    moe = model.mtp_is_moe()
    layer_dense, layer_expert = layer_param_split(model, t, moe, plan.ep, plan.expert_tp)
    dense = n * (layer_dense + 3 * model.norm_params + 2 * h * h / t)
    if stage != 0 and not model.tied_embeddings:
        dense += vocab_rows_params(model, t)
    return dense, n * layer_expert


def stage_params_per_rank(model: ModelSpec, plan: Plan, stage: int, layers: int) -> float:
    """Parameters held by one GPU of pipeline stage ``stage``.

    Word embedding (vocab-parallel, padded as Megatron pads it) on the first stage, output layer
    on the last; a tied embedding is duplicated on the last stage when ``pp > 1``
    (``language_module.py::setup_embeddings_and_output_layer``). Learned position embeddings and
    the embedding norm are replicated across TP. MoE models: the stage's dense-first and MoE layers
    as ``Plan.stage_moe_layers`` places them, each MoE layer with its ``E / ep`` experts split over
    ``etp`` (:func:`layer_param_split`).
    """
    return sum(stage_param_split(model, plan, stage, layers))


def stage_max_layer_params(model: ModelSpec, plan: Plan, stage: int, layers: int) -> float:
    """The largest layer of stage ``stage`` on one GPU (what ZeRO-3 / FSDP gathers at a time)."""
    moe_layers = stage_moe_layer_count(model, plan, stage, layers)
    sizes = ([plan_layer_params_per_rank(model, plan, False)] if layers > moe_layers else []) + \
        ([plan_layer_params_per_rank(model, plan, True)] if moe_layers else [])
    return max(sizes, default=plan_layer_params_per_rank(model, plan, False))


def grad_bytes(training: TrainingSpec) -> int:
    """Bytes per gradient: fp32 main grads, or 16-bit with ``grad_reduce_in_bf16`` (formulas.md A1, C4)."""
    return 2 if training.grad_reduce_in_bf16 and training.precision != "fp32" else GRAD_BYTES


def param_bytes(training: TrainingSpec) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter.

    Mixed precision (bf16, fp8): Megatron's 2 + 4 + 12 (module docstring). Plain fp32 training
    (the CPU run of `plan3d validate`): 4 + 4 + 8, Adam's m and v with no master copy.
    """
    if training.precision == "fp32":
        return 4, 4, 8
    return WEIGHT_BYTES, grad_bytes(training), OPTIMIZER_BYTES


def act_bytes(training: TrainingSpec) -> int:
    """Bytes per activation element: 4 in fp32 training, else 2 (bf16; fp8 GEMM inputs are handled apart)."""
    return 4 if training.precision == "fp32" else ACT_BYTES


def state_bytes_per_param(zero_stage: int, shards: int, bytes_per_param: tuple[int, int, int] = (
        WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES)) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter under ZeRO over ``shards`` replicas.

    ZeRO paper (Rajbhandari et al. 2020, section 5): stage 1 shards optimizer states, 2 also
    gradients, 3 also weights; Megatron bytes (2, 4, 12) as the module docstring says.
    """
    n = max(shards, 1)
    wb, gb, ob = bytes_per_param
    return wb / (n if zero_stage >= 3 else 1), gb / (n if zero_stage >= 2 else 1), ob / (n if zero_stage >= 1 else 1)


def zero_working_set_bytes(model: ModelSpec, plan: Plan, layers: int,
                           bytes_per_param: tuple[int, int, int] = (WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES),
                           layer_params: float | None = None) -> tuple[float, float]:
    """Extra (weights, gradients) bytes that ZeRO-2/3 keep unsharded while a layer runs.

    ZeRO-3 / FSDP gathers the current layer and prefetches the next (2 layers of bf16 weights);
    ZeRO-2/3 reduce-scatter one layer's fp32 gradients at a time (DeepSpeed
    ``estimate_zero3_model_states_mem_needs``: ``4 * largest_layer_params``). Capped so that a
    higher stage never needs more than the stage below it holds unsharded. ``layer_params``: the
    largest layer on this GPU (default: a dense layer at the plan's tp; MoE stages pass
    :func:`stage_max_layer_params`).
    """
    shards = plan.dp * plan.cp
    if shards == 1:
        return 0.0, 0.0
    per_layer = layer_params_per_rank(model, plan.tp, False) if layer_params is None else layer_params
    w = bytes_per_param[0] * min(2, layers) * per_layer if plan.zero_stage >= 3 else 0.0
    g = bytes_per_param[1] * per_layer if plan.zero_stage >= 2 else 0.0
    return w, g


# --- activations --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ActTerm:
    """One tensor one layer saves for backward, per GPU and micro-batch."""

    name: str
    bytes: float
    core: bool = False  # inside the attention core (dropped by selective recompute)
    layer_input: bool = False  # the layer's input (the only tensor kept under full recompute)
    selective: bool | None = None  # kept under selective recompute; None: unless ``core`` (Megatron's rule)
    autograd: bool = True  # saved by autograd without recompute; False: kept only by an op-level AC policy
    modules: tuple[str, ...] = ()  # Megatron --recompute-modules that drop it (apply_recompute_modules)


def apply_recompute_modules(terms: list[ActTerm], training: TrainingSpec) -> list[ActTerm]:
    """The terms as Megatron-Core's selective recompute keeps them for ``training.recompute_modules``
    (``--recompute-modules``, default ``core_attn``; core_v0.16.1 ``transformer_config.py``).

    A term is dropped when one of its modules (``ActTerm.modules``; the attention core's terms belong to
    ``core_attn``) is recomputed, and kept otherwise, so a list without ``core_attn`` keeps the core. Code paths:
    ``core_attn`` checkpoints the core attention (``attention.py``); ``mla_up_proj`` runs the MLA
    up-projections with their fused q/kv norms and the RoPE under ``CheckpointWithoutOutput`` and discards
    Q, K and V after the core attention (``multi_latent_attention.py``): the latents, its inputs, stay;
    ``mlp`` checkpoints a dense layer's MLP with its fused pre-MLP norm (``transformer_layer.py``,
    ``recompute_mlp`` only when the layer is not MoE): its input stays; ``moe`` checkpoints the MoE layer
    (``moe_layer.py``): the pre-MLP norm output, its input, stays; ``moe_act`` discards the experts'
    activation output, FC2's input (``experts.py``, ``CheckpointWithoutOutput``; under fp8/fp4 FC2 is set to
    save that original input instead of its quantised copy, ``set_save_original_input``, so nothing of it
    stays); ``shared_experts``
    checkpoints the shared expert (``shared_experts.py``). ``layernorm`` recomputes a norm that is not fused
    into the next linear; with Transformer Engine's fused ``LayerNormLinear`` the kept input is what the
    linear saves anyway, so it is modelled as dropping nothing (an upper bound on memory).
    """
    mods = set(training.recompute_modules)
    out = []
    for x in terms:
        own = x.modules + (("core_attn",) if x.core else ())
        if own and x.selective is None:
            x = replace(x, selective=not (mods & set(own)))
        out.append(x)
    return out


#: Bytes per element of a GEMM input saved for the weight gradient (Transformer Engine keeps the quantised
#: column-wise copy, not the bf16 tensor): fp8 1 B; fp8 block scaling 1 B + one FP32 scale per 1 x 128 tile
#: (TE Float8BlockScaling: activations and gradients in 1 x 128 tiles, weights in 128 x 128 blocks, DeepSeek-V3
#: report arXiv:2412.19437 section 3.3, "FP8 Training"; Megatron-Bridge ``bf16_with_fp8_subchannel_scaling_mixed``: "128x128
#: blockwise quantization for weight and 1x128 blockwise quantization for activation"); mxfp8 1 B + one E8M0
#: scale per 32 values; nvfp4 0.5 B + one E4M3 scale per 16 values (TE MXFP8BlockScaling / NVFP4BlockScaling;
#: OCP MX spec v1.0; NVIDIA, arXiv:2509.25149). Keyed by :func:`linear_input_key`.
LINEAR_INPUT_BYTES = {"fp8": 1.0, "fp8_blockwise": 1 + 4 / 128, "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def linear_input_key(training: TrainingSpec) -> str:
    """The ``LINEAR_INPUT_BYTES`` key of a job: its precision, and for fp8 block scaling ``fp8_blockwise`` (the
    per-tensor recipes keep one scale per tensor: nothing per value)."""
    if training.precision == "fp8" and training.fp8_recipe == "blockwise":
        return "fp8_blockwise"
    return training.precision


def linear_input_bytes(training: TrainingSpec) -> float:
    """Bytes per element of a GEMM input saved for the weight gradient: the quantised copy where the framework's
    low-precision GEMMs keep it (Transformer Engine, ``LINEAR_INPUT_BYTES``), else the 16-bit input
    (``FrameworkProfile.saves_quantized_gemm_inputs`` False: torchao's float8 and MX modules under torchtitan save
    ``input_hp``, torchao 0.18.0 ``float8/float8_linear.py`` ``matmul_with_hp_or_float8_args``), and in 16-bit
    training ``act_bytes``."""
    e = act_bytes(training)
    if not frameworks.get(training.framework).saves_quantized_gemm_inputs:
        return e
    return LINEAR_INPUT_BYTES.get(linear_input_key(training), e)


def torchao_fp8_recomputes_inputs(training: TrainingSpec) -> bool:
    """A compiled torchtitan block under torchao float8 (``saves_quantized_gemm_inputs`` False, fp8, compiled
    blocks): inductor's min-cut partitioner recomputes the two norm outputs (the QKV and FC1 inputs) and the SwiGLU
    product (the FC2 input) from what it saves anyway, where the bf16 block saves them; measured with torchao's
    rowwise and tensorwise recipes on torch 2.13 (planner/compile_probe.py, tests/test_torchtitan_float8.py)."""
    return (training.precision == "fp8" and training.compiled_blocks
            and not frameworks.get(training.framework).saves_quantized_gemm_inputs)


def layer_activation_terms(model: ModelSpec, training: TrainingSpec, plan: Plan, moe: bool | None = None
                           ) -> list[ActTerm]:
    """Tensors one transformer layer saves for backward, per GPU and micro-batch (:func:`_layer_activation_terms`,
    memoised on the plan fields it reads: the search asks the same layer of many shapes)."""
    moe = model.is_moe if moe is None else (moe and model.is_moe)
    # a dense layer holds no experts: its terms do not depend on ep and etp, so one entry serves every (ep, etp)
    key = (plan.tp, plan.cp, plan.micro_batch_size, plan.sequence_parallel, plan.ep, plan.expert_tp) if moe else \
        (plan.tp, plan.cp, plan.micro_batch_size, plan.sequence_parallel, 1, plan.tp)
    return list(_layer_activation_terms_cached(model, training, key, moe))


@functools.lru_cache(maxsize=65536)
def _layer_activation_terms_cached(model: ModelSpec, training: TrainingSpec, key: tuple, moe: bool
                                   ) -> tuple[ActTerm, ...]:
    tp, cp, mbs, sp, ep, etp = key
    plan = Plan.model_construct(tp=tp, cp=cp, micro_batch_size=mbs, sequence_parallel=sp, ep=ep, etp=etp)
    return tuple(_layer_activation_terms(model, training, plan, moe))


def _layer_activation_terms(model: ModelSpec, training: TrainingSpec, plan: Plan, moe: bool) -> list[ActTerm]:
    """Tensors one transformer layer saves for backward, per GPU and micro-batch.

    Korthikanti et al. 2022 (arXiv:2205.05198) section 4.1: attention ``11 sbh + 5 a s^2 b``,
    MLP ``19 sbh``, norms ``4 sbh`` with GeLU, f = 4h, MHA and dropout; the terms below reduce to
    exactly that. Generalised by the same rule (formulas.md A3): K and V are ``g*d_h`` wide (GQA),
    SwiGLU stores its two FC1 outputs and the FC2 input, no masks without dropout, and
    FlashAttention stores the fp32 log-sum-exp instead of the ``s x s`` scores (Dao et al. 2022);
    materialised attention with GQA also keeps K and V repeated to all query heads (Megatron
    ``DotProductAttention``).
    TP divides what lies inside the column/row-parallel region; sequence parallelism also divides
    the norm and dropout regions (Table 2), and Megatron keeps only the 1/t shard of the
    column-parallel inputs (its ``LinearWithGradAccumulationAndAsyncCommunication`` re-gathers
    them in backward), where torch's DTensor SP keeps them gathered (``framework="torchtitan"``);
    CP divides the sequence (context_parallel.md). With
    fp8 the four GEMM inputs are saved in fp8 (1 B), as Transformer Engine does. The per-token
    fp32 norm statistics (mean, rstd) are included. A framework that runs SwiGLU unfused
    (torchtitan eager: ``w2(F.silu(w1(x)) * w3(x))``, ``FrameworkProfile.swiglu_unfused``) also
    keeps the SiLU output, which the multiply saves.

    Layer structure beyond Megatron's GPT (the Hugging Face module graphs): parallel attention
    (GPT-NeoX, Falcon) feeds the layer input to both norms, so it is saved once, and a shared norm
    (Falcon-7B) has one set of statistics and one output that QKV and FC1 both save (two copies
    when each makes its own: fp8 casts, or DTensor's per-module all-gather); sandwich norms
    (Gemma-2) save the attention and MLP outputs and their statistics; QK norms (OLMo-2) save Q and
    K before the norm; a soft-capped materialised attention (Gemma-2 eager) keeps the ``tanh``
    output as well. Post-norm (OLMo-2) saves the same sizes as pre-norm: the norm input moves from
    the layer input to the sublayer output.

    MLA attention (``model.is_mla``) saves what :func:`mla_attention_terms` lists; a MoE layer
    (``moe``; default: a MoE layer when the model has experts, ``moe=False`` for its dense-first
    layers) replaces the MLP terms by :func:`moe_activation_terms`.
    """
    t, e = plan.tp, act_bytes(training)
    sp = t if plan.sequence_parallel else 1
    profile = frameworks.get(training.framework)
    gathered = 1 if profile.sp_gathers_inputs else sp  # DTensor SP keeps them gathered
    lin = linear_input_bytes(training)
    # compiled torchao float8: not saved, recomputed (measured on a dense block with its own two norms; a MoE layer
    # or a shared input norm keeps them counted)
    recomputed_inputs = torchao_fp8_recomputes_inputs(training) and not moe and not model.shared_input_norm
    s, b, h, f = training.seq_len // plan.cp, plan.micro_batch_size, model.hidden_size, model.ffn_size
    a_r, q_r = model.num_attention_heads / t, model.q_size / t
    kv_r = kv_heads_per_rank(model, t) * model.kv_channels
    sb = s * b
    stats = sb * FP32_BYTES * (2 if model.norm == "layernorm" else 1)
    drop = model.dropout
    terms = [
        ActTerm("norm1 input", sb * h * e / sp, layer_input=True),
        ActTerm("norm1 statistics", stats / sp),
    ]
    if model.is_mla:
        terms += mla_attention_terms(model, training, plan)
    else:
        terms += [
            ActTerm("QKV input", sb * h * lin / gathered, autograd=not recomputed_inputs),
            ActTerm("Q", sb * q_r * e),
            ActTerm("K, V", 2 * sb * kv_r * e),
            ActTerm("out-proj input", sb * q_r * lin),
        ]
        terms += _qk_norm_terms(model, sb, q_r, kv_r, a_r, e)
        terms += _core_attention_terms(model, training, plan, q_r, kv_r, q_r)
    if drop:
        terms.append(ActTerm("attention residual dropout mask", sb * h / sp))
    fc1_out = (2 if model.gated_mlp else 1) * sb * f / t
    if not model.parallel_attention:  # in parallel, norm2 reads the layer input, saved above
        terms.append(ActTerm("norm2 input", sb * h * e / sp))
    mlp = () if moe else ("mlp",)  # a dense layer's MLP, its fused pre-MLP norm included (apply_recompute_modules)
    if not model.shared_input_norm:
        terms.append(ActTerm("norm2 statistics", stats / sp, modules=mlp))
    if moe:
        terms += moe_activation_terms(model, training, plan)
    else:
        if not (model.shared_input_norm and lin == e and gathered == sp):  # else the QKV input tensor itself
            terms.append(ActTerm("FC1 input", sb * h * lin / gathered, modules=mlp, autograd=not recomputed_inputs))
        terms += [
            ActTerm("activation input (FC1 output)", fc1_out * e, modules=mlp),
            ActTerm("FC2 input", sb * f / t * lin, modules=mlp, autograd=not recomputed_inputs),
        ]
        # torch.compile (torchtitan --compile.enable): the partitioner recomputes the SiLU in backward and
        # saves W1's and W3's outputs and the product only (planner/compile_probe.py, docs/memory.md)
        if model.activation == "swiglu" and profile.swiglu_unfused and not training.compiled_blocks:
            terms.append(ActTerm("SiLU output (unfused SwiGLU: the multiply saves it)", sb * f / t * e, modules=mlp))
        if model.activation == "swiglu" and training.unfused_swiglu:  # Megatron --no-bias-swiglu-fusion
            # core_v0.16.1 mlp.py glu(): silu(x_glu) * (x_linear + glu_linear_offset): the multiply saves both factors
            terms += [ActTerm("SiLU output (Megatron's eager glu)", sb * f / t * e, modules=mlp),
                      ActTerm("x_linear + glu_linear_offset (Megatron's eager glu)", sb * f / t * e, modules=mlp)]
    if drop:
        terms.append(ActTerm("MLP residual dropout mask", sb * h / sp))
    if model.norm_placement == "sandwich":
        for where in ("attention", "MLP"):
            terms += [ActTerm(f"post-{where} norm input", sb * h * e / sp),
                      ActTerm(f"post-{where} norm statistics", stats / sp)]
    if profile.op_sac:
        return op_sac_terms(terms, model, plan, e, compiled=training.compiled_blocks,
                            float8_scales=torchao_fp8_recomputes_inputs(training))
    return apply_recompute_modules(terms, training)


def _core_attention_terms(model: ModelSpec, training: TrainingSpec, plan: Plan, q_r: float, kv_r: float,
                          out_r: float) -> list[ActTerm]:
    """The attention core's own saved tensors (dropped by selective recompute): FlashAttention's fp32
    log-sum-exp (and the bf16 output when the out-projection saves an fp8 copy), or the materialised
    softmax (+ GQA-expanded K/V, soft-cap and dropout tensors). ``q_r``/``kv_r``/``out_r``: Q, K/V and
    output widths on this rank."""
    t, e = plan.tp, act_bytes(training)
    lin = linear_input_bytes(training)
    s, b = training.seq_len // plan.cp, plan.micro_batch_size
    sb, a_r = s * b, model.num_attention_heads / t
    if training.attention in FLASH_ATTENTION:
        terms = [ActTerm("softmax log-sum-exp", sb * a_r * FP32_BYTES, core=True)]
        if lin != e:
            terms.append(ActTerm("attention output (bf16)", sb * out_r * e, core=True))
        return terms
    s_kv = training.seq_len  # keys seen by each local query (all of them with CP ring attention)
    terms = []
    if kv_r < q_r:  # GQA: Megatron's unfused DotProductAttention repeat_interleaves K and V to a heads
        terms.append(ActTerm("K, V expanded to query heads", 2 * sb * q_r * e, core=True))
    if model.attn_logit_softcap is not None:
        terms.append(ActTerm("soft-capped scores (tanh output)", a_r * sb * s_kv * e, core=True))
    terms.append(ActTerm("softmax output", a_r * sb * s_kv * e, core=True))
    if model.dropout:
        terms.append(ActTerm("attention dropout mask", a_r * sb * s_kv, core=True))
        terms.append(ActTerm("attention dropout output", a_r * sb * s_kv * e, core=True))
    return terms


def mla_attention_terms(model: ModelSpec, training: TrainingSpec, plan: Plan) -> list[ActTerm]:
    """What multi-head latent attention saves between the input norm and the output projection.

    Megatron-Core core_v0.16.1 ``transformer/multi_latent_attention.py::MLASelfAttention``
    (``get_query_key_value_tensors``) with the Transformer Engine spec: the duplicated (TP-replicated)
    ``linear_q_down_proj`` and ``linear_kv_down_proj`` read the norm output on this rank's tokens
    (``s/t`` with SP: no gather) and save it once (bf16; one fp8 copy each under fp8); the q latent
    ``[s/t, r_q]`` and the kv latent + rope key ``[s/t, r_kv + rope]`` feed the fused
    ``q_layernorm``/``kv_layernorm`` + column-parallel up projections (``TELayerNormColumnParallelLinear``),
    which save the norm input, its fp32 rstd and the normalised latent (the ``s/t`` shard, re-gathered
    in backward as Megatron's column-parallel linears do; DTensor SP keeps it gathered). The up
    projections produce the full-sequence per-rank heads: Q and K ``a/t x (nope + rope)`` wide
    (K's rope part is the shared rope key expanded to every head, ``torch.cat`` copies it), V
    ``a/t x v_head_dim`` (``.contiguous()`` copies the split view); the attention output
    ``a/t x v_head_dim`` is the out-projection input; the core's own tensors as
    :func:`_core_attention_terms`. RoPE is counted as saving nothing (the fused MLA RoPE kernels;
    unfused RoPE saves only its cos/sin tables). Under torchtitan's op-level selective AC the MLA
    tensors are counted as kept (an upper bound: its policy keeps every other ``aten.mm`` output).
    """
    t, e = plan.tp, act_bytes(training)
    sp = t if plan.sequence_parallel else 1
    gathered = 1 if frameworks.get(training.framework).sp_gathers_inputs else sp
    lin = linear_input_bytes(training)
    sb = training.seq_len // plan.cp * plan.micro_batch_size
    h, a_r = model.hidden_size, model.num_attention_heads / t
    rq, rkv, rope = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    stat = FP32_BYTES * (2 if model.norm == "layernorm" else 1)
    keep = True if frameworks.get(training.framework).op_sac else None
    copies = 2 if lin != e else 1  # one fp8 copy per down projection; bf16: the same tensor, saved once
    terms = [ActTerm("q/kv down-projection input (norm1 output)", copies * sb * h * min(lin, e) / gathered,
                     selective=keep)]
    up = ("mla_up_proj",)  # what --recompute-modules mla_up_proj discards (apply_recompute_modules)
    if rq:
        terms += [ActTerm("q latent (q-norm input)", sb * rq * e / sp, selective=keep),
                  ActTerm("q-norm statistics", sb * stat / sp, selective=keep, modules=up),
                  ActTerm("q up-projection input (normalised q latent)", sb * rq * lin / gathered,
                          selective=keep, modules=up)]
    terms += [ActTerm("kv latent and rope key (kv-norm input)", sb * (rkv + rope) * e / sp, selective=keep),
              ActTerm("kv-norm statistics", sb * stat / sp, selective=keep, modules=up),
              ActTerm("kv up-projection input (normalised kv latent)", sb * rkv * lin / gathered,
                      selective=keep, modules=up),
              ActTerm("Q (nope + rope heads)", sb * a_r * model.qk_head_dim * e, selective=keep, modules=up),
              ActTerm("K (nope + rope heads)", sb * a_r * model.qk_head_dim * e, selective=keep, modules=up),
              ActTerm("V", sb * a_r * model.v_dim * e, selective=keep, modules=up),
              ActTerm("out-proj input", sb * a_r * model.v_dim * lin, selective=keep)]
    qk_r, v_r = a_r * model.qk_head_dim, a_r * model.v_dim
    return terms + _core_attention_terms(model, training, plan, qk_r, qk_r, v_r)


def moe_tokens_per_rank(model: ModelSpec, training: TrainingSpec, plan: Plan) -> tuple[float, float]:
    """(tokens one GPU routes, expert rows one GPU computes) per micro-batch of a MoE layer.

    Megatron-Core core_v0.16.1 alltoall dispatcher (``moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher``):
    each GPU routes its own ``s b / (cp t)`` tokens (sequence-parallel shard; ``MoELayer.forward``
    requires SP with tp > 1), permutes ``k`` copies, sends them over the EP group (all-to-all)
    and all-gathers them over the expert-TP group (``dispatch_postprocess``: ``AG(TP)``). Dropless
    (``moe_expert_capacity_factor`` None), the balanced share per GPU is
    ``tokens * k * etp`` rows (the EP group's ``ep * tokens * k`` rows over ``ep`` GPUs, times the
    ``etp`` gathered shards); routing is data-dependent, so a GPU may receive more: at most all
    ``ep * tokens * min(k, E/ep)`` of its group (docs/moe.md, Memory states the risk). The estimate holds the
    busiest GPU's rows (:func:`moe_row_scale`), the balanced share times ``TrainingSpec.moe_load_imbalance`` (1.0:
    balanced, NVIDIA's benchmarks force it), at most that worst case: the rows the cost model charges the same GPU
    (``cost.moe_layer_extra``). With a capacity factor, each source keeps at most
    ``ceil(tokens*k/E * cf)`` tokens per expert (``moe_utils.py::apply_router_token_dropping`` /
    ``get_capacity`` on the local tokens), so a GPU computes at most ``cf`` times the balanced share,
    exactly that with ``moe_pad_expert_input_to_capacity``.

    torchtitan 0.3.0 (``models/common/moe.py``, ``moe_sharding.py``): with ep > 1 the MoE shards the
    tokens over the TP axis (``s b / (cp t)`` routed per GPU) and experts are not TP-split (etp = 1);
    with ep = 1 the router runs on all ``s b / cp`` tokens of the TP group (``Replicate`` input) and
    every expert is TP-split. Rows per GPU ``tokens * k`` in both (dropless).
    """
    sb = training.seq_len // plan.cp * plan.micro_batch_size
    routed, rows = moe_routed_shares(model, training, plan)
    return sb * routed, sb * rows


def moe_routed_shares(model: ModelSpec, training: TrainingSpec, plan: Plan) -> tuple[float, float]:
    """:func:`moe_tokens_per_rank` per token of the micro-batch's ``s b / cp`` on one GPU: (the share of them the GPU
    routes, the expert rows it computes per such token). One figure for the memory estimate and the cost model
    (``cost.moe_layer_extra``, which takes the tokens of its own call)."""
    t, ep, et, k = plan.tp, plan.ep, plan.expert_tp, model.top_k
    if frameworks.get(training.framework).moe_dispatch == "torchtitan":
        routed = 1 / t if ep > 1 else 1.0
        gather = 1
    else:
        routed = 1 / (t if plan.sequence_parallel else 1)
        gather = et
    return routed, routed * k * gather * moe_row_scale(model, training, plan)


def moe_row_scale(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """The busiest expert-parallel rank's routed rows over the balanced share (:func:`moe_tokens_per_rank`), which
    the memory estimate and the cost model (``cost.moe_layer_extra``) both use: the capacity factor where the model
    has one (each expert's input padded to its capacity: Megatron ``--moe-pad-expert-input-to-capacity``, as plan3d
    emits it), else ``TrainingSpec.moe_load_imbalance``; never more than every copy of its EP group's tokens,
    ``ep min(k, E / ep) / k`` times the balanced share."""
    if not model.is_moe:
        return 1.0
    k = model.top_k
    worst = plan.ep * min(k, model.num_experts / plan.ep) / k
    scale = model.capacity_factor if model.capacity_factor is not None else training.moe_load_imbalance
    return min(scale, worst)


def router_dtype_bytes(model: ModelSpec) -> int:
    """Bytes per element of the router's logits, scores and probabilities: fp32 with Megatron ``--moe-router-dtype
    fp32`` (``ModelSpec.router_dtype``), else the input's bf16 (core_v0.16.1 ``moe/router.py``: ``router_dtype =
    input.dtype`` unless ``moe_router_dtype``; ``moe_utils.py``: the softmax ``type_as(logits)``)."""
    return FP32_BYTES if model.router_dtype == "fp32" else 2


def moe_allgather_buffer_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """Megatron's global memory buffer that the allgather token dispatcher gathers the hidden states into, on a GPU
    of a stage with a MoE layer (``TrainingSpec.moe_token_dispatcher`` "allgather").

    core_v0.16.1 ``MoEAllGatherTokenDispatcher.token_dispatch`` calls ``gather_from_sequence_parallel_region(
    hidden_states, group=tp_ep_group, use_global_buffer=True)``: the ``[T etp ep, h]`` output (``T`` the tokens this
    GPU routes, :func:`moe_routed_shares`; the gather spans the etp x ep ranks) comes from
    ``get_global_memory_buffer().get_tensor(..., "mpu")`` (``utils.py::GlobalMemoryBuffer``), which allocates it the
    first time and keeps it for the rest of the run. The dispatcher's other outputs (the unpermuted ``[T etp ep, h]``
    and its copy in the probabilities' dtype for the reduce-scatter) are transient, as the all-to-all's are, and not
    counted."""
    if training.moe_token_dispatcher != "allgather" or not model.is_moe:
        return 0.0
    routed, _ = moe_routed_shares(model, training, plan)
    tokens = training.seq_len // plan.cp * plan.micro_batch_size * routed
    return tokens * plan.expert_tp * plan.ep * model.hidden_size * act_bytes(training)


def moe_activation_terms(model: ModelSpec, training: TrainingSpec, plan: Plan) -> list[ActTerm]:
    """What a MoE layer's router, dispatch, experts and shared experts save, per GPU and micro-batch
    (after the pre-MLP norm, which :func:`layer_activation_terms` counts). ``T`` tokens routed and
    ``R`` expert rows per GPU as :func:`moe_tokens_per_rank` says; ``F_r = moe_ffn / etp``.

    Megatron-Core core_v0.16.1 (``moe/``), non-fused permutation, ``TEGroupedMLP``:

    * ``router.py::RouterGatingLinearFunction`` saves its input, the pre-MLP norm output ``[T, h]``
      (also what the shared expert's FC1 keeps: ``shared_experts.py`` notes "the output of
      pre_mlp_layernorm is saved by router"), once;
    * router scores ``[T, E]`` in ``router_dtype``: the sigmoid output (DeepSeek-V3's score function) or
      the softmax of the load-balancing loss (``compute_routing_scores_for_aux_loss``); a softmax
      router without an auxiliary loss saves less (its top-k softmax only): counted as one such tensor;
    * ``topk_routing_with_score_function``: the int64 top-k indices, the ``[T, k]`` probabilities and the
      sigmoid's ``[T, 1]`` normaliser;
    * ``moe_utils.py::permute`` (non-fused; ``--moe-permute-fusion`` saves TE's row-id map instead): the
      transposed bool routing map ``[E, T]`` and the transposed probabilities ``[E, T]`` (router dtype),
      both saved by ``masked_select``, and the int64 ``sorted_indices`` ``[T k]`` (``index_select``;
      ``unpermute``'s ``scatter_add_`` saves a view of the same indices);
    * ``experts.py::TEGroupedMLP``: FC1 saves its input ``[R, h]`` (the dispatched tokens), the fused
      ``weighted_bias_swiglu_impl`` its input ``[R, 2 F_r]`` and the routed probabilities ``[R]``
      (router dtype), FC2 its input ``[R, F_r]``; a non-gated activation runs unfused (``activation * probs``:
      its input and output);
    * ``shared_experts.py::SharedExpertMLP`` (an ``MLP`` over the attention TP group, sequence-gathered):
      FC1 output ``[s b, 2 F_s / t]`` and FC2 input ``[s b, F_s / t]``; with the sigmoid gate also the
      shared output ``[T, h]`` and the gate score, which the multiply saves.

    The all-to-alls, the expert-TP all-gather / reduce-scatter and the chunk sorts save nothing;
    their outputs are transient (the fp32 reduce-scatter of ``combine_preprocess`` included).

    torchtitan 0.3.0 (``models/common/moe.py``, ``token_dispatcher.py``), on a GPU: the router's
    ``torch.autocast(dtype=float32)`` gate saves fp32 copies of its input ``[T, h]`` and weight ``[E, h]``;
    the fp32 scores ``[T, E]`` (sigmoid/softmax output), top-k indices, the gathered scores and their
    normaliser; two int64 index vectors ``[T k]`` (``argsort`` and its ``// top_k``);
    ``GroupedExperts`` runs SwiGLU eagerly: the input ``[R, h]`` and four ``[R, F_r]`` tensors (W1
    output, SiLU output, W3 output, W2 input); ``combine`` multiplies an fp32 copy of the expert
    output ``[T k, h]`` by the sorted fp32 scores ``[T k]`` and saves both. Shared experts as
    torchtitan's dense ``FeedForward`` (gathered input, four ``[s b, F_s / t]`` tensors).

    Under recompute "selective" every MoE term is kept with Megatron's default ``--recompute-modules
    core_attn`` (``moe``, ``moe_act`` and ``shared_experts`` drop theirs: :func:`apply_recompute_modules`;
    torchtitan's op-level policy counted as keeping them, an upper bound); "full" keeps only the layer input.
    """
    tokens, rows = moe_tokens_per_rank(model, training, plan)
    t, e = plan.tp, act_bytes(training)
    profile = frameworks.get(training.framework)
    lin = linear_input_bytes(training)
    sb = training.seq_len // plan.cp * plan.micro_batch_size
    h, k, n_exp = model.hidden_size, model.top_k, model.num_experts
    f_r = model.moe_ffn_size / plan.expert_tp
    keep = True if profile.op_sac else None
    gated = 2 if model.gated_mlp else 1
    shared = model.shared_expert_ffn_hidden_size
    if profile.moe_dispatch == "torchtitan":
        f_r = model.moe_ffn_size / (1 if plan.ep > 1 else t)
        terms = [ActTerm("router input, fp32 autocast copy", tokens * h * FP32_BYTES, selective=keep),
                 ActTerm("router weight, fp32 autocast copy", n_exp * h * FP32_BYTES, selective=keep),
                 ActTerm("router scores (fp32)", tokens * n_exp * FP32_BYTES, selective=keep),
                 ActTerm("top-k indices (int64)", tokens * k * TOKEN_ID_BYTES, selective=keep),
                 ActTerm("top-k scores and normaliser (fp32)", tokens * (k + 1) * FP32_BYTES, selective=keep),
                 ActTerm("dispatch sort indices (two int64 vectors)", 2 * tokens * k * TOKEN_ID_BYTES, selective=keep),
                 ActTerm("expert input (dispatched tokens)", rows * h * e, selective=keep),
                 ActTerm("expert W1, SiLU, W3 outputs and W2 input (eager SwiGLU)", 4 * rows * f_r * e,
                         selective=keep),
                 ActTerm("routed scores, sorted (fp32)", tokens * k * FP32_BYTES, selective=keep),
                 ActTerm("expert output, fp32 copy (the score multiply saves it)", tokens * k * h * FP32_BYTES,
                         selective=keep)]
        if shared is not None:
            gathered = 1 if profile.sp_gathers_inputs else (t if plan.sequence_parallel else 1)
            terms += [ActTerm("shared-expert input (gathered)", sb * h * e / gathered, selective=keep),
                      ActTerm("shared-expert W1, SiLU, W3 outputs and W2 input", 4 * sb * shared / t * e,
                              selective=keep)]
            if model.shared_expert_gate:
                terms.append(ActTerm("shared-expert output and gate score (the gate multiply saves them)",
                                     tokens * (h + 1) * e, selective=keep))
        return terms
    rb = router_dtype_bytes(model)
    layer, act, sh = ("moe",), ("moe", "moe_act"), ("moe", "shared_experts")  # apply_recompute_modules
    # the allgather dispatcher permutes the gathered tokens of its etp x ep group for the local experts: its routing
    # map and transposed probabilities are [T etp ep, E / ep] (etp times the alltoall's [T, E]) and its sorted
    # indices one per local row (core_v0.16.1 MoEAllGatherTokenDispatcher.dispatch_postprocess)
    per_token = plan.expert_tp if training.moe_token_dispatcher == "allgather" else 1
    sorted_rows = rows if training.moe_token_dispatcher == "allgather" else tokens * k
    terms = [ActTerm("MoE input (pre-MLP norm output; router and shared-expert FC1 save it)", tokens * h * e),
             ActTerm("router scores (router dtype)", tokens * n_exp * rb, modules=layer),
             ActTerm("router top-k indices (int64), probabilities and normaliser",
                     tokens * k * (TOKEN_ID_BYTES + rb) + tokens * rb, modules=layer),
             ActTerm("permutation routing map (bool)", tokens * per_token * n_exp, modules=layer),
             ActTerm("router probabilities, transposed (permute's masked_select saves them)",
                     tokens * per_token * n_exp * rb, modules=layer),
             ActTerm("permutation sorted indices (int64)", sorted_rows * TOKEN_ID_BYTES, modules=layer),
             ActTerm("expert FC1 input (dispatched tokens)", rows * h * lin, modules=layer),
             ActTerm("expert activation input (FC1 output)", rows * gated * f_r * e, modules=layer),
             ActTerm("routed probabilities (router dtype)", rows * rb, modules=layer),
             ActTerm("expert FC2 input", rows * f_r * lin, modules=act)]
    if not model.gated_mlp:
        terms.append(ActTerm("expert activation output (unfused activation * probs)", rows * f_r * e, modules=act))
    if shared is not None:
        terms += [ActTerm("shared-expert activation input (FC1 output)", sb * gated * shared / t * e, modules=sh),
                  ActTerm("shared-expert FC2 input", sb * shared / t * lin, modules=sh)]
        if model.shared_expert_gate:
            terms.append(ActTerm("shared-expert output and gate score (the gate multiply saves them)",
                                 tokens * (h + 1) * e, modules=sh))
    return terms


def _qk_norm_terms(model: ModelSpec, sb: int, q_r: float, kv_r: float, a_r: float, e: int) -> list[ActTerm]:
    """What the Q and K norms save: their inputs and fp32 statistics (one per token, or per token and
    head for per-head norms; two with LayerNorm)."""
    if model.qk_norm == "none":
        return []
    per_stat = FP32_BYTES * (2 if model.norm == "layernorm" else 1)
    q_stats, k_stats = (a_r, kv_r / model.kv_channels) if model.qk_norm == "head" else (1, 1)
    return [ActTerm("Q-norm input", sb * q_r * e), ActTerm("K-norm input", sb * kv_r * e),
            ActTerm("Q/K-norm statistics", sb * (q_stats + k_stats) * per_stat)]


def op_sac_terms(terms: list[ActTerm], model: ModelSpec, plan: Plan, e: int, compiled: bool = False,
                 float8_scales: bool = False) -> list[ActTerm]:
    """The terms as torchtitan's selective op-level AC keeps them (``selective_ac_option = "op"``,
    torchtitan ``distributed/activation_checkpoint.py::_get_custom_policy``): inside each block's
    checkpoint it saves the outputs of the ops of ``_save_list`` (``aten.mm``, the SDPA kernels,
    ``_c10d_functional.reduce_scatter_tensor``, ``aten.max``) except every second ``aten.mm``,
    and recomputes the rest. Per block the mm are Q, K, V, O, W1, W3, W2, so Q, V, W1 and W2
    outputs are kept, K, O and W3 recomputed; the block's input is kept by the checkpoint. The W2
    output (full width on every TP rank, before its reduce-scatter) and, with TP, the two
    reduce-scatter outputs are saved by the policy although autograd does not save them.

    ``compiled`` (torch.compile of the checkpointed block, torchtitan ``--compile.enable``): the policy
    only tags the joint graph (MUST_SAVE / PREFER_RECOMPUTE) and the min-cut partitioner saves a tagged
    output only if the backward uses it, so the W2 output, which only the residual add reads, is not
    kept; measured with inductor and aot_eager on torch 2.13 (planner/compile_probe.py: the block saves
    its input, Q, V, the attention output and log-sum-exp and W1's output, nothing else;
    tests/test_torchtitan_compile.py). With TP, W2's reduce-scatter output is dropped for the same
    reason and O's is kept (the recompute of the norm2 input reads it; not measured: the probe has no TP).

    ``float8_scales`` (compiled, torchao float8: :func:`torchao_fp8_recomputes_inputs`): the compiled graph also
    keeps two fp32 rowwise scales per token (measured, planner/compile_probe.py; counted over every token of the
    rank, not divided by TP: the probe has no TP).
    """
    t = plan.tp
    by_name = {x.name: x for x in terms}
    keep = {"norm1 input", "Q", "out-proj input", "softmax log-sum-exp"}
    out = []
    for x in terms:
        if x.name == "K, V":  # K (mm 2) recomputed, V (mm 3) kept
            out += [ActTerm("K", x.bytes / 2, selective=False), ActTerm("V", x.bytes / 2, selective=True)]
        elif x.name == "activation input (FC1 output)" and model.activation == "swiglu":  # W1 kept, W3 not
            out += [ActTerm("W1 output", x.bytes / 2, selective=True),
                    ActTerm("W3 output", x.bytes / 2, selective=False)]
        else:
            out.append(replace(x, selective=(x.name in keep) if x.selective is None else x.selective))
    sbh = by_name["norm1 input"].bytes * (plan.tp if plan.sequence_parallel else 1)  # s b h e, ungathered
    if float8_scales:
        sb = sbh / model.hidden_size / e
        out.append(ActTerm("float8 rowwise scales (kept by the compiled op AC)", 2 * sb * FP32_BYTES, selective=True,
                           autograd=False))
    if "FC2 input" in by_name and not compiled:  # a dense MLP (a MoE layer's terms say what they keep themselves)
        out.append(ActTerm("W2 output (aten.mm kept by op AC)", sbh, selective=True, autograd=False))
    if t > 1 and compiled:
        out.append(ActTerm("O reduce-scatter output (kept by op AC, read by the compiled recompute)", sbh / t,
                           selective=True, autograd=False))
    elif t > 1:
        out.append(ActTerm("O and W2 reduce-scatter outputs (kept by op AC)", 2 * sbh / t, selective=True,
                           autograd=False))
    return out


def saved_bytes_per_layer(terms: list[ActTerm], recompute: str) -> float:
    """Bytes a layer keeps between its forward and backward under ``recompute``.

    none: every term autograd saves; selective: all but the attention core (Korthikanti section 5),
    or what the framework's op-level policy keeps (``ActTerm.selective``, :func:`op_sac_terms`);
    full: the layer input only (``2 sbh``, / t with SP; Korthikanti Table 2).
    """
    return sum(x.bytes for x in terms if kept_under(x, recompute))


def kept_under(x: ActTerm, recompute: str) -> bool:
    """Whether a layer keeps ``x`` between its forward and backward under ``recompute`` (the rules of
    :func:`saved_bytes_per_layer`)."""
    if recompute == "full":
        return x.layer_input
    if recompute == "selective":
        return x.selective if x.selective is not None else not x.core
    return x.autograd


def recompute_working_bytes(terms: list[ActTerm], recompute: str) -> float:
    """Bytes recomputed for one layer during its backward, live on top of what is saved: the
    tensors autograd saves that ``recompute`` does not keep (none under ``none``)."""
    return sum(x.bytes for x in terms if x.autograd and not kept_under(x, recompute))


def a2a_overlap_active(model: ModelSpec, training: TrainingSpec, plan: Plan) -> bool:
    """Whether Megatron-Core runs ``plan`` with the MoE all-to-all overlap the job asks for
    (``TrainingSpec.moe_a2a_overlap``, ``--overlap-moe-expert-parallel-comm``): a MoE model, Megatron's schedule
    (megatron, nemo) and a plan ``TransformerConfig.__post_init__`` (core_v0.16.1) accepts with it: ep > 1,
    virtual pipeline stages when pp > 1, no full recomputation, at most one MTP layer and then pp > 1
    (``specs.a2a_overlap_problems``, part of ``plan_problems``: the search proposes no other plan for such a job,
    ``estimate`` and ``check`` refuse one). Elsewhere neither its time nor its memory applies."""
    return training.moe_a2a_overlap and model.is_moe and not a2a_overlap_problems(model, training, plan)


def a2a_overlap_extra_layers(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches, stage: int,
                             layers: int):
    """Layers' activations a stage holds at its peak beyond the schedule's own count when the MoE all-to-all
    overlap runs (:func:`a2a_overlap_active`; 0 elsewhere). Two things, both in Megatron-Core core_v0.16.1:

    * with pp > 1 the interleaved schedule runs one more warm-up forward ("we schedule one extra micro-batch forward
      step before the 1f1b stages", ``schedules.py`` ``get_pp_rank_microbatches``: ``num_warmup_microbatches + 1``,
      at most every chunk of every micro-batch): one more chunk in flight (``in_flight_chunks`` with
      ``warmup_extra=1``), counted at the stage's largest chunk;
    * in the merged steady step (``combined_1f1b.py``: one micro-batch's forward runs layer by layer together with
      another's backward, the forward of layer ``i`` before the backward of layer ``L-1-i`` frees its tensors), the
      forward's layers grow as the backward's shrink: one layer more than the backward alone holds.

    ``num_microbatches`` may be a numpy array (the search)."""
    if not layers or not a2a_overlap_active(model, training, plan):
        return np.zeros_like(np.asarray(num_microbatches, dtype=float))
    extra = 1.0
    if plan.pp > 1:
        base = in_flight_chunks(plan, num_microbatches, stage)
        more = in_flight_chunks(plan, num_microbatches, stage, warmup_extra=1)
        extra = extra + (more - base) * math.ceil(layers / plan.vpp)
    return np.asarray(extra, dtype=float) + np.zeros_like(np.asarray(num_microbatches, dtype=float))


def in_flight_chunks(plan: Plan, num_microbatches, stage: int, w_fraction: float = 0.0, family: str = "megatron",
                     warmup_extra: int = 0):
    """Micro-batches (chunk-micro-batches when ``vpp > 1``) whose activations stage ``stage`` holds at peak.

    The zero-bubble schedules (``plan.pipeline_schedule`` interleaved_zb, zbv, dualpipev) take the closed
    forms of ``schedules.peak_in_flight``, checked against torch.distributed.pipelining's action lists and
    its saved-tensor peaks on gloo (docs/schedules.md); ``w_fraction`` is what a chunk waiting for its
    weight-gradient step still holds (:func:`schedule_w_fraction`).

    1F1B: ``min(m, p - r)`` (Megatron ``schedules.py``: ``p - r - 1`` warm-up forwards + 1).
    Interleaved: warm-up ``2 (p - r - 1) + (v - 1) N`` chunk forwards + 1, at most ``m v``, with ``N`` the
    micro-batch group size (default ``p``; Megatron ``get_pp_rank_microbatches``). In torch's order
    (``family`` ``"torch"``: torchtitan and plain torch, ``ScheduleInterleaved1F1B``) ``N`` is its
    micro-batches per round, ``m // max(1, m // p)`` (``schedules.torch_group_size``): ``p`` when ``m`` is a
    multiple of ``p``, more otherwise (torch's flex rounds; p 2, v 2, m 3: 6 in flight on rank 0 where the
    Megatron order holds 5). ``tests/test_schedules.py`` checks these against Megatron-Core's and
    torch.distributed.pipelining's own schedule code, and ``tests/test_schedules_zb.py`` against the saved
    tensors torch's schedule holds on gloo. ``num_microbatches`` may be a numpy array (the search evaluates
    many at once). ``warmup_extra``: more warm-up forwards in Megatron's interleaved order (the MoE all-to-all
    overlap's one, :func:`a2a_overlap_extra_layers`).
    """
    p, v, m, r = plan.pp, plan.vpp, num_microbatches, stage
    if plan.pipeline_schedule in ("interleaved_zb", "zbv", "dualpipev"):
        from planner.schedules import peak_in_flight

        return np.asarray(peak_in_flight(plan.pipeline_schedule, p, v, m, r, w_fraction=w_fraction))
    if v == 1:
        return np.minimum(m, p - r)
    if family == "torch":  # torch's micro-batches per round (schedules.torch_group_size)
        n = m // np.maximum(1, m // p)
    else:
        n = plan.microbatch_group_size or p  # Megatron's group size N, default p (planner/schedules.py)
    return np.minimum(m * v, 2 * (p - r - 1) + (v - 1) * n + warmup_extra + 1)


def schedule_w_fraction(training: TrainingSpec) -> float:
    """Share of a chunk's saved activations kept between its input-gradient (I) and weight-gradient (W)
    steps: torch's runtime keeps all of them (``schedules.TORCH_W_FRACTION``, measured on gloo); the
    other frameworks run no split backward (0)."""
    from planner.schedules import TORCH_W_FRACTION, framework_family

    return TORCH_W_FRACTION if framework_family(training.framework) == "torch" else 0.0


def stage_in_flight_chunks(training: TrainingSpec, plan: Plan, num_microbatches, stage: int):
    """:func:`in_flight_chunks` with the framework's ``w_fraction`` and schedule order (``schedules.framework_family``)."""
    from planner.schedules import framework_family

    return in_flight_chunks(plan, num_microbatches, stage, schedule_w_fraction(training),
                            framework_family(training.framework))


def saved_bytes_per_layer_kind(model: ModelSpec, training: TrainingSpec, plan: Plan) -> tuple[float, float]:
    """(dense layer, MoE layer) bytes one layer keeps for backward under ``plan.recompute`` (the MoE
    value is 0 for a dense model).

    Megatron's ``--distribute-saved-activations`` (``training.distribute_saved_activations``, full recompute,
    tp > 1, no SP): the checkpoint keeps ``split_tensor_into_1d_equal_chunks`` of its input, this rank's 1/tp
    share in a new buffer, in place of the whole input (core_v0.16.1 ``tensor_parallel/random.py``
    ``CheckpointFunction.forward``); what the backward gathers back is the recompute's, not held between passes."""
    share = 1 / plan.tp if distributes_checkpoints(training, plan) else 1.0
    dense = share * saved_bytes_per_layer(layer_activation_terms(model, training, plan, moe=False), plan.recompute)
    if not model.is_moe:
        return dense, 0.0
    return dense, share * saved_bytes_per_layer(layer_activation_terms(model, training, plan, moe=True), plan.recompute)


def distributes_checkpoints(training: TrainingSpec, plan: Plan) -> bool:
    """Whether each full-recompute checkpoint keeps only its 1/tp share of the layer input (Megatron
    ``--distribute-saved-activations``, DeepSpeed's ``partition_activations``) where the framework's rules for it
    (``specs.distributed_checkpoint_problems``) hold and there is more than one TP rank; elsewhere the inputs are
    kept whole. Under DeepSpeed with sequence parallelism the share is 1/tp of the sequence shard."""
    return (training.distribute_saved_activations and plan.tp > 1
            and not distributed_checkpoint_problems(training, plan))


def cp_ring_transient_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """Bytes Transformer Engine's ring attention holds for one layer on top of what it saves, at the end of its
    forward, where Megatron-Core runs context parallelism (``--cp-comm-type p2p``, the default; megatron, nemo).

    ``AttnFuncWithCPAndKVP2P.forward`` (NVIDIA/TransformerEngine ``transformer_engine/pytorch/attention/
    dot_product_attention/context_parallel.py``, TE 2.x) keeps every step's output (``out_per_step``, ``cp`` of
    them; the last CP rank's are all full-length, the others' later ones half) and every received K/V chunk
    (``p2p_comm_buffers``, ``cp`` entries, the local one among them, which the layer saves anyway) in lists until
    the output correction after the last step, which accumulates into an fp32 output; the per-step log-sum-exps
    (fp32) likewise. So, with ``O`` one local output (``s/cp x b x a/t x d``, 16-bit) and ``KV`` one local K/V
    chunk: ``cp O + 2 O + (cp - 1) KV + cp x lse``. The backward's two K/V + dK/dV ring buffers and fp32 dQ are
    smaller for cp >= 2 and are not counted apart. Not for multi-head latent attention (its K and V widths differ;
    not modelled) nor torchtitan, whose ring attention is torch's own (``torch.distributed.tensor.experimental``)."""
    from planner.schedules import framework_family

    if plan.cp == 1 or training.attention not in FLASH_ATTENTION or model.is_mla \
            or framework_family(training.framework) != "megatron":
        return 0.0
    t, c, e = plan.tp, plan.cp, act_bytes(training)
    sb = training.seq_len // c * plan.micro_batch_size
    out = sb * model.q_size / t * e
    kv = 2 * sb * kv_heads_per_rank(model, t) * model.kv_channels * e
    lse = c * sb * model.num_attention_heads / t * FP32_BYTES
    return c * out + 2 * out + (c - 1) * kv + lse


def layer_recompute_working_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """One layer's recompute working set (:func:`recompute_working_bytes`), the larger of the dense and
    the MoE layer for a MoE model. Under Megatron's uniform groups of N layers (``plan.recompute_group_layers``)
    a group is recomputed whole before its backward (core_v0.16.1 ``transformer_block.py``
    ``_checkpointed_forward``): N layers' recomputed tensors, and the inputs of its N - 1 inner layers (the
    group's own input is the checkpoint, already saved), N at most the largest chunk. A distributed checkpoint
    (:func:`distributes_checkpoints`) is gathered back whole before its recompute, in place of its 1/tp share
    (core_v0.16.1 ``CheckpointFunction.backward``: ``gather_split_1d_tensor``): the other (tp - 1)/tp of the
    input join the working set. Context parallelism adds its ring attention's transient buffers
    (:func:`cp_ring_transient_bytes`), there in the forward and again in a full recompute's."""
    kinds = [False, True] if model.is_moe else [False]
    one = max(recompute_working_bytes(layer_activation_terms(model, training, plan, moe=m), plan.recompute)
              for m in kinds)
    ring = cp_ring_transient_bytes(model, training, plan)
    if plan.recompute != "full":
        return one + ring
    inputs = max(saved_bytes_per_layer(layer_activation_terms(model, training, plan, moe=m), "full") for m in kinds)
    gathered = (1 - 1 / plan.tp) * inputs if distributes_checkpoints(training, plan) else 0.0
    if plan.recompute_group_layers is None:
        return one + gathered + ring
    n = min(plan.recompute_group_layers, max(max(c) for c in plan.chunk_layers(model.num_layers)))
    return n * one + (n - 1) * inputs + gathered + ring


def chunk_peak_layers(training: TrainingSpec, plan: Plan, num_microbatches: int, stage: int,
                      layers: int) -> float | None:
    """Layers whose activations a stage holds at its peak when its chunks hold unequal numbers of layers,
    counted over the schedule's own action list (schedules.peak_in_flight_layers). None for a stage of
    equal chunks, where in-flight chunks x the chunk's layers is exact.

    In-flight chunks x the mean chunk is wrong when the chunks differ, because the schedule does not hold
    them in proportion: a chunk that holds no transformer layer (rank 0's embedding chunk, the last rank's
    loss chunk: specs.min_stage_layers) is in flight but holds nothing, and a stage whose layers vpp does
    not divide (specs.stage_chunks: the longer chunks first, except on rank 0) runs the early chunks of its
    warm-up group first. Megatron's order, p = 16, v = 4, N = 16, the last rank of 7 layers as (2, 2, 2, 1):
    its 48 warm-up forwards are chunks 0..2 of micro-batches 0..15, 96 layers, and its peak 98
    (F(chunk 0 of mb 16) before B(chunk 2 of mb 0)); the mean chunk gave 49 x 7/4 = 85.75
    (tests/test_meta_405b.py)."""
    if not layers or not uneven_chunks(layers, plan.vpp, first=stage == 0):
        return None
    from planner.schedules import framework_family

    family = framework_family(training.framework)
    return _chunk_peak_layers(plan.schedule, plan.pp, int(num_microbatches), stage, plan.vpp,
                              "torch" if family == "deepspeed" else family, plan.microbatch_group_size, layers,
                              schedule_w_fraction(training))


@functools.lru_cache(maxsize=65536)
def _chunk_peak_layers(schedule: str, pp: int, num_microbatches: int, stage: int, vpp: int, family: str,
                       group: int | None, layers: int, w_fraction: float) -> float:
    """:func:`chunk_peak_layers` on hashable arguments, cached: the search asks for the same stage and schedule
    for many plans (tens of thousands of times for DeepSeek-V3 on 2048 GPUs)."""
    from planner.schedules import peak_in_flight_layers, schedule_actions

    chunks = stage_chunks(layers, vpp, first=stage == 0)
    actions = schedule_actions(schedule, pp, num_microbatches, stage, vpp, family, group)
    return float(peak_in_flight_layers(actions, chunks, w_fraction))


def offload_resident_layers(model: ModelSpec, plan: Plan, layers: int) -> tuple[int, int]:
    """(dense, MoE) layers whose saved activations are on the GPU at the peak of a pp = 1 stage of
    ``layers`` layers that offloads its first ``N = plan.cpu_offload_layers`` (N > 0): the ``L - N`` layers
    not offloaded and one offloaded layer in flight, ``L - N + 1`` in all.

    Source: Megatron-LM core_v0.16.1 ``transformer_block.py`` wraps each layer in Transformer Engine's
    ``get_cpu_offload_context(cpu_offloading, cpu_offloading_num_layers, num_layers, ...)`` and calls
    ``group_prefetch_offload_commit_async`` after it; TE (2.9, ``pytorch/cpu_offload.py``,
    ``AsyncDoubleBufferGroupOffloadHandler``) offloads layer (group) ``i < N`` on a D2H stream and frees
    it at the commit of layer ``layer_window_map[i] = (L // N)(i + 1) - 1`` (+ the remainder spread over
    the first ``L % N`` groups), the last one at layer ``L - 1``; the next group's copy starts then. In
    backward it reloads group ``i`` when the backward reaches layer ``layer_window_map[i]``. Counting
    layers held after each forward layer and before each backward layer gives at most ``L - N + 1``
    (the end of the forward: the ``L - N`` kept layers and group ``N - 1``, freed at that commit);
    ``tests/test_offload.py`` replays the window map for every N < L. Megatron leaves TE's
    ``double_buffering`` off (``cpu_offloading_double_buffering`` defaults to False and has no
    command-line flag: arguments.py excludes it), so no reload buffers are kept beyond the layer reloaded.

    Every saved tensor of an offloaded layer is counted as offloaded: TE marks the inputs its modules save
    and Megatron the linear inputs (``tensor_parallel/layers.py``, ``input_parallel.activation_offloading``)
    and the MLP activation input (``transformer/mlp.py``); the few unmarked tensors (e.g. dropout masks)
    are left out. The host memory that receives them is not modelled."""
    n = plan.cpu_offload_layers
    held = range(n - 1, layers)  # layers N-1 (in flight) .. L-1 (not offloaded)
    moe = sum(1 for i in held if model.is_moe_layer(i))
    return len(held) - moe, moe


def stage_saved_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches: int,
                      stage: int, layers: int) -> float:
    """What the layers of stage ``stage`` keep for backward at its peak: in-flight chunks x layers per chunk
    x bytes saved per layer (A3, A4); a MoE model's dense-first and MoE layers each with their own bytes
    (``Plan.stage_moe_layers``). `plan3d validate` measures exactly this. With activation offloading
    (``plan.cpu_offload_layers``, pp = 1) only :func:`offload_resident_layers` count.

    Megatron's block recompute (``plan.recompute_num_layers`` K): the first K layers of each chunk keep their
    input only, the others everything, so the stage holds the share ``specs.recomputed_share`` gives of what it
    would hold under full recompute and the rest of what it would hold under none (exact for equal chunks; with
    unequal ones the smallest chunk share, an upper bound). torchtitan's per-layer AC (``plan.recompute_interval``
    N) likewise, with every N-th layer of the rank recomputed (exact at vpp 1). Megatron's uniform groups of N
    (``plan.recompute_group_layers``): full recompute's inputs, one per group (``Plan.grouped_share``)."""
    if plan.recompute == "full" and plan.recompute_group_layers is not None:  # Megatron's uniform groups of N
        whole = plan.model_copy(update={"recompute_group_layers": None})
        return plan.grouped_share(stage, layers) * stage_saved_bytes(model, training, whole, num_microbatches, stage,
                                                                     layers)
    if plan.partial_recompute:
        share = plan.recomputed_share(stage, layers)[1]
        whole = plan.model_copy(update={"recompute_num_layers": None, "recompute_interval": None})
        kept = whole.model_copy(update={"recompute": "none"})
        return share * stage_saved_bytes(model, training, whole, num_microbatches, stage, layers) + \
            (1 - share) * stage_saved_bytes(model, training, kept, num_microbatches, stage, layers)
    dense_b, moe_b = saved_bytes_per_layer_kind(model, training, plan)
    moe_layers = stage_moe_layer_count(model, plan, stage, layers)
    # the MoE all-to-all overlap's extra layers, at the heavier layer kind of the stage; with activation offloading
    # too (Megatron-Core allows both; the merged step's extra forward layer is on the GPU either way)
    overlap = float(a2a_overlap_extra_layers(model, training, plan, num_microbatches, stage, layers)) * \
        (max(dense_b, moe_b) if moe_layers else dense_b)
    if plan.cpu_offload_layers:
        dense_n, moe_n = offload_resident_layers(model, plan, layers)
        return float(stage_in_flight_chunks(training, plan, num_microbatches, stage) * (dense_n * dense_b + moe_n * moe_b)
                     ) + overlap
    peak_layers = chunk_peak_layers(training, plan, num_microbatches, stage, layers)
    if peak_layers is not None:
        per_layer = ((layers - moe_layers) * dense_b + moe_layers * moe_b) / layers
        return float(peak_layers * per_layer) + overlap
    per_chunk = ((layers - moe_layers) * dense_b + moe_layers * moe_b) / plan.vpp
    return float(stage_in_flight_chunks(training, plan, num_microbatches, stage) * per_chunk) + overlap


def bf16_layer_delta_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """What one layer that runs outside the FP8/FP4 context (``TrainingSpec.bf16_layers_at_start/end``, Megatron
    --first-last-layers-bf16) saves per micro-batch beyond the same layer at the job's precision: its GEMM inputs in
    16 bits (:func:`linear_input_bytes`), the heavier layer kind of a MoE model. Under Megatron's partial recompute
    (block or interval) the layer is taken as not recomputed, an upper bound; under full recompute it keeps its
    input only, the same either way."""
    if not (training.bf16_layers_at_start or training.bf16_layers_at_end) or training.precision == "bf16":
        return 0.0
    if plan.partial_recompute:
        plan = plan.model_copy(update={"recompute": "none", "recompute_num_layers": None, "recompute_interval": None})
    low = saved_bytes_per_layer_kind(model, training, plan)
    high = saved_bytes_per_layer_kind(model, training.model_copy(update={"precision": "bf16"}), plan)
    return max(high[0] - low[0], high[1] - low[1] if model.is_moe else 0.0, 0.0)


def bf16_layers_on_stage(training: TrainingSpec, pp: int, stage: int) -> int:
    """How many of the bf16 end layers (``TrainingSpec.bf16_layers_at_start/end``) pipeline rank ``stage`` holds: the
    first ones on rank 0, the last ones on rank pp - 1 (both on rank 0 without PP)."""
    return (training.bf16_layers_at_start if stage == 0 else 0) + (training.bf16_layers_at_end if stage == pp - 1
                                                                  else 0)


def bf16_layers_extra_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches, stage: int):
    """The extra saved bytes of the bf16 layers on ``stage`` at its peak (:func:`bf16_layer_delta_bytes` per layer and
    micro-batch): the first ``bf16_layers_at_start`` layers are on pipeline rank 0 and the last ``bf16_layers_at_end``
    on rank pp - 1 (core_v0.16.1 ``is_first_last_bf16_layer`` takes global layer numbers; Megatron keeps each count
    within num_layers // pp, ``TransformerConfig.__post_init__``), each held by every micro-batch in flight there:
    exact at vpp 1, and at vpp > 1 the stage's in-flight chunk-micro-batches (at most m), an upper bound for the one
    chunk that holds them. Elementwise on arrays of micro-batch counts (the search)."""
    n = bf16_layers_on_stage(training, plan.pp, stage)
    if not n:
        return 0.0
    inflight = np.minimum(num_microbatches, stage_in_flight_chunks(training, plan, num_microbatches, stage))
    return n * bf16_layer_delta_bytes(model, training, plan) * inflight


def stage_activation_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches: int,
                           stage: int, layers: int) -> float:
    """Saved activations of stage ``stage`` at its peak, plus one layer's recompute working set."""
    return stage_saved_bytes(model, training, plan, num_microbatches, stage, layers) + \
        layer_recompute_working_bytes(model, training, plan)


def input_bytes_per_microbatch(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """First stage, per in-flight micro-batch: int64 input ids and the embedding dropout mask
    (Korthikanti section 4.3; Megatron ``compute_activation_memory``)."""
    sp = plan.tp if plan.sequence_parallel else 1
    s, b, h = training.seq_len // plan.cp, plan.micro_batch_size, model.hidden_size
    return s * b * TOKEN_ID_BYTES + (s * b * h / sp if model.dropout else 0.0)


def dataloader_mask_bytes(training: TrainingSpec, plan: Plan) -> float:
    """The attention mask Megatron-LM's data path puts on the GPU for the micro-batch in its forward
    (``TrainingSpec.attention_mask_in_dataloader``), on every TP rank of the first and the last pipeline stage: a
    bool tensor of ``micro_batch x 1 x s x s`` (core_v0.16.1 training/utils.py ``get_batch_on_this_tp_rank``:
    ``data["attention_mask"].cuda()`` on TP rank 0, ``torch.empty((micro_batch_size, 1, seq_length, seq_length),
    dtype=torch.bool)`` on the others, broadcast), its query dimension cut to ``s/cp`` under CP
    (core/utils.py ``get_batch_on_this_cp_rank``: ``seq_dim = 2`` for the mask). It lives while its micro-batch's
    forward runs, the loss included (Megatron-Core's GPTModel computes the loss in its forward), so it adds to
    the last stage's loss spike (:func:`output_bytes`) and to the first stage once. 1 byte per element: 64 MiB at
    8,192 tokens, 16 GiB at 131,072 without CP."""
    if not training.attention_mask_in_dataloader:
        return 0.0
    return float(plan.micro_batch_size * (training.seq_len // plan.cp) * training.seq_len)


def deferred_wgrad_microbatches(training: TrainingSpec, num_microbatches):
    """How many micro-batches' output-layer weight gradients wait for the flush
    (``TrainingSpec.defer_embedding_wgrad``): ``wgrad_deferral_limit`` of them, or all at 0 (Megatron's default); none
    without the switch. Elementwise on arrays of micro-batch counts (the search)."""
    if not training.defer_embedding_wgrad:
        return 0
    m = np.asarray(num_microbatches)
    return m if training.wgrad_deferral_limit == 0 else np.minimum(training.wgrad_deferral_limit, m)


def deferred_wgrad_bytes_per_microbatch(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """What the loss stage keeps per deferred micro-batch for the output layer's deferred weight gradient
    (``TrainingSpec.defer_embedding_wgrad``, Megatron --defer-embedding-wgrad-compute): the logits gradient,
    ``s/cp x b x V_pad/t`` in the activation dtype (core_v0.16.1 tensor_parallel/layers.py
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``: ``grad_output_buffer.append(grad_output)`` instead
    of the wgrad GEMM), and the output layer's input, ``s/cp x b x h / t_SP`` (``ColumnParallelLinear.forward``:
    ``embedding_activation_buffer.append(input_parallel)``); both lists are emptied at the pipeline flush."""
    if not training.defer_embedding_wgrad:
        return 0.0
    sp = plan.tp if plan.sequence_parallel else 1
    sb = training.seq_len // plan.cp * plan.micro_batch_size
    e = act_bytes(training)
    return sb * padded_vocab_size(model.vocab_size, plan.tp) / plan.tp * e + sb * model.hidden_size * e / sp


def deferred_wgrad_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches):
    """The deferred output-layer weight gradients the loss stage holds (:func:`deferred_wgrad_microbatches` x
    :func:`deferred_wgrad_bytes_per_microbatch`), counted whole at the stage's peak: the last stage holds one
    micro-batch's activations in flight under 1F1B when the lists are longest, so this over-counts by at most that
    stage's in-flight activations."""
    return deferred_wgrad_microbatches(training, num_microbatches) * \
        deferred_wgrad_bytes_per_microbatch(model, training, plan)


def output_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """Last stage: the final norm's and the output layer's inputs, the logits and cross-entropy
    spike of one micro-batch and the int64 labels. Bytes per logit are the framework's
    (``FrameworkProfile.logits_bytes_per_element``: 6 for Megatron's vocab-parallel cross entropy,
    module docstring; 12 for torchtitan's ``cross_entropy(pred.float())``)."""
    t = plan.tp
    sp = t if plan.sequence_parallel else 1
    s, b, h = training.seq_len // plan.cp, plan.micro_batch_size, model.hidden_size
    v_pad = padded_vocab_size(model.vocab_size, t)
    e = act_bytes(training)
    logits = frameworks.get(training.framework).logits_bytes_per_element(training, plan)
    softcap = e if model.final_logit_softcap is not None else 0  # cap * tanh(logits / cap)'s saved tanh (Gemma-2)
    inputs = 2 * s * b * h * e / sp + s * b * TOKEN_ID_BYTES  # final-norm and output-layer inputs, labels
    head = inputs + (logits + softcap) * s * b * v_pad / t
    kept_head = inputs + (kept_logits_bytes_per_element(training) + softcap) * s * b * v_pad / t
    return head + mtp_bytes(model, training, plan, kept_head) + dataloader_mask_bytes(training, plan)


def kept_logits_bytes_per_element(training: TrainingSpec) -> float:
    """Bytes per logit a finished loss forward keeps for its backward: the fp32 softmax Megatron's vocab-parallel cross
    entropy saves (``exp_logits``, 4 B; plain or ``--cross-entropy-loss-fusion`` native: the bf16 logits are freed
    once upcast), or the bf16 logits Transformer Engine's fused loss writes its gradient into (2 B,
    ``planner.frameworks.megatron`` module docstring). A multi-token-prediction head's loss runs before the main
    one (:func:`mtp_bytes`), so at the main loss's backward peak it holds this much, not its own peak."""
    return 2 if training.cross_entropy_fusion == "te" else 4


def mtp_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, head_bytes: float) -> float:
    """What the multi-token-prediction modules (``ModelSpec.mtp_num_layers``) keep for backward, per micro-batch on
    the loss stage. Megatron-Core computes each module's logits and loss inside the forward
    (core_v0.16.1 ``gpt_model.py`` ``_postprocess``: ``process_mtp_loss`` before the main logits), so all of it
    lives with the main logits until the loss backward, the loss phase of :func:`layer_phase_bytes`. Per module:
    one layer of the last layer's kind (:func:`saved_bytes_per_layer_kind`), the inputs of ``enorm``, ``hnorm``
    and of ``eh_proj`` (the two normed halves, ``2h``) (``MultiTokenPredictionLayer.forward``), and a second
    output head as its finished loss keeps it (``head_bytes``: final-norm and output-layer inputs, the logits its loss
    saved, :func:`kept_logits_bytes_per_element`, labels): the main loss's backward, the peak, comes first (autograd
    runs the later-made node first) while the MTP loss still waits for its own. NVIDIA's MTP functional test on DGX
    H100 (``benchmarks/megatron_functional_memory.py``, MoE + MLA + MTP, native fused loss): -1.3 % so; -2.8 % with
    6 B per logit in both heads, +3.1 % with the main head's 10 in both."""
    n = model.mtp_num_layers
    if not n:
        return 0.0
    sp = plan.tp if plan.sequence_parallel else 1
    sbh_e = training.seq_len // plan.cp * plan.micro_batch_size * model.hidden_size * act_bytes(training) / sp
    dense_b, moe_b = saved_bytes_per_layer_kind(model, training, plan)
    layer = moe_b if model.mtp_is_moe() else dense_b
    return n * (layer + 4 * sbh_e + head_bytes)


def stage_boundary_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """One micro-batch's activation between pipeline stages: ``s/cp x b x h``, sequence-sharded under SP."""
    sp = plan.tp if plan.sequence_parallel else 1
    return training.seq_len // plan.cp * plan.micro_batch_size * model.hidden_size * act_bytes(training) / sp


def pipeline_receiving_chunks(plan: Plan, stage: int) -> tuple[int, int]:
    """(chunks of pipeline rank ``stage`` that receive their input, chunks that receive their output's gradient):
    all but the chunk holding the first virtual stage, all but the one holding the last
    (``schedules.stage_index``: loop order, or V order where rank 0 holds both ends)."""
    from planner.schedules import stage_index

    last = plan.pp * plan.vpp - 1
    stages = [stage_index(plan.schedule, plan.pp, stage, c) for c in range(plan.vpp)]
    return sum(g != 0 for g in stages), sum(g != last for g in stages)


def pipeline_buffer_count(plan: Plan, num_microbatches, stage, in_flight):
    """Stage-boundary-sized receive buffers of torch.distributed.pipelining on pipeline rank ``stage``
    beyond the in-flight stage inputs (``in_flight`` chunks, :func:`stage_in_flight_chunks`) that the saved
    activations already count (:func:`pipeline_buffer_bytes`). Vectorised over ``num_microbatches`` and
    ``in_flight``, and over ``stage`` given as an array of ranks (search)."""
    v, m = plan.vpp, num_microbatches
    ranks = np.atleast_1d(np.asarray(stage))
    counts = np.array([pipeline_receiving_chunks(plan, int(r)) for r in ranks.ravel()], dtype=float)
    receiving = counts[:, 0].reshape(ranks.shape)
    sending_back = counts[:, 1].reshape(ranks.shape)
    if np.ndim(stage) == 0:
        receiving, sending_back = receiving[0], sending_back[0]
    return np.maximum(receiving * m - in_flight * receiving / v, 0) + sending_back * m


def pipeline_buffer_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches,
                          stage: int):
    """torch.distributed.pipelining's receive buffers on pipeline rank ``stage``, beyond the in-flight
    stage inputs the saved activations already count.

    torch 2.13 ``distributed/pipelining/stage.py``: ``PipelineStage._setup_forward_recv_info`` gives every
    virtual stage but the first one receive buffer per micro-batch for its input
    (``for chunk_id in range(num_microbatches)`` ... ``_make_tensor_from_meta``), and
    ``_setup_backward_recv_info`` every virtual stage but the last one per micro-batch for its output's
    gradient; they are made at the first step and kept (``clear_runtime_states`` keeps them). Each is
    the stage boundary tensor (:func:`stage_boundary_bytes`). A received input is what the chunk's first
    layer saves while its micro-batch is in flight (counted by :func:`stage_saved_bytes`), so those are
    taken off; where a rank's chunk holds the first virtual stage (it receives nothing), the in-flight chunks
    are taken off in proportion (the receiving ``(vpp-1)/vpp``; :func:`pipeline_receiving_chunks`)."""
    if plan.pp == 1 or not frameworks.get(training.framework).pipeline_recv_buffers:
        return 0.0
    in_flight = stage_in_flight_chunks(training, plan, num_microbatches, stage)
    return pipeline_buffer_count(plan, num_microbatches, stage, in_flight) * stage_boundary_bytes(model, training, plan)


def megatron_p2p_tensor_count(plan: Plan, num_microbatches, stage, in_flight, overlap_p2p: bool):
    """Stage-boundary tensors Megatron-Core's pipeline schedules hold on pipeline rank ``stage`` beyond the in-flight
    stage inputs the saved activations count, in the steady state (at least two steady iterations: ``in_flight`` chunks,
    :func:`stage_in_flight_chunks`, below the rank's ``m x vpp``; 0 before, and with pp = 1). Vectorised over
    ``num_microbatches``, ``in_flight`` and ``stage`` (an array of ranks: search).

    From core_v0.16.1 ``pipeline_parallel/schedules.py``:

    * 1F1B (``forward_backward_pipelining_without_interleaving``): the loop's ``input_tensor_grad`` (what
      ``backward_step`` returned: ``input_tensor.grad``, the ``retain_grad`` copy) and ``output_tensor_grad`` (what
      ``send_forward_recv_backward`` received) stay bound to their Python names until the next iteration rebinds them,
      after its forward: one of each through the next micro-batch's forward and into its backward. The first stage
      has no input gradient (``backward_step`` returns ``None`` there), the last no output gradient.
    * interleaved (``forward_backward_pipelining_with_interleaving``): the steady loop's ``input_tensor_grad`` likewise,
      the output gradient received for the next backward (``output_tensor_grads[...].append``, held until that
      backward pops it), and, with ``overlap_p2p_comm`` (Megatron's default with interleaving; arguments.py turns it
      off without), the input received for the next forward (``pp_post_forward`` posts it after this forward) while
      this forward's output waits for ``pp_pre_forward``'s ``deallocate_output_tensor``: three; two without the
      overlap, where both receives follow the backward (``send_forward_backward_recv_forward_backward``).

    Held out against NVIDIA's functional tests (``benchmarks/megatron_functional_memory.py``): the 7B TP1 x PP4 x VPP8
    case's last stage read 193.6 MiB (3.0 boundaries of 64 MiB) above the prediction before this term."""
    ranks = np.asarray(stage)
    m = np.asarray(num_microbatches, dtype=float)
    if plan.vpp > 1:
        held = np.full(np.shape(ranks), 3.0 if overlap_p2p else 2.0)
    else:
        held = (ranks > 0).astype(float) + (ranks < plan.pp - 1)
    steady = np.asarray(in_flight, dtype=float) <= m * plan.vpp - 1
    out = np.where(steady, held, 0.0)
    if plan.pp == 1:
        out = np.zeros_like(out)
    return out if np.ndim(out) else float(out)


def megatron_p2p_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches, stage: int):
    """:func:`megatron_p2p_tensor_count` boundary tensors (:func:`stage_boundary_bytes`) where the framework runs
    Megatron-Core's schedules (``FrameworkProfile.megatron_p2p_tensors``: megatron, nemo); 0 elsewhere."""
    if plan.pp == 1 or not frameworks.get(training.framework).megatron_p2p_tensors:
        return 0.0
    from planner.cost import resolved_overlap  # cost imports this module

    in_flight = stage_in_flight_chunks(training, plan, num_microbatches, stage)
    overlap = resolved_overlap(training).overlap_p2p_comm
    count = megatron_p2p_tensor_count(plan, num_microbatches, stage, in_flight, overlap)
    return count * stage_boundary_bytes(model, training, plan)


def deepspeed_pipe_tensor_counts(plan: Plan, num_microbatches, stage):
    """(whole stage-boundary tensors, sent-size boundary tensors, kept module outputs) DeepSpeed's pipeline engine
    holds on pipeline rank ``stage`` at its peak, beyond the saved activations. Vectorised over ``num_microbatches``
    and ``stage`` (an array of ranks: search).

    From deepspeed 0.19.8 ``runtime/pipe/engine.py`` (``PipelineEngine``), with ``k = min(pp - r, m)`` micro-batches
    in flight (``pipe/schedule.py`` ``TrainSchedule.num_pipe_buffers``):

    * every stage but the last keeps each in-flight micro-batch's output in ``pipe_buffers['outputs']`` until its
      backward (sent size: under model parallelism the engine keeps only this rank's part, ``pipe_partitioned``, on by
      default, and empties the full tensor's data); every stage but the first keeps the receive buffer
      ``pipe_recv_buf`` (sent size); without model parallelism each received input is kept whole
      (``pipe_buffers['inputs']``) while the model runs on its ``.clone()``, which its first layer saves; partitioned,
      the gathered input is the model's own. The first stage holds the gradient receive buffer ``grad_layer`` at its
      peak (sent size: ``grad_partitioned``).
    * the last stage's backward returns before it frees ``pipe_buffers['outputs']`` (``_exec_backward_pass``: "The last
      stage just runs backward on the loss"), so its module outputs stay referenced in its ``max(2, ...)`` buffers: the
      previous micro-batch's beside the current one's (:func:`deepspeed_pipe_bytes` sizes them).

    Checked against the engine itself on this CPU (tests/deepspeed_pipe_probe.py: gloo ranks, pp 2-4, tp 1-2, 1-8
    micro-batches; tests/test_deepspeed_pipe_buffers.py)."""
    ranks = np.asarray(stage, dtype=float)
    m = np.asarray(num_microbatches, dtype=float)
    k = np.minimum(plan.pp - ranks, m)
    first, last = (ranks == 0).astype(float), (ranks == plan.pp - 1).astype(float)
    whole = (1 - first) * k * (plan.tp == 1)  # kept received inputs
    sent = (1 - last) * k + (1 - first) + first * (plan.pp > 1)  # kept outputs; pipe_recv_buf or grad_layer
    kept = last * (np.minimum(m, 2) - 1)
    out = np.broadcast_arrays(whole, sent, kept)
    return tuple(float(x) for x in out) if np.ndim(out[0]) == 0 else tuple(np.array(x) for x in out)


def deepspeed_last_module_output_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """The last stage's module output as Megatron-DeepSpeed's ``GPTModelPipe`` returns it to the pipeline engine: the
    vocabulary-parallel logits, ``s/cp x b x V/t``, upcast to fp32 by its last layer (``float16_to_fp32`` after the
    tied ``EmbeddingPipe``'s ``_logits_helper`` under fp16/bf16; microsoft/Megatron-DeepSpeed
    ``megatron/model/gpt_model.py``); in fp32 training the same 4 B: the size of :func:`kept_output_bytes`."""
    return kept_output_bytes(model, training, plan)


def deepspeed_pipe_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches, stage: int):
    """:func:`deepspeed_pipe_tensor_counts` in bytes where DeepSpeed's pipeline engine runs the job
    (``FrameworkProfile.deepspeed_pipe_buffers`` and ``frameworks.deepspeed.runs_pipeline_engine``); 0 elsewhere. A
    stage boundary is :func:`stage_boundary_bytes`; the engine sends 1/tp of it under model parallelism."""
    if not frameworks.get(training.framework).deepspeed_pipe_buffers:
        return 0.0
    from planner.frameworks.deepspeed import runs_pipeline_engine

    if not runs_pipeline_engine(training.deepspeed.pipeline_engine, plan.pp):
        return 0.0
    whole, sent, kept = deepspeed_pipe_tensor_counts(plan, num_microbatches, stage)
    boundary = stage_boundary_bytes(model, training, plan)
    return (whole * boundary + sent * boundary / plan.tp
            + kept * deepspeed_last_module_output_bytes(model, training, plan))


def kept_output_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """One micro-batch's output of the loss stage as a pipeline schedule keeps it
    (:func:`pipeline_kept_output_bytes`): the logits, ``s/cp x b x V/t`` (vocabulary-sharded under TP: torchtitan's
    ``loss_parallel``), in fp32. torchtitan's Llama of 2024 ended its forward with ``self.output(h).float()`` (the
    torchtitan model that torch's own FSDP2 + pipelining tests copied, with ``ScheduleFlexibleInterleaved1F1B``,
    which torch had in late 2024); torchtitan 0.3.0 returns the bf16 logits (``models/common/decoder.py``), for which
    4 B is an upper bound."""
    s, b = training.seq_len // plan.cp, plan.micro_batch_size
    return s * b * padded_vocab_size(model.vocab_size, plan.tp) / plan.tp * FP32_BYTES


def kept_outputs_bytes_of(kept: str, plan: Plan, num_microbatches, stage, output_bytes, boundary_bytes,
                          transient_bytes=0.0):
    """:func:`pipeline_kept_output_bytes` from its parts, vectorised over ``num_microbatches``, ``stage`` (an array
    of ranks), the per-micro-batch sizes and ``transient_bytes`` (search)."""
    if plan.pp == 1 or kept == "none":
        return 0.0
    m = np.asarray(num_microbatches, dtype=float)
    is_loss = np.asarray(stage) == plan.loss_stage
    during = np.maximum(m - 1, 0) * output_bytes
    at_merge = 2 * m * output_bytes - transient_bytes
    out = np.where(is_loss, np.maximum(during, at_merge), 0.0)
    if kept == "all":  # every other chunk of the rank keeps its m boundary outputs
        out = out + (plan.vpp - is_loss) * m * boundary_bytes
    return out if np.ndim(out) else float(out)


def pipeline_kept_output_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches,
                               stage: int, transient_bytes: float = 0.0):
    """Stage outputs that torch.distributed.pipelining keeps until the step ends
    (``TrainingSpec.pipeline_kept_outputs``), on pipeline rank ``stage``.

    torch 2.13 ``distributed/pipelining/stage.py`` ``forward_one_chunk``: ``if self.is_last and
    save_forward_output: self.output_chunks.append(output)``; ``schedules.py`` ``step(..., return_outputs=True)``
    by default, and at its end ``self._merge_outputs(self._stage.output_chunks)`` (``merge_chunks``: one
    ``torch.cat`` of the m outputs); ``output_chunks`` is cleared by ``clear_runtime_states`` when the next step
    starts. Before pytorch#153383 (merged 2025-05-13, "Optimize memory usage by releasing output memory earlier")
    every stage appended its output, not only the last (``"all"``). torchtitan 0.3.0 passes
    ``return_outputs=False`` (``trainer.py``): nothing is kept (``"none"``).

    On the loss stage the peak holds the larger of two moments: the last micro-batch's loss with the m - 1 earlier
    outputs kept, and the merge after the last backward, where the m outputs and their concatenation (2 m) live
    but the activations, the loss spike and what the last backward released
    (``StateBytes.released_at_last_backward_bytes``) are gone (``transient_bytes``). Every other chunk (``"all"``)
    keeps its m boundary outputs (:func:`stage_boundary_bytes`), counted whole: an upper bound before the last
    micro-batch."""
    return kept_outputs_bytes_of(training.pipeline_kept_outputs, plan, num_microbatches, stage,
                                 kept_output_bytes(model, training, plan), stage_boundary_bytes(model, training, plan),
                                 transient_bytes)


# Transformer Engine's userbuffer communicators for TP communication overlap (TE 2.x ``module/base.py``
# ``initialize_ub``, default methods): ring_exchange qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad; pipeline proj_fprop,
# fc2_fprop; bulk qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad; external proj_wgrad, fc2_wgrad. Each holds one buffer of
# the ``shape`` it is given; those in ``layers_all_gather_overlap`` (8) are uint8 under an FP8 quantization mode
# (``fp8_buf``), the reduce-scatter ones (4) keep the 16-bit dtype.
UB_ALL_GATHER_BUFFERS, UB_REDUCE_SCATTER_BUFFERS = 8, 4


def tp_comm_overlap_bytes_per_element(training: TrainingSpec) -> float:
    """Bytes of Transformer Engine's TP-overlap userbuffers per element of their shape, 0 where the job runs none: the
    framework is Megatron's (megatron, nemo) and TP communication overlap is on (``cost.resolved_overlap``; NeMo's
    recipes default to it). Megatron-Core core_v0.16.1 ``training/initialize.py`` ``_initialize_tp_communicators``
    calls ``initialize_ub`` with the FP8 quantization mode when ``args.fp8`` (the fp8 and mxfp8 recipes); TE gives
    every communicator a buffer of the shape it is given, ``UB_ALL_GATHER_BUFFERS`` at 1 B under FP8, else 2, and
    ``UB_REDUCE_SCATTER_BUFFERS`` at 2 B. The cuBLAS workspaces TE repeats per overlap stream are
    :func:`gemm_workspace_bytes`; not counted: a second set under ``--first-last-layers-bf16``."""
    from planner.cost import resolved_overlap  # cost imports this module

    if training.framework not in ("megatron", "nemo") or not resolved_overlap(training).tp_comm_overlap:
        return 0.0
    ag_bytes = 1 if training.precision in ("fp8", "mxfp8") else ACT_BYTES
    return float(UB_ALL_GATHER_BUFFERS * ag_bytes + UB_REDUCE_SCATTER_BUFFERS * ACT_BYTES)


def tp_comm_overlap_buffer_bytes(training: TrainingSpec, plan: Plan, hidden_size: int) -> float:
    """Transformer Engine's userbuffers, allocated once per GPU when TP communication overlap runs (it needs SP and
    tp > 1): ``initialize_ub``'s ``shape = [seq_length * micro_batch_size // context_parallel_size, hidden_size]``
    (Megatron-Core ``_initialize_tp_communicators``) times :func:`tp_comm_overlap_bytes_per_element`. Llama-3-70B at
    8,192 tokens, micro-batch 1: 12 x 8192 x 8192 x 2 B = 1.5 GiB in bf16, 1.0 GiB in fp8."""
    per = tp_comm_overlap_bytes_per_element(training)
    if not per or plan.tp == 1 or not plan.sequence_parallel:
        return 0.0
    return float(training.seq_len * plan.micro_batch_size // plan.cp * hidden_size * per)


#: RDMA receive tokens per channel of DeepEP's recommended configs, 128 at every group size (``deep_ep/buffer.py``; the
#: NVLink ones by size: ``specs.DEEPEP_NVL_RECV_TOKENS``)
DEEPEP_RDMA_RECV_TOKENS = 128
#: SMs DeepEP's normal kernels use under Megatron (``TransformerConfig.moe_deepep_num_sms``, core_v0.16.1, passed to
#: ``Buffer.set_num_sms``); a channel is two SMs (``config.hpp``: ``num_channels = num_sms / 2``).
DEEPEP_NUM_SMS = 20
DEEPEP_NVL_PEERS = 8  # NUM_MAX_NVL_PEERS (csrc/kernels/configs.cuh)
DEEPEP_WORKSPACE_BYTES = 32 * 2**20  # NUM_WORKSPACE_BYTES, cudaMalloc'd by every Buffer (csrc/deep_ep.cpp)
#: NVSHMEM backs its symmetric heap in granules of this size, which DeepEP sets (buffer.py:
#: ``NVSHMEM_CUMEM_GRANULARITY = 2**29``, "NVSHMEM initialization requires at least 256 MiB")
NVSHMEM_GRANULE_BYTES = 2**29


def deepep_buffer_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> float:
    """Device memory of DeepEP's communication buffer on one GPU, allocated outside PyTorch's caching allocator the
    first time a MoE layer dispatches (so on every stage that holds one), where the job runs DeepEP.

    Megatron-Core (core_v0.16.1 ``moe/fused_a2a.py``) builds ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` over the
    ``etp x ep`` group with ``hidden_bytes = hidden * max(element size, 2)`` and the larger of the dispatch and
    combine configs' hints. DeepEP's ``csrc/config.hpp`` (``Config::get_nvl_buffer_size_hint``,
    ``get_rdma_buffer_size_hint``), with ``c = num_sms / 2`` channels, ``n = min(ranks, 8)`` NVLink peers and
    ``r = max(ranks / 8, 1)`` RDMA ranks, ``K = 128`` top-k slots and scales, an 8-byte source meta:

    * NVLink (``cudaMalloc``): ``c n (2r + 3) 4 + c n T_nvl (hidden_bytes + 8 + K 8 + K 4 + K 4)``, 128-byte aligned;
    * RDMA (NVSHMEM, only when the group spans nodes, ranks > 8): ``c r (2 x 8 + 2) 2 x 4 + 2 c r T_rdma
      (hidden_bytes + 8 + K 8 + K 4 + K 4 + 16) + 1 MiB``, backed in whole NVSHMEM granules;
    * the 32 MiB workspace.

    DeepSeek-V3 (hidden 7,168) over 64 ranks: 377.7 MB NVLink, 337.1 MB RDMA (one 512 MiB granule), so 0.88 GiB per
    GPU; over 8 ranks 0.34 GiB. NVSHMEM's own state (queue pairs, proxy) is not counted. Sizes DeepEP has no config for
    are refused (``specs.deepep_group_problems``)."""
    ranks = plan.ep * plan.expert_tp
    if training.moe_token_dispatcher != "deepep" or not model.is_moe or ranks not in DEEPEP_NVL_RECV_TOKENS:
        return 0.0
    hidden_bytes = model.hidden_size * max(act_bytes(training), 2)
    c = DEEPEP_NUM_SMS // 2
    k = 128
    per_token = 8 + k * 8 + k * 4 + k * 4  # source meta, top-k indices (int64), weights and scales (fp32)
    n, r = min(ranks, DEEPEP_NVL_PEERS), max(ranks // DEEPEP_NVL_PEERS, 1)
    nvl = c * n * (2 * r + 3) * 4 + c * n * DEEPEP_NVL_RECV_TOKENS[ranks] * (hidden_bytes + per_token)
    nvl = -(-nvl // 128) * 128
    rdma = 0
    if ranks > DEEPEP_NVL_PEERS:
        rdma = (c * r * (DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4
                + 2 * c * r * DEEPEP_RDMA_RECV_TOKENS * (hidden_bytes + per_token + 16) + 2**20)
        rdma = -(-rdma // NVSHMEM_GRANULE_BYTES) * NVSHMEM_GRANULE_BYTES
    return float(nvl + rdma + DEEPEP_WORKSPACE_BYTES)


#: HybridEP's floor on the tokens per rank it sizes its buffers for (deepseek-ai/DeepEP, hybrid-ep,
#: ``deep_ep/hybrid_ep_buffer.py`` @ 098da2a6: ``max_num_of_tokens_per_rank = max(max_num_of_tokens_per_rank, 512)``)
HYBRIDEP_MIN_TOKENS = 512
#: ``num_sms_preprocessing_api`` HybridEP defaults to (ibid.: 108) and the bytes of one ``hybrid_ep::tmp_state_t`` (an
#: enum and an int32): its preprocessing scratch is one per block and NVLink-domain rank (``csrc/hybrid_ep/hybrid_ep.cu``
#: ``allocate_buffer_for_preprocessing``)
HYBRIDEP_PREPROCESSING_BLOCKS, HYBRIDEP_TMP_STATE_BYTES = 108, 8
#: Tokens per chunk of HybridEP's dispatch and combine kernels (``NUM_OF_TOKENS_PER_CHUNK_*_API``, default 128): one
#: 8-byte RDMA flag per chunk and remote domain
HYBRIDEP_TOKENS_PER_CHUNK = 128


def hybridep_domain_ranks(training: TrainingSpec, plan: Plan, hardware: HardwareSpec | None) -> tuple[int, int]:
    """(ranks of the expert group in one NVLink domain, domains it spans): HybridEP's ``num_of_ranks_per_node`` and
    ``num_of_nodes``. The group is Megatron-Core's ``tp_ep_group`` (``etp x ep`` ranks, the flex dispatcher's,
    core_v0.16.1 ``moe/token_dispatcher.py::MoEFlexTokenDispatcher``) as the layout places it on the profile's
    NVLink domains as the job fills them (``HardwareSpec.job_nvlink_domain``: 64 of an NVL72 rack's 72 GPUs for a job of
    64-GPU segments; 8 without a profile, HybridEP's own default
    ``NUM_OF_RANKS_PER_NVLINK_DOMAIN``). HybridEP takes the ranks per domain from that variable (later versions:
    ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN``, or the ranks it detects it can reach), which ``plan3d emit`` writes
    as this count. A job that sets the variable (``TrainingSpec.hybridep_ranks_per_domain``) gets its value."""
    size = plan.ep * plan.expert_tp
    if training.hybridep_ranks_per_domain is not None:  # what the job tells HybridEP (specs: it divides the group)
        ranks = min(training.hybridep_ranks_per_domain, size)
    else:  # one count where HybridEP runs (specs.hybridep_domain_problem refuses the rest); the largest otherwise
        domain = hardware.job_nvlink_domain(training.num_gpus) if hardware is not None else 8
        ranks = max(block_domain_counts(size, training.num_gpus, domain))
    return ranks, -(-size // ranks)


def hybridep_buffer_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan,
                          hardware: HardwareSpec | None = None) -> float:
    """Device memory of HybridEP's buffers on one GPU (the flex dispatcher's ``hybridep`` backend), allocated outside
    PyTorch's caching allocator at the first dispatch, so on every stage that holds a MoE layer; 0 for another
    dispatcher.

    Megatron-Core core_v0.16.1 ``moe/fused_a2a.py::init_hybrid_ep_buffer`` builds ``HybridEPBuffer(group, hidden_dim,
    max_num_of_tokens_per_rank=seq_len, num_local_experts, ..., use_fp8=False)`` with ``seq_len, hidden_dim =
    x.shape[-2:]``: the ``T`` tokens a rank dispatches per micro-batch (``mbs x seq / (cp x tp)``, as the all-to-all's
    ``T_r``), ``L = E / ep`` local experts, over ``G = etp x ep`` ranks, ``R`` of them per NVLink domain and ``N = G /
    R`` domains (:func:`hybridep_domain_ranks`). deepseek-ai/DeepEP hybrid-ep ``csrc/hybrid_ep/hybrid_ep.cu`` @ 098da2a6
    sizes for the worst case, every token of the group routed to this rank ("all tokens are routed to the same
    expert"): ``M = T' R N`` with ``T' = max(T, 512)``, and with ``use_shared_buffer`` (what ``hybrid_ep_buffer.py``
    passes) dispatch and combine share one token and one probability buffer:

    * token rows ``M h`` at 2 B (``expert_input_token``, ``uint16_t`` whatever the dtype; Megatron asserts no fp8
      dispatch), probabilities ``M L R`` at 4 B (``expert_input_prob``), scaling factors ``M h/128`` at 4 B
      (``expert_output_scaling_factor``, allocated in bf16 too), through the IPC (or, with ``R > 8``, fabric) allocator;
    * preprocessing scratch ``108 R`` x 8 B;
    * across domains (``N > 1``, ``D = N - 1``; ``csrc/hybrid_ep/internode.cu``, ``allocate_dispatch_rdma_buffers`` and
      ``allocate_combine_rdma_buffers``): dispatch ``T' h 2 + T' L R N 4 + T' h/128 4`` (the local send copies) plus
      ``T' D (2h + 4 L R + 4 h/128)`` (one receive slot per remote domain), combine ``2 T' D (2h + 4 L R)``, and
      ``4 D T'/128`` 8-byte flags.

    DeepSeek-V3 (h 7,168, 4 local experts) at 4,096 tokens over 64 ranks in one NVL72 domain: ``M = 262,144`` rows of
    15,584 B, 3.80 GiB, where DeepEP's buffer is 0.88 GiB (:func:`deepep_buffer_bytes`); over 8 ranks 0.48 GiB. Not
    counted: the fabric allocator's rounding to ``cuMemGetAllocationGranularity`` (a runtime query), the queue pairs
    of the RDMA path, and the per-dispatch tensors PyTorch allocates (the all-gathered routing map ``T G x E`` bools,
    the handle's maps), which are transient or small. Later HybridEP versions keep ``M`` and the shared token buffer
    (``NVLCoordinator::init``); the sizes above are those of the version whose constructor matches Megatron's call."""
    if training.moe_token_dispatcher != "hybridep" or not model.is_moe:
        return 0.0
    r, n = hybridep_domain_ranks(training, plan, hardware)
    return hybridep_sized_bytes(model.hidden_size, model.num_experts // plan.ep, r, n,
                                plan.micro_batch_size * training.seq_len // (plan.cp * plan.tp))


def hybridep_sized_bytes(h: int, local: int, r: int, n: int, tokens: int) -> float:
    """:func:`hybridep_buffer_bytes` for hidden size ``h``, ``local`` experts per rank, ``r`` ranks per NVLink domain
    over ``n`` domains and ``tokens`` dispatched per rank and micro-batch (the search's tables ask it per micro-batch
    size, the layout resolved once per shape)."""
    tokens = max(tokens, HYBRIDEP_MIN_TOKENS)
    rows = tokens * r * n
    scales = h // 128
    total = rows * (2 * h + 4 * local * r + 4 * scales) + HYBRIDEP_PREPROCESSING_BLOCKS * r * HYBRIDEP_TMP_STATE_BYTES
    if n > 1:
        d = n - 1
        total += tokens * (2 * h + 4 * local * r * n + 4 * scales)  # dispatch: the local send copies
        total += tokens * d * (2 * h + 4 * local * r + 4 * scales)  # dispatch: a receive slot per remote domain
        total += 2 * tokens * d * (2 * h + 4 * local * r)  # combine: reduction and receive slots
        total += 4 * d * (tokens // HYBRIDEP_TOKENS_PER_CHUNK) * 8  # dispatch and combine flags, sent and received
    return float(total)


#: Transformer Engine's ``_NUM_MAX_UB_STREAMS`` (``pytorch/module/base.py``): the copies of its cuBLAS workspace
#: ``initialize_ub`` keeps for the userbuffer overlap's concurrent GEMMs
TE_UB_STREAMS = 3


def gemm_workspace_bytes(training: TrainingSpec, hardware: HardwareSpec | None, loss_stage: bool,
                         moe_stage: bool, tp_overlap: bool = False) -> float:
    """cuBLAS workspaces a stage's GEMMs allocate through PyTorch's caching allocator and keep for the run
    (``FrameworkProfile.gemm_workspaces``); 0 without a hardware profile.

    * "torch" (torchtitan, plan3d validate's miniature, Megatron-DeepSpeed): every linear is a torch GEMM
      (``nn.Linear``, torchao's ``torch._scaled_mm``, Megatron-DeepSpeed's ``ColumnParallelLinear`` and
      ``RowParallelLinear`` on ``torch.matmul``), so every stage holds PyTorch's workspace for the forward's thread and
      autograd's device thread, as below; no Transformer Engine.
    * "te" (Megatron-Core, NeMo), two kinds:
      - PyTorch's own (``HardwareSpec.blas_workspace_mib``, 32 MiB on Hopper: aten/src/ATen/cuda/CublasHandlePool.cpp),
        one per thread that runs a torch GEMM: the forward's and autograd's device thread, as the caching-allocator
        check on an H100 found (``planner.fake_rank``, benchmarks/data/h100_allocator_check.json). Megatron-Core's torch
        GEMMs are the output layer's (``tensor_parallel.ColumnParallelLinear``, on the loss stage) and the MoE
        router's (``TopKRouter.gating``, on a stage with a MoE layer); its transformer layers are Transformer Engine
        modules, which pass TE's workspace to cuBLAS.
      - Transformer Engine's (``HardwareSpec.te_workspace_mib``): one per process (``module/base.py::get_workspace``),
        ``_NUM_MAX_UB_STREAMS`` (3) of them in one tensor where TP communication overlap runs (``initialize_ub``:
        ``_cublas_workspace = get_workspace().repeat(_NUM_MAX_UB_STREAMS)``, the single one freed; the job's
        :func:`tp_comm_overlap_buffer_bytes` > 0), and ``num_cublas_streams`` more where ``GroupedLinear`` runs the
        routed experts (``get_multi_stream_cublas_workspace``; ``FrameworkProfile.expert_gemm_streams``, 4; none under
        Megatron's ``SequentialMLP``, without ``--moe-grouped-gemm``: ``frameworks.expert_gemm_streams``).

    Held out against NVIDIA's Megatron-LM functional tests on DGX H100 (``benchmarks/megatron_functional_memory.py``):
    before this term every dense case's last stage was 96-112 MiB under its ``mem-max-allocated-bytes``; 2 x 32 +
    32 MiB is 96; the FP8 case with TP communication overlap was 88 MiB under, 24 with the userbuffers' three."""
    kind = frameworks.get(training.framework).gemm_workspaces
    if hardware is None or kind is None:
        return 0.0
    if kind == "torch":  # every linear of every stage is a torch GEMM: the forward's and autograd's thread
        return 2 * hardware.blas_workspace_mib * 2**20
    torch_threads = 2 if (loss_stage or moe_stage) else 0
    te = (TE_UB_STREAMS if tp_overlap else 1) + (frameworks.expert_gemm_streams(training)[1] if moe_stage else 0)
    return (torch_threads * hardware.blas_workspace_mib + te * hardware.te_workspace_mib) * 2**20


def stage_other_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches,
                      stage: int, hardware: HardwareSpec | None = None):
    """Activations outside the transformer layers: the inputs of every micro-batch in flight on the first stage (and
    Megatron's dataloader mask, :func:`dataloader_mask_bytes`), the output layer's on the last (and the deferred
    embedding wgrad, :func:`deferred_wgrad_bytes`), the pipeline's receive buffers (:func:`pipeline_buffer_bytes`,
    :func:`megatron_p2p_bytes`, :func:`deepspeed_pipe_bytes`);
    Transformer Engine's TP-overlap userbuffers on every stage (:func:`tp_comm_overlap_buffer_bytes`); DeepEP's,
    HybridEP's or the allgather dispatcher's buffer on every stage with a MoE layer (:func:`deepep_buffer_bytes`,
    :func:`hybridep_buffer_bytes`, :func:`moe_allgather_buffer_bytes`); the GEMMs' cuBLAS workspaces
    (:func:`gemm_workspace_bytes`, with ``hardware``)."""
    moe_stage = bool(plan.stage_moe_layers(model)[stage])
    userbuffers = tp_comm_overlap_buffer_bytes(training, plan, model.hidden_size)
    other = pipeline_buffer_bytes(model, training, plan, num_microbatches, stage) + userbuffers + \
        megatron_p2p_bytes(model, training, plan, num_microbatches, stage) + \
        deepspeed_pipe_bytes(model, training, plan, num_microbatches, stage) + \
        gemm_workspace_bytes(training, hardware, stage == plan.loss_stage, moe_stage, userbuffers > 0)
    if moe_stage:  # DeepEP's, HybridEP's or the allgather dispatcher's buffer, where a MoE layer of this stage dispatches
        other = other + deepep_buffer_bytes(model, training, plan) + moe_allgather_buffer_bytes(model, training, plan) + \
            hybridep_buffer_bytes(model, training, plan, hardware)
    if stage == 0:
        mbs_in_flight = np.ceil(stage_in_flight_chunks(training, plan, num_microbatches, 0) / plan.vpp)
        other = other + mbs_in_flight * input_bytes_per_microbatch(model, training, plan)
        if plan.loss_stage != 0:  # the forward's mask (the loss stage holds it in its spike)
            other = other + dataloader_mask_bytes(training, plan)
    if stage == plan.loss_stage:
        other = other + output_bytes(model, training, plan) + deferred_wgrad_bytes(model, training, plan,
                                                                                   num_microbatches)
    return other


# --- the estimate -------------------------------------------------------------------------------

def stage_state_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, stage: int, layers: int,
                      hardware: HardwareSpec | None = None) -> frameworks.StateBytes:
    """Weights, gradients and optimizer states of one GPU of stage ``stage``, as the framework of
    ``training.framework`` holds them at the step's peak (``planner/frameworks``).

    MoE models: the routed experts' part (``expert_params``) is sharded over the expert-data-parallel
    group of ``Plan.expert_dp = tp*cp*dp / (etp*ep)`` ranks, the rest over dp x cp as for a dense
    model. Megatron-Core core_v0.16.1 ``distributed/distributed_data_parallel.py``: parameters with
    ``allreduce=False`` (the experts) go to ``expert_parallel_buffers`` over ``intra_expt_dp_group``,
    and the distributed optimizer shards each buffer over its own data-parallel group;
    torchtitan's FSDP2 shards the experts over its ``efsdp`` mesh (``dp_shard*cp*tp/ep``,
    ``distributed/parallel_dims.py``), its other parameters over ``fsdp`` (``dp_shard*cp``)."""
    return stage_state_bytes_of(model, training, plan, layers, stage_param_inputs(model, plan, stage, layers), hardware,
                                stage)


def stage_param_inputs(model: ModelSpec, plan: Plan, stage: int, layers: int) -> tuple:
    """What :func:`stage_state_bytes` hands the framework profile about stage ``stage``'s parameters on one GPU:
    (all of them, the largest layer, the routed experts' share, the GEMM weights, the word embedding's rows; the
    fourth None for a dense model, whose profile takes its default). None of them depends on the ZeRO stage, so
    the search computes them once per stage for every ZeRO option (:func:`stage_state_bytes_of`)."""
    dense, expert = stage_param_split(model, plan, stage, layers)
    embedding = vocab_rows_params(model, plan.tp) if stage == 0 else 0.0
    if not model.is_moe:
        return dense, layer_params_per_rank(model, plan.tp), 0.0, None, embedding
    return (dense + expert, stage_max_layer_params(model, plan, stage, layers), expert,
            stage_linear_params_per_rank(model, plan, stage, layers), embedding)


def stage_state_bytes_of(model: ModelSpec, training: TrainingSpec, plan: Plan, layers: int, inputs: tuple,
                         hardware: HardwareSpec | None = None, stage: int = 0) -> frameworks.StateBytes:
    """:func:`stage_state_bytes` from the stage's :func:`stage_param_inputs` (``stage``: its index, which Muon's
    states read, ``planner.frameworks.megatron.muon_state``)."""
    profile = frameworks.get(training.framework)
    params, largest, expert, linear, embedding = inputs
    # Megatron-Core's and NeMo's profiles take the stage's index for Muon (specs.muon_problems); the others never see it
    muon = {"muon_stage": stage} if training.optimizer != "adam" else {}
    if not model.is_moe:  # the dense path, unchanged
        return profile.state_bytes(model, training, plan, params, largest, layers, hardware=hardware,
                                   embedding_params=embedding, **muon)
    return profile.state_bytes(model, training, plan, params, largest, layers, expert_params=expert,
                               linear_params=linear, hardware=hardware, embedding_params=embedding, **muon)


def stage_linear_params_per_rank(model: ModelSpec, plan: Plan, stage: int, layers: int) -> float:
    """GEMM weights of the stage's layers on one GPU (norms, biases and the router left out): what
    Transformer Engine caches quantised copies of under fp8 (``planner.frameworks.megatron``)."""
    def linear(moe: bool) -> float:  # one layer's parameters less its norms and (MoE) its router
        d, e = layer_param_split(model, plan.tp, moe, plan.ep, plan.expert_tp)
        return d + e - model.norms_per_layer * model.norm_params - (model.router_params() if moe else 0.0)

    moe_layers = stage_moe_layer_count(model, plan, stage, layers)
    total = (layers - moe_layers) * linear(False) + (moe_layers * linear(True) if moe_layers else 0.0)
    if model.mtp_num_layers and stage == plan.loss_stage:  # the MTP layers and their eh_proj (mtp_param_split)
        h = model.hidden_size
        total += model.mtp_num_layers * (linear(model.mtp_is_moe()) + 2 * h * h / plan.tp)
    return total


def layer_phase_bytes(st: frameworks.StateBytes, recompute_bytes: float, output_spike_bytes: float
                      ) -> tuple[float, float, float]:
    """(weights, gradients, activations) of the layer-phase working set that add to the peak.

    Two transient sets never coexist: the **loss phase** (the last stage's logits and
    cross-entropy spike, ``output_bytes``) and the **layer phase** (one layer's recompute working
    set, and the framework's gathered layer and its gradient buffers, ``StateBytes.working_*``):
    the loss is done before any layer runs its backward. The peak holds the larger, so the part of
    the layer phase above the spike is counted, split in proportion (for a stage without the output
    layer the spike is 0 and the whole layer phase counts).
    """
    work = st.working_weights_bytes + st.working_grads_bytes + recompute_bytes
    if work <= 0:
        return 0.0, 0.0, 0.0
    keep = max(work - output_spike_bytes, 0.0) / work
    return st.working_weights_bytes * keep, st.working_grads_bytes * keep, recompute_bytes * keep


def step_excess_bytes(step_extra_bytes, backward_transient_bytes):
    """What the optimizer step holds beyond the model states (``StateBytes.step_extra_bytes``) and the backward's
    peak does not already cover: the step runs after the last backward, when the saved activations and the layer
    working set (``backward_transient_bytes``) are gone, so the stage's peak is the larger of the two moments.
    Elementwise on arrays (the search)."""
    return np.maximum(np.asarray(step_extra_bytes, dtype=float) - backward_transient_bytes, 0.0)


def stage_memory(model: ModelSpec, training: TrainingSpec, plan: Plan, num_microbatches: int,
                 stage: int, layers: int, hardware: HardwareSpec | None = None) -> StageMemory:
    """Every component of one GPU of stage ``stage``: the framework's states, the saved activations,
    the inputs / outputs, the larger of the layer phase and the loss spike (:func:`layer_phase_bytes`), and what the
    optimizer step holds beyond all that (:func:`step_excess_bytes`, in the gradients)."""
    st = stage_state_bytes(model, training, plan, stage, layers, hardware)
    spike = output_bytes(model, training, plan) if stage == plan.loss_stage else 0.0
    recompute = layer_recompute_working_bytes(model, training, plan)
    w_work, g_work, a_work = layer_phase_bytes(st, recompute, spike)
    saved = stage_saved_bytes(model, training, plan, num_microbatches, stage, layers) + \
        float(bf16_layers_extra_bytes(model, training, plan, num_microbatches, stage))
    kept = pipeline_kept_output_bytes(model, training, plan, num_microbatches, stage,
                                      saved + spike + st.released_at_last_backward_bytes)
    step = float(step_excess_bytes(st.step_extra_bytes, saved + w_work + g_work + a_work))
    return StageMemory(
        stage=stage, layers=layers,
        weights_bytes=st.weights_bytes + w_work,
        grads_bytes=st.grads_bytes + g_work + step,
        optimizer_bytes=st.optimizer_bytes,
        activations_bytes=saved + a_work,
        other_bytes=float(stage_other_bytes(model, training, plan, num_microbatches, stage, hardware)) + kept,
        step_excess_bytes=step,
    )


def estimate_memory(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, plan: Plan) -> MemoryEstimate:
    """Memory of every pipeline stage against the usable memory of one GPU."""
    m = plan_microbatches(training, plan)
    stages = tuple(stage_memory(model, training, plan, m, r, n, hardware)
                   for r, n in enumerate(plan.stage_layers(model.num_layers)))
    if training.framework == "torchtitan":  # its logs show the caching allocator's reserved peak
        from planner.frameworks.torchtitan import with_reserved

        stages = with_reserved(model, hardware, training, plan, m, stages)
    return MemoryEstimate(capacity_gib=hardware.gpu_memory_gib, usable_gib=hardware.usable_memory_gib, stages=stages)


def estimate_scenario_memory(sc: Scenario) -> MemoryEstimate:
    return estimate_memory(sc.model, sc.hardware, sc.training, sc.plan)
