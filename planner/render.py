"""rich tables and JSON output. No arithmetic here beyond formatting."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.table import Table

from planner.specs import HardwareSpec, ModelSpec, pipeline_kept_mode

#: Below this console width the tables drop or merge columns (the compact layout).
COMPACT_COLUMNS = 100


def compact(con) -> bool:
    return con.width < COMPACT_COLUMNS


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def _name_column(t: Table, specs) -> None:
    """The name column of a listing, never cut short: the name is what ``--model`` / ``--hardware`` take."""
    t.add_column("name", justify="left", no_wrap=True, min_width=max((len(s.name) for s in specs), default=4))


def _listing(title: str, specs, columns: dict, narrow: bool, keep_narrow: tuple[str, ...]) -> Table:
    """A listing of specs: the name, then ``columns`` (header -> cell of a spec), each folded over lines rather
    than cut short; in a narrow terminal (:func:`compact`) only the columns ``keep_narrow`` names."""
    t = Table(title=title)
    _name_column(t, specs)
    shown = {k: f for k, f in columns.items() if not narrow or k in keep_narrow}
    for col in shown:
        t.add_column(col, justify="left" if col in ("act", "norm") else "right", overflow="fold")
    for s in specs:
        t.add_row(s.name, *(f(s) for f in shown.values()))
    return t


def models_table(specs: list[ModelSpec], narrow: bool = False) -> Table:
    """The bundled model presets; narrow: name, parameters, layers, hidden size and experts only."""
    columns = {
        "params": lambda s: _billions(s.num_params), "active": lambda s: _billions(s.num_active_params),
        "layers": lambda s: str(s.num_layers), "hidden": lambda s: str(s.hidden_size),
        "heads": lambda s: str(s.num_attention_heads), "kv heads": lambda s: str(s.kv_heads),
        "ffn": lambda s: str(s.ffn_size),
        "experts": lambda s: f"{s.top_k}/{s.num_experts} x {s.moe_ffn_size}" if s.is_moe else "-",
        "vocab": lambda s: str(s.vocab_size), "act": lambda s: s.activation, "norm": lambda s: s.norm}
    return _listing("Model presets", specs, columns, narrow, ("params", "active", "layers", "hidden", "experts"))


def hardware_table(specs: list[HardwareSpec], narrow: bool = False) -> Table:
    """The bundled hardware profiles; narrow: name, usable memory, bf16/fp8 rates, GPUs per node, NVLink domain."""
    columns = {
        "memory GiB": lambda s: f"{s.gpu_memory_gib:g}", "usable GiB": lambda s: f"{s.usable_memory_gib:.1f}",
        "bf16 TFLOP/s": lambda s: f"{s.peak_bf16_tflops:g}",
        "fp8 TFLOP/s": lambda s: f"{s.peak_fp8_tflops:g}" if s.peak_fp8_tflops else "-",
        "fp4 TFLOP/s": lambda s: f"{s.peak_fp4_tflops:g}" if s.peak_fp4_tflops else "-",
        "GPUs/node": lambda s: str(s.gpus_per_node),
        "NVLink domain (segment)": lambda s: str(s.nvlink_domain) + (f" ({s.nvlink_domain_segment})"
                                                                     if s.nvlink_domain_segment else ""),
        "intra GB/s": lambda s: f"{s.intra_node_bandwidth_gbps:g}",
        "inter GB/s": lambda s: f"{s.inter_node_bandwidth_gbps:g}"}
    return _listing("Hardware profiles", specs, columns, narrow,
                    ("usable GiB", "bf16 TFLOP/s", "fp8 TFLOP/s", "GPUs/node", "NVLink domain (segment)"))


def spec_dict(spec: ModelSpec | HardwareSpec) -> dict:
    """The spec's fields and its derived figures (`plan3d show --json`; a file of it loads back: presets.build_spec)."""
    from planner.presets import derived_fields

    return spec.model_dump() | derived_fields(spec)


def spec_table(spec: ModelSpec | HardwareSpec) -> Table:
    kind = "Model" if isinstance(spec, ModelSpec) else "Hardware"
    t = Table(title=f"{kind}: {spec.name}")
    t.add_column("field", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    data = spec_dict(spec)
    derived = set(data) - set(spec.model_dump())
    for key, value in data.items():
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else \
            f"{value:.6g}" if isinstance(value, float) else str(value)  # 73.62, not 73.61999999999999
        t.add_row(f"[bold]{key}[/bold] (derived)" if key in derived else key, shown)
    return t


def plan_line(plan: dict) -> str:
    extras = [f"vpp {plan['vpp']}"] if plan["vpp"] > 1 else []
    extras += [f"cp {plan['cp']}"] if plan["cp"] > 1 else []
    extras += [f"ep {plan['ep']}"] if plan.get("ep", 1) > 1 else []
    extras += [f"etp {plan['etp']}"] if plan.get("etp") not in (None, plan["tp"]) else []
    extras += ["sequence parallel"] if plan["sequence_parallel"] else []
    extras += [f"ZeRO-{plan['zero_stage']}"] if plan["zero_stage"] else []
    rc = recompute_text(plan["recompute"], plan.get("recompute_num_layers"), plan.get("recompute_interval"),
                        plan.get("recompute_group_layers"))
    return (f"TP {plan['tp']} x PP {plan['pp']} x DP {plan['dp']}" + "".join(f", {x}" for x in extras) +
            f"; micro-batch {plan['micro_batch_size']} x {plan['num_microbatches']}; recompute {rc}")


def memory_table(mem: dict, title: str = "Memory per GPU of each pipeline stage (GiB)", narrow: bool = False) -> Table:
    """Stages as rows (``MemoryEstimate.to_dict``); ``narrow`` (under COMPACT_COLUMNS) merges weights, grads and
    optimizer into "states". Where the framework's reserved peak is modelled (torchtitan) a "reserved" column follows
    the allocated total, and the share of usable memory is of the reserved peak, the figure each stage's ``fits`` (the
    verdict of ``MemoryEstimate.fits``, in whole KiB) judges."""
    t = Table(title=title)
    reserved = any("reserved_gib" in s for s in mem["stages"])
    peak_cols = ("total", "reserved") if reserved else ("total",)
    cols = (("stage", "layers", "states", "activations", "other", *peak_cols, "fits") if narrow else
            ("stage", "layers", "weights", "grads", "optimizer", "activations", "other", *peak_cols, "of usable",
             "fits"))
    for col in cols:
        t.add_column(col, justify="right", overflow="fold")
    usable = mem["usable_gib"]
    for s in mem["stages"]:
        peak = s.get("reserved_gib", s["total_gib"])
        states = ((f"{s['weights_gib'] + s['grads_gib'] + s['optimizer_gib']:.2f}",) if narrow else
                  tuple(f"{s[k]:.2f}" for k in ("weights_gib", "grads_gib", "optimizer_gib")))
        share = () if narrow else (f"{100 * peak / usable:.0f}%",)
        totals = (f"[bold]{s['total_gib']:.2f}[/bold]",) + ((f"[bold]{peak:.2f}[/bold]",) if reserved else ())
        t.add_row(str(s["stage"]), str(s["layers"]), *states,
                  *(f"{s[k]:.2f}" for k in ("activations_gib", "other_gib")), *totals, *share,
                  "[green]yes[/green]" if s["fits"] else "[red]NO[/red]")
    t.caption = (f"capacity {mem['capacity_gib']:.1f} GiB, usable {usable:.1f} GiB "
                 f"(after CUDA context, NCCL buffers and fragmentation headroom); peak stage {mem['peak_stage']}")
    return t


def print_estimate(con, est) -> None:
    """The table view of `plan3d estimate`."""
    d = est.to_dict()
    sc = est.scenario
    con.print(f"[bold]{sc.model.name}[/bold] on {sc.training.num_gpus} x {sc.hardware.name}, "
              f"global batch {sc.training.global_batch_size} x {sc.training.seq_len} tokens, {sc.training.precision}")
    con.print(f"Plan: {plan_line(d['plan'])}")
    con.print(memory_table(d["memory"], narrow=compact(con)))
    verdict = "[green]fits[/green]" if d["memory"]["fits"] else "[red]does NOT fit[/red]"
    con.print(f"Peak {d['memory']['peak_gib']:.2f} GiB of {d['memory']['usable_gib']:.2f} GiB usable: {verdict}")
    con.print(f"Peak on {stage_where(sc.plan, d['memory']['peak_stage'])}, in Megatron's rank order tp-cp-dp-pp")
    from planner.layout import placement_line

    domain = sc.hardware.job_nvlink_domain(sc.training.num_gpus)
    line = placement_line(sc.plan, domain)
    if domain != sc.hardware.nvlink_domain:
        line += (f" [{sc.training.num_gpus} GPUs fill {domain} of each {sc.hardware.nvlink_domain}-GPU domain: "
                 "nvlink_domain_segment]")
    con.print(line, highlight=False, markup=False)
    f = d["flops"]
    con.print(f"Model FLOPs per step {f['model_flops_per_step']:.3e}; hardware FLOPs (with recompute) "
              f"{f['hardware_flops_per_step']:.3e}")
    if "time" in d:
        print_time(con, d["time"])
        from planner.sanity import mfu_note

        note = mfu_note(sc.hardware.name, sc.training.precision, d["time"]["mfu"])
        if note:
            con.print(note, highlight=False, markup=False)


def print_time(con, time: dict) -> None:
    t = Table(title="Step time")
    t.add_column("term", overflow="fold")
    t.add_column("seconds", justify="right", overflow="fold")
    t.add_column("share", justify="right", overflow="fold")
    step = time["step_time_s"]
    for k, v in time["breakdown"].items():
        t.add_row(k, f"{v:.4f}", f"{100 * v / step:.1f}%" if step else "-")
    t.add_row("[bold]step[/bold]", f"[bold]{step:.4f}[/bold]", "100%")
    con.print(t)
    con.print(f"{time['tokens_per_s']:,.0f} tokens/s, {time['tflops_per_gpu']:.1f} TFLOP/s per GPU, "
              f"MFU {100 * time['mfu']:.1f}%, HFU {100 * time['hfu']:.1f}%")
    if "range" in time:
        r = time["range"]
        con.print(f"Step time range {r['low_s']:.4g}-{r['high_s']:.4g} s (sources {r['sources_s'][0]:.4g}-"
                  f"{r['sources_s'][1]:.4g} s, {'MoE ' if r.get('calibration_set') == 'moe' else ''}calibration runs "
                  f"{r['calibration_s'][0]:.4g}-{r['calibration_s'][1]:.4g} s)",
                  highlight=False)


def scenario_json(sc) -> str:
    """A plan file: the four specs, with the derived plan fields filled in."""
    return json.dumps({"model": sc.model.model_dump(), "hardware": sc.hardware.model_dump(),
                       "training": sc.training.model_dump(),
                       "plan": sc.resolved_plan().model_dump() | {"layers_per_stage": list(sc.stage_layers)}},
                      indent=2) + "\n"


def loses_on(best, alt) -> dict:
    """The breakdown term where ``alt`` spends the most time more than ``best``."""
    b, a = best.time.breakdown, alt.time.breakdown
    term = max(a, key=lambda k: a[k] - b[k])
    return {"term": term, "seconds": a[term] - b[term]}


def lead_within_range(best, alt) -> bool:
    """Whether ``best``'s lead over ``alt`` is inside the prediction's uncertainty (planner/uncertainty.py)."""
    from planner.uncertainty import lead_within_range as within

    return within(best.time.breakdown, best.time.step_time_s, alt.time.breakdown, alt.time.step_time_s)


def search_dict(result: dict) -> dict:
    """The best plan and its alternatives, each with the job as it runs it (``training``: the inputs with the
    switches the search picked, ``grad_reduce_in_bf16`` and ``fp8_params``)."""
    best = result["best"]

    def job(est) -> dict:
        return {"training": est.scenario.training.model_dump(mode="json")}
    return best.to_dict() | job(best) | {
        "alternatives": [alt.to_dict() | job(alt) | {"loses_on": loses_on(best, alt),
                                                     "lead_within_range": lead_within_range(best, alt)}
                         for alt in result["alternatives"]],
        "solver": result["solver"],
    }


def recompute_text(recompute: str, num_layers: int | None, interval: int | None = None,
                   group: int | None = None) -> str:
    """A plan's recompute, with Megatron's block method's layer count (``Plan.recompute_num_layers``),
    torchtitan's per-layer interval (``Plan.recompute_interval``) or Megatron's uniform groups
    (``Plan.recompute_group_layers``) where set."""
    return recompute + (f" (first {num_layers} layers of each chunk)" if num_layers is not None else "") + \
        (f" (one layer in every {interval})" if interval is not None else "") + \
        (f" (in groups of {group} layers)" if group is not None else "")


def _plan_cell(est) -> str:
    p = est.scenario.plan
    extra = [recompute_text(p.recompute, p.recompute_num_layers, p.recompute_interval, p.recompute_group_layers)] if p.recompute != "none" else []
    extra += ["SP"] if p.sequence_parallel else []
    extra += [f"ZeRO-{p.zero_stage}"] if p.zero_stage else []
    extra += ["bf16 grads"] if est.scenario.training.grad_reduce_in_bf16 else []
    extra += ["distributed checkpoints"] if est.scenario.training.distribute_saved_activations else []
    kept = pipeline_kept_mode(est.scenario.training, p)
    extra += [f"pipeline keeps {kept} stage outputs" if kept == "all" else "pipeline keeps the loss stage's outputs"] \
        if kept else []
    extra += ["fp8 params"] if est.scenario.training.fp8_params else []
    extra += ["TE fused loss"] if est.scenario.training.cross_entropy_fusion == "te" else []
    extra += ["a2a overlap"] if est.scenario.training.moe_a2a_overlap else []
    extra += {"bf16": ["bf16 Adam states"], "bf16-apex": ["bf16 Apex Adam states"]}.get(
        est.scenario.training.optimizer_dtype, [])
    extra += [est.scenario.training.optimizer] if est.scenario.training.optimizer != "adam" else []
    # a plan file keeps every split, even ones (a search writes [32] for pp 1): only an uneven one is news
    extra += ["uneven " + "/".join(map(str, p.layers_per_stage))] if p.layers_per_stage and \
        len(set(p.layers_per_stage)) > 1 else []
    return est.scenario.plan.label() + (f" ({', '.join(extra)})" if extra else "")


def print_search(con, result: dict) -> None:
    best = result["best"]
    sc = best.scenario
    con.print(f"[bold]{sc.model.name}[/bold] on {sc.training.num_gpus} x {sc.hardware.name}, global batch "
              f"{sc.training.global_batch_size} x {sc.training.seq_len} tokens, {sc.training.precision}")
    t = Table(title="Best plan and alternatives")
    narrow = compact(con)
    cols = ("#", "plan", "step s", "MFU", "peak GiB", "loses on") if narrow else (
        "#", "plan", "step s", "tokens/s", "MFU", "peak GiB", "loses on")
    for col in cols:
        t.add_column(col, justify="left" if col in ("plan", "loses on") else "right", overflow="fold")
    rows = [(best, "")] + [(a, "{term} +{seconds:.3f} s".format(**loses_on(best, a))
                            + (" (within range)" if lead_within_range(best, a) else ""))
                           for a in result["alternatives"]]
    for i, (est, why) in enumerate(rows):
        tokens = () if narrow else (f"{est.time.tokens_per_s:,.0f}",)
        peak = f"{est.memory.peak_gib:.1f}" + ("" if narrow else f" (stage {est.memory.peak.stage})")
        t.add_row("best" if i == 0 else str(i), _plan_cell(est), f"{est.time.step_time_s:.3f}", *tokens,
                  f"{100 * est.time.mfu:.1f}%", peak, why)
    con.print(t)
    s = result["solver"]
    split = "" if s.get("cp_sat_s") is None else \
        f" ({s['cp_sat_s']:.2f} s of it CP-SAT; the rest mostly builds the cost and memory tables)"
    con.print(f"Solver: {s['status']} over {s['candidates']:,} legal combinations in {s['wall_s']:.2f} s{split}")
    if any(lead_within_range(best, a) for a in result["alternatives"]):
        con.print("(within range): the best plan's lead is inside the uncertainty of the terms where the two differ "
                  "(docs/cost-model.md, Uncertainty); measure both before choosing")
    print_estimate(con, best)


def _quiet_line(est) -> str:
    return (f"{_plan_cell(est)}: step {est.time.step_time_s:.3f} s, {est.time.tokens_per_s:,.0f} tokens/s, "
            f"MFU {100 * est.time.mfu:.1f}%, peak {est.memory.peak_gib:.1f} GiB (stage {est.memory.peak.stage})")


def print_search_quiet(result: dict) -> None:
    """`search --quiet`: the best plan on one line."""
    sys.stdout.write(f"best: {_quiet_line(result['best'])}\n")


def print_estimate_quiet(est) -> None:
    """`estimate --quiet`: the plan on one line, with whether it fits (the exit code says the same)."""
    verdict = "fits" if est.memory.fits else "does NOT fit"
    sys.stdout.write(f"{_quiet_line(est)}, usable {est.memory.usable_gib:.1f} GiB: {verdict}\n")


def print_sweep_quiet(rows: list[dict]) -> None:
    """`search --quiet` over several GPU counts: one line per count."""
    for r in rows:
        sys.stdout.write(f"{r['gpus']} GPUs: {_quiet_line(r['estimate']) if r['estimate'] else 'no plan fits'}\n")
    smallest = sweep_dict(rows)["smallest_fitting_gpus"]
    sys.stdout.write(f"Smallest GPU count in the sweep that fits: {smallest}\n" if smallest
                     else "No GPU count in the sweep fits\n")


def sweep_dict(rows: list[dict]) -> dict:
    fitting = [r["gpus"] for r in rows if r["estimate"]]
    return {"sweep": [{"gpus": r["gpus"], "status": r["status"], "fits": r["estimate"] is not None,
                       **(r["estimate"].to_dict() if r["estimate"] else {})} for r in rows],
            "smallest_fitting_gpus": min(fitting) if fitting else None}


def print_sweep(con, rows: list[dict]) -> None:
    t = Table(title="Best plan per GPU count")
    for col in ("GPUs", "plan", "step s", "tokens/s", "MFU", "peak GiB"):
        t.add_column(col, justify="left" if col == "plan" else "right", overflow="fold")
    for r in rows:
        est = r["estimate"]
        if est is None:
            t.add_row(str(r["gpus"]), "[red]no plan fits[/red]", "-", "-", "-", "-")
        else:
            t.add_row(str(r["gpus"]), _plan_cell(est), f"{est.time.step_time_s:.3f}", f"{est.time.tokens_per_s:,.0f}",
                      f"{100 * est.time.mfu:.1f}%", f"{est.memory.peak_gib:.1f}")
    con.print(t)
    smallest = sweep_dict(rows)["smallest_fitting_gpus"]
    con.print(f"Smallest GPU count in the sweep that fits: {smallest}" if smallest
              else "[red]No GPU count in the sweep fits[/red]")


def stage_where(plan, stage: int) -> str:
    """``stage 1 (global ranks 16-31)`` in Megatron's rank order tp-cp-dp-pp (planner/layout.py)."""
    from planner import layout

    return f"stage {stage} (global ranks {layout.ranges_text(layout.stage_ranks(plan, stage))})"


def _verdict(r) -> tuple:
    """(memory estimate, peak stage, GiB short) of a check result (``CheckResult.memory``: computed once)."""
    mem = r.memory()
    return mem, mem.peak, mem.peak_gib - mem.usable_gib


def print_check(con, results) -> None:
    """One row per file, the file name in full (folded over lines when long, never cut short)."""
    from rich.markup import escape

    t = Table(title="plan3d check")
    narrow = compact(con)
    cols = ("file", "plan", "peak stage", "peak GiB", "verdict") if narrow else (
        "file", "plan", "peak stage", "peak GiB", "usable GiB", "verdict")
    for col in cols:
        t.add_column(col, justify="left" if col in ("file", "plan", "verdict") else "right",
                     overflow="fold", min_width=12 if col == "file" else None)
    for r in results:
        if r.errors:
            t.add_row(escape(r.label), "-", "-", "-", *(() if narrow else ("-",)), "[red]invalid[/red]")
            continue
        mem, peak, short = _verdict(r)
        verdict = "[green]fits[/green]" if mem.fits else f"[red]short by {short:.2f} GiB[/red]"
        t.add_row(escape(r.label), escape(f"{r.scenario.model.name} {r.scenario.plan.label()}"), str(peak.stage),
                  f"{mem.peak_gib:.2f}", *(() if narrow else (f"{mem.usable_gib:.2f}",)), verdict)
    con.print(t)
    for r in results:
        for line in r.errors:
            con.print(f"[red]error[/red]: {escape(line)}", markup=True, highlight=False)
        for note in r.notes:
            con.print(f"note: {r.label}: {note}", markup=False, highlight=False)
        if not r.errors:
            mem, peak, short = _verdict(r)
            con.print(memory_table(mem.to_dict(), title=escape(f"{r.label}: memory per GPU of each stage (GiB)"),
                                   narrow=narrow))
            if not mem.fits:
                con.print(f"{r.label}: {stage_where(r.scenario.plan, peak.stage)} needs {mem.peak_gib:.2f} GiB of "
                          f"{mem.usable_gib:.2f} GiB usable, short by {short:.2f} GiB", highlight=False)


def print_github(results) -> None:
    """GitHub Actions workflow commands: ``::error file=F,line=L::message`` per problem."""
    for r in results:
        if r.errors:
            for line in r.errors:
                sys.stdout.write(f"::error file={r.path},line={r.line}::{line}\n")
            continue
        mem, peak, short = _verdict(r)
        label = f"{r.scenario.model.name} {r.scenario.plan.label()}" + (f" [{r.branch}]" if r.branch else "")
        if mem.fits:
            sys.stdout.write(f"::notice file={r.path},line={r.line}::{label} fits: peak {mem.peak_gib:.2f} GiB "
                             f"(stage {peak.stage}) of {mem.usable_gib:.2f} GiB usable\n")
        else:
            where = stage_where(r.scenario.plan, peak.stage)
            sys.stdout.write(f"::error file={r.path},line={r.line}::{label}: {where} needs {mem.peak_gib:.2f} GiB "
                             f"of {mem.usable_gib:.2f} GiB usable (short by {short:.2f} GiB)\n")


def print_validate(con, sc, run, report: dict) -> None:
    """Predicted against measured, per metric, for a validate report."""
    p = run.plan
    con.print(f"[bold]validate[/bold] {sc.model.name} {sc.plan.label()}: ran {run.model.name} "
              f"(tp {p.tp}, pp {p.pp}, vpp {p.vpp}, dp {p.dp}, "
              f"recompute {recompute_text(p.recompute, p.recompute_num_layers, p.recompute_interval, p.recompute_group_layers)}, "
              f"SP {'on' if p.sequence_parallel else 'off'}, ZeRO-{p.zero_stage}) on {run.training.num_gpus} ranks")
    t = Table(title="Predicted against measured")
    for col in ("metric", "stage", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col == "metric" else "right", overflow="fold")
    worst: dict = {}
    for row in report["memory"]:
        key = (row["metric"], row["stage"])
        if key not in worst or abs(row["rel_error"]) > abs(worst[key]["rel_error"]):
            worst[key] = row
    for (metric, stage), row in sorted(worst.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        t.add_row(metric.replace("_bytes", " (MiB)"), str(stage), f"{row['predicted'] / 2**20:.3f}",
                  f"{row['measured'] / 2**20:.3f}", f"{100 * row['rel_error']:+.2f}%")
    st = report["step_time"]
    t.add_row("step time (s)", "all", f"{st['predicted_s']:.4f}", f"{st['measured_s']:.4f}", f"{100 * st['rel_error']:+.1f}%")
    if "reference" in report:
        ref = report["reference"]
        t.add_row("first loss vs single process", "-", f"{ref['reference_loss']:.6f}", f"{ref['first_loss']:.6f}",
                  f"{100 * ref['rel_error']:+.4f}%")
    con.print(t)
    if report.get("losses"):
        con.print("loss per step: " + ", ".join(f"{x:.4f}" for x in report["losses"]))
    for name, b in report.get("microbenchmarks", {}).items():
        con.print(f"{name}: {b['bytes'] / 2**20:.2f} MiB over {b['ranks']} ranks in {1e3 * b['seconds']:.2f} ms, "
                  f"bus bandwidth {b['busbw_gbps']:.3f} GB/s")
    fits = "measured memory fits" if report["fits"] else "measured memory does NOT fit"
    con.print(f"{fits}; largest memory error {100 * report['memory_max_abs_error']:.2f}%", highlight=False)
