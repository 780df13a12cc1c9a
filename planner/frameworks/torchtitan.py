"""torchtitan: FSDP2 (``fully_shard``) + DTensor TP + ``torch.distributed.pipelining``.

Code paths (torchtitan ``models/llama3/infra/parallelize.py::apply_fsdp``; torch
``distributed/fsdp/_fully_shard``; ``distributed/pipelining/stage.py``):

* **Mixed precision**: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
  (``training.mixed_precision_param`` / ``mixed_precision_reduce`` defaults). The sharded
  parameters stay fp32 (4 B / N), AdamW's ``exp_avg`` and ``exp_avg_sq`` are sharded like them
  (8 B / N), the sharded gradients are fp32 (4 B / N); N = dp x cp (torchtitan's FSDP mesh is
  ``dp_shard_cp``). There is no separate master copy: the sharded fp32 parameter is it.
* **Unsharded bf16 parameters**: ``reshard_after_forward`` (``parallelism.fsdp_reshard_after_forward``,
  default ``"default"`` = True without PP, **False with PP**). When True, one layer is gathered
  and the next prefetched (FSDP2's implicit forward/backward prefetch): 2 layers of bf16. When
  False, every layer of the stage stays gathered from its forward to its backward: 2 B x the stage.
  plan3d's ``zero_stage`` 1 and 2 are emitted as ``never``, 3 as ``default``.
  The root parameters (embedding, final norm, output layer) are gathered at the loss.
* **Gradients under PP**: ``PipelineStage.backward_maybe_with_nosync`` calls
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` for the
  micro-batches' backward and reduce-scatters only in ``perform_reduce_grad``; FSDP2 keeps the
  unsharded gradient in ``reduce_dtype`` (``FSDPParam.to_accumulated_grad_if_needed``): 4 B x
  the stage of fp32 unsharded gradients, plus the 2 B unsharded parameters; while a layer (or the
  root) runs its backward, its bf16 gradient is live until it is added to the fp32 one.
* **Gradients without PP**: each layer's bf16 gradient (2 B) is cast to fp32 for the
  reduce-scatter (4 B, ``foreach_reduce``) and scattered into its 4 B / N shard.
* **Without FSDP** (zero_stage 0: DDP or a single replica): fp32 parameters and gradients,
  AdamW 8 B, bf16 compute by ``torch.autocast`` (``maybe_enable_amp``), which keeps a bf16 cast
  of each weight for backward: 4 + 2 + 4 + 8 B.
* **Logits**: the output layer's bf16 logits, then ``cross_entropy(pred.flatten(0, 1).float(),
  labels)`` (``components/loss.py``). Without TP the peak is in backward: ``log_softmax``'s saved
  fp32 output, the fp32 gradient from ``nll_loss`` and the fp32 gradient of the log-softmax input:
  12 B per logit. With TP, ``loss_parallel`` (the default, ``parallelism.disable_loss_parallel``)
  keeps the vocabulary sharded (V / t per rank) but runs DTensor's decomposed log-softmax
  (``torch/distributed/tensor/parallel/loss.py::_log_softmax``; peak in backward: the saved fp32
  log-softmax and three fp32 gradient tensors): 16 B per local logit at any tp. Both are measured on torch
  2.13 with ``MemTracker`` under fake tensors and re-measured in CI (``tests/test_fake_rank.py::
  test_loss_bytes_per_logit``); the loss-parallel figure also on real tensors, gloo ranks at tp 1, 2 and 8
  (tests/test_loss_parallel_gloo.py). It was 22 B until 2026-12-04: the fake harness counted DTensor's
  global-shape sharding-propagation tensors as the rank's (``planner.fake_rank._dtensor_propagation_apart``).
* **SwiGLU** runs eager and unfused (``FeedForward.forward``: ``w2(F.silu(w1(x)) * w3(x))``):
  the multiply also saves the SiLU output, one more ``s b f`` tensor per layer.
* **Selective AC** is torchtitan's op-level policy (``activation_checkpoint.mode = "selective"``,
  ``selective_ac_option = "op"`` in its Llama 3 configs): ``planner.memory.op_sac_terms``.
  Full AC (``mode = "full"``) keeps each block's input.
* **Sequence parallel**: DTensor's ``SequenceParallel`` + ``ColwiseParallel`` keep the gathered
  QKV/FC1 inputs for backward (``planner.memory.layer_activation_terms``).
* **torch.compile** (``training.compile``; torchtitan ``--compile.enable``, default components
  ``["model", "loss"]``, 0.3.0 ``config/configs.py::CompileConfig``): each TransformerBlock is compiled
  after AC wrapping (``distributed/compile.py::apply_compile``) and the loss function too
  (``components/loss.py::BaseLoss._maybe_compile``). Measured on torch 2.13 with inductor
  (``planner/compile_probe.py``): the compiled block saves W1's and W3's outputs and their product but
  not the SiLU output (the eager unfused SwiGLU term goes); under op SAC it does not keep the W2 output
  (``planner.memory.op_sac_terms``); full AC keeps the block input as eagerly. The compiled
  ``cross_entropy(pred.float())`` saves the bf16 logits and one fp32 value per token, and its backward is
  one fused kernel writing the bf16 gradient (inductor's generated code allocates nothing else per
  logit): 4 B per logit instead of 12. loss_parallel (TP) under compile is not measured and keeps its
  eager 16 B.
* **float8** (torchao, torchtitan's ``Float8LinearConverter``, rowwise by default in 0.3.0): the weights stay
  16-bit and are cast per GEMM; the GEMM inputs are saved in 16 bits, not in fp8 as Transformer Engine saves
  them: torchao's ``matmul_with_hp_or_float8_args.forward`` (and its MX linear and grouped MMs) does
  ``ctx.save_for_backward(input_hp, weight_hp_t)`` and casts again in backward (torchao 0.18.0
  ``float8/float8_linear.py``). Measured on torchao's own modules on this CPU (``planner/compile_probe.py``,
  ``tests/test_torchtitan_float8.py``): eager, a float8 block saves exactly what the bf16 block saves; compiled
  (inductor) without AC, the partitioner recomputes the two norm outputs and the SwiGLU product instead of saving
  them (``planner.memory.layer_activation_terms``); compiled under op SAC it keeps two fp32 rowwise scales per
  token more (:func:`planner.memory.op_sac_terms`). ``enable_fsdp_float8_all_gather`` (fp8 all-gathers, 1 B
  instead of 2 unsharded) is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import replace

from planner.frameworks import FrameworkProfile, StateBytes

BF16, FP32 = 2, 4
#: why an fp16 run has no torchtitan form (torchtitan 0.3.0 config/configs.py:
#: ``mixed_precision_param: Literal["bfloat16", "float32"]``): said by ``specs.job_problems`` and the emitter
NO_FP16 = "torchtitan 0.3.0 trains in bfloat16 or float32 (training.mixed_precision_param), not fp16"
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in the parameter's dtype (fp32)
SHARD_BYTES_PER_PARAM = (FP32, FP32, ADAM_STATE_BYTES)
"""(parameter, gradient, AdamW) bytes per parameter of the sharded states FSDP2 keeps between steps, whatever
``param_dtype`` is: torch 2.13 ``distributed/fsdp/_fully_shard/_fsdp_param.py`` ``FSDPParam.init_dtype_attrs``
(``orig_dtype = sharded_param.dtype``, fp32) and ``_fsdp_collectives.py::foreach_reduce`` (the reduce output is
cast to ``orig_dtype`` before it becomes the sharded gradient). :func:`state_bytes` adds the unsharded
(gathered) copies on top; ``plan3d validate`` measures these sharded ones (``launch.predicted_rank_memory``)."""
LOGITS_BYTES_PER_ELEMENT = 12  # cross_entropy(pred.float()) peak in backward (module docstring)
LOSS_PARALLEL_BYTES_PER_ELEMENT = 16  # loss_parallel's decomposed log-softmax, per local logit (module docstring)
# torch.compile'd cross entropy (--compile.enable, "loss" in --compile.components): the bf16 logits saved and
# their bf16 gradient, nothing per logit in fp32 (module docstring, planner/compile_probe.py)
COMPILED_LOGITS_BYTES_PER_ELEMENT = 2 * BF16


#: HBM bytes per token of one eager (not compiled) Llama 3 block's memory-bound kernels, as coefficients of the
#: widths: ``h`` hidden, ``q`` query (heads x head dim), ``kv`` key (KV heads x head dim), ``f`` FFN, ``d`` head dim,
#: ``one`` a constant; (forward, backward without the recompute). Counted on torchtitan 0.3.0's own block
#: (planner/eager_probe.py, tests/test_eager_traffic.py runs it and checks these), with the norms as CUDA's fused
#: ``_fused_rms_norm`` pair (torch >= 2.8). Forward: two norms (4h + 4 each: input, output, fp32 rstd), the fused QKV
#: split made contiguous (4q + 8kv), the complex RoPE on Q and K (to fp32, complex multiply by the cached cis, back to
#: bf16: 20q + 20kv, and 4d per call of the cis rows), the two residual adds (6h each), SiLU (4f) and the gate product
#: (6f). Backward: the gate product's two gradients (12f), SiLU's (6f), the MLP input-gradient sum (6h), the two norm
#: backwards (6h + 4 each), the two residual-gradient adds (6h each), RoPE's backward (20q + 20kv, 8d of cis reads and
#: two 8d copies of the conjugated cis rows), and the QKV gradients concatenated (4q + 8kv). The fused (Megatron,
#: compiled) count is planner.cost._elementwise_bytes_per_token.
EAGER_BLOCK_BYTES = (
    {"h": 20, "q": 24, "kv": 28, "f": 10, "d": 8, "one": 8},
    {"h": 30, "q": 24, "kv": 28, "f": 18, "d": 24, "one": 8},
)
#: Kernel launches of that eager block, (forward, backward without the recompute): the same count.
EAGER_BLOCK_KERNELS = (15, 17)
#: HBM bytes per logit of the eager loss, (forward, backward): ``F.cross_entropy(pred.float())`` casts the bf16
#: logits to fp32 (2 + 4), log-softmax (4 + 4); backward zero-fills and scatters the NLL gradient (4), log-softmax's
#: backward (8 + 4), the cast back (4 + 2). Counted by planner/eager_probe.loss_traffic on torchtitan 0.3.0's
#: ``cross_entropy_loss``.
EAGER_LOSS_BYTES_PER_LOGIT = (14, 22)


def split_layers(num_stages: int, num_layers: int, input_weight: int, output_weight: int) -> list[int] | None:
    """Transformer layers on each virtual stage as torchtitan assigns them, or None where it refuses.

    Source: torchtitan 0.3.0 ``torchtitan/distributed/pipeline_parallel.py::_generate_llm_fqn_per_model_part``:
    ``num_layers + input_weight + output_weight`` effective layers are spread evenly (the first
    ``extra`` stages get one more); the first stage gives ``input_weight`` of its share to the
    embedding, the last ``output_weight`` to the norm and head. tests/test_emit_consumers.py
    compares this with torchtitan's own function.
    """
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    if num_stages > effective:
        return None
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0 or input_weight > per_stage or output_weight > per_stage:
        return None
    out, left = [], num_layers
    for i in range(num_stages):
        share = per_stage + (1 if i < extra else 0)
        share -= input_weight if i == 0 else output_weight if i == num_stages - 1 else 0
        take = min(share, left)
        out.append(take)
        left -= take
    return out


def stage_keys(num_layers: int, pp: int, vpp: int, chunks) -> tuple[int | None, int, int] | None:
    """(``pipeline_parallel_layers_per_stage``, first-stage less layers, last-stage less layers) with which
    torchtitan 0.3.0 builds exactly ``chunks`` (``chunks[r][c]``: layers of rank ``r``'s chunk ``c``, stages placed
    looped, virtual stage ``s`` on rank ``s % pp``), or None where no such keys do; layers_per_stage None (not
    written) where only its default gives the stage count.

    torchtitan's "stage" is a virtual stage: ``ceil((L + first_less + last_less) / layers_per_stage)`` of them, or
    without layers_per_stage ``pp`` for a single-stage schedule and ``2 pp`` for a multi-stage one
    (``pipeline_parallel.py::_get_pipeline_metadata``), split by :func:`split_layers`: 32 layers with the default keys
    on 4 x 2 stages are 4/5/4/4/4/4/4/3, which no layers_per_stage gives (5 makes 7 stages, 4 makes 9). Llama 3 405B at
    pp 16 x vpp 8, 7 + 14 x 8 + 7 layers, is torchtitan's default 1 + 126 + 1 split over 128 stages, its first stage
    only the embedding and its last only the norm and output (``first/last_stage_less_layers`` 1); Llama-3-70B's 80
    layers on 4 stages with the defaults (1 and 1) are 20/21/20/19."""
    num_stages = pp * vpp
    wanted = [chunks[s % pp][s // pp] for s in range(num_stages)]
    for first_less in range(max(wanted) + 1):
        for last_less in range(max(wanted) + 1):
            if split_layers(num_stages, num_layers, first_less, last_less) != wanted:
                continue
            per_stage = math.ceil((num_layers + first_less + last_less) / num_stages)
            if math.ceil((num_layers + first_less + last_less) / per_stage) == num_stages:
                return per_stage, first_less, last_less
            if vpp <= 2:  # the default stage count: vpp 1 runs a single-stage schedule, vpp > 1 a multi-stage one
                return None, first_less, last_less
    return None


def builds_split(plan) -> bool:
    """Whether torchtitan's own pipeline keys build ``plan``'s layers per virtual stage (:func:`stage_keys`; the
    torchtitan profile's ``split_rule``): its default split (first/last 1) puts 20/21/20/19 of Llama-3-70B's 80
    layers on 4 stages, which the first/middle/last shapes the search offers do not include."""
    from planner.specs import chunk_split

    if plan.pipeline_schedule in ("zbv", "dualpipev"):  # V placement; uneven V layouts are refused (specs.Plan)
        return False
    lps = plan.layers_per_stage
    return stage_keys(sum(lps), plan.pp, plan.vpp, chunk_split(lps, plan.vpp)) is not None


def published_layers_per_stage(num_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...] | None:
    """Layers per pipeline rank of torchtitan's published pipeline runs (its benchmark,
    llama3_h100_202412_torchtitan.md, run at torchtitan 9dec370 without split points).

    torchtitan 9dec370 ``torchtitan/parallelisms/pipelining_utils.py::generate_split_points``: with no
    ``pipeline_parallel_split_points`` there are ``pp`` stages for a single-stage schedule (1F1B) and
    ``2 pp`` for a multi-stage one (Interleaved 1F1B); each gets ``L // stages`` layers, the middle
    stages one more while ``L % stages`` lasts, the last stage the rest. Llama 3.1 405B's 126 layers:
    15 + 6 x 16 + 15 on 8 stages; 7 + 14 x 8 + 7 on 16, rank r holding virtual stages r and r + 8
    (``stage_ids_this_rank``, loop style), which is :func:`planner.specs.chunk_split` of the per-rank
    sums. None when the split is even."""
    if pp == 1:
        return None
    stages = pp * vpp
    base, extra = divmod(num_layers, stages)
    per = [base] + [base + 1 if i < extra else base for i in range(stages - 2)]
    per.append(num_layers - sum(per))
    ranks = tuple(sum(per[r + c * pp] for c in range(vpp)) for r in range(pp))
    return None if len(set(ranks)) == 1 else ranks


def published_microbatches(pp: int, vpp: int = 1) -> int:
    """Micro-batches per step of torchtitan's published pipeline runs: torchtitan 9dec370
    ``pipelining_utils.py::build_pipeline_schedule`` defaults ``experimental.pipeline_parallel_microbatches``
    to the total number of stages, ``pp x`` stages per rank (the local batch is split into that many)."""
    return pp * vpp


def reshard_after_forward(plan) -> bool:
    """torchtitan's ``fsdp_reshard_after_forward``: plan3d emits ``default`` for ZeRO-3 (True unless
    PP, ``parallelize.py::apply_fsdp``) and ``never`` below."""
    return plan.zero_stage >= 3 and plan.pp == 1


#: torchtitan 0.3.0 config-registry functions that turn async TP on (models/llama3/config_registry.py llama3_405b:
#: CompileConfig(enable=True, enable_async_tensor_parallel=True)); planner/emit/torchtitan.py turns it off where the plan
#: was costed without it, planner/readers/torchtitan.py reads it as the default of such a launch
ASYNC_TP_CONFIGS = ("llama3_405b",)


def step_cuda_graph_by_default(pp: int, ep: int) -> bool:
    """torchtitan's trainer captures the step in a CUDA graph unless pp > 1 or ep > 1, where ``_validate_cuda_graphs``
    refuses it and plan3d's launches pass ``--training.disable_cuda_graphs`` (planner/emit/torchtitan.py)."""
    return pp == 1 and ep == 1


def step_cuda_graph(training, plan) -> bool:
    """Whether torchtitan runs the step's forward+backward as one CUDA graph (``TrainingSpec.step_cuda_graph``):
    as set, else its trainer's default (:func:`step_cuda_graph_by_default`)."""
    if training.framework != "torchtitan":
        return False
    if training.step_cuda_graph is not None:
        return training.step_cuda_graph
    return step_cuda_graph_by_default(plan.pp, plan.ep)


def embedding_grad_bytes(training, plan, embedding_params: float) -> float:
    """Bytes of the word embedding's weight gradient while it is made, on a rank that holds ``embedding_params`` of
    it (this rank's vocabulary rows; 0 off the first stage): the compute-dtype gradient, and with TP first a
    gradient of the whole vocabulary.

    torchtitan shards the embedding's rows over TP (``parallelize.py``: ``"tok_embeddings": RowwiseParallel(
    input_layouts=Replicate(), output_layouts=Shard(1))``). DTensor has no backward strategy that makes a
    row-sharded weight gradient (torch 2.13 ``distributed/tensor/_ops/_embedding_ops.py``,
    ``embedding_dense_backward_strategy``: ``Shard(1)`` for column sharding, ``Partial`` for sharded batches), so
    from the gathered output gradient and the replicated token ids each rank computes the gradient of every row
    (a ``Replicate`` DTensor), t times its shard. FSDP2 redistributes it to the rank's rows when it reduces
    (``_fsdp_param.py`` ``_get_grad_inner_tensor``): without PP in the same post_backward, a copy of the rows made
    before the whole gradient goes; under PP only at the step, so the whole bf16 gradient is what each
    micro-batch's backward makes (and :func:`embedding_accumulator_extra_bytes` the fp32 accumulator it goes into).
    Measured on real gloo ranks (tests/test_embedding_grad_gloo.py: the gradient's local shape is the whole
    vocabulary's at tp 2 and 4) and in torch's own trace of the FSDP2 + TP step (tests/test_torchtitan_reserved.py,
    the first pipeline stage at tp 8)."""
    if not embedding_params:
        return 0.0
    wb = FP32 if training.precision == "fp32" else BF16
    if plan.tp == 1:
        return wb * embedding_params
    if plan.pp > 1:  # no gradient sync: the whole gradient goes into the fp32 accumulator as it is
        return wb * plan.tp * embedding_params
    return wb * (plan.tp + 1) * embedding_params  # post_backward: the whole gradient and this rank's rows


def embedding_accumulator_extra_bytes(training, plan, embedding_params: float) -> float:
    """Under PP, the fp32 accumulator of the embedding's gradient beyond this rank's rows: FSDP2 upcasts the whole
    gradient as it is (torch 2.13 ``_fsdp_param.py`` ``to_accumulated_grad_if_needed``: ``unsharded_grad.to(
    reduce_dtype)``) and redistributes it to the rows only when it reduces (``_get_grad_inner_tensor`` in
    ``perform_reduce_grad``'s post_backward), so it holds t x the rows until the step (:func:`embedding_grad_bytes`;
    tests/test_torchtitan_reserved.py, the first stage at tp 8)."""
    if plan.pp == 1 or plan.tp == 1 or not embedding_params or plan.zero_stage == 0:
        return 0.0
    return FP32 * (plan.tp - 1) * embedding_params


def state_bytes(model, training, plan, stage_params: float, layer_params: float, layers: int,
                expert_params: float = 0.0, linear_params: float | None = None, hardware=None,
                embedding_params: float = 0.0) -> StateBytes:
    """Weights, gradients and AdamW states of one GPU of a stage (module docstring).

    Persistent at the peak: the fp32 shards (parameters, gradients, Adam; the gradient shards only
    with gradient accumulation, PP or the whole-step CUDA graph (:func:`step_cuda_graph`): with one micro-batch
    and no graph, ``optimizer.zero_grad()`` (set_to_none) freed them and they are rebuilt in backward, after the
    loss); with PP also the
    unsharded bf16 parameters and fp32 gradients of the whole stage; with ``reshard_after_forward``
    off, the unsharded bf16 parameters. Working set (``StateBytes.working_*``): the gathered layer
    and the next one, or the root module, with their bf16 gradient and its fp32 cast.

    On the first stage the embedding's gradient is made as :func:`embedding_grad_bytes` says (with TP, a gradient of
    the whole vocabulary first): with the other root gradients it is the root's working set when it is larger
    than the reduction's (the bf16 gradients and their fp32 cast); under PP its fp32 accumulator is the whole
    vocabulary's too (:func:`embedding_accumulator_extra_bytes`).

    MoE (``expert_params`` of ``stage_params``): torchtitan 0.3.0 ``distributed/fsdp.py`` shards the
    routed experts of each MoE block over ``edp_mesh`` = ``efsdp`` (``dp_shard*cp*tp/ep``,
    ``distributed/parallel_dims.py``; plan3d's ``Plan.expert_dp`` with ``etp`` = 1) when ep > 1, and
    over the block's ``fsdp`` mesh (dp_shard x cp, the experts TP-split over tp) when ep = 1; the other
    parameters over ``fsdp``. So the shards are ``dense / (dp*cp) + experts / expert_dp``.
    """
    from planner.specs import plan_microbatches

    P, Pl = stage_params, layer_params
    wb = FP32 if training.precision == "fp32" else BF16  # param_dtype of the MixedPrecisionPolicy
    if plan.zero_stage == 0:  # no FSDP: fp32 parameters and gradients, autocast's bf16 weight casts
        cast = 0 if wb == FP32 else BF16
        return StateBytes(weights_bytes=P * (FP32 + cast), grads_bytes=P * FP32, optimizer_bytes=P * ADAM_STATE_BYTES)
    n = plan.dp * plan.cp
    sharded = (P - expert_params) / n + expert_params / max(plan.expert_dp, 1)
    root = max(P - layers * Pl, 0.0)  # embedding / final norm / output layer on this stage
    grad_cast = FP32 if wb != FP32 else 0  # the bf16 gradient is cast to reduce_dtype for the reduce-scatter
    weights, grads = FP32 * sharded, FP32 * sharded
    work_w = work_g = released = 0.0
    m = plan_microbatches(training, plan)
    # zero_grad(set_to_none) freed them: the shards appear during backward only; under the whole-step CUDA graph
    # torchtitan zeroes them in place instead (trainer.py: set_to_none=disable_cuda_graphs), so they stay
    if m == 1 and plan.pp == 1 and not step_cuda_graph(training, plan):
        grads, work_shards = 0.0, FP32 * sharded
    else:
        work_shards = 0.0
    if plan.pp > 1:  # PipelineStage: no reshard after backward, no gradient sync until perform_reduce_grad
        weights += wb * P
        partial = embedding_accumulator_extra_bytes(training, plan, embedding_params)
        grads += FP32 * P + partial
        # freed at the last backward (torch pipelining stage.py backward_maybe_with_nosync, last_backward: FSDP2
        # post_backward with reshard_after_backward and gradient sync on), before the schedule returns
        released = (wb + FP32) * P + partial
        # each group's bf16 gradient lives until it is added into the fp32 accumulator
        # (FSDPParam.to_accumulated_grad_if_needed / accumulate_unsharded_grad_if_needed)
        work_g = max(grad_cast and wb * max(Pl, root), embedding_grad_bytes(training, plan, embedding_params))
    else:
        # the root's gradients: cast for the reduction, or at the embedding's backward (the other root gradients,
        # the output layer's and the final norm's, live until FSDP2's final callback)
        made = embedding_grad_bytes(training, plan, embedding_params)
        root_g = max((wb + grad_cast) * root, wb * (root - embedding_params) + made if made else 0.0)
        if reshard_after_forward(plan):  # one layer gathered + the next prefetched, or the root module
            layer_set = (wb * min(2, layers) * Pl, (wb + grad_cast) * Pl)
            work_w, work_g = max(layer_set, (wb * root, root_g), key=sum)
        else:  # reshard_after_forward=False: every layer stays gathered from its forward to its backward
            weights += wb * P
            work_g = max((wb + grad_cast) * Pl, root_g)
    return StateBytes(weights_bytes=weights, grads_bytes=grads, optimizer_bytes=ADAM_STATE_BYTES * sharded,
                      working_weights_bytes=work_w, working_grads_bytes=work_g + work_shards,
                      released_at_last_backward_bytes=released)


def logits_bytes_per_element(training, plan) -> float:
    """Bytes per logit live at the loss (module docstring); fp32 training: logits, log-softmax, grad."""
    if training.precision == "fp32":
        return 3 * FP32
    if plan.tp > 1:
        return LOSS_PARALLEL_BYTES_PER_ELEMENT
    return COMPILED_LOGITS_BYTES_PER_ELEMENT if training.compiled_loss else LOGITS_BYTES_PER_ELEMENT


#: The passes FSDP2 runs on the compute stream in each micro-batch, over the stage's parameters besides the GEMMs:
#: (operation, bytes read, bytes written) per local parameter element (the whole, unsharded stage). Recorded on torch
#: 2.13's ``fully_shard`` and ``torch.distributed.pipelining`` on four gloo ranks (tests/fsdp2_accumulation_probe.py,
#: compared in tests/test_fsdp2_accumulation.py). The gradients' (``GRAD_PASSES``), by whether a pipeline defers the
#: reduce-scatter and the parameters' compute dtype:
#:
#: * under a pipeline (``PipelineStage.backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)`` until the
#:   last micro-batch) each steady backward adds the new bf16 gradient into the fp32 unsharded one
#:   (``FSDPParamGroup.post_backward`` -> ``FSDPParam.accumulate_unsharded_grad_if_needed``, on the current stream):
#:   fp32 read and written, bf16 read, 10 B; with fp32 parameters autograd's own accumulation into ``.grad``, 12 B.
#:   The step's first backward casts instead (``to_accumulated_grad_if_needed``: 2 read, 4 written): charging the
#:   steady 10 B to all m overstates the term by 4 / (10 m);
#: * without a pipeline each backward reduce-scatters: ``foreach_reduce`` copies the bf16 gradients into the fp32
#:   reduce-scatter input (``foreach_reduce_scatter_copy_in``, ``fsdp::chunk_cat``) on the current stream before the
#:   reduce-scatter stream waits for it: 2 read, 4 written (fp32: 4 and 4). What follows (the division, the copy and
#:   add into the sharded gradient) runs on the reduce-scatter stream, alongside the next layers' backward.
GRAD_PASSES = {
    ("pipeline", "bf16"): (("aten::add_", 6.0, 4.0),),
    ("pipeline", "fp32"): (("aten::add_", 8.0, 4.0),),
    ("plain", "bf16"): (("fsdp::chunk_cat", 2.0, 4.0),),
    ("plain", "fp32"): (("fsdp::chunk_cat", 4.0, 4.0),),
}
#: And each all-gather's copy-out into the unsharded parameters (``FSDPParamGroup.wait_for_unshard`` ->
#: ``foreach_all_gather_copy_out``, ``fsdp::split_with_sizes_copy``, on the current stream), per gathered element, by
#: compute dtype; how many a micro-batch runs is :func:`gathers_per_microbatch`.
GATHER_COPY_OUT = {"bf16": ("fsdp::split_with_sizes_copy", 2.0, 2.0),
                   "fp32": ("fsdp::split_with_sizes_copy", 4.0, 4.0)}


def reshards_after_forward(training, plan) -> bool:
    """Whether the transformer blocks' FSDP units reshard after forward: torchtitan's policy as plan3d emits it
    (zero_stage 3 as ``fsdp_reshard_after_forward`` "default", True without PP and False with it; 1 and 2 as "never":
    ``distributed/fsdp.py::get_fsdp_reshard_after_forward_policy``), plan3d validate's miniature at zero_stage 3
    whatever the pipeline (planner/validate/worker.py: ``reshard_after_forward=p.zero_stage >= 3``)."""
    if training.framework == "torch":
        return plan.zero_stage >= 3
    return plan.zero_stage == 3 and plan.pp == 1


def gathers_per_microbatch(training, plan) -> int:
    """All-gathers of the stage's parameters in a steady micro-batch (recorded, tests/test_fsdp2_accumulation.py).
    Without a pipeline: in the forward, and again in the backward where the blocks reshard after forward
    (:func:`reshards_after_forward`); the backward reshards after itself, so every micro-batch gathers anew. Under a
    pipeline the nosync backwards do not reshard (``set_reshard_after_backward(False)``): with reshard after forward
    the backward gathers and the next forward finds the parameters gathered, one per micro-batch; without it none, the
    parameters gathered once per step. The warm-up's back-to-back forwards gather once each more, not counted.
    torchtitan never reshards its final norm and output layer after forward unless the policy is "always"
    (``apply_fsdp_to_decoder``), so they gather once where two are charged: 4 B x their parameters per micro-batch
    too much (Llama-3-8B: 0.53 B parameters, 0.8 ms on an H100)."""
    if plan.zero_stage == 0:
        return 0
    again = reshards_after_forward(training, plan)
    if plan.pp > 1:
        return 1 if again else 0
    return 2 if again else 1


def microbatch_passes(training, plan) -> tuple:
    """The compute-stream passes of one micro-batch over the stage's parameters (``GRAD_PASSES`` and the all-gathers'
    copy-outs, ``GATHER_COPY_OUT``); none without FSDP (zero_stage 0, ``replicate``: not recorded)."""
    if plan.zero_stage == 0:
        return ()
    dtype = "fp32" if training.precision == "fp32" else "bf16"
    return GRAD_PASSES[("pipeline" if plan.pp > 1 else "plain", dtype)] + \
        (GATHER_COPY_OUT[dtype],) * gathers_per_microbatch(training, plan)


def grad_accum_bytes_per_param(training, plan, last_stage: bool = True) -> float:
    """Bytes each micro-batch moves per local parameter on the compute stream outside the GEMMs
    (:func:`microbatch_passes`; ``cost.grad_accum_s``): under a pipeline 10 (14 for plan3d validate's miniature at
    zero_stage 3); without one 6 + 4 per all-gather (14 at zero_stage 3, 10 at 1 and 2); with fp32 parameters 12 and 8
    for the gradients and 8 per gather; 0 without FSDP. The same on every stage (``last_stage`` is DeepSpeed's)."""
    return float(sum(r + w for _, r, w in microbatch_passes(training, plan)))


PROFILE = FrameworkProfile(name="torchtitan", state_bytes=state_bytes, logits_bytes_per_element=logits_bytes_per_element,
                           sp_gathers_inputs=True, swiglu_unfused=True, op_sac=True,
                           saves_quantized_gemm_inputs=False,  # torchao float8 (module docstring)
                           allows_heavier_ends=False,  # pipeline_parallel_first/last_stage_less_layers
                           # its automatic split shortens only the first and last *virtual* stage, and
                           # module_fqns_per_model_part cannot be passed on the command line (planner/emit/torchtitan.py)
                           uneven_virtual_ends_only=True, pipeline_recv_buffers=True,
                           gemm_workspaces="torch",  # nn.Linear and torchao's _scaled_mm (memory.gemm_workspace_bytes)
                           split_rule=builds_split,  # and whatever else its keys build (20/21/20/19)
                           allows_layer_interval_recompute=True,  # selective_ac_option N (Plan.recompute_interval)
                           expert_tp_rule="torchtitan", moe_ep_needs_fsdp=True, moe_dispatch="torchtitan",
                           fsdp_with_cp=True,  # ParallelDims.fsdp_enabled (FrameworkProfile.fsdp_with_cp)
                           replicates_kv_heads=False,  # models/common/decoder.py: tp must divide n_kv_heads
                           moe_host_issue="torchtitan",  # grouped experts (planner.cost.TORCHTITAN_MOE_HOST_OPS)
                           eager_block_bytes=EAGER_BLOCK_BYTES,
                           eager_block_kernels=EAGER_BLOCK_KERNELS, eager_loss_bytes_per_logit=EAGER_LOSS_BYTES_PER_LOGIT,
                           grad_accum_bytes_per_param=grad_accum_bytes_per_param)  # cost.grad_accum_s

# plan3d validate's own model on the same torch.distributed code: fused SwiGLU, Megatron's selective recompute
TORCH_PROFILE = replace(PROFILE, name="torch", swiglu_unfused=False, op_sac=False,
                        allows_block_recompute=True,  # its miniature recomputes the first K layers of a chunk
                        # (and every N-th layer of a rank, Plan.recompute_interval, as torchtitan does)
                        uneven_virtual_ends_only=False,  # plan3d validate's miniature splits any stage
                        moe_ep_needs_fsdp=False,  # its expert mesh stands apart from FSDP (planner/validate/moe_layer.py)
                        fsdp_with_cp=False,  # its ZeRO-0 replicates over dp x cp (planner/validate/worker.py)
                        replicates_kv_heads=True,  # its miniature keeps max(kv_heads // tp, 1) (planner/validate/model.py)
                        # its MoE miniature runs its experts one by one and copies the counts to the host every layer
                        # (planner/validate/moe_layer.py: recv.tolist()), as Megatron's SequentialMLP does
                        moe_host_issue="megatron",
                        # plan3d validate's miniature runs fused SwiGLU and RoPE of its own, not torchtitan's block
                        eager_block_bytes=None, eager_block_kernels=None, eager_loss_bytes_per_logit=None)


def reserved_modelled(model, training, plan) -> bool:
    """Whether :mod:`planner.allocator_trace` writes this plan's step: dense models, one virtual stage per
    rank in 1F1B order (torchtitan's default ``pipeline_parallel_schedule``), no activation offloading and no
    block recompute (torchtitan's own per-layer AC, ``plan.recompute_interval``, is written layer by layer).
    Interleaved and zero-bubble schedules and MoE layers (expert shards over ``efsdp``, dispatch buffers)
    are not written: their peak stays the allocated estimate."""
    return (not model.is_moe and plan.vpp == 1 and plan.schedule == "1f1b" and not plan.cpu_offload_layers
            and plan.recompute_num_layers is None)  # block recompute (Megatron's) is not written either


def with_reserved(model, hardware, training, plan, num_microbatches: int, stages: tuple) -> tuple:
    """``stages`` with ``reserved_bytes``: the peak reserved of each stage's synthetic step trace
    (:func:`planner.allocator_trace.stage_reserved`), never below the stage's allocated total.

    What ``fits`` means for torchtitan: the trace is replayed with the device's usable memory
    (``HardwareSpec.usable_memory_gib``) as the caching allocator's limit. When a new segment would
    pass it, the allocator releases its wholly free cached segments and retries
    (``CUDACachingAllocator.cpp``: ``malloc`` -> ``release_cached_blocks``), so the reserved peak stays
    at or under the limit exactly when the step runs without ``OutOfMemoryError``: ``peak_gib <=
    usable_gib`` is "no OOM", and ``peak_gib`` is then what ``max_memory_reserved`` would log on that
    device. A step whose allocations fit but whose free blocks cannot serve a request even after the
    release (fragmentation) does not fit; one that reserves more than the device on a larger GPU but
    fits once the cache is released does. The usable memory keeps the profile's headroom for what the
    trace leaves out (NCCL's and the context's memory; FSDP2's stream pools are in it).
    """
    if not reserved_modelled(model, training, plan):
        return stages
    from planner.allocator_trace import stage_reserved
    from planner.specs import GIB

    capacity = hardware.usable_memory_gib * GIB
    out = []
    for st in stages:
        reserved, _, _ = stage_reserved(model, training, plan, st.stage, st.layers, num_microbatches, capacity,
                                        blas_workspace_bytes=int(hardware.blas_workspace_mib * 2**20))
        out.append(replace(st, reserved_bytes=max(reserved, st.total_bytes)))
    return tuple(out)
