"""Start the validate run, watch it, and compare what it measured with the prediction (no torch here).

Outside a torchrun job, `plan3d validate` runs a *miniature* of the plan on this machine: the same
tp, pp, vpp, schedule, recompute and sequence parallelism, the same heavier and lighter stages of
an uneven pipeline, data parallelism capped so that all
ranks fit ``max_ranks`` local processes, and model, batch and sequence sizes scaled down. The
prediction is recomputed for that miniature on the local hardware profile (``cpu-gloo`` by default),
in fp32 and with torch's DTensor sequence parallelism, which is what the run does.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from planner.memory import (estimate_memory, param_bytes, stage_params_per_rank, stage_saved_bytes,
                            state_bytes_per_param)
from planner.presets import SpecError, load_hardware
from planner.specs import HardwareSpec, ModelSpec, Plan, Scenario, TrainingSpec

MEMORY_TOLERANCE = 0.05


def _round_to(x: float, step: int) -> int:
    return max(step, int(round(x / step)) * step)


def miniature_stage_layers(plan: Plan, num_layers: int, per_chunk: int) -> tuple[int, ...] | None:
    """Layers per stage of the miniature: ``per_chunk`` per virtual stage, and for an uneven plan
    one chunk-layer more (or fewer) on each stage that holds more (or fewer) than the even split.

    The miniature keeps which stages are heavier or lighter, not the exact ratio; the memory check
    is exact per rank, so one layer of difference is enough to tell whether the estimator follows
    each stage's own layer count. ``None`` for an even plan.
    """
    counts = plan.layers_per_stage
    if counts is None or len(set(counts)) == 1:
        return None
    v, even = plan.vpp, num_layers / plan.pp
    base = per_chunk * v + (v if per_chunk == 1 and min(counts) < even else 0)
    return tuple(base + v * ((n > even) - (n < even)) for n in counts)


def miniature(sc: Scenario, max_ranks: int = 8, scale: float = 1.0, hardware: HardwareSpec | None = None) -> Scenario:
    """A small copy of the plan that runs on ``max_ranks`` local processes (module docstring)."""
    p, m = sc.plan, sc.model
    tp, pp, vpp = p.tp, p.pp, p.vpp
    if tp * pp > max_ranks:
        raise SpecError(f"validate: tp({tp}) * pp({pp}) = {tp * pp} ranks exceed the {max_ranks} local processes; "
                        "run `plan3d validate` inside torchrun or Slurm (`plan3d emit --format slurm`) instead")
    dp = max(1, min(p.dp, max_ranks // (tp * pp)))
    ratio = min(m.num_attention_heads // m.kv_heads, 4)  # GQA kept (up to 4 query heads per KV head)
    kv = tp * max(1, -(-4 // (tp * ratio))) if ratio > 1 else tp * max(1, -(-4 // tp))
    heads = kv * ratio
    head_dim = max(8, _round_to(16 * scale, 8))
    hidden = heads * head_dim
    ffn = _round_to(hidden * m.ffn_size / m.hidden_size, 8 * tp * dp)
    seq = _round_to(128 * scale, 8 * tp)
    per_chunk = 2 if pp * vpp <= 4 else 1
    stage_layers = miniature_stage_layers(p, m.num_layers, per_chunk)
    model = ModelSpec(
        name=f"{m.name}-miniature", num_layers=sum(stage_layers) if stage_layers else pp * vpp * per_chunk,
        hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=kv, ffn_hidden_size=ffn, vocab_size=_round_to(512, 128 * tp * dp), max_seq_len=seq,
        activation=m.activation, norm=m.norm, tied_embeddings=False,
        position_embedding="rope" if p.sequence_parallel or m.position_embedding != "learned" else "learned",
        linear_bias=m.linear_bias, qkv_bias=m.qkv_bias, dropout=False)
    mbs = min(p.micro_batch_size, 2)
    micro = 2 * pp
    training = TrainingSpec(num_gpus=tp * pp * dp, global_batch_size=mbs * micro * dp, seq_len=seq,
                            precision="fp32", attention="flash", framework="torch", overlap_grad_reduce=True)
    plan = Plan(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch_size=mbs, recompute=p.recompute,
                sequence_parallel=p.sequence_parallel, zero_stage=2 if p.zero_stage == 1 else p.zero_stage,
                layers_per_stage=stage_layers)
    return Scenario(model=model, hardware=hardware or load_hardware("cpu-gloo"), training=training, plan=plan)


def predicted_rank_memory(sc: Scenario, pp_rank: int) -> dict:
    """The components of one rank that the run measures exactly: resident weights, gradients and
    optimizer states (no transient ZeRO buffers), and activations saved by the layers at peak.

    FSDP2 keeps weights sharded at rest for ZeRO-2 as for ZeRO-3 (``reshard_after_forward`` only
    decides whether they are re-gathered for backward), so the resident weights are 1/dp there.
    """
    p = sc.resolved_plan()
    layers = sc.stage_layers[pp_rank]
    params = stage_params_per_rank(sc.model, p, pp_rank, layers)
    per_param = param_bytes(sc.training)
    w, g, o = state_bytes_per_param(p.zero_stage, p.dp * p.cp, per_param)
    if sc.training.framework == "torch" and p.zero_stage >= 2:
        w = per_param[0] / (p.dp * p.cp)
    return {"weights_bytes": params * w, "grads_bytes": params * g, "optimizer_bytes": params * o,
            "saved_activation_peak_bytes": stage_saved_bytes(sc.model, sc.training, p, p.num_microbatches,
                                                             pp_rank, layers)}


@dataclass
class Outcome:
    ok: bool
    message: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)


def _phases(folder: Path, world: int) -> dict[int, str]:
    out = {}
    for r in range(world):
        f = folder / f"rank{r}"
        out[r] = f.read_text() if f.exists() else "not started"
    return out


def _stalled(phases: dict[int, str]) -> str:
    """The ranks furthest behind and their phase (a rank that waits on a stalled peer may share it)."""
    order = {"not started": -4, "init": -3, "build": -2, "microbenchmarks": -1, "report": 1e6, "done": 1e7}

    def progress(ph: str) -> float:
        return int(ph.split()[1]) if ph.startswith("step ") else order.get(ph, -5)

    low = min(phases.values(), key=progress)
    ranks = [r for r, ph in phases.items() if ph == low]
    others = sorted({ph for ph in phases.values() if ph != low}, key=progress)
    names = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    rest = f" (the others reached {', '.join(repr(o) for o in others)})" if others else ""
    return f"{names} in phase '{low}'{rest}"


def _failure(log: Path, code: int, phases: dict[int, str]) -> list[str]:
    """Which rank died, in which phase, and what it said.

    torchrun's failure summary lists every rank it stopped; its "Root Cause" block names the first
    one that failed. Ranks that torchrun itself terminated (SIGTERM/SIGKILL) come after the others.
    """
    import re

    text = log.read_text(errors="replace")
    pattern = r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)"
    root = text[text.find("Root Cause"):] if "Root Cause" in text else ""
    dead = [(int(r), int(c)) for r, c in re.findall(pattern, root)] or \
        [(int(r), int(c)) for r, c in re.findall(pattern, text)]
    dead.sort(key=lambda rc: rc[1] in (-15, -9))
    if dead:
        who = "; ".join(f"rank {r} exited with code {c} in phase '{phases.get(r, '?')}'" for r, c in dead[:2])
    else:
        who = f"no rank named; {_stalled(phases)}"
    lines = [ln.strip() for ln in text.splitlines()
             if re.search(r"injected fault|Error:|error:|OutOfMemory", ln) and "elastic" not in ln]
    first = dead[0][0] if dead else None
    said = [ln for ln in lines if first is not None and re.search(rf"\brank\s*{first}\b|\[rank{first}\]", ln)]
    said = (said or lines)[-3:]
    return [f"a rank failed (torchrun exit code {code}): {who} (log: {log})", *(f"  {ln}" for ln in said)]


def _torchrun(module: str, args: list[str], world: int, timeout_s: float, workdir: Path) -> tuple[int | None, Path]:
    """Run ``module`` on ``world`` local ranks under torchrun. Returns its exit code, or None when it ran past
    ``timeout_s`` and was killed with its whole process group; and the log file."""
    log = workdir / f"{module.rsplit('.', 1)[-1]}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(world), "--max-restarts", "0", "-m", module, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            return proc.wait(timeout=timeout_s), log
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, log


def run_torchrun(plan_path: Path, world: int, steps: int, backend: str, timeout_s: float, workdir: Path,
                 reference: bool) -> Outcome:
    """Start torchrun with the worker on ``world`` local ranks; never wait longer than ``timeout_s``."""
    out, phase_dir = workdir / "measured.json", workdir / "phases"
    phase_dir.mkdir(exist_ok=True)
    args = ["--plan", str(plan_path), "--steps", str(steps), "--out", str(out), "--phase-dir", str(phase_dir),
            "--backend", backend, "--timeout-s", str(max(30.0, timeout_s / 2))] + (["--reference"] if reference else [])
    code, log = _torchrun("planner.validate.worker", args, world, timeout_s, workdir)
    if code is None:
        return Outcome(False, [f"validate timed out after {timeout_s:.0f} s: {_stalled(_phases(phase_dir, world))} "
                               f"(log: {log})"])
    if code != 0:
        return Outcome(False, _failure(log, code, _phases(phase_dir, world)))
    return Outcome(True, report=json.loads(out.read_text()))


def compare(sc: Scenario, measured: dict) -> dict:
    """Predicted against measured for each metric, with relative errors."""
    from planner.cost import estimate_time

    rows = []
    ranks = measured["ranks"]
    for r in ranks:
        pred = predicted_rank_memory(sc, r["pp_rank"])
        for key, value in pred.items():
            got = r[key]
            rows.append({"metric": key, "rank": r["rank"], "stage": r["pp_rank"], "predicted": value, "measured": got,
                         "rel_error": (got - value) / value if value else 0.0})
    step_s = max(sum(r["step_s"]) / len(r["step_s"]) for r in ranks if r["step_s"])
    t = estimate_time(sc.model, sc.hardware, sc.training, sc.plan)
    losses = next((r["losses"] for r in ranks if r["losses"] and r["dp_rank"] == 0 and r["tp_rank"] == 0), [])
    bench = {}
    for r in ranks:
        for name, val in r["microbenchmarks"].items():
            bench.setdefault(name, val)
    out = {
        "memory": rows,
        "memory_max_abs_error": max(abs(x["rel_error"]) for x in rows),
        "step_time": {"predicted_s": t.step_time_s, "measured_s": step_s,
                      "rel_error": (step_s - t.step_time_s) / t.step_time_s},
        "losses": losses,
        "microbenchmarks": bench,
    }
    if "reference_loss" in measured and losses:
        ref = measured["reference_loss"]
        out["reference"] = {"reference_loss": ref, "first_loss": losses[0], "rel_error": (losses[0] - ref) / ref}
    peak = estimate_memory(sc.model, sc.hardware, sc.training, sc.plan)
    out["fits"] = peak.fits
    return out


def validate_local(sc: Scenario, steps: int = 3, scale: float = 1.0, max_ranks: int = 8, backend: str = "gloo",
                   timeout_s: float = 300.0, hardware: HardwareSpec | None = None, keep: str | None = None,
                   reference: bool = True) -> tuple[Scenario, Outcome]:
    mini = miniature(sc, max_ranks, scale, hardware)
    from planner.render import scenario_json

    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="plan3d-validate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    plan_path = workdir / "miniature.plan.json"
    plan_path.write_text(scenario_json(mini))
    t0 = time.perf_counter()
    outcome = run_torchrun(plan_path, mini.plan.world_size, steps, backend, timeout_s, workdir, reference)
    if outcome.ok:
        outcome.report = {"miniature": json.loads(plan_path.read_text()), "wall_s": time.perf_counter() - t0,
                          **compare(mini, outcome.report), "measured": outcome.report}
    return mini, outcome


def calibrate_local(base: HardwareSpec, backend: str = "gloo", ranks: int = 8, timeout_s: float = 300.0,
                    quick: bool = True, name: str | None = None) -> tuple[HardwareSpec, str]:
    """Measure this machine with ``ranks`` local processes; return the profile and its annotated YAML."""
    workdir = Path(tempfile.mkdtemp(prefix="plan3d-calibrate-"))
    out = workdir / "calibration.json"
    args = ["--out", str(out), "--backend", backend] + (["--quick"] if quick else [])
    code, log = _torchrun("planner.validate.calibrate", args, ranks, timeout_s, workdir)
    if code != 0:
        raise SpecError(f"calibrate: the measuring run failed (exit {code}); see {log}")
    return profile_from_measurements(json.loads(out.read_text()), base, name)


def profile_from_measurements(data: dict, base: HardwareSpec, name: str | None = None) -> tuple[HardwareSpec, str]:
    """A hardware profile from `calibrate` measurements, on top of ``base`` for what was not measured."""
    import datetime

    ranks = data["ranks"]
    tflops = statistics.median([g["tflops"] for r in ranks for g in r["gemms"]])
    best = max(g["tflops"] for r in ranks for g in r["gemms"])

    def link(key: str):
        curves = [r[key] for r in ranks if r[key]]
        if not curves:
            return None
        big = statistics.median([c[-1]["busbw_gbps"] for c in curves])
        small = statistics.median([c[0]["latency_us"] for c in curves])
        return big, small

    intra = link("intra")
    inter = link("inter") or intra
    fp32 = data["dtype"] == "torch.float32"
    when = datetime.date.today().isoformat()
    src = f"measured by plan3d calibrate ({data['world']} ranks, {data['backend']}) on {when}"
    fields = base.model_dump()
    fields.update({"name": name or f"{base.name}-calibrated", "gpus_per_node": data["gpus_per_node"],
                   "gemm_efficiency_max": min(1.0, tflops / best), "sustained_fraction": 1.0})
    fields["peak_fp32_tflops" if fp32 else "peak_bf16_tflops"] = best
    if fp32:
        fields["peak_bf16_tflops"] = best  # the CPU runs its "bf16" plans in fp32 too
    if intra:
        fields["intra_node_bandwidth_gbps"], fields["intra_node_latency_us"] = intra
    if inter:
        fields["inter_node_bandwidth_gbps"], fields["inter_node_latency_us"] = inter
    spec = HardwareSpec.model_validate(fields)
    notes = {"peak_fp32_tflops" if fp32 else "peak_bf16_tflops": f"best GEMM rate, {src}",
             "gemm_efficiency_max": f"median over the cost model's GEMM shapes / best, {src}",
             "sustained_fraction": "1.0: the GEMM rates above were measured with all ranks loaded",
             "intra_node_bandwidth_gbps": f"all-reduce bus bandwidth (nccl-tests factor), {src}",
             "intra_node_latency_us": f"smallest all-reduce / ring steps, {src}",
             "inter_node_bandwidth_gbps": f"{'' if data['nodes'] > 1 else 'one node only, same as intra-node; '}{src}",
             "inter_node_latency_us": f"{'' if data['nodes'] > 1 else 'one node only, same as intra-node; '}{src}",
             "gpus_per_node": src}
    if fp32:
        notes["peak_bf16_tflops"] = "the CPU computes in fp32: same as peak_fp32_tflops"
    lines = [f"# Hardware profile written by `plan3d calibrate` on {when}, from {base.name}.",
             "# Measured figures say so; the others are copied from the base profile and keep its sources there."]
    for key, value in spec.model_dump().items():
        if value is None:
            continue
        text = f"{key}: {json.dumps(value) if isinstance(value, str) else value}"
        lines.append(f"{text:<40} # {notes.get(key, f'from {base.name}')}")
    return spec, "\n".join(lines) + "\n"


def inside_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def run_scenario(sc: Scenario) -> Scenario:
    """What the validate run executes for a plan: fp32, torch's DTensor SP, FSDP2 (ZeRO-1 runs as ZeRO-2)."""
    training = sc.training.model_copy(update={"precision": "fp32", "framework": "torch"})
    plan = sc.plan.model_copy(update={"zero_stage": 2 if sc.plan.zero_stage == 1 else sc.plan.zero_stage})
    return sc.model_copy(update={"training": training, "plan": plan})
