"""NeMo 2 (NeMo 24.07 and later): Megatron-Core underneath, so Megatron's memory semantics.

What differs is the defaults a NeMo recipe sets, not the code that holds the memory:

* ``grad_reduce_in_fp32=True`` in the ``bf16_mixed`` / ``bf16_with_fp8_mixed`` precision plugins
  (``nemo/lightning/pytorch/plugins/mixed_precision.py``) and in the recipes'
  ``DistributedDataParallelConfig``: the fp32 gradient buffer of Megatron (plan3d's default,
  ``grad_reduce_in_bf16=False``);
* ``use_distributed_optimizer=True`` in the recipes' ``OptimizerConfig``
  (``nemo/collections/llm/recipes/optim/adam.py``): ZeRO-1;
* fp8 through Transformer Engine, with TE's fp8 weight cache (see ``planner.frameworks.megatron``).

* ``optimizer_dtype="bf16"``: NeMo 2 and Megatron-Bridge build Megatron-Core's optimizer from its
  ``OptimizerConfig``, so bf16 states are the precision-aware optimizer's
  (``use_precision_aware_optimizer=True``, ``exp_avg_dtype``/``exp_avg_sq_dtype`` bf16; Megatron-Bridge's
  DeepSeek-V3 recipe sets it) and count as ``planner.frameworks.megatron`` counts them: 6-8 B per parameter,
  distributed optimizer only. Counting a NeMo 2 job at Apex's 4 B would pass a plan that runs out of memory.

* ``optimizer_dtype="bf16-apex"``: NeMo 1's ``optim.name: distributed_fused_adam`` is Apex's
  ``DistributedFusedAdam`` (``nemo/core/optim/distributed_adam.py``, ``MegatronDistributedFusedAdam``),
  whose ``StateBucket`` (``apex/contrib/optimizers/distributed_fused_adam.py``) allocates
  ``exp_avg_shard`` and ``exp_avg_sq_shard`` of ``shard_size`` (bucket / distributed group) in the
  optimizer ``dtype``, and ``params_shard`` in that dtype only with ``store_params``. NeMo's
  ``MegatronBaseModel.setup_optimization`` (``nemo/collections/nlp/models/language_modeling/
  megatron_base_model.py``) takes ``dtype`` from ``optim.dtype`` and sets
  ``store_params=True`` when ``fp8_params`` (the fp8 weights cannot serve as master), else
  ``store_params=False`` when the optimizer dtype equals the model's (bf16 with
  ``megatron_amp_O2``). So with ``optim.dtype: bf16``: 2 + 2 (+ 2 with fp8_params) B per parameter,
  over dp x cp (``process_group = get_data_parallel_group(with_context_parallel=True)``), in place
  of Megatron's 12. NVIDIA's Nemotron-4 340B recipe sets it (dgxc-benchmarking
  ``nemotron/nemotron4-340b-synth.yaml``). Apex's gradient buckets are in ``grad_sync_dtype``
  (``grad_reduce_in_bf16``, as Megatron's buffer); its transient per-bucket shard buffers
  (``bucket_cap_mb``, ``pipeline_size`` = 2 buckets at a time) are left out. Apex shards
  regardless of the plan's ZeRO stage; at ZeRO 0 the bytes are counted unsharded (the larger). It replaces
  Megatron's optimizer, so it runs with Megatron's DDP (ZeRO 0 or 1 in plan3d's terms), not Megatron-FSDP.

The search limits: Megatron's ``DistributedDataParallel`` with or without the distributed optimizer
(ZeRO 0 and 1), and Megatron-FSDP with parameters, gradients and optimizer sharded (ZeRO 3): the
Megatron-Bridge performance recipes run it (``use_megatron_fsdp=True``,
``data_parallel_sharding_strategy="optim_grads_params"``, scripts/performance/utils/overrides.py) and
its performance summary lists such runs ("FSDP = 1: use FSDP", docs/performance-summary.md). ZeRO 2
(``optim_grads``) is not offered: no NeMo recipe uses it.
"""

from __future__ import annotations

from planner.frameworks import FrameworkProfile
from planner.frameworks.megatron import MEGATRON_FSDP_RS_QUEUE_ELEMENTS, MUON_ZERO_STAGES, logits_bytes_per_element
from planner.frameworks.megatron import state_bytes as megatron_state_bytes

#: Apex DistributedFusedAdam states per parameter with optim.dtype bf16 (module docstring): m, v.
BF16_ADAM_MOMENTS_BYTES = 2 + 2
#: and the bf16 master copy (``store_params``), which NeMo keeps only with fp8 parameters.
BF16_ADAM_MASTER_BYTES = 2


def state_bytes(model, training, plan, stage_params: float, layer_params: float, layers: int,
                expert_params: float = 0.0, linear_params: float | None = None, hardware=None,
                embedding_params: float = 0.0, muon_stage: int | None = None):
    """Megatron-Core's states (``planner.frameworks.megatron.state_bytes``, which also counts ``optimizer_dtype``
    bf16, the precision-aware optimizer); with ``optimizer_dtype="bf16-apex"`` the optimizer shards are Apex
    DistributedFusedAdam's bf16 states (module docstring), sharded over the same data-parallel groups as Megatron's."""
    apex = BF16_ADAM_MOMENTS_BYTES + (BF16_ADAM_MASTER_BYTES if training.fp8_params else 0) \
        if training.optimizer_dtype == "bf16-apex" else None
    return megatron_state_bytes(model, training, plan, stage_params, layer_params, layers, expert_params=expert_params,
                                linear_params=linear_params, hardware=hardware, optimizer_bytes_per_param=apex,
                                muon_stage=muon_stage)


PROFILE = FrameworkProfile(name="nemo", state_bytes=state_bytes, logits_bytes_per_element=logits_bytes_per_element,
                           sp_gathers_inputs=False, quantized_sp_gather=True, zero_stages=(0, 1, 3), moe_needs_sp=True,
                           allows_fp8_params=True, optimizer_dtypes=("fp32", "bf16", "bf16-apex"),
                           optimizer_zero_stages=(("bf16", (1,)), ("bf16-apex", (0, 1)), *MUON_ZERO_STAGES),
                           # Megatron --grad-reduce-in-bf16 (core_v0.16.1 arguments.py; planner/emit/megatron.py)
                           allows_grad_reduce_in_bf16=True,
                           # NeMo passes cpu_offloading_num_layers and recompute_method/num_layers to Megatron-Core
                           allows_cpu_offload=True, allows_block_recompute=True, allows_recompute_groups=True,
                           unfused_yarn_rope=True,  # Megatron-Bridge's provider (FrameworkProfile.unfused_yarn_rope)
                           # the recipes' moe_grouped_gemm=True: TEGroupedMLP, TE's multi-stream GroupedLinear
                           expert_gemm_streams=4, gemm_workspaces="te", megatron_p2p_tensors=True,
                           # --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep
                           runs_deepep=True,
                           # Megatron-FSDP's reduce-scatter queue (optim_grads[_params], cost.grad_reduce_trail_s)
                           grad_reduce_queue_elements=MEGATRON_FSDP_RS_QUEUE_ELEMENTS)
