"""`plan3d models`, `plan3d hardware`, `plan3d show`: the bundled presets and one spec."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.cli.common import JsonOpt, app, console, handle_errors


@app.command()
@handle_errors
def models(json_out: JsonOpt = False) -> None:
    """List the bundled model presets."""
    from planner import presets, render

    specs = [presets.load_model(n) for n in presets.preset_names(presets.MODEL_DIRNAME)]
    if json_out:
        render.print_json([s.model_dump() | {"num_params": s.num_params, "num_active_params": s.num_active_params} for s in specs])
    else:
        con = console()
        con.print(render.models_table(specs, narrow=render.compact(con)))


@app.command()
@handle_errors
def hardware(json_out: JsonOpt = False) -> None:
    """List the bundled hardware profiles."""
    from planner import presets, render

    specs = [presets.load_hardware(n) for n in presets.preset_names(presets.HARDWARE_DIRNAME)]
    if json_out:
        render.print_json([s.model_dump() | {"usable_memory_gib": s.usable_memory_gib} for s in specs])
    else:
        con = console()
        con.print(render.hardware_table(specs, narrow=render.compact(con)))


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
