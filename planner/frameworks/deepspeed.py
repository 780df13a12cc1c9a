"""DeepSpeed (Megatron-DeepSpeed): ZeRO stages as the engine allocates them, and its pipeline engine's limits.

Code paths (deepspeedai/DeepSpeed ``deepspeed/runtime``):

* **ZeRO-1/2** (``zero/stage_1_and_2.py::DeepSpeedZeroOptimizer``): bf16 parameters, full size;
  fp32 partition of the parameters (master) and Adam m, v: 12 B / N; the bf16 gradients are kept
  full size at stage 1 and partitioned at stage 2, plus their fp32 partition (4 B / N). Its own
  estimator ``estimate_zero2_model_states_mem_needs`` gives ``2 + 18 / N`` B/param ("18 = 2
  grads16 + 4 grads32 + 4 params32 + 8 optim states"; formulas.md A1). With
  ``contiguous_gradients`` (DeepSpeed's default) each backward allocates an ``ipg_buffer`` of
  ``reduce_bucket_size`` elements (default 5e8) in the 16-bit dtype, and a second with ``overlap_comm``
  (``setup_buckets``): 2 GB with both at the defaults; none without ``contiguous_gradients``.
* **ZeRO-3** (``zero/stage3.py``): everything partitioned; ``estimate_zero3_model_states_mem_needs``
  adds ``4 x largest_layer_params`` (a gathered bf16 module and its bf16 gradient). plan3d counts the gradient of
  the largest module (a transformer layer, or the embedding or output layer on the stages that hold them) and, for
  the weights, what DeepSpeed's parameter coordinator holds gathered at once: its code ported
  (planner/frameworks/deepspeed_zero3.py, checked against the real one on CPU) and replayed over the model's module
  tree (:func:`zero3_tree`) with the config's prefetch bucket, live limit, reuse distance and persistence threshold
  (:func:`zero3_gathered_elements`); with ``contiguous_gradients``, one reduce bucket whatever ``overlap_comm`` says
  (``stage3.py``: one ``bucket.buffer`` of ``reduce_bucket_size``).
* **Which optimizer wrapper** (:func:`optimizer_wrapper`): the engine picks it in
  ``engine.py::_do_optimizer_sanity_check`` from the ZeRO stage, the model dtype, ``data_types.grad_accum_dtype``
  (default: the model dtype, ``get_data_types``) and whether the model is a ``PipelineModule``. Checked on the
  engine itself on CPU (tests/deepspeed_engine_probe.py, tests/test_deepspeed_engine.py).
* **BF16_Optimizer** (``bf16_optimizer.py``; bf16 at ZeRO-0 under the pipeline engine, or ZeRO stage 1 with
  ``grad_accum_dtype`` fp32): bf16 parameters and gradients, a full-size gradient accumulation buffer
  (``fp32_groups_gradients_flat``, in ``grad_accum_dtype``), and the fp32 master and Adam states of 1/N of the
  parameters (``_setup_for_real_optimizer``: ``fp32_groups_flat_partition`` is this rank's partition of the flat
  bf16 group, and the wrapped optimizer steps only it; BigScience's BLOOM scripts: "bf16 must use z0! it
  implements its own zero stage 1 equivalent"): 2 + 2 + 4 + 12 / N B. The buffer is counted in fp32 unless the
  config says bf16: before deepspeedai/DeepSpeed#7790 (January 2026) bf16 without ZeRO defaulted to fp32
  accumulation, so a config that names no dtype got fp32 there.
* **FP16_Optimizer** (``fp16/fused_optimizer.py``, or ``FP16_UnfusedOptimizer``; fp16 at ZeRO-0, and since
  deepspeedai/DeepSpeed#7790 also bf16 at ZeRO-0 without a pipeline, the engine's ``DDP_BFLOAT16``): the fp32
  master, its fp32 gradient and Adam's states whole: 2 + 2 + 4 + 12 B. Releases before #7790 ran BF16_Optimizer
  there, which holds less; plan3d counts the larger.
* **Pipeline engine** (``pipe/engine.py``): ZeRO 0 or 1 only ("ZeRO-2 and ZeRO-3 are incompatible
  with pipeline parallelism"), no interleaved schedule, layers split by ``PipelineModule``'s
  ``partition_method`` (``pipe/module.py::_partition_layers``): ``type:<regex>`` gives each layer whose class
  matches a weight of 1 and splits the weights with ``runtime/utils.py::partition_balanced``. Megatron-DeepSpeed's
  ``--pp-partition-method`` defaults to ``type:transformer`` (its transformer layers only); BLOOM's
  ``type:transformer|embedding`` also counts the two tied ``EmbeddingPipe`` at the ends (:func:`pipeline_partitions`).
  An uneven ``layers_per_stage`` is accepted when it is one of those; ``plan3d search`` keeps even splits (the
  JSON config it writes cannot carry the model code's partition method). Megatron-DeepSpeed has no context
  parallelism and plan3d writes no fp8 recipe for it.
* **Logits**: Megatron-DeepSpeed's vocab-parallel cross entropy, as Megatron (6 B per logit).
"""

from __future__ import annotations

import functools
import itertools

from planner.frameworks import FrameworkProfile, StateBytes
from planner.frameworks.megatron import logits_bytes_per_element

BF16, FP32, MASTER_AND_ADAM = 2, 4, 12


def runs_pipeline_engine(pipeline_engine: bool | None, pp: int) -> bool:
    """Whether DeepSpeed's PipelineEngine runs the job: as ``DeepSpeedZero.pipeline_engine`` says, or, where it says
    nothing, when pp > 1."""
    return pp > 1 if pipeline_engine is None else pipeline_engine


def optimizer_wrapper(training, zero_stage: int, pp: int) -> str:
    """The optimizer DeepSpeed's engine wraps Adam in for this job (:func:`wrapper_for`,
    :func:`runs_pipeline_engine`)."""
    return wrapper_for(training.precision, training.fp16, training.deepspeed.grad_accum_dtype,
                       runs_pipeline_engine(training.deepspeed.pipeline_engine, pp), zero_stage)


def wrapper_for(precision: str, fp16: bool, grad_accum_dtype: str | None, pipeline_engine: bool,
                zero_stage: int) -> str:
    """The optimizer DeepSpeed's engine wraps Adam in: ``"zero"`` (``DeepSpeedZeroOptimizer`` or its stage-3
    form), ``"bf16_optimizer"`` (``BF16_Optimizer``), ``"fp16_optimizer"`` (``FP16_Optimizer`` /
    ``FP16_UnfusedOptimizer``) or ``"fp32"`` (none). deepspeed 0.19.8 ``runtime/engine.py``
    ``_do_optimizer_sanity_check``, with ``grad_accum_dtype`` defaulting to the model dtype (``get_data_types``):

    * ZeRO 1-3: ``BF16_Optimizer`` for bf16 at stage 1 with ``grad_accum_dtype`` fp32 (and no CPU offload, which
      plan3d refuses), else the ZeRO optimizer;
    * ZeRO 0, bf16: ``BF16_Optimizer`` under the pipeline engine (``pipeline_parallelism``), else
      ``FP16_Optimizer`` in bf16 (``DDP_BFLOAT16``; deepspeedai/DeepSpeed#7790). With ``grad_accum_dtype`` fp32
      0.19.8 raises ``NotImplementedError``; earlier releases ran ``BF16_Optimizer`` (the mix ``plan3d check``
      notes), taken here;
    * ZeRO 0, fp16: ``FP16_Optimizer``.

    fp8 training is bf16 to the engine (the model dtype). Asked of the engine on CPU for every case
    (tests/test_deepspeed_engine.py)."""
    if precision == "fp32":
        return "fp32"
    if zero_stage >= 1:
        return "bf16_optimizer" if zero_stage == 1 and not fp16 and grad_accum_dtype == "fp32" else "zero"
    if fp16:
        return "fp16_optimizer"
    return "bf16_optimizer" if grad_accum_dtype == "fp32" or pipeline_engine else "fp16_optimizer"


#: What each micro-batch's backward moves per local parameter outside the GEMMs, per optimizer wrapper, as
#: (operation, bytes read, bytes written, over the rank's partition) per parameter element in a steady micro-batch
#: (not the step's first); a pass over the partition moves its bytes for 1 / N of the parameters (N the ranks
#: that shard the gradients). DeepSpeed 0.19.8, recorded on the engine itself on CPU on one rank and, for ZeRO 2 and
#: 3 and the pipeline engine with a stage per rank, on two and four (tests/deepspeed_engine_probe.py ``accumulation``,
#: ``accumulation_ranks``):
#:
#: * ``BF16_Optimizer``: ``backward_prologue`` -> ``clear_lp_grads`` zeroes the 16-bit gradients
#:   (``torch._foreach_zero_``); autograd's ``AccumulateGrad`` adds the new weight gradient into the zeroed one
#:   (``grad += new``, the gradient exists); ``backward_epilogue`` -> ``update_hp_grads`` -> ``_update_hp_grad``:
#:   ``hp_grad.add_(lp.grad.to(hp_grad.dtype))``, one parameter at a time, into the accumulation buffer (fp32: a
#:   cast and an fp32 add; bf16 (``grad_accum_dtype``): the add alone, ``HP_GRAD_UPDATE``). The pipeline engine's
#:   stages before the last call ``clear_lp_grads`` and ``update_hp_grads`` themselves
#:   (``pipe/engine.py::_exec_backward_pass``), and their ``outputs.backward`` runs the engine's backward prologue
#:   too: the gradients are zeroed twice there (``PIPELINE_EXTRA_ZEROING``).
#: * ``FP16_Optimizer`` and ZeRO stage 1 (``DeepSpeedZeroOptimizer``): the gradients accumulate in autograd
#:   (``AccumulateGrad``'s add) until the boundary, where the reduction's own copies run (counted with the reduction).
#: * ZeRO stages 2 and 3: every backward copies each gradient into the reduce bucket and averages the bucket
#:   (``div_``), all of it, then copies the rank's reduced partition out (stage 2 twice over) and adds it into the
#:   partitioned gradients. Recorded on 1, 2 and 4 ranks: full + partition / N at each.
#:
#: The step's first micro-batch finds no gradient (``zero_grad(set_to_none=True)`` at the step) and skips the
#: zeroing and autograd's add.
GRAD_ACCUM_PASSES = {
    "bf16_optimizer": (("_foreach_zero_", 0, BF16, False), ("add_", 2 * BF16, BF16, False)),
    "fp16_optimizer": (("add_", 2 * BF16, BF16, False),),
    "zero1": (("add_", 2 * BF16, BF16, False),),
    "zero2": (("copy_", BF16, BF16, False), ("div_", BF16, BF16, False), ("copy_", 2 * BF16, 2 * BF16, True),
              ("add_", 2 * BF16, BF16, True)),
    "zero3": (("copy_", BF16, BF16, False), ("div_", BF16, BF16, False), ("copy_", BF16, BF16, True),
              ("add_", 2 * BF16, BF16, True)),
}
#: BF16_Optimizer under the pipeline engine, on a stage before the last: ``clear_lp_grads`` once more
PIPELINE_EXTRA_ZEROING = (("_foreach_zero_", 0, BF16, False),)
#: BF16_Optimizer's update of its accumulation buffer, by the buffer's bytes per element (``update_hp_grads``)
HP_GRAD_UPDATE = {FP32: (("_to_copy", BF16, FP32, False), ("add_", 2 * FP32, FP32, False)),
                  BF16: (("add_", 2 * BF16, BF16, False),)}


def grad_accum_passes(training, zero_stage: int, pp: int, last_stage: bool = True
                      ) -> tuple[tuple[str, int, int, bool], ...]:
    """The memory-bound passes each micro-batch's backward runs over the local parameters (``GRAD_ACCUM_PASSES``),
    for the optimizer wrapper this job gets (:func:`optimizer_wrapper`) on a stage that is the pipeline's last or
    not (``last_stage``); empty where none is counted."""
    wrapper = optimizer_wrapper(training, zero_stage, pp)
    if wrapper == "bf16_optimizer":
        extra = () if last_stage or not runs_pipeline_engine(training.deepspeed.pipeline_engine, pp) \
            else PIPELINE_EXTRA_ZEROING
        return GRAD_ACCUM_PASSES["bf16_optimizer"] + extra + HP_GRAD_UPDATE[accumulation_bytes(training)]
    if wrapper == "fp16_optimizer":
        return GRAD_ACCUM_PASSES["fp16_optimizer"]
    if wrapper == "zero":
        return GRAD_ACCUM_PASSES[f"zero{zero_stage}"]
    return ()


def grad_accum_bytes_per_param(training, plan, last_stage: bool = True) -> float:
    """Bytes each micro-batch's backward moves per local parameter outside the GEMMs (:func:`grad_accum_passes`),
    a partition's passes over 1 / (dp x cp) of them: 26 under BF16_Optimizer with an fp32 buffer (2 zeroed + 6
    added by autograd + 6 cast + 12 added; 28 on a pipeline stage before the last), 6 where autograd alone
    accumulates, 8 + 14 / N at ZeRO 2 and 8 + 10 / N at ZeRO 3."""
    shards = plan.dp * plan.cp
    return float(sum((r + w) / (shards if part else 1)
                     for _, r, w, part in grad_accum_passes(training, plan.zero_stage, plan.pp, last_stage)))


def accumulation_bytes(training) -> int:
    """Bytes per element of BF16_Optimizer's gradient accumulation buffer: fp32 unless the config says bf16/fp16
    (module docstring)."""
    return BF16 if training.deepspeed.grad_accum_dtype in ("bf16", "fp16") else FP32


def reduce_buffer_count(training, zero_stage: int) -> int:
    """Reduce buckets of ``reduce_bucket_size`` elements a ZeRO optimizer holds through a backward: none without
    ``contiguous_gradients``; stage 1-2 one, two with ``overlap_comm`` (``TrainingSpec.overlap_grad_reduce``;
    0.19.8 ``stage_1_and_2.py::setup_buckets``); stage 3 one (``stage3.py``). Counted on the engine on CPU
    (tests/deepspeed_engine_probe.py)."""
    if not training.deepspeed.contiguous_gradients or zero_stage == 0:
        return 0
    if zero_stage >= 3:
        return 1
    return 2 if training.overlap_grad_reduce else 1


def state_bytes(model, training, plan, stage_params: float, layer_params: float, layers: int,
                expert_params: float = 0.0, linear_params: float | None = None, hardware=None,
                embedding_params: float = 0.0) -> StateBytes:
    """Weights, gradients and optimizer of one GPU of a stage (module docstring). MoE models run here
    without expert parallelism (``PROFILE.allows_ep`` is False), so the experts are ordinary
    parameters, sharded over dp x cp like the rest: ``expert_params`` changes nothing. Nor does ``embedding_params``:
    Megatron-DeepSpeed's ``VocabParallelEmbedding`` makes its gradient on this rank's rows only."""
    P, Pl, n, z = stage_params, layer_params, plan.dp * plan.cp, plan.zero_stage
    wrapper = optimizer_wrapper(training, z, plan.pp)
    if wrapper == "fp32":
        return StateBytes(weights_bytes=FP32 * P, grads_bytes=FP32 * P, optimizer_bytes=8 * P / (n if z else 1))
    if wrapper in ("bf16_optimizer", "fp16_optimizer"):
        # BF16_Optimizer shards the master and Adam over the data-parallel ranks; FP16_Optimizer does not. The
        # accumulation buffer is fp32 unless the config says bf16 (module docstring)
        accum = accumulation_bytes(training) if wrapper == "bf16_optimizer" else FP32
        # FP16_Optimizer.step (fp16/fused_optimizer.py) builds fp32 copies of every gradient and then their flat
        # concatenation, the fp32 gradient counted above, while the 16-bit gradients are still held: 4 B per
        # parameter more than counted, inside the step
        step_extra = FP32 * P if wrapper == "fp16_optimizer" else 0.0
        return StateBytes(weights_bytes=BF16 * P, grads_bytes=(BF16 + accum) * P,
                          optimizer_bytes=MASTER_AND_ADAM * P / (n if wrapper == "bf16_optimizer" else 1),
                          step_extra_bytes=step_extra)
    bucket_elements = training.deepspeed.reduce_bucket_elements
    buckets = reduce_buffer_count(training, z) * bucket_elements * BF16
    if z == 1:
        return StateBytes(weights_bytes=BF16 * P, grads_bytes=BF16 * P + FP32 * P / n + buckets,
                          optimizer_bytes=MASTER_AND_ADAM * P / n)
    if z == 2:
        # DeepSpeedZeroOptimizer.step flattens the 16-bit gradient partition before casting it to fp32, while the
        # partition is still held: 2 B / N more than counted, inside the step (at stage 1 the whole 16-bit gradients
        # counted above are gone by then)
        return StateBytes(weights_bytes=BF16 * P, grads_bytes=(BF16 + FP32) * P / n + buckets,
                          optimizer_bytes=MASTER_AND_ADAM * P / n, step_extra_bytes=BF16 * P / n)
    # the bf16 gradient of one gathered module (a layer, or the embedding or output layer where the stage holds one:
    # V x h / tp each, Llama-3-8B 525e6 elements against a 218e6 layer) until its reduce-scatter; with pp 1 and
    # untied embeddings both sit on the one stage and are computed one at a time
    rest = max(P - layers * Pl, 0.0)
    largest_module = rest / 2 if plan.pp == 1 and not model.tied_embeddings else rest
    working = BF16 * min(P, max(Pl, largest_module))
    if plan.pp == 1:
        # the parameters DeepSpeed's coordinator holds gathered at once (prefetched, kept for reuse, persisted),
        # replayed over the model's module tree (planner/frameworks/deepspeed_zero3.py)
        gathered = BF16 * zero3_gathered_elements(model, plan, training.deepspeed)
    else:  # ZeRO-3 runs without DeepSpeed's pipeline engine only (PROFILE.max_zero_with_pp): not reached by a plan
        gathered = working + training.deepspeed.prefetch_bucket_elements * BF16
    return StateBytes(weights_bytes=BF16 * P / n + gathered,
                      grads_bytes=(BF16 + FP32) * P / n + working + buckets,
                      optimizer_bytes=MASTER_AND_ADAM * P / n)


def zero3_shape(model, tp: int, recompute: tuple[bool, ...] | str = "none") -> tuple:
    """The element counts of one GPU's modules, in the order Megatron-DeepSpeed's ``GPTModel`` calls them
    (``megatron/model/language_model.py``, ``transformer.py``), as :func:`zero3_tree` takes them: the embedding
    (word, learned positions, embedding norm), per layer kind the norms, the attention's input and output
    projections (weight, bias), the MLP's two linears (weight, bias) or a MoE layer's router and experts (DeepSpeed-MoE
    ``TopKGate.wg`` and ``Experts``, all experts local: ``PROFILE.allows_ep`` is False) and shared experts, the final
    norm and the output layer as (weight, bias) (weight 0 when tied: the embedding's again; bias 0 without one,
    ``ModelSpec.output_bias``). TP splits as Megatron (column-parallel inputs and output layer, row-parallel outputs
    with whole biases, norms whole; :func:`layer_params_per_rank`'s rule).
    ``recompute``: per layer whether Megatron-DeepSpeed checkpoints it whole (``--checkpoint-activations``,
    ``_checkpointed_forward`` through ``deepspeed.checkpointing.checkpoint``, reentrant), or "selective" (its
    ``CoreAttention`` checkpointed, ``--recompute-granularity selective``).
    """
    from planner.specs import padded_vocab_size

    h, t = model.hidden_size, tp
    norm = (h,) * model.norm_weights_per_channel
    attention = model.attention_params() - (model.qk_norm_params() if not model.is_mla else 0)
    out_w = (model.num_attention_heads * model.v_dim if model.is_mla else model.q_size) * h
    out_b = h if model.has_out_proj_bias else 0
    in_b = (model.q_size + 2 * model.kv_heads * model.kv_channels) if model.has_qkv_bias and not model.is_mla else 0
    in_w = attention - out_w - out_b - in_b

    def linear(w, b, split_bias=True):
        return (round(w / t),) + ((round(b / t) if split_bias else b,) if b else ())

    def mlp(ffn):
        mlp_in = 2 * ffn if model.gated_mlp else ffn
        bias = model.has_mlp_bias
        return (linear(h * mlp_in, mlp_in if bias else 0), linear(ffn * h, h if bias else 0, split_bias=False))

    attn = (linear(in_w, in_b), linear(out_w, out_b, split_bias=False))
    dense = ("dense", norm, attn, mlp(model.ffn_size))
    moe = None
    if model.is_moe:
        shared = mlp(model.shared_expert_ffn_hidden_size) if model.shared_expert_ffn_hidden_size else None
        moe = ("moe", norm, attn, (model.router_params(),), model.num_experts, mlp(model.moe_ffn_size), shared)
    whole = recompute if isinstance(recompute, tuple) else (False,) * model.num_layers
    kinds = "".join(("m" if whole[i] else "M") if model.is_moe_layer(i) else ("d" if whole[i] else "D")
                    for i in range(model.num_layers))
    v_pad = padded_vocab_size(model.vocab_size, t)
    embedding = (round(v_pad * h / t),) + ((model.max_seq_len * h,) if model.position_embedding == "learned" else ()) \
        + (norm if model.embedding_norm else ())
    output = 0 if model.tied_embeddings else round(v_pad * h / t)
    output_bias = round(v_pad / t) if model.output_bias else 0  # split with the vocabulary rows
    return embedding, dense, moe, kinds, norm, (output, output_bias), recompute == "selective"


def zero3_tree(shape: tuple):
    """The module tree of :func:`zero3_shape`, with Megatron-DeepSpeed's modules that hold no parameter of their own
    (the containers, the embedding dropout, the core attention), which DeepSpeed's hooks visit all the same."""
    from planner.frameworks.deepspeed_zero3 import Module

    embedding, dense, moe, kinds, final_norm, output, core_checkpointed = shape
    ids = itertools.count(1)

    def params(sizes):
        return tuple((next(ids), n) for n in sizes)

    def mlp_module(linears):
        fc1, fc2 = linears
        return Module((), (Module(params(fc1)), Module(params(fc2))))

    def layer(spec, checkpointed):
        kind, norm, (qkv, proj) = spec[0], spec[1], spec[2]
        attention = Module((), (Module(params(qkv)), Module((), checkpointed=core_checkpointed), Module(params(proj))))
        if kind == "dense":
            ffn = mlp_module(spec[3])
        else:
            router, experts, expert, shared = spec[3], spec[4], spec[5], spec[6]
            moe_layer = Module((), (Module(params(router)),
                                    Module((), tuple(mlp_module(expert) for _ in range(experts)))))
            ffn = Module((), (moe_layer,) + ((mlp_module(shared),) if shared else ()))
        return Module((), (Module(params(norm)), attention, Module(params(norm)), ffn), checkpointed=checkpointed)

    word = params(embedding[:1])
    embed = Module((), (Module(word), *(Module(params((n,))) for n in embedding[1:]), Module(())))
    body = tuple(layer(dense if k in "Dd" else moe, k.islower()) for k in kinds)
    weight, bias = output
    head = Module((word if weight == 0 else params((weight,))) + (params((bias,)) if bias else ()))
    language_model = Module((), (embed, Module((), body + (Module(params(final_norm)),)), head))
    return Module((), (language_model,))


@functools.lru_cache(maxsize=64)
def _zero3_gathered(shape: tuple, prefetch: int, max_live: int, max_reuse: int, persistence: int) -> int:
    from planner.frameworks.deepspeed_zero3 import Settings, gathered_elements

    return gathered_elements(zero3_tree(shape), Settings(prefetch_bucket=prefetch, max_live=max_live,
                                                         max_reuse=max_reuse, persistence_threshold=persistence))


def zero3_gathered_elements(model, plan, ds) -> int:
    """Parameter elements DeepSpeed ZeRO-3 holds gathered at once on one GPU of ``plan`` (pp 1): its coordinator
    (planner/frameworks/deepspeed_zero3.py) replayed over :func:`zero3_tree` (the plan's TP and recompute) with the
    config's
    ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``, ``stage3_max_reuse_distance`` and
    ``stage3_param_persistence_threshold`` (``DeepSpeedZero``). At DeepSpeed's defaults the prefetcher runs ahead up to
    the live limit, since the hooks of the modules without parameters of their own prefetch too
    (benchmarks/deepspeed_zero3_gathered.py)."""
    from planner.specs import checkpointed_layers

    if plan.recompute == "selective":
        recompute: tuple[bool, ...] | str = "selective"
    else:
        recompute = checkpointed_layers(model.num_layers, 1, True, plan.recompute, plan.recompute_num_layers)
    return _zero3_gathered(zero3_shape(model, plan.tp, recompute), ds.prefetch_bucket_elements, ds.max_live_elements,
                           ds.max_reuse_elements, ds.persistence_threshold_elements)


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Part boundaries DeepSpeed gives ``weights`` over ``num_parts`` stages: ``deepspeed/runtime/utils.py``
    ``partition_balanced`` (DeepSpeed 0.19.8), the linear-partition dynamic programme that minimises the spread
    between the heaviest and the lightest part, ties to the later split point; ``partition_uniform`` when there are
    no more items than parts. Ported as written (``tests/test_framework_memory.py`` compares it with DeepSpeed's)."""
    n, m = len(weights), num_parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    dp_max[0][0] = dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                if dp_cost[i][j] >= hi - lo:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


@functools.lru_cache(maxsize=256)
def pipeline_partitions(num_layers: int, pp: int) -> dict[str, tuple[int, ...]]:
    """Transformer layers per stage that Megatron-DeepSpeed's ``--pp-partition-method`` builds, by method:
    ``type:transformer`` (its default: the layers alone, weight 1 each) and ``type:transformer|embedding`` (the
    tied ``EmbeddingPipe`` before the first layer and after the last also weigh 1; each stage then holds its
    slots less its embeddings: BLOOM-176B's 70 layers on 12 stages, 5 + 10 x 6 + 5, bigscience-workshop/bigscience
    ``train/tr11-176B-ml/README.md``). A split with a stage of no layer is left out."""
    out = {}
    if pp <= 1:
        return out
    bounds = partition_balanced([1.0] * num_layers, pp)
    out["type:transformer"] = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    slots = partition_balanced([1.0] * (num_layers + 2), pp)  # slot 0 and slot L + 1: the two embeddings
    out["type:transformer|embedding"] = tuple(
        (b - a) - (a <= 0 < b) - (a <= num_layers + 1 < b) for a, b in zip(slots, slots[1:]))
    return {k: v for k, v in out.items() if min(v) >= 1}


PROFILE = FrameworkProfile(name="deepspeed", state_bytes=state_bytes, logits_bytes_per_element=logits_bytes_per_element,
                           sp_gathers_inputs=False, max_zero_with_pp=1, allows_cp=False, allows_vpp=False,
                           allows_uneven=False, pipeline_partitions=pipeline_partitions, allows_fp8=False,
                           # plan3d's DeepSpeed launch files write no MoE/expert-parallel configuration
                           allows_ep=False, expert_tp_rule="tp",
                           replicates_kv_heads=False,  # ParallelAttention: divide(num_key_value_heads, tp)
                           # Megatron-DeepSpeed's SwiGLU is eager, F.silu(x[0]) * x[1] (microsoft/Megatron-DeepSpeed
                           # 1e3fc81 megatron/model/transformer.py ParallelMLP): the multiply saves the SiLU output
                           swiglu_unfused=True,
                           gemm_workspaces="torch",  # every linear a torch GEMM (memory.gemm_workspace_bytes)
                           deepspeed_pipe_buffers=True,  # PipelineEngine's buffers (memory.deepspeed_pipe_bytes)
                           grad_accum_bytes_per_param=grad_accum_bytes_per_param)  # cost.grad_accum_s
