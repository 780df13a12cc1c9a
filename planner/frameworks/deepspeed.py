"""DeepSpeed (Megatron-DeepSpeed): ZeRO stages as the engine allocates them, and its pipeline engine's limits.

Code paths (deepspeedai/DeepSpeed ``deepspeed/runtime``):

* **ZeRO-1/2** (``zero/stage_1_and_2.py::DeepSpeedZeroOptimizer``): bf16 parameters, full size;
  fp32 partition of the parameters (master) and Adam m, v: 12 B / N; the bf16 gradients are kept
  full size at stage 1 and partitioned at stage 2, plus their fp32 partition (4 B / N). Its own
  estimator ``estimate_zero2_model_states_mem_needs`` gives ``2 + 18 / N`` B/param ("18 = 2
  grads16 + 4 grads32 + 4 params32 + 8 optim states"; formulas.md A1). With
  ``contiguous_gradients`` and ``overlap_comm`` (both written by ``plan3d emit deepspeed``) it
  allocates two ``ipg_buffer`` of ``reduce_bucket_size`` (default 5e8 elements) in bf16: 2 GB.
* **ZeRO-3** (``zero/stage3.py``): everything partitioned; ``estimate_zero3_model_states_mem_needs``
  adds ``4 x largest_layer_params`` (the gathered bf16 layer and its bf16 gradient), plus the
  prefetch bucket ``stage3_prefetch_bucket_size`` (5e7 elements) and one reduce bucket.
* **ZeRO-0** with bf16 (``bf16_optimizer.py::BF16_Optimizer``, which the engine picks for bf16 without ZeRO):
  bf16 parameters and gradients, a full-size fp32 gradient accumulation buffer
  (``fp32_groups_gradients_flat``), and the fp32 master and Adam states of 1/N of the parameters
  (``_setup_for_real_optimizer``: ``fp32_groups_flat_partition`` is this rank's partition of the flat
  bf16 group, and the wrapped optimizer steps only it; BigScience's BLOOM scripts: "bf16 must use z0! it
  implements its own zero stage 1 equivalent"): 2 + 2 + 4 + 12 / N B. With fp16
  (``training.fp16``; ``fp16/fused_optimizer.py::FP16_Optimizer``) the fp32 master, its fp32 gradient and
  Adam's states are whole: 2 + 2 + 4 + 12 B.
* **Pipeline engine** (``pipe/engine.py``): ZeRO 0 or 1 only ("ZeRO-2 and ZeRO-3 are incompatible
  with pipeline parallelism"), no interleaved schedule, layers split by ``partition_method``
  (plan3d emits even splits); Megatron-DeepSpeed has no context parallelism and plan3d writes
  no fp8 recipe for it.
* **Logits**: Megatron-DeepSpeed's vocab-parallel cross entropy, as Megatron (6 B per logit).
"""

from __future__ import annotations

from planner.frameworks import FrameworkProfile, StateBytes
from planner.frameworks.megatron import logits_bytes_per_element

REDUCE_BUCKET_ELEMENTS = 5e8  # zero/config.py: reduce_bucket_size default 500,000,000
PREFETCH_BUCKET_ELEMENTS = 5e7  # zero/config.py: stage3_prefetch_bucket_size default 50,000,000
BF16, FP32, MASTER_AND_ADAM = 2, 4, 12


def state_bytes(model, training, plan, stage_params: float, layer_params: float, layers: int,
                expert_params: float = 0.0, linear_params: float | None = None, hardware=None) -> StateBytes:
    """Weights, gradients and optimizer of one GPU of a stage (module docstring). MoE models run here
    without expert parallelism (``PROFILE.allows_ep`` is False), so the experts are ordinary
    parameters, sharded over dp x cp like the rest: ``expert_params`` changes nothing."""
    P, Pl, n, z = stage_params, layer_params, plan.dp * plan.cp, plan.zero_stage
    if training.precision == "fp32":
        return StateBytes(weights_bytes=FP32 * P, grads_bytes=FP32 * P, optimizer_bytes=8 * P / (n if z else 1))
    if z == 0:  # BF16_Optimizer shards the master and Adam over the data-parallel ranks; FP16_Optimizer does not
        return StateBytes(weights_bytes=BF16 * P, grads_bytes=(BF16 + FP32) * P,
                          optimizer_bytes=MASTER_AND_ADAM * P / (1 if training.fp16 else n))
    buckets = (2 if training.overlap_grad_reduce else 1) * REDUCE_BUCKET_ELEMENTS * BF16
    if z == 1:
        return StateBytes(weights_bytes=BF16 * P, grads_bytes=BF16 * P + FP32 * P / n + buckets,
                          optimizer_bytes=MASTER_AND_ADAM * P / n)
    if z == 2:
        return StateBytes(weights_bytes=BF16 * P, grads_bytes=(BF16 + FP32) * P / n + buckets,
                          optimizer_bytes=MASTER_AND_ADAM * P / n)
    working = BF16 * min(P, Pl)  # one gathered layer (and, in grads, its bf16 gradient)
    return StateBytes(weights_bytes=BF16 * P / n + working + PREFETCH_BUCKET_ELEMENTS * BF16,
                      grads_bytes=(BF16 + FP32) * P / n + working + REDUCE_BUCKET_ELEMENTS * BF16,
                      optimizer_bytes=MASTER_AND_ADAM * P / n)


PROFILE = FrameworkProfile(name="deepspeed", state_bytes=state_bytes, logits_bytes_per_element=logits_bytes_per_element,
                           sp_gathers_inputs=False, max_zero_with_pp=1, allows_cp=False, allows_vpp=False,
                           allows_uneven=False, allows_fp8=False,
                           # plan3d's DeepSpeed launch files write no MoE/expert-parallel configuration
                           allows_ep=False, expert_tp_rule="tp")
