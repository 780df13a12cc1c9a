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

Which rank a parameter lands on depends on the sizes and the number of parameters before it, so
:func:`stage_tensors` lists every parameter of a stage as Megatron builds it, the 1-D ones too, and :func:`dealt_max`
deals them as Megatron does and takes the fullest rank (of the dense group, plus the fullest of the expert group: an
upper bound, since the two fullest need not be one GPU). Checked against Megatron's own ``shard_params`` on the
parameters Megatron builds for 16 plans (tests/test_megatron_params.py): equal to the byte.
"""

from __future__ import annotations

import functools

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


def layer_small_tensors(model: ModelSpec, tp: int, moe: bool, ep: int = 1, etp: int | None = None
                        ) -> tuple[tuple[float, float, bool], ...]:
    """The 1-D parameters of one layer on one GPU (Adam's), as ``(numel, count, expert)``: each norm's weight (and
    bias under LayerNorm), the Q/K norms (per head: ``d_h`` each; full width: this rank's heads), MLA's two latent
    norms, the biases (QKV, output projection, FC1, FC2; a routed expert's in the expert group), the attention sinks
    and the router's bias. Their number matters, not only their sum: ``shard_params`` deals by position."""
    from planner.memory import kv_heads_per_rank

    h, n = model.hidden_size, model.norm_weights_per_channel
    out: list = [(h, model.norms_per_layer * n, False)]
    if model.is_mla:
        out += [(r, n, False) for r in (model.q_lora_rank, model.kv_lora_rank) if r]
    else:
        q, kv = model.q_size / tp, model.kv_channels * kv_heads_per_rank(model, tp)
        if model.qk_norm == "head":
            out.append((model.kv_channels, 2 * n, False))
        elif model.qk_norm == "full":
            out += [(q, n, False), (kv, n, False)]
        if model.has_qkv_bias:
            out.append((q + 2 * kv, 1, False))
        if model.has_out_proj_bias:
            out.append((h, 1, False))
    if model.attention_sinks:
        out.append((model.num_attention_heads / tp, 1, False))
    g = 2 if model.gated_mlp else 1

    def biases(ffn: float, split: int, count: float, expert: bool) -> list:
        return [(g * ffn / split, count, expert), (h, count, expert)] if model.has_mlp_bias else []

    if not (moe and model.is_moe):
        return tuple(out + biases(model.ffn_size, tp, 1, False))
    if model.router_bias:
        out.append((model.num_experts, 1, False))
    if model.shared_expert_ffn_hidden_size is not None:
        out += biases(model.shared_expert_ffn_hidden_size, tp, 1, False)
    return tuple(out + biases(model.moe_ffn_size, etp or tp, model.num_experts / ep, True))


@functools.lru_cache(maxsize=16384)
def stage_tensors(model: ModelSpec, plan: Plan, stage: int, layers: int) -> tuple:
    """One GPU's parameters of stage ``stage`` as ``(numel, count, muon, expert, ns_shapes)`` rows, each parameter as
    Megatron-Core builds it (the sum is :func:`planner.memory.stage_param_split`'s, tests/test_muon.py; the dealing
    Megatron's own, tests/test_megatron_params.py): Muon's 2-D weights of its layers (:func:`layer_matrices`; on the
    loss stage also the MTP modules' layers and ``eh_proj``) and of a learned position table; Adam's 1-D ones
    (:func:`layer_small_tensors`, the final and embedding norms) and the word embedding's and output layer's rows."""
    from planner.memory import stage_moe_layer_count, vocab_rows_params

    t, h = plan.tp, model.hidden_size
    n_moe = stage_moe_layer_count(model, plan, stage, layers)
    kinds = [(False, layers - n_moe), (True, n_moe)]
    mtp = model.mtp_num_layers if stage == plan.loss_stage else 0
    if mtp:  # mtp_param_split: per module a layer of the last layer's kind, eh_proj (2h -> h / t) and three norms
        kinds.append((model.mtp_is_moe(), mtp))
    rows = []
    for moe, n in kinds:
        if n:
            rows += [(r * c, k * n, True, e, (r, c, pieces))
                     for r, c, k, pieces, e in layer_matrices(model, t, moe, plan.ep, plan.expert_tp)]
            rows += [(size, k * n, False, e, None) for size, k, e in layer_small_tensors(model, t, moe, plan.ep,
                                                                                         plan.expert_tp)]
    if mtp:
        rows += [(h / t * 2 * h, mtp, True, False, (h / t, 2 * h, (h / t,))),
                 (h, 3 * model.norm_weights_per_channel * mtp, False, False, None)]
    vocab = vocab_rows_params(model, t)
    if stage == 0:  # the word embedding's rows (Adam: is_embedding_or_output_parameter), a learned position table
        # (2-D and not so marked: Muon's, language_module.py sets the attribute on the word embedding only), BLOOM's
        # embedding norm
        rows.append((vocab, 1, False, False, None))
        if model.position_embedding == "learned":
            rows.append((model.max_seq_len * h, 1, True, False, (model.max_seq_len, h, (model.max_seq_len,))))
        if model.embedding_norm:
            rows.append((h, model.norm_weights_per_channel, False, False, None))
    if stage == plan.loss_stage:
        rows.append((h, model.norm_weights_per_channel, False, False, None))  # the final norm
        if not model.tied_embeddings or (plan.pp > 1 and not plan.v_shaped):  # the output layer (or the tied copy)
            rows.append((vocab, 1, False, False, None))
        if model.output_bias:  # a 1-D parameter (Adam's), this rank's share of the padded vocabulary
            rows.append((vocab / h, 1, False, False, None))
        if mtp and stage != 0 and not model.tied_embeddings:
            # the MTP modules' own word embedding: language_module.py marks is_embedding_or_output_parameter on the
            # first stage's only, so Muon steps this 2-D copy (found against Megatron's build, tests/test_megatron_params)
            rows.append((vocab, 1, True, False, (vocab, h, (vocab,))))
    return tuple(rows)


def dealt_max(values: np.ndarray, numel: np.ndarray, ranks: int, after: np.ndarray | None = None) -> float:
    """The largest per-rank sum of ``values`` when the parameters of sizes ``numel`` are dealt to ``ranks`` ranks as
    ``LayerWiseDistributedOptimizer.shard_params`` deals them: sorted by size (a stable sort of its list, which holds
    Muon's parameter groups before Adam's, ``get_megatron_muon_optimizer``: among equal sizes ``after`` True, Adam's,
    come last), then ranks ``0 .. n-1, n-1 .. 0`` over and over."""
    if ranks <= 1 or values.size == 0:
        return float(values.sum())
    order = np.lexsort((np.zeros(numel.size) if after is None else after, numel))
    pos = np.arange(values.size) % (2 * ranks)
    rank = np.where(pos < ranks, pos, 2 * ranks - 1 - pos)
    return float(np.bincount(rank, weights=values[order], minlength=ranks).max())


def dealt_groups(optimizer: str, dense_ranks: int, expert_ranks: int) -> tuple[tuple[bool, int], ...]:
    """(expert, ranks its parameters are dealt over) of the dense and the expert group: none dealt with muon;
    with dist_muon dp x cp and the expert-data-parallel ranks, except that a dp x cp group of one deals nothing, the
    experts neither (``shard_params`` returns before it lists either group)."""
    if optimizer != "dist_muon" or dense_ranks <= 1:
        return ((False, 1), (True, 1))
    return ((False, dense_ranks), (True, expert_ranks))


def _fullest(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, dense_ranks: int,
             expert_ranks: int, value) -> float:
    """:func:`dealt_max` of ``value(row)`` over the stage's parameters (:func:`stage_tensors`), the dense group's
    fullest rank plus the expert group's (:func:`dealt_groups`)."""
    rows = stage_tensors(model, plan, stage, layers)
    total = 0.0
    for expert, ranks in dealt_groups(optimizer, dense_ranks, expert_ranks):
        sel = [r for r in rows if r[3] == expert]
        counts = np.rint([r[1] for r in sel]).astype(np.int64)
        numel = np.repeat(np.array([r[0] for r in sel], dtype=float), counts)
        values = np.repeat(np.array([value(r) for r in sel], dtype=float), counts)
        adam = np.repeat(np.array([not r[2] for r in sel], dtype=bool), counts)
        total += dealt_max(values, numel, ranks, adam)
    return total


def optimizer_bytes(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, adam_bytes: float,
                    master_bytes: float, dense_ranks: int, expert_ranks: int) -> float:
    """Optimizer bytes (fp32 master copies and states) on the fullest GPU of stage ``stage``: ``master_bytes +
    MOMENTUM_BYTES`` per Muon parameter, ``adam_bytes`` per other one; with dist_muon those of the parameters dealt to
    the fullest rank of the dense group (``dense_ranks``: dp x cp) plus the fullest of the expert group
    (``expert_ranks``)."""
    return _fullest(model, plan, stage, layers, optimizer, dense_ranks, expert_ranks,
                    lambda r: r[0] * (master_bytes + MOMENTUM_BYTES if r[2] else adam_bytes))


def owned_params(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, dense_ranks: int,
                 expert_ranks: int) -> float:
    """Parameters the fullest GPU of the stage steps (all of them, or with dist_muon those dealt to it)."""
    return _fullest(model, plan, stage, layers, optimizer, dense_ranks, expert_ranks, lambda r: r[0])


#: HBM bytes per Muon parameter of one step outside the Newton-Schulz GEMMs, fp32 master, gradient and momentum
#: (Emerging-Optimizers ``OrthogonalizedOptimizer.step``, each op eager): the gradient-norm read of Megatron's clipping
#: (4), decoupled weight decay ``p.add_(p, ...)`` (read 4, write 4), the momentum ``exp_avg.lerp_(grad, ...)`` (read 8,
#: write 4), TensorParallelMuon's ``orth_grad * scale_factor * extra_scale_factor`` (two new tensors: 2 x (4 + 4),
#: core_v0.16.1 ``optimizer/muon.py``), the update ``p.add_(grad, ...)`` (read 8, write 4), the copy of the fp32 master
#: into the bf16 weight (6) and the zeroing of the gradient buffer (4): 62. Nesterov momentum (``--muon-use-nesterov``,
#: off by default) and the Newton-Schulz normalisation and casts are left out, so this is a floor. Adam's parameters
#: keep ``planner.cost.ADAM_BYTES_PER_PARAM``.
MUON_UPDATE_BYTES = 4 + 8 + 12 + 16 + 12 + 6 + 4


def update_bytes(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, dense_ranks: int,
                 expert_ranks: int, adam_bytes: float) -> float:
    """HBM bytes of the per-parameter updates on the fullest GPU of the stage: ``MUON_UPDATE_BYTES`` per Muon
    parameter, ``adam_bytes`` per other one (all of them, or with dist_muon those dealt to that GPU)."""
    return _fullest(model, plan, stage, layers, optimizer, dense_ranks, expert_ranks,
                    lambda r: r[0] * (MUON_UPDATE_BYTES if r[2] else adam_bytes))


def ns_step_s(model: ModelSpec, plan: Plan, stage: int, layers: int, optimizer: str, dense_ranks: int,
              expert_ranks: int, gemm_s) -> float:
    """Seconds of Newton-Schulz GEMMs on the busiest GPU of the stage: each Muon weight's three GEMMs per step
    (``gemm_s(m, k, n)``, :func:`planner.cost.gemm_time_s` at bf16), over the weights dealt to that GPU."""
    def one(r) -> float:
        if not r[2]:
            return 0.0
        _, cols, pieces = r[4]
        s = 0.0
        for p in pieces:
            m, n = min(p, cols), max(p, cols)
            s += NS_STEPS * (gemm_s(m, n, m) + gemm_s(m, m, m) + gemm_s(m, m, n))
        return s

    return _fullest(model, plan, stage, layers, optimizer, dense_ranks, expert_ranks, one)
