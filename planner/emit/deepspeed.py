"""The DeepSpeed JSON config for a plan.

Keys are DeepSpeed's (``deepspeed/runtime/config.py``): ``train_batch_size`` =
``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x data-parallel size,
``zero_optimization.stage``, its bucket keys (``overlap_comm``, ``contiguous_gradients``, ``reduce_bucket_size``,
and at stage 3 ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``,
``stage3_param_persistence_threshold``: ``TrainingSpec.deepspeed``), ``data_types.grad_accum_dtype`` where the
plan names one, ``bf16.enabled`` / ``fp16.enabled``, ``communication_data_type`` (the gradient reduction dtype plan3d
costed). Expert parallelism is not a config key
(DeepSpeed-MoE takes ``ep_size`` in ``deepspeed.moe.layer.MoE``, in model code): MoE plans with ep > 1
or an expert TP other than tp are refused. DeepSpeed's pipeline engine
(``deepspeed/runtime/pipe/engine.py``) takes ZeRO stage 0 or 1 only; the config has no context
parallelism.

No Megatron-DeepSpeed argument file is written: Megatron-DeepSpeed's parser is a fork of an old
Megatron-LM one (no ``RMSNorm`` choice, no ``--group-query-attention``, ``--num-query-groups``,
``--position-embedding-type``, ``--decoder-first/last-pipeline-num-layers``, ``--overlap-grad-reduce``
or ``--mock-data``), and plan3d has no copy of it to test against (docs/emit.md).
"""

from __future__ import annotations

import json

from planner.emit import partial_optimizer_refusal
from planner.presets import SpecError
from planner.specs import Scenario


def config(sc: Scenario) -> dict:
    p = sc.resolved_plan()
    ds = sc.training.deepspeed
    # the bucket settings plan3d counted (planner/frameworks/deepspeed.py state_bytes), written out so that the file
    # holds what was checked whatever a DeepSpeed release defaults to
    zero = {"stage": p.zero_stage, "overlap_comm": sc.training.overlap_grad_reduce,
            "contiguous_gradients": ds.contiguous_gradients, "reduce_bucket_size": ds.reduce_bucket_elements}
    if p.zero_stage >= 3:
        zero.update(stage3_prefetch_bucket_size=ds.prefetch_bucket_elements,
                    stage3_max_live_parameters=ds.max_live_elements, stage3_max_reuse_distance=ds.max_reuse_elements,
                    stage3_param_persistence_threshold=ds.persistence_threshold_elements)
    out = {
        "train_batch_size": sc.training.global_batch_size,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.num_microbatches,
        "zero_optimization": zero,
        # fp16 training (TrainingSpec.fp16: DeepSpeed's FP16_Optimizer) or bf16
        "bf16": {"enabled": not sc.training.fp16},
        "fp16": {"enabled": sc.training.fp16},
        # the gradients' reduction dtype plan3d costed (TrainingSpec.grad_reduce_in_bf16; DeepSpeed's own default
        # under bf16 would be bf16, runtime/engine.py communication_data_type)
        "communication_data_type": ("fp16" if sc.training.fp16 else "bf16") if sc.training.grad_reduce_in_bf16
        else "fp32",
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if ds.grad_accum_dtype is not None:  # it picks the optimizer wrapper (frameworks.deepspeed.wrapper_for)
        out["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    return out


def check_supported(sc: Scenario) -> None:
    p = sc.plan
    refusal = partial_optimizer_refusal("deepspeed", sc.training)  # also planner.emit.job_problems, before a search
    if refusal:
        raise SpecError(f"--emit deepspeed: {refusal}")
    if p.cp > 1:
        raise SpecError(f"--emit deepspeed: DeepSpeed's config has no context parallelism (plan has cp={p.cp})")
    if p.cpu_offload_layers:
        raise SpecError(f"--emit deepspeed: the DeepSpeed config written here has no activation offloading (plan has "
                        f"cpu_offload_layers={p.cpu_offload_layers}); use --format megatron or cpu_offload_layers 0")
    if p.recompute_num_layers is not None:
        raise SpecError(f"--emit deepspeed: the DeepSpeed config written here has no block recompute of the first "
                        f"{p.recompute_num_layers} layers of each chunk; use --format megatron or drop recompute_num_layers")
    if p.recompute_group_layers is not None:
        raise SpecError(f"--emit deepspeed: the DeepSpeed config written here recomputes layer by layer, not in groups "
                        f"of {p.recompute_group_layers}; use --format megatron or drop recompute_group_layers")
    if sc.training.distribute_saved_activations:
        raise SpecError("--emit deepspeed: the DeepSpeed config written here keeps whole checkpointed inputs (no "
                        "partition_activations); use --format megatron or drop --distribute-saved-activations")
    if p.recompute_interval is not None:
        raise SpecError(f"--emit deepspeed: the DeepSpeed config written here has no per-layer AC (one layer in "
                        f"every {p.recompute_interval} recomputed); drop recompute_interval")
    if p.pp > 1 and p.zero_stage > 1:
        raise SpecError(f"--emit deepspeed: DeepSpeed's pipeline engine takes ZeRO 0 or 1, not {p.zero_stage} with pp={p.pp}")
    if sc.training.precision != "bf16":
        raise SpecError(f"--emit deepspeed: the DeepSpeed config written here has no {sc.training.precision} "
                        "recipe; use bf16")
    if p.pipeline_schedule not in (None, "1f1b"):
        from planner.schedules import schedule_problems

        lines = schedule_problems(p.pipeline_schedule, "deepspeed", p.pp, p.vpp, sc.num_microbatches)
        raise SpecError(f"--emit deepspeed: {lines[0]}" if lines else
                        f"--emit deepspeed: the config written here drives PipelineEngine (1F1B); plan3d does not "
                        f"write DeepSpeed's DualPipeVEngine setup (plan has {p.pipeline_schedule})")
    if p.vpp > 1:
        raise SpecError(f"--emit deepspeed: DeepSpeed's pipeline engine has no interleaved schedule (plan has vpp={p.vpp})")
    if sc.model.is_moe and (p.ep > 1 or p.expert_tp != p.tp):
        raise SpecError(f"--emit deepspeed: DeepSpeed-MoE sets expert parallelism in the model code (deepspeed.moe.layer.MoE "
                        f"ep_size), not in this config, and plan3d does not write it; the plan has ep={p.ep}, "
                        f"etp={p.expert_tp} (use --format megatron)")


def render_config(sc: Scenario) -> str:
    check_supported(sc)
    return json.dumps(config(sc), indent=2) + "\n"
