"""Step time of a plan: per-stage compute and communication, pipeline schedule, DP sync, optimizer.

The model (docs/cost-model.md):

* **GEMMs** run at the maximum achievable matmul rate (MAMF, ``gemm_efficiency_max`` x peak),
  reduced by **tile and wave quantisation**: the output is cut into 256 x 128 (or 128 x 256)
  tiles, one per SM at a time, so a GEMM takes ``ceil(tiles / SMs)`` full waves (NVIDIA "Matrix
  Multiplication Background User's Guide", sections on tile and wave quantisation). A GEMM is
  also never faster than its HBM traffic (roofline), and each costs ``kernel_overhead_us``. So
  TP's thinner slices and short sequences run less efficiently. Backward = data grad + weight
  grad, each with its own shape. FP8 GEMMs reach the measured FP8 MAMF (or the FP8/BF16 ratio,
  ``FP8_MAMF_RATIO``), block-scaled ones TE's measured ratio to FP8 (``BLOCK_SCALED_OVER_FP8``), and each
  GEMM input and output gradient pays TE's measured quantisation (``_fp8_cast_bytes_per_token``).
* **Attention**: fused attention at ``attention_efficiency`` of peak times the measured speed of
  the kernel at this sequence length, forward and backward separately (``attention_shape``,
  H200 measurement and FlashAttention-3 paper), and its wave quantisation; backward FLOPs 2.5x
  forward (5 GEMMs against 2, Dao 2023, arXiv:2307.08691). Under CP, ring attention
  (:func:`ring_attention`). Materialised attention is two batched GEMMs plus the fused softmax and
  dropout, which are memory-bound.
* **Memory-bound operations** (norms, bias-dropout-add, activation function, RoPE, cross-entropy)
  move their bytes at ``hbm_bandwidth * hbm_efficiency``; backward moves twice the bytes; never
  faster than their kernel launches.
* **TP communication** (Shoeybi 2019 section 3; Korthikanti 2022 section 4.2.2; formulas.md C2):
  2 all-reduces forward and 2 backward per layer, or with SP 2 all-gathers + 2 reduce-scatters
  each way plus the wgrad re-gather. The column-parallel input-gradient collectives overlap the
  weight-gradient GEMM, as Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` does.
  With ``tp_comm_overlap`` (Megatron ``--tp-comm-overlap``) the forward collectives and the
  row-parallel backward all-gathers overlap their GEMMs too (:func:`resolved_overlap`).
* **Pipeline** (Narayanan 2021 section 2.2): ``T = m * X_max + (p - 1) * X_mean / v``. ``X`` is the
  per-micro-batch forward + backward time of a stage (its P2P transfers included). So the
  slowest stage paces the steady state and the bubble is ``(p - 1) / v`` stage-times (the
  "ratio to ideal" form of contradiction 9, as a time). Interleaved P2P overlaps the chunks'
  compute with ``overlap_p2p_comm``. Written once, vectorised: :func:`stage_terms` and
  :func:`compose_step`, which ``planner.search`` uses too. The zero-bubble schedules
  (``Plan.pipeline_schedule``, docs/schedules.md) take their bubble from their action lists
  (:func:`schedule_bubble_s`) with the forward, weight-gradient and rest-of-backward time per chunk.
* **DP**: all-reduce (or reduce-scatter + all-gather with ZeRO 1-2) of each stage's gradients. With
  ``overlap_grad_reduce`` the reduction is hidden under the last micro-batch's backward of that
  stage and under the pipeline drain behind it, the weight all-gather under the next step's first
  forward (Megatron ``--overlap-grad-reduce`` / ``--overlap-param-gather``, formulas.md C4). Frameworks
  that keep the gradients sharded across micro-batches (Megatron-FSDP, DeepSpeed ZeRO-2/3, FSDP2 without PP)
  reduce them in every micro-batch's backward instead (:func:`grad_reduced_every_microbatch`), each
  overlapped with that backward (:func:`compose_step`).
* **Optimizer**: Adam is memory-bound, 42 B moved per parameter of the local shard (``ADAM_BYTES_PER_PARAM``).
* **Mixture of experts** (docs/moe.md): a stage is ``n - n_moe`` dense layers plus ``n_moe`` MoE layers
  (``Plan.stage_moe_layers``). A MoE layer is the attention (MLA: its five projections), the shared
  experts as an ordinary TP MLP, and :func:`moe_layer_extra`: the router, the routed experts as one
  grouped GEMM per matrix at the per-expert token count (the same tile-and-wave rate model), the token
  permutation, the dispatch/combine all-to-all over the EP group's link tier (or DeepEP), the expert-TP
  collectives; exposed unless ``moe_a2a_overlap``; a load-imbalance factor on the expert work. Expert
  gradients are reduced over the expert-data-parallel group (:func:`dp_sync_parts_s`). MFU counts the
  activated FLOPs (``planner.flops``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from planner import comm, flops, frameworks
from planner.frameworks import deepspeed as deepspeed_framework
from planner.layout import DEFAULT_ORDER, axis_span, expert_span, partial_dp_spans, pp_hop_crosses_nodes
from planner.memory import (LINEAR_INPUT_BYTES, linear_input_key, a2a_overlap_active, act_bytes, grad_bytes, kv_heads_per_rank, layer_param_split, param_bytes,  # noqa: F401
                            moe_routed_shares, moe_row_scale, router_dtype_bytes, stage_param_split)
from planner.specs import (FLASH_ATTENTION, FLEX_DISPATCHERS, HardwareSpec, ModelSpec, Plan, Scenario, TrainingSpec, padded_vocab_size,
                           plan_microbatches)

ACT_BYTES = 2
FLASH_BWD_OVER_FWD = 2.5  # FlashAttention-2 backward runs 5 GEMMs to the forward's 2 (Dao 2023)
# Megatron's optimizer step per parameter of the local shard: grad-norm read 4, Adam (read grad,
# master, m, v; write master, m, v) 28, fp32 master -> bf16 weight copy 6, zeroing the grad buffer 4
ADAM_BYTES_PER_PARAM = 42
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_comm_exposed", "optimizer")


TILES = ((256, 128), (128, 256))  # large CTA tiles of cuBLAS/CUTLASS bf16 GEMMs

# FP8 GEMMs do not reach twice the BF16 rate: best FP8 (torch._scaled_mm, e4m3) 1,414 TFLOP/s against
# best BF16 808 TFLOP/s over the same 384 Megatron-layer shapes, measured on one H200 SXM (132 SMs),
# torch 2.11.0+cu130, 2026-11-30 (benchmarks/data/h200_kernels.json, measured by benchmarks/gpu_kernels.py).
# Consistent with H800 TileLang FP8 1,460-1,540 TFLOP/s (docs/cost-model.md). Used when a profile
# gives no fp8_gemm_efficiency_max.
FP8_MAMF_RATIO = 1414.0 / 808.0

# Fused attention speed by sequence length (TFLOP/s), causal, BF16, head dim 128, 32 query / 8 KV
# heads, cuDNN backend of F.scaled_dot_product_attention (Transformer Engine's default on Hopper),
# batch x seqlen = 16k: measured on one H200 SXM (132 SMs, the H100 SXM's SMs and clocks), torch
# 2.11.0+cu130, 2026-11-30 (benchmarks/data/h200_kernels.json).
# Forward and backward separately; FLOPs as FlashAttention counts them (backward = 2.5 x forward,
# causal halved). The 512 row and the non-causal rows are [derived] from Shah et al. 2024,
# "FlashAttention-3", arXiv:2407.08608, Figure 5(b)/(e), cuDNN bars on H100: 512 = 1k x (the
# paper's 512/1k ratio); non-causal = causal x (the paper's non-causal/causal forward ratio at that
# length, the 16k ratio at 32k). Only the *shape* is used (``attention_shape``): the hardware
# profile's ``attention_efficiency`` sets the level (causal forward at 16k).
ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192, 16384, 32768)
_FA3_CAUSAL_FWD = (315.0, 410.0, 484.0, 518.0, 529.0, 539.0, 539.0)
_FA3_NONCAUSAL_FWD = (497.0, 574.0, 617.0, 609.0, 600.0, 595.0, 595.0)
_H200_CAUSAL = {"fwd": (469.6, 557.6, 608.0, 638.9, 652.8, 607.0), "bwd": (269.9, 375.1, 465.6, 480.9, 506.6, 524.3)}
# The same kernel, heads and batch x seqlen at head dim 64 (the same H200 run, benchmarks/data/h200_kernels.json,
# cudnn rows with head_dim 64, 32 query / 8 KV heads): 0.70-0.75x the head-dim-128 speed forward, 0.77-0.84x
# backward (consistent with half the tensor-core work per score at d 64 beside an unchanged softmax per score:
# max, exp, sum, rescale). Its 512 and non-causal rows are derived as the head-dim-128 ones are (the FA3 paper's
# ratios, measured at 128). GPT-OSS (d 64) and GPT-NeoX-20B (d 96, interpolated) run between the two.
_H200_CAUSAL_D64 = {"fwd": (328.3, 391.5, 430.4, 451.7, 468.9, 457.2), "bwd": (209.3, 293.0, 358.1, 405.0, 419.8, 425.6)}
# FlashAttention-2, the kernel of F.scaled_dot_product_attention's flash backend (torch ships FlashAttention-2), in the
# same H200 run, shapes and FLOP count as the cuDNN rows above (benchmarks/data/h200_kernels.json, backend "flash",
# 32 query / 8 KV heads, head dim 128 and 64). FlashAttention-2 has no Hopper path (no wgmma/TMA: Shah et al. 2024,
# arXiv:2407.08608, section 1), so on Hopper it reaches 0.49-0.68x the cuDNN forward and 0.54-0.66x the backward;
# where a job runs it (``TrainingSpec.attention`` "flash2") on a GPU whose profile level is a faster kernel
# (``HardwareSpec.attention_beyond_fa2``) the speed comes from these rows. Its 512 and non-causal rows are derived as
# the cuDNN ones are.
_H200_FA2_CAUSAL = {"fwd": (261.4, 286.7, 307.2, 315.1, 336.8, 350.1), "bwd": (150.8, 201.0, 251.5, 285.8, 307.8, 317.1)}
_H200_FA2_CAUSAL_D64 = {"fwd": (215.6, 260.8, 281.4, 280.9, 286.0, 310.7),
                        "bwd": (133.3, 180.7, 217.1, 247.2, 271.5, 280.4)}
# The same measurements on one H100 SXM (NVIDIA H100 80GB HBM3, 132 SMs, 700 W), torch 2.11.0+cu130, 2026-12-05,
# by the same script: each entry the median of three runs in two leases (benchmarks/data/h100_kernels.json and the
# two runs of benchmarks/data/h100_attention_repeat.json; run-to-run spread, max - min over the median: 2 % median,
# within 5 % for 37 of the 48 entries, 9-15 % for five of them, all cuDNN at 4k-16k).
# Forward as the H200 within 4 % (the same GH100 die, clocks and SMs); the backward 13-14 % slower at 1k and 8-12 %
# at 2k in each of the three runs (the H200's HBM3e moves 4.8 against 3.35 TB/s; gpu_kernels.py's 1 GiB copy: 4,222
# against 3,009 GB/s), and within the run-to-run spread from 4k on.
_H100_CAUSAL = {"fwd": (469.9, 540.8, 605.5, 640.9, 631.0, 608.0),
                "bwd": (233.3, 339.3, 421.8, 446.1, 507.7, 525.4)}
_H100_CAUSAL_D64 = {"fwd": (334.7, 385.8, 429.9, 463.9, 468.3, 446.1),
                    "bwd": (189.2, 273.1, 348.3, 391.0, 403.6, 406.4)}
_H100_FA2_CAUSAL = {"fwd": (265.2, 288.7, 293.3, 309.7, 332.8, 346.6),
                    "bwd": (141.9, 194.5, 248.6, 290.3, 312.3, 312.9)}
_H100_FA2_CAUSAL_D64 = {"fwd": (213.1, 262.4, 279.9, 282.7, 296.2, 307.3),
                        "bwd": (127.5, 175.1, 215.2, 244.7, 272.1, 283.7)}
#: Head dims of the measured attention tables; between them the speed is interpolated in log2(d), outside them the
#: nearest table is used (wider heads, e.g. MLA's 192, keep the head-dim-128 speed: nothing wider was measured).
ATTENTION_HEAD_DIMS = (64, 128)
#: The measured attention tables by GPU (``HardwareSpec.attention_table`` picks one): for each, the fused kernel's and
#: FlashAttention-2's speeds by (pass, causal, head dim) over ATTENTION_SEQ. All are read relative to one reference,
#: the H200's fused causal forward at 16k (ATTENTION_REFERENCE, what attention_efficiency means), so a GPU's own
#: table carries its measured difference from the H200 cell by cell (not a renormalised shape: the H100's own 16k
#: forward cell is the noisiest of its table). GPUs without their own measurement use the H200's (the profile says).
ATTENTION_TABLES: dict[str, dict] = {}
for _gpu, _fused, _fa2 in (("h200", ((128, _H200_CAUSAL), (64, _H200_CAUSAL_D64)),
                            ((128, _H200_FA2_CAUSAL), (64, _H200_FA2_CAUSAL_D64))),
                           ("h100", ((128, _H100_CAUSAL), (64, _H100_CAUSAL_D64)),
                            ((128, _H100_FA2_CAUSAL), (64, _H100_FA2_CAUSAL_D64)))):
    _entry = ATTENTION_TABLES[_gpu] = {"fused": {}, "fa2": {}}
    for _kernel, _tables in (("fused", _fused), ("fa2", _fa2)):
        for _d, _table in _tables:
            for _pass, _row in _table.items():
                _causal = (_row[0] * _FA3_CAUSAL_FWD[0] / _FA3_CAUSAL_FWD[1], *_row)
                _entry[_kernel][(_pass, True, _d)] = _causal
                _entry[_kernel][(_pass, False, _d)] = tuple(c * n / k for c, n, k
                                                            in zip(_causal, _FA3_NONCAUSAL_FWD, _FA3_CAUSAL_FWD))
# the H200's fused causal forward at 16k, head dim 128: what attention_efficiency means
ATTENTION_REFERENCE = ATTENTION_TABLES["h200"]["fused"][("fwd", True, 128)][5]


def _attention_row_speed(row: tuple, kv_len: float) -> float:
    x = math.log2(min(max(kv_len, ATTENTION_SEQ[0]), ATTENTION_SEQ[-1]))
    i = min(int(x) - 9, len(ATTENTION_SEQ) - 2)
    lo, hi = row[i], row[i + 1]
    return lo + (hi - lo) * (x - math.log2(ATTENTION_SEQ[i]))


def attention_shape(kv_len: float, causal: bool, pass_: str, head_dim: float = 128, kernel: str = "fused",
                    table: str = "h200") -> float:
    """Speed of a fused attention kernel over ``kv_len`` keys on the GPU of ``table`` (``ATTENTION_TABLES``: "h200" or
    "h100", measured on each) relative to the H200's fused (cuDNN) causal forward at 16k, head dim 128
    (``ATTENTION_REFERENCE``).
    ``kernel``: "fused" (cuDNN, Transformer Engine's default on Hopper, the level each profile's
    ``attention_efficiency`` states) or "fa2" (FlashAttention-2's own rows, so its speed comes out relative to the
    same cuDNN reference).

    Linear in log2(length) between the rows of the table (the GPU's measurement, above, and the
    FlashAttention-3 paper for 512 and the non-causal rows); outside 512-32k the end row is used (the lookup says so
    via :func:`attention_in_table`). Short sequences run slower: fewer key blocks per query tile to
    hide the softmax and the prologue behind. ``head_dim`` (the query/key head width): the measured
    head-dim-64 and -128 tables (``ATTENTION_HEAD_DIMS``), linear in log2(d) between them, the nearest
    outside them.
    """
    lo_d, hi_d = ATTENTION_HEAD_DIMS
    d = min(max(head_dim, lo_d), hi_d)
    rows = ATTENTION_TABLES[table][kernel]
    hi = _attention_row_speed(rows[(pass_, causal, hi_d)], kv_len)
    lo = _attention_row_speed(rows[(pass_, causal, lo_d)], kv_len)
    w = math.log2(d / lo_d) / math.log2(hi_d / lo_d)
    return (lo + (hi - lo) * w) / ATTENTION_REFERENCE


ATTENTION_BLOCK_M = 128  # query rows per thread block, head dim 128 (FlashAttention-3 paper section 3.3 / 4.1)
ATTENTION_BENCH_TILES = 16384 // ATTENTION_BLOCK_M * 32  # the table's runs: batch x seqlen = 16k, 32 heads


def attention_wave_factor(q_len: float, heads: float, sm_count: int) -> float:
    """Share of the table's speed a kernel keeps once its query tiles are cut into waves.

    A fused attention kernel runs one thread block per (batch x head, 128-query tile) and
    ``ceil(tiles / SMs)`` waves of them (wave quantisation, as for GEMMs in NVIDIA's "Matrix
    Multiplication Background User's Guide"). Relative to the table's own runs (16k query rows x
    32 heads); short CP chunks with few heads per TP rank leave SMs idle.
    """
    def busy(tiles: float) -> float:
        return tiles / (math.ceil(tiles / sm_count) * sm_count)
    tiles = max(1.0, math.ceil(q_len / ATTENTION_BLOCK_M) * heads)
    return min(1.0, busy(tiles) / busy(ATTENTION_BENCH_TILES))


def attention_in_table(kv_len: float) -> bool:
    """Whether a key length lies inside the measured attention table (512-32k)."""
    return ATTENTION_SEQ[0] <= kv_len <= ATTENTION_SEQ[-1]


@dataclass(frozen=True)
class Rates:
    """The hardware figures the cost model uses, in base units (FLOP/s, bytes/s, seconds)."""

    gemm_flops: float
    sm_count: int
    gemm_overhead_s: float
    attention_flops: float
    hbm_bytes_per_s: float
    attention_bwd_flops: float = 0.0  # the backward kernels' level; 0: as the forward's
    attention_kernel: str = "fused"  # whose measured table shapes the attention speed (attention_shape)
    attention_table: str = "h200"  # on which GPU that table was measured (ATTENTION_TABLES)

    def attention_rate(self, pass_: str) -> float:
        """FLOP/s level of the fused attention kernel in one pass (``attention_shape`` sets its shape)."""
        return self.attention_bwd_flops if pass_ == "bwd" and self.attention_bwd_flops else self.attention_flops

    @classmethod
    def of(cls, hw: HardwareSpec, precision: str, attention: str = "flash") -> Rates:
        """``attention``: the job's kernel (``TrainingSpec.attention``); "flash2" takes FlashAttention-2's table
        where the profile's level is a faster kernel's (``HardwareSpec.attention_beyond_fa2``), else the fused
        one's shape applies."""
        sustained = hw.sustained_fraction
        kernel = "fa2" if attention == "flash2" and hw.attention_beyond_fa2 else "fused"
        if precision in LOW_PRECISIONS:
            # fp8: the measured FP8 MAMF, or the FP8/BF16 ratio measured on an H200 (FP8_MAMF_RATIO); mxfp8 and
            # nvfp4: that FP8 rate times TE's measured block-scaled/FP8 kernel ratio (BLOCK_SCALED_OVER_FP8), never
            # above the datasheets' own ratio
            mamf = hw.fp8_gemm_efficiency_max or hw.gemm_efficiency_max * FP8_MAMF_RATIO / 2
            gemm_flops = hw.peak_flops("fp8") * mamf * sustained
            if precision in BLOCK_SCALED_OVER_FP8:
                gemm_flops *= min(BLOCK_SCALED_OVER_FP8[precision], hw.peak_flops(precision) / hw.peak_flops("fp8"))
        else:
            gemm_flops = hw.peak_flops(precision) * hw.gemm_efficiency_max * sustained
        return cls(gemm_flops=gemm_flops, sm_count=hw.sm_count,
                   gemm_overhead_s=hw.kernel_overhead_us * 1e-6,
                   attention_flops=hw.peak_flops("bf16") * hw.attention_efficiency * sustained,
                   hbm_bytes_per_s=hw.hbm_bandwidth_gbps * 1e9 * hw.hbm_efficiency,
                   attention_bwd_flops=hw.peak_flops("bf16") * (hw.attention_bwd_efficiency
                                                                 or hw.attention_efficiency) * sustained,
                   attention_kernel=kernel, attention_table=hw.attention_table)


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


def gemm_fwd_bwd_s(m: float, k: float, n: float, rates: Rates, batch: float = 1.0,
                   streams: int = 0) -> tuple[float, float, float]:
    """(forward, data-grad, weight-grad) times of a linear layer ``[m, k] -> [m, n]``; ``batch`` such
    layers in one grouped GEMM (the local experts of a MoE layer, each with its own weights), run as
    :func:`grouped_gemm_time_s` says (``streams``)."""
    if batch == 1.0:
        return gemm_time_s(m, k, n, rates), gemm_time_s(m, n, k, rates), gemm_time_s(k, m, n, rates)
    return (grouped_gemm_time_s(m, k, n, rates, batch, streams), grouped_gemm_time_s(m, n, k, rates, batch, streams),
            grouped_gemm_time_s(k, m, n, rates, batch, streams))


#: CUDA streams Transformer Engine's grouped GEMM spreads the per-expert GEMMs over: NVIDIA/TransformerEngine
#: transformer_engine/common/util/multi_stream.cpp ``get_num_compute_streams`` (``static constexpr int
#: num_compute_streams = 4``), read by ``multi_stream_cublas_gemm`` in common/gemm/cublaslt_gemm.cu.
TE_GROUPED_GEMM_STREAMS = 4


def grouped_gemm_time_s(m: float, k: float, n: float, rates: Rates, gemms: float, streams: int = 0) -> float:
    """``gemms`` GEMMs ``[m, k] x [k, n]``, each with its own weights (the local experts of a MoE layer).

    ``streams = 0``: one grouped kernel over all of them (``torch._grouped_mm``, torchtitan): :func:`gemm_time_s`
    with ``batch = gemms``, one kernel's fixed cost, the tiles of all the GEMMs sharing the waves.

    ``streams > 0``: Transformer Engine's ``GroupedLinear`` (Megatron-Core's ``TEGroupedMLP``,
    ``--moe-grouped-gemm``), whose ``general_grouped_gemm`` (pytorch/cpp_extensions/gemm.py) reaches
    ``nvte_multi_tensor_gemm`` -> ``multi_stream_cublas_gemm`` (NVIDIA/TransformerEngine
    transformer_engine/common/gemm/cublaslt_gemm.cu; the path since PR #853 "Grouped GEMM via multi-stream
    cuBLAS", TE 1.7, and still the default in TE 2.x: the CUTLASS grouped kernel only with
    ``NVTE_USE_CUTLASS_GROUPED_GEMM`` on Hopper): ``for i in range(num_gemms): nvte_cublas_gemm_v2(...,
    get_compute_stream(i % num_streams))``. So each expert's GEMM is its own cuBLAS kernel, with its own fixed
    cost and its own tiles, and the kernels go round-robin to ``streams`` streams, where at most ``streams`` run
    side by side: ``ceil(gemms / streams)`` rounds, each as many waves as the tiles of its concurrent kernels fill
    (``ceil(s * tiles / SMs)``) and one kernel's fixed cost (the streams pay theirs side by side). HBM traffic as
    for one grouped kernel."""
    if streams <= 0 or gemms <= 1:
        return gemm_time_s(m, k, n, rates, gemms)
    g = math.ceil(gemms)
    s = min(streams, g)
    full, rest = divmod(g, s)
    flops = full * _waves_flops(m, k, n, s, rates.sm_count) + (_waves_flops(m, k, n, rest, rates.sm_count) if rest
                                                               else 0.0)
    moved = ACT_BYTES * (m * k + k * n + m * n) * gemms
    rounds = full + (1 if rest else 0)
    return max(flops / rates.gemm_flops, moved / rates.hbm_bytes_per_s) + rounds * rates.gemm_overhead_s


@dataclass(frozen=True)
class Overlap:
    """Which communications the framework overlaps with compute, once ``None`` fields are resolved."""

    tp_comm_overlap: bool
    overlap_p2p_comm: bool


# Each framework's default for the overlap switches that TrainingSpec leaves as None. Keyed by
# ``TrainingSpec.framework`` in one place so that framework profiles can remap it.
FRAMEWORK_OVERLAP_DEFAULTS = {
    # Megatron-Core v0.16.1: ModelParallelConfig.tp_comm_overlap = False (--tp-comm-overlap turns it
    # on, and needs SP); --no-overlap-p2p-communication (dest overlap_p2p_comm) is on by default and
    # kept only with the interleaved schedule (megatron/training/arguments.py).
    "megatron": Overlap(tp_comm_overlap=False, overlap_p2p_comm=True),
    # NeMo 2.0 / Megatron-Bridge performance recipes attach MegatronCommOverlapCallback(tp_comm_overlap=True)
    # with Transformer Engine userbuffers configs for TP > 1 (e.g. userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192
    # for Llama-3-70B on H100, megatron.bridge.training.comm_overlap); Megatron-Core underneath.
    "nemo": Overlap(tp_comm_overlap=True, overlap_p2p_comm=True),
    # torchtitan: async TP is off unless --parallelism.enable_async_tensor_parallel; torch.distributed
    # .pipelining's schedules wait for each chunk's receive before computing it (charged in full).
    "torch": Overlap(tp_comm_overlap=False, overlap_p2p_comm=False),
    "torchtitan": Overlap(tp_comm_overlap=False, overlap_p2p_comm=False),
    # Megatron-DeepSpeed: no TP/GEMM overlap, no interleaved schedule
    "deepspeed": Overlap(tp_comm_overlap=False, overlap_p2p_comm=False),
}


def framework_defaults(framework: str) -> Overlap:
    """The overlap defaults of ``framework`` (``TrainingSpec.framework``); unknown names get Megatron's."""
    return FRAMEWORK_OVERLAP_DEFAULTS.get(framework, FRAMEWORK_OVERLAP_DEFAULTS["megatron"])


def resolved_overlap(training: TrainingSpec) -> Overlap:
    """The training spec's overlap switches, ``None`` replaced by the framework's default.

    NVFP4 under NeMo: the Megatron-Bridge performance recipes turn TP communication overlap off for it on
    every GPU ("tp_comm_overlap = False if precision == 'nvfp4'", scripts/performance/configs/llama/
    llama3_llm_pretrain.py and llama31_llm_pretrain.py), so the nemo default follows.
    """
    base = framework_defaults(training.framework)
    if training.framework == "nemo" and training.precision == "nvfp4":
        base = Overlap(tp_comm_overlap=False, overlap_p2p_comm=base.overlap_p2p_comm)
    tp = base.tp_comm_overlap if training.tp_comm_overlap is None else training.tp_comm_overlap
    p2p = base.overlap_p2p_comm if training.overlap_p2p_comm is None else training.overlap_p2p_comm
    return Overlap(tp_comm_overlap=tp, overlap_p2p_comm=p2p)


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
    cp_fwd: float
    cp_bwd: float
    ep_fwd: float = 0.0  # MoE: token dispatch/combine all-to-all and expert-TP collectives
    ep_bwd: float = 0.0
    wgrad: float = 0.0  # the weight-gradient GEMMs inside bwd_compute (the zero-bubble schedules' W step)
    # MoE all-to-all overlap: the more a micro-batch that runs alone exposes (MoEExtra.comm_alone; stage_terms applies
    # it in a2a_alone_share's share)
    ep_alone: float = 0.0

    @property
    def tp(self) -> float:
        return self.tp_fwd + self.tp_bwd

    @property
    def cp(self) -> float:
        return self.cp_fwd + self.cp_bwd

    @property
    def ep(self) -> float:
        return self.ep_fwd + self.ep_bwd


def _linear_shapes(model: ModelSpec, plan: Plan, moe: bool = False) -> dict[str, tuple[float, float, str]]:
    """(k, n, kind) of each linear layer on one TP rank; kind is column or row parallel, or inner (no TP
    collective of its own). Each column-parallel linear opens a TP region (one AG/RS pair with SP, one
    all-reduce without), so a dense layer has two.

    MLA (DeepSeek-V2 section 2.1; Megatron-Core ``multi_latent_attention.py``): the down-projections
    ``h -> r_q`` and ``h -> r_kv + d_rope`` are duplicated on every TP rank (``parallel_mode='duplicated'``),
    the up-projections column-parallel, the output projection row-parallel; the q down-projection
    stands for the region's entrance. A MoE layer (``moe``) keeps only the shared experts as an ordinary
    TP MLP (Megatron ``SharedExpertMLP``); the router and the routed experts are costed apart
    (:func:`moe_layer_extra`).
    """
    t, h, d = plan.tp, model.hidden_size, model.kv_channels
    if model.is_mla:
        a, rq, rkv = model.num_attention_heads, model.q_lora_rank, model.kv_lora_rank
        q_up, kv_up = a * model.qk_head_dim / t, a * (model.qk_nope_head_dim + model.v_head_dim) / t
        att = {"q_down": (h, rq, "column"), "q_up": (rq, q_up, "inner")} if rq else {"q": (h, q_up, "column")}
        att |= {"kv_down": (h, rkv + model.qk_rope_head_dim, "inner"), "kv_up": (rkv, kv_up, "inner"),
                "proj": (a * model.v_head_dim / t, h, "row")}
    else:
        q_r, kv_r = model.q_size / t, kv_heads_per_rank(model, t) * d
        att = {"qkv": (h, q_r + 2 * kv_r, "column"), "proj": (q_r, h, "row")}
    ffn = (model.shared_expert_ffn_hidden_size or 0) if moe else model.ffn_size
    if not ffn:
        return att
    fc1 = (2 if model.gated_mlp else 1) * ffn / t
    return att | {"fc1": (h, fc1, "column"), "fc2": (ffn / t, h, "row")}


def _attention_core_s(model: ModelSpec, training: TrainingSpec, plan: Plan, rates: Rates) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one layer per micro-batch, without CP.

    Flash: the causal FLOPs at the kernel's measured speed for this sequence length
    (:func:`attention_shape`), backward 2.5x the forward FLOPs (Dao 2023) at the backward speed;
    1 kernel forward, 3 backward (dO.O preprocessing, the main kernel, dQ conversion; FlashAttention-2
    ``flash_bwd_kernel`` launch sequence) at ``kernel_overhead_us`` each.

    Chunked layers (``model.chunked``, Llama 4) likewise: their chunk's FLOPs (:func:`flops.chunked_pairs`) at the
    speed of a causal kernel over the chunk.

    Sliding-window layers (``model.windowed_layers``): FlashAttention-2's local attention
    (``flash_attn_func(..., window_size=(w-1, 0))``, v2.3+) and cuDNN's sliding-window SDPA skip the key
    blocks wholly outside the window, so such a layer does its windowed FLOPs
    (:func:`flops.attention_flops_per_token_per_layer` with ``window``) at the speed the table gives a
    kernel whose queries each see ``min(s, w)`` keys. The per-layer time is the average over the model's
    layers (``flops.mean_attention_flops_per_token_per_layer``'s mix): every layer of a stage gets the same
    time, exact for a stage's sum when it holds whole periods of the pattern. Materialised attention
    computes the full masked ``s x s`` whatever the window, so it is unchanged.
    """
    t, b, s = plan.tp, plan.micro_batch_size, training.seq_len
    a_r, d = model.num_attention_heads / t, model.kv_channels
    if training.attention in FLASH_ATTENTION:
        d_qk = model.qk_head_dim  # the kernel's speed at this head width (attention_shape)
        wave = attention_wave_factor(s, b * a_r, rates.sm_count)
        rate_f, rate_b = rates.attention_rate("fwd") * wave, rates.attention_rate("bwd") * wave

        def core_s(window: int | None, chunk: int | None = None) -> tuple[float, float]:
            fwd_flops = b * flops.attention_flops_per_token_per_layer(model, s, causal=True, window=window,
                                                                      chunk=chunk) * s / t
            # keys one query sees: the kernel's speed (a chunk runs as a causal kernel over chunk-long blocks)
            span = min(s, window or s, chunk or s)
            k, g = rates.attention_kernel, rates.attention_table
            return (fwd_flops / (rate_f * attention_shape(span, True, "fwd", d_qk, k, g)),
                    FLASH_BWD_OVER_FWD * fwd_flops / (rate_b * attention_shape(span, True, "bwd", d_qk, k, g)))

        fwd, bwd = core_s(None)
        w_share, c_share = model.windowed_layers / model.num_layers, model.chunked / model.num_layers
        if w_share or c_share:
            w_fwd, w_bwd = core_s(model.sliding_window) if w_share else (0.0, 0.0)
            c_fwd, c_bwd = core_s(None, model.attention_chunk) if c_share else (0.0, 0.0)
            rest = 1 - w_share - c_share
            fwd = rest * fwd + w_share * w_fwd + c_share * c_fwd
            bwd = rest * bwd + w_share * w_bwd + c_share * c_bwd
        return fwd + rates.gemm_overhead_s, bwd + 3 * rates.gemm_overhead_s
    # materialised: QK^T and PV as batched GEMMs over a_r * b heads, full s x s (masked, not skipped)
    heads = a_r * b
    sq = s / plan.cp
    qk = gemm_time_s(sq, d, s, rates, batch=heads)
    pv = gemm_time_s(sq, s, d, rates, batch=heads)
    elements = heads * sq * s
    soft_fwd = elements * (ACT_BYTES * 2 + (5 if model.dropout else 0)) / rates.hbm_bytes_per_s
    soft_bwd = elements * (ACT_BYTES * 3 + (5 if model.dropout else 0)) / rates.hbm_bytes_per_s
    return qk + pv + soft_fwd, 2 * (qk + pv) + soft_bwd


# Ring attention's per-step output merge: read the step's bf16 output, read-modify-write the fp32
# accumulator (2 + 4 + 4 bytes per element), as Transformer Engine's AttnFuncWithCPAndKVP2P does
# (``flash_attn_fwd_out_correction``); backward accumulates dQ and dK/dV the same way.
RING_MERGE_BYTES = 10


@dataclass(frozen=True)
class RingAttention:
    """One layer's ring attention under CP, per micro-batch (seconds)."""

    fwd_compute: float  # the cp attention steps, their merges and launches
    bwd_compute: float
    fwd_exposed: float  # K/V exchange not hidden behind the step it overlaps (plus SM contention)
    bwd_exposed: float  # K/V exchange and the dK/dV return


def ring_attention(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                   order: str = DEFAULT_ORDER) -> RingAttention:
    """Context-parallel attention as Megatron-Core runs it (``--cp-comm-type p2p``, the default).

    Sources: Megatron-Core ``docs/user-guide/features/context_parallel.md`` (ring of P2P K/V
    exchanges overlapped with attention; load-balanced causal split into 2·cp chunks);
    Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889 (blockwise
    compute overlapped with the K/V rotation); Transformer Engine ``AttnFuncWithCPAndKVP2P``.

    Each rank holds ``s/cp`` tokens (two half-chunks). Step 0 is causal attention over the local
    chunk; steps 1..cp-1 are *non-causal* blocks of ``s/cp`` queries against ``s/(2cp)`` keys,
    so every step runs at the measured speed of that short kernel (:func:`attention_shape`).
    Forward: cp-1 K/V exchanges of ``2·b·(s/cp)·g_r·d_h`` bytes, each overlapped with one step.
    Backward: the K/V exchange again plus the dK/dV return, twice the bytes per step. Every step
    after the first merges its partial output (``RING_MERGE_BYTES``) and costs its kernel launches.

    Sliding-window and chunked layers are costed here as full causal ones (an over-estimate): Transformer Engine's
    p2p ring refuses a window (``attn_forward_func_with_cp`` asserts ``cp_comm_type`` in
    ``("a2a", "all_gather")`` for sliding-window attention, ``pytorch/attention/dot_product_attention/
    context_parallel.py``), and those CP variants are not modelled.
    """
    rates = Rates.of(hw, gemm_precision(training, hw), training.attention)
    cp, t, b = plan.cp, plan.tp, plan.micro_batch_size
    s_c = training.seq_len / cp
    a_r = model.num_attention_heads / t
    g_r, d = kv_heads_per_rank(model, t), model.kv_channels
    tokens = b * s_c
    # every step does the same FLOPs: 2·q·s_c² (causal s_c x s_c, or full s_c x s_c/2), per rank / t
    step_flops = b * 2.0 * model.q_size * s_c * s_c / t
    if model.is_mla:  # a * (d_qk + d_v) per query-key pair (flops.attention_flops_per_token_per_layer)
        step_flops = b * model.num_attention_heads * (model.qk_head_dim + model.v_dim) * s_c * s_c / t
    launch = rates.gemm_overhead_s
    heads, sm = b * a_r, rates.sm_count
    d_qk = model.qk_head_dim  # the kernel's speed at this head width (attention_shape)

    k, g = rates.attention_kernel, rates.attention_table

    def speed(pass_: str, causal: bool) -> float:
        if causal:  # step 0: the local chunk against itself
            return (rates.attention_rate(pass_) * attention_shape(s_c, True, pass_, d_qk, k, g)
                    * attention_wave_factor(s_c, heads, sm))
        # later steps: s_c queries x s_c/2 keys on half the ranks, s_c/2 x s_c on the others; the
        # ring is synchronous, so the slower of the two paces every step
        return rates.attention_rate(pass_) * min(
            attention_shape(s_c / 2, False, pass_, d_qk, k, g) * attention_wave_factor(s_c, heads, sm),
            attention_shape(s_c, False, pass_, d_qk, k, g) * attention_wave_factor(s_c / 2, heads, sm))

    f0 = step_flops / speed("fwd", True) + launch
    b0 = FLASH_BWD_OVER_FWD * step_flops / speed("bwd", True) + 3 * launch
    merge_f = tokens * a_r * d * RING_MERGE_BYTES / rates.hbm_bytes_per_s + launch
    merge_b = tokens * (a_r + 2 * g_r) * d * RING_MERGE_BYTES / rates.hbm_bytes_per_s + 2 * launch
    fi = step_flops / speed("fwd", False) + launch + merge_f
    bi = FLASH_BWD_OVER_FWD * step_flops / speed("bwd", False) + 3 * launch + merge_b
    group = axis_span(plan, "cp", hw.nvlink_domain, order)
    kv_bytes = 2 * tokens * g_r * d * act_bytes(training)
    if model.is_mla:  # MLA rings the up-projected keys and values: a heads of d_qk + d_v
        kv_bytes = tokens * a_r * (model.qk_head_dim + model.v_dim) * act_bytes(training)
    c = contention(hw)
    # exchange k (k = 1..cp-1) runs while step k-1 computes: the first alongside the causal step
    x_f = comm.p2p_time_s(kv_bytes, not group.intra_node, hw)
    x_b = comm.p2p_time_s(2 * kv_bytes, not group.intra_node, hw)
    steps = cp - 1
    fwd_exposed = overlapped_s(x_f, f0, c) + (steps - 1) * overlapped_s(x_f, fi, c) if steps else 0.0
    bwd_exposed = overlapped_s(x_b, b0, c) + (steps - 1) * overlapped_s(x_b, bi, c) if steps else 0.0
    return RingAttention(fwd_compute=f0 + steps * fi, bwd_compute=b0 + steps * bi,
                         fwd_exposed=fwd_exposed, bwd_exposed=bwd_exposed)


def _elementwise_bytes_per_token(model: ModelSpec, plan: Plan, moe: bool = False, imbalance: float = 1.0,
                                 fused_rope: bool = True) -> float:
    """Forward HBM bytes per token of one layer's memory-bound operations.

    Norms read and write ``2h`` bytes each; each fused bias-dropout-add reads the branch and the
    residual and writes the sum (``6h``, plus a 1-byte mask with dropout). These replicated
    regions are / t only with SP (Korthikanti section 4.2.2). The activation function reads its
    input (``2f``, ``4f`` for SwiGLU) and writes ``2f``; RoPE rewrites Q and K. In a MoE layer the
    activation runs over ``top_k`` routed copies of each token at the expert width (times the load
    imbalance on the busiest rank) and over the shared experts: ``f = imbalance*k*f_moe + f_shared``.
    Under MLA RoPE rewrites only the rotary parts, ``a*d_rope`` of Q and the shared ``d_rope`` key.
    ``fused_rope=False``: the RoPE is left out, costed apart as the eager one (:func:`unfused_rope`).
    """
    t, h, f = plan.tp, model.hidden_size, model.ffn_size
    if moe:
        f = imbalance * model.top_k * model.moe_ffn_size + (model.shared_expert_ffn_hidden_size or 0)
    sp = t if plan.sequence_parallel else 1
    mask = h if model.dropout else 0
    replicated = (2 * 4 * h + 2 * (6 * h + mask)) / sp
    act = ((4 if model.gated_mlp else 2) * f + 2 * f) / t
    if model.position_embedding != "rope" or not fused_rope:
        rope = 0
    elif model.is_mla:
        rope = 4 * (model.num_attention_heads + 1) * model.qk_rope_head_dim / t
    else:
        rope = 4 * (model.q_size + 2 * model.kv_heads * model.kv_channels) / t
    return replicated + act + rope


def _elementwise_kernels(model: ModelSpec, fused_rope: bool = True) -> tuple[int, int]:
    """(forward, backward) launches of one layer's memory-bound kernels.

    Forward: 2 norms, 2 residual (bias-dropout-)adds, the activation, and RoPE on Q and on K
    (Megatron-Core ``TransformerLayer`` with Transformer Engine modules). Backward: each of them
    once more, and each norm twice (input grad, then the weight-grad reduction; Apex/TE layer norm
    backward). Counted by hand from those modules; each costs ``kernel_overhead_us``.
    ``fused_rope=False``: the RoPE is left out (:func:`unfused_rope` counts the eager one).
    """
    rope = 2 if model.position_embedding == "rope" and fused_rope else 0
    fwd = 2 + 2 + 1 + rope
    return fwd, fwd + 2


def eager_block(model: ModelSpec, training: TrainingSpec, plan: Plan) -> tuple[tuple[float, float], tuple[int, int]] | None:
    """((forward, backward) HBM bytes per token, (forward, backward) launches) of one dense layer's memory-bound
    kernels where the framework runs the block eager (``FrameworkProfile.eager_block_bytes``: torchtitan without
    ``--compile.enable`` on the model, ``TrainingSpec.compiled_blocks``), or None where they are fused
    (:func:`_elementwise_bytes_per_token`). Counted on the framework's own block for an RMSNorm / SwiGLU / RoPE
    layer (planner/eager_probe.py); other layer kinds keep the fused count. The backward excludes the recompute.
    Under TP with SP the norms and residual adds run on ``1/t`` of the tokens and the projections' widths are
    ``1/t``; DTensor's own redistribution copies are not counted."""
    prof = frameworks.get(training.framework)
    if (prof.eager_block_bytes is None or training.compiled_blocks or model.norm != "rmsnorm"
            or not model.gated_mlp or model.position_embedding != "rope" or model.is_mla):
        return None
    t = plan.tp
    sp = t if plan.sequence_parallel else 1
    widths = {"h": model.hidden_size / sp, "q": model.q_size / t, "kv": kv_heads_per_rank(model, t) * model.kv_channels,
              "f": model.ffn_size / t, "d": model.kv_channels, "one": 1.0 / sp}
    fwd, bwd = (sum(c * widths[k] for k, c in coef.items()) for coef in prof.eager_block_bytes)
    return (fwd, bwd), prof.eager_block_kernels


#: Megatron-Core's eager RoPE (core_v0.16.1 models/common/embeddings/rope_utils.py ``_apply_rotary_pos_emb_bshd``,
#: not interleaved, rotary over the whole head), counted by hand per call (one for the query, one for the key) with
#: autograd's backward of each op; HBM bytes per bf16 element of the tensor it rotates, and launches per call.
#: Forward: cos and sin of the fp32 frequencies, each times ``mscale`` and cast to bf16 (6 launches over s x d, bytes
#: negligible), ``t * cos`` (read 2, write 2 B), the negation of the second half (1 + 1), ``torch.cat((-x2, x1))``
#: (2 + 2), ``* sin`` (2 + 2), the sum (4 + 2) and ``torch.cat((t, t_pass))`` with an empty ``t_pass`` (2 + 2): 24 B,
#: 12 launches. Backward: the two products' gradients (4 + 4), the negation (2), the chunk's concatenation (4), the
#: zero-filled gradient of the empty ``t_pass`` slice (2) and autograd's two accumulations into the input's gradient
#: (6 + 6): 28 B, 7 launches. Transformer Engine's fused RoPE is 4 B and 1 launch (:func:`_elementwise_bytes_per_token`).
UNFUSED_ROPE_BYTES = (24, 28)
UNFUSED_ROPE_KERNELS = (12, 7)


def unfused_rope(model: ModelSpec, training: TrainingSpec, plan: Plan
                 ) -> tuple[tuple[float, float], tuple[int, int]] | None:
    """((forward, backward) HBM bytes per token, (forward, backward) launches) of one layer's eager RoPE on the query
    and the key (``UNFUSED_ROPE_*``), where the framework runs it unfused: a YaRN model (``ModelSpec.rope_scaling``,
    not MLA) under Megatron-Bridge (``FrameworkProfile.unfused_yarn_rope``: ``GPTModelProvider.provide`` turns
    ``apply_rope_fusion`` off for a ``position_embedding_type`` other than ``"rope"``, and GPT-OSS's provider says
    ``"yarn"``; besides, its bridge sets ``yarn_mscale`` and ``yarn_mscale_all_dim`` to None
    (``gpt_oss_bridge.py`` ``provider_bridge``), so the concentration factor is ``0.1 ln 32 + 1 = 1.35``, and
    Megatron-Core falls back to the unfused path for any ``mscale != 1`` even with the fusion on, core_v0.16.1
    rope_utils.py ``apply_rotary_pos_emb``). None where the RoPE is Transformer Engine's fused kernel."""
    if (model.position_embedding != "rope" or model.rope_scaling != "yarn" or model.is_mla
            or not frameworks.get(training.framework).unfused_yarn_rope):
        return None
    elements = model.q_size / plan.tp + kv_heads_per_rank(model, plan.tp) * model.kv_channels
    return ((UNFUSED_ROPE_BYTES[0] * elements, UNFUSED_ROPE_BYTES[1] * elements),
            (2 * UNFUSED_ROPE_KERNELS[0], 2 * UNFUSED_ROPE_KERNELS[1]))


#: Transformer Engine's own GEMM benchmark (``benchmarks/gemm/benchmark_gemm.py``; TE docs/examples/gemm_profiling/
#: gemm_profiling.rst, commit 8f2e635): one layer of a 5B model (h 4096, f 16384, M = 31 x 512 = 15,872 tokens,
#: 4 linears, 12 GEMMs: fprop, dgrad, wgrad), per-layer ms as (kernels only, ``--pre-quantize``; autocast, i.e.
#: with the quantisation TE does in training), on one B300 SXM6 and one H200 NVL. DelayedScaling cannot be
#: pre-quantised; its kernels are the per-tensor FP8 GEMMs of CurrentScaling (``tensorwise``), so the
#: tensorwise kernel time stands for both. FP8 block scaling (``Float8BlockScaling``, ``fp8_blockwise``) is measured
#: on the H200 in autocast only ("Hopper's cuBLAS does not support" its pre-quantised 2D-by-2D inputs, the same
#: page): 22.882 ms per layer. Its kernel time is taken as the per-tensor FP8 kernels' (16.785 ms) and the rest as
#: its quantisation, so the layer's total is the measured one at this shape, whichever of the two the gap belongs to.
TE_GEMM_BENCH_MS = {
    "b300": {"bf16": (13.102, 12.758), "fp8_tensorwise": (6.812, 9.147), "fp8_delayed": (6.812, 7.802),
             "mxfp8": (7.161, 8.984), "nvfp4": (3.764, 6.453)},
    "h200": {"bf16": (31.968, 32.014), "fp8_tensorwise": (16.785, 20.285), "fp8_delayed": (16.785, 18.978),
             "fp8_blockwise": (16.785, 22.882)},
}
#: The benchmark GPUs' HBM bandwidth, GB/s (B300: 8 TB/s, hardware_profiles/b300-288gb.yaml; H200 NVL: 4.8 TB/s,
#: NVIDIA H200 datasheet), at the profiles' hbm_efficiency 0.8 (NVIDIA Deep Learning Performance Guide).
TE_GEMM_BENCH_HBM_GBPS = {"b300": 8000.0 * 0.8, "h200": 4800.0 * 0.8}
#: Elements the benchmark quantises per layer, both copies of each: the inputs of the 4 linears (M x (4096 +
#: 4096 + 4096 + 16384)), their output gradients (M x (12288 + 4096 + 16384 + 4096)) and the weights
#: (4096 x 12288 + 4096 x 4096 + 4096 x 16384 + 16384 x 4096), which autocast quantises on every call.
TE_GEMM_BENCH_ELEMENTS = 15872 * (28672 + 36864) + (4096 * 12288 + 4096 * 4096 + 4096 * 16384 + 16384 * 4096)


def _quantisation_bytes(key: str) -> float:
    """HBM-equivalent bytes per element (both copies) of TE's quantisation in one recipe: the benchmark's
    autocast minus kernel-only time, at the GPU's HBM rate, over the elements it quantises; the mean over the
    GPUs measured. B300 and H200 agree within 12 % for tensorwise FP8 (12.0 and 10.8 B), which is why a
    bandwidth-scaled figure is used on other GPUs; delayed scaling 5.1 and 6.8 B; block scaling 18.9 B (H200 only,
    Hopper being where it runs natively)."""
    got = [(bench[key][1] - bench[key][0]) * 1e-3 * TE_GEMM_BENCH_HBM_GBPS[gpu] * 1e9 / TE_GEMM_BENCH_ELEMENTS
           for gpu, bench in TE_GEMM_BENCH_MS.items() if key in bench]
    return sum(got) / len(got)


#: Bytes per element of the low-precision casts, by quantisation (``quantisation_key``), measured as above. The
#: bare data movement is less (read 2 B, write 1 + 1 B for fp8; plus block scales for mxfp8 and nvfp4): the
#: measurement also holds the amax passes of current scaling, the block-scale computation, NVFP4's random
#: Hadamard transform and stochastic rounding, and the launches.
LOW_PRECISION_CAST_BYTES = {k: _quantisation_bytes(k)
                            for k in ("fp8_delayed", "fp8_tensorwise", "fp8_blockwise", "mxfp8", "nvfp4")}
LOW_PRECISIONS = ("fp8", "mxfp8", "nvfp4")
#: Block-scaled GEMM kernels against per-tensor FP8 on the same GPU (the benchmark's kernel-only B300 totals):
#: MXFP8 6.812 / 7.161 = 0.95x, NVFP4 6.812 / 3.764 = 1.81x (the datasheet's FP4/FP8 ratio on B300 is 2.9x).
BLOCK_SCALED_OVER_FP8 = {p: TE_GEMM_BENCH_MS["b300"]["fp8_tensorwise"][0] / TE_GEMM_BENCH_MS["b300"][p][0]
                         for p in ("mxfp8", "nvfp4")}


def gemm_precision(training: TrainingSpec, hw: HardwareSpec) -> str:
    """The precision whose GEMM rate a job's GEMMs run at (:meth:`Rates.of`): the job's, except FP8 block scaling on
    a GPU with block-scaled tensor cores, which Transformer Engine runs as MXFP8 ("On Blackwell (SM100+), FP8 Block
    is emulated via MXFP8 for backward compatibility", TE docs/examples/gemm_profiling/gemm_profiling.rst, commit
    8f2e635): MXFP8's kernels (``BLOCK_SCALED_OVER_FP8``). Its casts stay block scaling's measured bytes
    (``LOW_PRECISION_CAST_BYTES["fp8_blockwise"]``, Hopper's: TE publishes no figure for the emulation)."""
    if training.precision == "fp8" and training.fp8_recipe == "blockwise" and hw.peak_fp4_tflops is not None:
        return "mxfp8"
    return training.precision


def quantisation_key(precision: str, fp8_recipe: str = "delayed") -> str:
    """The ``LOW_PRECISION_CAST_BYTES`` key of a training precision (fp8 by its scaling recipe)."""
    return f"fp8_{fp8_recipe}" if precision == "fp8" else precision


def _fp8_cast_bytes_per_token(model: ModelSpec, plan: Plan, linears, precision: str = "fp8",
                              fp8_recipe: str = "delayed") -> tuple[float, float]:
    """(forward, backward) HBM-equivalent bytes per token of the low-precision casts of one layer.

    Every GEMM input is quantised once, both copies (``LOW_PRECISION_CAST_BYTES`` per element, measured on
    Transformer Engine's own benchmark). Forward: the input of each linear (``k`` wide); backward: each output
    gradient (``n`` wide). Weights are cast once per step (``is_first_microbatch``), not per micro-batch, and are
    left out. Attention, norms and the optimizer stay in bf16/fp32.
    """
    c = LOW_PRECISION_CAST_BYTES[quantisation_key(precision, fp8_recipe)]
    fwd = sum(c * k for k, _, _ in linears)
    bwd = sum(c * n for _, n, _ in linears)
    return fwd, bwd


#: Kernels of the token permutation per MoE layer and pass: permute, sort by local expert, unsort,
#: unpermute (Megatron-Core ``MoEAlltoAllTokenDispatcher``: ``permute``, ``sort_chunks_by_idxs`` twice,
#: ``unpermute``), and the router's top-k + softmax + aux-loss kernels (3).
MOE_PERMUTE_KERNELS = 4
MOE_ROUTER_KERNELS = 3


#: Eager kernels Megatron-Core's grouped experts (``TEGroupedMLP``, core_v0.16.1 ``moe/experts.py``) add around the
#: fused ones, counted by hand from that code with autograd's backward of each op; HBM bytes per routed token copy
#: and unit of width, and launches per layer and pass.
#: * Clamped SwiGLU (``ModelSpec.swiglu_limit``; ``fusions/fused_bias_geglu.py::weighted_bias_quick_geglu_impl``):
#:   forward ``x_glu.clamp``, ``x_linear.clamp`` (read + write 2 B each over ``f``) and ``torch.cat`` of the two
#:   (read + write 4 B over ``f``): 16 B per copy and unit of ``f``, 3 kernels plus the host-to-device copy of
#:   ``torch.tensor(linear_offset, device=...)``; backward each clamp's masked gradient (read grad and input,
#:   write: 6 B) and the ``chunk`` backward's concatenation (read + write 4 B): 20 B, 3 kernels.
#: * Expert output biases (``ModelSpec.mlp_bias`` in a MoE layer; ``TEGroupedMLP._apply_bias``): for each local
#:   expert ``t + b * p`` with the FP32 router probabilities (``b * p`` writes 4 B, the add reads 2 + 4 and writes
#:   4 B), then ``torch.cat`` (read + write 4 B) and ``.to(bf16)`` (read 4, write 2 B): 28 B per copy and unit of
#:   ``h``, 2 kernels per local expert plus 2; backward the cast (6 B), the add's cast of the gradient to the
#:   input's dtype (6 B), the bias and probability gradients (a multiply and a sum each: 12 B each) and the
#:   split's concatenation (4 B): 40 B, 6 kernels per local expert plus 3.
EXPERT_CLAMP_BYTES = (16, 20)
EXPERT_CLAMP_KERNELS = (4, 3)
EXPERT_BIAS_BYTES = (28, 40)
EXPERT_BIAS_KERNELS_PER_EXPERT = (2, 6)
EXPERT_BIAS_KERNELS = (2, 3)


def expert_eager_ops(model: ModelSpec, local_experts: float, etp: int = 1
                     ) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward, backward) HBM bytes per routed token copy, (forward, backward) kernel launches per layer) of the
    eager kernels a MoE layer's grouped experts add (``EXPERT_CLAMP_*``, ``EXPERT_BIAS_*``); zero for a model
    with neither a clamped activation nor expert biases. The activation is ``f/etp`` wide on an expert-TP rank;
    the output bias is added to the full-width ``h`` partial output (before the expert-TP reduce-scatter)."""
    byte = [0.0, 0.0]
    kern = [0.0, 0.0]
    f, h = model.moe_ffn_size / etp, model.hidden_size
    for i in (0, 1):
        if model.swiglu_limit is not None:
            byte[i] += EXPERT_CLAMP_BYTES[i] * f
            kern[i] += EXPERT_CLAMP_KERNELS[i]
        if model.has_mlp_bias:
            byte[i] += EXPERT_BIAS_BYTES[i] * h
            kern[i] += EXPERT_BIAS_KERNELS_PER_EXPERT[i] * local_experts + EXPERT_BIAS_KERNELS[i]
    return (byte[0], byte[1]), (kern[0], kern[1])


@dataclass(frozen=True)
class MoEExtra:
    """What a MoE layer adds to its attention and shared experts, per micro-batch on one GPU (seconds)."""

    fwd_compute: float  # router, grouped expert GEMMs, permutation
    bwd_compute: float
    comm_fwd: float  # dispatch + combine all-to-all, expert-TP all-gather + reduce-scatter (exposed)
    comm_bwd: float
    wgrad: float = 0.0  # the weight-gradient GEMMs inside bwd_compute (experts, router)
    # under the all-to-all overlap: what a micro-batch that runs alone (warm-up, cool-down; a2a_alone_share) exposes
    # beyond comm_fwd + comm_bwd, the overlapped exposure; 0 without the overlap
    comm_alone: float = 0.0
    # forward GPU seconds from the dispatcher's host sync to a clamped activation's (activation_sync_split): the
    # permutation, the dispatch, the sort by local expert, FC1 and the clamps; 0 without a clamped activation
    fwd_to_activation: float = 0.0


def moe_layer_extra(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                    tokens: float) -> MoEExtra:
    """Router, routed experts and token dispatch of one MoE layer, as Megatron-Core's
    ``MoEAlltoAllTokenDispatcher`` (``--moe-token-dispatcher-type alltoall``, what plan3d emits) runs them.

    Each rank routes its ``T_r = tokens/tp`` tokens (Megatron requires sequence parallelism with
    MoE and tp > 1, ``moe_layer.py``; torchtitan without EP routes all ``tokens`` of its TP group), ``k`` copies each:
    the shares the memory estimate holds (``memory.moe_routed_shares``). The copies go through one all-to-all over
    the EP group (``ep`` ranks ``etp`` apart, :func:`planner.layout.expert_span`), then an all-gather
    over the expert-TP group; each rank then holds ``etp*T_r*k`` copies for its ``E/ep`` local experts,
    ``m = etp*T_r*k*ep/E`` per expert (times the load imbalance), and runs the expert MLP as one grouped
    GEMM over the local experts at the width ``f_moe/etp`` (:func:`gemm_fwd_bwd_s` with ``batch=E/ep``,
    the same tile-and-wave rate model as every GEMM; under Megatron and NeMo one cuBLAS kernel per local expert
    on Transformer Engine's streams, :func:`grouped_gemm_time_s`). The combine reverses it (reduce-scatter over
    expert TP, all-to-all). Backward repeats both all-to-alls and both expert-TP collectives.

    Not overlapped with compute: Megatron's default (``--overlap-moe-expert-parallel-comm``, the 1F1B
    all-to-all overlap, and ``--moe-shared-expert-overlap`` are off by default; core_v0.16.1
    ``arguments.py``). The router GEMM ``[T_r, h] x [h, E]`` runs in ``router_dtype`` (fp32: the
    profile's fp32 rate), its softmax/top-k move ``3 x 4 B`` per logit. Permutation and unpermutation
    are memory-bound copies of the hidden states: ``T_r*h`` read and ``T_r*k*h`` written (and back),
    plus the sort by local expert (read + write of the received copies) when a rank has several experts.
    FP8: each grouped GEMM input and output gradient pays the cast (``LOW_PRECISION_CAST_BYTES``). A clamped
    activation and expert biases add Megatron's eager kernels around the grouped GEMMs (:func:`expert_eager_ops`).

    ``moe_token_dispatcher`` "allgather", Megatron-Core's own default (core_v0.16.1 ``transformer_config.py``
    ``moe_token_dispatcher_type = "allgather"``; ``MoEAllGatherTokenDispatcher``): every rank all-gathers the hidden
    states of its ``etp x ep`` group (``tp_ep_group``, ``T_g = T_r etp ep`` tokens) with their probabilities (router
    dtype) and bool routing map, permutes the rows of its local experts out of them (the same ``copies`` as the
    all-to-all's, balanced or not) and back, and reduce-scatters the ``[T_g, h]`` result over the group in the
    probabilities' dtype (``token_combine``); backward reduce-scatters and all-gathers the same sizes. No all-to-all
    and no separate expert-TP collectives (the gather spans expert TP).
    """
    rates = Rates.of(hw, gemm_precision(training, hw))
    h, e = model.hidden_size, act_bytes(training)
    E, k, f = model.num_experts, model.top_k, model.moe_ffn_size
    ep, etp = plan.ep, plan.expert_tp
    imb = moe_row_scale(model, training, plan)  # the busiest rank's rows over the balanced share, as memory holds
    routed, rows = moe_routed_shares(model, training, plan)
    t_r = tokens * routed  # tokens this rank routes
    local = E / ep
    copies = tokens * rows  # routed token copies on this rank (the busiest), the rows memory holds
    m = copies / local
    gate = 2 if model.gated_mlp else 1
    fwd = bwd = wgrad = 0.0
    fc1_f = 0.0
    streams = frameworks.expert_gemm_streams(training)[0]  # TE's per-expert GEMMs (grouped_gemm_time_s)
    for kk, nn in ((h, gate * f / etp), (f / etp, h)):
        gf, gd, gw = gemm_fwd_bwd_s(m, kk, nn, rates, batch=local, streams=streams)
        fwd, bwd, wgrad = fwd + gf, bwd + gd + gw, wgrad + gw
        fc1_f = fc1_f or gf
    (eb_f, eb_b), (ek_f, ek_b) = expert_eager_ops(model, local, etp)
    if ek_f or ek_b:  # clamped activation and expert biases (EXPERT_CLAMP_*, EXPERT_BIAS_*)
        fwd += max(copies * eb_f / rates.hbm_bytes_per_s, ek_f * rates.gemm_overhead_s)
        bwd += max(copies * eb_b / rates.hbm_bytes_per_s, ek_b * rates.gemm_overhead_s)
    if training.precision in LOW_PRECISIONS:
        cb = LOW_PRECISION_CAST_BYTES[quantisation_key(training.precision, training.fp8_recipe)]
        fwd += copies * cb * (h + f / etp) / rates.hbm_bytes_per_s + 2 * rates.gemm_overhead_s
        bwd += copies * cb * (gate * f / etp + h) / rates.hbm_bytes_per_s + 2 * rates.gemm_overhead_s
    # router: logits GEMM in router_dtype, softmax/top-k memory-bound
    try:
        r_rates = Rates.of(hw, "fp32") if model.router_dtype == "fp32" else rates
    except ValueError:
        r_rates = rates
    rf, rd, rw = gemm_fwd_bwd_s(t_r, h, E, r_rates)
    router_mem = t_r * E * 3 * 4 / rates.hbm_bytes_per_s
    launches = MOE_ROUTER_KERNELS * rates.gemm_overhead_s
    fwd += rf + max(router_mem, launches)
    bwd += rd + rw + max(router_mem, launches)
    wgrad += rw
    allgather = training.moe_token_dispatcher == "allgather"
    gathered = t_r * etp * ep  # the allgather dispatcher's tokens: every token of the etp x ep group
    if allgather:  # permute the gathered tokens' local rows out (T_g*h -> copies) and back (copies -> T_g*h)
        perm = 2 * h * e * (gathered + copies)
    else:  # permutation: T_r*h -> T_r*k*h copies and back; sort/unsort of the received copies by local expert
        perm = 2 * t_r * h * e * (1 + imb * k) + (4 * copies * h * e if local > 1 else 0.0)
    perm_s = max(perm / rates.hbm_bytes_per_s, MOE_PERMUTE_KERNELS * rates.gemm_overhead_s)
    fwd, bwd = fwd + perm_s, bwd + perm_s
    # dispatch + combine: all-to-all over EP of the busiest rank's copies, AG + RS over expert TP
    ep_group = expert_span(plan, "ep", hw.nvlink_domain)
    etp_group = expert_span(plan, "etp", hw.nvlink_domain)
    etp_s = 0.0 if allgather else (  # the allgather dispatcher's gather spans expert TP already
        comm.collective_time_s("all_gather", copies * h * e, etp_group, hw)
        + comm.collective_time_s("reduce_scatter", copies * h * e, etp_group, hw))
    if allgather:
        # MoEAllGatherTokenDispatcher (core_v0.16.1): all-gather the hidden states, the probabilities (router dtype)
        # and the bool routing map over the etp x ep group; reduce-scatter the unpermuted outputs back in the
        # probabilities' dtype (``token_combine``: ``.to(self.local_probs.dtype)``); backward the reverse of each
        group = expert_span(plan, "etp_ep", hw.nvlink_domain)
        pb = router_dtype_bytes(model)
        dispatch = comm.collective_time_s("all_gather", gathered * (h * e + E * (pb + 1)), group, hw)
        combine = comm.collective_time_s("reduce_scatter", gathered * h * pb, group, hw)
    elif training.moe_token_dispatcher in FLEX_DISPATCHERS:
        # in the activation dtype, also under FP8: Megatron-Core's flex dispatcher hands DeepEP the hidden states
        # unquantised (core_v0.16.1 moe/fused_a2a.py ``fused_dispatch``) and HybridEP refuses FP8 dispatch
        # (``assert not fp8_dispatch``; "Currently, we do not support fp8 dispatch"). DeepEP's own FP8 dispatch
        # (DeepSeek-V3's framework) is not what Megatron runs. HybridEP moves the same copies (one per destination
        # rank inside an NVLink domain, one per destination domain across them): deepep_time_s, which is checked
        # against NVIDIA's measured HybridEP dispatch.
        dispatch = combine = deepep_time_s(imb * t_r * h * e, k, ep_group, hw, model)
    else:
        dispatch = combine = comm.all_to_all_time_s(imb * t_r * k * h * e, ep_group, hw)
    comm_f = comm_b = dispatch + combine + etp_s
    overlap = a2a_overlap_active(model, training, plan)
    if overlap:
        # --overlap-moe-expert-parallel-comm: one micro-batch's forward runs merged with another's backward
        # (Megatron-Core ``combined_1f1b``), so the layer's communication hides under that compute; the warm-up
        # forwards and cool-down backwards run alone, their communication exposed: ``comm_alone`` more, in the share
        # a2a_alone_share gives (applied per stage, stage_terms, where the micro-batch count is known)
        exposed = overlapped_s(comm_f + comm_b, fwd + bwd, contention(hw))
        alone = comm_f + comm_b - exposed
        comm_f = comm_b = exposed / 2
    else:
        alone = 0.0
    to_act = 0.0
    if model.swiglu_limit is not None:  # the GPU work between the two host syncs (activation_sync_split)
        clamp_f = max(copies * EXPERT_CLAMP_BYTES[0] * f / etp / rates.hbm_bytes_per_s,
                      EXPERT_CLAMP_KERNELS[0] * rates.gemm_overhead_s)
        sent = 0.0 if overlap else dispatch + etp_s / 2
        to_act = perm_s / 2 + sent + fc1_f + clamp_f
    return MoEExtra(fwd_compute=fwd, bwd_compute=bwd, comm_fwd=comm_f, comm_bwd=comm_b, wgrad=wgrad,
                    comm_alone=alone, fwd_to_activation=to_act)


def a2a_alone_share(m, pp: int, vpp: int, group: int | None = None):
    """Share of a rank's (chunk) forwards and backwards that Megatron-Core runs alone under
    ``--overlap-moe-expert-parallel-comm``, their all-to-alls exposed (``MoEExtra.comm_alone``), averaged over the
    pipeline ranks; the others run merged with another micro-batch's. ``m``: micro-batches per step (a scalar or
    an array, the search's options). Megatron-Core core_v0.16.1:

    * no pipeline (``combined_1f1b.combined_1f1b_schedule_for_no_pipelining``): "The forward step for the first
      microbatch is executed alone, no a2a overlapping", then ``m - 1`` merged steps, then the last backward alone:
      ``1 / m``;
    * interleaved (``schedules.get_pp_rank_microbatches``, then ``combined_1f1b_schedule_for_interleaved_pipelining``
      for the steady steps only): rank ``r`` runs ``W = 2 (p - r - 1) + (v - 1) N + 1`` warm-up chunk forwards alone
      (the ``+ 1``: "we schedule one extra micro-batch forward step before the 1f1b stages"), at most all ``m v``, and
      as many cool-down backwards: ``W / (m v)``, ``N`` the micro-batch group size (``group``, default ``p``).

    (The overlap needs virtual stages when ``pp > 1``: ``a2a_overlap_problems``.)"""
    m = np.maximum(np.asarray(m, dtype=float), 1.0)
    if pp == 1:
        return 1.0 / m
    n = group or pp
    total = m * vpp
    alone = sum(np.minimum(total, 2 * (pp - r - 1) + (vpp - 1) * n + 1) for r in range(pp))
    return alone / (pp * total)


#: Launches the host issues between the alltoall dispatcher's host sync (``before_ep_alltoall``: it waits for the
#: token counts it copied to the host, core_v0.16.1 moe/token_dispatcher.py ``_maybe_dtoh_and_synchronize``) and the
#: second one of a clamped activation: the two all-to-alls of ``token_dispatch`` (tokens, probabilities), the two
#: clamps and ``torch.cat`` and the host-to-device copy of ``weighted_bias_quick_geglu_impl``, plus, per local expert,
#: its FC1 GEMM (TE's grouped linear), and with several local experts the sort by expert (``sort_chunks_by_idxs``).
ACTIVATION_SYNC_HOST_LAUNCHES = 2 + 3 + 1


def activation_sync_split(model: ModelSpec, hw: HardwareSpec, plan: Plan, extra: MoEExtra) -> tuple[float, float] | None:
    """(host seconds, GPU seconds) of a MoE layer's forward between its two host syncs, or None where it has one.

    A clamped activation (``ModelSpec.swiglu_limit``) runs Megatron-Core's ``weighted_bias_quick_geglu_impl``
    (core_v0.16.1 fusions/fused_bias_geglu.py), which builds ``torch.tensor(linear_offset, device=input.device)``
    on every call: a blocking host-to-device copy, which PyTorch ends with a stream synchronisation
    (torch/csrc/utils/tensor_new.cpp ``internal_new_from_data``: ``tensor.to(device, ..., non_blocking=false)``;
    aten/src/ATen/native/cuda/Copy.cu ``copy_kernel_cuda``: ``at::cuda::memcpy_and_sync``). With the dispatcher's
    sync the forward is cut in two: the host cannot issue what follows the activation before the GPU has run what
    precedes it, so the layer takes ``max(h1, g1) + max(h - h1, g - g1)`` in place of ``max(h, g)``, with ``h1``
    the launches between the syncs (``ACTIVATION_SYNC_HOST_LAUNCHES``) and ``g1`` their GPU work
    (``MoEExtra.fwd_to_activation``). GPU-bound layers lose nothing; host-bound ones lose the overlap."""
    if model.swiglu_limit is None:
        return None
    local = model.num_experts / plan.ep
    launches = ACTIVATION_SYNC_HOST_LAUNCHES + local + (1 if local > 1 else 0)
    return launches * hw.host_launch_us * 1e-6, extra.fwd_to_activation


#: Kernel-launching operators Megatron-Core's own MoE layer issues per micro-batch and pass, measured on the
#: CPU by ``benchmarks/megatron_host_ops.py`` (core_v0.16.1 ``MoELayer``, alltoall dispatcher, ``SequentialMLP``
#: experts, aux-loss router; ``tests/test_host_overhead.py`` re-measures them): a base (router, token
#: counts, permutation, dispatch, combine) plus a count per local expert (its two linears and activation).
#: View and metadata operators (about as many again) launch nothing and are left out. ``router``: the
#: router's own share of the base (Megatron's ``moe_router`` CUDA-graph scope). ``fwd_after_sync_*``: the forward
#: operators issued after the dispatcher's host sync (``before_ep_alltoall`` with ep > 1: the all-to-all, the sort by
#: local expert, the experts, the unsort and the combine), measured by the same script.
MOE_HOST_OPS = {"fwd_base": 36, "fwd_per_expert": 6, "bwd_base": 27, "bwd_per_expert": 13,
                "router_fwd": 23, "router_bwd": 15, "fwd_after_sync_base": 6, "fwd_after_sync_per_expert": 6}

#: The same counts for torchtitan 0.3.0's own MoE layer, measured on
#: the CPU by ``benchmarks/torchtitan_host_ops.py`` (``tests/test_host_overhead.py`` re-measures them; a profile's
#: ``FrameworkProfile.moe_host_issue`` "torchtitan"): its routed
#: experts are three ``torch._grouped_mm`` calls over all local experts (``models/common/moe.py`` ``GroupedExperts``),
#: so nothing grows with the local experts. ``ep``: the all-to-all token dispatcher of an ep > 1 run
#: (``AllToAllTokenDispatcher``), which waits for the token counts on the host once per layer
#: (``_sync_token_count_exchange``: ``output_splits.to("cpu", non_blocking=False)``); ``local``: ep 1
#: (``LocalTokenDispatcher``), which copies nothing to the host. The router is a plain module there (Megatron's
#: ``moe_router`` CUDA-graph scope does not apply).
TORCHTITAN_MOE_HOST_OPS = {
    "ep": {"fwd_base": 57, "fwd_per_expert": 0, "bwd_base": 52, "bwd_per_expert": 0, "router_fwd": 0,
           "router_bwd": 0, "fwd_after_sync_base": 35, "fwd_after_sync_per_expert": 0},
    "local": {"fwd_base": 32, "fwd_per_expert": 0, "bwd_base": 45, "bwd_per_expert": 0, "router_fwd": 0,
              "router_bwd": 0, "fwd_after_sync_base": 0, "fwd_after_sync_per_expert": 0},
}


def moe_host_ops(training: TrainingSpec, plan: Plan) -> dict[str, int]:
    """The operator counts of the framework's own MoE layer (``FrameworkProfile.moe_host_issue``): ``MOE_HOST_OPS``,
    Megatron-Core's, also charged to DeepSpeed, whose MoE layer is not measured, and to plan3d validate's miniature,
    which runs its experts one by one as Megatron's ``SequentialMLP`` does; ``TORCHTITAN_MOE_HOST_OPS``."""
    if frameworks.get(training.framework).moe_host_issue == "torchtitan":
        return TORCHTITAN_MOE_HOST_OPS["ep" if plan.ep > 1 else "local"]
    return MOE_HOST_OPS


def moe_host_syncs(training: TrainingSpec, plan: Plan) -> bool:
    """Whether the framework's dropless MoE layer waits on the host for the token counts every layer: Megatron-Core's
    dispatchers always (:func:`moe_host_s`); torchtitan's only with expert parallelism (``TORCHTITAN_MOE_HOST_OPS``)."""
    if frameworks.get(training.framework).moe_host_issue == "torchtitan":
        return plan.ep > 1
    return True


def _experts_issued_one_by_one(training: TrainingSpec) -> bool:
    """Whether the framework issues the experts' eager kernels (clamped activation, biases) once per local expert
    (Megatron-Core's per-expert loops, ``expert_eager_ops``) rather than once over all of them (torchtitan's grouped
    experts)."""
    return frameworks.get(training.framework).moe_host_issue != "torchtitan"


def _expert_eager_launches(model: ModelSpec, training: TrainingSpec, plan: Plan) -> tuple[float, float]:
    """(forward, backward) host launches of the experts' eager kernels (``expert_eager_ops``), as the framework
    issues them: once per local expert, or once over all of them (:func:`_experts_issued_one_by_one`)."""
    local = model.num_experts / plan.ep if _experts_issued_one_by_one(training) else 1
    return expert_eager_ops(model, local)[1]


def moe_host_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan) -> tuple[float, float]:
    """(forward, backward) host seconds to issue one MoE layer's kernels for one micro-batch.

    Why it matters: the dropless all-to-all dispatcher copies the token counts to the host and waits for
    them every layer (Megatron-Core ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``, sync point
    ``before_ep_alltoall``; skipped only with drop-and-pad), so the CPU cannot run ahead of the GPU across
    layers and the layer takes at least the host's issue time (:func:`layer_time`). NVIDIA's MoE tuning
    guide names the symptom ("CPU overhead: gaps between GPU kernels") and the remedies, CUDA graphs and
    "decrease TP or increase MBS" (Megatron-Bridge docs, training/moe-optimization.md).

    Kernels: the attention block's fused Transformer Engine kernels as :func:`layer_time` counts them (each
    linear's GEMM and, in low precision, its cast; the attention kernel, 1 forward and 3 backward; the
    norms, residual adds and RoPE of :func:`_elementwise_kernels`, or the eager RoPE's of :func:`unfused_rope`), plus
    the framework's own MoE layer as measured (:func:`moe_host_ops`: Megatron-Core's ``MOE_HOST_OPS``, torchtitan's
    ``TORCHTITAN_MOE_HOST_OPS``), plus the eager kernels of a clamped activation and of expert biases, which the
    measured layers do not have (:func:`expert_eager_ops`; once per local expert under Megatron, once under
    torchtitan's grouped experts). torchtitan syncs only with expert parallelism (:func:`moe_host_syncs`). Each
    costs ``host_launch_us``. A part captured in a CUDA graph (``cuda_graph_modules``: attn, moe_router; moe, the whole
    MoE layer with drop-and-pad routing) costs one launch instead. ``moe_preprocess`` is not separated in the
    measurement and is left at full cost. Megatron's selective recompute of ``moe_act`` issues
    the activation (and a clamped activation's clamps) once more in the backward.
    """
    linears = len(_linear_shapes(model, plan, moe=True))
    casts = linears if training.precision in LOW_PRECISIONS else 0
    rope = unfused_rope(model, training, plan)
    k_f, k_b = _elementwise_kernels(model, fused_rope=rope is None)  # less the activation, which the experts' count holds
    attn_f, attn_b = linears + casts + 1 + k_f - 1, 2 * linears + casts + 3 + k_b - 1
    if rope is not None:
        attn_f, attn_b = attn_f + rope[1][0], attn_b + rope[1][1]
    graphs = training.cuda_graph_modules
    if "attn" in graphs:
        attn_f = attn_b = 1
    local = model.num_experts / plan.ep
    o = moe_host_ops(training, plan)
    eager_f, eager_b = _expert_eager_launches(model, training, plan)  # not in the measured layers
    moe_f = o["fwd_base"] + o["fwd_per_expert"] * local + eager_f
    moe_b = o["bwd_base"] + o["bwd_per_expert"] * local + eager_b
    if "moe_router" in graphs:
        moe_f, moe_b = moe_f - o["router_fwd"] + 1, moe_b - o["router_bwd"] + 1
    if "moe" in graphs:  # the whole MoE layer replayed (core_v0.16.1 TransformerLayer._get_submodules_under_cudagraphs)
        moe_f = moe_b = 1
    mods = training.recompute_modules
    if (plan.recompute == "selective" and "moe_act" in mods and "moe" not in mods
            and not frameworks.get(training.framework).op_sac):
        # the backward issues the recomputed activation again (module_recompute_s), with its clamps
        moe_b += 1 + (EXPERT_CLAMP_KERNELS[0] if model.swiglu_limit is not None else 0)
    launch_s = hw.host_launch_us * 1e-6
    return (attn_f + moe_f) * launch_s, (attn_b + moe_b) * launch_s


def moe_host_after_sync_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan) -> float:
    """Host seconds, in one MoE layer's forward, to issue what follows the dispatcher's host sync: the all-to-all,
    the experts and the combine (``fwd_after_sync_*`` of :func:`moe_host_ops`, measured on the framework's own MoE
    layer, plus
    the eager kernels of a clamped activation and of expert biases, :func:`expert_eager_ops`, which run inside the
    experts). Each costs ``host_launch_us``; CUDA-graph scopes do not reach them (Megatron's ``moe_router`` and
    ``moe_preprocess`` scopes end before the dispatch). Used by :func:`layer_time` for the sync chain."""
    local = model.num_experts / plan.ep
    o = moe_host_ops(training, plan)
    eager_f, _ = _expert_eager_launches(model, training, plan)
    return (o["fwd_after_sync_base"] + o["fwd_after_sync_per_expert"] * local + eager_f) * hw.host_launch_us * 1e-6


def expected_destinations(parts: int, top_k: int, num_groups: int | None = None, group_topk: int | None = None) -> float:
    """Expected number of the ``parts`` equal, consecutive blocks of the experts (the EP group's ranks, or its nodes)
    that receive at least one of a token's ``top_k`` experts, the experts drawn evenly.

    Without a group limit the ``k`` experts fall on ``parts * (1 - (1 - 1/parts)^k)`` distinct blocks. With
    group-limited routing (``ModelSpec.router_num_groups`` G, ``router_group_topk`` g: Megatron-Core core_v0.16.1
    ``moe_utils.group_limited_topk``, DeepSeek-V3's node-limited routing, report arXiv:2412.19437 section 2.1.2) the
    token's experts lie in g of the G groups of consecutive experts, so on fewer blocks: when groups are whole
    blocks or unions of them (``G % parts == 0``) a block is hit when one of its ``G / parts`` groups is picked,
    ``parts * (1 - C(G - G/parts, g) / C(G, g))`` (each picked group taken to receive an expert: the router ranks
    groups by their best experts' scores); when blocks split groups (``parts % G == 0``) the experts spread over the
    ``g * parts / G`` blocks of the picked groups. Never more than without the limit."""
    if parts <= 1:
        return float(parts)
    free = parts * (1 - (1 - 1 / parts) ** top_k)
    if not num_groups or not group_topk:
        return free
    if num_groups % parts == 0:
        per = num_groups // parts
        hit = parts * (1 - math.comb(num_groups - per, group_topk) / math.comb(num_groups, group_topk))
    elif parts % num_groups == 0:
        m = group_topk * parts // num_groups
        hit = m * (1 - (1 - 1 / m) ** top_k)
    else:
        return free
    return min(free, hit)


def deepep_time_s(token_bytes: float, top_k: int, group, hw: HardwareSpec, model: ModelSpec | None = None) -> float:
    """DeepEP dispatch (or combine) of ``token_bytes`` of tokens per rank over an EP group (DeepEP README,
    "normal kernels": a token crosses the network once per destination node, then NVLink forwards it to
    the ranks there; DeepSeek-V3 report arXiv:2412.19437 section 3.2.2). A token goes once to each rank that holds
    one of its experts (DeepEP's ``get_dispatch_layout``: ``is_token_in_rank``, one row per token and rank), not
    once per expert: ``R`` distinct ranks and ``N_hit`` distinct nodes of the group's ``n`` ranks on ``N`` nodes
    (:func:`expected_destinations`, with the model's group-limited routing). Inside one NVLink domain the
    ``R (n-1)/n`` remote copies go over NVLink; across nodes the ``N_hit (N-1)/N`` remote nodes' copies go over the
    rank's NIC while NVLink carries the ``R`` copies to the ranks (direct, or forwarded by the receiving node's proxy
    GPU) at the same time. One alpha of the slowest link.

    Checked against NVIDIA's measured HybridEP dispatch (Megatron-Core MoE report arXiv:2603.07685, Table 7: hidden
    7168, 4,096 tokens, 256 experts; tests/test_cost_moe.py): H100 EP8 661 us, EP32 3,064 us, EP64 4,626 us;
    GB200 NVL72 EP8 391 us. On NVL72 at EP 16-64 (578-675 us) the measured dispatch is slower than this count
    predicts, by up to a third: many NVLink peers per GPU, which the model does not charge."""
    if group.size <= 1 or token_bytes <= 0:
        return 0.0
    groups = (model.router_num_groups, model.router_group_topk) if model is not None else (None, None)
    n = group.size
    ranks = expected_destinations(n, top_k, *groups)
    if group.intra_node:
        bw = hw.intra_node_bandwidth_gbps * 1e9
        return hw.intra_node_latency_us * 1e-6 + ranks * (n - 1) / n * token_bytes / bw
    nodes = group.nodes
    remote = expected_destinations(nodes, top_k, *groups) * (nodes - 1) / nodes
    inter = remote * token_bytes / (hw.inter_node_bandwidth_gbps * 1e9)
    intra = ranks * token_bytes / (hw.intra_node_bandwidth_gbps * 1e9)
    return hw.inter_node_latency_us * 1e-6 + max(inter, intra)


def op_sac_recompute_s(model: ModelSpec, training: TrainingSpec, plan: Plan, rates: Rates, tokens: float,
                       elem_f_s: float, elem_kernels: int) -> float:
    """Seconds torchtitan's selective op-level AC recomputes in one dense layer's backward, per micro-batch.

    torchtitan ``distributed/activation_checkpoint.py::_get_custom_policy`` (``selective_ac_option = "op"``)
    saves the outputs of ``aten.mm`` and the SDPA kernels and recomputes every other op, and of the ``aten.mm``
    it recomputes every second one in the block's forward order (the same rule :func:`planner.memory.op_sac_terms`
    applies to the saved bytes). torchtitan's block issues Q, K, V, O, W1, W3, W2 (``Attention.forward``,
    ``FeedForward.forward``), so K, O and W3 are recomputed; a two-matrix MLP (Q, K, V, O, W1, W2) recomputes
    K, O and W2. Their forward GEMMs (:func:`gemm_time_s`, at the shape of one TP rank), in low precision their
    casts, and the forward of every memory-bound op (norms, RoPE, the activation, the residual adds:
    ``elem_f_s``, never faster than ``elem_kernels`` launches) run again; the attention kernel does not.
    """
    t, h = plan.tp, model.hidden_size
    kv_r = kv_heads_per_rank(model, t) * model.kv_channels
    f = model.ffn_size / t
    # (k, n, kind) as _linear_shapes gives them: K, O, and W3 (or W2 of a two-matrix MLP)
    linears = [(h, kv_r, "inner"), (model.q_size / t, h, "row"), (h, f, "inner") if model.gated_mlp else (f, h, "row")]
    gemm_s = sum(gemm_time_s(tokens, k, n, rates) for k, n, _ in linears)
    if training.precision in LOW_PRECISIONS:  # the recomputed forward GEMMs cast their inputs again
        cast_f, _ = _fp8_cast_bytes_per_token(model, plan, linears, training.precision, training.fp8_recipe)
        gemm_s += tokens * cast_f / rates.hbm_bytes_per_s + len(linears) * rates.gemm_overhead_s
    return gemm_s + max(elem_f_s, elem_kernels * rates.gemm_overhead_s)


def module_recompute_s(model: ModelSpec, training: TrainingSpec, plan: Plan, rates: Rates, tokens: float,
                       att_f: float, gemm_fwd: dict, tp_region_s: float, moe_extra) -> tuple[float, float, float]:
    """(recomputed forward seconds, repeated TP seconds, repeated EP seconds) of one layer's backward under
    Megatron's selective recompute of ``training.recompute_modules`` (``--recompute-modules``; what each keeps:
    :func:`planner.memory.apply_recompute_modules`).

    ``core_attn``: the attention core's forward (``att_f``). ``mla_up_proj``: the q and kv up-projection GEMMs
    (``gemm_fwd``, the layer's forward GEMM times by :func:`_linear_shapes` name; their fused norms and the RoPE
    are left out, memory-bound and small beside them). ``mlp`` (a dense layer): FC1 and FC2 and the activation
    (read the FC1 output, write its result), and the MLP's TP region again (``tp_region_s``: its all-gather and
    reduce-scatter with SP, its all-reduce without). ``moe`` (a MoE layer): the router, expert GEMMs and
    permutation (``moe_extra.fwd_compute``), the shared experts' GEMMs and the dispatch and combine again;
    otherwise ``moe_act``: the experts' activation over the routed rows (with a clamped activation, its eager
    clamps and concatenation too), and ``shared_experts``: the shared
    experts' GEMMs and their TP region. ``layernorm`` is costed as nothing (a norm's forward; it is modelled
    as saving nothing, too)."""
    mods = training.recompute_modules
    e = act_bytes(training)
    gate = 2 if model.gated_mlp else 1
    s = att_f if "core_attn" in mods else 0.0
    tp = ep = 0.0
    if "mla_up_proj" in mods:
        s += gemm_fwd.get("q_up", 0.0) + gemm_fwd.get("kv_up", 0.0)
    if moe_extra is None:
        if "mlp" in mods and "fc1" in gemm_fwd:
            act_bytes_ = tokens * (gate + 1) * model.ffn_size / plan.tp * e
            s += gemm_fwd["fc1"] + gemm_fwd["fc2"] + max(act_bytes_ / rates.hbm_bytes_per_s, rates.gemm_overhead_s)
            tp += tp_region_s
        return s, tp, ep
    shared = "fc1" in gemm_fwd  # a MoE layer's fc1/fc2 are its shared experts (_linear_shapes)
    if "moe" in mods:
        s += moe_extra.fwd_compute + (gemm_fwd["fc1"] + gemm_fwd["fc2"] if shared else 0.0)
        ep += moe_extra.comm_fwd
        tp += tp_region_s if shared else 0.0
        return s, tp, ep
    if "moe_act" in mods:
        rows = moe_row_scale(model, training, plan) * plan.expert_tp * tokens / plan.tp * model.top_k
        f_r = model.moe_ffn_size / plan.expert_tp
        act_bytes_ = rows * (gate + 1) * f_r * e
        kernels = 1
        if model.swiglu_limit is not None:
            # the checkpointed function is TEGroupedMLP's bias_act_func, which holds weighted_bias_quick_geglu_impl's
            # clamps and torch.cat (core_v0.16.1 moe/experts.py, ``activation_checkpoint.checkpoint(bias_act_func,
            # ...)``): they run again with it (EXPERT_CLAMP_BYTES / _KERNELS forward)
            act_bytes_ += rows * EXPERT_CLAMP_BYTES[0] * f_r
            kernels += EXPERT_CLAMP_KERNELS[0]
        s += max(act_bytes_ / rates.hbm_bytes_per_s, kernels * rates.gemm_overhead_s)
    if "shared_experts" in mods and shared:
        s += gemm_fwd["fc1"] + gemm_fwd["fc2"]
        tp += tp_region_s
    return s, tp, ep


def sp_gather_bytes_per_element(training: TrainingSpec) -> float:
    """Bytes per element of a sequence-parallel all-gather (a column-parallel linear's input, or a row-parallel
    linear's output gradient in backward).

    Transformer Engine quantises the input on the rank's own 1/t shard (the fused norm writes it quantised,
    ``with_quantized_norm``, or the input quantizer runs first) and gathers the quantised data with
    ``gather_along_first_dim(..., quantizer=input_quantizer)``; the backward's re-gather of the saved shard for the
    weight gradient does the same (TE 2.x ``module/layernorm_linear.py``, ``layernorm_mlp.py`` and ``linear.py``,
    forward "Prepare GEMM input" and ``backward``; TE 1.x gathered the fp8 norm output as well), and so does the
    output gradient's gather (``module/base.py`` ``grad_output_preprocess``, "FP8 with all-gather": the gradient
    quantizer is passed to ``gather_along_first_dim``). Megatron-Core's TE layers ask for no high-precision norm
    output (``return_layernorm_output=False``), so no 16-bit copy is gathered. The bytes are those of the saved
    GEMM input (``planner.memory.LINEAR_INPUT_BYTES``: 1 B fp8, 1 + 4/128 B fp8 block scaling, 1 + 1/32 B MXFP8,
    0.5 + 1/16 B NVFP4). The reduce-scatters carry the 16-bit GEMM outputs. Frameworks that gather the 16-bit tensor
    (torch's DTensor SP) and 16-bit training: ``act_bytes``."""
    e = act_bytes(training)
    if not frameworks.get(training.framework).quantized_sp_gather:
        return e
    return LINEAR_INPUT_BYTES.get(linear_input_key(training), e)


def layer_time(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
               order: str = DEFAULT_ORDER, moe: bool = False) -> LayerTime:
    """Compute and communication of one transformer layer for one micro-batch on one GPU; ``moe``: a
    MoE layer (attention, shared experts, router and routed experts: :func:`moe_layer_extra`)."""
    rates = Rates.of(hw, gemm_precision(training, hw), training.attention)
    tokens = plan.micro_batch_size * training.seq_len / plan.cp
    overlap = resolved_overlap(training)
    imbalance = moe_row_scale(model, training, plan) if moe else 1.0
    fwd = bwd = wgrad = 0.0
    gemms = []  # (fwd, dgrad, wgrad, kind) of each linear, in forward order
    shapes = _linear_shapes(model, plan, moe)
    linears = list(shapes.values())
    for k, n, kind in linears:
        f, dg, wg = gemm_fwd_bwd_s(tokens, k, n, rates)
        fwd, bwd, wgrad = fwd + f, bwd + dg + wg, wgrad + wg
        gemms.append((f, dg, wg, kind))
    ring = None
    if plan.cp > 1 and training.attention in FLASH_ATTENTION:
        ring = ring_attention(model, hw, training, plan, order)
        att_f, att_b = ring.fwd_compute, ring.bwd_compute
    else:
        att_f, att_b = _attention_core_s(model, training, plan, rates)
    # memory-bound ops move their bytes, and are never faster than their launches (a floor, as a
    # GEMM is never faster than its HBM traffic): it bites only on small micro-batches
    rope = unfused_rope(model, training, plan)
    eager = None if moe else eager_block(model, training, plan)
    if eager is not None:  # the framework's eager block, counted on its own code (eager_block)
        (e_f, e_b), (k_f, k_b) = eager
        elem_f, elem_b = tokens * e_f / rates.hbm_bytes_per_s, tokens * e_b / rates.hbm_bytes_per_s
    else:
        k_f, k_b = _elementwise_kernels(model, fused_rope=rope is None)
        elem_f = tokens * _elementwise_bytes_per_token(model, plan, moe, imbalance, fused_rope=rope is None) / \
            rates.hbm_bytes_per_s
        elem_b = 2 * elem_f
    fwd += att_f + max(elem_f, k_f * rates.gemm_overhead_s)
    bwd += att_b + max(elem_b, k_b * rates.gemm_overhead_s)
    if rope is not None:  # the eager RoPE of a YaRN model under Megatron-Bridge (unfused_rope)
        (r_f, r_b), (rk_f, rk_b) = rope
        fwd += max(tokens * r_f / rates.hbm_bytes_per_s, rk_f * rates.gemm_overhead_s)
        bwd += max(tokens * r_b / rates.hbm_bytes_per_s, rk_b * rates.gemm_overhead_s)
    if training.precision in LOW_PRECISIONS:
        cast_f, cast_b = _fp8_cast_bytes_per_token(model, plan, linears, training.precision, training.fp8_recipe)
        fwd += tokens * cast_f / rates.hbm_bytes_per_s + len(linears) * rates.gemm_overhead_s
        bwd += tokens * cast_b / rates.hbm_bytes_per_s + len(linears) * rates.gemm_overhead_s

    tp_group = axis_span(plan, "tp", hw.nvlink_domain, order)
    e = act_bytes(training)
    buf = tokens * model.hidden_size * e
    c = contention(hw)
    col = [(dg, wg) for _, dg, wg, kind in gemms if kind == "column"]
    regions = len(col)  # TP regions: 2 in a dense layer, 1 in a MoE layer without shared experts
    if plan.sequence_parallel:
        # every all-gather (the column-parallel input, its re-gather for the weight gradient, the row-parallel
        # output gradient) moves the low-precision copy where the framework quantises before gathering
        # (sp_gather_bytes_per_element); the reduce-scatters stay 16-bit
        ag = comm.collective_time_s("all_gather", tokens * model.hidden_size * sp_gather_bytes_per_element(training),
                                    tp_group, hw)
        rs = comm.collective_time_s("reduce_scatter", buf, tp_group, hw)
        # backward: the input re-gather overlaps the data-grad GEMM and the input-grad RS overlaps
        # the weight-grad GEMM of each column-parallel linear (Megatron layers.py)
        col_bwd = sum(overlapped_s(ag, dg, c) + overlapped_s(rs, wg, c) for dg, wg in col)
        if overlap.tp_comm_overlap:
            # --tp-comm-overlap (TE userbuffers): each AG is pipelined with the GEMM it feeds, each
            # RS with the GEMM that produces it, and the backward AG of the output gradient with
            # the row-parallel data-grad GEMM (Megatron-Core ModelParallelConfig.tp_comm_overlap)
            tp_fwd = sum(overlapped_s(ag if kind == "column" else rs, f, c) for f, _, _, kind in gemms
                         if kind != "inner")
            tp_bwd = col_bwd + sum(overlapped_s(ag, dg, c) for _, dg, _, kind in gemms if kind == "row")
        else:
            tp_fwd = regions * (ag + rs)
            tp_bwd = regions * ag + col_bwd  # the AG conjugates of the forward RS are exposed
    else:
        ar = comm.collective_time_s("all_reduce", buf, tp_group, hw)
        tp_fwd = regions * ar
        tp_bwd = sum(overlapped_s(ar, wg, c) for _, wg in col)
    gathered_qkv = replicated_kv_gather_s(model, hw, training, plan, tokens, tp_group)
    tp_fwd, tp_bwd = tp_fwd + gathered_qkv[0], tp_bwd + gathered_qkv[1]
    ep_fwd = ep_bwd = 0.0
    x = None
    if moe:
        x = moe_layer_extra(model, hw, training, plan, tokens)
        fwd, bwd, wgrad = fwd + x.fwd_compute, bwd + x.bwd_compute, wgrad + x.wgrad
        ep_fwd, ep_bwd = x.comm_fwd, x.comm_bwd

    cp_fwd = cp_bwd = 0.0
    if ring is not None:
        cp_fwd, cp_bwd = ring.fwd_exposed, ring.bwd_exposed
    elif plan.cp > 1:  # materialised attention: ring exchange of K and V overlapped with the core
        cp_group = axis_span(plan, "cp", hw.nvlink_domain, order)
        kv_bytes = 2 * tokens * kv_heads_per_rank(model, plan.tp) * model.kv_channels * e
        exchange = (plan.cp - 1) * comm.p2p_time_s(kv_bytes, not cp_group.intra_node, hw)
        cp_fwd, cp_bwd = overlapped_s(exchange, att_f, c), overlapped_s(2 * exchange, att_b, c)
    recompute = {"none": 0.0, "selective": att_f, "full": fwd}[plan.recompute]
    op_sac = frameworks.get(training.framework).op_sac
    if plan.recompute == "selective" and not moe and op_sac:
        recompute = op_sac_recompute_s(model, training, plan, rates, tokens, elem_f, k_f)
    elif plan.recompute == "selective" and not op_sac:
        gemm_fwd = {name: g[0] for name, g in zip(shapes, gemms)}
        region_s = (ag + rs) if plan.sequence_parallel else ar
        recompute, tp_again, ep_again = module_recompute_s(model, training, plan, rates, tokens, att_f, gemm_fwd,
                                                           region_s if plan.tp > 1 else 0.0, x)
        tp_bwd, ep_bwd = tp_bwd + tp_again, ep_bwd + ep_again
    if plan.recompute == "full":
        tp_bwd += tp_fwd  # the recomputed forward repeats its collectives
        ep_bwd += ep_fwd  # and its token dispatch and combine
        tp_bwd += distributed_checkpoint_gather_s(training, plan, buf, tp_group, hw)
    if plan.recompute == "full" or (plan.recompute == "selective" and
                                    (op_sac or "core_attn" in training.recompute_modules)):
        cp_bwd += cp_fwd  # and its ring exchange
    if moe:  # the per-layer host sync exposes the host's issue time where it exceeds the GPU's (moe_host_s)
        host_f, host_b = moe_host_s(model, hw, training, plan)
        gpu_f = fwd + tp_fwd + cp_fwd + ep_fwd
        if model.capacity_factor is None and moe_host_syncs(training, plan) and not a2a_overlap_active(model, training,
                                                                                                     plan):
            # The sync chain. Dropless, the dispatcher waits for the token counts on the host before the dispatch
            # (MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize at before_ep_alltoall; the flex dispatcher's
            # HybridEP/DeepEP dispatch and TEGroupedMLP's tokens_per_expert.tolist() likewise, core_v0.16.1
            # moe/fused_a2a.py, moe/experts.py), so the GPU is idle when the host starts issuing the experts, and
            # the next layer's attention, shared experts and router reach the GPU only after the host has issued
            # the experts and the combine. From one sync to the next the layer takes at least that host time plus
            # the GPU time of the pre-dispatch work (the layer's GPU forward less the router, experts, permutation
            # and all-to-alls: a lower bound). Not with drop-and-pad routing (no sync) nor under the 1F1B
            # all-to-all overlap (another micro-batch's backward fills the GPU).
            pre_dispatch_s = gpu_f - x.fwd_compute - x.comm_fwd
            host_f = max(host_f, moe_host_after_sync_s(model, hw, training, plan) + pre_dispatch_s)
        # Megatron-Core's clamped activation copies to the device and syncs (activation_sync_split); torchtitan's
        # grouped experts do not run that function
        split = activation_sync_split(model, hw, plan, x) if _experts_issued_one_by_one(training) else None
        if split is None:
            fwd += max(0.0, host_f - gpu_f)
        else:  # a second host sync in the forward: each part exposes its own host time
            h1, g1 = split
            fwd += max(h1, g1) + max(host_f - h1, gpu_f - g1) - gpu_f
        bwd += max(0.0, host_b - (bwd + recompute + tp_bwd + cp_bwd + ep_bwd))
    if plan.cpu_offload_layers:  # the copies to and from host memory, where the layers cannot hide them
        from planner.memory import layer_activation_terms, saved_bytes_per_layer

        copy_s = saved_bytes_per_layer(layer_activation_terms(model, training, plan, moe=moe), "none") / \
            (hw.host_link_gbps * 1e9)
        L, n = model.num_layers, plan.cpu_offload_layers
        fwd, bwd = fwd + offload_exposed_s(copy_s, fwd, L, n) / L, bwd + offload_exposed_s(copy_s, bwd, L, n) / L
    return LayerTime(fwd_compute=fwd, bwd_compute=bwd, recompute=recompute, tp_fwd=tp_fwd, tp_bwd=tp_bwd,
                     cp_fwd=cp_fwd, cp_bwd=cp_bwd, ep_fwd=ep_fwd, ep_bwd=ep_bwd, wgrad=wgrad,
                     ep_alone=x.comm_alone if x is not None else 0.0)


def replicated_kv_gather_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, tokens: float,
                           tp_group) -> tuple[float, float]:
    """(forward, backward) seconds per layer and micro-batch of Megatron-Core's QKV gather when the TP ranks outnumber
    the KV heads (MQA, or GQA with tp > num_query_groups): the fused QKV weight is split evenly over TP, so no rank
    holds whole heads, and ``get_query_key_value_tensors`` all-gathers the QKV output along its last dim before
    slicing this rank's heads out of it (core_v0.16.1 ``transformer/attention.py``:
    ``all_gather_last_dim_from_tensor_parallel_region(mixed_qkv)`` when ``num_query_groups < world_size``); its
    backward is a reduce-scatter along that dim (``tensor_parallel/mappings.py``
    ``_AllGatherFromTensorParallelRegion.backward``). The gathered tensor is the whole layer's ``(q + 2 g d)`` per
    token, 16-bit. Neither is overlapped (TE's userbuffers overlap the linears' own collectives, not this one).
    Zero elsewhere: frameworks that split the KV heads refuse such a tp (``FrameworkProfile.replicates_kv_heads``),
    plan3d validate's miniature builds a KV head per rank, and MLA has no KV heads."""
    from planner.schedules import framework_family

    g = model.kv_heads
    if plan.tp <= g or model.is_mla or framework_family(training.framework) != "megatron":
        return 0.0, 0.0
    gathered = tokens * (model.q_size + 2 * g * model.kv_channels) * act_bytes(training)
    return (comm.collective_time_s("all_gather", gathered, tp_group, hw),
            comm.collective_time_s("reduce_scatter", gathered, tp_group, hw))


def distributed_checkpoint_gather_s(training: TrainingSpec, plan: Plan, input_bytes: float, tp_group,
                                    hw: HardwareSpec) -> float:
    """Seconds per layer and micro-batch to gather a distributed checkpoint's input back before the recompute
    (Megatron ``--distribute-saved-activations``, ``memory.distributes_checkpoints``): core_v0.16.1
    ``CheckpointFunction.backward`` calls ``gather_split_1d_tensor``, one all-gather of the ``input_bytes`` layer
    input over the TP group on the compute stream, nothing to overlap it with. Uniform groups of N layers
    (``plan.recompute_group_layers``) checkpoint one input per group: 1/N of a gather per layer (exact where N
    divides the chunk). 0 where the checkpoints are not distributed."""
    from planner.memory import distributes_checkpoints

    if not distributes_checkpoints(training, plan):
        return 0.0
    return comm.collective_time_s("all_gather", input_bytes, tp_group, hw) / (plan.recompute_group_layers or 1)


def offload_windows(num_layers: int, offload_layers: int) -> tuple[int, ...]:
    """Layers of compute each offloaded layer's copy overlaps, in forward (to the host) and in backward
    (back to the GPU), for ``N = offload_layers`` of ``L = num_layers`` layers.

    Transformer Engine 2.9 ``pytorch/cpu_offload.py::AsyncDoubleBufferGroupOffloadHandler`` (Megatron-LM
    core_v0.16.1 builds it through ``extensions/transformer_engine.py::get_cpu_offload_context``):
    ``layer_window_map[i] = (L // N)(i + 1) - 1``, plus ``i + 1`` for the first ``L % N`` groups and the
    last such ``i + 1`` for the rest. Forward: group 0's copy starts after layer 0, group ``i``'s at the
    commit of layer ``w[i-1]``, and the compute stream waits for it at the commit of ``w[i]``
    (``synchronize_on_group_commit_forward``): it overlaps layers ``w[i-1]+1 .. w[i]``, ``w[0]`` for
    group 0. Backward (``on_group_commit_backward``): group ``i``'s reload is issued when the backward
    reaches ``w[i]`` and waited for at ``w[i-1]`` (at layer 0 for group 0): the same counts."""
    q, r = divmod(num_layers, offload_layers)
    w, extra = [], 0
    for i in range(offload_layers):
        if i < r:
            extra = i + 1
        w.append(q * (i + 1) - 1 + extra)
    return tuple([w[0]] + [b - a for a, b in zip(w, w[1:])])


def offload_exposed_s(copy_s: float, layer_s: float, num_layers: int, offload_layers: int) -> float:
    """Per micro-batch, the part of ``offload_layers`` copies of ``copy_s`` each (one direction) not hidden
    by the compute they overlap (:func:`offload_windows` layers of ``layer_s``); the copies run on their own
    CUDA streams, so only what exceeds the window is exposed. The HBM traffic of the copies is not charged
    to the compute beside them."""
    return sum(max(0.0, copy_s - k * layer_s) for k in offload_windows(num_layers, offload_layers))


def _head_time_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, order: str) -> tuple[float, float]:
    """(compute, tp comm) of the output layer and cross entropy on the last stage, per micro-batch."""
    rates = Rates.of(hw, gemm_precision(training, hw))
    tokens = plan.micro_batch_size * training.seq_len / plan.cp
    v_r = padded_vocab_size(model.vocab_size, plan.tp) / plan.tp
    f, dg, wg = gemm_fwd_bwd_s(tokens, model.hidden_size, v_r, rates)
    per_logit = 2 + 4 + 4 + 4 + 4 + 2  # bf16 logits -> fp32 softmax -> grad -> bf16
    eager_loss = frameworks.get(training.framework).eager_loss_bytes_per_logit
    if eager_loss is not None and not training.compiled_loss:  # the framework's eager loss, counted on its own code
        per_logit = sum(eager_loss)
    ce = tokens * v_r * per_logit / rates.hbm_bytes_per_s
    tp_group = axis_span(plan, "tp", hw.nvlink_domain, order)
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
    ep_comm: float = 0.0  # MoE token dispatch/combine and expert-TP collectives
    wgrad: float = 0.0  # weight-gradient GEMMs inside compute (the zero-bubble schedules' W steps)

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.cp_comm + self.pp_comm + self.ep_comm


STAGE_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "fwd", "bwd", "ep_comm", "wgrad")


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
    #: the FLOPs the rates above are of: Megatron's count at its padded vocabulary (flops.model_flops_per_step),
    #: and with the recompute (flops.hardware_flops_per_step); estimate.Estimate reports these
    model_flops_per_step: float = 0.0
    hardware_flops_per_step: float = 0.0

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


# --- the one composition of a step (used by estimate_time and, vectorised, by planner.search) -----

LAYER_KEYS = ("fwd", "bwd", "recompute", "tp", "tp_fwd", "tp_bwd", "cp", "cp_fwd", "cp_bwd", "wgrad")
#: a MoE layer's terms: the same as a dense layer's (``moe_`` prefix) plus its EP communication
MOE_KEYS = tuple(f"moe_{k}" for k in LAYER_KEYS) + ("moe_ep", "moe_ep_fwd", "moe_ep_bwd", "moe_ep_alone")
FACTOR_KEYS = LAYER_KEYS + ("head_compute", "head_tp") + MOE_KEYS


def _layer_factors(lt: LayerTime, prefix: str = "") -> dict[str, float]:
    out = {"fwd": lt.fwd_compute, "bwd": lt.bwd_compute, "recompute": lt.recompute, "tp": lt.tp,
           "tp_fwd": lt.tp_fwd, "tp_bwd": lt.tp_bwd, "cp": lt.cp, "cp_fwd": lt.cp_fwd, "cp_bwd": lt.cp_bwd,
           "wgrad": lt.wgrad}
    if prefix:
        out |= {"ep": lt.ep, "ep_fwd": lt.ep_fwd, "ep_bwd": lt.ep_bwd, "ep_alone": lt.ep_alone}
    return {prefix + k: v for k, v in out.items()}


def micro_factors(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                  order: str = DEFAULT_ORDER) -> dict[str, float]:
    """Per-micro-batch factors of one plan: one dense layer's terms (:func:`layer_time`), one MoE layer's
    (``moe_*``, zero for a dense model) and the output layer's."""
    head_compute, head_tp = _head_time_s(model, hw, training, plan, order)
    dense = layer_time(model, hw, training, plan, order)
    moe = layer_time(model, hw, training, plan, order, moe=True) if model.is_moe else None
    if model.mtp_num_layers:
        head_compute, head_tp = _with_mtp_s(model, hw, training, plan, head_compute, head_tp,
                                            moe if model.mtp_is_moe() else dense)
    out = _layer_factors(dense) | {"head_compute": head_compute, "head_tp": head_tp}
    if moe is not None:
        return out | _layer_factors(moe, "moe_")
    return out | dict.fromkeys(MOE_KEYS, 0.0)


def _with_mtp_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, head_compute: float,
                head_tp: float, layer: LayerTime) -> tuple[float, float]:
    """The output layer's (compute, TP) terms with the multi-token-prediction modules added
    (``ModelSpec.mtp_num_layers``), which run on the loss stage after the decoder (Megatron-Core core_v0.16.1
    ``gpt_model.py``, ``MultiTokenPredictionBlock``). Per module and micro-batch: one layer of the last layer's
    kind (``layer``: its forward, backward, recompute, CP and EP terms counted as compute, its TP as TP),
    ``eh_proj``, a column-parallel ``[tokens, 2h] x [2h, h/t]`` GEMM (:func:`gemm_fwd_bwd_s`), and the output
    layer and loss once more (the head's own terms). The norms are left out (three ``h``-wide passes beside the
    layer's)."""
    n = model.mtp_num_layers
    rates = Rates.of(hw, gemm_precision(training, hw), training.attention)
    tokens = plan.micro_batch_size * training.seq_len / plan.cp
    eh = sum(gemm_fwd_bwd_s(tokens, 2 * model.hidden_size, model.hidden_size / plan.tp, rates))
    layer_s = layer.fwd_compute + layer.bwd_compute + layer.recompute + layer.cp + layer.ep
    return head_compute * (1 + n) + n * (layer_s + eh), head_tp * (1 + n) + n * layer.tp


def stage_terms(n, last, f: dict, hop, pp: int, vpp: int, overlap_p2p: bool, c: float, n_moe=None,
                empty=0, alone=0.0) -> dict:
    """Per-micro-batch terms of stage rows, vectorised: ``n`` and ``last`` are arrays over the rows
    [K]; every factor in ``f`` and ``hop`` is a scalar or an array over options [U]; results are [U, K].

    A stage of ``n`` layers: ``n`` x each layer term, plus the output layer on the last stage, plus
    its exposed P2P. With ``n_moe`` (MoE models; [K], from ``Plan.stage_moe_layers``) ``n - n_moe`` dense
    layers and ``n_moe`` MoE layers (the ``moe_*`` factors), whose EP communication is ``ep_comm``.
    ``fwd`` and ``bwd`` split the total into the forward and backward parts (P2P half each), for the DP
    overlap window and the timeline.

    P2P: one receive forward and one backward per chunk and micro-batch. Megatron's interleaved
    schedule with ``overlap_p2p_comm`` (default on with vpp > 1) posts each chunk's send/receive
    asynchronously and waits for it only before the chunk that needs it, so the transfer runs
    behind the compute of the chunk in between (Megatron-Core
    ``schedules.forward_backward_pipelining_with_interleaving``); only what exceeds that chunk
    (``n / vpp`` layers), plus SM contention, is exposed. Otherwise every transfer is exposed.
    ``empty`` ([K] or scalar): chunks of the row with no transformer layer (rank 0's embedding chunk,
    the last rank's loss chunk: ``specs.min_stage_layers``); they hide nothing, so their transfers are
    exposed whole and the ``n`` layers fill the ``vpp - empty`` others.
    ``alone`` (a scalar or [U]): under the MoE all-to-all overlap, the share of the micro-batches that run alone
    (:func:`a2a_alone_share`), each exposing ``moe_ep_alone`` more per MoE layer (half forward, half backward).
    """
    def col(x):
        return np.asarray(x, dtype=float)[..., None]

    n, last = np.asarray(n, dtype=float), np.asarray(last, dtype=float)
    if n_moe is not None:
        return _moe_stage_terms(n, last, np.asarray(n_moe, dtype=float), f, hop, pp, vpp, overlap_p2p, c, empty,
                                alone)
    fwd, bwd, hop_c = col(f["fwd"]), col(f["bwd"]), col(hop)
    pp_t = _p2p_exposed_s(n * fwd, n * bwd, n, hop_c, pp, vpp, overlap_p2p, c, empty)
    hc, ht = col(f["head_compute"]) * last, col(f["head_tp"]) * last
    share = fwd / (fwd + bwd)
    compute = n * (fwd + bwd) + hc
    recompute = n * col(f["recompute"]) + 0.0 * hc
    tp = n * col(f["tp"]) + ht
    cp = n * col(f["cp"]) + 0.0 * hc
    return {"compute": compute, "recompute": recompute, "tp_comm": tp, "cp_comm": cp, "pp_comm": pp_t,
            "total": compute + recompute + tp + cp + pp_t, "wgrad": n * col(f["wgrad"]),
            "fwd": n * (fwd + col(f["tp_fwd"]) + col(f["cp_fwd"])) + hc * share + pp_t / 2,
            "bwd": n * (bwd + col(f["recompute"]) + col(f["tp_bwd"]) + col(f["cp_bwd"])) + hc * (1 - share) + ht + pp_t / 2}


def _p2p_exposed_s(fwd_all, bwd_all, n, hop_c, pp: int, vpp: int, overlap_p2p: bool, c: float, empty):
    """Exposed P2P of stage rows per micro-batch (the rules in :func:`stage_terms`' docstring): ``fwd_all`` and
    ``bwd_all`` the rows' layer compute [U, K], ``n`` their layers [K], ``hop_c`` one hop [U, 1]."""
    if pp == 1:
        return 0.0 * hop_c * n
    if overlap_p2p and vpp > 1:
        full = vpp - np.asarray(empty, dtype=float)  # chunks holding layers
        return full * (overlapped_s_array(hop_c, fwd_all / full, c) + overlapped_s_array(hop_c, bwd_all / full, c)) \
            + (vpp - full) * 2 * hop_c
    return 2 * vpp * hop_c + 0.0 * n


def _moe_stage_terms(n, last, n_moe, f: dict, hop, pp: int, vpp: int, overlap_p2p: bool, c: float,
                     empty=0, alone=0.0) -> dict:
    """:func:`stage_terms` for a stage of ``n - n_moe`` dense and ``n_moe`` MoE layers (same rules)."""
    def col(x):
        return np.asarray(x, dtype=float)[..., None]

    nd = n - n_moe
    fwd, bwd, hop_c = col(f["fwd"]), col(f["bwd"]), col(hop)

    def layers(key):  # the stage's layers' total of one per-layer term
        return nd * col(f[key]) + n_moe * col(f["moe_" + key])

    fwd_all, bwd_all = layers("fwd"), layers("bwd")
    pp_t = _p2p_exposed_s(fwd_all, bwd_all, n, hop_c, pp, vpp, overlap_p2p, c, empty)
    hc, ht = col(f["head_compute"]) * last, col(f["head_tp"]) * last
    share = fwd / (fwd + bwd)
    compute = fwd_all + bwd_all + hc
    recompute = layers("recompute") + 0.0 * hc
    tp = layers("tp") + ht
    cp = layers("cp") + 0.0 * hc
    half_alone = col(alone) * col(f["moe_ep_alone"]) / 2  # the micro-batches run alone under the a2a overlap
    ep = n_moe * (col(f["moe_ep"]) + 2 * half_alone) + 0.0 * hc
    return {"compute": compute, "recompute": recompute, "tp_comm": tp, "cp_comm": cp, "ep_comm": ep, "pp_comm": pp_t,
            "total": compute + recompute + tp + cp + ep + pp_t, "wgrad": layers("wgrad"),
            "fwd": fwd_all + layers("tp_fwd") + layers("cp_fwd") + n_moe * (col(f["moe_ep_fwd"]) + half_alone)
            + hc * share + pp_t / 2,
            "bwd": bwd_all + layers("recompute") + layers("tp_bwd") + layers("cp_bwd")
            + n_moe * (col(f["moe_ep_bwd"]) + half_alone) + hc * (1 - share) + ht + pp_t / 2}


def compose_step(terms: dict, z3, dp_grad, dp_param, optimizer, m, pp: int, vpp: int, counts, before,
                 overlap_grad_reduce: bool, c: float, schedule: str | None = None, family: str = "torch",
                 grad_every_mb=False, grad_mb_overlap: bool = True, grad_under_own_bwd=True,
                 grad_trail_s=0.0, bubble_of=None, param_gather_overlapped: bool = True,
                 first_stage_buckets_only: bool = False, grad_accum=0.0) -> dict:
    """Step time from stage rows (Narayanan 2021 section 2.2, module docstring), vectorised.

    ``terms`` from :func:`stage_terms` ([..., K]); ``z3`` (ZeRO-3 gathers), ``dp_grad`` and ``dp_param``
    (:func:`dp_sync_parts_s`) per row, broadcastable to it; ``optimizer`` and ``m`` broadcastable to
    the leading dims. ``counts[k]``: how many stages row ``k`` stands for (the bubble averages over
    all ``pp`` stages); ``before[k, j]``: how many stages of row ``j`` come before row ``k``.

    With ``overlap_grad_reduce`` (Megatron ``--overlap-grad-reduce``, and ``--overlap-param-gather``
    with the distributed optimizer, which Megatron allows only together with it) a stage's gradient
    reduction hides under its own last backward and the drain of the stages before it, and its
    parameter all-gather under the next step's first forward, which reaches stage ``k`` after the
    forwards of the stages before it. Otherwise both are exposed.

    ``T = m · X_max + (p - 1) · X_mean / v + exposed DP + optimizer``, X = per-micro-batch stage time
    with the ZeRO-3 gathers' exposed part.

    ``schedule`` (``Plan.pipeline_schedule``): the zero-bubble schedules replace the bubble term by
    :func:`schedule_bubble_s` (the same ``m · X_max`` steady state; their bubble from the action lists), or
    ``bubble_of`` where given (the search's :class:`ZeroBubbleBatch`, the same function run for many plans at once).

    ``grad_every_mb`` (:func:`grad_reduced_every_microbatch`; a bool, or per ZeRO option broadcastable to the
    rows): the framework reduces the gradients in every micro-batch's backward, not once per step. Then
    ``dp_grad`` is paid by every micro-batch, in its stage time X: with ``grad_mb_overlap``
    (:func:`grad_reduce_overlapped`) under that micro-batch's backward, less the ZeRO-3 backward all-gather
    (``z3 / 2``) that shares the DP links with it, else exposed; and nothing is left for the step's end.
    ``grad_under_own_bwd`` False (:func:`grad_reduce_overlaps_last_backward`): a once-per-step reduction that
    starts only after the stage's last backward hides under the drain of the stages before it alone (a bool, or per
    ZeRO option as ``grad_every_mb``). ``param_gather_overlapped`` False (:func:`param_gather_overlapped`): the
    weights' all-gather runs inside the optimizer step, exposed.
    ``grad_trail_s`` (:func:`grad_reduce_trail_s`): how long a per-micro-batch reduction may run on past its own
    backward, under the forward that follows (Megatron-FSDP's reduce-scatter queue); 0 where the compute stream
    waits for it at the end of the backward.
    ``first_stage_buckets_only`` (:func:`first_stage_buckets_only`): only the first row (the first stage in every
    caller) starts its once-per-step reduction during its own last backward; the others, one bucket each, only
    after it, under the drain of the stages before them.
    ``grad_accum`` (:func:`grad_accum_s`, per row as ``z3``): the framework's memory-bound passes of each micro-batch
    over the stage's gradients and parameters, on the compute stream (breakdown term ``param_passes``): added to the
    stage time X whole.
    """
    z3_exposed = overlapped_s_array(z3, terms["compute"], c)
    every = np.asarray(grad_every_mb, dtype=float)
    grad_mb = dp_grad * every
    dp_grad = dp_grad * (1.0 - every)
    if grad_mb_overlap:
        half_z3 = np.asarray(z3) / 2  # the ZeRO-3 gathers of each pass share the DP links with it
        window = np.maximum(terms["bwd"] - half_z3, 0.0) + \
            np.minimum(np.maximum(terms["fwd"] - half_z3, 0.0), grad_trail_s)
        grad_exposed = overlapped_s_array(grad_mb, window, c)
    else:
        grad_exposed = grad_mb + 0.0 * terms["bwd"]
    per_mb = terms["total"] + z3_exposed + grad_exposed + grad_accum
    if schedule in ZB_SCHEDULES and pp > 1:
        w = np.asarray(counts, dtype=float)
        bubble = (bubble_of or schedule_bubble_s)(schedule, pp, vpp, m, (terms["fwd"] @ w) / pp,
                                                  (terms["wgrad"] @ w) / pp, (per_mb @ w) / pp, family)
    else:
        bubble = (pp - 1) * (per_mb @ np.asarray(counts, dtype=float)) / pp / vpp
    if overlap_grad_reduce:
        before = np.asarray(before, dtype=float).T
        own = terms["bwd"] * np.asarray(grad_under_own_bwd, dtype=float)
        if first_stage_buckets_only:
            own = own * (np.arange(own.shape[-1]) == 0)
        gather = overlapped_s_array(dp_param, terms["fwd"] + terms["fwd"] @ before, c) if param_gather_overlapped \
            else dp_param + 0.0 * terms["fwd"]
        exposed = overlapped_s_array(dp_grad, own + terms["bwd"] @ before, c) + gather
    else:
        exposed = np.broadcast_to(dp_grad + dp_param, per_mb.shape)
    dp_exposed = exposed.max(axis=-1)
    step = m * per_mb.max(axis=-1) + bubble + dp_exposed + optimizer
    return {"step": step, "per_mb": per_mb, "z3": z3_exposed, "grad_mb": grad_exposed, "bubble": bubble,
            "dp_exposed": dp_exposed, "grad_accum": np.broadcast_to(grad_accum, per_mb.shape)}


ZB_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")


def schedule_bubble_s(schedule: str, pp: int, vpp: int, m, fwd_s, wgrad_s, total_s, family: str = "torch"):
    """Bubble of a zero-bubble schedule (seconds), elementwise over the options.

    ``fwd_s``, ``wgrad_s`` and ``total_s`` are a mean stage's per-micro-batch forward, weight-gradient GEMM
    and total time; per chunk (``vpp`` chunks per rank) they give ``f = fwd / vpp``, ``w = wgrad / vpp`` and
    ``i = total / vpp - f - w`` (the rest of the backward: data-gradient GEMMs, attention, element-wise ops,
    recompute, exposed TP/CP/EP communication). P2P is already in ``total_s`` (``stage_terms``), so the
    schedule is timed with ``hop_s = 0``. The published closed form where one holds
    (``schedules.bubble_closed_form_s``: ZB-H1, Qi et al. 2024 arXiv:2401.10241 section 2.1), else the
    action lists run against each other (:func:`simulated_bubble_s`: ``schedules.bubble_s``'s rules, over all
    options of one micro-batch count at once)."""
    batch = ZeroBubbleBatch()  # one run of the action lists per micro-batch count, over all options
    out = batch(schedule, pp, vpp, m, fwd_s, wgrad_s, total_s, family)
    owed = batch.owed()
    if owed is None:  # the closed form
        return out
    batch.run()
    return out + owed


def _bubble_runs(schedule: str, pp: int, vpp: int, m, fwd_s, wgrad_s, total_s, family: str):
    """:func:`schedule_bubble_s` up to its simulations: (the closed-form bubble, None) where one holds, else
    (None, (the bubble array, inf where not asked, and the runs it asks: (simulated_bubble_s's program key
    (schedule, pp, vpp, m, family), the options' mask, their f, i, w)))."""
    from planner import schedules

    nv = schedules.chunks_per_rank(schedule, vpp)
    f = np.asarray(fwd_s, dtype=float) / nv
    w = np.asarray(wgrad_s, dtype=float) / nv
    i = np.maximum(np.asarray(total_s, dtype=float) / nv - f - w, 0.0)
    m_b, f, i, w = np.broadcast_arrays(np.asarray(m), f, i, w)
    closed = schedules.bubble_closed_form_s(schedule, pp, vpp, f, i, w)
    if closed is not None:
        return np.asarray(closed, dtype=float), None
    fam = "deepspeed" if family == "deepspeed" else "torch"
    out = np.full(f.shape, np.inf)  # inf: not asked (m < 1: the search's illegal or non-fitting combinations)
    asked = [((schedule, pp, vpp, int(mv), fam), sel, f[sel], i[sel], w[sel])
             for mv in np.unique(m_b[m_b >= 1]) for sel in [m_b == mv]]
    return None, (out, asked)


class ZeroBubbleBatch:
    """:func:`schedule_bubble_s` for many plans with one simulation per action program: the search's tables ask
    it for every shape (``compose_step``'s ``bubble_of``), get a placeholder (0 where a simulation is owed, inf
    where none is asked, the closed form where one holds), and add :meth:`owed` to the step once :meth:`run`
    has run every program once over all the options that asked for it. The same numbers as asking plan by
    plan: :func:`simulated_bubble_s` is elementwise over its options."""

    def __init__(self) -> None:
        self._asked: dict[tuple, list] = {}
        self._pending: list = []

    def __call__(self, schedule: str, pp: int, vpp: int, m, fwd_s, wgrad_s, total_s, family: str = "torch"):
        closed, runs = _bubble_runs(schedule, pp, vpp, m, fwd_s, wgrad_s, total_s, family)
        if closed is not None:
            return closed
        out, asked = runs
        owed = np.where(np.isinf(out), np.inf, 0.0)  # filled in by run()
        for key, sel, f, i, w in asked:
            out[sel] = 0.0
            self._asked.setdefault(key, []).append((owed, sel, f, i, w))
        self._pending.append(owed)
        return out

    def merge(self, other: "ZeroBubbleBatch") -> None:
        """Take ``other``'s asks (the search's table workers each collect their own; the simulations then run once
        over all of them, here)."""
        for key, asks in other._asked.items():
            self._asked.setdefault(key, []).extend(asks)
        other._asked = {}

    def owed(self):
        """The bubbles owed to the last :meth:`__call__` (None if it needed no simulation); :meth:`run` fills them."""
        return self._pending.pop() if self._pending else None

    def tasks(self) -> list[tuple]:
        """The simulations :meth:`run` will run, one per action program: (program key, f, i, w of every option
        that asked for it), the largest program first (``size``)."""
        out = [(key, *(np.concatenate([a[k] for a in asks]) for k in (2, 3, 4))) for key, asks in self._asked.items()]
        return sorted(out, key=lambda t: -self.size(t[0]))

    @staticmethod
    def size(key: tuple) -> int:
        """A program's length in (rank, chunk, micro-batch) steps, ``pp x vpp x m``: what its simulation's time
        grows with (``schedules.action_program``)."""
        return key[1] * (key[2] or 1) * key[3]

    def run(self, map_fn=map, tasks: list | None = None) -> None:
        """One simulation per action program over every option that asked for it (:func:`simulate_task`, mapped
        over :meth:`tasks` by ``map_fn``: the search passes its worker pool's; each program is simulated alone, so
        the results are the same whichever process runs it); a micro-batch count the schedule refuses
        (``schedules.schedule_problems`` says why) leaves inf, as in :func:`schedule_bubble_s`. ``tasks``: what
        :meth:`tasks` returned, where the caller already has it (nothing may be asked in between)."""
        tasks = self.tasks() if tasks is None else tasks
        for (key, *_), got in zip(tasks, map_fn(simulate_task, tasks)):
            at = 0
            for owed, sel, fa, _, _ in self._asked[key]:
                owed[sel] = got[at:at + fa.shape[0]]
                at += fa.shape[0]
        self._asked.clear()


def simulate_task(task: tuple) -> np.ndarray:
    """One :meth:`ZeroBubbleBatch.tasks` entry simulated (:func:`simulated_bubble_s`); inf for a micro-batch count
    the schedule refuses (``schedules.schedule_problems`` says why). Module-level, so a worker pool can run it.

    Each distinct (f, i, w) is simulated once: the search asks with every (micro-batch option, ZeRO stage), and
    the ZeRO stage does not change a chunk's times, so about half the options repeat another (Mixtral-8x7B and
    Llama-3-8B under torchtitan, 2026-12-04); :func:`simulated_bubble_s` is elementwise over its options, so an
    option's bubble is the same computed alone or with others."""
    key, f, i, w = task
    distinct, inverse = np.unique(np.stack([f, i, w], axis=1), axis=0, return_inverse=True)
    try:
        got = simulated_bubble_s(*key[:4], distinct[:, 0], distinct[:, 1], distinct[:, 2], key[4])
    except ValueError:
        return np.full(f.shape, np.inf)
    return got[inverse.reshape(-1)]


@functools.lru_cache(maxsize=256)
def _schedule_program(schedule: str, p: int, v: int, m: int, family: str):
    """``schedules.action_program`` as waves for :func:`simulated_bubble_s`: the actions grouped by their depth in
    the dependency graph (an action's wave is one more than the later of the action before it on its rank and the
    one it waits for), each wave as (actions, kinds, the action before, the action waited for), a missing one
    pointing at the row after the last action, which stays 0; the ranks' last actions; and each rank's action
    counts per kind [p, 4] (its work for any durations)."""
    from planner import schedules

    kinds, _, ranks, deps, prevs, last = schedules.action_program(schedule, p, m, v, family)
    n = len(kinds)
    depth = [0] * n
    for a, (d, q) in enumerate(zip(deps, prevs)):  # the program lists every action after its inputs
        depth[a] = 1 + max(depth[d] if d >= 0 else -1, depth[q] if q >= 0 else -1)
    depth_a, kinds_a = np.array(depth, dtype=int), np.array(kinds, dtype=int)
    prevs_a, deps_a = np.array(prevs, dtype=int), np.array(deps, dtype=int)
    prevs_a[prevs_a < 0], deps_a[deps_a < 0] = n, n
    order = np.argsort(depth_a, kind="stable")
    bounds = np.searchsorted(depth_a[order], np.arange(depth_a.max() + 2 if n else 1))
    waves = tuple((order[lo:hi], kinds_a[order[lo:hi]], prevs_a[order[lo:hi]], deps_a[order[lo:hi]])
                  for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo)
    counts = np.zeros((p, 4))
    np.add.at(counts, (np.array(ranks, dtype=int), kinds_a), 1.0)
    return n, waves, np.array([a for a in last if a >= 0], dtype=int), counts


def simulated_bubble_s(schedule: str, pp: int, vpp: int, m: int, f_s, i_s, w_s, family: str = "torch"):
    """``schedules.bubble_s`` with ``hop_s = 0`` and uniform stages, for arrays of per-chunk (f, i, w) at once:
    the same rules (each rank in list order, each action when the rank is free and its input is there; a full
    backward B lasts i + w), run as one program over the options (``schedules.action_program``). An action ends
    at max(end of the action before it on its rank, end of its input) + its duration; the actions of one wave
    (:func:`_schedule_program`) depend only on earlier waves, so each wave is one array step (a missing action
    reads the zero row, and max(x, 0) = x for the non-negative ends: the same sums as action by action). Every
    operation is elementwise over the options, so an option's bubble does not depend on the others asked with it
    (:class:`ZeroBubbleBatch` asks many at once). tests/test_schedules_hook.py checks it equals
    ``schedules.bubble_s``."""
    n, waves, last, counts = _schedule_program(schedule, pp, vpp, m, family)
    f, i, w = (np.atleast_1d(np.asarray(x, dtype=float)) for x in (f_s, i_s, w_s))
    dur = np.stack([f, i, w, i + w])  # [4, K]
    end = np.zeros((n + 1, f.shape[0]))
    for acts, k, q, d in waves:
        end[acts] = np.maximum(end[q], end[d]) + dur[k]
    step = end[last].max(axis=0)
    work = counts[:, 0:1] * f + counts[:, 1:2] * i + counts[:, 2:3] * w + counts[:, 3:4] * dur[3]  # [p, K]
    return step - work.max(axis=0)


def overlapped_s_array(comm_s, compute_s, c: float):
    """:func:`overlapped_s`, elementwise on arrays."""
    return np.maximum(0.0, comm_s - compute_s) + c * np.minimum(comm_s, compute_s)


def _rows_of_all_stages(plan: Plan, num_layers: int):
    layers = plan.stage_layers(num_layers)
    p = plan.pp
    return (np.array(layers, dtype=float), np.arange(p) == plan.loss_stage, np.ones(p),
            np.tril(np.ones((p, p)), -1))


def stage_times(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                order: str = DEFAULT_ORDER) -> tuple[StageTime, ...]:
    """Per-micro-batch time of every stage; uneven stages are costed from their own layer counts.

    Megatron's block recompute (``plan.recompute_num_layers``): every term of a stage is the share of its layers
    recomputed (``specs.recomputed_share``) of the stage under full recompute, and the rest of it under none (the
    per-layer terms add up layer by layer; the others are the same under both). torchtitan's per-layer AC
    (``plan.recompute_interval``) the same way, with its share."""
    if plan.partial_recompute:
        whole = plan.model_copy(update={"recompute_num_layers": None, "recompute_interval": None})
        full = stage_times(model, hw, training, whole, order)
        none = stage_times(model, hw, training, whole.model_copy(update={"recompute": "none"}), order)
        out = []
        for st_f, st_n, n in zip(full, none, plan.stage_layers(model.num_layers)):
            share = plan.recomputed_share(st_f.stage, n)[0]
            out.append(StageTime(stage=st_f.stage, **{k: share * getattr(st_f, k) + (1 - share) * getattr(st_n, k)
                                                    for k in STAGE_TERMS}))
        return tuple(out)
    f = micro_factors(model, hw, training, plan, order)
    hop = p2p_hop_s(model, hw, training, plan, pp_hop_crosses_nodes(plan, hw.nvlink_domain, order),
                    axis_span(plan, "tp", hw.nvlink_domain, order))
    n, last, _, _ = _rows_of_all_stages(plan, model.num_layers)
    n_moe = plan.stage_moe_layers(model) if model.is_moe else None
    empty = np.array(plan.empty_chunks(model.num_layers), dtype=float)
    alone = a2a_alone_share(plan_microbatches(training, plan), plan.pp, plan.vpp,
                            plan.microbatch_group_size)
    t = stage_terms(n, last, f, hop, plan.pp, plan.vpp, resolved_overlap(training).overlap_p2p_comm, contention(hw),
                    n_moe, empty, alone)
    ep = t.get("ep_comm")
    return tuple(StageTime(stage=r, compute=float(t["compute"][r]), recompute=float(t["recompute"][r]),
                           tp_comm=float(t["tp_comm"][r]), cp_comm=float(t["cp_comm"][r]),
                           pp_comm=float(t["pp_comm"][r]), fwd=float(t["fwd"][r]), bwd=float(t["bwd"][r]),
                           ep_comm=0.0 if ep is None else float(ep[r]), wgrad=float(t["wgrad"][r]))
                 for r in range(plan.pp))


def stage_moe_counts(model: ModelSpec, plan: Plan) -> tuple[int, ...]:
    """``plan.stage_moe_layers(model)`` (cached there on what it depends on)."""
    return plan.stage_moe_layers(model)


def grad_reduced_every_microbatch(framework: str, zero_stage: int, pp: int) -> bool:
    """Whether the framework reduces a stage's gradients in every micro-batch's backward (``True``) or once per
    step, after the last one (``False``). Per its code (docs/cost-model.md "DP"):

    * **Megatron-Core / NeMo**, ZeRO 0-1 (``DistributedDataParallel``, the distributed optimizer): once; the
      schedules run every backward but the last under ``no_sync`` and the buffer accumulates the full-size grads.
      ZeRO 2-3 (Megatron-FSDP ``optim_grads`` / ``optim_grads_params``): every backward. core_v0.16.1
      ``core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py`` ``_process_post_backward_gradients`` and
      ``_root_post_backward``: ``grad_reduce_every_bprop`` is true for those strategies and the reduce-scatter is
      launched whatever ``is_last_microbatch`` says (``no_sync``: "For grads shard mode there will actually always
      be gradient sync happening"); ``param_and_grad_buffer.py::GradReducePipeline._bucket_group_gradient_reduce``
      adds each reduced shard into the sharded ``main_grad`` buffer (``local_grad += reduced_grad``).
    * **DeepSpeed**, ZeRO 0-1: once, at the gradient-accumulation boundary (deepspeed 0.19.8
      ``runtime/engine.py::allreduce_gradients``, ``zero/stage_1_and_2.py::reduce_ready_partitions_and_remove_grads``
      reduces only ``if self.partition_gradients or self.is_gradient_accumulation_boundary()``). ZeRO 2-3: every
      backward ("ZeRO stage >= 2 communicates during non gradient accumulation boundaries as well",
      ``engine.py``; ``stage3.py::partition_grads`` adds each micro-batch's reduced partition into the fp32 one);
      ``engine.no_sync`` asserts it is not used with gradient partitioning. Counted on the engine on CPU
      (tests/deepspeed_grad_sync_probe.py): 0, 0, 1 bucket reductions over 3 backwards at ZeRO-1, 1, 1, 1 at 2 and 3.
    * **torchtitan / torch** (FSDP2 ``fully_shard``, ZeRO 0 as its replicate mesh): without PP, every backward:
      torchtitan 0.3.0 ``trainer.py::train_step`` runs ``loss.backward()`` per accumulation step and never calls
      ``set_requires_gradient_sync(False)`` (tests/test_cost_dp_sync.py counts FSDP2's reduce-scatters: one set
      per backward). With PP, once: ``torch.distributed.pipelining`` ``PipelineStage.backward_maybe_with_nosync``
      turns gradient sync off for every backward and ``perform_reduce_grad`` reduces after the stage's last one
      (torchtitan runs one ``pp_schedule.step`` per step, planner/emit/torchtitan.py).
    """
    if framework in ("torch", "torchtitan"):
        return pp == 1
    return zero_stage >= 2


def grad_reduce_overlaps_last_backward(framework: str, pp: int, zero_stage: int = 1) -> bool:
    """Whether a once-per-step gradient reduction starts during the stage's last backward (Megatron's buckets,
    DeepSpeed's ZeRO hooks: as each bucket's gradients are final) or only after it.

    ``torch.distributed.pipelining`` (torch, torchtitan with pp > 1) reduces in the ``REDUCE_GRAD`` action that
    ``_add_reduce_grad`` places after the stage's last backward (``schedules.py``; ``PipelineStage.perform_reduce_grad``
    runs FSDP2's ``post_backward`` for every parameter group then), and FSDP2's ``_root_post_backward_final_callback``
    makes the compute stream wait for it: only the drain of the stages before it is left to hide it.

    DeepSpeed (0.19.8) reduces during the backward only through the ZeRO optimizer's gradient hooks at stage 1 or
    more without a pipeline. At stage 0 (plain or ``BF16_Optimizer``) the engine all-reduces in
    ``_backward_epilogue``, after ``loss.backward`` returns (``runtime/engine.py``). Its pipeline engine runs a
    ``ReduceGrads`` instruction after the last ``BackwardPass`` (``pipe/schedule.py`` ``TrainSchedule.steps``:
    ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep`` at the last step), and its gradient-accumulation boundary
    is true only inside that instruction (``pipe/engine.py`` ``_exec_reduce_grads`` sets ``_force_grad_boundary``),
    so the stage-1 hooks, which reduce only at the boundary (``stage_1_and_2.py``), reduce nothing during the
    backward."""
    if framework == "deepspeed":
        return pp == 1 and zero_stage >= 1
    return not (framework in ("torch", "torchtitan") and pp > 1)


def param_gather_overlapped(training: TrainingSpec) -> bool:
    """Whether the all-gather of the updated 16-bit weights (ZeRO 1-2, :func:`dp_sync_parts_s`) can hide under the next
    step's first forward (Megatron ``--overlap-param-gather``, which the distributed optimizer takes with
    ``--overlap-grad-reduce``). DeepSpeed gathers inside the optimizer step, before it returns:
    ``DeepSpeedZeroOptimizer.step`` and ``BF16_Optimizer.update_lp_params`` call ``all_gather_dp_groups``
    (0.19.8 ``runtime/zero/stage_1_and_2.py``, ``runtime/bf16_optimizer.py``), so there it is exposed. So is
    dist_muon's (``LayerWiseDistributedOptimizer.step`` calls ``allgather_params`` before it returns; Megatron asserts
    no ``--overlap-param-gather`` with Muon, core_v0.16.1 arguments.py)."""
    return training.framework != "deepspeed" and training.optimizer == "adam"


def first_stage_buckets_only(framework: str, pp: int) -> bool:
    """Whether only the first pipeline stage reduces its gradients bucket by bucket during its last backward.
    Megatron-Core's ``DistributedDataParallel`` turns bucketing off on every other pipeline rank (core_v0.16.1
    ``distributed/distributed_data_parallel.py``: ``if disable_bucketing or pp_rank > 0: self.bucket_size = None``,
    "since data-parallel communication on these stages is not on the critical path"; counted on Megatron's own DDP
    by tests/test_megatron_states.py), so there all its parameters form one bucket, whose reduction starts when the last
    gradient is ready: after the stage's last backward. It hides only under the backward the stages before it still
    run, while ``finalize_model_grads`` waits for it (``finish_grad_sync``). Megatron and NeMo (its DDP) at ZeRO 0-1;
    Megatron-FSDP (ZeRO 2-3) reduces in every micro-batch instead (:func:`grad_reduced_every_microbatch`)."""
    return framework in ("megatron", "nemo") and pp > 1


def grad_reduce_overlapped(training: TrainingSpec) -> bool:
    """Whether a per-micro-batch gradient reduction (:func:`grad_reduced_every_microbatch`) runs beside that
    micro-batch's backward. Megatron-FSDP forces ``overlap_grad_reduce`` for ``optim_grads[_params]`` (core_v0.16.1
    ``megatron_fsdp.py``: "Gradient reduce-scatter must be overlapped when using sharding optimizer and
    gradients") and reduce-scatters on a side stream; FSDP2 on its reduce-scatter stream. DeepSpeed reduces on
    its ``reduction_stream`` / ``reduce_and_partition_stream`` only with ``overlap_comm`` (``plan3d emit
    deepspeed`` writes ``overlap_grad_reduce`` there), else on the compute stream (``stage3.py``:
    ``Stream() if overlap_comm else default_stream()``; ``stage_1_and_2.py::reduce_ipg_grads``)."""
    return training.overlap_grad_reduce if training.framework == "deepspeed" else True


def overlap_grad_reduce_of(training: TrainingSpec) -> bool:
    """Whether the step's once-per-step gradient reduction hides under the backward (``compose_step``): the job's
    ``overlap_grad_reduce`` (Megatron ``--overlap-grad-reduce``, DeepSpeed ``overlap_comm``), except under FSDP2
    (torchtitan, and the torch run of ``plan3d validate``), which always reduce-scatters on its own stream after each
    FSDP module's backward (torch ``fully_shard``: ``FSDPParamGroup.post_backward`` on the ``reduce_scatter_stream``)
    and has no switch to do otherwise, so the flag cannot change what it runs. Megatron runs Muon without the overlap
    (core_v0.16.1 arguments.py: "Muon optimizer does not support overlap grad reduce for now")."""
    if training.optimizer != "adam":
        return False
    return True if training.framework in ("torchtitan", "torch") else training.overlap_grad_reduce


def grad_reduce_trail_s(hw: HardwareSpec, training: TrainingSpec, plan: Plan, order: str = DEFAULT_ORDER) -> float:
    """Seconds a per-micro-batch gradient reduction (:func:`grad_reduced_every_microbatch`) may run on past the end of
    its own backward before the compute stream has to wait for it; 0 where the framework waits at the end of every
    backward (``FrameworkProfile.grad_reduce_queue_elements`` None: FSDP2, DeepSpeed).

    Megatron-FSDP (ZeRO 2-3 under Megatron-Core and NeMo) issues each bucket's reduce-scatter asynchronously and
    waits for the oldest only when more than ``Q`` gradient elements are queued (``MEGATRON_FSDP_RS_QUEUE_ELEMENTS``,
    one queue per model chunk), so the reduction trails its backward by up to the time to reduce-scatter ``Q``
    elements per chunk over the DP x CP group, under the forward that follows; ``vpp`` chunks queue side by side.
    The dense DP group stands for the expert-data-parallel one of a MoE model's expert gradients."""
    queue = frameworks.get(training.framework).grad_reduce_queue_elements
    shards = plan.dp * plan.cp
    if queue is None or shards == 1:
        return 0.0
    group = axis_span(plan.model_copy(update={"dp": shards, "cp": 1}), "dp", hw.nvlink_domain, order)
    return plan.vpp * comm.collective_time_s("reduce_scatter", queue * grad_bytes(training), group, hw)


def grad_reduction_args(training: TrainingSpec, pp: int, zero_stages, trail_s: float = 0.0) -> dict:
    """:func:`compose_step`'s gradient-reduction keywords for a job: ``grad_every_mb``
    (:func:`grad_reduced_every_microbatch`; a bool for one ZeRO stage, a ``[Z, 1]`` array for a sequence of them,
    as the search's tables hold them), ``grad_mb_overlap`` (:func:`grad_reduce_overlapped`),
    ``grad_under_own_bwd`` (:func:`grad_reduce_overlaps_last_backward`, per ZeRO option as ``grad_every_mb``),
    ``param_gather_overlapped`` (:func:`param_gather_overlapped`) and ``grad_trail_s`` (``trail_s``,
    :func:`grad_reduce_trail_s` of the plan)."""
    fw = training.framework

    def hooked(z: int) -> int:
        # DeepSpeed's BF16_Optimizer at ZeRO stage 1 reduces as stage 0 does, in the engine after the backward
        # (0.19.8 engine.py allreduce_gradients: buffered_allreduce_fallback; frameworks.deepspeed.optimizer_wrapper)
        return 0 if fw == "deepspeed" and deepspeed_framework.optimizer_wrapper(training, z, pp) != "zero" else z

    if isinstance(zero_stages, int):
        every = grad_reduced_every_microbatch(fw, zero_stages, pp)
        under = grad_reduce_overlaps_last_backward(fw, pp, hooked(zero_stages))
    else:
        every = np.array([grad_reduced_every_microbatch(fw, z, pp) for z in zero_stages])[:, None]
        under = np.array([grad_reduce_overlaps_last_backward(fw, pp, hooked(z)) for z in zero_stages])[:, None]
    return {"grad_every_mb": every, "grad_mb_overlap": grad_reduce_overlapped(training),
            "grad_under_own_bwd": under, "grad_trail_s": trail_s,
            "param_gather_overlapped": param_gather_overlapped(training),
            "first_stage_buckets_only": first_stage_buckets_only(fw, pp)}


def _sync_s(params: float, shards: int, group, hw: HardwareSpec, training: TrainingSpec, zero_stage: int, pp: int):
    if shards == 1 or params == 0:
        return 0.0, 0.0
    g = params * grad_bytes(training)
    wrapper = deepspeed_framework.optimizer_wrapper(training, zero_stage, pp) \
        if training.framework == "deepspeed" else None
    if zero_stage == 0 and training.optimizer == "dist_muon":
        # Megatron's DDP all-reduces the gradients; LayerWiseDistributedOptimizer all-gathers the updated 16-bit
        # parameters after the step (planner.muon)
        return (comm.collective_time_s("all_reduce", g, group, hw),
                comm.collective_time_s("all_gather", params * param_bytes(training)[0], group, hw))
    if zero_stage == 0 or wrapper == "bf16_optimizer":
        # DeepSpeed's BF16_Optimizer is its own ZeRO-1: the gradients all-reduced, each rank steps its 1/dp of the
        # fp32 master weights and all-gathers the bf16 ones (0.19.8 bf16_optimizer.py update_lp_params,
        # all_gather_dp_groups); which configs run it: planner.frameworks.deepspeed.optimizer_wrapper
        gather = comm.collective_time_s("all_gather", params * param_bytes(training)[0], group, hw) \
            if wrapper == "bf16_optimizer" else 0.0
        return comm.collective_time_s("all_reduce", g, group, hw), gather
    gather = 0.0 if zero_stage >= 3 else comm.collective_time_s("all_gather", params * _gathered_weight_bytes(training),
                                                                 group, hw)
    return comm.collective_time_s("reduce_scatter", g, group, hw), gather


def _gathered_weight_bytes(training: TrainingSpec) -> float:
    """Bytes per parameter the distributed optimizer all-gathers after its step: fp8 parameters (--fp8-param-gather)
    as fp8, 1 B each (Megatron-Core core_v0.16.1 distributed_data_parallel.py keeps them in a uint8 buffer); mxfp8
    ones as bf16 into the shared gradient buffer (param_and_grad_buffer.py, planner/frameworks/megatron.py); else the
    16-bit weights."""
    return 1 if training.fp8_params and training.precision == "fp8" else param_bytes(training)[0]


def _partial_sync_s(params: float, shards: int, instances: int, groups, hw: HardwareSpec,
                    training: TrainingSpec) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) of a distributed optimizer split into ``instances`` copies
    (``TrainingSpec.dist_optimizer_instances``, ZeRO 1): core_v0.16.1 ``param_and_grad_buffer.py``
    ``start_grad_sync`` reduce-scatters each bucket within its instance (``groups[0]``, ``shards / instances``
    ranks), then all-reduces this rank's shard of it across the instances (``groups[1]``); ``start_param_sync``
    all-gathers the updated weights within the instance."""
    if params == 0:
        return 0.0, 0.0
    intra = shards // instances
    g = params * grad_bytes(training)
    rs = comm.collective_time_s("reduce_scatter", g, groups[0], hw) if intra > 1 else 0.0
    ar = comm.collective_time_s("all_reduce", g / intra, groups[1], hw)
    gather = comm.collective_time_s("all_gather", params * _gathered_weight_bytes(training), groups[0], hw) \
        if intra > 1 else 0.0
    return rs + ar, gather


def dp_sync_parts_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, stage: int, layers: int,
                    order: str = DEFAULT_ORDER) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) of one stage over its DP x CP group (formulas.md C4).

    ZeRO 0: all-reduce of the gradients, nothing gathered. ZeRO 1-2 (Megatron distributed
    optimizer): reduce-scatter of the gradients, all-gather of the updated 16-bit weights after the
    optimizer step. ZeRO 3 (FSDP): reduce-scatter only; its weights are gathered per micro-batch
    (:func:`zero3_gather_s`), not after the step.

    MoE: the expert parameters are reduced (and sharded) over the expert-data-parallel group instead
    (``plan.expert_dp`` ranks ``etp*ep`` apart, :func:`planner.layout.expert_span`; Megatron-Core
    ``expert_data_parallel_group``), after the dense ones on the same stream: the two add.
    """
    # cached on the plan fields it reads: the search asks the same stage kinds of many shapes
    key = (plan.tp, plan.cp, plan.dp, plan.pp, plan.ep, plan.etp, plan.zero_stage, stage == 0,
           stage == plan.loss_stage, layers, stage_moe_counts(model, plan)[stage] if model.is_moe else 0,
           plan.v_shaped)
    return _dp_sync_cached(model, hw, training, key, order)


@functools.lru_cache(maxsize=65536)
def _dp_sync_cached(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, key: tuple, order: str):
    tp, cp, dp, pp, ep, etp, zero, first, last, layers, n_moe, v_shaped = key
    stage = 0 if first else (pp - 1 if last else 1)
    layout = (layers,) * pp if pp > 1 else (layers,)
    # a stand-in plan with the same stage kind, layers and MoE layers on that stage (V: the loss on rank 0)
    plan = Plan.model_construct(tp=tp, cp=cp, dp=dp, pp=pp, vpp=2 if v_shaped else 1, ep=ep, etp=etp, zero_stage=zero,
                                micro_batch_size=1, layers_per_stage=layout,
                                pipeline_schedule="zbv" if v_shaped else None)
    dense_layer, _ = layer_param_split(model, tp, False)
    moe_dense, moe_expert = layer_param_split(model, tp, True, ep, etp) if n_moe else (0.0, 0.0)
    # the stage's layers, plus what it holds besides them (embedding, output layer, MTP modules: dense and expert)
    rest_dense, rest_expert = stage_param_split(model, plan, stage, 0)
    dense = rest_dense + (layers - n_moe) * dense_layer + n_moe * moe_dense
    return _dp_sync_split(dense, rest_expert + n_moe * moe_expert, hw, training, plan, order)


def _dp_sync_split(dense: float, expert: float, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                   order: str) -> tuple[float, float]:
    shards = plan.dp * plan.cp
    n = training.dist_optimizer_instances
    if n > 1:  # partial distributed optimizers (plan_problems: ZeRO 1, n divides both groups)
        rs, ag = _partial_sync_s(dense, shards, n, partial_dp_spans(plan, n, hw.nvlink_domain, order), hw, training)
        if expert:
            ers, eag = _partial_sync_s(expert, plan.expert_dp, n, partial_dp_spans(plan, n, hw.nvlink_domain, order,
                                                                                   expert=True), hw, training)
            rs, ag = rs + ers, ag + eag
        return rs, ag
    group = axis_span(plan.model_copy(update={"dp": shards, "cp": 1}), "dp", hw.nvlink_domain, order) \
        if shards > 1 else None
    rs, ag = _sync_s(dense, shards, group, hw, training, plan.zero_stage, plan.pp)
    if expert:
        ers, eag = _sync_s(expert, plan.expert_dp, expert_span(plan, "edp", hw.nvlink_domain), hw, training,
                           plan.zero_stage, plan.pp)
        rs, ag = rs + ers, ag + eag
    return rs, ag


def dp_sync_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, stage: int, layers: int,
              order: str = DEFAULT_ORDER) -> float:
    """All DP communication of one stage per step (:func:`dp_sync_parts_s`, both parts)."""
    return sum(dp_sync_parts_s(model, hw, training, plan, stage, layers, order))


def zero3_gather_s(model: ModelSpec, hw: HardwareSpec, plan: Plan, stage: int, layers: int,
                   order: str = DEFAULT_ORDER, weight_bytes: int = ACT_BYTES) -> float:
    """ZeRO-3 / FSDP: all-gather the stage's weights in forward and again in backward, per micro-batch."""
    if plan.zero_stage < 3:
        return 0.0
    dense, expert = stage_param_split(model, plan, stage, layers)
    out = 0.0
    if plan.dp * plan.cp > 1:
        group = axis_span(plan.model_copy(update={"dp": plan.dp * plan.cp, "cp": 1}), "dp", hw.nvlink_domain, order)
        out = 2 * comm.collective_time_s("all_gather", dense * weight_bytes, group, hw)
    if expert and plan.expert_dp > 1:  # experts gathered over the expert-data-parallel group
        out += 2 * comm.collective_time_s("all_gather", expert * weight_bytes,
                                          expert_span(plan, "edp", hw.nvlink_domain), hw)
    return out


def grad_accum_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, params: float,
                 last_stage: bool = True) -> float:
    """Per micro-batch: the framework's memory-bound passes that accumulate one stage's gradients outside the GEMMs
    (``FrameworkProfile.grad_accum_bytes_per_param``: DeepSpeed's BF16_Optimizer zeroes its 16-bit gradients,
    autograd adds into them and ``update_hp_grads`` adds them into the fp32 buffer, 26 B per parameter;
    ``planner.frameworks.deepspeed.GRAD_ACCUM_PASSES``, recorded on DeepSpeed's engine; at ZeRO 2 the bucket copies,
    partly over the rank's partition; FSDP2's fp32 unsharded accumulation under a pipeline, 10 B, and without one
    its reduce-scatter copy-in and all-gather copy-outs, 10-14 B: ``planner.frameworks.torchtitan.microbatch_passes``,
    recorded on torch's own ``fully_shard``, also on the compute stream) over the stage's
    ``params`` local parameters (dense and expert, ``stage_param_split``) of the pipeline's last stage or another
    (``last_stage``: DeepSpeed's pipeline engine zeroes the others' gradients twice), at the HBM rate memory-bound
    kernels reach (``Rates.hbm_bytes_per_s``). They run on the compute stream after the micro-batch's backward and before
    the boundary's reduction (``engine.py::_backward_epilogue``), so nothing hides them. Every micro-batch pays
    the steady rate: the step's first skips the zeroing and autograd's add (8 of the 26 B), an overstatement of
    at most 8 / 26 / m of the term. 0 for frameworks that accumulate inside the weight-gradient GEMM (Megatron-Core's
    ``gradient_accumulation_fusion``)."""
    per_param = frameworks.get(training.framework).grad_accum_bytes_per_param
    if per_param is None:
        return 0.0
    b = per_param(training, plan, last_stage)
    return b * params / Rates.of(hw, training.precision).hbm_bytes_per_s if b else 0.0


def stage_grad_accum_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                       split=None) -> np.ndarray:
    """:func:`grad_accum_s` of every pipeline stage [p], each over its own local parameters (``split``: each stage's
    ``stage_param_split``, computed here when not given); all 0 under Megatron-Core."""
    if split is None:
        split = [stage_param_split(model, plan, r, n) for r, n in enumerate(plan.stage_layers(model.num_layers))]
    return np.array([grad_accum_s(model, hw, training, plan, sum(x), r == plan.pp - 1) for r, x in enumerate(split)])


def optimizer_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, params_per_stage,
                expert_params_per_stage=None, stage_rows=None) -> float:
    """Adam on the largest stage's local shard: ``ADAM_BYTES_PER_PARAM`` moved per parameter. MoE: the
    expert parameters (``expert_params_per_stage``) are sharded over the expert-data-parallel group. Muon
    (``training.optimizer``): :func:`muon_step_s` of the slowest of ``stage_rows`` ((stage, layers) of each stage
    kind, in the order of ``params_per_stage``)."""
    if training.optimizer != "adam":
        return max(muon_step_s(model, hw, training, plan, r, n) for r, n in stage_rows)
    n = training.dist_optimizer_instances  # each instance steps its dp x cp / n shard (planner.frameworks.megatron)
    shards = plan.dp * plan.cp // n if plan.zero_stage >= 1 else 1
    local = np.asarray(params_per_stage, dtype=float) / shards
    if expert_params_per_stage is not None:
        expert_shards = plan.expert_dp // n if plan.zero_stage >= 1 else 1
        local = local + np.asarray(expert_params_per_stage, dtype=float) / expert_shards
        return float(local.max()) * ADAM_BYTES_PER_PARAM / Rates.of(hw, training.precision).hbm_bytes_per_s
    return max(params_per_stage) / shards * ADAM_BYTES_PER_PARAM / Rates.of(hw, training.precision).hbm_bytes_per_s


def muon_step_s(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan, stage: int,
                layers: int) -> float:
    """Megatron-Core's Muon step on the busiest GPU of stage ``stage`` (:mod:`planner.muon`): the Newton-Schulz
    GEMMs of the Muon weights it steps, at the bf16 GEMM rates (``--muon-fp32-matmul-prec medium`` casts to bf16,
    Emerging-Optimizers ``newton_schulz``), plus the per-parameter updates of every parameter it steps: the Muon
    weights' ``muon.MUON_UPDATE_BYTES`` (counted from the optimizer's eager ops; until 2026-12-07 charged at Adam's),
    the others' ``ADAM_BYTES_PER_PARAM``. dist_muon: the parameters dealt to that GPU
    (``LayerWiseDistributedOptimizer``)."""
    from planner import muon

    rates = Rates.of(hw, "bf16")
    dense_ranks, expert_ranks = plan.dp * plan.cp, plan.expert_dp
    ns = muon.ns_step_s(model, plan, stage, layers, training.optimizer, dense_ranks, expert_ranks,
                        lambda m, k, n: gemm_time_s(m, k, n, rates))
    moved = muon.update_bytes(model, plan, stage, layers, training.optimizer, dense_ranks, expert_ranks,
                              ADAM_BYTES_PER_PARAM)
    return ns + moved / Rates.of(hw, training.precision).hbm_bytes_per_s


def schedule_family(training: TrainingSpec) -> str:
    """Whose action order the framework runs (``schedules.framework_family``)."""
    from planner.schedules import framework_family

    return framework_family(training.framework)


def estimate_time(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan,
                  order: str = DEFAULT_ORDER) -> TimeEstimate:
    """Step time and its breakdown (module docstring), composed by :func:`compose_step` over every stage."""
    hw = hw.for_job(training.num_gpus)  # the NVLink domain this job's ranks fill (HardwareSpec.job_nvlink_domain)
    m = plan_microbatches(training, plan)
    p, v = plan.pp, plan.vpp
    c = contention(hw)
    stages = stage_times(model, hw, training, plan, order)
    layers = plan.stage_layers(model.num_layers)
    _, _, counts, before = _rows_of_all_stages(plan, model.num_layers)
    terms = {k: np.array([[getattr(st, k) for st in stages]]) for k in
             ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "fwd", "bwd", "ep_comm", "wgrad")}
    terms["total"] = np.array([[st.total for st in stages]])
    z3 = np.array([zero3_gather_s(model, hw, plan, r, n, order, param_bytes(training)[0]) for r, n in enumerate(layers)])
    dp_grad, dp_param = np.array([dp_sync_parts_s(model, hw, training, plan, r, n, order)
                                  for r, n in enumerate(layers)]).T
    split = [stage_param_split(model, plan, r, n) for r, n in enumerate(layers)]
    optimizer = optimizer_s(model, hw, training, plan, [x[0] for x in split],
                            [x[1] for x in split] if model.is_moe else None, list(enumerate(layers)))
    accum = stage_grad_accum_s(model, hw, training, plan, split)
    grad = grad_reduction_args(training, plan.pp, plan.zero_stage, grad_reduce_trail_s(hw, training, plan, order))
    out = compose_step(terms, z3, dp_grad, dp_param, optimizer, m, p, v, counts, before,
                       overlap_grad_reduce_of(training), c, plan.pipeline_schedule, schedule_family(training), **grad,
                       grad_accum=accum)
    pace = int(np.argmax(out["per_mb"][0]))
    sp_ = stages[pace]
    breakdown = {
        "compute": m * sp_.compute, "recompute": m * sp_.recompute, "tp_comm": m * sp_.tp_comm,
        "cp_comm": m * sp_.cp_comm, "pp_comm": m * sp_.pp_comm, "bubble": float(out["bubble"][0]),
        "dp_comm_exposed": float(out["dp_exposed"][0]) + m * float(out["z3"][0, pace] + out["grad_mb"][0, pace]),
        "optimizer": optimizer,
    }
    if model.is_moe:
        breakdown["ep_comm"] = m * sp_.ep_comm
    if frameworks.get(training.framework).grad_accum_bytes_per_param is not None:
        breakdown["param_passes"] = m * float(out["grad_accum"][0, pace])
    step = float(out["step"][0])
    tokens = training.global_batch_size * training.seq_len
    # activated FLOPs (MoE), the output layer at Megatron's padded vocabulary: the count Megatron logs
    vocab = padded_vocab_size(model.vocab_size, plan.tp)
    mf = flops.model_flops_per_step(model, training.global_batch_size, training.seq_len, vocab_size=vocab)
    hf = flops.hardware_flops_per_step(model, training.global_batch_size, training.seq_len, plan.recompute,
                                       recomputed_layers_share(model, plan), vocab_size=vocab)
    peak = hw.peak_flops(training.precision)
    n = training.num_gpus
    return TimeEstimate(step_time_s=step, tokens_per_s=tokens / step, tflops_per_gpu=mf / step / n / 1e12,
                        mfu=flops.mfu(mf, step, n, peak), hfu=flops.hfu(hf, step, n, peak), breakdown=breakdown,
                        stages=stages, dp_comm_s=float((dp_grad * (m if grad["grad_every_mb"] else 1) + dp_param).max()),
                        model_flops_per_step=mf, hardware_flops_per_step=hf)


def recomputed_layers_share(model: ModelSpec, plan: Plan) -> float:
    """Share of the model's layers recomputed under ``plan.recompute`` full (1 unless Megatron's block method,
    ``plan.recompute_num_layers``, or torchtitan's per-layer AC, ``plan.recompute_interval``, leaves some out:
    ``specs.recomputed_share`` per stage); 1 under selective or no recompute, whose recomputed work
    ``flops.hardware_flops_per_step`` counts whole."""
    if not plan.partial_recompute:
        return 1.0
    layers = plan.stage_layers(model.num_layers)
    return sum(plan.recomputed_share(r, n)[0] * n for r, n in enumerate(layers)) / max(sum(layers), 1)


def estimate_scenario_time(sc: Scenario, order: str = DEFAULT_ORDER) -> TimeEstimate:
    return estimate_time(sc.model, sc.hardware, sc.training, sc.plan, order)
