"""`plan3d emit`, `plan3d check`, `plan3d report`: launch files, the CI memory gate, figures."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from planner.cli.common import (
    ForceOpt, QuietOpt, app, console, fail, handle_errors, spinner,
)
from planner.errors import MAX_COUNT, MAX_GPUS, SpecError


@app.command()
@handle_errors
def emit(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN", help="Plan file written by `plan3d search --out`.")],
    formats: Annotated[Optional[str], typer.Option("--format", "-f", help="Comma-separated: megatron, torchrun, slurm, deepspeed, torchtitan, plan. Default: the plan's framework's own (megatron,torchrun,slurm for megatron and nemo; torchtitan; deepspeed).")] = None,
    out_dir: Annotated[str, typer.Option("--out-dir", "-o", help="Folder for the launch files (created if missing).")] = ".",
    force: ForceOpt = False,
) -> None:
    """Write launch files for a plan: Megatron-LM arguments, torchrun, Slurm, DeepSpeed, torchtitan."""
    from planner import presets
    from planner.emit import default_formats

    sc = presets.load_scenario(plan_file)
    emit_files(sc, formats if formats is not None else default_formats(sc.training.framework), out_dir, force)


def emit_files(sc, formats: str, out_dir: str, force: bool, quiet: bool = False) -> None:
    """Write ``formats``' launch files for ``sc``; a format that runs another framework than the plan's gets a note
    on stderr (``planner.emit.framework_notes``), even when ``quiet``."""
    from planner.emit import framework_notes, parse_formats, render_all
    from planner.io import write_all

    wanted = parse_formats(formats)
    unchanged: list = []
    for path in write_all(out_dir, render_all(sc, wanted), force, unchanged=unchanged):
        if not quiet:
            console().print(f"{'unchanged (same content)' if path in unchanged else 'wrote'} {path}", highlight=False)
    for line in framework_notes(sc.training.framework, wanted):
        console(stderr=True).print(line, highlight=False)


@app.command()
def check(
    files: Annotated[list[str], typer.Argument(metavar="FILE...", help="Plan files, bash/Slurm launch scripts, Megatron-LM argument files, torchtitan TOML or DeepSpeed JSON configs.")],
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="Hardware preset or profile; required for launch files, except those plan3d emit wrote for a bundled profile (they name it).")] = None,
    headroom: Annotated[Optional[float], typer.Option("--headroom", min=0.0, max=0.9, help="Fragmentation headroom, e.g. 0.05 (default: the profile's).")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=1, max=MAX_GPUS, help="GPU count when a file does not say it.")] = None,
    vocab_size: Annotated[Optional[int], typer.Option("--vocab-size", min=1, max=MAX_COUNT, help="Tokenizer vocabulary (before Megatron's padding) for launch files whose tokenizer check cannot size.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, json or github (GitHub Actions annotations).")] = "table",
) -> None:
    """CI memory gate: exit 0 when every file's plan fits, 1 when one does not, 2 on unreadable or invalid input."""
    from planner import presets, render
    from planner.check import check_paths, exit_code, to_json

    if fmt not in ("table", "json", "github"):
        fail([f"--format: '{fmt}' is not one of table, json, github"])
    try:
        hw = presets.load_hardware(hardware) if hardware else None
    except SpecError as err:
        fail(err.lines)
    results = check_paths(files, hw, headroom, gpus, vocab_size)
    if fmt == "json":
        render.print_json(json.loads(to_json(results)))
    elif fmt == "github":
        render.print_github(results)
    else:
        render.print_check(console(), results)
    code = exit_code(results)  # 2 unreadable or invalid, 1 does not fit, 0 fits
    if code:
        raise typer.Exit(code)


@app.command()
@handle_errors
def report(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN", help="Plan file written by `plan3d search --out`.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for the figures (PNG, SVG) and report.html.")] = "report",
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="Also draw a scaling curve over these GPU counts (64..1024 or a list).")] = None,
    validate_report: Annotated[Optional[str], typer.Option("--validate", help="A `plan3d validate --out` report to draw.")] = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Draw the plan: pipeline timeline, memory per stage, TP x PP map, scaling curve; one self-contained HTML page."""
    from planner import presets

    sc = presets.load_scenario(plan_file)
    write_report_files(sc, out, sweep, validate_report, quiet, force)


def write_report_files(sc, out: str, sweep: Optional[str], validate_report: Optional[str], quiet: bool,
                       force: bool = False) -> None:
    from pathlib import Path

    from planner.report import write_report
    from planner.search import parse_gpu_counts

    counts = None
    if sweep:
        try:
            counts = parse_gpu_counts(sweep, max_gpus=MAX_GPUS)
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
    # not animated: the TP x PP map builds the search tables, whose workers a refresh thread would forbid
    with spinner(quiet, f"Drawing the report into {out}...", animate=False):
        figures = write_report(sc, out, counts, measured, force=force)
    if not quiet:
        console().print(f"wrote {figures['html']} and {len(figures) - 1} figures (PNG and SVG)", highlight=False)
