"""Framework profiles: how each training framework holds its model states, and what it can run.

One module per framework (``megatron``, ``nemo``, ``torchtitan``, ``deepspeed``), each exposing a
:class:`FrameworkProfile` as ``PROFILE``. A profile answers two questions for ``planner.memory``
and ``planner.candidates``:

* **memory policy**: the bytes of weights, gradients and optimizer states one GPU of a pipeline
  stage holds at its peak (:meth:`FrameworkProfile.state_bytes`), how its loss keeps the logits
  (bytes per logit), and whether sequence parallelism keeps the column-parallel inputs gathered;
* **search limits**: the ZeRO stages, context parallelism, interleaving and uneven pipelines the
  framework can run, so that ``plan3d search --framework X`` only proposes plans X can launch.

``"torch"`` (the name plan3d used before the profiles, and what ``plan3d validate`` runs) is
torchtitan's profile for everything torch.distributed decides (FSDP2 states, DTensor SP, loss
parallel, pipelining), with the model code of ``plan3d validate`` instead of torchtitan's: fused
SwiGLU (``planner/validate/kernels.py``) and Megatron's selective recompute of the attention core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

FRAMEWORKS = ("megatron", "nemo", "torchtitan", "deepspeed")
#: Precisions whose GEMM weights Megatron-Core keeps quantised with no bf16 copy under --fp8-param-gather
#: (planner/frameworks/megatron.py): per-tensor fp8 (Float8Tensor) and mxfp8 (MXFP8Tensor). NVFP4 has no such
#: path in the recipes plan3d models: Megatron-Bridge's MixedPrecisionConfig.finalize raises "fp4_param and
#: fp4_param_gather are not supported for now" (src/megatron/bridge/training/mixed_precision.py, commit 0509780).
FP8_PARAM_PRECISIONS = ("fp8", "mxfp8")


@dataclass(frozen=True)
class StateBytes:
    """Bytes one GPU holds for the model states of its stage at the step's peak."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    # transient: live only while one layer (or the root module) runs its forward/backward, not while
    # the loss holds the logits (FSDP2's gathered layer and its gradient buffers); planner.memory
    # counts max(working, logits spike) on the last stage
    working_weights_bytes: float = 0.0
    working_grads_bytes: float = 0.0
    # part of weights_bytes + grads_bytes freed by the last micro-batch's backward, before the pipeline schedule
    # returns (torchtitan under PP: FSDP2's post_backward reshards the unsharded parameters and reduce-scatters and
    # frees the unsharded fp32 gradient accumulators); planner.memory.pipeline_kept_output_bytes
    released_at_last_backward_bytes: float = 0.0
    # held beyond weights + grads + optimizer only inside the optimizer step, when no activation is held (DeepSpeed's
    # FP16_Optimizer flattens fp32 copies of the gradients); planner.memory.step_excess_bytes counts what of it the
    # backward's activations and working set do not already cover
    step_extra_bytes: float = 0.0


@dataclass(frozen=True)
class FrameworkProfile:
    """Memory policy and search limits of one framework (see the module of each)."""

    name: str
    # (model, training, plan, stage_params, layer_params, layers, expert_params=, linear_params=, hardware=) -> StateBytes
    state_bytes: Callable
    logits_bytes_per_element: Callable  # (training, plan) -> bytes per logit live at the loss peak
    sp_gathers_inputs: bool  # DTensor SP keeps QKV/FC1 inputs gathered (torch); Megatron keeps the 1/t shard
    # the sequence-parallel all-gathers (a column-parallel input, a row-parallel output gradient) move the
    # low-precision copy (Transformer Engine quantises, then gathers: planner.cost.sp_gather_bytes_per_element);
    # else 16-bit
    quantized_sp_gather: bool = False
    swiglu_unfused: bool = False  # eager ``w2(silu(w1 x) * w3 x)``: also saves the SiLU output (torchtitan)
    # fp8/fp4 GEMMs keep their quantised input for the weight gradient (Transformer Engine: 1 B under fp8); False:
    # the 16-bit input (torchao's Float8Linear, MX linear and grouped MMs save ``input_hp``: torchtitan's
    # converters; planner.memory.linear_input_bytes)
    saves_quantized_gemm_inputs: bool = True
    op_sac: bool = False  # "selective" recompute is torchtitan's op-level policy (planner.memory.op_sac_terms)
    # a YaRN model's RoPE (ModelSpec.rope_scaling) runs Megatron-Core's eager _apply_rotary_pos_emb_bshd, not TE's
    # fused kernel: Megatron-Bridge's GPTModelProvider.provide sets apply_rope_fusion False when
    # position_embedding_type is not "rope" (src/megatron/bridge/utils/fusions.py validate_rope_fusion_compatibility)
    unfused_yarn_rope: bool = False
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    max_zero_with_pp: int = 3  # highest ZeRO stage the pipeline engine accepts when pp > 1
    allows_cp: bool = True
    allows_vpp: bool = True
    allows_uneven: bool = True
    # the uneven splits the framework's pipeline builds by its own partition rule, (layers, pp) -> {method: split}
    # (DeepSpeed's PipelineModule partition_method, planner.frameworks.deepspeed.pipeline_partitions); with it, an
    # uneven layers_per_stage must be one of them, whatever allows_uneven says (the search offers those: allows_stage_split)
    pipeline_partitions: Callable | None = None
    allows_heavier_ends: bool = True  # uneven splits may give the first/last stage *more* layers
    allows_uneven_interleaved: bool = True  # uneven stages together with vpp > 1
    # with vpp > 1, only the first and the last *virtual* stage may be shorter, every other one holding
    # the same layers (torchtitan's pipeline_parallel_first/last_stage_less_layers, planner/emit/torchtitan.py)
    uneven_virtual_ends_only: bool = False
    # the framework's own rule for an uneven split, plan -> whether its pipeline builds plan.layers_per_stage
    # (torchtitan's first/last_stage_less_layers and layers_per_stage keys, planner.frameworks.torchtitan.builds_split):
    # a split it builds is legal besides the shapes above (the search offers those only, allows_stage_split)
    split_rule: Callable | None = None
    # torch.distributed.pipelining: every PipelineStage keeps one receive buffer per micro-batch for its input
    # and one for its output's gradient, for the whole run (planner.memory.pipeline_buffer_bytes)
    pipeline_recv_buffers: bool = False
    # Megatron-Core's pipeline schedules hold stage-boundary tensors beyond the in-flight stage inputs in their steady
    # state: the last input gradient and output gradient, and under interleaving the receives posted ahead
    # (planner.memory.megatron_p2p_tensor_count)
    megatron_p2p_tensors: bool = False
    # DeepSpeed's pipeline engine keeps stage outputs, received inputs, its receive buffers and the last stage's module
    # outputs (planner.memory.deepspeed_pipe_tensor_counts)
    deepspeed_pipe_buffers: bool = False
    # (training, plan, last_stage) -> bytes each micro-batch's backward moves per local parameter outside the GEMMs, to
    # accumulate the gradients (DeepSpeed's BF16_Optimizer and autograd's accumulation; FSDP2's unsharded fp32
    # accumulation under a pipeline, its reduce-scatter copy-in without one and its all-gather copy-outs:
    # planner.cost.grad_accum_s, breakdown term param_passes);
    # None: none beyond the GEMMs (Megatron-Core accumulates in the weight-gradient GEMM, gradient_accumulation_fusion)
    grad_accum_bytes_per_param: Callable | None = None
    allows_fp8: bool = True
    allows_fp8_params: bool = False  # fp8 GEMM weights with no bf16 copy (Megatron --fp8-param-gather)
    # activation offloading to host memory (Plan.cpu_offload_layers): Megatron-Core's TE-backed
    # --cpu-offloading-num-layers; plan3d emits no such knob for torchtitan or DeepSpeed
    allows_cpu_offload: bool = False
    # Megatron's block recompute (Plan.recompute_num_layers, --recompute-method block --recompute-num-layers K)
    allows_block_recompute: bool = False
    # Megatron's uniform method with groups of N > 1 layers (Plan.recompute_group_layers, --recompute-method
    # uniform --recompute-num-layers N)
    allows_recompute_groups: bool = False
    # torchtitan's per-layer AC (Plan.recompute_interval, --activation_checkpoint.mode selective
    # --activation_checkpoint.selective_ac_option N: every N-th block of a rank fully checkpointed)
    allows_layer_interval_recompute: bool = False
    optimizer_dtypes: tuple[str, ...] = ("fp32",)  # Adam state dtypes modelled (TrainingSpec.optimizer_dtype)
    # (dtype, ZeRO stages) pairs: the stages at which each non-fp32 optimizer state dtype runs (a dtype left out:
    # any; pairs, not a dict, so the profile stays hashable); Megatron's
    # precision-aware optimizer (bf16) needs the distributed optimizer (planner/frameworks/megatron.py), NeMo 1's
    # Apex optimizer (bf16-apex) is a DDP optimizer of its own, not Megatron-FSDP (planner/frameworks/nemo.py)
    optimizer_zero_stages: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # bf16 gradients (TrainingSpec.grad_reduce_in_bf16) as plan3d emits this framework (Megatron
    # --grad-reduce-in-bf16); `plan3d search` then offers both gradient dtypes when the user set neither
    # (candidates.grad_dtype_options)
    allows_grad_reduce_in_bf16: bool = False
    # tp larger than the KV heads, each KV head replicated on tp / kv_heads ranks: Megatron-Core does it
    # (core_v0.16.1 attention.py: num_query_groups < world_size, the QKV output all-gathered); torchtitan 0.3.0 refuses
    # it (models/common/decoder.py: "tensor_parallel_degree ... must divide n_kv_heads"), as does Megatron-DeepSpeed
    # (megatron/model/transformer.py ParallelAttention: core.utils.divide(num_key_value_heads, world_size))
    replicates_kv_heads: bool = True
    # --- mixture of experts (planner.memory, docs/moe.md) ---
    allows_ep: bool = True  # expert parallelism (ep > 1) as plan3d emits this framework
    # which expert-TP degrees the framework builds: "free" (Megatron's --expert-tensor-parallel-size),
    # "tp" (experts split like the dense MLP), "torchtitan" (1 with ep > 1, tp without: torchtitan 0.3.0)
    expert_tp_rule: str = "free"
    moe_needs_sp: bool = False  # a MoE layer with tp > 1 trains only with sequence parallelism (Megatron)
    moe_ep_needs_fsdp: bool = False  # ep > 1 lives inside the FSDP mesh: ZeRO >= 1 (torchtitan's efsdp)
    # with cp > 1 the parameters are always sharded over the dp_shard x cp mesh, so ZeRO 0 does not run there (torchtitan
    # 0.3.0 distributed/parallel_dims.py: fsdp_enabled = dp_shard_enabled or cp_enabled)
    fsdp_with_cp: bool = False
    # how a MoE layer holds its tokens and saves them (planner.memory.moe_activation_terms)
    moe_dispatch: str = "megatron"
    # whose MoE layer the host issues (planner.cost.moe_host_ops): "megatron", experts one by one and a host sync
    # every layer (Megatron-Core's measured counts); "torchtitan", grouped experts, a host sync only with EP
    moe_host_issue: str = "megatron"
    # DeepEP and HybridEP token dispatch (TrainingSpec.moe_token_dispatcher "deepep", "hybridep"), which plan3d models
    # as Megatron-Core's flex dispatcher (planner.cost.deepep_time_s, planner.memory.deepep_buffer_bytes and
    # hybridep_buffer_bytes) and emits only for Megatron; elsewhere a job asking for it is refused
    # (specs.job_problems) and validate predicts the all-to-all its run uses
    runs_deepep: bool = False
    # how the routed experts' GEMMs run (planner.cost.grouped_gemm_time_s): 0, one grouped kernel over the local
    # experts (torch._grouped_mm); n > 0, one cuBLAS GEMM per local expert, issued round-robin to n CUDA streams
    # (Transformer Engine's GroupedLinear under Megatron-Core's TEGroupedMLP, planner.cost.TE_GROUPED_GEMM_STREAMS)
    expert_gemm_streams: int = 0
    # the cuBLAS workspaces the stage's GEMMs keep through the caching allocator (planner.memory.gemm_workspace_bytes):
    # "te" where the model's layers are Transformer Engine modules and the output layer and MoE router are torch GEMMs
    # (Megatron-Core, NeMo); "torch" where every linear is a torch GEMM (torchtitan, plan3d validate's miniature,
    # Megatron-DeepSpeed); None: not counted in the stage total
    gemm_workspaces: str | None = None
    # a gradient reduction issued in every micro-batch's backward (ZeRO 2-3, planner.cost.grad_reduced_every_microbatch)
    # runs on its own stream; None: the compute stream waits for it at the end of that backward (FSDP2's
    # _root_post_backward_final_callback, DeepSpeed's reduction epilogue). A count: the reductions run on past the
    # backward, under whatever compute follows, until that many gradient elements per model chunk are outstanding
    # (Megatron-FSDP's reduce-scatter queue, planner.cost.grad_reduce_trail_s)
    grad_reduce_queue_elements: int | None = None
    # the memory-bound kernels of a dense RMSNorm/SwiGLU/RoPE block when it runs eager, not compiled (TrainingSpec.compile
    # off): ((forward, backward) bytes per token as width coefficients, (forward, backward) launches), and the eager
    # loss's (forward, backward) bytes per logit; None: the framework runs fused kernels (planner.cost.eager_block)
    eager_block_bytes: tuple | None = None
    eager_block_kernels: tuple[int, int] | None = None
    eager_loss_bytes_per_logit: tuple[int, int] | None = None

    def allows_zero(self, zero_stage: int, pp: int, optimizer_dtype: str = "fp32", ep: int = 1, cp_tp: int = 1,
                    cp: int = 1) -> bool:
        """Whether this framework runs ZeRO stage ``zero_stage`` with ``pp`` pipeline stages, optimizer states of
        ``optimizer_dtype`` (``TrainingSpec.optimizer_dtype``), ``ep``-way expert parallelism over ``cp x tp``
        context- and tensor-parallel ranks (:meth:`_ep_allows_zero`) and ``cp``-way context parallelism
        (:meth:`_cp_allows_zero`)."""
        return zero_stage in self.zero_stages and (pp == 1 or zero_stage <= self.max_zero_with_pp) \
            and self._optimizer_allows_zero(zero_stage, optimizer_dtype) and self._ep_allows_zero(zero_stage, ep, cp_tp) \
            and self._cp_allows_zero(zero_stage, cp)

    def _cp_allows_zero(self, zero_stage: int, cp: int) -> bool:
        """``fsdp_with_cp``: no unsharded (ZeRO 0) parameters with context parallelism."""
        return not (self.fsdp_with_cp and cp > 1 and zero_stage == 0)

    def _ep_allows_zero(self, zero_stage: int, ep: int, cp_tp: int) -> bool:
        """torchtitan 0.3.0 ``parallel_dims.py`` draws EP from dp_shard x cp x tp: without FSDP (dp_shard 1) only
        an ``ep`` that divides cp x tp has its ranks (the launch-file reader's rule, planner/readers/torchtitan.py)."""
        return not (ep > 1 and self.moe_ep_needs_fsdp and zero_stage < 1 and cp_tp % ep)

    def _optimizer_allows_zero(self, zero_stage: int, optimizer_dtype: str) -> bool:
        return zero_stage in dict(self.optimizer_zero_stages).get(optimizer_dtype, (zero_stage,))

    def allows_split(self, first: int, middle: int, last: int, vpp: int = 1) -> bool:
        """Whether the framework can place ``first`` / ``middle`` / ``last`` layers on the stages."""
        if first == middle == last:
            return True
        if vpp > 1 and not self.allows_uneven_interleaved:
            return False
        if vpp > 1 and self.uneven_virtual_ends_only:
            # every chunk but the very first and the very last must hold middle / vpp layers; chunk_split
            # balances a stage's chunks to within one layer, so the end stages may be at most one short
            return middle % vpp == 0 and middle - 1 <= min(first, last) and max(first, last) <= middle
        return self.allows_uneven and (self.allows_heavier_ends or max(first, last) <= middle)

    def allows_stage_split(self, pp: int, vpp: int, first: int, middle: int, last: int) -> bool:
        """Whether the search may offer this split (:meth:`allows_split`); for a framework whose pipeline builds
        its own partitions (``pipeline_partitions``), an uneven split only where it is one of them, without
        interleaving (DeepSpeed's ``--pp-partition-method``: BLOOM-176B's 5 + 10 x 6 + 5)."""
        if first == middle == last or self.pipeline_partitions is None:
            return self.allows_split(first, middle, last, vpp)
        layers = (first,) + (middle,) * (pp - 2) + (last,)
        return vpp == 1 and layers in self.pipeline_partitions(sum(layers), pp).values()

    def job_problems(self, precision: str, fp8_params: bool = False, optimizer_dtype: str = "fp32") -> list[str]:
        """What of the job (whatever the plan) this framework cannot run."""
        if optimizer_dtype == "bf16-apex" and optimizer_dtype not in self.optimizer_dtypes:
            return [f"optimizer_dtype: bf16-apex is NeMo 1's Apex distributed_fused_adam (framework nemo); {self.name} "
                    f"as plan3d models it keeps {'/'.join(self.optimizer_dtypes)} optimizer states; use "
                    f"{' or '.join(reversed(self.optimizer_dtypes))}"]
        if optimizer_dtype not in self.optimizer_dtypes:
            return [f"optimizer_dtype: {self.name} as plan3d models it keeps {'/'.join(self.optimizer_dtypes)} "
                    f"optimizer states, not {optimizer_dtype}; use {self.optimizer_dtypes[0]}"]
        if optimizer_dtype != "fp32" and precision == "fp32":
            return [f"optimizer_dtype: {optimizer_dtype} optimizer states go with mixed precision, not fp32 training; "
                    "use fp32"]
        if precision in ("fp8", "mxfp8", "nvfp4") and not self.allows_fp8:
            return [f"precision: {self.name} as plan3d emits it has no {precision} recipe; use bf16"]
        if fp8_params and not self.allows_fp8_params:
            return [f"fp8_params: {self.name} as plan3d models it keeps bf16 weights; drop fp8_params"]
        if fp8_params and precision not in FP8_PARAM_PRECISIONS:
            return [f"fp8_params: fp8 weights need precision fp8 or mxfp8 (Megatron --fp8-param-gather), not "
                    f"{precision}; set precision fp8 or drop fp8_params"]
        return []

    def allows_tp(self, tp: int, model) -> bool:
        """Whether this framework splits ``model``'s attention ``tp`` ways: the KV heads divided among the ranks, or,
        where it replicates them (``replicates_kv_heads``), also ``tp`` a multiple of them. MLA has no KV heads to
        split (its latent is replicated)."""
        g = model.kv_heads
        return model.is_mla or g % tp == 0 or (self.replicates_kv_heads and tp % g == 0)

    def plan_problems(self, plan, model=None, optimizer_dtype: str = "fp32") -> list[str]:
        """What of ``plan`` this framework cannot run, one line each naming the field (``model``, when
        given, adds the rules that depend on it: MoE, KV heads; ``optimizer_dtype``, the job's optimizer states)."""
        errors = self._moe_problems(plan, model)
        if model is not None and plan.tp > 1 and not self.allows_tp(plan.tp, model) and plan.tp % model.kv_heads == 0:
            fits = [t for t in (1, 2, 4, 8, 16) if model.kv_heads % t == 0 and model.num_attention_heads % t == 0]
            errors.append(f"tp: {self.name} divides the {model.kv_heads} KV heads among the TP ranks and does not "
                          f"replicate them (Megatron-LM does): tp({plan.tp}) must divide num_kv_heads; use tp "
                          f"{' or '.join(map(str, fits))}")
        if not self.allows_zero(plan.zero_stage, plan.pp):
            allowed = [z for z in self.zero_stages if self.allows_zero(z, plan.pp)]
            errors.append(f"zero_stage: {self.name} runs ZeRO {allowed} with pp={plan.pp}, not {plan.zero_stage}")
        elif not self._optimizer_allows_zero(plan.zero_stage, optimizer_dtype):
            stages = dict(self.optimizer_zero_stages)[optimizer_dtype]
            if "muon" in optimizer_dtype:  # TrainingSpec.optimizer_key: Muon's name
                errors.append(f"zero_stage: Megatron runs {optimizer_dtype} without the distributed optimizer or "
                              f"Megatron-FSDP (validate_args asserts it): use zero_stage 0 (plan has {plan.zero_stage})")
                return errors
            what = ("(Megatron --use-precision-aware-optimizer) need the distributed optimizer" if optimizer_dtype == "bf16"
                    else "(NeMo 1's Apex distributed_fused_adam) run without Megatron-FSDP")
            errors.append(f"zero_stage: {self.name}'s {optimizer_dtype} optimizer states {what}: use zero_stage "
                          f"{' or '.join(map(str, stages))} (plan has {plan.zero_stage}) or optimizer_dtype fp32")
        if plan.cpu_offload_layers and not self.allows_cpu_offload:
            errors.append(f"cpu_offload_layers: {self.name} as plan3d emits it has no activation offloading "
                          f"(Megatron --cpu-offloading-num-layers); use framework megatron or nemo, or 0")
        if plan.recompute_num_layers is not None and not self.allows_block_recompute:
            errors.append(f"recompute_num_layers: {self.name} has no block recompute of the first layers of each "
                          f"chunk (Megatron --recompute-method block); use framework megatron or nemo, or drop it")
        if plan.recompute_group_layers is not None and not self.allows_recompute_groups:
            errors.append(f"recompute_group_layers: {self.name} has no recompute of layers in groups (Megatron "
                          f"--recompute-method uniform --recompute-num-layers N); use framework megatron or nemo, "
                          f"or drop it")
        if plan.recompute_interval is not None and not self.allows_layer_interval_recompute:
            errors.append(f"recompute_interval: {self.name} has no per-layer AC of every N-th layer (torchtitan "
                          f"--activation_checkpoint.selective_ac_option N); use framework torchtitan, or drop it")
        if plan.cp > 1 and not self.allows_cp:
            errors.append(f"cp: {self.name} has no context parallelism (cp={plan.cp}); use cp=1")
        if plan.vpp > 1 and not self.allows_vpp:
            errors.append(f"vpp: {self.name}'s pipeline has no interleaved schedule (vpp={plan.vpp}); use vpp=1")
        lps = plan.layers_per_stage
        uneven = lps is not None and len(set(lps)) > 1
        if uneven and self.pipeline_partitions is not None:
            splits = self.pipeline_partitions(sum(lps), len(lps))
            if tuple(lps) not in splits.values():
                built = "; ".join(f"{list(v)} ({k})" for k, v in splits.items()) or "even splits only"
                errors.append(f"layers_per_stage: {self.name}'s pipeline builds {built} for {sum(lps)} layers on "
                              f"pp={len(lps)}, not {list(lps)}; use one of those")
        elif uneven:
            middle = lps[1] if len(lps) > 2 else max(lps)
            if not self.allows_uneven:
                errors.append(f"layers_per_stage: {self.name} splits layers evenly; drop layers_per_stage")
            elif plan.vpp > 1 and not self.allows_uneven_interleaved:
                errors.append(f"layers_per_stage: {self.name} runs uneven stages only without interleaving "
                              f"(vpp={plan.vpp}); use vpp=1 or an even split")
            elif (not self.allows_split(lps[0], middle, lps[-1], plan.vpp) or (
                    self.uneven_virtual_ends_only and len(set(lps[1:-1])) > 1)) and not (
                    self.split_rule is not None and self.split_rule(plan)):
                which = "virtual stage (one chunk)" if plan.vpp > 1 and self.uneven_virtual_ends_only else "stages"
                own = " (or split as its own pipeline keys split)" if self.split_rule is not None else ""
                errors.append(f"layers_per_stage: {self.name} can only give the first and last {which} fewer "
                              f"layers{own}, not {list(lps)} at vpp={plan.vpp}")
        return errors

    def allows_expert(self, ep: int, etp: int, tp: int) -> bool:
        """Whether this framework runs ``ep``-way expert parallelism with experts split ``etp`` ways beside a
        ``tp``-way TP (the rules :meth:`_moe_problems` words; the search's shapes keep only these)."""
        if ep > 1 and not self.allows_ep:
            return False
        if self.expert_tp_rule == "tp":
            return etp == tp
        if self.expert_tp_rule == "torchtitan":
            return etp == (1 if ep > 1 else tp)
        return True

    def _moe_problems(self, plan, model) -> list[str]:
        """Expert-parallel limits of this framework (the ``FrameworkProfile`` MoE fields)."""
        errors = []
        ep, etp, tp = plan.ep, plan.expert_tp, plan.tp
        if ep > 1 and not self.allows_ep:
            errors.append(f"ep: {self.name} as plan3d emits it has no expert parallelism (ep={ep}); use ep=1")
        elif not self.allows_expert(ep, etp, tp):
            if self.expert_tp_rule == "tp":
                errors.append(f"etp: {self.name} splits experts like the dense MLP (etp = tp = {tp}); drop etp")
            else:  # expert_tp_rule "torchtitan"
                want = 1 if ep > 1 else tp
                errors.append(f"etp: {self.name} runs experts with etp={want} when ep={ep} "
                              f"(torchtitan 0.3.0: EP replaces expert TP; without EP experts are split over tp); "
                              f"set etp {want}")
        if not self._cp_allows_zero(plan.zero_stage, plan.cp):
            errors.append(f"zero_stage: {self.name} shards the parameters over the context-parallel ranks whenever cp > 1 "
                          f"(torchtitan 0.3.0 ParallelDims.fsdp_enabled: dp_shard > 1 or cp > 1), so ZeRO 0 does not "
                          f"run with cp={plan.cp}; use zero_stage 2 or 3, or cp 1")
        if not self._ep_allows_zero(plan.zero_stage, ep, plan.cp * tp):
            errors.append(f"zero_stage: {self.name}'s expert parallelism lives inside its FSDP mesh (efsdp); "
                          f"use zero_stage >= 1 with ep={ep}, or an ep that divides cp x tp = {plan.cp * tp}")
        if (self.moe_needs_sp and model is not None and model.is_moe and tp > 1
                and not plan.sequence_parallel):
            errors.append(f"sequence_parallel: {self.name}'s MoE layer trains with tp={tp} only with sequence "
                          "parallelism (Megatron-Core MoELayer.forward); set sequence_parallel")
        return errors


_PROFILES: dict[str, FrameworkProfile] = {}


def get(name: str) -> FrameworkProfile:
    """The profile of framework ``name`` (``megatron``, ``nemo``, ``torchtitan``, ``deepspeed`` or ``torch``). The
    modules are imported on the first call (they import this one) and the table is kept: the search asks for a
    profile hundreds of thousands of times."""
    if not _PROFILES:
        from planner.frameworks import deepspeed, megatron, nemo, torchtitan

        _PROFILES.update({"megatron": megatron.PROFILE, "nemo": nemo.PROFILE, "torchtitan": torchtitan.PROFILE,
                          "deepspeed": deepspeed.PROFILE, "torch": torchtitan.TORCH_PROFILE})
    return _PROFILES[name]


def expert_gemm_streams(training) -> tuple[int, int]:
    """(streams the routed experts' GEMMs run on, extra cuBLAS workspaces they keep) for a job: the profile's
    ``expert_gemm_streams`` and as many of Transformer Engine's multi-stream workspaces under ``--moe-grouped-gemm``
    (``TrainingSpec.moe_grouped_gemm``: TEGroupedMLP's ``GroupedLinear``, ``get_multi_stream_cublas_workspace``);
    without it Megatron-Core's ``SequentialMLP`` (core_v0.16.1 ``moe/experts.py``) runs each local expert's TE linears
    in turn on the main stream, with TE's one workspace: one stream, no extra workspace. A profile with 0
    (torchtitan's ``torch._grouped_mm``) keeps 0 either way."""
    n = get(training.framework).expert_gemm_streams
    if n and not training.moe_grouped_gemm:
        return 1, 0
    return n, n
