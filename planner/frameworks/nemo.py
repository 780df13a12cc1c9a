"""NeMo 2 (NeMo 24.07 and later): Megatron-Core underneath, so Megatron's memory semantics.

What differs is the defaults a NeMo recipe sets, not the code that holds the memory:

* ``grad_reduce_in_fp32=True`` in the ``bf16_mixed`` / ``bf16_with_fp8_mixed`` precision plugins
  (``nemo/lightning/pytorch/plugins/mixed_precision.py``) and in the recipes'
  ``DistributedDataParallelConfig``: the fp32 gradient buffer of Megatron (plan3d's default,
  ``grad_reduce_in_bf16=False``);
* ``use_distributed_optimizer=True`` in the recipes' ``OptimizerConfig``
  (``nemo/collections/llm/recipes/optim/adam.py``): ZeRO-1;
* fp8 through Transformer Engine, with TE's fp8 weight cache (see ``planner.frameworks.megatron``).

The search limits are Megatron's distributed optimizer and no Megatron-FSDP (ZeRO 0 and 1):
NeMo's recipes run Megatron's ``DistributedDataParallel``.
"""

from __future__ import annotations

from planner.frameworks import FrameworkProfile
from planner.frameworks.megatron import logits_bytes_per_element, state_bytes

PROFILE = FrameworkProfile(name="nemo", state_bytes=state_bytes, logits_bytes_per_element=logits_bytes_per_element,
                           sp_gathers_inputs=False, zero_stages=(0, 1), moe_needs_sp=True,
                           allows_fp8_params=True)
