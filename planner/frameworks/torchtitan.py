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
  the stage of fp32 unsharded gradients, plus the 2 B unsharded parameters.
* **Gradients without PP**: each layer's bf16 gradient (2 B) is cast to fp32 for the
  reduce-scatter (4 B, ``foreach_reduce``) and scattered into its 4 B / N shard.
* **Without FSDP** (zero_stage 0: DDP or a single replica): fp32 parameters and gradients,
  AdamW 8 B, bf16 compute by ``torch.autocast`` (``maybe_enable_amp``), which keeps a bf16 cast
  of each weight for backward: 4 + 2 + 4 + 8 B.
* **Logits**: the output layer's bf16 logits (vocabulary / t with ``loss_parallel``, the
  default with TP), then ``cross_entropy(pred.flatten(0, 1).float(), labels)``
  (``components/loss.py``): the fp32 copy and ``log_softmax``'s fp32 output, which it saves; in
  backward the fp32 gradient of the log-softmax input and its bf16 cast: 2 + 4 + 4 + 2 B.
* **Sequence parallel**: DTensor's ``SequenceParallel`` + ``ColwiseParallel`` keep the gathered
  QKV/FC1 inputs for backward (``planner.memory.layer_activation_terms``).
* float8 (torchao) is not modelled: its weights are cast per GEMM and, with
  ``enable_fsdp_float8_all_gather``, gathered in fp8 (1 B instead of 2 unsharded).
"""

from __future__ import annotations

from planner.frameworks import FrameworkProfile, StateBytes

BF16, FP32 = 2, 4
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in the parameter's dtype (fp32)
LOGITS_BYTES_PER_ELEMENT = 12  # bf16 logits + fp32 copy + fp32 log_softmax output + bf16 grad (module docstring)


def reshard_after_forward(plan) -> bool:
    """torchtitan's ``fsdp_reshard_after_forward``: plan3d emits ``default`` for ZeRO-3 (True unless
    PP, ``parallelize.py::apply_fsdp``) and ``never`` below."""
    return plan.zero_stage >= 3 and plan.pp == 1


def state_bytes(model, training, plan, stage_params: float, layer_params: float, layers: int) -> StateBytes:
    """Weights, gradients and AdamW states of one GPU of a stage (module docstring)."""
    P, Pl = stage_params, layer_params
    if training.precision == "fp32":  # plain fp32 FSDP2 (plan3d validate): no bf16 copies
        wb, gb = FP32, FP32
    else:
        wb, gb = BF16, BF16
    n = plan.dp * plan.cp
    if plan.zero_stage == 0:
        autocast_copy = wb if training.precision != "fp32" else 0
        return StateBytes(weights_bytes=P * (FP32 + autocast_copy), grads_bytes=P * FP32,
                          optimizer_bytes=P * ADAM_STATE_BYTES)
    sharded = P / n
    root = max(P - layers * Pl, 0.0)  # embedding / final norm / output layer on this stage
    if reshard_after_forward(plan):
        unsharded_w = wb * (min(2, layers) * Pl + root)
    else:
        unsharded_w = wb * P
    if plan.pp > 1:  # no gradient sync until perform_reduce_grad: unsharded fp32 grads of the stage
        grads = FP32 * P + FP32 * sharded
    else:  # one layer's bf16 grad, its fp32 cast for the reduce-scatter, the fp32 shards
        grads = (gb + FP32) * max(Pl, root) + FP32 * sharded if wb != FP32 else FP32 * (max(Pl, root) + sharded)
    return StateBytes(weights_bytes=FP32 * sharded + unsharded_w, grads_bytes=grads,
                      optimizer_bytes=ADAM_STATE_BYTES * sharded)


def logits_bytes_per_element(training, plan) -> float:
    """Bytes per logit live at the loss (module docstring); fp32 training: logits, log-softmax, grad."""
    return 3 * FP32 if training.precision == "fp32" else LOGITS_BYTES_PER_ELEMENT


PROFILE = FrameworkProfile(name="torchtitan", state_bytes=state_bytes, logits_bytes_per_element=logits_bytes_per_element,
                           sp_gathers_inputs=True)
