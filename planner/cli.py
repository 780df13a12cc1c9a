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
GpusOpt = Annotated[int, typer.Option("--gpus", min=1, help="Number of GPUs (world size).", rich_help_panel="Job")]
GlobalBatchOpt = Annotated[int, typer.Option("--global-batch", min=1, help="Global batch size in sequences.", rich_help_panel="Job")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", min=1, help="Sequence length in tokens.", rich_help_panel="Job")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="bf16 or fp8.", rich_help_panel="Job")]
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


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
