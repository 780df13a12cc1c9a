"""Step time of a plan: per-stage compute and communication, pipeline schedule, DP sync, optimizer.

The model (docs/cost-model.md):

* **GEMMs** run at the maximum achievable matmul rate (MAMF, ``gemm_efficiency_max`` x peak),
  reduced by **tile and wave quantisation**: the output is cut into 256 x 128 (or 128 x 256)
  tiles, one per SM at a time, so a GEMM takes ``ceil(tiles / SMs)`` full waves (NVIDIA "Matrix
  Multiplication Background User's Guide", sections on tile and wave quantisation). A GEMM is
  also never faster than its HBM traffic (roofline), and each costs ``kernel_overhead_us``. So
  TP's thinner slices and short sequences run less efficiently. Backward = data grad + weight
  grad, each with its own shape.
* **Attention**: FlashAttention at ``attention_efficiency`` of peak, backward 2.5x forward
  (5 GEMMs against 2, Dao 2023, arXiv:2307.08691). Materialised attention is two batched GEMMs
  plus the fused softmax and dropout, which are memory-bound.
* **Memory-bound operations** (norms, bias-dropout-add, activation function, RoPE, cross-entropy)
  move their bytes at ``hbm_bandwidth * hbm_efficiency``; backward moves twice the bytes.
* **TP communication** (Shoeybi 2019 section 3; Korthikanti 2022 section 4.2.2; formulas.md C2):
  2 all-reduces forward and 2 backward per layer, or with SP 2 all-gathers + 2 reduce-scatters
  each way plus the wgrad re-gather. The column-parallel input-gradient collectives overlap the
  weight-gradient GEMM, as Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` does.
* **Pipeline** (Narayanan 2021 section 2.2): ``T = m * X_max + (p - 1) * X_mean / v``. ``X`` is the
  per-micro-batch forward + backward time of a stage (its P2P transfers included). So the
  slowest stage paces the steady state and the bubble is ``(p - 1) / v`` stage-times (the
  "ratio to ideal" form of contradiction 9, as a time).
* **DP**: all-reduce (or reduce-scatter + all-gather with ZeRO) of each stage's gradients. With
  ``overlap_grad_reduce`` it is hidden under the last micro-batch's backward of that stage and
  under the pipeline drain behind it (Megatron ``--overlap-grad-reduce``, formulas.md C4).
* **Optimizer**: Adam is memory-bound, 42 B moved per parameter of the local shard (``ADAM_BYTES_PER_PARAM``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import comm, flops
from planner.layout import DEFAULT_ORDER, axis_span, pp_hop_crosses_nodes
from planner.memory import act_bytes, grad_bytes, kv_heads_per_rank, param_bytes, stage_params_per_rank
from planner.specs import HardwareSpec, ModelSpec, Plan, Scenario, TrainingSpec, padded_vocab_size

ACT_BYTES = 2
FLASH_BWD_OVER_FWD = 2.5  # FlashAttention-2 backward runs 5 GEMMs to the forward's 2 (Dao 2023)
# Megatron's optimizer step per parameter of the local shard: grad-norm read 4, Adam (read grad,
# master, m, v; write master, m, v) 28, fp32 master -> bf16 weight copy 6, zeroing the grad buffer 4
ADAM_BYTES_PER_PARAM = 42
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_comm_exposed", "optimizer")


TILES = ((256, 128), (128, 256))  # large CTA tiles of cuBLAS/CUTLASS bf16 GEMMs


@dataclass(frozen=True)
class Rates:
    """The hardware figures the cost model uses, in base units (FLOP/s, bytes/s, seconds)."""

    gemm_flops: float
    sm_count: int
    gemm_overhead_s: float
    attention_flops: float
    hbm_bytes_per_s: float

    @classmethod
    def of(cls, hw: HardwareSpec, precision: str) -> Rates:
        sustained = hw.sustained_fraction
        return cls(gemm_flops=hw.peak_flops(precision) * hw.gemm_efficiency_max * sustained, sm_count=hw.sm_count,
                   gemm_overhead_s=hw.kernel_overhead_us * 1e-6,
                   attention_flops=hw.peak_flops("bf16") * hw.attention_efficiency * sustained,
                   hbm_bytes_per_s=hw.hbm_bandwidth_gbps * 1e9 * hw.hbm_efficiency)


def _waves_flops(m: float, k: float, n: float, batch: float, sm_count: int) -> float:
    """FLOPs the GPU spends on a GEMM once its output is cut into tiles and tiles into waves."""
    best = math.inf
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / sm_count)
        best = min(best, waves * sm_count * 2.0 * tm * tn * k)
    return best


def gemm_time_s(m: float, k: float, n: float, rates: Rates, batch: float = 1.0) -> float:
    """One (batched) GEMM ``[m, k] x [k, n]``: quantised compute or HBM traffic, plus launch (module docstring)."""
    moved = ACT_BYTES * (m * k + k * n + m * n) * batch
    compute = _waves_flops(m, k, n, batch, rates.sm_count) / rates.gemm_flops
    return max(compute, moved / rates.hbm_bytes_per_s) + rates.gemm_overhead_s


def gemm_fwd_bwd_s(m: float, k: float, n: float, rates: Rates) -> tuple[float, float, float]:
    """(forward, data-grad, weight-grad) times of a linear layer ``[m, k] -> [m, n]``."""
    return gemm_time_s(m, k, n, rates), gemm_time_s(m, n, k, rates), gemm_time_s(k, m, n, rates)


def overlapped_s(comm_s: float, compute_s: float, contention: float) -> float:
    """Exposed time of a collective that runs alongside ``compute_s`` of GEMMs.

    What does not fit under the compute is exposed; while both run, NCCL's thread blocks
    occupy ``contention`` of the SMs, slowing the compute by that share (NCCL runs one block per
    channel; ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` in the NCCL environment docs).
    """
    return max(0.0, comm_s - compute_s) + contention * min(comm_s, compute_s)


def contention(hw: HardwareSpec) -> float:
    return min(1.0, hw.nccl_channels / hw.sm_count)


@dataclass(frozen=True)
class LayerTime:
    """Seconds one layer spends per micro-batch on one GPU."""

    fwd_compute: float
    bwd_compute: float
    recompute: float
    tp_fwd: float
    tp_bwd: float
    cp: float

    @property
    def tp(self) -> float:
        return self.tp_fwd + self.tp_bwd


def _linear_shapes(model: ModelSpec, plan: Plan) -> dict[str, tuple[float, float, str]]:
    """(k, n, kind) of each linear layer on one TP rank; kind is column or row parallel."""
    t, h, d = plan.tp, model.hidden_size, model.kv_channels
    q_r, kv_r = model.q_size / t, kv_heads_per_rank(model, t) * d
    fc1 = (2 if model.gated_mlp else 1) * model.ffn_size / t
    return {"qkv": (h, q_r + 2 * kv_r, "column"), "proj": (q_r, h, "row"),
            "fc1": (h, fc1, "column"), "fc2": (model.ffn_size / t, h, "row")}


def _attention_core_s(model: ModelSpec, training: TrainingSpec, plan: Plan, rates: Rates) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one layer per micro-batch."""
    t, b, s = plan.tp, plan.micro_batch_size, training.seq_len
    a_r, d = model.num_attention_heads / t, model.kv_channels
    if training.attention == "flash":
        fwd_flops = b * flops.attention_flops_per_token_per_layer(model, s, causal=True) * (s / plan.cp) / t
        fwd = fwd_flops / rates.attention_flops
        return fwd, FLASH_BWD_OVER_FWD * fwd
    # materialised: QK^T and PV as batched GEMMs over a_r * b heads, full s x s (masked, not skipped)
    heads = a_r * b
    sq = s / plan.cp
    qk = gemm_time_s(sq, d, s, rates, batch=heads)
    pv = gemm_time_s(sq, s, d, rates, batch=heads)
    elements = heads * sq * s
    soft_fwd = elements * (ACT_BYTES * 2 + (5 if model.dropout else 0)) / rates.hbm_bytes_per_s
    soft_bwd = elements * (ACT_BYTES * 3 + (5 if model.dropout else 0)) / rates.hbm_bytes_per_s
    return qk + pv + soft_fwd, 2 * (qk + pv) + soft_bwd


def _elementwise_bytes_per_token(model: ModelSpec, plan: Plan) -> float:
    """Forward HBM bytes per token of one layer's memory-bound operations.

    Norms read and write ``2h`` bytes each; each fused bias-dropout-add reads the branch and the
    residual and writes the sum (``6h``, plus a 1-byte mask with dropout). These replicated
    regions are / t only with SP (Korthikanti section 4.2.2). The activation function reads its
    input (``2f``, ``4f`` for SwiGLU) and writes ``2f``; RoPE rewrites Q and K.
    """
    t, h, f = plan.tp, model.hidden_size, model.ffn_size
    sp = t if plan.sequence_parallel else 1
    mask = h if model.dropout else 0
    replicated = (2 * 4 * h + 2 * (6 * h + mask)) / sp
    act = ((4 if model.gated_mlp else 2) * f + 2 * f) / t
    rope = 4 * (model.q_size + 2 * model.kv_heads * model.kv_channels) / t if model.position_embedding == "rope" else 0
    return replicated + act + rope


def layer_time(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
               order: str = DEFAULT_ORDER) -> LayerTime:
    """Compute and communication of one transformer layer for one micro-batch on one GPU."""
    rates = Rates.of(hw, training.precision)
    tokens = plan.micro_batch_size * training.seq_len / plan.cp
    fwd = bwd = 0.0
    wgrad_col = []
    for k, n, kind in _linear_shapes(model, plan).values():
        f, dg, wg = gemm_fwd_bwd_s(tokens, k, n, rates)
        fwd, bwd = fwd + f, bwd + dg + wg
        if kind == "column":
            wgrad_col.append((dg, wg))
    att_f, att_b = _attention_core_s(model, training, plan, rates)
    elem_f = tokens * _elementwise_bytes_per_token(model, plan) / rates.hbm_bytes_per_s
    fwd, bwd = fwd + att_f + elem_f, bwd + att_b + 2 * elem_f
    recompute = {"none": 0.0, "selective": att_f, "full": fwd}[plan.recompute]

    tp_group = axis_span(plan, "tp", hw.gpus_per_node, order)
    e = act_bytes(training)
    buf = tokens * model.hidden_size * e
    c = contention(hw)
    if plan.sequence_parallel:
        ag = comm.collective_time_s("all_gather", buf, tp_group, hw)
        rs = comm.collective_time_s("reduce_scatter", buf, tp_group, hw)
        tp_fwd = 2 * (ag + rs)
        # backward: AG conjugates of the forward RS are exposed; the input re-gather overlaps the
        # data-grad GEMM and the input-grad RS overlaps the weight-grad GEMM (Megatron layers.py)
        tp_bwd = 2 * ag + sum(overlapped_s(ag, dg, c) + overlapped_s(rs, wg, c) for dg, wg in wgrad_col)
    else:
        ar = comm.collective_time_s("all_reduce", buf, tp_group, hw)
        tp_fwd = 2 * ar
        tp_bwd = sum(overlapped_s(ar, wg, c) for _, wg in wgrad_col)
    if plan.recompute == "full":
        tp_bwd += tp_fwd  # the recomputed forward repeats its collectives

    cp_time = 0.0
    if plan.cp > 1:  # ring exchange of K and V, overlapped with the attention core (context_parallel.md)
        cp_group = axis_span(plan, "cp", hw.gpus_per_node, order)
        kv_bytes = 2 * tokens * kv_heads_per_rank(model, plan.tp) * model.kv_channels * e
        step = comm.p2p_time_s(kv_bytes, not cp_group.intra_node, hw)
        exchange = (plan.cp - 1) * step
        cp_time = overlapped_s(exchange, att_f, c) + overlapped_s(2 * exchange, att_b, c)
    return LayerTime(fwd_compute=fwd, bwd_compute=bwd, recompute=recompute, tp_fwd=tp_fwd, tp_bwd=tp_bwd, cp=cp_time)


def _head_time_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, order: str) -> tuple[float, float]:
    """(compute, tp comm) of the output layer and cross entropy on the last stage, per micro-batch."""
    rates = Rates.of(hw, training.precision)
    tokens = plan.micro_batch_size * training.seq_len / plan.cp
    v_r = padded_vocab_size(model.vocab_size, plan.tp) / plan.tp
    f, dg, wg = gemm_fwd_bwd_s(tokens, model.hidden_size, v_r, rates)
    ce = tokens * v_r * (2 + 4 + 4 + 4 + 4 + 2) / rates.hbm_bytes_per_s  # bf16 logits -> fp32 softmax -> grad -> bf16
    tp_group = axis_span(plan, "tp", hw.gpus_per_node, order)
    kind = "reduce_scatter" if plan.sequence_parallel else "all_reduce"
    tp = comm.collective_time_s(kind, tokens * model.hidden_size * act_bytes(training), tp_group, hw)
    return f + dg + wg + ce, overlapped_s(tp, wg, contention(hw))


@dataclass(frozen=True)
class StageTime:
    """Per-micro-batch seconds of one pipeline stage, by term."""

    stage: int
    compute: float
    recompute: float
    tp_comm: float
    cp_comm: float
    pp_comm: float
    fwd: float  # forward part (compute + its TP/P2P), for the timeline
    bwd: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.cp_comm + self.pp_comm


@dataclass(frozen=True)
class TimeEstimate:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    breakdown: dict
    stages: tuple[StageTime, ...]
    dp_comm_s: float

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "hfu": self.hfu,
                "breakdown": dict(self.breakdown)}


def p2p_hop_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, crosses_nodes: bool,
              tp_group) -> float:
    """One activation (or its gradient) from one stage to the next (Narayanan 2021 section 4.1).

    With SP, or Megatron's scatter/gather optimisation without it, each TP rank sends its 1/t
    shard; without SP the receiving stage re-assembles it with an all-gather over NVLink.
    """
    tokens = plan.micro_batch_size * training.seq_len / plan.cp
    msg = tokens * model.hidden_size * act_bytes(training) / plan.tp
    hop = comm.p2p_time_s(msg, crosses_nodes, hw)
    if not plan.sequence_parallel and plan.tp > 1:
        hop += comm.collective_time_s("all_gather", msg * plan.tp, tp_group, hw)
    return hop


def stage_times(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                order: str = DEFAULT_ORDER) -> tuple[StageTime, ...]:
    """Per-micro-batch time of every stage; uneven stages are costed from their own layer counts."""
    lt = layer_time(model, hw, training, plan, order)
    head_compute, head_tp = _head_time_s(model, hw, training, plan, order)
    hop = p2p_hop_s(model, hw, training, plan, pp_hop_crosses_nodes(plan, hw.gpus_per_node, order),
                    axis_span(plan, "tp", hw.gpus_per_node, order))
    out = []
    for r, n in enumerate(plan.stage_layers(model.num_layers)):
        last = r == plan.pp - 1
        hc, ht = (head_compute, head_tp) if last else (0.0, 0.0)
        # each chunk boundary costs one receive forward and one backward (batched with the sends)
        pp = 2 * plan.vpp * hop if plan.pp > 1 else 0.0
        fwd_share = lt.fwd_compute / (lt.fwd_compute + lt.bwd_compute)
        out.append(StageTime(
            stage=r, compute=n * (lt.fwd_compute + lt.bwd_compute) + hc, recompute=n * lt.recompute,
            tp_comm=n * lt.tp + ht, cp_comm=n * lt.cp, pp_comm=pp,
            fwd=n * (lt.fwd_compute + lt.tp_fwd) + hc * fwd_share + pp / 2,
            bwd=n * (lt.bwd_compute + lt.recompute + lt.tp_bwd + lt.cp) + hc * (1 - fwd_share) + ht + pp / 2))
    return tuple(out)


def dp_sync_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, stage: int, layers: int,
              order: str = DEFAULT_ORDER) -> float:
    """Gradient synchronisation of one stage over its DP x CP group (formulas.md C4)."""
    shards = plan.dp * plan.cp
    if shards == 1:
        return 0.0
    group = axis_span(plan.model_copy(update={"dp": shards, "cp": 1}), "dp", hw.gpus_per_node, order)
    params = stage_params_per_rank(model, plan, stage, layers)
    g = params * grad_bytes(training)
    if plan.zero_stage == 0:
        return comm.collective_time_s("all_reduce", g, group, hw)
    # reduce-scatter the gradients, all-gather the updated bf16 weights (distributed optimizer)
    return comm.collective_time_s("reduce_scatter", g, group, hw) + \
        comm.collective_time_s("all_gather", params * param_bytes(training)[0], group, hw)


def zero3_gather_s(model: ModelSpec, hw: HardwareSpec, plan: Plan, stage: int, layers: int,
                   order: str = DEFAULT_ORDER, weight_bytes: int = ACT_BYTES) -> float:
    """ZeRO-3 / FSDP: all-gather the stage's weights in forward and again in backward, per micro-batch."""
    if plan.zero_stage < 3 or plan.dp * plan.cp == 1:
        return 0.0
    group = axis_span(plan.model_copy(update={"dp": plan.dp * plan.cp, "cp": 1}), "dp", hw.gpus_per_node, order)
    params = stage_params_per_rank(model, plan, stage, layers)
    return 2 * comm.collective_time_s("all_gather", params * weight_bytes, group, hw)


def estimate_time(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                  order: str = DEFAULT_ORDER) -> TimeEstimate:
    """Step time and its breakdown (module docstring)."""
    m = training.global_batch_size // (plan.micro_batch_size * plan.dp)
    p, v = plan.pp, plan.vpp
    stages = stage_times(model, hw, training, plan, order)
    layers = plan.stage_layers(model.num_layers)
    # ZeRO-3 gathers overlap the micro-batch's compute (prefetch); what does not fit is exposed
    c = contention(hw)
    z3 = [overlapped_s(zero3_gather_s(model, hw, plan, r, n, order, param_bytes(training)[0]), st.compute, c)
          for r, (st, n) in enumerate(zip(stages, layers))]
    per_mb = [st.total + z for st, z in zip(stages, z3)]
    pace = max(range(p), key=lambda r: per_mb[r])
    bubble = (p - 1) * (sum(per_mb) / p) / v
    dp = [dp_sync_s(model, hw, training, plan, r, n, order) for r, n in enumerate(layers)]
    if training.overlap_grad_reduce:
        # stage r's last backward ends r backward-steps before stage 0's: it hides under that drain
        exposed = [overlapped_s(dp[r], stages[r].bwd + sum(stages[j].bwd for j in range(r)), c) for r in range(p)]
    else:
        exposed = dp
    dp_exposed = max(exposed)
    opt_shards = plan.dp * plan.cp if plan.zero_stage >= 1 else 1
    params = [stage_params_per_rank(model, plan, r, n) for r, n in enumerate(layers)]
    rates = Rates.of(hw, training.precision)
    optimizer = max(params) / opt_shards * ADAM_BYTES_PER_PARAM / rates.hbm_bytes_per_s
    sp_ = stages[pace]
    breakdown = {
        "compute": m * sp_.compute, "recompute": m * sp_.recompute, "tp_comm": m * sp_.tp_comm,
        "cp_comm": m * sp_.cp_comm, "pp_comm": m * sp_.pp_comm, "bubble": bubble,
        "dp_comm_exposed": dp_exposed + m * z3[pace], "optimizer": optimizer,
    }
    step = sum(breakdown.values())
    tokens = training.global_batch_size * training.seq_len
    mf = flops.model_flops_per_step(model, training.global_batch_size, training.seq_len)
    hf = flops.hardware_flops_per_step(model, training.global_batch_size, training.seq_len, plan.recompute)
    peak = hw.peak_flops(training.precision)
    n = training.num_gpus
    return TimeEstimate(step_time_s=step, tokens_per_s=tokens / step, tflops_per_gpu=mf / step / n / 1e12,
                        mfu=flops.mfu(mf, step, n, peak), hfu=flops.hfu(hf, step, n, peak), breakdown=breakdown,
                        stages=stages, dp_comm_s=max(dp))


def estimate_scenario_time(sc: Scenario, order: str = DEFAULT_ORDER) -> TimeEstimate:
    return estimate_time(sc.model, sc.hardware, sc.training, sc.plan, order)
