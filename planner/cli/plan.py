"""`plan3d estimate` and `plan3d search`: one plan's memory and time; the fastest plan that fits."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from planner.cli.common import (
    EXIT_DOES_NOT_FIT, EXIT_INFEASIBLE, MAX_GPUS, AttentionOpt, GroupOpt, CpOpt, DistributeSavedOpt, DistOptInstancesOpt, OptimizerOpt, KeptOutputsOpt, EpOpt, EtpOpt, Fp8ParamsOpt, GradBf16Opt, MoeA2aOverlapOpt, MoeDispatcherOpt, MoeImbalanceOpt, CudaGraphOpt, CompileOpt, CrossEntropyFusionOpt, Fp8RecipeOpt, OffloadOpt, RecomputeGroupOpt, RecomputeIntervalOpt, RecomputeLayersOpt, RecomputeModulesOpt,
    OptimizerDtypeOpt, ScheduleOpt, ForceOpt, FrameworkOpt, GlobalBatchOpt,
    HardwareOpt, JsonOpt, LayersOpt, MbsOpt, ModelOpt, OptGlobalBatchOpt, OptGpusOpt, OptHardwareOpt, OptModelOpt,
    OptSeqLenOpt, OverlapOpt, P2pOverlapOpt, PpOpt, PrecisionOpt, QuietOpt, RecomputeOpt, SeqLenOpt, SpOpt, TpOpt, TpOverlapOpt, VppOpt, ZeroOpt,
    app, console, handle_errors, spinner,
)
from planner.cli.inputs import job_from_options, moe_options, parse_layers_per_stage, scenario_from_options, state_options
from planner.errors import SpecError


@app.command()
@handle_errors
def estimate(
    plan_file: Annotated[Optional[str], typer.Argument(metavar="[PLAN]", help="Plan file written by `plan3d search --out`, or a launch file `plan3d check` reads (bash/Slurm script, Megatron-LM argument file, torchtitan TOML, DeepSpeed JSON config beside its script; with --hardware).")] = None,
    model: OptModelOpt = None, hardware: OptHardwareOpt = None, gpus: OptGpusOpt = None,
    global_batch: OptGlobalBatchOpt = None, seq_len: OptSeqLenOpt = None,
    precision: PrecisionOpt = None,
    attention: AttentionOpt = None, overlap_grad_reduce: OverlapOpt = None, framework: FrameworkOpt = None,
    tp_comm_overlap: TpOverlapOpt = None, overlap_p2p_comm: P2pOverlapOpt = None,
    tp: TpOpt = None, pp: PpOpt = None, vpp: VppOpt = None, cp: CpOpt = None,
    micro_batch_size: MbsOpt = None, recompute: RecomputeOpt = None, recompute_num_layers: RecomputeLayersOpt = None,
    recompute_interval: RecomputeIntervalOpt = None, recompute_group_layers: RecomputeGroupOpt = None,
    sequence_parallel: SpOpt = None,
    zero_stage: ZeroOpt = None, layers_per_stage: LayersOpt = None, microbatch_group_size: GroupOpt = None,
    ep: EpOpt = None, etp: EtpOpt = None, cpu_offload_layers: OffloadOpt = None, moe_dispatcher: MoeDispatcherOpt = None,
    moe_a2a_overlap: MoeA2aOverlapOpt = None, moe_load_imbalance: MoeImbalanceOpt = None,
    cuda_graph_modules: CudaGraphOpt = None,
    grad_reduce_in_bf16: GradBf16Opt = None, fp8_params: Fp8ParamsOpt = None, optimizer_dtype: OptimizerDtypeOpt = None,
    fp8_recipe: Fp8RecipeOpt = None, recompute_modules: RecomputeModulesOpt = None, torch_compile: CompileOpt = None,
    cross_entropy_fusion: CrossEntropyFusionOpt = None, pipeline_schedule: ScheduleOpt = None,
    distribute_saved_activations: DistributeSavedOpt = None,
    pipeline_kept_outputs: KeptOutputsOpt = None, dist_optimizer_instances: DistOptInstancesOpt = None,
    optimizer: OptimizerOpt = None,
    json_out: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line: the plan's step time, peak memory and "
                                                              "whether it fits.")] = False,
) -> None:
    """Memory per pipeline stage, FLOPs and step time of one plan. Exit 0 fits, 1 does not fit, 2 bad input."""
    from planner import render
    from planner.estimate import estimate as run_estimate

    notes: list[str] = []
    sc = scenario_from_options(plan_file, notes=notes, model=model, hardware=hardware, gpus=gpus, global_batch=global_batch,
                               seq_len=seq_len, precision=precision, attention=attention,
                               overlap_grad_reduce=overlap_grad_reduce, framework=framework,
                               tp_comm_overlap=tp_comm_overlap, overlap_p2p_comm=overlap_p2p_comm, tp=tp, pp=pp, vpp=vpp,
                               cp=cp, micro_batch_size=micro_batch_size, recompute=recompute,
                               recompute_num_layers=recompute_num_layers, recompute_interval=recompute_interval,
                               recompute_group_layers=recompute_group_layers,
                               sequence_parallel=sequence_parallel, zero_stage=zero_stage,
                               layers_per_stage=parse_layers_per_stage(layers_per_stage),
                               microbatch_group_size=microbatch_group_size, ep=ep, etp=etp,
                               cpu_offload_layers=cpu_offload_layers, pipeline_schedule=pipeline_schedule,
                               job_extra=moe_options(moe_dispatcher, moe_a2a_overlap, moe_load_imbalance, cuda_graph_modules)
                               | state_options(grad_reduce_in_bf16, fp8_params, optimizer_dtype, fp8_recipe, recompute_modules,
                                                                   torch_compile, cross_entropy_fusion,
                                                                   distribute_saved_activations,
                                                                   pipeline_kept_outputs, dist_optimizer_instances,
                                                                   optimizer))
    est = run_estimate(sc)
    if not (json_out or quiet):  # how the launch file was read (plan3d check's notes)
        for line in notes:
            typer.echo(f"note: {line}", err=True)
    if json_out:
        render.print_json(est.to_dict())
    elif quiet:
        render.print_estimate_quiet(est)
    else:
        render.print_estimate(console(), est)
    if not est.memory.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _check_pins(hw, tp: Optional[int], counts: list[int]) -> None:
    """Refuse a pinned tp whose groups would straddle NVLink domains at any of the GPU counts (``plan_problems``
    says the same for a plan)."""
    for n in counts if tp is not None else ():
        straddle = hw.for_job(n).tp_straddles(tp, n)
        if straddle:
            raise SpecError(f"--tp: {tp} {straddle}" + (f" (at {n} GPUs)" if len(counts) > 1 else ""))


@app.command()
@handle_errors
def search(
    model: ModelOpt, hardware: HardwareOpt,
    gpus: Annotated[str, typer.Option("--gpus", help="GPU count, a list (64,128,256) or a doubling range (64..4096).", rich_help_panel="Job")],
    global_batch: GlobalBatchOpt, seq_len: SeqLenOpt,
    precision: PrecisionOpt = None,
    attention: AttentionOpt = None, overlap_grad_reduce: OverlapOpt = None, framework: FrameworkOpt = None,
    tp_comm_overlap: TpOverlapOpt = None, overlap_p2p_comm: P2pOverlapOpt = None,
    tp: TpOpt = None, pp: PpOpt = None, vpp: VppOpt = None, cp: CpOpt = None,
    micro_batch_size: MbsOpt = None, recompute: RecomputeOpt = None, sequence_parallel: SpOpt = None,
    zero_stage: ZeroOpt = None, ep: EpOpt = None, etp: EtpOpt = None, cpu_offload_layers: OffloadOpt = None, moe_dispatcher: MoeDispatcherOpt = None,
    moe_a2a_overlap: MoeA2aOverlapOpt = None, moe_load_imbalance: MoeImbalanceOpt = None,
    cuda_graph_modules: CudaGraphOpt = None,
    grad_reduce_in_bf16: GradBf16Opt = None, fp8_params: Fp8ParamsOpt = None, optimizer_dtype: OptimizerDtypeOpt = None,
    fp8_recipe: Fp8RecipeOpt = None, recompute_modules: RecomputeModulesOpt = None, torch_compile: CompileOpt = None,
    cross_entropy_fusion: CrossEntropyFusionOpt = None, pipeline_schedule: ScheduleOpt = None,
    distribute_saved_activations: DistributeSavedOpt = None,
    pipeline_kept_outputs: KeptOutputsOpt = None, dist_optimizer_instances: DistOptInstancesOpt = None,
    optimizer: OptimizerOpt = None,
    top: Annotated[int, typer.Option("--top", min=0, max=50, help="Alternatives to show, each with another (tp, pp, cp).")] = 3,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Brute-force enumeration instead of the CP-SAT solver.")] = False,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the best plan to this plan file.")] = None,
    emit_formats: Annotated[Optional[str], typer.Option("--emit", help="Also write launch files: megatron,torchrun,slurm,deepspeed,torchtitan.")] = None,
    out_dir: Annotated[str, typer.Option("--out-dir", help="Folder for --emit files.")] = ".",
    report_dir: Annotated[Optional[str], typer.Option("--report", help="Also draw the report of the best plan (or the sweep) into this folder.")] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Find the fastest plan that fits: CP-SAT over TP x PP x DP x CP, micro-batches, schedule, recompute, SP, ZeRO."""
    from planner import render
    from planner.candidates import Pins, SearchSpace, pinned_problems, schedule_pin_problems, switch_options
    from planner.search import parse_gpu_counts

    try:
        counts = parse_gpu_counts(gpus, max_gpus=MAX_GPUS)
    except ValueError as err:
        raise SpecError(f"--gpus: {err}") from None
    if recompute is not None and recompute not in ("none", "selective", "full"):
        raise SpecError(f"--recompute: '{recompute}' is not one of none, selective, full")
    if tp == 1 and sequence_parallel:
        # Megatron-LM turns sequence parallelism off at tp 1, and so does the search (Pins.sp_ok)
        if not (quiet or json_out):
            typer.echo("note: --sequence-parallel with --tp 1: Megatron-LM turns it off at tp 1, and so does the search",
                       err=True)
    pins = Pins(tp=tp, pp=pp, cp=cp, vpp=vpp, micro_batch_size=micro_batch_size, recompute=recompute,
                sequence_parallel=sequence_parallel, zero_stage=zero_stage, ep=ep, etp=etp,
                pipeline_schedule=pipeline_schedule, cpu_offload_layers=cpu_offload_layers)
    spec_model, spec_hw, training = job_from_options(model, hardware, counts[0], global_batch, seq_len, precision,
                                                     attention, overlap_grad_reduce, framework, tp_comm_overlap,
                                                     overlap_p2p_comm,
                                                     moe_options(moe_dispatcher, moe_a2a_overlap, moe_load_imbalance, cuda_graph_modules)
                                                     | state_options(grad_reduce_in_bf16, fp8_params, optimizer_dtype, fp8_recipe, recompute_modules,
                                                                   torch_compile, cross_entropy_fusion,
                                                                   distribute_saved_activations,
                                                                   pipeline_kept_outputs, dist_optimizer_instances,
                                                                   optimizer))
    _check_pins(spec_hw, tp, counts)
    # a switch the user set neither way (--grad-reduce-in-bf16, --fp8-params or their --no- forms; no
    # --cross-entropy-fusion) is searched
    space = SearchSpace(pins=pins, **switch_options(training, grad_reduce_in_bf16, fp8_params, cross_entropy_fusion))
    schedule_problem = schedule_pin_problems(training.framework, pipeline_schedule)
    if schedule_problem:
        raise SpecError(schedule_problem)
    pin_problems = pinned_problems(training.framework, pins, training.optimizer_key)
    if training.dist_optimizer_instances > 1 and zero_stage is not None:  # the ZeRO rule of dist_optimizer_problems
        from planner.specs import Plan, dist_optimizer_problems

        n = training.dist_optimizer_instances  # dp = n: the divisibility rules hold, the pinned stage alone is asked
        probe = Plan.model_construct(tp=1, pp=1, dp=n, cp=1, ep=1, etp=None, zero_stage=zero_stage, micro_batch_size=1)
        pin_problems += [f"--zero-stage {zero_stage} with --dist-optimizer-instances {n}: {line}"
                         for line in dist_optimizer_problems(training, probe)]
    if pin_problems:
        raise SpecError(pin_problems)
    if not spec_model.is_moe and (ep not in (None, 1) or etp is not None):
        raise SpecError(f"{'--ep' if ep not in (None, 1) else '--etp'}: applies to mixture-of-experts models; "
                        f"{spec_model.name} is dense")
    if emit_formats:  # what the launch formats refuse whatever the plan: before the search, not after it
        from planner.emit import job_problems, parse_formats

        emit_problems = job_problems(spec_model, training, parse_formats(emit_formats))
        if emit_problems:
            raise SpecError(emit_problems)
    elif not (quiet or json_out):  # what `plan3d emit` of the plan file will refuse, said before the search
        for line in own_format_notes(spec_model, training):
            typer.echo(line, err=True)
    spin_quiet = quiet or json_out
    if len(counts) > 1:
        if out or emit_formats:
            raise SpecError("--out/--emit: give a single --gpus value to write plan or launch files")
        rows = _sweep(spec_model, spec_hw, training, space, counts, spin_quiet)
        if json_out:
            render.print_json(render.sweep_dict(rows))
        elif quiet:
            render.print_sweep_quiet(rows)
        else:
            render.print_sweep(console(), rows)
        fitting = [r["estimate"] for r in rows if r["estimate"]]
        if report_dir and fitting:
            from planner.cli.files import write_report_files

            write_report_files(fitting[-1].scenario, report_dir, gpus, None, spin_quiet, force)
        if not fitting:
            raise typer.Exit(EXIT_INFEASIBLE)
        return
    result = _run_search(spec_model, spec_hw, training, space, top, exhaustive, spin_quiet)
    if result["best"] is None:
        if json_out:  # the answer as data too: stdout is JSON whatever the outcome
            render.print_json({"plan": None, "solver": result["solver"], "closest": result.get("closest"),
                               "smallest_fitting_gpus": result.get("smallest_fitting_gpus"),
                               "message": result["message"]})
        for line in result["message"]:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(EXIT_INFEASIBLE)
    best = result["best"].scenario
    if out:
        from planner.io import write_atomic

        write_atomic(out, render.scenario_json(best), force)
    if emit_formats:
        from planner.cli.files import emit_files

        emit_files(best, emit_formats, out_dir, force, quiet=spin_quiet)
    if report_dir:
        from planner.cli.files import write_report_files

        write_report_files(best, report_dir, None, None, spin_quiet, force)
    if json_out:
        render.print_json(render.search_dict(result))
    elif quiet:
        render.print_search_quiet(result)
    else:
        render.print_search(console(), result)
        if out:
            console().print(f"Plan written to {out}")
        if moe_dispatcher is None:
            for line in dispatcher_notes(result["best"]):
                typer.echo(line, err=True)


#: How much faster the flex dispatcher must make the plan for :func:`dispatcher_notes` to say so.
DEEPEP_NOTE_GAIN = 0.05
#: NVLink domains wider than a DGX node's 8 GPUs (GB200/GB300 NVL72): where NVIDIA's MoE tuning guide puts HybridEP
FLEX_NOTE_HYBRIDEP_ABOVE = 8
FLEX_NOTE_LIBRARY = {"deepep": "DeepEP", "hybridep": "HybridEP (DeepEP's hybrid-ep branch)"}


def dispatcher_notes(est) -> list[str]:
    """A note when the best plan of a MoE search (``est``, its estimate), priced with the job's dispatcher (the
    all-to-all unless ``--moe-dispatcher`` says otherwise), would be faster by ``DEEPEP_NOTE_GAIN`` or more with
    Megatron's flex dispatcher: with HybridEP on a GPU whose NVLink domain is wider than 8 (NVL72 racks), else with
    DeepEP (``--moe-dispatcher hybridep`` / ``deepep``; not where the job already runs the flex dispatcher), where the
    framework runs it, its EP group is one the library takes (``plan_problems``) and the plan still fits with that
    library's buffer. The search does not choose the dispatcher: either is a library of its own to install (NVIDIA's
    MoE tuning guide: the all-to-all "for safe bring-up", DeepEP on H100/B200-style systems, HybridEP on NVL72;
    Megatron-Bridge docs training/moe-optimization.md), so it is said, with the step time, and left to the user."""
    from planner import frameworks
    from planner.cost import estimate_time
    from planner.memory import estimate_memory
    from planner.specs import FLEX_DISPATCHERS, plan_problems

    sc = est.scenario
    model, hw, training, plan = sc.model, sc.hardware, sc.training, sc.plan
    if not model.is_moe or plan.ep <= 1 or training.moe_token_dispatcher in FLEX_DISPATCHERS or \
            not frameworks.get(training.framework).runs_deepep:
        return []
    flex = "hybridep" if hw.job_nvlink_domain(training.num_gpus) > FLEX_NOTE_HYBRIDEP_ABOVE else "deepep"
    alt = training.model_copy(update={"moe_token_dispatcher": flex})
    if plan_problems(model, hw, alt, plan) or not estimate_memory(model, hw, alt, plan).fits:
        return []
    now, then = est.time.step_time_s, estimate_time(model, hw, alt, plan).step_time_s  # the search priced ``now``
    if then > (1 - DEEPEP_NOTE_GAIN) * now:
        return []
    return [f"note: with --moe-dispatcher {flex} (Megatron's flex dispatcher with {FLEX_NOTE_LIBRARY[flex]}, which "
            f"must be installed) this plan would take {then:.3f} s per step instead of {now:.3f} s "
            f"({then / now - 1:+.0%}); search again with it to let the plan change too"]


def own_format_notes(model, training) -> list[str]:
    """One note per refusal that ``plan3d emit`` without ``--format`` (the framework's own launch files,
    ``planner.emit.default_formats``) will give whatever plan the search finds (``planner.emit.job_problems``): a
    torchtitan search of a model torchtitan 0.3.0 ships no config for, say. The plan's memory and step time still
    stand (a model registered with torchtitan by hand runs under the same semantics); ``--emit`` refuses the same up
    front. None for a framework without launch files of its own (``planner.emit.has_launch_format``: ``torch``,
    plan3d validate's run)."""
    from planner.emit import default_formats, has_launch_format, job_refusals, parse_formats

    if not has_launch_format(training.framework):
        return []
    refusals = job_refusals(model, training, parse_formats(default_formats(training.framework)))
    if not refusals:
        return []
    return [f"note: `plan3d emit` will not write this job's {training.framework} launch files "
            f"({len(refusals)} reason{'s' if len(refusals) > 1 else ''}; the plan's memory and time stand):",
            *(f"  - {reason}" for _, reason in refusals)]


def _run_search(model, hw, training, space, top: int, exhaustive: bool, quiet: bool) -> dict:
    """Solve (or enumerate), then estimate the winners with the reference functions."""
    import time

    from planner import search as S
    from planner.estimate import estimate
    from planner.memory import estimate_memory
    from planner.specs import Scenario

    t0 = time.perf_counter()
    with spinner(quiet, f"Searching plans for {model.name} on {training.num_gpus} x {hw.name}...", animate=False):
        if exhaustive:
            best, _, n, tr = S.exhaustive_with_training(model, hw, training, space)
            res = S.SearchResult(best=best, status="EXHAUSTIVE" if best else "INFEASIBLE", candidates=n,
                                 training=tr if best else None)
        else:
            res = S.search(model, hw, training, space, top_k=top)
        wall = time.perf_counter() - t0

        def scen(p, tr):  # each plan with the job as it runs it (the switches the search picked)
            return estimate(Scenario(model=model, hardware=hw, training=tr, plan=p))
        out = {"best": scen(res.best, res.training) if res.best else None,
               "alternatives": [scen(p, tr) for p, tr in zip(res.alternatives, res.alternative_trainings)],
               "solver": {"status": res.status, "wall_s": wall, "candidates": res.candidates,
                          "cp_sat_s": None if exhaustive else res.solver_s}, "message": []}
        if res.best is None:
            msg = ["no plan fits"]
            if res.closest is not None:
                mem = estimate_memory(model, hw, training, res.closest)
                peak = mem.peak
                msg = [f"no plan fits {model.name} on {training.num_gpus} x {hw.name}: the closest, "
                       f"{res.closest.label()} (recompute {res.closest.recompute}, ZeRO-{res.closest.zero_stage}), "
                       f"has stage {peak.stage} needing {mem.peak_gib:.1f} GiB of {mem.usable_gib:.1f} GiB usable"]
                out["closest"] = {"plan": res.closest.model_dump(mode="json"), "stage": peak.stage,
                                  "peak_gib": mem.peak_gib, "usable_gib": mem.usable_gib}
            elif res.candidates == 0:
                from planner.candidates import pinned_layout_problems, pinned_split_problems

                pinned = any(v is not None for v in vars(space.pins).values())
                why = pinned_layout_problems(model, hw, training, space.pins) if pinned else []
                if pinned and not why:  # each split the pins leave may break a rule of its own
                    why = pinned_split_problems(model, hw, training, space.pins)
                n = training.dist_optimizer_instances
                if n > 1 and training.num_gpus % n:  # dp x cp divides the GPUs: no split can hold n copies
                    why.append(f"--dist-optimizer-instances {n} must divide dp x cp (Megatron-Core asserts it, "
                               f"parallel_state.py), and no dp x cp of {training.num_gpus} GPUs is a multiple of {n}")
                msg = [f"no legal plan for {training.num_gpus} GPUs with these pins: {'; '.join(why)}" if why else
                       f"no legal plan for {training.num_gpus} GPUs with these pins: check --tp/--pp/--cp/--vpp/"
                       "--ep/--etp/--micro-batch-size against the model's heads and layers, --gpus and --global-batch"
                       if pinned else
                       f"no legal plan for {training.num_gpus} GPUs under {training.framework}: no tp x pp x cp x dp "
                       f"split of the GPUs suits {model.name}'s heads and layers, the global batch and what "
                       f"{training.framework} runs; check --gpus and --global-batch (docs/search.md)"]
            smallest = S.smallest_fitting_gpus(model, hw, training, space)
            out["smallest_fitting_gpus"] = smallest.gpus if smallest else None
            limit = min(training.num_gpus * 4096, MAX_GPUS)
            msg.append(smallest.describe() if smallest else
                       f"no GPU count of the form {training.num_gpus} x 2^k up to {limit:,} has a legal plan that fits")
            out["message"] = msg
    return out


def _sweep(model, hw, training, space, counts: list[int], quiet: bool) -> list[dict]:
    from planner import search as S
    from planner.estimate import estimate
    from planner.specs import Scenario

    rows = []
    with spinner(quiet, "Sweeping GPU counts...", animate=False):
        for n in counts:
            tr = training.model_copy(update={"num_gpus": n})
            res = S.search(model, hw, tr, space)
            est = estimate(Scenario(model=model, hardware=hw, training=res.training, plan=res.best)) if res.best else None
            rows.append({"gpus": n, "estimate": est, "status": res.status})
    return rows
