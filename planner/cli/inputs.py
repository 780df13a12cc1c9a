"""Turning command-line options (and plan files) into the specs the library takes.

Precedence: CLI flag > plan file > preset > model default. A flag that changes what a plan file's
derived values depend on (``--gpus``, ``--global-batch``, ``--pp``, any plan knob) re-derives them:
``dp`` from the GPU count, ``num_microbatches`` from the batch, the layer split from ``pp``; where a
knob pinned in the file makes that impossible, the error names the knob and the flag that frees it.
"""

from __future__ import annotations

from pathlib import Path
import typing
from typing import Optional

from planner.errors import SpecError, missing_file


def required(value, option: str):
    if value is None:
        raise SpecError(f"{option}: required (or give a PLAN file)")
    return value


def given(**options) -> dict:
    """The options the user set (typer passes None for the others)."""
    return {k: v for k, v in options.items() if v is not None}


def precision_fields(precision: Optional[str]) -> dict:
    """The TrainingSpec fields ``--precision`` sets: fp16 is the 16-bit format of a bf16-costed job
    (``TrainingSpec.fp16``: 2 bytes a value either way; Megatron ``--fp16``, DeepSpeed ``fp16.enabled``), the others
    are ``TrainingSpec.precision`` itself, with bf16 as the 16-bit format (also over a plan file's fp16)."""
    if precision is None:
        return {}
    if precision == "fp16":
        return {"precision": "bf16", "fp16": True}
    return {"precision": precision, "fp16": False}


def parse_layers_per_stage(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """``"18,22,22,18"`` -> ``(18, 22, 22, 18)``; a one-line error naming the option otherwise."""
    if text is None:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecError(f"--layers-per-stage: expected layer counts separated by commas, such as 18,22,22,18; "
                        f"got {text!r}") from None
    return counts


def existing_file(path: str, what: str = "PLAN") -> Path:
    p = Path(path)
    if p.is_dir():
        raise SpecError(f"{what}: {path} is a folder; give the path of a file")
    if not p.is_file():
        raise SpecError(f"{what}: {missing_file(path)}")
    return p


def derive_dp(num_gpus, plan: dict, from_file: bool = False) -> int:
    """dp = gpus / (tp * pp * cp), with an error that prints every factor."""
    tp, pp, cp = plan.get("tp", 1), plan.get("pp", 1), plan.get("cp", 1)
    if not all(isinstance(x, int) and x >= 1 for x in (num_gpus, tp, pp, cp)):
        return plan.get("dp", 1)  # the spec validation names the bad field
    if num_gpus % (tp * pp * cp):
        fix = "; pass --tp/--pp/--cp to change the plan file's degrees" if from_file else ""
        raise SpecError(f"--gpus: {num_gpus} is not divisible by tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp}{fix}")
    return num_gpus // (tp * pp * cp)


def scenario_from_options(plan_file: Optional[str], *, model: Optional[str], hardware: Optional[str],
                          gpus: Optional[int], global_batch: Optional[int], seq_len: Optional[int],
                          precision: Optional[str], attention: Optional[str] = None,
                          overlap_grad_reduce: Optional[bool] = None, framework: Optional[str] = None,
                          tp_comm_overlap: Optional[bool] = None, overlap_p2p_comm: Optional[bool] = None,
                          job_extra: Optional[dict] = None, notes: Optional[list] = None, **plan_opts):
    """Build a Scenario from a plan file and/or flags; flags win over the file. ``plan_file`` may also be a launch
    file (a bash or Slurm script, a Megatron-LM argument file, a torchtitan TOML, a DeepSpeed JSON config beside the
    script that passes it), read on ``hardware`` as `plan3d check` reads it (``planner.check.launch_scenario``);
    check's notes on it are appended to ``notes``."""
    from planner import presets
    from planner.check import launch_scenario
    from planner.specs import Scenario

    data: dict = {"training": {}, "plan": {}}
    source = ""
    launch_hw = None
    if plan_file:
        path = existing_file(plan_file)
        doc = presets.plan_document(path)
        if doc is None:  # a launch file (a DeepSpeed JSON config too: check finds the script that passes it)
            launch_hw = presets.load_hardware(hardware) if hardware is not None else None
            sc, said = launch_scenario(path, launch_hw, gpus)
            doc = sc.model_dump(mode="json")
            if notes is not None:
                notes.extend(said)
        if not isinstance(doc, dict):
            raise SpecError(f"{plan_file}: expected a mapping with keys model, hardware, training, plan")
        data = {**data, **doc}
        source = plan_file
    if model is not None or not plan_file:
        data["model"] = presets.load_model(required(model, "--model")).model_dump()
    if launch_hw is not None:
        data["hardware"] = launch_hw.model_dump()
    elif hardware is not None or not plan_file:
        data["hardware"] = presets.load_hardware(required(hardware, "--hardware")).model_dump()
    training = dict(data.get("training") or {})
    job = given(num_gpus=gpus, global_batch_size=global_batch, seq_len=seq_len)
    training |= job | precision_fields(precision) | given(attention=attention, overlap_grad_reduce=overlap_grad_reduce,
                            framework=framework, tp_comm_overlap=tp_comm_overlap, overlap_p2p_comm=overlap_p2p_comm)
    training |= given(**(job_extra or {}))  # MoE and state options (moe_options, state_options)
    if isinstance(data.get("model"), dict):  # the MoE options against the model, before any plan rule
        problems = dense_moe_option_problems(data["model"].get("num_experts") is not None,
                                             data["model"].get("name", "the model"), job_extra or {})
        if problems:
            raise SpecError(problems)
    if not plan_file:
        required(gpus, "--gpus"), required(global_batch, "--global-batch"), required(seq_len, "--seq-len")
    plan = dict(data.get("plan") or {})
    knobs = given(**plan_opts)
    if plan_file and (knobs or "num_gpus" in job or "global_batch_size" in job):
        plan.pop("num_microbatches", None)  # re-derived from the new batch, GPU count or knobs
    if plan_file and "pp" in knobs and "layers_per_stage" not in knobs:
        plan.pop("layers_per_stage", None)  # the file's split was for its own pipeline depth
    plan.update(knobs)
    if not plan_file:
        required(plan.get("tp"), "--tp"), required(plan.get("pp"), "--pp")
        plan.setdefault("micro_batch_size", 1)
    if "dp" not in plan or gpus is not None or knobs:
        plan["dp"] = derive_dp(training.get("num_gpus"), plan, from_file=bool(plan_file))
    data["training"], data["plan"] = training, plan
    return presets.build(Scenario, data, source)


CUDA_GRAPH_MODULES = ("attn", "moe_router", "moe_preprocess", "moe")


def moe_options(dispatcher: Optional[str], a2a_overlap: Optional[bool], load_imbalance: Optional[float],
                cuda_graph_modules: Optional[str] = None) -> dict:
    """The MoE job options as TrainingSpec fields (the unset ones left out)."""
    if dispatcher is not None and dispatcher not in ("alltoall", "allgather", "deepep", "hybridep"):
        raise SpecError(f"--moe-dispatcher: '{dispatcher}' is not one of alltoall, allgather, deepep, hybridep")
    graphs = module_list(cuda_graph_modules, "--cuda-graph-modules", CUDA_GRAPH_MODULES)
    return given(moe_token_dispatcher=dispatcher, moe_a2a_overlap=a2a_overlap, moe_load_imbalance=load_imbalance,
                 cuda_graph_modules=graphs)


#: The MoE job options (``moe_options``) by the flag that sets each (for the refusals of dense_moe_option_problems).
MOE_ONLY_FLAGS = {"moe_token_dispatcher": "--moe-dispatcher", "moe_a2a_overlap": "--moe-a2a-overlap",
                  "moe_load_imbalance": "--moe-load-imbalance", "cuda_graph_modules": "--cuda-graph-modules"}


def dense_moe_option_problems(is_moe: bool, name: str, options: dict) -> list[str]:
    """What the user asked of ``options`` (the given ``moe_options``) that only a mixture-of-experts model has,
    when the model ``name`` is dense: a token dispatcher, the all-to-all overlap, a load imbalance, or a MoE
    CUDA-graph scope (``moe_router``, ``moe_preprocess``). Refused on the command line, as ``--ep`` is, rather than
    run as a plan that names a switch it cannot have; a plan file or a launch script that carries them for a dense
    model is read as Megatron reads it (they do nothing there)."""
    if is_moe:
        return []
    asked = [k for k in ("moe_token_dispatcher", "moe_load_imbalance") if k in options]
    asked += ["moe_a2a_overlap"] if options.get("moe_a2a_overlap") else []
    moe_scopes = [m for m in options.get("cuda_graph_modules") or () if m.startswith("moe")]
    problems = [f"{MOE_ONLY_FLAGS[k]}: applies to mixture-of-experts models; {name} is dense (drop it)"
                for k in asked]
    problems += [f"--cuda-graph-modules: {m} applies to mixture-of-experts models; {name} is dense (keep attn or "
                 "drop it)" for m in moe_scopes[:1]]
    return problems


def module_list(text: Optional[str], flag: str, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    """A comma-separated list of module names, each one of ``allowed`` (None when the option is not given)."""
    if text is None:
        return None
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if m not in allowed]
    if bad:
        raise SpecError(f"{flag}: '{bad[0]}' is not one of {', '.join(allowed)}")
    return names


def state_options(grad_reduce_in_bf16: Optional[bool], fp8_params: Optional[bool], optimizer_dtype: Optional[str],
                  fp8_recipe: Optional[str] = None, recompute_modules: Optional[str] = None,
                  torch_compile: Optional[bool] = None, cross_entropy_fusion: Optional[str] = None,
                  distribute_saved_activations: Optional[bool] = None,
                  pipeline_kept_outputs: Optional[str] = None,
                  dist_optimizer_instances: Optional[int] = None, optimizer: Optional[str] = None) -> dict:
    """How the framework holds gradients, weights and optimizer states (and scales fp8), as TrainingSpec fields
    (unset left out)."""
    if optimizer_dtype is not None and optimizer_dtype not in ("fp32", "bf16", "bf16-apex"):
        raise SpecError(f"--optimizer-dtype: '{optimizer_dtype}' is not one of fp32, bf16, bf16-apex")
    if optimizer is not None and optimizer not in ("adam", "muon", "dist_muon"):
        raise SpecError(f"--optimizer: '{optimizer}' is not one of adam, muon, dist_muon")
    if fp8_recipe is not None and fp8_recipe not in ("delayed", "tensorwise", "blockwise"):
        raise SpecError(f"--fp8-recipe: '{fp8_recipe}' is not one of delayed, tensorwise, blockwise")
    if cross_entropy_fusion is not None and cross_entropy_fusion not in ("none", "native", "te"):
        raise SpecError(f"--cross-entropy-fusion: '{cross_entropy_fusion}' is not one of none, native, te")
    from planner.specs import RECOMPUTE_MODULES, KeptOutputs

    kept_values = typing.get_args(KeptOutputs)
    if pipeline_kept_outputs is not None and pipeline_kept_outputs not in kept_values:
        raise SpecError(f"--pipeline-kept-outputs: '{pipeline_kept_outputs}' is not one of {', '.join(kept_values)}")

    modules = module_list(recompute_modules, "--recompute-modules", RECOMPUTE_MODULES)
    return given(grad_reduce_in_bf16=grad_reduce_in_bf16, fp8_params=fp8_params, optimizer_dtype=optimizer_dtype,
                 fp8_recipe=fp8_recipe, recompute_modules=modules, compile=torch_compile,
                 cross_entropy_fusion=cross_entropy_fusion, distribute_saved_activations=distribute_saved_activations,
                 pipeline_kept_outputs=pipeline_kept_outputs, dist_optimizer_instances=dist_optimizer_instances,
                 optimizer=optimizer)


def job_from_options(model: str, hardware: str, gpus: int, global_batch: int, seq_len: int, precision: Optional[str],
                     attention: Optional[str], overlap_grad_reduce: Optional[bool] = None,
                     framework: Optional[str] = None, tp_comm_overlap: Optional[bool] = None,
                     overlap_p2p_comm: Optional[bool] = None, job_extra: Optional[dict] = None):
    """(ModelSpec, HardwareSpec, TrainingSpec) from the shared job options."""
    from planner import presets
    from planner.specs import TrainingSpec, job_problems

    training = {"num_gpus": gpus, "global_batch_size": global_batch, "seq_len": seq_len}
    training |= precision_fields(precision) | given(attention=attention, overlap_grad_reduce=overlap_grad_reduce,
                      framework=framework, tp_comm_overlap=tp_comm_overlap, overlap_p2p_comm=overlap_p2p_comm)
    training |= given(**(job_extra or {}))
    spec_model, spec_hw = presets.load_model(model), presets.load_hardware(hardware)
    problems = dense_moe_option_problems(spec_model.is_moe, spec_model.name, job_extra or {})
    if problems:
        raise SpecError(problems)
    tr = presets.build(TrainingSpec, training, "")
    problems = job_problems(spec_model, spec_hw, tr)
    if problems:
        raise SpecError(problems)
    return spec_model, spec_hw, tr
