"""A torchtitan launch for a plan, in the form torchtitan 0.3 accepts: ``--module``/``--config`` plus
``--section.option`` overrides parsed by its ``ConfigManager`` (tyro).

Option names are torchtitan's (``torchtitan/config/configs.py::ParallelismConfig``, ``TrainingConfig``;
``activation_checkpoint:{none,selective,full}`` subcommands). Mapping: DP without ZeRO is
``data_parallel_replicate_degree``; ZeRO 2/3 is FSDP2 over ``data_parallel_shard_degree``
(``fsdp_reshard_after_forward = never`` for 2). torchtitan has no optimizer-only sharding, so
ZeRO 1 is written as ZeRO 2. torchtitan's selective recompute is per-op SAC, not Megatron's
attention-core recompute.

Batches (``torchtitan/trainer.py``): gradient accumulation steps = global batch / (local batch x DP);
with PP the local batch is split into ``local / pipeline_parallel_microbatch_size`` pipeline
micro-batches, without PP it runs as one forward. So the local batch is the plan's micro-batch when
pp = 1 (accumulation = the plan's micro-batch count) and all of a step's micro-batches when pp > 1.

Mixture of experts: ``--parallelism.expert_parallel_degree`` (see :func:`expert_args` for what torchtitan
can shard); DeepSeek-V3 and Qwen3-30B-A3B have torchtitan configs, other MoE presets are refused.

Precision: torchtitan 0.3.0 sets float8 in its config-registry functions (``model_registry(...,
converters=[Float8LinearConverter...])``), not on the command line. Of the presets plan3d maps,
``llama3_405b`` always converts to float8, ``llama3_8b_mxfp8`` to MXFP8, and ``llama3_8b``/``llama3_70b`` never do,
so a plan whose precision differs from its preset's is refused rather than run in the wrong precision.
"""

from __future__ import annotations

from planner.emit import megatron, partial_optimizer_refusal, refusal_lines, torchrun
from planner.frameworks.torchtitan import ASYNC_TP_CONFIGS, NO_FP16, stage_keys, step_cuda_graph_by_default
from planner.names import slug
from planner.presets import SpecError
from planner.schedules import TORCHTITAN_SCHEDULE_NAMES
from planner.specs import Scenario, pipeline_kept_mode

# plan3d preset -> (torchtitan --module, {precision: the --config function that trains in it}).
# torchtitan 0.3.0 config registries: models/llama3/config_registry.py; models/deepseek_v3/config_registry.py
# (deepseek_v3_671b: model_registry("671B"), no MTP layers; deepseek_v3_671b_float8: the same with float8
# linears and grouped experts); models/qwen3/config_registry.py (qwen3_30b_a3b: model_registry("30B-A3B"));
# models/llama3/config_registry.py llama3_8b_mxfp8 (llama3_8b with MXFP8LinearConverter, torchao's MX linears, which
# need a Blackwell GPU; it turns compile on for the model, which compile_args overrides with the plan's own setting).
# Qwen3-235B-A22B has a model flavour ("235B-A22B") but no config function, and Mixtral no model: refused.
REGISTRY = {"llama3-8b": ("llama3", {"bf16": "llama3_8b", "mxfp8": "llama3_8b_mxfp8"}),
            "llama3-70b": ("llama3", {"bf16": "llama3_70b"}),
            "llama3-405b": ("llama3", {"fp8": "llama3_405b"}),
            "deepseek-v3": ("deepseek_v3", {"bf16": "deepseek_v3_671b", "fp8": "deepseek_v3_671b_float8"}),
            "qwen3-30b-a3b": ("qwen3", {"bf16": "qwen3_30b_a3b"})}
#: Presets whose model torchtitan 0.3.0 does ship, with a config function, but for which plan3d writes no torchtitan
#: launch: GPT-OSS (models/gpt_oss/config_registry.py gpt_oss_20b / gpt_oss_120b) runs its own attention (the
#: "varlen" backend with learned sinks, a 128-token window on even layers) and clamped-SwiGLU grouped experts with
#: biases, none of which plan3d's torchtitan profile was measured on (its eager block and host counts are Llama's and
#: Qwen3's), so a launch would run another model than the one whose memory and time plan3d predicts.
NOT_WRITTEN = {"gpt-oss-120b": "gpt_oss_120b", "gpt-oss-20b": "gpt_oss_20b"}


def stage_options(sc: Scenario) -> tuple[int | None, int, int]:
    """(``pipeline_parallel_layers_per_stage``, first-stage less layers, last-stage less layers) with which
    torchtitan puts exactly the plan's layers on every virtual stage (:func:`planner.frameworks.torchtitan.stage_keys`),
    refused where its command-line keys cannot (``module_fqns_per_model_part``, which can, is a list of lists that
    tyro does not parse from a command line: each value becomes a one-name stage)."""
    p = sc.resolved_plan()
    keys = stage_keys(sc.model.num_layers, p.pp, p.vpp, p.chunk_layers(sc.model.num_layers))
    if keys is None:
        raise SpecError(f"--emit torchtitan: torchtitan's pipeline keys (first/last_stage_less_layers, "
                        f"layers_per_stage) cannot place {list(p.layers_per_stage)} layers on pp={p.pp} x vpp={p.vpp} "
                        f"stages; use --format megatron")
    return keys


WHERE = "--emit torchtitan"


def job_refusals(model, training) -> list[tuple[str, str]]:
    """What keeps torchtitan 0.3.0 from training this model at this precision whatever the plan, as (where,
    reason): a model it does not ship, or a precision its config for the model cannot be switched to
    (``REGISTRY``). Known before a search, so ``plan3d search --emit torchtitan`` refuses up front."""
    if training.fp16:
        return [(WHERE, f"{NO_FP16}; use --format megatron or deepspeed, or precision bf16")]
    if model.name in NOT_WRITTEN:
        return [(WHERE, f"torchtitan 0.3.0 has {NOT_WRITTEN[model.name]}, but plan3d writes no torchtitan launch for "
                        f"{slug(model.name)}: its attention (varlen with sinks and sliding windows) and clamped-SwiGLU "
                        "grouped experts are not measured in plan3d's torchtitan profile (use --format megatron, or "
                        "search with --framework megatron for a plan Megatron-LM runs)")]
    if model.name not in REGISTRY:
        return [(WHERE, f"torchtitan ships no model for {slug(model.name)}; "
                        f"it has {', '.join(sorted(REGISTRY))} among plan3d's presets (use --format megatron, or "
                        f"search with --framework megatron for a plan Megatron-LM runs)")]
    _, configs = REGISTRY[model.name]
    if training.precision not in configs:
        trains = " and ".join(f"{c} trains in {prec}" for prec, c in configs.items())
        return [(WHERE, f"torchtitan 0.3.0's {trains}, and its command line cannot change that; "
                        f"the plan is {training.precision} (use --format megatron)")]
    return []


def job_problems(model, training) -> list[str]:
    """:func:`job_refusals`, one line each."""
    return refusal_lines(job_refusals(model, training))


def args(sc: Scenario) -> list[str]:
    refusal = partial_optimizer_refusal("torchtitan", sc.training)
    if refusal:
        raise SpecError(f"--emit torchtitan: {refusal}")
    if sc.plan.cpu_offload_layers:
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0 has no activation offloading to host memory (plan has "
                        f"cpu_offload_layers={sc.plan.cpu_offload_layers}); use --format megatron or cpu_offload_layers 0")
    if sc.plan.recompute_num_layers is not None:  # its selective_ac_option N checkpoints every N-th layer instead
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0 has no block recompute of the first "
                        f"{sc.plan.recompute_num_layers} layers of each stage (its per-layer AC takes every N-th layer); "
                        "use --format megatron or drop recompute_num_layers")
    if sc.plan.recompute_group_layers is not None:
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0 checkpoints each block alone, not in groups of "
                        f"{sc.plan.recompute_group_layers}; use --format megatron or drop recompute_group_layers")
    if sc.training.distribute_saved_activations:
        raise SpecError("--emit torchtitan: torchtitan has no distributed checkpoint of the layer inputs (Megatron "
                        "--distribute-saved-activations); use --format megatron or drop it")
    if pipeline_kept_mode(sc.training, sc.plan):
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0 keeps no stage outputs (trainer.py: step(..., "
                        f"return_outputs=False)), not pipeline_kept_outputs={sc.training.pipeline_kept_outputs}; "
                        "drop it")
    if sc.training.attention != "flash":
        # torchtitan 0.3.0's ScaledDotProductAttention runs under sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, MATH],
        # set_priority=True) (models/common/attention.py): the fastest fused kernel, plan3d's "flash", whatever torch
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0 runs torch SDPA with cuDNN attention first "
                        f"(models/common/attention.py), not attention={sc.training.attention}; use attention flash, or "
                        "--format megatron")
    if sc.plan.recompute_interval is not None:  # _apply_layer_sac went with the TOML configs
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0's selective AC is per-op only; its per-layer AC (one layer in "
                        f"every {sc.plan.recompute_interval}, selective_ac_option) is gone since the TOML "
                        "configs; use recompute full or selective, or an older torchtitan's TOML")
    problems = job_problems(sc.model, sc.training)
    if problems:
        raise SpecError(problems[0])
    p, tr = sc.resolved_plan(), sc.training
    module, configs = REGISTRY[sc.model.name]
    config = configs[tr.precision]
    sharded = p.zero_stage >= 1 and p.dp > 1
    expert = expert_args(sc, dp_shard=p.dp if sharded else 1)
    local_batch = p.micro_batch_size * (p.num_microbatches if p.pp > 1 else 1)
    out = ["--module", module, "--config", config,
           "--parallelism.data_parallel_replicate_degree", str(1 if sharded else p.dp),
           "--parallelism.data_parallel_shard_degree", str(p.dp if sharded else 1),
           "--parallelism.fsdp_reshard_after_forward", "default" if p.zero_stage >= 3 else "never",
           "--parallelism.tensor_parallel_degree", str(p.tp),
           "--parallelism.enable-sequence-parallel" if p.sequence_parallel else "--parallelism.no-enable-sequence-parallel",
           "--parallelism.pipeline_parallel_degree", str(p.pp),
           "--parallelism.pipeline_parallel_schedule", TORCHTITAN_SCHEDULE_NAMES[p.schedule],
           "--parallelism.pipeline_parallel_microbatch_size", str(p.micro_batch_size),
           "--parallelism.context_parallel_degree", str(p.cp), *expert,
           "--training.local_batch_size", str(local_batch),
           "--training.global_batch_size", str(tr.global_batch_size),
           "--training.seq_len", str(tr.seq_len)]
    if p.pp > 1:
        per_stage, first_less, last_less = stage_options(sc)
        if per_stage is not None:  # else torchtitan's default stage count (stage_keys)
            out += ["--parallelism.pipeline_parallel_layers_per_stage", str(per_stage)]
        out += ["--parallelism.pipeline_parallel_first_stage_less_layers", str(first_less),
                "--parallelism.pipeline_parallel_last_stage_less_layers", str(last_less)]
    # trainer.py _validate_cuda_graphs: "CUDA graphs do not support pipeline parallelism yet", nor EP with the
    # standard all-to-all token dispatcher (it synchronizes with the CPU), which the MoE configs here use
    # (step_cuda_graph_by_default); and where the plan was costed without the graph (TrainingSpec.step_cuda_graph false)
    if not step_cuda_graph_by_default(p.pp, p.ep) or sc.training.step_cuda_graph is False:
        out.append("--training.disable_cuda_graphs")
    out += compile_args(config, tr, p.tp)
    out.append(f"activation_checkpoint:{p.recompute}")
    return out


# torchtitan 0.3.0 config-registry functions that turn compile on (config/configs.py CompileConfig: enable False,
# components ["model", "loss"]): models/llama3/config_registry.py llama3_405b CompileConfig(enable=True,
# enable_async_tensor_parallel=True); models/deepseek_v3/config_registry.py deepseek_v3_671b (and _float8, which
# starts from it) CompileConfig(enable=True, components=["loss"]). llama3_8b, llama3_70b and qwen3_30b_a3b leave it off.
def compile_args(config: str, training, tp: int) -> list[str]:
    """``--compile.*`` so that torchtitan compiles what the plan assumed (``TrainingSpec.compile``,
    ``compile_components``), whatever the registry function sets: the switch is always written. torchtitan
    0.3.0 reads ``--compile.components`` comma-separated (``config/manager.py``).

    Async TP (``CompileConfig.enable_async_tensor_parallel``, applied only with a TP mesh, ``distributed/compile.py``)
    runs where the cost model overlapped the TP collectives (``TrainingSpec.tp_comm_overlap``, resolved: torchtitan's
    default is off) and tp > 1: ``--compile.enable-async-tensor-parallel``. Elsewhere a registry function that turns
    it on (``ASYNC_TP_CONFIGS``) gets ``--compile.no-enable-async-tensor-parallel``, so the launch does not overlap
    what the plan charged in full. torchtitan refuses async TP without the model compiled
    (``CompileConfig.__post_init__``: "Async TP requires 'model' in --compile.components and --compile.enable"), and
    so does ``specs.job_problems``."""
    from planner.cost import resolved_overlap

    out = ["--compile.enable", "--compile.components", ",".join(training.compile_components)] \
        if training.compile else ["--compile.no-enable"]
    if resolved_overlap(training).tp_comm_overlap and tp > 1:
        out.append("--compile.enable-async-tensor-parallel")
    elif config in ASYNC_TP_CONFIGS:
        out.append("--compile.no-enable-async-tensor-parallel")
    return out


def expert_args(sc: Scenario, dp_shard: int) -> list[str]:
    """``--parallelism.expert_parallel_degree`` for a MoE plan, or a one-line refusal of what torchtitan 0.3.0
    cannot shard that way.

    torchtitan 0.3.0 (``config/configs.py`` ``ParallelismConfig.expert_parallel_degree``;
    ``distributed/parallel_dims.py``): EP borrows ranks from ``dp_shard x cp x tp`` ("the dense region
    (dp_shard * cp * tp) and sparse region (efsdp * ep) cover the same ranks", ``efsdp = dp_shard * cp * tp
    / ep``), so ``ep`` must divide that product; ``dp_replicate`` (plan3d's ZeRO 0) lies outside it. The
    sparse mesh ``pp x dp_replicate x efsdp x ep`` has no tensor axis: with ep > 1 each expert is whole on
    its rank (expert TP 1, ``models/common/moe_sharding.py`` ``expert_param_placement_sparse``); with ep 1
    the experts are split over the dense TP axis (``expert_param_placement_dense``): expert TP = tp.
    There is no expert_tensor_parallel_degree option.
    """
    p = sc.plan
    if not sc.model.is_moe:
        return []
    if p.ep > 1 and p.expert_tp != 1:
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0 keeps each expert whole on its rank when ep > 1 (no "
                        f"expert tensor parallelism); the plan has ep={p.ep}, etp={p.expert_tp}: set etp 1")
    if p.ep == 1 and p.expert_tp != p.tp:
        raise SpecError(f"--emit torchtitan: without expert parallelism torchtitan 0.3.0 splits the experts over the "
                        f"tensor-parallel ranks (etp = tp = {p.tp}); the plan has etp={p.expert_tp}")
    region = dp_shard * p.cp * p.tp
    if region % p.ep:
        raise SpecError(f"--emit torchtitan: torchtitan 0.3.0 draws ep from dp_shard({dp_shard}) x cp({p.cp}) x "
                        f"tp({p.tp}) = {region}, which ep={p.ep} does not divide"
                        + ("; ZeRO 0 keeps dp as replicas outside it, use zero_stage >= 1" if dp_shard == 1 else ""))
    return ["--parallelism.expert_parallel_degree", str(p.ep)]


def render(sc: Scenario) -> str:
    """The launch script. The caller's own options (``"$@"``) go before the ``activation_checkpoint:``
    subcommand: torchtitan's parser (tyro) applies options after a subcommand to that subcommand and
    refuses e.g. ``--training.steps`` there ("Unrecognized or misplaced options")."""
    items = args(sc)
    options = [a for a in items if not a.startswith("activation_checkpoint:")]
    subcommands = [a for a in items if a.startswith("activation_checkpoint:")]
    lines = " \\\n  ".join(options + ['"$@"'] + subcommands)
    return f"""#!/usr/bin/env bash
{megatron.header(sc, "torchtitan training")}set -euo pipefail
{torchrun.launcher(sc)} -m torchtitan.train \\
  {lines}
"""
