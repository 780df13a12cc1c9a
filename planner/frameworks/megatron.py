"""Megatron-LM / Megatron-Core: how ``DistributedDataParallel`` and ``DistributedOptimizer`` hold the states.

Code paths (Megatron-LM core_v0.16, ``megatron/core/distributed`` and ``megatron/core/optimizer``):

* **Weights**: bf16 parameters, full size on every DP rank. With ``--use-distributed-optimizer``
  they live in the ``param_data`` buffer of ``_ParamAndGradBuffer`` (``param_and_grad_buffer.py``)
  and the post-step all-gather writes into that buffer in place: no separate gather buffer.
* **Gradients**: one contiguous ``grad_data`` buffer per dtype, full size, in fp32 by default:
  ``arguments.py`` sets ``accumulate_allreduce_grads_in_fp32`` for bf16 ("bfloat16 requires
  gradient accumulation and all-reduce to be done in fp32"); ``--grad-reduce-in-bf16`` makes it
  bf16 (``TrainingSpec.grad_reduce_in_bf16``). The distributed optimizer reduce-scatters inside
  that buffer, so it is **not** sharded (ZeRO-1 semantics, formulas.md A1 table "6 + 12/d").
  Buckets (``DistributedDataParallelConfig.bucket_size`` = max(40M, 1M x dp) params) are views
  of the buffer: no extra bytes beyond padding.
* **Optimizer**: fp32 master copy + Adam m and v, 12 B/param, divided by DP x CP with the
  distributed optimizer (``distrib_optimizer.py``, the ``data_parallel_group_with_cp``).
* **Precision-aware optimizer** (``TrainingSpec.optimizer_dtype="bf16"``: ``--use-precision-aware-optimizer
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``; Megatron-Bridge's DeepSeek-V3 recipe sets it): Transformer Engine's
  FusedAdam keeps m and v in bf16 (2 + 2 B). The master weight is TE's too where
  ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` holds (core_v0.16.1 ``optimizer/optimizer_config.py`` lines
  355-362: bf16 training, or fp8 with delayed scaling) and then, ``store_param_remainders`` being on by default
  (TE >= 2.1, ibid. line 192), it is the 16 bits the bf16 parameter lacks: an int16 remainder, 2 B
  (``distrib_optimizer.py`` line 802, the state shard it allocates to load one: ``init_shard(torch.int16)``). Otherwise (per-tensor current scaling,
  MXFP8, NVFP4, or fp8 weights) Megatron keeps the fp32 master, 4 B. So 6 or 8 B/param in place of 12, over the same
  data-parallel groups (TE older than 2.1 keeps the fp32 master, 2 B more per parameter: not modelled). Megatron
  accepts it only with the distributed optimizer (``optimizer_config.py`` line 381: "--use-precision-aware-optimizer
  only supported with distributed optimizer"), which Megatron-FSDP does not turn on: ZeRO 1 here.
* **ZeRO-2/3**: Megatron-FSDP (``--use-megatron-fsdp --data-parallel-sharding-strategy
  optim_grads[_params]``), counted as ``planner.memory.zero_working_set_bytes`` says.
* **fp8** (Transformer Engine, ``--fp8-format``): bf16 weights stay; TE's ``Linear`` caches the
  fp8 weight and its transpose across micro-batches (``transformer_engine/pytorch/module/linear.py``
  ``get_weight_workspace(cache_name="weight")`` when Megatron passes ``is_first_microbatch``):
  +2 B per linear-layer parameter. Not under Megatron-FSDP (ZeRO 2/3): its ``keep_fp8_transpose_cache``
  is off by default (core_v0.16.1 ``core/distributed/fsdp/src/README.md``).
* **fp8 parameters** (``--fp8-param-gather``, NeMo ``fp8_params``, ``TrainingSpec.fp8_params``): the
  model is built under TE's ``fp8_model_init``, so each GEMM weight is a ``Float8Tensor`` and no bf16
  copy exists. ``distributed_data_parallel.py`` (core_v0.16.1, lines 138-146) puts such parameters in
  a ``torch.uint8`` param buffer ("its actual data is stored in the form of a torch uint8 tensor"),
  1 B per weight, and the distributed optimizer all-gathers fp8 into it; the gradient buffer keeps
  the parameter's nominal dtype (bf16, or fp32 with grad_reduce_in_fp32, line 147). TE keeps the
  fp8 transpose of each weight for the backward: ``module/linear.py`` (TE 1.x, NVIDIA/TransformerEngine
  commit 0004dbd0) ``_Linear.backward`` takes it as ``weight.transpose(cache=ctx.is_first_microbatch
  is not None)`` when ``primary_weights_in_fp8``, and Megatron passes ``is_first_microbatch`` unless
  ``disable_parameter_transpose_cache`` (core_v0.16.1 ``extensions/transformer_engine.py``), 1 B: 2 B per
  GEMM weight in place of bf16 + cache's 4. Norms, embedding and output layer stay bf16.
  Under mxfp8 (``--fp8-recipe mxfp8 --fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag``, Megatron-Bridge's
  ``bf16_with_mxfp8_mixed``) each GEMM weight is a TE ``MXFP8Tensor`` holding both block-scaled directions
  (row-wise for the forward, column-wise for the dgrad GEMM), 1 B each plus one E8M0 scale per 32 values,
  and there is no param buffer: core_v0.16.1 ``param_and_grad_buffer.py`` (lines 776-792) makes one
  ``shared_buffer`` of the gradient dtype for the gradients and the bf16 parameter all-gather, and
  ``finish_param_sync`` copies (casts) the gathered bf16 values into the ``MXFP8Tensor`` s. So 2 + 2/32 B
  per GEMM weight in place of bf16 + cache's 4 + 2/32, and the all-gather moves bf16. Modelled
  with the distributed optimizer (ZeRO 1); Megatron accepts ``--fp8-param-gather`` with it, torch FSDP2 or
  Megatron-FSDP (``training/arguments.py`` line 655).
* **fp8 parameters under Megatron-FSDP** (ZeRO 3, ``optim_grads_params``; Megatron-Bridge copies the precision
  recipe's ``fp8_param_gather`` into ``DistributedDataParallelConfig``, ``MixedPrecisionConfig.setup``): per-tensor
  fp8 GEMM weights live sharded in a uint8 model-weight buffer, 1 B per weight in place of bf16's 2
  (``MEGATRON_FSDP_FP8_PARAM_BYTES``); the gradient buffer stays bf16 (fp32 with grad_reduce_in_fp32) and the fp32
  main weights in the optimizer shards. The gathered layers (``planner.memory.zero_working_set_bytes``, 2 B per
  weight) are left as they are: 1 B of fp8 data plus, in backward, TE's fp8 transpose (1 B; Blackwell's non-TN fp8
  GEMMs make none, ``Float8TensorStorage.update_usage``; not taken off in the gathered layers, which
  ``zero_working_set_bytes`` counts without the hardware: the Hopper bytes, the larger, are kept there). MXFP8 under Megatron-FSDP (a uint8 row-wise and a uint8
  column-wise buffer, both sharded, and the block scales) is left at the bf16 bytes, 2 B against its 2 + scales: a
  possible undercount of the scales, whose placement was not read. A stage with routed experts keeps the bf16
  bytes too (the larger).
* **Logits**: the vocab-parallel cross entropy (``tensor_parallel/cross_entropy.py``) upcasts the
  bf16 logits to fp32 in place of a copy: 2 + 4 B per logit live together (``planner.memory``
  contradiction 5). ``--cross-entropy-loss-fusion`` alone (``--cross-entropy-fusion-impl native``, the default:
  ``fused_vocab_parallel_cross_entropy``, ``core/fusions/fused_cross_entropy.py``) upcasts too and saves the fp32
  ``exp_logits``, but its pieces run under ``jit_fuser``, which is ``torch.compile`` on torch >= 2.2
  (``core/jit.py``): compiled, ``calculate_gradients`` writes its in-place ``index_put`` and ``mul_`` on the saved
  softmax through a new fp32 buffer of the logits' size and copies it back, next to the bf16 gradient it returns
  (inductor's output code for core_v0.16.1's function under torch 2.13: ``buf0 = empty_strided((s*b, v/t),
  float32)`` beside the bf16 ``buf2``): 4 + 4 + 2 = 10 B per logit in the loss backward. NVIDIA's functional test
  ``gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion`` on DGX H100 measured 4.1 B per logit above the 6
  (``benchmarks/megatron_functional_memory.py``). With ``--cross-entropy-fusion-impl te``
  (``TrainingSpec.cross_entropy_fusion``; ``language_module.py`` ``compute_language_model_loss`` calls
  ``te_parallel_cross_entropy``) Transformer Engine's Triton kernel keeps the bf16 logits and 12 B per token
  of fp32 (max, sum, target logit), and its backward writes the gradient into the logits in place
  (NVIDIA/TransformerEngine ``transformer_engine/pytorch/triton/cross_entropy.py``, commit 02965d2:
  ``cross_entropy_backward_kernel`` "is performed in-place"): 2 B per logit.
"""

from __future__ import annotations

from planner.frameworks import FrameworkProfile, StateBytes

#: Megatron-FSDP's reduce-scatter queue for ZeRO 2-3 (``optim_grads``, ``optim_grads_params``), in gradient elements
#: per model chunk: core_v0.16.1 ``core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py`` sets
#: ``suggested_RS_queue_capacity`` to ``suggested_communication_unit_size``, at least 1,000,000,000 ("Cap to 1B
#: elements": ``max(1_000_000_000, ...)``; the default ``DistributedDataParallelConfig`` leaves it None), and
#: ``param_and_grad_buffer.py::GradReducePipeline.wait_for_previous_grad_reduce`` makes the compute stream wait for
#: the oldest asynchronous reduce-scatter only once the queued buckets exceed it. ``_root_post_backward`` does not
#: wait ("asynchronous gradient reduce-scatter calls can be overlapped with subsequent compute").
MEGATRON_FSDP_RS_QUEUE_ELEMENTS = 1_000_000_000

FP8_WEIGHT_CACHE_BYTES = 2  # TE fp8 weight + fp8 transpose, 1 B each (module docstring)
#: The quantised weight copies TE keeps per GEMM weight, by recipe: fp8 row-wise + transpose; mxfp8 both
#: block-scaled directions with their E8M0 scales (1/32 B each); nvfp4 both directions at 0.5 B with
#: E4M3 scales per 16 (NVFP4 weights use 16x16 2D blocks, arXiv:2509.25149, so about 1/256 B: left out).
WEIGHT_CACHE_BYTES = {"fp8": FP8_WEIGHT_CACHE_BYTES, "mxfp8": 2 + 2 / 32, "nvfp4": 1.0}
#: ``fp8_params`` (Megatron --fp8-param-gather, NeMo fp8_params; module docstring): the fp8 weight itself
#: (core_v0.16.1 distributed_data_parallel.py builds the param buffer of Float8Tensor params in torch.uint8)
#: and the fp8 transpose TE keeps beside it for the dgrad GEMM (Hopper fp8 GEMMs take TN layouts only).
FP8_PARAM_BYTES = 1
FP8_PARAM_TRANSPOSE_BYTES = 1
#: FP8_TRANSPOSE_FREE: on a GPU with ``HardwareSpec.fp8_any_layout_gemm`` (Blackwell sm_100/sm_103) Transformer Engine
#: makes no fp8 transpose of a per-tensor-scaled tensor: ``bool create_transpose = columnwise_usage &&
#: !nvte_is_non_tn_fp8_gemm_supported()`` (NVIDIA/TransformerEngine transformer_engine/pytorch/csrc/quantizer.cpp),
#: and ``nvte_is_non_tn_fp8_gemm_supported()`` is true for compute capability 10.0-11.x and >= 13.0
#: (transformer_engine/common/transformer_engine.cpp): the weight cache and fp8_params keep 1 B per GEMM weight, not 2.
#: MXFP8 and NVFP4 keep both directions there too: their column-wise data is its own block-scaled quantisation.
#: ``fp8_params`` under mxfp8: the ``MXFP8Tensor`` weight, both directions with their scales (module docstring).
#: The per-tensor fp8 entry is Hopper's 1 + 1 B; :func:`state_bytes` takes the transpose off on Blackwell (above).
#: BLOCKWISE_BOTH_DIRECTIONS: FP8 block scaling (``fp8_recipe: blockwise``, TE ``Float8BlockScaling``) quantises the
#: column-wise copy on its own blocks (1 x 128 tiles run along the other dimension; DeepSeek-V3 report section 3.3), so
#: it is no transpose of the row-wise data and is kept on Blackwell too: 1 + 1 B, as on Hopper. The 128 x 128 weight
#: blocks' FP32 scales (4 B per 16,384 values) are left out.
QUANTISED_PARAM_BYTES = {"fp8": FP8_PARAM_BYTES + FP8_PARAM_TRANSPOSE_BYTES, "mxfp8": 2 + 2 / 32}
#: Megatron-FSDP (ZeRO 3) with fp8 parameters, per-tensor fp8: core_v0.16.1
#: ``core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py`` (``ParamAndGradBuffer``, lines 1941-1962)
#: gives a parameter group of ``Float8Tensor`` s a ``torch.uint8`` model-weight buffer (1 B per weight, sharded under
#: ``optim_grads_params``) and a transpose buffer only for MXFP8 (``fp8_need_transpose_data``, mixed_precision.py
#: lines 182-184); the per-tensor fp8 transpose is made for the gathered parameter in backward only
#: (``megatron_fsdp.py`` line 453, ``fp8_create_transpose_cache``) and dropped when the layer is released
#: (``keep_fp8_transpose_cache`` False, lines 538-544), so it belongs to the working set (left at 2 B per weight).
MEGATRON_FSDP_FP8_PARAM_BYTES = 1
#: Adam's m and v in bf16 under the precision-aware optimizer (``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``)
PRECISION_AWARE_MOMENTS_BYTES = 2 + 2
#: its master weight: the int16 remainder of the fp32 value next to the bf16 parameter (store_param_remainders), or
#: the fp32 master itself where Megatron, not TE, keeps it (module docstring)
PARAM_REMAINDER_BYTES = 2
FP32_MASTER_BYTES = 4
#: The optimizer's fp32 copy of a 16-bit gradient, made inside ``optimizer.step()`` (:func:`step_grad_copy_bytes`)
FP32_GRAD_COPY_BYTES = 4
LOGITS_BYTES_PER_ELEMENT = 6  # bf16 logits + fp32 upcast (module docstring)
TE_FUSED_LOGITS_BYTES_PER_ELEMENT = 2  # bf16 logits, the gradient written in place (module docstring)
NATIVE_FUSED_LOGITS_BYTES_PER_ELEMENT = 10  # saved fp32 softmax + compiled backward's fp32 copy + bf16 gradient


#: Muon runs at ZeRO 0 only: core_v0.16.1 arguments.py validate_args asserts no distributed optimizer, no
#: Megatron-FSDP and no torch FSDP2 when 'muon' is in --optimizer (TrainingSpec.optimizer)
MUON_ZERO_STAGES = (("muon", (0,)), ("dist_muon", (0,)))


def precision_aware_optimizer_bytes(training) -> float:
    """Optimizer bytes per parameter under Megatron's precision-aware optimizer with bf16 moments (module
    docstring): TE keeps the master as an int16 remainder in bf16 training and fp8 delayed scaling with bf16
    weights (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``, ``store_param_remainders``), else the fp32 master."""
    te_master = (training.precision == "bf16" or (training.precision == "fp8" and training.fp8_recipe == "delayed")) \
        and not training.fp8_params
    return PRECISION_AWARE_MOMENTS_BYTES + (PARAM_REMAINDER_BYTES if te_master else FP32_MASTER_BYTES)


def step_grad_copy_bytes(training, plan, dense_params: float, expert_params: float = 0.0) -> float:
    """Bytes the optimizer step holds beyond the model states (``StateBytes.step_extra_bytes``): fp32 copies of a
    16-bit gradient buffer (``--grad-reduce-in-bf16``). core_v0.16.1 ``optimizer/optimizer.py``
    (``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads``, no distributed optimizer:
    ``main_param.grad = model_param.main_grad.float()`` for every parameter) and ``optimizer/distrib_optimizer.py``
    (``DistributedOptimizer._copy_model_grads_to_main_grads``: ``shard_main_param.grad = shard_model_grad.float()``
    for the rank's shard, over dp x cp, or the expert-data-parallel group for routed experts). ``.float()`` of an
    fp32 buffer is the buffer itself, so fp32 gradients cost nothing here. The copies live until the next step's
    ``optimizer.zero_grad()`` (megatron/training/training.py ``train_step``), when no activation is held. None under
    the precision-aware optimizer where it steps on the 16-bit buffer itself (``decoupled_grad``, when
    ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``: bf16, or fp8 with delayed scaling;
    ``optimizer_config.py``) or under Megatron-FSDP (ZeRO 2/3: ``_copy_model_grads_to_main_grads`` returns at once).
    Measured on Megatron-Core's own DDP and optimizers on four CPU ranks (tests/test_megatron_states.py)."""
    from planner.memory import grad_bytes

    if grad_bytes(training) >= FP32_GRAD_COPY_BYTES or plan.zero_stage >= 2:
        return 0.0
    if training.optimizer_dtype == "bf16" and (training.precision == "bf16" or (
            training.precision == "fp8" and training.fp8_recipe == "delayed")):
        return 0.0
    if plan.zero_stage == 0:
        return FP32_GRAD_COPY_BYTES * (dense_params + expert_params)
    dense_shards, expert_shards = optimizer_shards(training, plan)
    return FP32_GRAD_COPY_BYTES * (dense_params / dense_shards + expert_params / expert_shards)


#: Bytes per element of the largest Muon weight that its Newton-Schulz step holds at once (Emerging-Optimizers
#: muon_utils.newton_schulz, module planner.muon): the fp32 normalised copy (4) is freed once cast to bf16 (2); a step
#: holds the old and new bf16 X (2 + 2) beside the m x m products; the fp32 result (4) and the two scaled products of
#: TensorParallelMuon's ``orth_grad * scale_factor * extra_scale_factor`` (4 + 4) are the peak: 12
MUON_NS_TRANSIENT_BYTES = 12


def muon_state(model, training, plan, stage: int, layers: int, per_param: tuple) -> tuple[float, float]:
    """(optimizer bytes, bytes the step holds beyond the states) of one GPU of stage ``stage`` under Megatron-Core's
    Muon (``training.optimizer``; :mod:`planner.muon`): fp32 master copies (none in fp32 training) and one fp32
    momentum per Muon weight, Adam's ``per_param[2]`` bytes per other parameter; dist_muon keeps those of the
    parameters dealt to the rank (dp x cp ranks, the routed experts' over the expert-data-parallel group; Megatron
    asserts no distributed optimizer, so ZeRO 0). At the step: the fp32 copies of a 16-bit gradient buffer
    (:func:`step_grad_copy_bytes`: ``Float16OptimizerWithFloat16Params`` copies the grads of the parameters in its
    groups, with dist_muon this rank's) and the Newton-Schulz transient of the largest Muon weight
    (``MUON_NS_TRANSIENT_BYTES``)."""
    from planner import muon
    from planner.memory import grad_bytes

    master = muon.FP32_MASTER_BYTES if per_param[2] > 8 else 0.0  # 2 + 4 + 12 mixed precision; fp32: 4 + 4 + 8
    dense_ranks, expert_ranks = plan.dp * plan.cp, plan.expert_dp
    optimizer = muon.optimizer_bytes(model, plan, stage, layers, training.optimizer, per_param[2], master,
                                     dense_ranks, expert_ranks)
    copies = 0.0
    if grad_bytes(training) < FP32_GRAD_COPY_BYTES and per_param[2] > 8:
        copies = FP32_GRAD_COPY_BYTES * muon.owned_params(model, plan, stage, layers, training.optimizer, dense_ranks,
                                                          expert_ranks)
    largest = max((r[0] for r in muon.stage_tensors(model, plan, stage, layers) if r[2]), default=0.0)
    return optimizer, copies + MUON_NS_TRANSIENT_BYTES * largest


def optimizer_shards(training, plan) -> tuple[int, int]:
    """(dense, expert) ranks the distributed optimizer shards its states over: dp x cp and the expert-data-parallel
    size, each divided by ``training.dist_optimizer_instances`` (core_v0.16.1 ``parallel_state.py``:
    ``intra_partial_data_parallel_size = dp x cp / N``, the expert group likewise; ``distrib_optimizer.py`` shards
    each buffer over the intra-instance group)."""
    n = training.dist_optimizer_instances
    return max(plan.dp * plan.cp // n, 1), max(plan.expert_dp // n, 1)


def linear_params_per_rank(model, tp: int, layers: int) -> float:
    """Parameters of the GEMM weights of ``layers`` layers on one TP rank (norms and biases left out)."""
    from planner.memory import layer_params_per_rank

    bias_and_norms = 2 * model.norm_params + (model.q_size + 2 * model.kv_heads * model.kv_channels
                                              if model.has_qkv_bias else 0)
    return layers * max(layer_params_per_rank(model, tp, False) - bias_and_norms, 0.0)


def state_bytes(model, training, plan, stage_params: float, layer_params: float, layers: int,
                expert_params: float = 0.0, linear_params: float | None = None, hardware=None,
                embedding_params: float = 0.0,
                optimizer_bytes_per_param: float | None = None, muon_stage: int | None = None) -> StateBytes:
    """Weights, gradients and optimizer of one GPU of a stage under Megatron-Core (module docstring):
    ZeRO sharding as ``planner.memory.state_bytes_per_param`` with the ZeRO-2/3 working set of
    ``planner.memory.zero_working_set_bytes``, plus TE's fp8 weight cache.

    ``expert_params`` (part of ``stage_params``): the routed experts, whose gradient buffers and
    distributed-optimizer shards live in the expert-data-parallel group of ``plan.expert_dp`` ranks
    (core_v0.16.1 ``distributed_data_parallel.py``: ``expert_parallel_buffers`` over
    ``intra_expt_dp_group``), the rest over dp x cp. ``linear_params``: the stage's GEMM weights for
    the fp8 cache (default: ``layers`` dense layers, :func:`linear_params_per_rank`). ``optimizer_bytes_per_param``:
    another optimizer's state bytes per parameter, sharded as Megatron's (NeMo's Apex optimizer); default Megatron's
    own (12, or the precision-aware optimizer's with ``optimizer_dtype`` bf16). ``embedding_params`` is not used:
    ``VocabParallelEmbedding`` computes its weight gradient on this rank's rows only (core_v0.16.1
    ``tensor_parallel/layers.py``: the input masked to the local range, ``F.embedding`` on the local weight).
    ``muon_stage``: the stage's index, read with ``training.optimizer`` muon or dist_muon (:func:`muon_state`)."""
    from planner.memory import param_bytes, state_bytes_per_param, zero_working_set_bytes

    per_param = param_bytes(training)
    dense = stage_params - expert_params
    dense_shards, expert_shards = optimizer_shards(training, plan)  # dp x cp (expert dp) / dist_optimizer_instances
    w, g, o = state_bytes_per_param(plan.zero_stage, dense_shards, per_param)
    we, ge, oe = state_bytes_per_param(plan.zero_stage, expert_shards, per_param) if expert_params else (w, g, o)
    w_work, g_work = zero_working_set_bytes(model, plan, layers, per_param, layer_params)
    sharded = dense * w + expert_params * we
    if training.fp8_params and training.precision == "fp8" and plan.zero_stage >= 3 and not expert_params:
        # Megatron-FSDP with fp8 parameters: the sharded model-weight buffer of Float8Tensor params is uint8, 1 B
        # per GEMM weight in place of bf16's 2 (MEGATRON_FSDP_FP8_PARAM_BYTES; module docstring). Stages with
        # routed experts (sharded over the expert-data-parallel group) keep the bf16 bytes, the larger
        linear = linear_params_per_rank(model, plan.tp, layers) if linear_params is None else linear_params
        sharded -= (per_param[0] - MEGATRON_FSDP_FP8_PARAM_BYTES) * linear / max(plan.dp * plan.cp, 1)
    weights = min(sharded + w_work, stage_params * per_param[0])
    if training.precision in WEIGHT_CACHE_BYTES and plan.zero_stage < 2:
        # (Megatron-FSDP, ZeRO 2/3, keeps no fp8 weight cache: ``keep_fp8_transpose_cache`` is off by default,
        # "This option will cause (number of parameter x 1 Byte) of memory overhead", core_v0.16.1
        # core/distributed/fsdp/src/README.md; param_and_grad_buffer.py discards the transpose caches)
        linear = linear_params_per_rank(model, plan.tp, layers) if linear_params is None else linear_params
        # per-tensor fp8 on a GPU whose fp8 GEMMs take any operand layout keeps no fp8 transpose (FP8_TRANSPOSE_FREE);
        # block scaling keeps both directions everywhere (BLOCKWISE_BOTH_DIRECTIONS)
        no_transpose = FP8_PARAM_TRANSPOSE_BYTES if (training.precision == "fp8" and training.fp8_recipe != "blockwise"
                                                     and hardware is not None and hardware.fp8_any_layout_gemm) else 0
        if training.fp8_params and plan.zero_stage == 1:
            # the GEMM weights are TE Float8Tensors in a uint8 param buffer (1 B in place of the bf16 2 B) with
            # their fp8 transpose (1 B), or MXFP8Tensors (both directions): no bf16 copy (module docstring)
            weights += (QUANTISED_PARAM_BYTES[training.precision] - no_transpose - per_param[0]) * linear
        else:
            weights += (WEIGHT_CACHE_BYTES[training.precision] - no_transpose) * linear
    optimizer = dense * o + expert_params * oe
    if optimizer_bytes_per_param is None and training.optimizer_dtype == "bf16":  # precision-aware (module docstring)
        optimizer_bytes_per_param = precision_aware_optimizer_bytes(training)
    if optimizer_bytes_per_param is not None and per_param[2]:  # another optimizer's bytes, sharded alike
        optimizer *= optimizer_bytes_per_param / per_param[2]
    # Megatron's own optimizers (NeMo 1's Apex optimizer, optimizer_dtype bf16-apex, steps on its own buckets)
    step_extra = 0.0 if training.optimizer_dtype == "bf16-apex" else \
        step_grad_copy_bytes(training, plan, dense, expert_params)
    if training.optimizer != "adam":
        optimizer, step_extra = muon_state(model, training, plan, muon_stage, layers, per_param)
    return StateBytes(weights_bytes=weights,
                      grads_bytes=min(dense * g + expert_params * ge + g_work, stage_params * per_param[1]),
                      optimizer_bytes=optimizer, step_extra_bytes=step_extra)


def logits_bytes_per_element(training, plan) -> float:
    """Bytes per logit at the loss: bf16 + fp32 upcast (6), bf16 only under TE's fused cross entropy (2), the native
    fused one's compiled backward (10), or fp32 logits + softmax (8) in fp32 training (module docstring)."""
    if training.precision == "fp32":
        return 8
    return {"te": TE_FUSED_LOGITS_BYTES_PER_ELEMENT, "native": NATIVE_FUSED_LOGITS_BYTES_PER_ELEMENT}.get(
        training.cross_entropy_fusion, LOGITS_BYTES_PER_ELEMENT)


PROFILE = FrameworkProfile(name="megatron", state_bytes=state_bytes, logits_bytes_per_element=logits_bytes_per_element,
                           sp_gathers_inputs=False, quantized_sp_gather=True,
                           # core_v0.16.1 moe/moe_layer.py::MoELayer.forward raises in training when the attention
                           # TP group is > 1 without sequence parallelism
                           moe_needs_sp=True, allows_fp8_params=True,
                           # fp32 Adam, or the precision-aware optimizer with bf16 moments (module docstring)
                           optimizer_dtypes=("fp32", "bf16"), optimizer_zero_stages=(("bf16", (1,)), *MUON_ZERO_STAGES),
                           # Megatron --grad-reduce-in-bf16 (core_v0.16.1 arguments.py; planner/emit/megatron.py)
                           allows_grad_reduce_in_bf16=True,
                           # --cpu-offloading-num-layers (core_v0.16.1 transformer_block.py: TE get_cpu_offload_context)
                           allows_cpu_offload=True, allows_block_recompute=True, allows_recompute_groups=True,
                           # --moe-grouped-gemm (planner/emit/megatron.py): TEGroupedMLP, TE's multi-stream GroupedLinear
                           expert_gemm_streams=4, gemm_workspaces="te", megatron_p2p_tensors=True,
                           # --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep
                           runs_deepep=True,
                           # Megatron-FSDP's reduce-scatter queue (optim_grads[_params], cost.grad_reduce_trail_s)
                           grad_reduce_queue_elements=MEGATRON_FSDP_RS_QUEUE_ELEMENTS)
