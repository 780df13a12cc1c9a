"""Megatron-Core's Muon optimizer (``TrainingSpec.optimizer`` muon / dist_muon): which parameters it steps, how
dist_muon deals them over the data-parallel ranks, the bytes of optimizer state a rank holds and the Newton-Schulz
work of its step. Pure arithmetic, no torch.

Sources (Megatron-LM core_v0.16.1 unless named):

* ``optimizer/muon.py`` ``get_megatron_muon_optimizer``: every parameter with two dimensions that is not the word
  embedding or the output layer (``is_embedding_or_output_parameter``) is stepped by ``TensorParallelMuon``; the rest
  (norms, biases, attention sinks, the embedding and the output layer) by Megatron's Adam. In bf16 both are wrapped
  in ``Float16OptimizerWithFloat16Params`` (an fp32 master copy of each parameter), and Muon's state is one
  ``momentum_buffer``, ``zeros_like`` the fp32 master (``muon_init_state_fn``): 4 + 4 B per Muon parameter, Adam's
  4 + 8 per other parameter. In fp32 training the parameter is its own master (``FP32Optimizer``).
* ``TensorParallelMuon`` with ``--muon-tp-mode blockwise`` (the default): each TP rank orthogonalises its own shard
  (``partition_dim`` None, so ``newton_schulz_tp`` falls back to ``newton_schulz`` on the local tensor);
  ``--muon-split-qkv`` (default on) orthogonalises the fused QKV weight as its Q, K and V parts.
* NVIDIA-NeMo/Emerging-Optimizers ``orthogonalized_optimizers/muon_utils.py`` ``newton_schulz``: the matrix
  transposed to ``m x n`` with ``m <= n``, normalised, then ``--muon-num-ns-steps`` (5) steps of
  ``A = X X^T; B = b A + c A A; X = a X + B X`` (``newton_schulz_step``: three GEMMs, ``2 m^2 n + 2 m^3 + 2 m^2 n``
  FLOPs), in bf16 at ``--muon-fp32-matmul-prec medium`` (the default: "We explicitly convert to BF16 and back").
* ``optimizer/layer_wise_optimizer.py`` ``LayerWiseDistributedOptimizer.shard_params`` (dist_muon): all parameters
  (Muon's and Adam's) sorted by ``numel`` and dealt to the dp x cp ranks (the routed experts' to the
  expert-data-parallel ranks) in a ping-pong loop ``0 .. n-1, n-1 .. 0``; each rank keeps master weights and states of
  the parameters dealt to it and steps only those; ``allgather_params`` then all-gathers the updated 16-bit
  parameters over each group (one ``all_gather`` of the flattened tensors). Gradients stay whole: Megatron's DDP
  all-reduces them (no distributed optimizer).

Which rank a parameter lands on depends only on the sizes, so :func:`dealt_max` deals the stage's parameters as
Megatron does and takes the fullest rank (of the dense group, plus the fullest of the expert group: an upper bound,
since the two fullest need not be one GPU). The small 1-D parameters (norms, biases) are counted in their total, as
tensors of ``h`` values each (their exact sizes move which rank is fullest by a few KiB).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from planner.specs import ModelSpec, Plan

#: Newton-Schulz steps (``--muon-num-ns-steps``, default 5) and Muon's fp32 momentum (``momentum_buffer``)
NS_STEPS = 5
MOMENTUM_BYTES = 4
FP32_MASTER_BYTES = 4


def layer_matrices(model: ModelSpec, tp: int, moe: bool, ep: int = 1, etp: int | None = None
                   ) -> tuple[tuple[float, float, float, tuple[float, ...], bool], ...]:
    """The 2-D weights of one layer on one GPU that Muon steps, as ``(rows, cols, count, pieces, expert)``: ``pieces``
    the row blocks orthogonalised apart (the fused QKV weight's Q, K and V, ``--muon-split-qkv``), ``expert`` True for
    the routed experts' (the expert-data-parallel group). Shapes and TP splits as :func:`planner.memory.layer_param_split`
    counts them (Megatron-Core's attention, MLA, MLP, router, shared experts and ``TEGroupedMLP`` experts, one weight
    per expert and linear)."""
    from planner.memory import kv_heads_per_rank

    h, a = model.hidden_size, model.num_attention_heads
    out: list = []
    if model.is_mla:
        rq, rkv, dqk = model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim
        if rq:
            out += [(rq, h, 1, (rq,), False), (a * dqk / tp, rq, 1, (a * dqk / tp,), False)]
        else:
            out.append((a * dqk / tp, h, 1, (a * dqk / tp,), False))
        kv_up = a * (model.qk_nope_head_dim + model.v_head_dim) / tp
        out += [(rkv + model.qk_rope_head_dim, h, 1, (rkv + model.qk_rope_head_dim,), False),
                (kv_up, rkv, 1, (kv_up,), False), (h, a * model.v_head_dim / tp, 1, (h,), False)]
    else:
        q, kv = model.q_size / tp, model.kv_channels * kv_heads_per_rank(model, tp)
        out += [(q + 2 * kv, h, 1, (q, kv, kv), False), (h, q, 1, (h,), False)]
    g = 2 if model.gated_mlp else 1

    def mlp(ffn: float, split: int, count: float, expert: bool) -> list:
        return [(g * ffn / split, h, count, (g * ffn / split,), expert), (h, ffn / split, count, (h,), expert)]

    if not (moe and model.is_moe):
        return tuple(out + mlp(model.ffn_size, tp, 1, False))
    out.append((model.num_experts, h, 1, (model.num_experts,), False))  # the router, replicated
    if model.shared_expert_ffn_hidden_size is not None:
        out += mlp(model.shared_expert_ffn_hidden_size, tp, 1, False)
        if model.shared_expert_gate:
            out.append((1, h, 1, (1,), False))
    return tuple(out + mlp(model.moe_ffn_size, etp or tp, model.num_experts / ep, True))


@functools.lru_cache(maxsize=16384)
def stage_tensors(model: ModelSpec, plan: Plan, stage: int, layers: int) -> tuple:
    """One GPU's parameters of stage ``stage`` as ``(numel, count, muon, expert, ns_shapes)`` rows: Muon's 2-D weights
    of its layers (:func:`layer_matrices`; on the loss stage also the MTP modules' layers and ``eh_proj``), the word
    embedding's and output layer's rows and the position table (Adam), and the rest of
    :func:`planner.memory.stage_param_split`'s count (norms, biases: Adam) as tensors of ``h`` values."""
    from planner.memory import mtp_param_split, stage_moe_layer_count, stage_param_split, vocab_rows_params

    t, h = plan.tp, model.hidden_size
    n_moe = stage_moe_layer_count(model, plan, stage, layers)
    kinds = [(False, layers - n_moe), (True, n_moe)]
    extra = []
    if stage == plan.loss_stage and model.mtp_num_layers:  # mtp_param_split: a layer and eh_proj (2h -> h / t) each
        kinds.append((model.mtp_is_moe(), model.mtp_num_layers))
        extra.append((h / t, 2 * h, model.mtp_num_layers, (h / t,), False))
    rows = []
    for moe, n in kinds:
        if n:
            rows += [(r * c, k * n, True, e, (r, c, pieces))
                     for r, c, k, pieces, e in layer_matrices(model, t, moe, plan.ep, plan.expert_tp)]
    rows += [(r * c, k, True, e, (r, c, pieces)) for r, c, k, pieces, e in extra]
    dense, expert = stage_param_split(model, plan, stage, layers)
    big = []  # Adam's large tensors: the embedding's rows (and a learned position table) and the output layer's
    vocab = vocab_rows_params(model, t)
    if stage == 0:
        big.append(vocab)
        if model.embedding_params() > model.vocab_size * h:
            big.append(model.embedding_params() - model.vocab_size * h)
    if stage == plan.loss_stage:
        if not model.tied_embeddings or (plan.pp > 1 and not plan.v_shaped):
            big.append(vocab)
        if model.mtp_num_layers and mtp_param_split(model, plan, stage)[0] and stage != 0 and not model.tied_embeddings:
            big.append(vocab)
    muon_dense = sum(n * k for n, k, _, e, _ in rows if not e)
    muon_expert = sum(n * k for n, k, _, e, _ in rows if e)
    rest = max(dense - muon_dense - sum(big), 0.0)
    rows += [(b, 1, False, False, None) for b in big]
    if rest:
        rows.append((rest / math.ceil(rest / h), math.ceil(rest / h), False, False, None))
    if expert > muon_expert:  # expert biases (GPT-OSS): Adam, in the expert group
        left = expert - muon_expert
        rows.append((left / math.ceil(left / h), math.ceil(left / h), False, True, None))
    return tuple(rows)


def dealt_max(values: np.ndarray, numel: np.ndarray, ranks: int) -> float:
    """The largest per-rank sum of ``values`` when the parameters of sizes ``numel`` are dealt to ``ranks`` ranks as
    ``LayerWiseDistributedOptimizer.shard_params`` deals them: sorted by size (stable), then ranks ``0 .. n-1,
    n-1 .. 0`` over and over."""
    if ranks <= 1 or values.size == 0:
        return float(values.sum())
    order = np.argsort(numel, kind="stable")
    pos = np.arange(values.size) % (2 * ranks)
    rank = np.where(pos < ranks, pos, 2 * ranks - 1 - pos)
    return float(np.bincount(rank, weights=values[order], minlength=ranks).max())


def _expanded(rows: tuple, expert: bool, value) -> tuple[np.ndarray, np.ndarray]:
    sel = [r for r in rows if r[3] == expert]
    counts = np.rint([r[1] for r in sel]).astype(np.int64)
    numel = np.repeat(np.array([r[0] for r in sel], dtype=float), counts)
    values = np.repeat(np.array([value(r) for r in sel], dtype=float), counts)
    return numel, values


def optimizer_bytes(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, adam_bytes: float,
                    master_bytes: float, dense_ranks: int, expert_ranks: int) -> float:
    """Optimizer bytes (fp32 master copies and states) on the fullest GPU of stage ``stage``: ``master_bytes +
    MOMENTUM_BYTES`` per Muon parameter, ``adam_bytes`` per other one; with dist_muon those of the parameters dealt to
    the fullest rank of the dense group (``dense_ranks``: dp x cp) plus the fullest of the expert group
    (``expert_ranks``)."""
    rows = stage_tensors(model, plan, stage, layers)

    def per_tensor(r) -> float:
        return r[0] * (master_bytes + MOMENTUM_BYTES if r[2] else adam_bytes)

    total = 0.0
    for expert, ranks in ((False, dense_ranks), (True, expert_ranks)):
        numel, values = _expanded(rows, expert, per_tensor)
        total += dealt_max(values, numel, ranks if optimizer == "dist_muon" else 1)
    return total


def owned_params(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, dense_ranks: int,
                 expert_ranks: int) -> float:
    """Parameters the fullest GPU of the stage steps (all of them, or with dist_muon those dealt to it)."""
    rows = stage_tensors(model, plan, stage, layers)
    total = 0.0
    for expert, ranks in ((False, dense_ranks), (True, expert_ranks)):
        numel, values = _expanded(rows, expert, lambda r: r[0])
        total += dealt_max(values, numel, ranks if optimizer == "dist_muon" else 1)
    return total


def ns_step_s(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, dense_ranks: int,
              expert_ranks: int, gemm_s) -> float:
    """Seconds of Newton-Schulz GEMMs on the busiest GPU of the stage: each Muon weight's three GEMMs per step
    (``gemm_s(m, k, n)``, :func:`planner.cost.gemm_time_s` at bf16), over the weights dealt to that GPU."""
    rows = stage_tensors(model, plan, stage, layers)

    def one(r) -> float:
        if not r[2]:
            return 0.0
        rr, cc, pieces = r[4]
        s = 0.0
        for p in pieces:
            m, n = min(p, cc), max(p, cc)
            s += NS_STEPS * (gemm_s(m, n, m) + gemm_s(m, m, m) + gemm_s(m, m, n))
        return s

    total = 0.0
    for expert, ranks in ((False, dense_ranks), (True, expert_ranks)):
        numel, values = _expanded(rows, expert, one)
        total += dealt_max(values, numel, ranks if optimizer == "dist_muon" else 1)
    return total
