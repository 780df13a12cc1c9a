"""Launch files for a plan: one module per target, each a pure mapping from the scenario to text.

``render_all`` returns ``{file name: content}``; ``planner.io.write_all`` writes them. File
names carry the plan, e.g. ``llama3-70b_tp8-pp4-dp16_mbs1.slurm``.
"""

from __future__ import annotations

from planner.names import slug
from planner.presets import SpecError
from planner.specs import Scenario

FORMATS = ("megatron", "torchrun", "slurm", "deepspeed", "torchtitan", "plan")
#: The formats that launch Megatron-LM (its arguments, alone or in a torchrun or Slurm script).
MEGATRON_FORMATS = ("megatron", "torchrun", "slurm")

#: The frameworks (``TrainingSpec.framework``) whose memory and time semantics each launch format runs: Megatron-LM's
#: arguments run Megatron-Core, which NeMo also runs; the DeepSpeed config runs DeepSpeed's engine; the torchtitan
#: script runs torchtitan. The plan file runs under any.
FORMAT_FRAMEWORKS = {**dict.fromkeys(MEGATRON_FORMATS, ("megatron", "nemo")), "deepspeed": ("deepspeed",),
                     "torchtitan": ("torchtitan",)}

#: ``plan3d emit`` without ``--format``: the launch files of the framework the plan was searched for.
DEFAULT_FORMATS = {"torchtitan": "torchtitan", "deepspeed": "deepspeed"}


def default_formats(framework: str) -> str:
    """The formats ``plan3d emit`` writes when none is asked for: the plan's own framework's (a torchtitan plan gets
    its torchtitan script, a DeepSpeed plan its config and plan file), Megatron-LM's arguments, torchrun and Slurm
    scripts otherwise."""
    return DEFAULT_FORMATS.get(framework, ",".join(MEGATRON_FORMATS))


def has_launch_format(framework: str) -> bool:
    """Whether the framework has launch files of its own: every one but ``torch`` (plan3d validate's own run, whose
    plans :func:`default_formats` writes as Megatron-LM's)."""
    return framework != "torch"


def framework_notes(framework: str, formats: list[str]) -> list[str]:
    """One line per requested format that runs another framework than the one the plan was searched for: its
    memory and step time were predicted under that framework's semantics (planner/frameworks), not the format's.
    The file is still written; ``plan3d check`` judges it under its own framework. ``torch`` (plan3d's own
    validation run) has no launch format of its own and gets no note."""
    if not has_launch_format(framework):
        return []
    notes = []
    for fmt in formats:
        runs = FORMAT_FRAMEWORKS.get(fmt)
        if runs and framework not in runs:
            notes.append(f"note: --format {fmt} runs {runs[0]}, but the plan was searched for framework {framework}: "
                         f"its memory and step time are {framework}'s. Run `plan3d check` on the file, or search "
                         f"with --framework {runs[0]}")
    return notes


def stem(sc: Scenario) -> str:
    """The file-name stem: the model name's slug (no ``/``, ``..``, spaces or shell syntax) and the plan."""
    return f"{slug(sc.model.name)}_{sc.plan.label()}"


def parse_formats(text: str) -> list[str]:
    wanted = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in wanted if f not in FORMATS]
    if bad or not wanted:
        raise SpecError(f"--format/--emit: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(FORMATS)}")
    return wanted


def _megatron_formats(formats: list[str]) -> list[str]:
    """The requested formats that launch Megatron-LM (its arguments, in a torchrun or Slurm script)."""
    return [f for f in formats if f in MEGATRON_FORMATS]


def _model_refusals(model, formats: list[str]) -> list[tuple[str, str]]:
    megatron_formats = _megatron_formats(formats)
    gaps = model.megatron_gaps() if megatron_formats else []
    return [(f"--format {megatron_formats[0]}", f"{model.name}: {gap}") for gap in gaps]


def chunk_refusals(model, training, formats: list[str]) -> list[tuple[str, str]]:
    """A Megatron-LM launch of a model with chunked attention (Llama 4, ``ModelSpec.attention_chunk``) at a sequence
    longer than the chunk: Megatron-LM core_v0.16.1 has no chunked attention, so its layers would attend over the
    whole sequence, another model's compute. Up to the chunk, chunked attention is causal attention and the launch
    is exact."""
    megatron_formats = _megatron_formats(formats)
    if not megatron_formats or not model.chunked or training.seq_len <= model.attention_chunk:
        return []
    return [(f"--format {megatron_formats[0]}",
             f"{model.name}: {model.chunked} layers attend within {model.attention_chunk}-token chunks, which "
             f"Megatron-LM cannot express (core_v0.16.1 has no chunked attention): at seq_len {training.seq_len} its "
             f"layers would attend over the whole sequence; use --seq-len {model.attention_chunk} or less")]


def model_problems(model, formats: list[str]) -> list[str]:
    """What the Megatron-LM launch formats cannot build of ``model`` (``ModelSpec.megatron_gaps``), one line each:
    a launch file that builds another model than the plan's is refused, never written. Independent of the plan,
    so ``plan3d search --emit`` checks it before searching."""
    return refusal_lines(_model_refusals(model, formats))


def refusal_lines(refusals) -> list[str]:
    """(where, reason) refusals as the emitters word them, one line each: "where: reason"."""
    return [f"{where}: {reason}" for where, reason in refusals]


def job_refusals(model, training, formats: list[str]) -> list[tuple[str, str]]:
    """Every refusal of ``formats`` that the model and the job alone decide (the plan's are the emitters' own), as
    (where, reason): :func:`model_problems`, chunked attention past its chunk (:func:`chunk_refusals`), NeMo 1's
    Apex optimizer in a Megatron-LM launch
    (``megatron.parallel_flags`` refuses it too) and torchtitan's model and precision
    (``planner.emit.torchtitan.job_refusals``)."""
    from planner.emit import torchtitan
    from planner.emit.megatron import APEX_REFUSAL

    megatron_formats = _megatron_formats(formats)
    apex = [(f"--format {megatron_formats[0]}", APEX_REFUSAL)] \
        if megatron_formats and training.optimizer_dtype == "bf16-apex" else []
    refusals = {f: partial_optimizer_refusal(f, training) for f in formats}
    partial = [(f"--format {f}", refusal) for f, refusal in refusals.items() if refusal]
    return _model_refusals(model, formats) + chunk_refusals(model, training, formats) + apex + partial + \
        (torchtitan.job_refusals(model, training) if "torchtitan" in formats else [])


def job_problems(model, training, formats: list[str]) -> list[str]:
    """:func:`job_refusals`, one line each, as the emitters word their own refusals ("--format X: reason")."""
    return refusal_lines(job_refusals(model, training, formats))


def partial_optimizer_refusal(fmt: str, training) -> str | None:
    """Why ``fmt`` cannot launch a job with Megatron-Core's partial distributed optimizers
    (``TrainingSpec.dist_optimizer_instances`` > 1) or its Muon (``TrainingSpec.optimizer``): no other framework
    plan3d emits for has them (torchtitan's and DeepSpeed's files here train with AdamW); None where it can."""
    if fmt not in ("deepspeed", "torchtitan"):
        return None
    if training.optimizer != "adam":
        return (f"{fmt} as plan3d emits it trains with AdamW, not Megatron-Core's Muon (the job has optimizer "
                f"{training.optimizer}); use --format megatron")
    if training.dist_optimizer_instances == 1:
        return None
    return (f"{fmt} has no partial distributed optimizer (the job has dist_optimizer_instances="
            f"{training.dist_optimizer_instances}); use --format megatron or 1")


def render_all(sc: Scenario, formats: list[str]) -> dict[str, str]:
    """Every requested launch file. A Slurm script comes with the plan file its validate mode reads."""
    from planner import render
    from planner.emit import deepspeed, megatron, slurm, torchrun, torchtitan

    gaps = model_problems(sc.model, formats) + refusal_lines(chunk_refusals(sc.model, sc.training, formats))
    if gaps:
        raise SpecError(gaps)
    base = stem(sc)
    plan_name = f"{base}.plan.json"
    out: dict[str, str] = {}
    for fmt in formats:
        if fmt == "megatron":
            out[f"{base}.megatron.args"] = megatron.render_args(sc)
        elif fmt == "torchrun":
            out[f"{base}.torchrun.sh"] = torchrun.render(sc)
        elif fmt == "slurm":
            out[f"{base}.slurm"] = slurm.render(sc, plan_name)
            out[plan_name] = render.scenario_json(sc)
        elif fmt == "deepspeed":  # the config holds no model: the plan file beside it does (plan3d check reads both)
            out[f"{base}.deepspeed.json"] = deepspeed.render_config(sc)
            out[plan_name] = render.scenario_json(sc)
        elif fmt == "torchtitan":
            out[f"{base}.torchtitan.sh"] = torchtitan.render(sc)
        elif fmt == "plan":
            out[plan_name] = render.scenario_json(sc)
    return out
