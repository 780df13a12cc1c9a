"""Start the validate run, watch it, and judge it by what it measured (no torch here).

Outside a torchrun job, `plan3d validate` runs a *miniature* of the plan on this machine: the same
tp, pp, cp, vpp, schedule, recompute and sequence parallelism, the same heavier and lighter stages of
an uneven pipeline, data parallelism capped so that all
ranks fit ``max_ranks`` local processes, and model, batch and sequence sizes scaled down. The
prediction is recomputed for that miniature on the local hardware profile (``cpu-gloo`` by default),
in the run's precision (fp32 by default, bf16 with FSDP2's mixed precision on request: :func:`run_precision`)
and with torch's DTensor sequence parallelism, which is what the run does. Every way the
miniature differs from the plan is listed in the report (``changed``); what the run cannot represent
is refused with a one-line reason (:func:`refusal`), never changed silently.

The verdict comes from measurements only (:func:`judge`): a memory component or peak off the
prediction by more than its tolerance, an out-of-memory rank, a first loss off the single-process
reference, diverged tied-embedding copies, or (when the hardware profile was calibrated here) a
step time off the prediction. The ranks are started by :func:`run_ranks` in one process group
that it owns and kills as a whole on a timeout, a failed rank, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from planner.memory import estimate_memory, stage_params_per_rank, stage_saved_bytes
from planner.presets import SpecError, load_hardware
from planner.specs import HardwareSpec, ModelSpec, Plan, Scenario, TrainingSpec, pipeline_kept_mode

MEMORY_TOLERANCE = 0.05
"""Relative tolerance of each measured memory component (weights, gradients, optimizer states, saved
activations) against its prediction. They matched exactly (0.00 %) in every miniature of
tests/test_validate.py; 5 % leaves room for padding and allocator rounding on other builds."""
ALLOCATED_TOLERANCE = 0.10
"""Relative tolerance of ``torch.cuda.max_memory_allocated`` against the predicted stage total on a
GPU: transient buffers (logits, FSDP all-gathers, cuBLAS workspaces) come on top of the tensors."""
LOSS_TOLERANCE = 1e-4
"""Relative tolerance of the first distributed loss against the single-process loss of the same
weights and batch (fp32: reduction order only)."""
GRAD_TOLERANCE = 1e-4
"""Largest difference of rank 0's first-step gradients (MoE and CP runs) from the single-process model's, relative
to the largest gradient: fp32 reduction order only, as :data:`LOSS_TOLERANCE`. A gradient reduced over the
wrong group is off by a factor (ep: 2x or more)."""
TIME_FACTOR = {"nccl": 1.5, "gloo": 8.0}
"""Largest ratio between measured and predicted step time (either way) that passes; judged only when
the hardware profile was measured on this machine by `plan3d calibrate` (:func:`is_calibrated`).
GPU (nccl): 1.5x, above the worst error of the cost model on held-out H100 runs (-30.2 %, 1.43x,
docs/cost-model.md), not yet confirmed by a validate run on a GPU. CPU (gloo): measured/predicted
was 0.44-2.3 on the 2-core development machine with a calibrated profile (2 ranks, TP2 or PP2,
shared with other jobs; 2.4 with 8 ranks) and 4.26 on the 2-core CI machine with 8 ranks (TP2 PP2 DP2,
2026-12 CI log): Python and gloo overheads that the cost model does not describe, which grow as more ranks
share the cores. 8x still catches a stalled or slow rank (a 1 s sleep per step is 20x) but not a cost-model
error below 8x."""


LOSS_TOLERANCE_BF16 = 2.0 ** -8
"""Relative tolerance of the first loss of a bf16 run against the single-process fp32 loss: one unit
roundoff of bf16 (1 sign, 8 exponent and 7 stored mantissa bits: 8 significant bits, u = 2^-8 = 0.39 %;
Intel, "BFLOAT16 - Hardware Numerics Definition", 2018). The bf16 run rounds every parameter, activation and
partial product it keeps to bf16, so each logit carries a relative error of order u; the loss, a mean over
the tokens of fp32 cross-entropy terms (``loss_fn`` upcasts the logits), is held to that. At initialisation
the loss stays near ln(vocab) whatever the weights, so this check is weak in bf16: the ``corrupt`` sabotage
moves it by 0.33 % only (tests/test_validate_bf16.py). What catches a wrong shard or reduction in bf16 is
the gradient check (:data:`GRAD_TOLERANCE_BF16`), which every bf16 run makes."""
GRAD_TOLERANCE_BF16 = 2.0 ** -4
""":data:`GRAD_TOLERANCE` for a bf16 run, against the single-process fp32 model: 16 unit roundoffs of bf16
(2^-4 = 6.25 %) of the largest gradient. Each gradient element is a sum over the b*s tokens of products of
bf16-rounded activations and output gradients, rounded to bf16 when it leaves its GEMM (the unsharded
gradient is bf16; FSDP2 reduces it in fp32), after a backward that rounds to bf16 at every op it passes, so
the element-wise error is a few u (0.5 to 1.4 % of the largest gradient, 1.3 to 3.6 u, in the runs of
tests/test_validate_bf16.py). 16 u leaves room for deeper backward paths and stays 8x below the smallest
error this check is for: a gradient reduced over the wrong group or scaled wrongly is off by a factor
(>= 50 %), a corrupted shard by far more (970 % for the ``corrupt`` sabotage)."""


def tolerances_for(precision: str) -> tuple[float, float]:
    """(loss, gradient) tolerances of a run in ``precision`` (fp32: reduction order only; bf16: above)."""
    return (LOSS_TOLERANCE, GRAD_TOLERANCE) if precision == "fp32" else (LOSS_TOLERANCE_BF16, GRAD_TOLERANCE_BF16)


def run_precision(precision: str) -> str:
    """What the validate run computes in for a plan in ``precision``: fp32 stays fp32; bf16 runs bf16 with
    FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (worker.mp_policy); fp8,
    mxfp8 and nvfp4 also run bf16 (the validate model has no fp8 GEMMs: Transformer Engine's and torchao's
    scaled GEMMs are not in it), which :func:`changes` lists."""
    return "fp32" if precision == "fp32" else "bf16"


def time_factor_for(hardware_ref: str, backend: str) -> float | None:
    """The step-time bound validate applies by default: :data:`TIME_FACTOR` for a calibrated profile, else None."""
    return TIME_FACTOR.get(backend) if is_calibrated(hardware_ref) else None
OOM_EXIT_CODE = 3  # the worker's exit code after it ran out of memory (worker.OOM_EXIT_CODE)
PORT_RETRIES = 3


def _round_to(x: float, step: int) -> int:
    return max(step, int(round(x / step)) * step)


def miniature_stage_layers(plan: Plan, num_layers: int, per_chunk: int) -> tuple[int, ...] | None:
    """Layers per stage of the miniature: ``per_chunk`` per virtual stage, and for an uneven plan
    one chunk-layer more (or fewer) on each stage that holds more (or fewer) than the even split.

    The miniature keeps which stages are heavier or lighter, not the exact ratio; the memory check
    is exact per rank, so one layer of difference is enough to tell whether the estimator follows
    each stage's own layer count. ``None`` for an even plan.
    """
    counts = plan.layers_per_stage
    if counts is None or len(set(counts)) == 1:
        return None
    v, even = plan.vpp, num_layers / plan.pp
    base = per_chunk * v + (v if per_chunk == 1 and min(counts) < even else 0)
    mini = [base + v * ((n > even) - (n < even)) for n in counts]
    # a chunk with no transformer layer (rank 0's embedding chunk, the last rank's loss chunk:
    # specs.min_stage_layers) stays empty: that rank gets one layer in each of its other chunks
    for r, empty in enumerate(plan.empty_chunks(num_layers)):
        if empty:
            mini[r] = v - empty
    return tuple(mini)


def refusal(sc: Scenario, backend: str = "gloo") -> str | None:
    """Why the run cannot represent this plan, in one line; None when it can.

    Context parallelism runs on gloo as torch's ring attention around the CPU flash-attention kernel
    (planner.validate.ring); on NCCL it is refused (that adapter calls the CPU kernel; torch's CUDA
    ``context_parallel`` is not wired into the worker yet), and with experts (the expert grid of
    :func:`planner.validate.worker.moe_mesh` has no cp axis). ALiBi and multi-token prediction: the validate model has neither. Mixture of experts: what the MoE layer does not run
    (:func:`planner.validate.moe.moe_refusal`: MLA, expert TP, tp > 1 without SP).
    """
    cp = sc.plan.cp
    if cp > 1 and backend != "gloo":
        return (f"plan: cp={cp} (context parallelism) runs on gloo only: the worker's ring attention calls the CPU "
                "flash-attention kernel; validate it with --backend gloo (the miniature) or with cp=1")
    if cp > 1 and sc.model.is_moe:
        return (f"plan: cp={cp} with a mixture of experts is not run: the validate expert grid has no cp axis; "
                "validate the same plan with cp=1")
    if sc.model.position_embedding == "alibi":
        return "model: position_embedding=alibi is not in the validate model; validate a rope or learned variant"
    if sc.model.mtp_num_layers:
        return (f"model: mtp_num_layers={sc.model.mtp_num_layers} (multi-token prediction) is not in the validate "
                "model; validate a variant with mtp_num_layers: 0")
    if sc.plan.pipeline_schedule in ("interleaved_zb", "zbv", "dualpipev"):
        return (f"plan: pipeline_schedule={sc.plan.pipeline_schedule}: the validate worker runs 1F1B / interleaved "
                "1F1B only; tests/test_schedules_zb.py checks the zero-bubble schedules against torch")
    if pipeline_kept_mode(sc.training, sc.plan):
        return (f"training: pipeline_kept_outputs={sc.training.pipeline_kept_outputs}: the validate worker calls "
                "step(return_outputs=False) and keeps no stage outputs; validate the plan without it")
    if sc.training.distribute_saved_activations:
        return ("training: distribute_saved_activations: the validate model keeps whole checkpointed inputs, not "
                "Megatron's 1/tp shares; validate the plan without --distribute-saved-activations")
    if sc.plan.recompute_group_layers is not None:
        return (f"plan: recompute_group_layers={sc.plan.recompute_group_layers}: the validate model checkpoints each "
                "layer alone, not Megatron's uniform groups; validate the plan without it")
    if sc.training.optimizer != "adam":
        return (f"training: optimizer {sc.training.optimizer}: the validate model steps torch's AdamW, not Megatron-Core's "
                "Muon, so its memory and step would not measure the plan's; validate the plan with optimizer adam")
    from planner.validate.moe import moe_refusal

    return moe_refusal(sc.model, sc.plan)


def miniature(sc: Scenario, max_ranks: int = 8, scale: float = 1.0, hardware: HardwareSpec | None = None,
              backend: str = "gloo", precision: str = "fp32") -> Scenario:
    """A small copy of the plan that runs on ``max_ranks`` local processes (module docstring).

    Kept from the plan: tp, pp, cp, vpp, recompute (with its block K), SP, the ZeRO stage (1 runs as 2), GQA,
    activation, norm (with or without its bias), every bias (QKV, output projection, MLP, output layer), tied
    embeddings, learned/rotary positions, the embedding norm and dropout; the layer structure it does not build
    (:data:`UNBUILT_STRUCTURE`: parallel attention, post or sandwich norms, Q/K norms, soft-caps, windows, ...)
    is left out and listed by :func:`changes`; for a
    MoE model the experts, shared experts, gate and router bias (:func:`miniature_moe_fields`).
    Changed, and listed by :func:`changes`: sizes, dp (capped), micro-batches, the precision (``precision``:
    fp32 by default, where the loss check against one process is exact; or bf16 with FSDP2's mixed
    precision); for MoE the expert count (at most 8), top-k (at most 2) and ep (``gcd(ep, tp*dp)``).
    """
    if precision not in ("fp32", "bf16"):
        raise SpecError(f"--precision: '{precision}' is not one of fp32, bf16 (what the miniature can run)")
    if precision == "bf16" and sc.model.is_moe:
        raise SpecError("--precision: bf16 with a mixture of experts is not judged: bf16 router scores pick other "
                        "experts than the fp32 single-process model for near ties, so the expert gradients differ by "
                        "whole tokens (19 % of the largest on tiny-moe), not by rounding; use --precision fp32")
    reason = refusal(sc, backend)
    if reason:
        raise SpecError(f"validate: {reason}")
    p, m = sc.plan, sc.model
    tp, pp, vpp, cp = p.tp, p.pp, p.vpp, p.cp
    if tp * pp * cp > max_ranks:
        raise SpecError(f"validate: tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp} ranks exceed the {max_ranks} "
                        "local processes; run `plan3d validate` inside torchrun or Slurm (`plan3d emit --format "
                        "slurm`) instead, or raise --max-ranks")
    dp = max(1, min(p.dp, max_ranks // (tp * pp * cp)))
    ratio = min(m.num_attention_heads // m.kv_heads, 4)  # GQA kept (up to 4 query heads per KV head)
    kv = tp * max(1, -(-4 // (tp * ratio))) if ratio > 1 else tp * max(1, -(-4 // tp))
    heads = kv * ratio
    head_dim = max(8, _round_to(16 * scale, 8))
    hidden = heads * head_dim
    ffn = _round_to(hidden * m.ffn_size / m.hidden_size, 8 * tp * dp)
    seq = _round_to(128 * scale, 8 * tp * 2 * cp)  # 2cp head-tail chunks, each split over TP for SP
    per_chunk = 2 if pp * vpp <= 4 else 1
    stage_layers = miniature_stage_layers(p, m.num_layers, per_chunk)
    model = ModelSpec(
        name=f"{m.name}-miniature", num_layers=sum(stage_layers) if stage_layers else pp * vpp * per_chunk,
        hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=kv, ffn_hidden_size=ffn, vocab_size=_round_to(512, 128 * tp * dp), max_seq_len=seq,
        activation=m.activation, norm=m.norm, tied_embeddings=m.tied_embeddings,
        position_embedding=m.position_embedding, embedding_norm=m.embedding_norm, norm_bias=m.norm_bias,
        output_bias=m.output_bias, linear_bias=m.linear_bias, qkv_bias=m.qkv_bias, out_proj_bias=m.out_proj_bias,
        mlp_bias=m.mlp_bias, dropout=m.dropout)
    if m.is_moe:
        pattern = miniature_moe_pattern(m, p, stage_layers, model.num_layers)
        model = model.model_copy(update=miniature_moe_fields(m, hidden, dp, tp) | {"moe_layer_pattern": pattern})
        model = ModelSpec.model_validate(model.model_dump())  # re-check (first_k_dense < num_layers)
    mbs = min(p.micro_batch_size, 2)
    micro = 2 * pp
    training = TrainingSpec(num_gpus=tp * pp * dp * cp, global_batch_size=mbs * micro * dp, seq_len=seq,
                            precision=precision, attention="flash", framework="torch", overlap_grad_reduce=True)
    plan = Plan(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, micro_batch_size=mbs, recompute=p.recompute,
                recompute_num_layers=p.recompute_num_layers, recompute_interval=p.recompute_interval,
                sequence_parallel=p.sequence_parallel, zero_stage=2 if p.zero_stage == 1 else p.zero_stage,
                layers_per_stage=stage_layers, ep=math.gcd(p.ep, tp * dp) if m.is_moe else 1,
                etp=1 if m.is_moe and p.etp is not None else None)
    return Scenario(model=model, hardware=hardware or load_hardware("cpu-gloo"), training=training, plan=plan)


MINIATURE_EXPERTS = 8
"""Routed experts of a MoE miniature when the model has more (or a number that the miniature's dp does
not divide): 8 divides every dp and ep of an 8-rank run, so FSDP2 shards the router rows evenly."""


def miniature_moe_pattern(m: ModelSpec, plan: Plan, stage_layers: tuple[int, ...] | None,
                          layers: int) -> tuple[int, ...] | None:
    """The miniature's ``moe_layer_pattern`` for a model with one (None otherwise): each virtual stage (rank r, chunk
    c) of the miniature takes the start of the model's own chunk (r, c) and keeps at least one MoE layer where that
    chunk has one, so every rank holds experts where the plan's rank does (Maverick at pp 4 x vpp 6: one dense and
    one MoE layer per chunk; the start of the whole pattern would leave rank 0 with dense layers only and its expert
    gradient check empty). At least one layer of the miniature has experts."""
    if m.moe_layer_pattern is None:
        return None
    mini = Plan.model_construct(tp=1, pp=plan.pp, dp=1, cp=1, vpp=plan.vpp, micro_batch_size=1,
                                layers_per_stage=stage_layers, pipeline_schedule=None)
    real_chunks, real_starts = plan.chunk_layers(m.num_layers), plan.chunk_starts(m.num_layers)
    mini_chunks, mini_starts = mini.chunk_layers(layers), mini.chunk_starts(layers)
    flags = [0] * layers
    for r in range(plan.pp):
        for c in range(plan.vpp):
            real = m.moe_layer_pattern[real_starts[r][c]:real_starts[r][c] + real_chunks[r][c]]
            n, at = mini_chunks[r][c], mini_starts[r][c]
            take = (list(real[:n]) + [0] * n)[:n]
            if n and any(real) and not any(take):
                take[-1] = 1
            flags[at:at + n] = take
    if not any(flags):
        flags[-1] = 1
    return tuple(flags)


def miniature_moe_fields(m: ModelSpec, hidden: int, dp: int, tp: int) -> dict:
    """The MoE fields of the miniature: experts (:data:`MINIATURE_EXPERTS` unless the model's count
    already fits), top-k at most 2, expert and shared widths scaled with the hidden size, one
    dense-first layer when the model has any (a model with a ``moe_layer_pattern`` gets one of its own,
    :func:`miniature_moe_pattern`); the gate, the router bias and the routing (dropless, or drop and pad at the model's
    capacity factor) are kept."""
    experts = m.num_experts if m.num_experts <= MINIATURE_EXPERTS and m.num_experts % dp == 0 else MINIATURE_EXPERTS

    def width(f: int | None) -> int | None:
        return None if f is None else _round_to(hidden * f / m.hidden_size, 8 * tp * dp)

    return {"num_experts": experts, "top_k": min(m.top_k, 2), "moe_ffn_hidden_size": width(m.moe_ffn_size),
            "shared_expert_ffn_hidden_size": width(m.shared_expert_ffn_hidden_size),
            "shared_expert_gate": m.shared_expert_gate, "first_k_dense": min(m.first_k_dense, 1),
            "router_bias": m.router_bias, "router_dtype": m.router_dtype, "capacity_factor": m.capacity_factor}


#: ModelSpec fields of the layer's structure that the validate model (planner/validate/model.py: one pre-norm layer,
#: attention then MLP, full causal attention over every position) does not build; :func:`changes` names each one the
#: plan's model sets, as it names the sizes it scales down.
UNBUILT_STRUCTURE = ("parallel_attention", "shared_input_norm", "norm_placement", "qk_norm", "attn_logit_softcap",
                     "final_logit_softcap", "sliding_window", "attention_chunk", "rotary_percent", "attention_sinks",
                     "swiglu_limit", "rope_scaling")


def buildable_model(model: ModelSpec) -> ModelSpec:
    """``model`` as the validate model builds it: each :data:`UNBUILT_STRUCTURE` field at ModelSpec's default (with
    the layer counts that go with a window or a chunk), so that the prediction a run is judged against is of the
    layer it runs. :func:`changes` lists what this drops."""
    fields = ModelSpec.model_fields
    update = {name: fields[name].default for name in (*UNBUILT_STRUCTURE, "sliding_window_layers", "chunked_layers")}
    return ModelSpec.model_validate(model.model_dump() | update)


def changes(sc: Scenario, run: Scenario) -> list[str]:
    """Every way the run differs from the plan, one line each (printed and in the report)."""
    p, q, m, n = sc.plan, run.plan, sc.model, run.model
    out = []
    unbuilt = [f"{name} {getattr(m, name)} -> {getattr(n, name)}" for name in UNBUILT_STRUCTURE
               if getattr(m, name) != getattr(n, name)]
    if unbuilt:
        out.append("layer structure the validate model does not build (it runs a sequential pre-norm layer with full "
                   "causal attention, judged against the prediction for that layer): " + ", ".join(unbuilt))
    if (n.num_layers, n.hidden_size, n.num_attention_heads, n.vocab_size) != \
            (m.num_layers, m.hidden_size, m.num_attention_heads, m.vocab_size):
        out.append(f"model scaled down: {m.num_layers} -> {n.num_layers} layers, hidden {m.hidden_size} -> "
                   f"{n.hidden_size}, heads {m.num_attention_heads} -> {n.num_attention_heads} "
                   f"(kv {m.kv_heads} -> {n.kv_heads}), vocab {m.vocab_size} -> {n.vocab_size}")
    if run.training.seq_len != sc.training.seq_len:
        out.append(f"sequence {sc.training.seq_len} -> {run.training.seq_len}")
    if q.dp != p.dp:
        out.append(f"dp {p.dp} -> {q.dp} (local processes)")
    if (q.micro_batch_size, run.num_microbatches) != (p.micro_batch_size, sc.num_microbatches):
        out.append(f"micro-batch {p.micro_batch_size} -> {q.micro_batch_size}, "
                   f"micro-batches {sc.num_microbatches} -> {run.num_microbatches}")
    if run.training.precision != sc.training.precision:
        why = (f" (the validate model has no {sc.training.precision} GEMMs; FSDP2 MixedPrecisionPolicy bf16 "
               "parameters, fp32 reduction)") if sc.training.precision not in ("fp32", "bf16") else ""
        out.append(f"precision {sc.training.precision} -> {run.training.precision}{why}")
    if q.zero_stage != p.zero_stage:
        out.append(f"ZeRO-{p.zero_stage} -> ZeRO-{q.zero_stage} (FSDP2 has no optimizer-only sharding)")
    if run.training.framework != sc.training.framework:
        out.append(f"framework {sc.training.framework} -> {run.training.framework} (DTensor TP/SP, FSDP2, "
                   "torch.distributed.pipelining)")
    if p.pp > 1 and tuple(sc.stage_layers) != tuple(run.stage_layers):
        out.append(f"layers per stage {tuple(sc.stage_layers)} -> {tuple(run.stage_layers)}")
    if m.is_moe:
        moe = [f"{name} {a} -> {b}" for name, a, b in (
            ("experts", m.num_experts, n.num_experts), ("top_k", m.top_k, n.top_k),
            ("expert ffn", m.moe_ffn_size, n.moe_ffn_size),
            ("shared expert ffn", m.shared_expert_ffn_hidden_size, n.shared_expert_ffn_hidden_size),
            ("dense-first layers", m.first_k_dense, n.first_k_dense), ("ep", p.ep, q.ep)) if a != b]
        if moe:
            out.append("mixture of experts: " + ", ".join(moe))
        if run.training.moe_token_dispatcher != sc.training.moe_token_dispatcher:
            out.append(f"token dispatch {sc.training.moe_token_dispatcher} -> {run.training.moe_token_dispatcher} "
                       "(torch's all-to-all)")
    return out


def predicted_rank_memory(sc: Scenario, pp_rank: int) -> dict:
    """The components of one rank that the run measures exactly: resident weights, gradients and
    optimizer states (no transient ZeRO buffers), and activations saved by the layers at peak.

    FSDP2 keeps weights sharded at rest for ZeRO-2 as for ZeRO-3 (``reshard_after_forward`` only
    decides whether they are re-gathered for backward), so the resident weights are 1/dp there.

    A MoE plan (planner.validate.moe) also predicts the experts' share of each state, and its saved
    activations here assume balanced routing; :func:`compare` replaces that by the bytes expected for
    the tokens each rank's experts actually received (:func:`moe_saved_rows`).
    """
    p = sc.resolved_plan()
    layers = sc.stage_layers[pp_rank]
    if sc.training.framework != "torch":
        raise ValueError("predicted_rank_memory: the validate run is torch.distributed; pass run_scenario(sc) or a miniature")
    if sc.model.is_moe:
        from planner.validate.moe import rank_state_bytes

        return {**rank_state_bytes(sc, pp_rank),
                "saved_activation_peak_bytes": moe_balanced_saved_peak_bytes(sc, pp_rank)}
    params = stage_params_per_rank(sc.model, p, pp_rank, layers)
    w, g, o = fsdp2_shard_bytes_per_param(p.zero_stage, p.dp * p.cp)
    return {"weights_bytes": params * w, "grads_bytes": params * g, "optimizer_bytes": params * o,
            "saved_activation_peak_bytes": stage_saved_bytes(sc.model, sc.training, p, p.num_microbatches,
                                                             pp_rank, layers)}


def fsdp2_shard_bytes_per_param(zero_stage: int, shards: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter of what FSDP2 keeps between steps in the validate run:
    the sharded fp32 parameter, its fp32 sharded gradient and AdamW's two fp32 states, in fp32 and in bf16
    alike (``planner.frameworks.torchtitan.SHARD_BYTES_PER_PARAM``, the persistent part of the torch profile's
    ``state_bytes``). Sharded over ``shards`` ranks with ZeRO >= 1 (FSDP2 keeps weights sharded at rest for
    ZeRO-2 as for ZeRO-3, ``reshard_after_forward`` only decides whether they are re-gathered for backward),
    replicated without ZeRO."""
    from planner.frameworks.torchtitan import SHARD_BYTES_PER_PARAM

    n = max(shards, 1) if zero_stage >= 1 else 1
    return tuple(b / n for b in SHARD_BYTES_PER_PARAM)


@dataclass
class Outcome:
    ok: bool
    message: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)


def _phases(folder: Path, world: int) -> dict[int, str]:
    out = {}
    for r in range(world):
        f = folder / f"rank{r}"
        out[r] = f.read_text() if f.exists() else "not started"
    return out


def _stalled(phases: dict[int, str]) -> str:
    """The ranks furthest behind and their phase (a rank that waits on a stalled peer may share it)."""
    order = {"not started": -4, "init": -3, "build": -2, "microbenchmarks": -1, "report": 1e6, "done": 1e7}

    def progress(ph: str) -> float:
        return int(ph.split()[1]) if ph.startswith("step ") else order.get(ph, -5)

    low = min(phases.values(), key=progress)
    ranks = [r for r, ph in phases.items() if ph == low]
    others = sorted({ph for ph in phases.values() if ph != low}, key=progress)
    names = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    rest = f" (the others reached {', '.join(repr(o) for o in others)})" if others else ""
    return f"{names} in phase '{low}'{rest}"


def _said(log: Path, n: int = 3) -> list[str]:
    """The last error lines a rank wrote (or its last lines when none looks like an error)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"injected|Error|error:|out of memory|refused|validate:", ln)]
    return (errors or lines)[-n:]


def free_port() -> int:
    """A TCP port that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup(pgid: int):
    """What a rank does between fork and exec: join process group ``pgid`` (0: lead a new one; Popen's
    ``process_group`` needs Python 3.11) and get SIGKILL when the launcher dies (Linux ``PR_SET_PDEATHSIG``)."""

    def setup() -> None:
        os.setpgid(0, pgid)
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1

    return setup


@dataclass
class RankRun:
    """How a run of ranks ended: ``status`` ok, failed (``rank`` exited with ``code``), timeout or port."""

    status: str
    rank: int | None = None
    code: int | None = None
    pids: list[int] = field(default_factory=list)


def _kill_group(pgid: int, procs: list) -> None:
    """SIGKILL the ranks' process group, then reap every rank. The group is signalled only while one of
    our ranks is not reaped yet: until then Linux cannot give its id to another process group."""
    if any(proc.poll() is None for proc in procs):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        proc.wait()


def _start(module: str, args: list[str], world: int, port: int, workdir: Path) -> list:
    """Start ``world`` ranks in one new process group (rank 0 leads it), each logging to rank<N>.log."""
    procs: list = []
    for r in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        with open(workdir / f"rank{r}.log", "w") as log:
            try:
                procs.append(subprocess.Popen([sys.executable, "-m", module, *args], stdout=log,
                                              stderr=subprocess.STDOUT, env=env,
                                              preexec_fn=_child_setup(procs[0].pid if procs else 0)))
            except BaseException:
                if procs:
                    _kill_group(procs[0].pid, procs)
                raise
    return procs


def _port_clash(workdir: Path) -> bool:
    text = (workdir / "rank0.log").read_text(errors="replace") if (workdir / "rank0.log").exists() else ""
    return bool(re.search(r"EADDRINUSE|[Aa]ddress already in use", text))


def run_ranks(module: str, args: list[str], world: int, timeout_s: float, workdir: Path,
              port: int | None = None, on_start=None) -> RankRun:
    """Run ``python -m module args`` on ``world`` local ranks with torch's env:// rendezvous.

    The ranks share one process group that this function owns; a rank that fails, the wall-clock
    limit ``timeout_s``, Ctrl-C (KeyboardInterrupt) or SIGTERM kill the whole group, and the
    children also die with this process (``PR_SET_PDEATHSIG``). A rendezvous port that another
    process holds makes rank 0 fail with EADDRINUSE; the run is then started again on a fresh port,
    up to ``PORT_RETRIES`` times, unless ``port`` was given (status ``port``).
    ``on_start(pids)`` is called once the ranks run (the tests use it).
    """
    deadline = time.monotonic() + timeout_s
    previous = signal.getsignal(signal.SIGTERM) if _main_thread() else None

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if previous is not None:
        signal.signal(signal.SIGTERM, on_term)
    try:
        for attempt in range(PORT_RETRIES):
            chosen = port or free_port()
            procs = _start(module, args, world, chosen, workdir)
            pids = [q.pid for q in procs]
            if on_start is not None:
                on_start(pids)
            try:
                result = _watch(procs, deadline)
            finally:
                _kill_group(procs[0].pid, procs)
            result.pids = pids
            if result.status == "failed" and result.rank == 0 and _port_clash(workdir):
                if port is not None or attempt == PORT_RETRIES - 1:
                    result.status, result.code = "port", chosen
                    return result
                continue
            return result
        raise AssertionError("unreachable")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _watch(procs: list, deadline: float) -> RankRun:
    while True:
        codes = [q.poll() for q in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            failed.sort(key=lambda rc: rc[1] in (-signal.SIGTERM, -signal.SIGKILL))
            return RankRun("failed", *failed[0])
        if all(c == 0 for c in codes):
            return RankRun("ok")
        if time.monotonic() > deadline:
            return RankRun("timeout")
        time.sleep(0.05)


def _workdir(keep: str | None, prefix: str) -> Path:
    path = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_worker(plan_path: Path, world: int, steps: int, backend: str, timeout_s: float, workdir: Path,
               reference: bool, on_start=None) -> Outcome:
    """The validate worker on ``world`` local ranks; never longer than ``timeout_s``."""
    out, phase_dir = workdir / "measured.json", workdir / "phases"
    phase_dir.mkdir(exist_ok=True)
    args = ["--plan", str(plan_path), "--steps", str(steps), "--out", str(out), "--phase-dir", str(phase_dir),
            # collectives time out after the wall clock, so that a stall is reported with the rank furthest behind
            "--backend", backend, "--timeout-s", str(timeout_s + 30.0)] + (["--reference"] if reference else [])
    run = run_ranks("planner.validate.worker", args, world, timeout_s, workdir, on_start=on_start)
    phases = _phases(phase_dir, world)
    if run.status == "ok":
        return Outcome(True, report=json.loads(out.read_text()), pids=run.pids)
    if run.status == "timeout":
        lines = [f"validate timed out after {timeout_s:.0f} s: {_stalled(phases)}"]
    elif run.status == "port":
        lines = [f"validate: the rendezvous port {run.code} is taken; free it or let validate pick one"]
    else:
        lines = [f"a rank failed: rank {run.rank} exited with code {run.code} in phase '{phases.get(run.rank, '?')}' "
                 f"(furthest behind: {_stalled(phases)})",
                 *(f"  {ln}" for ln in _said(workdir / f"rank{run.rank}.log"))]
    oom = [r for r, ph in phases.items() if ph.startswith("oom")]
    reasons = [f"out of memory: rank {r} ({phases[r]})" for r in oom] or [lines[0]]
    return Outcome(False, lines, {"verdict": "fail", "reasons": reasons, "fits": False if oom else None},
                   pids=run.pids)


def is_calibrated(hardware_ref: str) -> bool:
    """True when ``hardware_ref`` is a profile file that `plan3d calibrate` wrote (its first line says so)."""
    path = Path(hardware_ref)
    try:
        first = path.read_text().splitlines()[0] if path.is_file() else ""
    except (OSError, IndexError, UnicodeDecodeError):
        return False
    return first.startswith(CALIBRATE_HEADER)


def _rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted if predicted else (0.0 if measured == predicted else float("inf"))


def predicted_term_s(sc: Scenario, name: str, bench: dict) -> float:
    """The cost model's time for one measured collective, same bytes and group size, on one node
    (planner.comm ``ring_time_s`` for all-reduce, ``p2p_time_s`` for a send/recv and for one step of
    the cp ring, as planner.cost charges each K/V exchange)."""
    from planner.comm import p2p_time_s, ring_time_s

    hw = sc.hardware
    if name in ("pp_send_recv", "cp_ring_exchange"):  # a cp ring step: K/V to the next rank (planner.cost)
        return p2p_time_s(bench["bytes"], False, hw)
    return ring_time_s("all_reduce", bench["bytes"], bench["ranks"], hw.intra_node_bandwidth_gbps,
                       hw.intra_node_latency_us)


def moe_balanced_saved_peak_bytes(sc: Scenario, pp_rank: int) -> float:
    """Saved activations at the peak of stage ``pp_rank`` with balanced routing: in-flight chunks x the
    chunk's dense layers and MoE layers, each MoE layer receiving ``b*s*k`` tokens."""
    import numpy as np

    from planner.memory import in_flight_chunks
    from planner.schedules import framework_family
    from planner.validate.moe import balanced_routed_tokens, microbatch_saved_bytes

    p = sc.resolved_plan()
    moe_layers = p.stage_moe_layers(sc.model)[pp_rank]
    dense_layers = sc.stage_layers[pp_rank] - moe_layers
    r = balanced_routed_tokens(sc.training, p, sc.model)
    per_stage_pass = microbatch_saved_bytes(sc, dense_layers, [r] * moe_layers)  # all chunks of the stage
    held = in_flight_chunks(p, p.num_microbatches, pp_rank, family=framework_family(sc.training.framework))
    return float(np.asarray(held) * per_stage_pass / p.vpp)


def moe_saved_rows(sc: Scenario, r: dict) -> tuple[list[dict], dict]:
    """For one rank of a MoE run: the saved-activation rows against the bytes expected for the tokens its
    experts received (each chunk-micro-batch, and the peak over the ones in flight), and a summary with
    the ratio to the balanced-routing expectation and the routed token counts."""
    from planner.validate.moe import balanced_routed_tokens, microbatch_saved_bytes

    expected = {tuple(m["key"]): microbatch_saved_bytes(sc, m["dense_layers"], m["routed"])
                for m in r["saved_by_microbatch"]}
    worst = max(r["saved_by_microbatch"], key=lambda m: abs(_rel(m["bytes"], expected[tuple(m["key"])])))
    peak_pred = sum(expected.get(tuple(k), 0.0) for k in r["saved_peak_keys"])
    base = {"rank": r["rank"], "stage": r["pp_rank"]}
    rows = [{"metric": "saved_activation_peak_bytes", **base, "predicted": peak_pred,
             "measured": r["saved_activation_peak_bytes"],
             "rel_error": _rel(r["saved_activation_peak_bytes"], peak_pred)},
            {"metric": "saved_activation_microbatch_bytes", **base, "predicted": expected[tuple(worst["key"])],
             "measured": worst["bytes"], "rel_error": _rel(worst["bytes"], expected[tuple(worst["key"])])}]
    balanced = moe_balanced_saved_peak_bytes(sc, r["pp_rank"])
    routed = [n for m in r["saved_by_microbatch"] for n in m["routed"]]
    even = balanced_routed_tokens(sc.training, sc.resolved_plan(), sc.model)
    summary = {**base, "measured_peak_bytes": r["saved_activation_peak_bytes"], "balanced_peak_bytes": balanced,
               "ratio_to_balanced": r["saved_activation_peak_bytes"] / balanced if balanced else None,
               "routed_tokens_min": min(routed, default=None), "routed_tokens_max": max(routed, default=None),
               "routed_tokens_balanced": even}
    return rows, summary


def compare(sc: Scenario, measured: dict, time_factor: float | None = None,
            memory_tolerance: float = MEMORY_TOLERANCE) -> dict:
    """Predicted against measured for each metric, with relative errors, and the verdict (:func:`judge`)."""
    from planner.cost import estimate_time

    rows = []
    ranks = measured["ranks"]
    moe_summary = []
    for r in ranks:
        pred = predicted_rank_memory(sc, r["pp_rank"])
        if sc.model.is_moe:  # saved activations: against the routed token counts this rank measured
            del pred["saved_activation_peak_bytes"]
        for key, value in pred.items():
            got = r[key]
            rows.append({"metric": key, "rank": r["rank"], "stage": r["pp_rank"], "predicted": value, "measured": got,
                         "rel_error": _rel(got, value)})
        if sc.model.is_moe:
            saved_rows, summary = moe_saved_rows(sc, r)
            rows += saved_rows
            moe_summary.append(summary)
    peak = estimate_memory(sc.model, sc.hardware, sc.training, sc.plan)
    device_rows = []
    for r in ranks:
        if r.get("max_memory_allocated_bytes") is not None:
            want = peak.stages[r["pp_rank"]].total_bytes
            device_rows.append({"metric": "max_memory_allocated", "rank": r["rank"], "stage": r["pp_rank"],
                                "predicted": want, "measured": r["max_memory_allocated_bytes"],
                                "reserved": r.get("max_memory_reserved_bytes"),
                                "rel_error": _rel(r["max_memory_allocated_bytes"], want)})
    step_s = max(statistics.median(r["step_s"]) for r in ranks if r["step_s"])  # median: one hiccup is not the step
    t = estimate_time(sc.model, sc.hardware, sc.training, sc.plan)
    losses = next((r["losses"] for r in ranks if r["losses"] and r["dp_rank"] == 0 and r["tp_rank"] == 0), [])
    bench = {}
    for r in ranks:
        for name, val in r["microbenchmarks"].items():
            bench.setdefault(name, val)
    terms = []
    for name, b in bench.items():
        want = predicted_term_s(sc, name, b)
        terms.append({"term": name, "bytes": b["bytes"], "ranks": b["ranks"], "predicted_s": want,
                      "measured_s": b["seconds"], "rel_error": _rel(b["seconds"], want), "busbw_gbps": b["busbw_gbps"]})
    usable = sc.hardware.usable_memory_gib * 2**30
    loss_tol, grad_tol = tolerances_for(sc.training.precision)
    per_rank = [r["max_memory_allocated_bytes"] if r.get("max_memory_allocated_bytes") is not None else
                sum(r[k] for k in ("weights_bytes", "grads_bytes", "optimizer_bytes", "saved_activation_peak_bytes"))
                for r in ranks]
    out = {
        "memory": rows,
        "memory_max_abs_error": max(abs(x["rel_error"]) for x in rows),
        "device_memory": device_rows,
        "step_time": {"predicted_s": t.step_time_s, "measured_s": step_s, "rel_error": _rel(step_s, t.step_time_s),
                      "ratio": step_s / t.step_time_s, "judged": time_factor is not None},
        "terms": terms,
        "losses": losses,
        "microbenchmarks": bench,
        "tolerances": {"memory": memory_tolerance, "device_memory": ALLOCATED_TOLERANCE, "loss": loss_tol,
                       "gradients": grad_tol, "step_time_factor": time_factor},
        "measured_peak_bytes": max(per_rank),
        "fits": max(per_rank) <= usable,
        "predicted_fits": peak.fits,
    }
    if "reference_loss" in measured and losses:
        ref = measured["reference_loss"]
        out["reference"] = {"reference_loss": ref, "first_loss": losses[0], "rel_error": _rel(losses[0], ref)}
    tied = [r["tied_max_abs_diff"] for r in ranks if r.get("tied_max_abs_diff") is not None]
    if tied:
        out["tied_max_abs_diff"] = max(tied)
    if (sc.plan.cp > 1 or sc.training.precision != "fp32") and not sc.model.is_moe:  # cp and bf16 runs (MoE: below)
        out["grad_check"] = next((r["grad_check"] for r in ranks if r.get("grad_check")), None)
    if sc.model.is_moe:
        out["moe"] = {"activations": moe_summary,
                      "grad_check": next((r["grad_check"] for r in ranks if r.get("grad_check")), None)}
    out["verdict"], out["reasons"] = judge(out, ranks, memory_tolerance, time_factor)
    return out


def judge(out: dict, ranks: list[dict], memory_tolerance: float, time_factor: float | None) -> tuple[str, list[str]]:
    """``("pass" | "fail", reasons)`` from the measurements in ``out`` (never from the predicted fit)."""
    import math

    reasons = []
    for row in out["memory"]:
        if abs(row["rel_error"]) > memory_tolerance:
            reasons.append(f"memory: rank {row['rank']} (stage {row['stage']}) {row['metric']} measured "
                           f"{row['measured'] / 2**20:.3f} MiB, predicted {row['predicted'] / 2**20:.3f} MiB "
                           f"({100 * row['rel_error']:+.1f}% > {100 * memory_tolerance:.0f}%)")
    for row in out["device_memory"]:
        if abs(row["rel_error"]) > ALLOCATED_TOLERANCE:
            reasons.append(f"memory: rank {row['rank']} max_memory_allocated {row['measured'] / 2**30:.3f} GiB, "
                           f"predicted {row['predicted'] / 2**30:.3f} GiB ({100 * row['rel_error']:+.1f}% > "
                           f"{100 * ALLOCATED_TOLERANCE:.0f}%)")
    leaked = [r["rank"] for r in ranks if r.get("unreleased_microbatches")]
    if leaked:
        reasons.append(f"memory: ranks {leaked} kept saved activations of a micro-batch after its backward")
    if not out["fits"]:
        reasons.append(f"memory: measured peak {out['measured_peak_bytes'] / 2**30:.2f} GiB does not fit")
    tol = out.get("tolerances") or {}
    loss_tol, grad_tol = tol.get("loss", LOSS_TOLERANCE), tol.get("gradients", GRAD_TOLERANCE)
    ref = out.get("reference")
    if ref and not abs(ref["rel_error"]) <= loss_tol:
        reasons.append(f"loss: first loss {ref['first_loss']:.6f} vs single-process {ref['reference_loss']:.6f} "
                       f"({100 * ref['rel_error']:+.4f}% > {100 * loss_tol:.2f}%)")
    if not all(math.isfinite(x) for x in out["losses"]):
        reasons.append("loss: not finite")
    grads = (out.get("moe") or {}).get("grad_check") or out.get("grad_check") or {}
    for group, g in grads.items():
        if not g["rel_diff"] <= grad_tol:
            reasons.append(f"gradients: rank 0's {group} gradients differ from the single-process model's by "
                           f"{100 * g['rel_diff']:.4f}% of the largest (> {100 * grad_tol:.2f}%)")
    if out.get("tied_max_abs_diff", 0.0) > 1e-6:
        reasons.append(f"tied embeddings: the two copies differ by {out['tied_max_abs_diff']:.2e} after training")
    st = out["step_time"]
    if time_factor is not None and not 1 / time_factor <= st["ratio"] <= time_factor:
        reasons.append(f"step time: measured {st['measured_s']:.4f} s, predicted {st['predicted_s']:.4f} s "
                       f"({st['ratio']:.2f}x, outside 1/{time_factor:g}x..{time_factor:g}x)")
    return ("fail" if reasons else "pass"), reasons


def summary_lines(report: dict) -> list[str]:
    """What the CLI prints under the predicted-against-measured table: what the run changed, the
    per-term times, the device peaks, and the verdict with its reasons (from measurements only)."""
    lines = [f"changed: {c}" for c in report.get("changed", [])]
    for t in report.get("terms", []):
        lines.append(f"{t['term']}: measured {1e3 * t['measured_s']:.3f} ms, predicted {1e3 * t['predicted_s']:.3f} ms "
                     f"({100 * t['rel_error']:+.0f}%, reported, not judged)")
    for row in report.get("device_memory", []):
        reserved = f", reserved {row['reserved'] / 2**30:.3f} GiB" if row.get("reserved") else ""
        lines.append(f"rank {row['rank']}: max_memory_allocated {row['measured'] / 2**30:.3f} GiB, predicted "
                     f"{row['predicted'] / 2**30:.3f} GiB ({100 * row['rel_error']:+.1f}%){reserved}")
    lines += moe_summary_lines(report.get("moe"))
    for group, g in (report.get("grad_check") or {}).items():  # cp runs (MoE runs: moe_summary_lines)
        if g["params"]:
            lines.append(f"{group} gradients (rank 0, {g['params']} tensors) vs single process: "
                         f"{100 * g['rel_diff']:.5f}% of the largest")
    st = report.get("step_time")
    if st and not st.get("judged"):
        lines.append("step time: reported, not judged (the hardware profile was not calibrated here; "
                     "`plan3d calibrate`, or --time-factor)")
    lines.append(f"verdict: {report.get('verdict', 'fail').upper()}")
    lines += [f"  {r}" for r in report.get("reasons", [])]
    return lines


def moe_summary_lines(moe: dict | None) -> list[str]:
    """The MoE part of the summary: rank 0's gradients against the single-process model (judged) and the
    saved activations against balanced routing with the routed token counts (reported, not judged)."""
    if not moe:
        return []
    lines = []
    for group, g in (moe.get("grad_check") or {}).items():
        lines.append(f"{group} gradients (rank 0, {g['params']} tensors) vs single process: "
                     f"{100 * g['rel_diff']:.5f}% of the largest")
    acts = moe.get("activations") or []
    if acts:
        ratios = [a["ratio_to_balanced"] for a in acts if a["ratio_to_balanced"]]
        lows = [a["routed_tokens_min"] for a in acts if a["routed_tokens_min"] is not None]
        highs = [a["routed_tokens_max"] for a in acts if a["routed_tokens_max"] is not None]
        lines.append(f"saved activations / balanced-routing expectation: {min(ratios):.3f}..{max(ratios):.3f} over "
                     f"ranks; tokens per rank's experts per layer and micro-batch {min(lows)}..{max(highs)} "
                     f"(balanced {acts[0]['routed_tokens_balanced']}; reported, not judged: the rows above use "
                     "the measured counts)")
    return lines


def validate_local(sc: Scenario, steps: int = 3, scale: float = 1.0, max_ranks: int = 8, backend: str = "gloo",
                   timeout_s: float = 300.0, hardware: HardwareSpec | None = None, keep: str | None = None,
                   reference: bool = True, time_factor: float | None = None,
                   memory_tolerance: float = MEMORY_TOLERANCE, on_start=None,
                   precision: str = "fp32") -> tuple[Scenario, Outcome]:
    """Run the miniature of ``sc`` on this machine (in ``precision``: fp32 or bf16) and judge it; the temp
    folder is removed unless ``keep``."""
    mini = miniature(sc, max_ranks, scale, hardware, backend, precision)
    from planner.render import scenario_json

    workdir = _workdir(keep, "plan3d-validate-")
    try:
        plan_path = workdir / "miniature.plan.json"
        plan_path.write_text(scenario_json(mini))
        t0 = time.perf_counter()
        outcome = run_worker(plan_path, mini.plan.world_size, steps, backend, timeout_s, workdir, reference, on_start)
        outcome.report["changed"] = changes(sc, mini)
        if outcome.ok:
            outcome.report = {"miniature": json.loads(plan_path.read_text()), "wall_s": time.perf_counter() - t0,
                              "changed": changes(sc, mini),
                              **compare(mini, outcome.report, time_factor, memory_tolerance),
                              "measured": outcome.report}
        if not keep:
            outcome.message = [m.replace(str(workdir), "<removed temp folder>") for m in outcome.message]
        return mini, outcome
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


CALIBRATE_HEADER = "# Hardware profile written by `plan3d calibrate`"


def calibrate_local(base: HardwareSpec, backend: str = "gloo", ranks: int = 8, timeout_s: float = 300.0,
                    quick: bool = True, name: str | None = None) -> tuple[HardwareSpec, str]:
    """Measure this machine with ``ranks`` local processes; return the profile and its annotated YAML."""
    workdir = _workdir(None, "plan3d-calibrate-")
    try:
        out = workdir / "calibration.json"
        args = ["--out", str(out), "--backend", backend] + (["--quick"] if quick else [])
        run = run_ranks("planner.validate.calibrate", args, ranks, timeout_s, workdir)
        if run.status != "ok":
            what = {"timeout": f"timed out after {timeout_s:.0f} s", "port": f"rendezvous port {run.code} is taken"}
            said = " | ".join(_said(workdir / f"rank{run.rank}.log")) if run.status == "failed" else ""
            raise SpecError(f"calibrate: the measuring run failed: "
                            f"{what.get(run.status, f'rank {run.rank} exited with code {run.code}')}"
                            f"{': ' + said if said else ''}")
        return profile_from_measurements(json.loads(out.read_text()), base, name)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def profile_from_measurements(data: dict, base: HardwareSpec, name: str | None = None) -> tuple[HardwareSpec, str]:
    """A hardware profile from `calibrate` measurements, on top of ``base`` for what was not measured.

    Only what was measured replaces a figure of ``base``: the GEMM peak (per process, while every
    rank ran GEMMs at once), the intra-node bus bandwidth and latency, and the inter-node ones only
    when the job spanned several nodes. On one node the inter-node figures of ``base`` are kept
    (an intra-node figure would make cross-node links look as fast as NVLink). ``sustained_fraction``
    is a long-run property (docs/cost-model.md) that a short calibration does not measure: kept.
    Each line of the YAML says which it is.
    """
    import datetime

    ranks = data["ranks"]
    tflops = statistics.median([g["tflops"] for r in ranks for g in r["gemms"]])
    best = max(g["tflops"] for r in ranks for g in r["gemms"])

    def link(key: str):
        curves = [r[key] for r in ranks if r.get(key)]
        if not curves:
            return None
        big = statistics.median([c[-1]["busbw_gbps"] for c in curves])
        small = statistics.median([c[0]["latency_us"] for c in curves])
        return big, small

    intra = link("intra")
    inter = link("inter") if data["nodes"] > 1 else None
    fp32 = data["dtype"] == "torch.float32"
    when = datetime.date.today().isoformat()
    src = f"measured by plan3d calibrate ({data['world']} ranks, {data['nodes']} node(s), {data['backend']}) on {when}"
    fields = base.model_dump()
    fields.update({"name": name or f"{base.name}-calibrated", "gpus_per_node": data["gpus_per_node"]})
    if fp32:  # a CPU has no datasheet tensor peak: the best measured rate is the peak, the median its share
        # the miniature runs fp32 by default; a --precision bf16 run is predicted at this fp32 rate too (not measured)
        fields.update({"peak_fp32_tflops": best, "peak_bf16_tflops": best,
                       "gemm_efficiency_max": min(1.0, tflops / best)})
    else:
        # A GPU keeps its datasheet peak (MFU is measured against it); the measurement is the MAMF,
        # the best achievable rate as a share of that peak (gemm_efficiency_max's meaning). Measured on
        # one H200 (2026-11-30): 786.8 of 989.4 TFLOP/s = 0.795, where writing 786.8 as the "peak"
        # had inflated every MFU by 26 %.
        fields["gemm_efficiency_max"] = min(1.0, best / base.peak_bf16_tflops)
    if intra:
        fields["intra_node_bandwidth_gbps"], fields["intra_node_latency_us"] = intra
    if inter:
        fields["inter_node_bandwidth_gbps"], fields["inter_node_latency_us"] = inter
    spec = HardwareSpec.model_validate(fields)
    per_process = (f"best GEMM rate of one process while all {data['world']} ranks ran the same GEMMs "
                   f"(barrier before each sample), {src}")
    notes = {"gpus_per_node": src}
    if fp32:
        notes["peak_fp32_tflops"] = per_process
        notes["gemm_efficiency_max"] = f"median over the cost model's GEMM shapes and ranks / best, {src}"
    else:
        notes["gemm_efficiency_max"] = (f"best GEMM rate / peak_bf16_tflops ({base.name}'s datasheet figure, kept): "
                                        f"{per_process}")
    if intra:
        notes["intra_node_bandwidth_gbps"] = f"all-reduce bus bandwidth (nccl-tests factor), synchronised, {src}"
        notes["intra_node_latency_us"] = f"smallest all-reduce / ring steps, {src}"
    else:
        notes["intra_node_bandwidth_gbps"] = notes["intra_node_latency_us"] = \
            f"not measured (one rank per node): kept from {base.name}"
    if inter:
        notes["inter_node_bandwidth_gbps"] = f"all-reduce over one rank per node, synchronised, {src}"
        notes["inter_node_latency_us"] = f"smallest inter-node all-reduce / ring steps, {src}"
    else:
        notes["inter_node_bandwidth_gbps"] = notes["inter_node_latency_us"] = \
            f"not measured (one node): kept from {base.name}"
    notes["sustained_fraction"] = f"not measured (a long-run property): kept from {base.name}"
    if fp32:
        notes["peak_bf16_tflops"] = "the CPU computes in fp32: same as peak_fp32_tflops"
    measured = [k for k, v in notes.items() if "kept from" not in v]
    kept = [k for k in spec.model_dump() if k not in measured and k != "name"]
    lines = [f"{CALIBRATE_HEADER} on {when}, from {base.name}.",
             f"# Measured: {', '.join(measured)}.",
             f"# Kept from {base.name} (not measured here): {', '.join(kept)}."]
    for key, value in spec.model_dump().items():
        if value is None:
            continue
        text = f"{key}: {json.dumps(value) if isinstance(value, str) else value}"
        lines.append(f"{text:<40} # {notes.get(key, f'from {base.name}')}")
    return spec, "\n".join(lines) + "\n"


def calibration_summary(base: HardwareSpec, spec: HardwareSpec) -> list[str]:
    """What calibrate measured and what it kept, one line per figure, for the CLI to print."""
    out = []
    for key in ("peak_fp32_tflops", "peak_bf16_tflops", "gemm_efficiency_max", "intra_node_bandwidth_gbps",
                "intra_node_latency_us", "inter_node_bandwidth_gbps", "inter_node_latency_us", "sustained_fraction"):
        old, new = getattr(base, key), getattr(spec, key)
        out.append(f"{key}: {old} -> {new} (measured)" if old != new else f"{key}: {old} (kept from {base.name})")
    return out


def inside_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def run_scenario(sc: Scenario, precision: str | None = None) -> Scenario:
    """What the full-size validate run executes for a plan: the plan's precision as :func:`run_precision` maps
    it (bf16 for bf16 and the fp8 family, with FSDP2's mixed precision; fp32 for fp32) unless ``precision``
    says otherwise, torch's DTensor SP, FSDP2 (ZeRO-1 runs as ZeRO-2), the layer the validate model builds
    (:func:`buildable_model`). :func:`changes` lists what differs."""
    if precision not in (None, "fp32", "bf16"):
        raise SpecError(f"--precision: '{precision}' is not one of fp32, bf16 (what the validate run can run)")
    run = precision or run_precision(sc.training.precision)
    # (Megatron's loss kernel is Megatron's: the torch run has its own loss, counted by the torch profile)
    # (nor are DeepEP and HybridEP: the run dispatches with torch's all-to-all, planner.validate.moe)
    training = sc.training.model_copy(update={"precision": run, "framework": "torch", "cross_entropy_fusion": "none",
                                              "moe_token_dispatcher": "alltoall"})
    plan = sc.plan.model_copy(update={"zero_stage": 2 if sc.plan.zero_stage == 1 else sc.plan.zero_stage})
    return sc.model_copy(update={"model": buildable_model(sc.model), "training": training, "plan": plan})
