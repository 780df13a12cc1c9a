"""`plan3d validate` and `plan3d calibrate`: torch.distributed runs of a plan and of this machine.

The only commands that import torch, inside their bodies.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from planner.cli.common import JsonOpt, app, console, handle_errors, spinner
from planner.errors import SpecError


@app.command()
@handle_errors
def validate(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN", help="Plan file written by `plan3d search --out`.")],
    steps: Annotated[int, typer.Option("--steps", min=1, max=1000, help="Measured steps (after one warm-up step).")] = 3,
    backend: Annotated[Optional[str], typer.Option("--backend", help="gloo (CPU) or nccl (GPUs); default: nccl when CUDA is there.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the JSON report here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    scale: Annotated[float, typer.Option("--scale", min=0.25, max=8.0, help="Size of the local miniature (head width and sequence, x1 = 16 and 128).")] = 1.0,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="Profile of this machine for the miniature's prediction (e.g. from `plan3d calibrate`); default cpu-gloo (with --framework: the plan's own).")] = None,
    max_ranks: Annotated[int, typer.Option("--max-ranks", min=1, max=64, help="Local processes for the miniature.")] = 8,
    timeout: Annotated[Optional[float], typer.Option("--timeout", min=10, max=7 * 24 * 3600, help="Wall-clock limit of the whole run, seconds; default 300 (1800 with --framework).")] = None,
    time_factor: Annotated[Optional[float], typer.Option("--time-factor", min=1.0, max=100.0, help="Fail when measured/predicted step time is outside 1/F..F; default 8 (gloo) or 1.5 (nccl) when --hardware was written by `plan3d calibrate`, else reported, not judged.")] = None,
    memory_tolerance: Annotated[Optional[float], typer.Option("--memory-tolerance", min=0.0, max=1.0, help="Fail when a measured memory component is off the prediction by more than this fraction (default 0.05).")] = None,
    precision: Annotated[Optional[str], typer.Option("--precision", help="fp32 or bf16: what the run computes in. Default: fp32 for the local miniature (its loss check against one process is exact in fp32 only), the plan's precision at full size (bf16; fp8, mxfp8 and nvfp4 run bf16, listed as changed). bf16 is FSDP2's MixedPrecisionPolicy(bf16 parameters, fp32 reduction), as torchtitan.")] = None,
    keep: Annotated[Optional[str], typer.Option("--keep", help="Keep the miniature's plan, logs and measurements in this folder.")] = None,
    framework: Annotated[Optional[str], typer.Option("--framework", help="torchtitan or megatron: run the framework itself (the emitted launch file) for --steps steps after one warm-up and judge it from its logs; exit 77 when it cannot run here (docs/validation_framework.md).")] = None,
    logs: Annotated[Optional[str], typer.Option("--logs", help="With --framework: judge the logs of a run made elsewhere (a torchrun --log-dir folder or log files).")] = None,
    megatron_lm: Annotated[Optional[str], typer.Option("--megatron-lm", help="With --framework megatron: the Megatron-LM checkout (default $MEGATRON_LM).")] = None,
    json_out: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress spinner.")] = False,
) -> None:
    """Run the plan with torch.distributed and judge it by measurement: exit 0 pass, 1 fail, 2 bad input.

    Measured memory per component, peak allocated, loss against a single-process reference and, with a
    calibrated profile, step time are compared with the prediction (docs/validation.md). Inside
    torchrun or Slurm (the scripts from `plan3d emit`) it runs the plan at full scale; outside, it
    starts the ranks itself on this machine with a miniature of the plan.
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
    if precision not in (None, "fp32", "bf16"):
        raise SpecError(f"--precision: '{precision}' is not one of fp32, bf16")
    if framework is not None and precision is not None:
        raise SpecError("--precision: applies to plan3d's own run, not with --framework (the framework runs the "
                        "plan's precision)")
    if framework is not None:
        raise typer.Exit(_validate_framework(sc, framework, steps, timeout or 1800.0, keep, megatron_lm, hardware, time_factor,
                                             logs, out, force, json_out))
    if logs is not None or megatron_lm is not None:
        raise SpecError(f"{'--logs' if logs is not None else '--megatron-lm'}: applies with --framework only")
    hardware, timeout = hardware or "cpu-gloo", timeout or 300.0
    tolerance = launch.MEMORY_TOLERANCE if memory_tolerance is None else memory_tolerance
    if launch.inside_torchrun():
        code = _validate_in_job(sc, plan_file, steps, backend, out, force, timeout, time_factor, tolerance, json_out,
                                precision)
        from planner.validate import exit_after_run

        exit_after_run(code)  # this rank's work is done: no interpreter finalization (gloo's teardown aborts)
    local_hw = presets.load_hardware(hardware)
    factor = time_factor if time_factor is not None else launch.time_factor_for(hardware, backend or "gloo")
    with spinner(quiet or json_out, f"Validating a miniature of {sc.plan.label()} on this machine..."):
        mini, outcome = launch.validate_local(sc, steps=steps, scale=scale, max_ranks=max_ranks,
                                              backend=backend or "gloo", timeout_s=timeout, hardware=local_hw,
                                              keep=keep, time_factor=factor, memory_tolerance=tolerance,
                                              precision=precision or "fp32")
    if not outcome.ok:
        if json_out and outcome.report:
            render.print_json(outcome.report)
        for line in outcome.message:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(1)
    raise typer.Exit(_report_verdict(outcome.report, sc, mini, out, force, json_out))


def _validate_framework(sc, framework: str, steps: int, timeout: float, keep, megatron_lm, hardware, time_factor,
                        logs, out, force: bool, json_out: bool) -> int:
    """`validate --framework`: run (or read the logs of) torchtitan / Megatron-LM and judge its measurements."""
    from planner import render
    from planner.validate import framework_run

    if framework not in ("torchtitan", "megatron"):
        raise SpecError(f"--framework: '{framework}' is not one of torchtitan, megatron")
    run = framework_run.validate_framework(sc, framework, steps, timeout, keep, megatron_lm, hardware, time_factor, logs)
    report = framework_run.report_json(run)
    if out:
        from planner.io import write_atomic

        write_atomic(out, json.dumps(report, indent=2) + "\n", force)
    if json_out:
        render.print_json(report)
    else:
        skipped = run.status == "skipped"
        for line in framework_run.summary_lines(run):
            typer.echo(line, err=skipped)
    return framework_run.exit_code(run)


def _report_verdict(report: dict, sc, run, out, force: bool, json_out: bool) -> int:
    """Write and print the report; the exit code: 0 when the measured verdict passes, 1 when it fails."""
    from planner import render
    from planner.validate import launch

    if out:
        from planner.io import write_atomic

        write_atomic(out, json.dumps(report, indent=2) + "\n", force)
    if json_out:
        render.print_json(report)
    else:
        con = console()
        render.print_validate(con, sc, run, report)
        for line in launch.summary_lines(report):
            con.print(line, highlight=False, markup=False)
    return 0 if report["verdict"] == "pass" else 1


def _validate_in_job(sc, plan_file: str, steps: int, backend, out, force: bool, timeout: float,
                     time_factor, memory_tolerance: float, json_out: bool = False, precision: str | None = None) -> int:
    """Full-scale run: this process is one rank of the job; rank 0 compares and reports. It runs in
    ``precision`` or the plan's (``launch.run_scenario``), and the report lists what the run changed."""
    import os
    import tempfile

    from planner.validate import launch, worker

    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    run = launch.run_scenario(sc, precision)
    tmp = os.path.join(tempfile.gettempdir(), f"plan3d-validate-{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}.json")
    worker.main(["--plan", plan_file, "--steps", str(steps), "--out", tmp, "--backend", backend,
                 "--timeout-s", str(timeout), "--full-size", "--precision", run.training.precision])
    if os.environ.get("RANK") != "0":
        return 0
    try:
        with open(tmp) as fh:
            measured = json.load(fh)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    report = {"changed": launch.changes(sc, run),
              **launch.compare(run, measured, time_factor=time_factor, memory_tolerance=memory_tolerance)}
    return _report_verdict(report, sc, run, out, force, json_out)


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
    with spinner(quiet, f"Measuring GEMMs and all-reduce with {ranks} {backend} ranks..."):
        spec, text = launch.calibrate_local(base_spec, backend=backend, ranks=ranks, quick=backend == "gloo",
                                            name=name)
    if not quiet:
        for line in launch.calibration_summary(base_spec, spec):
            typer.echo(line, err=True)
    if out:
        from planner.io import write_atomic

        write_atomic(out, text, force)
        console().print(f"wrote {out}")
    else:
        typer.echo(text, nl=False)
