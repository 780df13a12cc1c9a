"""What the validate run predicts for a mixture-of-experts plan, per rank (no torch here).

Parameters (Megatron-Core parallel folding, ``parallel_state.initialize_model_parallel`` core_v0.16.1):
the dense part of a stage (attention, norms, embeddings, the dense MLP of the ``first_k_dense``
layers, and in every MoE layer the router and the shared experts) is replicated over ``ep`` and
reduced and sharded over the data-parallel ranks (``dp * cp``); the routed experts of a MoE layer
are split ``E/ep`` per rank (``etp = 1``: whole experts) and reduced and sharded over the
expert-data-parallel ranks (``expert_dp = tp*cp*dp / (etp*ep)``). Counts come from
``ModelSpec.expert_params``, ``mlp_params``, ``router_params`` and ``shared_expert_params``.

The parameter split is the estimator's own (``planner.memory.stage_param_split``); the activation
terms describe validate's torch-native MoE layer (not Megatron's dispatcher, whose terms are
``planner.memory.moe_activation_terms``); tests/test_validate_moe.py checks both against the run.

Saved activations of one MoE layer per micro-batch (:func:`moe_layer_terms`): the attention half
of the dense layer's terms (planner.memory.layer_activation_terms: norms, QKV, attention, and the
MLP input, which the router saves) plus what the layer of planner.validate.moe_layer saves, one
term per tensor: the top-k indices and probabilities, two int64 index vectors of the ``N`` routed copies
(``T*k`` dropless, ``E*C`` padded to capacity: :func:`routed_copies`), the ``R`` tokens this rank's experts
received (their inputs and the expert MLP
terms), the ``N`` returned outputs and their weights, and the shared expert with its gate. ``R``
depends on the router; balanced routing gives every rank ``R = N`` (``ep * N`` routed copies over
``ep`` ranks).
"""

from __future__ import annotations

import math

from planner.memory import ActTerm, act_bytes, layer_activation_terms, saved_bytes_per_layer, stage_param_split
from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec

INDEX_BYTES = 8  # int64 indices (torch.topk, argsort)
MLP_TERMS = ("activation input (FC1 output)", "FC2 input", "SiLU output (unfused SwiGLU: the multiply saves it)")


def moe_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """What the MoE miniature cannot run, in one line; None when it can (or the model is dense)."""
    if not model.is_moe:
        return None
    if model.is_mla:
        return "model: MLA attention (kv_lora_rank) is not in the validate model; validate a variant with GQA attention"
    if plan.expert_tp != 1:
        return (f"plan: etp={plan.expert_tp} (expert tensor parallelism) is not in the validate MoE layer, which runs "
                "whole experts (etp=1); validate the same plan with etp=1")
    if plan.tp > 1 and not plan.sequence_parallel:
        return (f"plan: tp={plan.tp} with experts needs sequence_parallel (Megatron requires it for MoE with TP; the "
                "validate MoE layer routes each rank's sequence shard); validate the plan with sequence_parallel")
    return None


def rank_state_bytes(sc: Scenario, stage: int) -> dict[str, float]:
    """Weights, gradients and optimizer states of one rank, in total and for its experts alone.

    Per parameter as ``planner.validate.launch.predicted_rank_memory`` counts them (FSDP2's fp32 shards,
    4 + 4 + 8 in fp32 and bf16 alike: ``launch.fsdp2_shard_bytes_per_param``), with the dense part sharded
    over ``dp * cp`` and the experts over ``expert_dp``.
    """
    from planner.validate.launch import fsdp2_shard_bytes_per_param

    p = sc.resolved_plan()
    dense, expert = stage_param_split(sc.model, p, stage, sc.stage_layers[stage])
    dw, dg, do = fsdp2_shard_bytes_per_param(p.zero_stage, p.dp * p.cp)
    ew, eg, eo = fsdp2_shard_bytes_per_param(p.zero_stage, p.expert_dp)
    return {"weights_bytes": dense * dw + expert * ew, "grads_bytes": dense * dg + expert * eg,
            "optimizer_bytes": dense * do + expert * eo, "expert_weights_bytes": expert * ew,
            "expert_grads_bytes": expert * eg, "expert_optimizer_bytes": expert * eo}


def moe_layer_terms(model: ModelSpec, training: TrainingSpec, plan: Plan, routed_tokens: float) -> list[ActTerm]:
    """Tensors one MoE layer of the validate model saves per micro-batch when its experts received
    ``routed_tokens`` tokens (module docstring); cp = 1, and with tp > 1 sequence parallelism: the router
    works on the ``b*s/tp`` local tokens and the shared experts on the gathered sequence (DTensor keeps the
    gathered input, ``framework="torch"``)."""
    e, i, tp = act_bytes(training), INDEX_BYTES, plan.tp
    t, h, k = training.seq_len * plan.micro_batch_size, model.hidden_size, model.top_k
    t_local = t // tp
    n, r = routed_copies(model, t_local), routed_tokens
    mlp_in = 2 if model.gated_mlp else 1
    f = model.moe_ffn_size
    terms = [x for x in layer_activation_terms(model, training, plan, moe=False) if x.name not in MLP_TERMS]
    if tp > 1:  # the MLP input term is the gathered sequence; the router keeps the local shard instead
        terms = [x for x in terms if x.name != "FC1 input"] + [ActTerm("router input (local norm2 output)",
                                                                        t_local * h * e)]
    terms += [
        ActTerm("router top-k indices", t_local * k * i),
        ActTerm("router probabilities (softmax over the top k)", t_local * k * e),
        ActTerm("dispatch: token index of each routed copy", n * i),
        ActTerm("dispatch: expert-sorted order", n * i),
        ActTerm("expert inputs (received)", r * h * e),
        ActTerm("expert activation input (FC1 output)", r * mlp_in * f * e),
        ActTerm("expert FC2 input", r * f * e),
        ActTerm("combine: returned expert outputs", n * h * e),
        ActTerm("combine: routing weights", n * e),
    ]
    fs = model.shared_expert_ffn_hidden_size
    if fs:
        if tp > 1:
            terms.append(ActTerm("shared expert FC1 input (gathered sequence)", t * h * e))
        terms += [ActTerm("shared expert activation input (FC1 output)", t * mlp_in * fs / tp * e),
                  ActTerm("shared expert FC2 input", t * fs / tp * e)]
        if model.shared_expert_gate:
            terms += [ActTerm("shared expert output (gated)", t_local * h * e),
                      ActTerm("shared expert gate (sigmoid)", t_local * e)]
    return terms


def moe_layer_saved_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan, routed_tokens: float) -> float:
    """Bytes one MoE layer keeps for backward per micro-batch under the plan's recompute."""
    return saved_bytes_per_layer(moe_layer_terms(model, training, plan, routed_tokens), plan.recompute)


def expert_capacity(model: ModelSpec, tokens: int) -> int:
    """Tokens each expert takes of a rank's ``tokens`` under drop-and-pad routing (``model.capacity_factor``):
    Megatron-Core's ``get_capacity`` of ``tokens * top_k`` copies over the experts, ``ceil(T k / E * c)``, and all
    ``T`` where that is more (core_v0.16.1 ``moe_utils.apply_router_token_dropping``)."""
    return min(math.ceil(tokens * model.top_k / model.num_experts * model.capacity_factor), tokens)


def routed_copies(model: ModelSpec, tokens: int) -> int:
    """Routed copies a rank sends per MoE layer for its ``tokens``: ``T k`` dropless, ``E C`` padded to capacity."""
    if model.capacity_factor is None:
        return tokens * model.top_k
    return model.num_experts * expert_capacity(model, tokens)


def balanced_routed_tokens(training: TrainingSpec, plan: Plan, model: ModelSpec) -> int:
    """Tokens one rank's experts receive per MoE layer and micro-batch when routing is even: the ``b*s/tp`` local
    tokens' routed copies (:func:`routed_copies`; each of the ep ranks of a group sends that many, spread evenly over
    the ep ranks). Padded to capacity, every rank receives exactly that, whatever the routing."""
    return routed_copies(model, training.seq_len * plan.micro_batch_size // plan.tp)


def microbatch_saved_bytes(sc: Scenario, dense_layers: int, routed: list[float]) -> float:
    """Saved bytes of one chunk forward: ``dense_layers`` dense layers and one MoE layer per entry of ``routed``."""
    p = sc.resolved_plan()
    dense = saved_bytes_per_layer(layer_activation_terms(sc.model, sc.training, p, moe=False), p.recompute)
    return dense_layers * dense + sum(moe_layer_saved_bytes(sc.model, sc.training, p, r) for r in routed)
