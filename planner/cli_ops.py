"""`plan3d` commands that write launch files, gate CI, run jobs and draw reports: emit, check, validate,
calibrate, report. They register on the typer app of ``planner.cli``; torch is imported only inside
validate and calibrate.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from planner.cli import EXIT_BAD_INPUT, JsonOpt, _spinner, app, console, fail, handle_errors
from planner.presets import SpecError


@app.command()
@handle_errors
def emit(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN", help="Plan file written by `plan3d search --out`.")],
    formats: Annotated[str, typer.Option("--format", "-f", help="Comma-separated: megatron, torchrun, slurm, deepspeed, torchtitan, plan.")] = "megatron,torchrun,slurm",
    out_dir: Annotated[str, typer.Option("--out-dir", "-o", help="Folder for the launch files (created if missing).")] = ".",
    force: Annotated[bool, typer.Option("--force", help="Overwrite files that exist.")] = False,
) -> None:
    """Write launch files for a plan: Megatron-LM arguments, torchrun, Slurm, DeepSpeed, torchtitan."""
    from planner import presets

    _emit(presets.load_scenario(plan_file), formats, out_dir, force)


def _emit(sc, formats: str, out_dir: str, force: bool) -> None:
    from planner.emit import parse_formats, render_all
    from planner.io import write_all

    for path in write_all(out_dir, render_all(sc, parse_formats(formats)), force):
        console().print(f"wrote {path}")


@app.command()
def check(
    files: Annotated[list[str], typer.Argument(metavar="FILE...", help="Plan files, Megatron-LM argument files or launch scripts.")],
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="Hardware preset or profile (required for Megatron-LM files).")] = None,
    headroom: Annotated[Optional[float], typer.Option("--headroom", min=0.0, max=0.9, help="Fragmentation headroom, e.g. 0.05 (default: the profile's).")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=1, help="GPU count when a file does not say it.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, json or github (GitHub Actions annotations).")] = "table",
) -> None:
    """CI memory gate: exit 0 when every file's plan fits, 1 when one does not, 2 on unreadable or invalid input."""
    from pathlib import Path

    from planner import presets, render
    from planner.check import check_file, to_json

    if fmt not in ("table", "json", "github"):
        fail([f"--format: '{fmt}' is not one of table, json, github"])
    try:
        hw = presets.load_hardware(hardware) if hardware else None
    except SpecError as err:
        fail(err.lines)
    results = [check_file(Path(f), hw, headroom, gpus) for f in files]
    if fmt == "json":
        render.print_json(json.loads(to_json(results)))
    elif fmt == "github":
        render.print_github(results)
    else:
        render.print_check(console(), results)
    if any(r.errors for r in results):
        raise typer.Exit(EXIT_BAD_INPUT)
    if not all(_fits(r) for r in results):
        raise typer.Exit(1)


def _fits(result) -> bool:
    from planner.memory import estimate_scenario_memory

    return estimate_scenario_memory(result.scenario).fits


@app.command()
@handle_errors
def validate(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN", help="Plan file written by `plan3d search --out`.")],
    steps: Annotated[int, typer.Option("--steps", min=1, max=1000, help="Measured steps (after one warm-up step).")] = 3,
    backend: Annotated[Optional[str], typer.Option("--backend", help="gloo (CPU) or nccl (GPUs); default: nccl when CUDA is there.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the JSON report here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    scale: Annotated[float, typer.Option("--scale", min=0.25, max=8.0, help="Size of the local miniature (head width and sequence, x1 = 16 and 128).")] = 1.0,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help="Profile of this machine for the miniature's prediction (e.g. from `plan3d calibrate`).")] = "cpu-gloo",
    max_ranks: Annotated[int, typer.Option("--max-ranks", min=1, max=64, help="Local processes for the miniature.")] = 8,
    timeout: Annotated[float, typer.Option("--timeout", min=10, help="Wall-clock limit of the whole run, seconds.")] = 300.0,
    json_out: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress spinner.")] = False,
) -> None:
    """Run the plan with torch.distributed and compare measured memory, time and bandwidth with the prediction.

    Inside torchrun or Slurm (the scripts from `plan3d emit`) it runs the plan at full scale; outside,
    it starts torchrun itself on this machine with a miniature of the plan.
    """
    from planner import presets, render
    from planner.validate import launch

    sc = presets.load_scenario(plan_file)
    if backend not in (None, "gloo", "nccl"):
        raise SpecError(f"--backend: '{backend}' is not one of gloo, nccl")
    if out and not force:
        from pathlib import Path

        if Path(out).exists():
            raise SpecError(f"--out: {out} exists; pass --force to overwrite it")
    if launch.inside_torchrun():
        code = _validate_in_job(sc, plan_file, steps, backend, out, force, timeout)
        raise typer.Exit(code)
    local_hw = presets.load_hardware(hardware)
    with _spinner(quiet or json_out, f"Validating a miniature of {sc.plan.label()} with torchrun on this machine..."):
        mini, outcome = launch.validate_local(sc, steps=steps, scale=scale, max_ranks=max_ranks,
                                              backend=backend or "gloo", timeout_s=timeout, hardware=local_hw)
    if not outcome.ok:
        for line in outcome.message:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(1)
    report = outcome.report
    if out:
        from planner.io import write_atomic

        write_atomic(out, json.dumps(report, indent=2) + "\n", force)
    if json_out:
        render.print_json(report)
    else:
        render.print_validate(console(), sc, mini, report)
    raise typer.Exit(0 if report["fits"] else 1)


def _validate_in_job(sc, plan_file: str, steps: int, backend, out, force: bool, timeout: float) -> int:
    """Full-scale run: this process is one rank of the job; rank 0 compares and reports."""
    import os
    import tempfile

    from planner import render
    from planner.validate import launch, worker

    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    tmp = os.path.join(tempfile.gettempdir(), f"plan3d-validate-{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}.json")
    worker.main(["--plan", plan_file, "--steps", str(steps), "--out", tmp, "--backend", backend,
                 "--timeout-s", str(timeout)])
    if os.environ.get("RANK") != "0":
        return 0
    run = launch.run_scenario(sc)
    report = launch.compare(run, json.loads(open(tmp).read()))
    if out:
        from planner.io import write_atomic

        write_atomic(out, json.dumps(report, indent=2) + "\n", force)
    render.print_validate(console(), sc, run, report)
    return 0 if report["fits"] else 1


@app.command()
@handle_errors
def calibrate(
    backend: Annotated[str, typer.Option("--backend", help="gloo (CPU) or nccl (GPUs).")] = "gloo",
    out: Annotated[Optional[str], typer.Option("--out", help="Write the hardware profile (YAML) here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    base: Annotated[Optional[str], typer.Option("--base", help="Profile to start from (default: cpu-gloo for gloo).")] = None,
    ranks: Annotated[int, typer.Option("--ranks", min=1, max=64, help="Local processes (one per GPU).")] = 8,
    name: Annotated[Optional[str], typer.Option("--name", help="Name of the new profile.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress spinner.")] = False,
) -> None:
    """Measure matmul FLOP/s and bus bandwidth here and write a hardware profile that search and estimate accept."""
    from planner import presets
    from planner.validate import launch

    if backend not in ("gloo", "nccl"):
        raise SpecError(f"--backend: '{backend}' is not one of gloo, nccl")
    if backend == "nccl" and base is None:
        raise SpecError("--base: name the profile of these GPUs (e.g. h100-sxm-80gb) to calibrate with nccl")
    if out and not force:
        from pathlib import Path

        if Path(out).exists():
            raise SpecError(f"--out: {out} exists; pass --force to overwrite it")
    base_spec = presets.load_hardware(base or "cpu-gloo")
    with _spinner(quiet, f"Measuring GEMMs and all-reduce with {ranks} {backend} ranks..."):
        spec, text = launch.calibrate_local(base_spec, backend=backend, ranks=ranks, quick=backend == "gloo",
                                            name=name)
    if out:
        from planner.io import write_atomic

        write_atomic(out, text, force)
        console().print(f"wrote {out}")
    else:
        typer.echo(text, nl=False)


@app.command()
@handle_errors
def report(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN", help="Plan file written by `plan3d search --out`.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for the figures (PNG, SVG) and report.html.")] = "report",
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="Also draw a scaling curve over these GPU counts (64..1024 or a list).")] = None,
    validate_report: Annotated[Optional[str], typer.Option("--validate", help="A `plan3d validate --out` report to draw.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress spinner.")] = False,
) -> None:
    """Draw the plan: pipeline timeline, memory per stage, TP x PP map, scaling curve; one self-contained HTML page."""
    from planner import presets

    sc = presets.load_scenario(plan_file)
    _report(sc, out, sweep, validate_report, quiet)


def _report(sc, out: str, sweep: Optional[str], validate_report: Optional[str], quiet: bool) -> None:
    from pathlib import Path

    from planner.report import write_report
    from planner.search import parse_gpu_counts

    counts = None
    if sweep:
        try:
            counts = parse_gpu_counts(sweep)
        except ValueError as err:
            raise SpecError(f"--sweep: {err}") from None
    measured = None
    if validate_report:
        path = Path(validate_report)
        try:
            measured = json.loads(path.read_text())
            measured["memory"], measured["step_time"]  # noqa: B018 - the keys a validate report has
        except (OSError, ValueError, KeyError, TypeError):
            raise SpecError(f"--validate: {validate_report} is not a `plan3d validate --out` report") from None
    with _spinner(quiet, f"Drawing the report into {out}..."):
        figures = write_report(sc, out, counts, measured)
    if not quiet:
        console().print(f"wrote {figures['html']} and {len(figures) - 1} figures (PNG and SVG)")
