"""Plan report: pipeline timeline, memory per stage, TP x PP map, scaling curve, validate comparison.

Each figure function computes its data from the pure estimate functions, draws it with matplotlib
(Agg backend), saves PNG and SVG, and returns the data it drew, so that tests can check that the
picture shows the estimate's numbers. ``write_report`` puts the figures and the plan's tables into
one self-contained HTML page (images inlined), readable offline.
"""

from __future__ import annotations

import base64
import html
import json
import os
from dataclasses import dataclass
from pathlib import Path

from planner.cost import estimate_time, stage_grad_accum_s, stage_times
from planner.memory import estimate_memory
from planner.presets import SpecError
from planner.schedules import rank_actions
from planner.specs import GIB, Scenario

COLORS = {"weights": "#4e79a7", "grads": "#59a14f", "optimizer": "#9c755f", "activations": "#f28e2b",
          "other": "#bab0ac", "forward": "#4e79a7", "backward": "#e15759"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_dir: Path, name: str) -> list[Path]:
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.svg"]
    fig.savefig(paths[0], dpi=110, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    _plt().close(fig)
    return paths


# --- 1. pipeline timeline ---------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    stage: int
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int
    start_s: float
    end_s: float


def simulate_timeline(sc: Scenario) -> list[Op]:
    """Start and end of every forward and backward of one step, from the cost model's per-micro-batch times.

    Each op waits for its stage and for its input: the same micro-batch and chunk on the previous
    stage (forward) or the next stage (backward), plus one P2P transfer. A backward is drawn with the framework's
    per-micro-batch passes over its parameters and gradients (``cost.stage_grad_accum_s``: DeepSpeed's and FSDP2's, on
    the compute stream; FSDP2's forward all-gather copy-out among them; 0 under Megatron-Core), as the step counts them.
    """
    plan = sc.resolved_plan()
    p, v, m = plan.pp, plan.vpp, plan.num_microbatches
    times = stage_times(sc.model, sc.hardware, sc.training, plan)
    accum = stage_grad_accum_s(sc.model, sc.hardware.for_job(sc.training.num_gpus), sc.training, plan)
    hop = [t.pp_comm / (2 * v) if p > 1 else 0.0 for t in times]  # one transfer
    fwd = [(t.fwd - t.pp_comm / 2) / v for t in times]
    bwd = [(t.bwd - t.pp_comm / 2 + a) / v for t, a in zip(times, accum)]
    orders = [rank_actions("megatron", p, v, m, r) for r in range(p)]
    pos, free = [0] * p, [0.0] * p
    done: dict[tuple, float] = {}
    ops: list[Op] = []
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] >= len(orders[r]):
                continue
            kind, mb, chunk = orders[r][pos[r]]
            virtual = chunk * p + r  # position along the whole pipeline of chunks
            if kind == "F":
                dep = ("F", mb, virtual - 1) if virtual > 0 else None
                dur = fwd[r]
            else:
                dep = ("B", mb, virtual + 1) if virtual < p * v - 1 else ("F", mb, virtual)
                dur = bwd[r]
            if dep is not None and dep not in done:
                continue
            ready = done[dep] + (hop[r] if dep is not None and dep[2] != virtual else 0.0) if dep else 0.0
            start = max(free[r], ready)
            free[r] = start + dur
            done[(kind, mb, virtual)] = free[r]
            ops.append(Op(r, kind, mb, chunk, start, free[r]))
            pos[r] += 1
            progressed = True
        if not progressed:  # cannot happen for a valid schedule
            raise RuntimeError("pipeline simulation deadlocked")
    return ops


def timeline_figure(sc: Scenario, out_dir: Path) -> dict:
    plt = _plt()
    ops = simulate_timeline(sc)
    p = sc.plan.pp
    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 1.8))
    makespan = max(op.end_s for op in ops)
    # one collection per stage and kind (a bar per action took ~25 s and 65,000 patches for 256 micro-batches x
    # vpp 4 x pp 8); the white edges that part neighbouring actions only where an action is wide enough to show
    # between them, else the edges alone fill the row
    spans: dict = {}
    for op in ops:
        spans.setdefault((op.stage, op.kind), []).append((op.start_s, op.end_s - op.start_s))
    widest_row = max(len(v) for v in spans.values())
    edge = 0.3 if widest_row <= 200 else 0.0
    for (stage, kind), xranges in spans.items():
        ax.broken_barh(xranges, (p - 1 - stage - 0.4, 0.8), facecolors=COLORS["forward" if kind == "F" else "backward"],
                       edgecolor="white", linewidth=edge)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {p - 1 - i}" for i in range(p)])
    ax.set_xlabel("seconds")
    kind = "interleaved 1F1B" if sc.plan.vpp > 1 else "1F1B"
    busy = sum(op.end_s - op.start_s for op in ops) / p
    step_s = estimate_time(sc.model, sc.hardware, sc.training, sc.plan).step_time_s
    # The timeline draws the forward/backward phase; the step adds what follows it (the gradient
    # reduction's exposed part, the optimizer), so the title names both.
    ax.set_title(f"{sc.model.name} {sc.plan.label()}: {kind}, {sc.resolved_plan().num_microbatches} micro-batches; "
                 f"idle {100 * (1 - busy / makespan):.1f}% of the {makespan:.2f} s pipeline phase "
                 f"(step {step_s:.2f} s with gradient sync and optimizer)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("forward", "backward")]
    ax.legend(handles, ["forward", "backward"], loc="upper right", fontsize=8)
    ax.set_xlim(0, makespan * 1.01)
    paths = _save(fig, out_dir, "timeline")
    return {"paths": paths, "ops": ops, "makespan_s": makespan}


# --- 2. memory per stage ------------------------------------------------------------------------

def memory_figure(sc: Scenario, out_dir: Path) -> dict:
    plt = _plt()
    mem = estimate_memory(sc.model, sc.hardware, sc.training, sc.plan)
    parts = ("weights", "grads", "optimizer", "activations", "other")
    data = {k: [getattr(s, f"{k}_bytes") / GIB for s in mem.stages] for k in parts}
    x = list(range(len(mem.stages)))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(x) + 3), 4.5))
    bottom = [0.0] * len(x)
    for k in parts:
        ax.bar(x, data[k], bottom=bottom, color=COLORS[k], label=k)
        bottom = [b + d for b, d in zip(bottom, data[k])]
    ax.axhline(mem.capacity_gib, color="black", linestyle="-", linewidth=1, label=f"capacity {mem.capacity_gib:.0f} GiB")
    ax.axhline(mem.usable_gib, color="red", linestyle="--", linewidth=1, label=f"usable {mem.usable_gib:.1f} GiB")
    ax.set_xticks(x)
    ax.set_xticklabels([str(i) for i in x])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{sc.model.name} {sc.plan.label()} on {sc.hardware.name}: peak stage {mem.peak.stage} "
                 f"{mem.peak_gib:.1f} GiB")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return {"paths": _save(fig, out_dir, "memory"), "stacks": data, "totals": bottom,
            "usable_gib": mem.usable_gib, "capacity_gib": mem.capacity_gib}


# --- 3. TP x PP map -----------------------------------------------------------------------------

def tp_pp_map(sc: Scenario) -> dict:
    """Best tokens/s for every (tp, pp) of the searched space, or why none fits."""
    import numpy as np

    from planner.candidates import SearchSpace
    from planner.search import build_tables

    tables = build_tables(sc.model, sc.hardware, sc.training, SearchSpace())
    tps = sorted({sh[0] for sh in tables.shapes})
    pps = sorted({sh[3].pp for sh in tables.shapes})
    fits = tables.legal & (tables.mem_kib.max(axis=-1) <= tables.usable_kib)
    tokens = sc.training.global_batch_size * sc.training.seq_len
    cells = {}
    for tp in tps:
        for pp in pps:
            idx = [i for i, sh in enumerate(tables.shapes) if sh[0] == tp and sh[3].pp == pp]
            if not idx:
                cells[(tp, pp)] = {"tokens_per_s": None, "reason": "illegal"}
                continue
            legal = tables.legal[idx]
            if not legal.any():
                cells[(tp, pp)] = {"tokens_per_s": None, "reason": "illegal"}
                continue
            ok = fits[idx]
            if not ok.any():
                worst = np.where(legal, tables.mem_kib[idx].max(axis=-1), np.iinfo(np.int64).max).min()
                cells[(tp, pp)] = {"tokens_per_s": None, "reason": f"OOM {worst * 1024 / GIB:.0f} GiB"}
                continue
            best_ns = np.where(ok, tables.time_ns[idx], np.iinfo(np.int64).max).min()
            cells[(tp, pp)] = {"tokens_per_s": tokens / (best_ns / 1e9), "reason": None}
    return {"tps": tps, "pps": pps, "cells": cells}


def map_figure(sc: Scenario, out_dir: Path) -> dict:
    plt = _plt()
    data = tp_pp_map(sc)
    tps, pps, cells = data["tps"], data["pps"], data["cells"]
    values = [[cells[(tp, pp)]["tokens_per_s"] or float("nan") for pp in pps] for tp in tps]
    fig, ax = plt.subplots(figsize=(1.1 * len(pps) + 3, 0.7 * len(tps) + 2))
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    for i, tp in enumerate(tps):
        for j, pp in enumerate(pps):
            c = cells[(tp, pp)]
            text = f"{c['tokens_per_s'] / 1e3:,.0f}k" if c["tokens_per_s"] else c["reason"]
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if c["tokens_per_s"] else "black")
    ax.set_xticks(range(len(pps)))
    ax.set_xticklabels([str(p) for p in pps])
    ax.set_yticks(range(len(tps)))
    ax.set_yticklabels([str(t) for t in tps])
    ax.set_xlabel("pipeline parallel (pp)")
    ax.set_ylabel("tensor parallel (tp)")
    ax.set_title(f"Best tokens/s per (tp, pp): {sc.model.name} on {sc.training.num_gpus} x {sc.hardware.name}")
    fig.colorbar(im, ax=ax, label="tokens/s")
    return {"paths": _save(fig, out_dir, "tp_pp_map"), **data}


# --- 4. scaling curve ---------------------------------------------------------------------------

def scaling_figure(rows: list[dict], out_dir: Path, title: str) -> dict:
    """rows: [{"gpus", "tokens_per_s", "mfu"}] (None where no plan fits)."""
    plt = _plt()
    pts = [r for r in rows if r["tokens_per_s"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["gpus"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", color=COLORS["forward"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s", color=COLORS["forward"])
    ax2 = ax.twinx()
    ax2.plot([r["gpus"] for r in pts], [100 * r["mfu"] for r in pts], "s--", color=COLORS["backward"])
    ax2.set_ylabel("MFU %", color=COLORS["backward"])
    ax.set_title(title)
    return {"paths": _save(fig, out_dir, "scaling"), "rows": rows}


def sweep_rows(sc: Scenario, counts: list[int]) -> list[dict]:
    from planner.search import search

    rows = []
    for n in counts:
        tr = sc.training.model_copy(update={"num_gpus": n})
        res = search(sc.model, sc.hardware, tr)
        if res.best is None:
            rows.append({"gpus": n, "tokens_per_s": None, "mfu": None, "plan": None})
            continue
        t = estimate_time(sc.model, sc.hardware, tr, res.best)
        rows.append({"gpus": n, "tokens_per_s": t.tokens_per_s, "mfu": t.mfu, "plan": res.best.label()})
    return rows


# --- 5. validate: predicted against measured -----------------------------------------------------

def validate_figure(report: dict, out_dir: Path) -> dict:
    plt = _plt()
    worst: dict = {}
    for row in report["memory"]:
        key = f"{row['metric'].replace('_bytes', '')} s{row['stage']}"
        if key not in worst or abs(row["rel_error"]) > abs(worst[key]["rel_error"]):
            worst[key] = row
    labels = list(worst) + ["step time"]
    pred = [worst[k]["predicted"] / 2**20 for k in worst] + [report["step_time"]["predicted_s"]]
    meas = [worst[k]["measured"] / 2**20 for k in worst] + [report["step_time"]["measured_s"]]
    ratio = [m / p if p else 0.0 for p, m in zip(pred, meas)]
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(labels) + 2), 4))
    ax.bar(range(len(labels)), ratio, color=[COLORS["activations"] if abs(r - 1) > 0.05 else COLORS["grads"]
                                             for r in ratio])
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("measured / predicted")
    ax.set_title("validate: measured against predicted (MiB for memory, s for time)")
    return {"paths": _save(fig, out_dir, "validate"), "labels": labels, "predicted": pred, "measured": meas}


# --- HTML ---------------------------------------------------------------------------------------

def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _table(rows: list[list], header: list[str]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def report_file_names(sweep: bool, validate: bool) -> list[str]:
    """The files :func:`write_report` writes into its folder."""
    names = ["timeline", "memory", "map"] + (["scaling"] if sweep else []) + (["validate"] if validate else [])
    return [f"{n}.{ext}" for n in names for ext in ("png", "svg")] + ["report.html"]


def write_report(sc: Scenario, out_dir: str | Path, sweep: list[int] | None = None,
                 validate_report: dict | None = None, force: bool = False) -> dict:
    """Every figure as PNG and SVG, and report.html with them inlined. Returns what each figure drew.

    Like the other outputs, it refuses to replace files without ``force`` (checked before anything is
    drawn) and writes atomically: everything is drawn into a hidden folder beside ``out_dir`` and then
    renamed into place, so an interrupted run leaves the earlier report as it was.
    """
    import shutil
    import tempfile

    from planner.io import make_folder, refuse_replacing

    out = make_folder(out_dir, "--out")
    if not force:
        refuse_replacing("--out", [out / n for n in report_file_names(bool(sweep), bool(validate_report))
                                   if (out / n).exists()])
    try:
        stage = Path(tempfile.mkdtemp(prefix=".plan3d-report-", dir=out))
    except OSError as err:
        raise SpecError(f"--out: cannot write in {out}: {err.strerror or err}") from None
    try:
        figures = _draw_report(sc, stage, sweep, validate_report)
        for path in sorted(stage.iterdir()):
            os.replace(path, out / path.name)
    except OSError as err:
        raise SpecError(f"--out: cannot write the report into {out}: {err.strerror or err}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    for fig in figures.values():
        if isinstance(fig, dict) and "paths" in fig:
            fig["paths"] = [out / p.name for p in fig["paths"]]
    figures["html"] = out / "report.html"
    return figures


def _draw_report(sc: Scenario, out: Path, sweep: list[int] | None, validate_report: dict | None) -> dict:
    from planner.estimate import estimate

    figures = {"timeline": timeline_figure(sc, out), "memory": memory_figure(sc, out), "map": map_figure(sc, out)}
    if sweep:
        figures["scaling"] = scaling_figure(sweep_rows(sc, sweep), out,
                                            f"{sc.model.name} on {sc.hardware.name}: best plan per GPU count")
    if validate_report:
        figures["validate"] = validate_figure(validate_report, out)
    est = estimate(sc).to_dict()
    mem_rows = [[s["stage"], s["layers"], *(f"{s[k]:.2f}" for k in ("weights_gib", "grads_gib", "optimizer_gib",
                                                                     "activations_gib", "other_gib", "total_gib"))]
                for s in est["memory"]["stages"]]
    time_rows = [[k, f"{v:.4f}", f"{100 * v / est['time']['step_time_s']:.1f}%"]
                 for k, v in est["time"]["breakdown"].items()]
    plan_rows = [[k, json.dumps(v)] for k, v in est["plan"].items()]
    sections = [
        f"<h1>plan3d report: {html.escape(sc.model.name)} {html.escape(sc.plan.label())}</h1>",
        f"<p>{sc.training.num_gpus} x {html.escape(sc.hardware.name)}, global batch {sc.training.global_batch_size}"
        f" x {sc.training.seq_len} tokens. Step {est['time']['step_time_s']:.3f} s, "
        f"{est['time']['tokens_per_s']:,.0f} tokens/s, MFU {100 * est['time']['mfu']:.1f}%, peak memory "
        f"{est['memory']['peak_gib']:.1f} of {est['memory']['usable_gib']:.1f} GiB usable.</p>",
        "<h2>Plan</h2>" + _table(plan_rows, ["knob", "value"]),
        "<h2>Pipeline timeline</h2>" + _img(figures["timeline"]["paths"][0]),
        "<h2>Memory per stage</h2>" + _img(figures["memory"]["paths"][0]) +
        _table(mem_rows, ["stage", "layers", "weights", "grads", "optimizer", "activations", "other", "total GiB"]),
        "<h2>Step time</h2>" + _table(time_rows, ["term", "seconds", "share"]),
        "<h2>TP x PP map</h2>" + _img(figures["map"]["paths"][0]),
    ]
    if "scaling" in figures:
        rows = [[r["gpus"], r["plan"] or "no plan fits", f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
                 f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"] for r in figures["scaling"]["rows"]]
        sections.append("<h2>Scaling</h2>" + _img(figures["scaling"]["paths"][0]) +
                        _table(rows, ["GPUs", "best plan", "tokens/s", "MFU"]))
    if "validate" in figures:
        v = figures["validate"]
        rows = [[lab, f"{p:.4f}", f"{m:.4f}"] for lab, p, m in zip(v["labels"], v["predicted"], v["measured"])]
        sections.append("<h2>validate: predicted against measured</h2>" + _img(v["paths"][0]) +
                        _table(rows, ["metric", "predicted", "measured"]))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}"
             "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>plan3d report</title><style>{style}</style>"
            f"</head><body>{''.join(sections)}</body></html>")
    (out / "report.html").write_text(page, encoding="utf-8")
    figures["html"] = out / "report.html"
    return figures
