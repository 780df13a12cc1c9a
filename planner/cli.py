"""The `plan3d` command line: thin typer commands that parse, load specs, call the library, render.

Precedence of settings: CLI flag > plan file > preset > model default.
Bad input ends with one line per problem on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Callable, Optional

import typer

from planner.presets import SpecError

app = typer.Typer(
    name="plan3d",
    help="Plan 3D-parallel (TP x PP x DP) training of large transformers: memory, step time, best plan, launch files.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_BAD_INPUT = 2

# --- shared options -----------------------------------------------------------------------------
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model preset name, YAML/JSON spec, or Hugging Face config.json.", rich_help_panel="Job")]
HardwareOpt = Annotated[str, typer.Option("--hardware", "-H", help="Hardware preset name or YAML/JSON profile.", rich_help_panel="Job")]
GlobalBatchOpt = Annotated[int, typer.Option("--global-batch", min=1, help="Global batch size in sequences.", rich_help_panel="Job")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", min=1, help="Sequence length in tokens.", rich_help_panel="Job")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


def fail(lines: list[str], code: int = EXIT_BAD_INPUT) -> None:
    """Print each problem on its own line to stderr and exit."""
    for line in lines:
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(code)


def handle_errors(fn: Callable) -> Callable:
    """Turn SpecError (bad input) into clean lines and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecError as err:
            fail(err.lines)

    return wrapper


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=False, width=max(120, Console().width))


# --- commands -----------------------------------------------------------------------------------
@app.command()
@handle_errors
def models(json_out: JsonOpt = False) -> None:
    """List the bundled model presets."""
    from planner import presets, render

    specs = [presets.load_model(n) for n in presets.preset_names(presets.MODEL_DIRNAME)]
    if json_out:
        render.print_json([s.model_dump() | {"num_params": s.num_params} for s in specs])
    else:
        console().print(render.models_table(specs))


@app.command()
@handle_errors
def hardware(json_out: JsonOpt = False) -> None:
    """List the bundled hardware profiles."""
    from planner import presets, render

    specs = [presets.load_hardware(n) for n in presets.preset_names(presets.HARDWARE_DIRNAME)]
    if json_out:
        render.print_json([s.model_dump() | {"usable_memory_gib": s.usable_memory_gib} for s in specs])
    else:
        console().print(render.hardware_table(specs))


@app.command()
@handle_errors
def show(name: Annotated[str, typer.Argument(help="Preset name or path to a model/hardware file.")],
         json_out: JsonOpt = False) -> None:
    """Print a model or hardware spec with its derived figures (parameter count, usable memory)."""
    from planner import presets, render

    spec = presets.load_any(name)
    if json_out:
        render.print_json(render.spec_dict(spec))
    else:
        console().print(render.spec_table(spec))


# --- plan options shared by estimate / search ---------------------------------------------------
TpOpt = Annotated[Optional[int], typer.Option("--tp", min=1, help="Tensor-parallel degree.", rich_help_panel="Plan")]
PpOpt = Annotated[Optional[int], typer.Option("--pp", min=1, help="Pipeline-parallel degree.", rich_help_panel="Plan")]
VppOpt = Annotated[Optional[int], typer.Option("--vpp", min=1, help="Virtual stages per pipeline rank (interleaved 1F1B).", rich_help_panel="Plan")]
CpOpt = Annotated[Optional[int], typer.Option("--cp", min=1, help="Context-parallel degree.", rich_help_panel="Plan")]
MbsOpt = Annotated[Optional[int], typer.Option("--micro-batch-size", min=1, help="Sequences per micro-batch.", rich_help_panel="Plan")]
RecomputeOpt = Annotated[Optional[str], typer.Option("--recompute", help="none, selective or full.", rich_help_panel="Plan")]
SpOpt = Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel", help="Megatron sequence parallelism.", rich_help_panel="Plan")]
ZeroOpt = Annotated[Optional[int], typer.Option("--zero-stage", min=0, max=3, help="0-3; 1 = distributed optimizer.", rich_help_panel="Plan")]
LayersOpt = Annotated[Optional[str], typer.Option("--layers-per-stage", help="Uneven pipeline: layers of each stage, comma-separated (18,22,22,18); default even split.", rich_help_panel="Plan")]
PrecisionOpt = Annotated[Optional[str], typer.Option("--precision", help="bf16 or fp8.", rich_help_panel="Job")]
AttentionOpt = Annotated[Optional[str], typer.Option("--attention", help="flash (default) or materialized attention scores.", rich_help_panel="Job")]
OverlapOpt = Annotated[Optional[bool], typer.Option("--overlap-grad-reduce/--no-overlap-grad-reduce", help="DP gradient reduction overlapped with backward (Megatron --overlap-grad-reduce; default on).", rich_help_panel="Job")]
FrameworkOpt = Annotated[Optional[str], typer.Option("--framework", help="megatron (default) or torch: how sequence parallelism keeps activations (torchtitan = torch).", rich_help_panel="Job")]


def _required(value, option: str):
    if value is None:
        raise SpecError(f"{option}: required (or give a PLAN file)")
    return value


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


def _given(**options) -> dict:
    """The options the user set (typer passes None for the others)."""
    return {k: v for k, v in options.items() if v is not None}


def scenario_from_options(plan_file: Optional[str], *, model: Optional[str], hardware: Optional[str],
                          gpus: Optional[int], global_batch: Optional[int], seq_len: Optional[int],
                          precision: Optional[str], attention: Optional[str] = None,
                          overlap_grad_reduce: Optional[bool] = None, framework: Optional[str] = None, **plan_opts):
    """Build a Scenario from a plan file and/or flags; flags win over the file."""
    from planner import presets
    from planner.specs import Scenario

    data: dict = {"training": {}, "plan": {}}
    source = ""
    if plan_file:
        doc = presets.read_document(_existing(plan_file))
        if not isinstance(doc, dict):
            raise SpecError(f"{plan_file}: expected a mapping with keys model, hardware, training, plan")
        data = {**data, **doc}
        source = plan_file
    if model is not None or not plan_file:
        data["model"] = presets.load_model(_required(model, "--model")).model_dump()
    if hardware is not None or not plan_file:
        data["hardware"] = presets.load_hardware(_required(hardware, "--hardware")).model_dump()
    training = dict(data.get("training") or {})
    training |= _given(num_gpus=gpus, global_batch_size=global_batch, seq_len=seq_len, precision=precision,
                       attention=attention, overlap_grad_reduce=overlap_grad_reduce, framework=framework)
    if not plan_file:
        _required(gpus, "--gpus"), _required(global_batch, "--global-batch"), _required(seq_len, "--seq-len")
    plan = dict(data.get("plan") or {})
    given = _given(**plan_opts)
    if given and plan_file:
        plan.pop("num_microbatches", None)  # re-derived after an override
    plan.update(given)
    if not plan_file:
        _required(plan.get("tp"), "--tp"), _required(plan.get("pp"), "--pp")
        plan.setdefault("micro_batch_size", 1)
    if "dp" not in plan or gpus is not None or given:
        plan["dp"] = _derive_dp(training.get("num_gpus"), plan)
    data["training"], data["plan"] = training, plan
    return presets.build(Scenario, data, source)


def _existing(path: str):
    from pathlib import Path

    if not Path(path).is_file():
        raise SpecError(f"PLAN: file {path} does not exist")
    return Path(path)


def _derive_dp(num_gpus, plan: dict) -> int:
    """dp = gpus / (tp * pp * cp), with an error that prints every factor."""
    tp, pp, cp = plan.get("tp", 1), plan.get("pp", 1), plan.get("cp", 1)
    if not all(isinstance(x, int) and x >= 1 for x in (num_gpus, tp, pp, cp)):
        return plan.get("dp", 1)  # the spec validation names the bad field
    if num_gpus % (tp * pp * cp):
        raise SpecError(f"--gpus: {num_gpus} is not divisible by tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp}")
    return num_gpus // (tp * pp * cp)


@app.command()
@handle_errors
def estimate(
    plan_file: Annotated[Optional[str], typer.Argument(metavar="[PLAN]", help="Plan file written by `plan3d search --out`.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model preset, YAML/JSON spec or HF config.json.", rich_help_panel="Job")] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="Hardware preset or profile file.", rich_help_panel="Job")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=1, help="Number of GPUs.", rich_help_panel="Job")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", min=1, help="Global batch in sequences.", rich_help_panel="Job")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=1, help="Sequence length.", rich_help_panel="Job")] = None,
    precision: PrecisionOpt = None,
    attention: AttentionOpt = None, overlap_grad_reduce: OverlapOpt = None, framework: FrameworkOpt = None,
    tp: TpOpt = None, pp: PpOpt = None, vpp: VppOpt = None, cp: CpOpt = None,
    micro_batch_size: MbsOpt = None, recompute: RecomputeOpt = None, sequence_parallel: SpOpt = None,
    zero_stage: ZeroOpt = None, layers_per_stage: LayersOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Memory per pipeline stage, FLOPs and step time of one plan."""
    from planner import render
    from planner.estimate import estimate as run_estimate

    sc = scenario_from_options(plan_file, model=model, hardware=hardware, gpus=gpus, global_batch=global_batch,
                               seq_len=seq_len, precision=precision, attention=attention,
                               overlap_grad_reduce=overlap_grad_reduce, framework=framework, tp=tp, pp=pp, vpp=vpp,
                               cp=cp, micro_batch_size=micro_batch_size, recompute=recompute,
                               sequence_parallel=sequence_parallel, zero_stage=zero_stage,
                               layers_per_stage=parse_layers_per_stage(layers_per_stage))
    est = run_estimate(sc)
    if json_out:
        render.print_json(est.to_dict())
    else:
        render.print_estimate(console(), est)


EXIT_INFEASIBLE = 3


def job_from_options(model: str, hardware: str, gpus: int, global_batch: int, seq_len: int, precision: Optional[str],
                     attention: Optional[str], overlap_grad_reduce: Optional[bool] = None,
                     framework: Optional[str] = None):
    """(ModelSpec, HardwareSpec, TrainingSpec) from the shared job options."""
    from planner import presets
    from planner.specs import TrainingSpec

    training = {"num_gpus": gpus, "global_batch_size": global_batch, "seq_len": seq_len}
    training |= _given(precision=precision, attention=attention, overlap_grad_reduce=overlap_grad_reduce,
                       framework=framework)
    spec_model, spec_hw = presets.load_model(model), presets.load_hardware(hardware)
    from planner.specs import job_problems

    tr = presets.build(TrainingSpec, training, "")
    problems = job_problems(spec_model, spec_hw, tr)
    if problems:
        raise SpecError(problems)
    return spec_model, spec_hw, tr


def _spinner(quiet: bool, text: str):
    import contextlib

    if quiet:
        return contextlib.nullcontext()
    return console(stderr=True).status(text, spinner="dots")


@app.command()
@handle_errors
def search(
    model: ModelOpt, hardware: HardwareOpt,
    gpus: Annotated[str, typer.Option("--gpus", help="GPU count, a list (64,128,256) or a doubling range (64..4096).", rich_help_panel="Job")],
    global_batch: GlobalBatchOpt, seq_len: SeqLenOpt,
    precision: PrecisionOpt = None,
    attention: AttentionOpt = None, overlap_grad_reduce: OverlapOpt = None, framework: FrameworkOpt = None,
    tp: TpOpt = None, pp: PpOpt = None, vpp: VppOpt = None, cp: CpOpt = None,
    micro_batch_size: MbsOpt = None, recompute: RecomputeOpt = None, sequence_parallel: SpOpt = None,
    zero_stage: ZeroOpt = None,
    top: Annotated[int, typer.Option("--top", min=0, help="Alternatives to show, each with another (tp, pp, cp).")] = 3,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Brute-force enumeration instead of the CP-SAT solver.")] = False,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the best plan to this plan file.")] = None,
    emit_formats: Annotated[Optional[str], typer.Option("--emit", help="Also write launch files: megatron,torchrun,slurm,deepspeed,torchtitan.")] = None,
    out_dir: Annotated[str, typer.Option("--out-dir", help="Folder for --emit files.")] = ".",
    report_dir: Annotated[Optional[str], typer.Option("--report", help="Also draw the report of the best plan (or the sweep) into this folder.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out / --emit files that exist.")] = False,
    json_out: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress spinner.")] = False,
) -> None:
    """Find the fastest plan that fits: CP-SAT over TP x PP x DP x CP, micro-batches, schedule, recompute, SP, ZeRO."""
    from planner import render
    from planner.candidates import Pins, SearchSpace
    from planner.search import parse_gpu_counts

    try:
        counts = parse_gpu_counts(gpus)
    except ValueError as err:
        raise SpecError(f"--gpus: {err}") from None
    if recompute is not None and recompute not in ("none", "selective", "full"):
        raise SpecError(f"--recompute: '{recompute}' is not one of none, selective, full")
    pins = Pins(tp=tp, pp=pp, cp=cp, vpp=vpp, micro_batch_size=micro_batch_size, recompute=recompute,
                sequence_parallel=sequence_parallel, zero_stage=zero_stage)
    space = SearchSpace(pins=pins)
    spec_model, spec_hw, training = job_from_options(model, hardware, counts[0], global_batch, seq_len, precision,
                                                     attention, overlap_grad_reduce, framework)
    quiet = quiet or json_out
    if len(counts) > 1:
        if out or emit_formats:
            raise SpecError("--out/--emit: give a single --gpus value to write plan or launch files")
        rows = _sweep(spec_model, spec_hw, training, space, counts, quiet)
        render.print_json(render.sweep_dict(rows)) if json_out else render.print_sweep(console(), rows)
        fitting = [r["estimate"] for r in rows if r["estimate"]]
        if report_dir and fitting:
            from planner.cli_ops import _report

            _report(fitting[-1].scenario, report_dir, gpus, None, quiet)
        if not any(r["estimate"] for r in rows):
            raise typer.Exit(EXIT_INFEASIBLE)
        return
    result = _run_search(spec_model, spec_hw, training, space, top, exhaustive, quiet)
    if result["best"] is None:
        for line in result["message"]:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(EXIT_INFEASIBLE)
    if out:
        from planner.io import write_atomic

        write_atomic(out, render.scenario_json(result["best"].scenario), force)
    if emit_formats:
        from planner.cli_ops import _emit

        _emit(result["best"].scenario, emit_formats, out_dir, force)
    if report_dir:
        from planner.cli_ops import _report

        _report(result["best"].scenario, report_dir, None, None, quiet or json_out)
    if json_out:
        render.print_json(render.search_dict(result))
    else:
        render.print_search(console(), result)
        if out:
            console().print(f"Plan written to {out}")


def _run_search(model, hw, training, space, top: int, exhaustive: bool, quiet: bool) -> dict:
    """Solve (or enumerate), then estimate the winners with the reference functions."""
    import time

    from planner import search as S
    from planner.estimate import estimate
    from planner.memory import estimate_memory
    from planner.specs import Scenario

    t0 = time.perf_counter()
    with _spinner(quiet, f"Searching plans for {model.name} on {training.num_gpus} x {hw.name}..."):
        if exhaustive:
            best, _, n = S.exhaustive(model, hw, training, space)
            res = S.SearchResult(best=best, status="EXHAUSTIVE" if best else "INFEASIBLE", candidates=n)
        else:
            res = S.search(model, hw, training, space, top_k=top)
        wall = time.perf_counter() - t0
        scen = lambda p: estimate(Scenario(model=model, hardware=hw, training=training, plan=p))  # noqa: E731
        out = {"best": scen(res.best) if res.best else None, "alternatives": [scen(p) for p in res.alternatives],
               "solver": {"status": res.status, "wall_s": wall, "candidates": res.candidates}, "message": []}
        if res.best is None:
            msg = ["no plan fits"]
            if res.closest is not None:
                mem = estimate_memory(model, hw, training, res.closest)
                peak = mem.peak
                msg = [f"no plan fits {model.name} on {training.num_gpus} x {hw.name}: the closest, "
                       f"{res.closest.label()} (recompute {res.closest.recompute}, ZeRO-{res.closest.zero_stage}), "
                       f"has stage {peak.stage} needing {mem.peak_gib:.1f} GiB of {mem.usable_gib:.1f} GiB usable"]
            elif res.candidates == 0:
                msg = [f"no legal plan for {training.num_gpus} GPUs with these pins: check --tp/--pp/--cp/--vpp/"
                       "--micro-batch-size against the model's heads and layers, --gpus and --global-batch"]
            smallest = S.smallest_fitting_gpus(model, hw, training, space)
            msg.append(f"the smallest GPU count that fits is {smallest}" if smallest else
                       "no GPU count up to 4096x this one fits")
            out["message"] = msg
    return out


def _sweep(model, hw, training, space, counts: list[int], quiet: bool) -> list[dict]:
    from planner import search as S
    from planner.estimate import estimate
    from planner.specs import Scenario

    rows = []
    with _spinner(quiet, "Sweeping GPU counts..."):
        for n in counts:
            tr = training.model_copy(update={"num_gpus": n})
            res = S.search(model, hw, tr, space)
            est = estimate(Scenario(model=model, hardware=hw, training=tr, plan=res.best)) if res.best else None
            rows.append({"gpus": n, "estimate": est, "status": res.status})
    return rows


# the commands that write files or run jobs (emit, check, validate, calibrate, report) live in cli_ops
from planner import cli_ops  # noqa: E402, F401  (registers its commands on `app`)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    # `python -m planner.cli` runs this file as __main__; the commands of cli_ops are registered on
    # the app of the imported module planner.cli, so run that one.
    from planner.cli import main as _main

    _main()
