"""Run the framework itself: the emitted launch file of a plan, for a few steps, judged from its own logs.

``plan3d validate PLAN --framework torchtitan|megatron`` (:func:`run_framework`) writes the launch
file that ``plan3d emit`` writes (``planner.emit.render_all``: ``<stem>.torchtitan.sh`` or the Megatron-LM
``<stem>.torchrun.sh``) into a temporary folder, runs it with a step limit and a wall-clock limit, reads
memory, step time and throughput from the framework's own log lines (``planner.readers.logs``) and
compares them with ``planner.estimate.estimate`` of the plan as that framework runs it. The verdict is
validate's rule (:func:`planner.validate.launch.judge`): peak allocated memory per rank within
``launch.ALLOCATED_TOLERANCE`` of the predicted stage total, step time within the time factor when
one applies (``launch.time_factor_for``: a profile calibrated here, or ``--time-factor``), finite
losses, a measured peak that fits.

What each framework needs to run, else the run is **skipped** with the reason (:func:`skip_reason`):

* torchtitan: importable; a device it can use. torchtitan 0.3.0 has no CPU path: it picks
  ``_get_available_device_type() or "cuda"`` (``torchtitan/tools/utils.py::get_device_info``) and
  ``Trainer.__init__`` calls ``device_module.set_device`` (``torchtitan/trainer.py``), which fails
  without CUDA; the reason cites both lines as found in the installed files. The run gets a local
  tokenizer and text data set written here (:func:`write_torchtitan_assets`), since the configs
  name Hugging Face downloads (``allenai/c4``, ``./assets/hf/Llama-3.1-8B``).
* Megatron-LM: a checkout with ``pretrain_gpt.py`` (``megatron_lm`` or ``$MEGATRON_LM``), CUDA
  (``megatron/training/initialize.py::_initialize_distributed`` sets CUDA devices and NCCL) and
  Transformer Engine (its default ``--transformer-impl transformer_engine``,
  ``megatron/core/transformer/transformer_config.py``, which the emitted arguments keep).
* both: all the plan's GPUs on this one node.

Memory: Megatron prints ``torch.cuda.max_memory_allocated`` per rank (judged) and the reserved peak
(reported). torchtitan's console line has only the reserved peak; its TensorBoard scalars, which the
run turns on for every rank, have the active peak (:func:`tensorboard_metrics`), judged as the
allocated one. Without them the reserved peak is judged one way, as a miss when it is below the
predicted allocated peak by more than the tolerance (reserved memory holds every allocated byte, so
the prediction is then too high); above, it is reported.

A skipped run is neither a pass nor a miss: :func:`exit_code` gives ``SKIP_EXIT_CODE`` (77, the
"skipped" status of the GNU Automake and Meson test harnesses).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from planner import frameworks
from planner.presets import SpecError
from planner.readers import logs
from planner.specs import HardwareSpec, Scenario

FRAMEWORKS = ("torchtitan", "megatron")
WARMUP_STEPS = 1
"""Steps run before the measured ones and left out of the times (they include initialisation)."""
SKIP_EXIT_CODE = 77
"""Exit status of a skipped run: 77 is "skipped" in the GNU Automake test harness (automake manual,
section 15.2.1 "Scripts-based Testsuites") and in Meson's ``meson test``. Not 0: nothing was
validated, and a CI job must not read a machine without the framework as a pass; not 1 (a miss) or
2 (bad input) either. A job that accepts skips runs ``plan3d validate ... || test $? -eq 77``."""
KILL_GRACE_S = 5.0
OOM_PATTERN = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory")


@dataclass
class FrameworkRun:
    """How a framework run ended: ``status`` pass, fail or skipped; ``report`` holds the comparison."""

    framework: str
    status: str
    reasons: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)


def exit_code(run: FrameworkRun) -> int:
    """0 pass, 1 a miss or a failed run, :data:`SKIP_EXIT_CODE` skipped (bad input raises SpecError: 2)."""
    return {"pass": 0, "skipped": SKIP_EXIT_CODE}.get(run.status, 1)


# --- where it can run ---------------------------------------------------------------------------

def _package_dir(name: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "(unknown version)"


def _line_of(path: Path, needle: str) -> int | None:
    try:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if needle in line:
                return n
    except OSError:
        return None
    return None


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchtitan_device_reason() -> str | None:
    """Why the installed torchtitan cannot train here, from its own code; None when it can try.

    torchtitan chooses its device in ``tools/utils.py::get_device_info`` as
    ``_get_available_device_type() or "cuda"`` and ``Trainer.__init__`` calls
    ``device_module.set_device``: without an accelerator that is ``torch.cuda.set_device``, which
    fails. Only when both lines are in the installed files and torch finds no accelerator is the
    run refused; otherwise it is tried and any failure is torchtitan's own.
    """
    import torch._utils

    if torch._utils._get_available_device_type() is not None:
        return None
    root = _package_dir("torchtitan")
    if root is None:
        return None
    pick = _line_of(root / "tools" / "utils.py", 'or "cuda"')
    set_device = _line_of(root / "trainer.py", "device_module.set_device(")
    if pick is None or set_device is None:
        return None
    return (f"torchtitan {_version('torchtitan')} cannot train on this machine: it has no GPU, torchtitan then "
            f"picks device 'cuda' (torchtitan/tools/utils.py:{pick}, `_get_available_device_type() or \"cuda\"`) "
            f"and Trainer.__init__ calls torch.cuda.set_device (torchtitan/trainer.py:{set_device}); it has no "
            "CPU device option")


def megatron_checkout(megatron_lm: str | None) -> Path | None:
    path = megatron_lm or os.environ.get("MEGATRON_LM")
    return Path(path) if path else None


def skip_reason(sc: Scenario, framework: str, megatron_lm: str | None = None) -> str | None:
    """Why ``framework`` cannot run ``sc`` on this machine, in one line; None when it can."""
    from planner.emit import torchrun

    if framework not in FRAMEWORKS:
        raise SpecError(f"--framework: '{framework}' is not one of {', '.join(FRAMEWORKS)}")
    reasons = []
    if framework == "torchtitan":
        if _package_dir("torchtitan") is None:
            return "torchtitan is not installed (pip install torchtitan)"
        device = torchtitan_device_reason()
        if device:
            return device
    else:
        checkout = megatron_checkout(megatron_lm)
        if checkout is None or not (checkout / "pretrain_gpt.py").is_file():
            where = f"none at {checkout}" if checkout else "MEGATRON_LM is not set"
            reasons.append(f"no Megatron-LM checkout with pretrain_gpt.py ({where}); set MEGATRON_LM")
        if _gpus() == 0:
            reasons.append("Megatron-LM needs CUDA GPUs (megatron/training/initialize.py _initialize_distributed "
                           "sets CUDA devices and NCCL) and this machine has none")
        if _package_dir("transformer_engine") is None:
            reasons.append("Transformer Engine is not installed (Megatron-LM's default --transformer-impl "
                           "transformer_engine, megatron/core/transformer/transformer_config.py, which the emitted "
                           "arguments keep)")
        if reasons:
            return "Megatron-LM cannot run here: " + "; ".join(reasons)
    nodes, _ = torchrun.nodes(sc)
    have = _gpus()
    if nodes > 1 or have < sc.training.num_gpus:
        return (f"the plan runs on {sc.training.num_gpus} GPUs ({nodes} node(s)) and this machine has {have}; run "
                "the emitted launch file on the cluster (with PET_LOG_DIR set, torchrun's --log-dir) and judge its logs "
                "with judge_logs (`--logs DIR`)")
    return None


# --- the launch ----------------------------------------------------------------------------------

def predicted_scenario(sc: Scenario, framework: str, hardware: HardwareSpec | None = None) -> Scenario:
    """The plan as ``framework`` runs it: its framework profile (planner/frameworks) and, when given,
    the hardware profile of this machine."""
    update = {"framework": framework}
    if not frameworks.get(framework).runs_deepep:  # its launch file dispatches with the all-to-all (specs.job_problems)
        update["moe_token_dispatcher"] = "alltoall"
    training = sc.training.model_copy(update=update)
    return sc.model_copy(update={"training": training, "hardware": hardware or sc.hardware})


def changes(sc: Scenario, pred: Scenario) -> list[str]:
    out = []
    if pred.training.framework != sc.training.framework:
        out.append(f"framework {sc.training.framework} -> {pred.training.framework} (predicted as it runs)")
    if pred.training.moe_token_dispatcher != sc.training.moe_token_dispatcher:
        out.append(f"token dispatch {sc.training.moe_token_dispatcher} -> {pred.training.moe_token_dispatcher}")
    if pred.hardware.name != sc.hardware.name:
        out.append(f"hardware {sc.hardware.name} -> {pred.hardware.name}")
    return out


TOKENIZER_WORDS = 256


def write_torchtitan_assets(folder: Path) -> tuple[Path, Path]:
    """A word-level tokenizer (``tokenizers``, as ``tokenizer.json`` with a ``tokenizer_config.json``
    naming BOS/EOS, what torchtitan's ``HuggingFaceTokenizer`` loads) and a text data set in the
    ``c4_test`` layout (a local folder that ``datasets.load_dataset(path, split="train")`` reads, one
    ``text`` field per sample: ``hf_datasets/text_datasets.py``). The ids stay below every model's
    vocabulary; the data loader loops over the data (``infinite = True``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(TOKENIZER_WORDS)]
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    vocab = {tok: i for i, tok in enumerate(special + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir, data_dir = folder / "tokenizer", folder / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
         "add_eos_token": True}))
    with open(data_dir / "train.jsonl", "w") as fh:
        for i in range(64):  # fixed pseudo-text: word i*k mod N
            fh.write(json.dumps({"text": " ".join(words[(i * 7 + k * 13) % TOKENIZER_WORDS] for k in range(512))}))
            fh.write("\n")
    return tok_dir, data_dir


TB_FOLDER = "tb"
TB_ACTIVE = "memory/max_active(GiB)"  # torchtitan metrics.py MetricsProcessor.log, the metrics dict
TB_STEP_S = "time_metrics/end_to_end(s)"


def tensorboard_metrics(dump: str | Path) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """torchtitan's per-rank TensorBoard scalars: ``<dump>/tb/<YYYYmmdd-HHMM>/rank_<r>/events.*``
    (``MetricsProcessor._build_metric_logger`` with ``save_for_all_ranks``; ``TensorBoardLogger.log``
    writes ``add_scalar(key, value, step)`` for every key of the metrics dict), read with
    TensorBoard's own ``EventAccumulator``. Empty when TensorBoard is absent or nothing was written.

    They carry what the console line leaves out: ``memory/max_active(GiB)``, the peak of
    ``active_bytes.all.peak`` (allocated blocks, plus freed ones still in use by a stream) since the
    previous step, and ``time_metrics/end_to_end(s)``, the step's wall time.
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    out: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for rank_dir in sorted(Path(dump).glob(f"**/{TB_FOLDER}/*/rank_*")):
        try:
            rank = int(rank_dir.name.split("_", 1)[1])
        except ValueError:
            continue
        acc = EventAccumulator(str(rank_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags().get("scalars", [])
        series = out.setdefault(rank, {})
        for tag in (TB_ACTIVE, TB_STEP_S):
            if tag in tags:
                series.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def torchtitan_run_options(steps: int, dump: Path, tokenizer: Path, data: Path) -> list[str]:
    """torchtitan 0.3.0 options of a short measured run (names from ``torchtitan/config/configs.py``,
    accepted by its ``ConfigManager``: tests/test_validate_framework.py)."""
    return ["--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
            "--metrics.enable-tensorboard", "--metrics.save-for-all-ranks", "--metrics.save_tb_folder", TB_FOLDER,
            "--dump_folder", str(dump), "--hf_assets_path", str(tokenizer),
            "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(data), "--checkpoint.no-enable",
            "--profiler.no-enable-profiling", "--validator.no-enable"]


MEGATRON_RUN_OPTIONS = ["--log-throughput", "--log-memory-interval", "1", "--eval-iters", "0"]
"""Megatron-LM options added to the emitted ones: the throughput field and a memory report every
iteration (``training.py::training_log``), no evaluation pass (names from core_v0.16.1's argument
parser, accepted by its ``parse_args``: tests/test_validate_framework.py)."""



def _emitted(sc: Scenario, framework: str) -> dict[str, str]:
    """The launch file the run executes, as ``plan3d emit`` writes it (``--format torchtitan``, or ``--format torchrun``
    for Megatron-LM);
    ``SpecError`` where the emitter refuses the plan."""
    from planner.emit import render_all

    return render_all(sc, ["torchtitan" if framework == "torchtitan" else "torchrun"])


def prepare(sc: Scenario, framework: str, steps: int, workdir: Path,
            megatron_lm: str | None = None) -> tuple[Path, list[str], dict[str, str]]:
    """Write the emitted launch file into ``workdir``; (script, its arguments, environment additions)."""
    from planner.io import write_all

    total = steps + WARMUP_STEPS
    env = {"PET_LOG_DIR": str(workdir / "logs"), "PET_TEE": "3"}  # torchrun: per-rank log files (--log-dir, --tee)
    if framework == "torchtitan":
        script = write_all(workdir, _emitted(sc, framework), option="--keep")[0]
        tok, data = write_torchtitan_assets(workdir / "assets")
        return script, torchtitan_run_options(total, workdir / "dump", tok, data), env
    script = write_all(workdir, _emitted(sc, framework), option="--keep")[0]
    env |= {"TRAIN_ITERS": str(total)}
    checkout = megatron_checkout(megatron_lm)
    if checkout is not None:
        env["MEGATRON_LM"] = str(checkout)
    return script, list(MEGATRON_RUN_OPTIONS), env


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux ``/proc``): torchrun starts its workers in their own
    sessions (``start_new_session=True``, torch/distributed/elastic/multiprocessing/subprocess_handler),
    so killing the launcher's process group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group and every process below it, then reap the launcher."""
    below = _descendants(proc.pid) if proc.poll() is None else []
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def launch_script(script: Path, args: list[str], env: dict[str, str], timeout_s: float, workdir: Path,
                  on_start=None) -> tuple[str, int | None]:
    """Run ``bash script args``; ("ok" | "failed" | "timeout", exit code). The launcher leads a new
    process group and dies with this process (``launch._child_setup``); a timeout, Ctrl-C or SIGTERM
    kill it with every process below it (:func:`_kill_tree`)."""
    from planner.validate.launch import _child_setup, _main_thread

    previous = signal.getsignal(signal.SIGTERM) if _main_thread() else None

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if previous is not None:
        signal.signal(signal.SIGTERM, on_term)
    deadline = time.monotonic() + timeout_s
    try:
        with open(workdir / "launcher.log", "w") as log:
            proc = subprocess.Popen(["bash", str(script), *args], cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1") | env, preexec_fn=_child_setup(0))
        try:
            if on_start is not None:
                on_start(proc.pid)
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    return "timeout", None
                time.sleep(0.1)
            return ("ok" if proc.returncode == 0 else "failed"), proc.returncode
        finally:
            _kill_tree(proc)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def rank_logs(workdir: Path) -> dict[int | None, str]:
    """Each rank's output of a run in ``workdir`` (:func:`log_folder_texts` of its ``logs`` folder), and
    the launcher's own output under ``None``."""
    out = log_folder_texts(workdir / "logs") if (workdir / "logs").is_dir() else {}
    launcher = workdir / "launcher.log"
    out[None] = (out.get(None, "") + launcher.read_text(errors="replace")) if launcher.is_file() else out.get(None, "")
    return out


def log_folder_texts(folder: str | Path) -> dict[int | None, str]:
    """The logs of a run for :func:`compare_logs`, e.g. a cluster run's: torchrun's ``--log-dir`` layout
    (``<log_dir>/<run id>/attempt_<n>/<rank>/stdout.log`` and ``stderr.log``,
    torch/distributed/elastic/multiprocessing/api.py; the last attempt, by local rank, which is the rank
    on one node) when it is there, else every file of the folder as one text of unknown rank (``None``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecError(f"--logs: {folder} is not a folder")
    out: dict[int | None, str] = {}
    attempts = sorted(folder.glob("*/attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if attempts:
        for rank_dir in sorted(attempts[-1].iterdir()):
            if rank_dir.is_dir() and rank_dir.name.isdigit():
                out[int(rank_dir.name)] = "".join(
                    (rank_dir / f).read_text(errors="replace") for f in ("stdout.log", "stderr.log")
                    if (rank_dir / f).is_file())
        return out
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    out[None] = "\n".join(p.read_text(errors="replace") for p in files)
    return out


# --- the comparison ------------------------------------------------------------------------------

def _rel(measured: float, predicted: float) -> float:
    from planner.validate.launch import _rel as rel

    return rel(measured, predicted)


def _apply_scalars(summary: logs.LogSummary, scalars: dict, warmup: int) -> None:
    """torchtitan's TensorBoard scalars into the summary (:func:`compare_logs`)."""
    slowest = None
    for rank, series in sorted(scalars.items()):
        active = [v for _, v in series.get(TB_ACTIVE, [])]
        if active:
            m = summary.memory.setdefault(rank, {"max_reserved_bytes": None})
            m["max_allocated_bytes"], m["metric"] = max(active) * logs.GIB, "max_memory_active"
        times = [v for step, v in series.get(TB_STEP_S, []) if step > warmup]
        if times and (slowest is None or statistics.median(times) > statistics.median(slowest)):
            slowest = times
    if slowest:
        summary.step_times_s, summary.step_time_s = slowest, statistics.median(slowest)
        summary.steps_measured = len(slowest)
        summary.step_time_source = f"torchtitan TensorBoard {TB_STEP_S}"


def compare_logs(sc: Scenario, framework: str, texts: dict[int | None, str], time_factor: float | None = None,
                 hardware: HardwareSpec | None = None, warmup: int = WARMUP_STEPS,
                 scalars: dict[int, dict[str, list[tuple[int, float]]]] | None = None) -> dict:
    """Measured (from the framework's logs, one text per rank; ``None``: text of unknown rank) against
    predicted, with validate's verdict (:func:`planner.validate.launch.judge`) and reasons.

    ``scalars`` (torchtitan, :func:`tensorboard_metrics`): where a rank has them, its peak active memory
    is judged as the allocated peak (two-sided) and the step time is its ``end_to_end(s)``, not the
    one derived from the rounded ``tps``."""
    from planner.estimate import estimate
    from planner.validate import launch

    if framework not in FRAMEWORKS:
        raise SpecError(f"--framework: '{framework}' is not one of {', '.join(FRAMEWORKS)}")
    pred = predicted_scenario(sc, framework, hardware)
    p = pred.resolved_plan()
    est = estimate(pred)
    world = pred.training.num_gpus
    per_stage = max(1, world // p.pp)  # pp is the outermost rank dimension in both (Megatron tp-cp-ep-dp-pp,
    # torchtitan ParallelDims ["pp", "dp_replicate", "dp_shard", "cp", "tp"])
    if framework == "megatron":
        summary = logs.summarize_megatron(logs.parse_megatron("\n".join(texts.values())), warmup)
    else:
        per_rank = {r: logs.parse_torchtitan(t) for r, t in texts.items()}
        if any(per_rank[r] for r in per_rank if r is not None):
            per_rank.pop(None, None)
        else:  # no per-rank files: the launcher's console (one rank's lines are enough for the times)
            per_rank = {0: per_rank.get(None, [])}
        tokens = pred.training.global_batch_size / p.dp * pred.training.seq_len
        summary = logs.summarize_torchtitan(per_rank, tokens, p.tp * p.cp * p.pp, warmup)
        _apply_scalars(summary, scalars or {}, warmup)
    device_rows, reserved_rows = [], []
    for rank, m in sorted(summary.memory.items()):
        stage = min(rank // per_stage, p.pp - 1)
        want = est.memory.stages[stage].total_bytes
        if m.get("max_allocated_bytes") is not None:
            device_rows.append({"metric": m.get("metric", "max_memory_allocated"), "rank": rank, "stage": stage, "predicted": want,
                                "measured": m["max_allocated_bytes"], "reserved": m.get("max_reserved_bytes"),
                                "rel_error": _rel(m["max_allocated_bytes"], want)})
        elif m.get("max_reserved_bytes") is not None:
            reserved_rows.append({"metric": "max_memory_reserved", "rank": rank, "stage": stage, "predicted": want,
                                  "measured": m["max_reserved_bytes"], "rel_error": _rel(m["max_reserved_bytes"], want)})
    t = est.time.step_time_s
    measured_s = summary.step_time_s
    step_time = {"predicted_s": t, "measured_s": measured_s,
                 "rel_error": _rel(measured_s, t) if measured_s is not None else None,
                 "ratio": measured_s / t if measured_s is not None else None,
                 "judged": time_factor is not None and measured_s is not None}
    peaks = [r["measured"] for r in device_rows + reserved_rows]
    usable = pred.hardware.usable_memory_gib * 2**30
    out = {
        "framework": framework,
        "changed": changes(sc, pred),
        "memory": [],  # no per-component measurement: the frameworks log totals only
        "device_memory": device_rows,
        "reserved_memory": reserved_rows,
        "step_time": step_time,
        "step_times_s": summary.step_times_s,
        "step_time_source": summary.step_time_source,
        "steps_logged": summary.steps_logged,
        "steps_measured": summary.steps_measured,
        "warmup_steps": warmup,
        "losses": summary.losses,
        "throughput": {"tflops_per_gpu": summary.tflops_per_gpu, "tokens_per_s_per_gpu": summary.tokens_per_s_per_gpu,
                       "predicted_model_tflops_per_gpu": est.model_flops_per_step / t / world / 1e12 if t else None,
                       "note": "reported, not judged: each framework counts FLOPs its own way"},
        "framework_memory_estimate_bytes": summary.theoretical_bytes,
        "tolerances": {"device_memory": launch.ALLOCATED_TOLERANCE, "step_time_factor": time_factor},
        "measured_peak_bytes": max(peaks) if peaks else None,
        "fits": (max(peaks) <= usable) if peaks else True,
        "predicted_fits": est.memory.fits,
    }
    _, reasons = launch.judge(out, [], launch.MEMORY_TOLERANCE, time_factor if measured_s is not None else None)
    for row in reserved_rows:  # one-sided: reserved holds every allocated byte (module docstring)
        if row["rel_error"] < -launch.ALLOCATED_TOLERANCE:
            reasons.append(f"memory: rank {row['rank']} reserved at most {row['measured'] / 2**30:.3f} GiB, below the "
                           f"predicted allocated peak {row['predicted'] / 2**30:.3f} GiB ({100 * row['rel_error']:+.1f}% "
                           f"< -{100 * launch.ALLOCATED_TOLERANCE:.0f}%)")
    if summary.steps_measured == 0:
        reasons.append(f"no training step after the {warmup} warm-up step(s) in the {framework} logs")
    if not peaks:
        reasons.append(f"no memory figure in the {framework} logs")
    oom = [r for r, text in texts.items() if OOM_PATTERN.search(text)]
    if oom:
        reasons.append("out of memory: " + ", ".join("launcher" if r is None else f"rank {r}" for r in oom))
        out["fits"] = False
    out["verdict"], out["reasons"] = ("fail" if reasons else "pass"), reasons
    return out


def summary_lines(run: FrameworkRun) -> list[str]:
    """What the CLI prints: the comparison per quantity, then the verdict and its reasons."""
    r = run.report
    if run.status == "skipped":
        return [f"{run.framework}: skipped: {run.reasons[0]}"]
    lines = [f"changed: {c}" for c in r.get("changed", [])]
    for row in r.get("device_memory", []) + r.get("reserved_memory", []):
        extra = f", reserved {row['reserved'] / 2**30:.3f} GiB" if row.get("reserved") else ""
        lines.append(f"rank {row['rank']} (stage {row['stage']}): {row['metric']} {row['measured'] / 2**30:.3f} GiB, "
                     f"predicted {row['predicted'] / 2**30:.3f} GiB ({100 * row['rel_error']:+.1f}%){extra}")
    st = r.get("step_time")
    if st and st.get("measured_s") is not None:
        judged = "" if st.get("judged") else " (reported, not judged: `plan3d calibrate`, or --time-factor)"
        lines.append(f"step time: measured {st['measured_s']:.4f} s (median of {r['steps_measured']} steps after "
                     f"{r['warmup_steps']} warm-up), predicted {st['predicted_s']:.4f} s ({st['ratio']:.2f}x){judged}")
    tp = r.get("throughput") or {}
    if tp.get("tflops_per_gpu") is not None:
        lines.append(f"throughput: {tp['tflops_per_gpu']:.1f} TFLOP/s/GPU as {run.framework} counts, predicted "
                     f"{tp['predicted_model_tflops_per_gpu']:.1f} model TFLOP/s/GPU (reported, not judged)")
    lines.append(f"verdict: {run.status.upper()}")
    lines += [f"  {x}" for x in run.reasons]
    return lines


# --- the entry point -----------------------------------------------------------------------------

def run_framework(sc: Scenario, framework: str, steps: int = 5, timeout_s: float = 1800.0,
                  workdir: str | Path | None = None, megatron_lm: str | None = None,
                  time_factor: float | None = None, hardware: HardwareSpec | None = None,
                  preflight: bool = True, env: dict[str, str] | None = None, on_start=None) -> FrameworkRun:
    """Run ``framework`` on the emitted launch file of ``sc`` for ``steps`` measured steps (after
    :data:`WARMUP_STEPS`) within ``timeout_s`` seconds and judge it (module docstring).

    ``workdir``: keep the launch file, assets and logs there (else a temporary folder, removed).
    ``preflight=False`` skips :func:`skip_reason` (the tests run stand-in launchers that way);
    ``env`` adds to the launcher's environment.
    """
    if framework not in FRAMEWORKS:
        raise SpecError(f"--framework: '{framework}' is not one of {', '.join(FRAMEWORKS)}")
    if steps < 1:
        raise SpecError("--steps: give at least 1 measured step")
    _emitted(sc, framework)  # a plan the framework's launch file cannot express is bad input (exit 2), not a skip
    if preflight:
        reason = skip_reason(sc, framework, megatron_lm)
        if reason:
            return FrameworkRun(framework, "skipped", [reason], {"verdict": "skipped", "reasons": [reason]})
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"plan3d-{framework}-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        script, args, extra = prepare(sc, framework, steps, folder, megatron_lm)
        status, code = launch_script(script, args, extra | (env or {}), timeout_s, folder, on_start)
        texts = rank_logs(folder)
        tail = [ln for ln in texts.get(None, "").splitlines() if ln.strip()][-5:]
        command = ["bash", script.name, *args]
        if status != "ok":
            what = (f"timed out after {timeout_s:.0f} s" if status == "timeout"
                    else f"the launch exited with code {code}")
            reasons = [f"{framework} run {what}"]
            oom = [r for r, text in texts.items() if OOM_PATTERN.search(text)]
            if oom:
                reasons.append("out of memory: " + ", ".join("launcher" if r is None else f"rank {r}" for r in oom))
            return FrameworkRun(framework, "fail", reasons, {"verdict": "fail", "reasons": reasons}, command, tail)
        scalars = tensorboard_metrics(folder / "dump") if framework == "torchtitan" else None
        report = compare_logs(sc, framework, texts, time_factor, hardware, scalars=scalars)
        return FrameworkRun(framework, report["verdict"], report["reasons"], report, command, tail)
    finally:
        if not workdir:
            shutil.rmtree(folder, ignore_errors=True)


def judge_logs(sc: Scenario, framework: str, folder: str | Path, time_factor: float | None = None,
               hardware: HardwareSpec | None = None, warmup: int = WARMUP_STEPS) -> FrameworkRun:
    """Judge the logs of a run made elsewhere (a cluster job of the emitted launch file) as
    :func:`run_framework` judges its own: ``folder`` as :func:`log_folder_texts` reads it."""
    if framework not in FRAMEWORKS:
        raise SpecError(f"--framework: '{framework}' is not one of {', '.join(FRAMEWORKS)}")
    scalars = tensorboard_metrics(folder) if framework == "torchtitan" else None
    report = compare_logs(sc, framework, log_folder_texts(folder), time_factor, hardware, warmup, scalars)
    return FrameworkRun(framework, report["verdict"], report["reasons"], report)


def validate_framework(sc: Scenario, framework: str, steps: int = 5, timeout_s: float = 1800.0,
                       keep: str | None = None, megatron_lm: str | None = None, hardware_ref: str | None = None,
                       time_factor: float | None = None, logs_dir: str | None = None) -> FrameworkRun:
    """What ``plan3d validate PLAN --framework F`` does, from the CLI's plain values.

    ``hardware_ref``: a hardware profile for the prediction (default: the plan's own); the step time is
    judged with ``time_factor``, else with ``launch.time_factor_for(hardware_ref, "nccl")`` (a profile that
    `plan3d calibrate` wrote), else reported. ``logs_dir``: judge the logs of a run made elsewhere
    (:func:`judge_logs`) instead of running. ``keep``: keep the launch file, assets and logs there.
    """
    from planner.presets import load_hardware
    from planner.validate import launch

    hw = load_hardware(hardware_ref) if hardware_ref else None
    factor = time_factor if time_factor is not None else (
        launch.time_factor_for(hardware_ref, "nccl") if hardware_ref else None)
    if logs_dir:
        return judge_logs(sc, framework, logs_dir, factor, hw)
    return run_framework(sc, framework, steps, timeout_s, keep, megatron_lm, factor, hw)


def report_json(run: FrameworkRun) -> dict:
    """The ``--json`` / ``--out`` document: the comparison with the run's status and reasons."""
    return {"framework": run.framework, "status": run.status, "reasons": run.reasons, "command": run.command,
            "log_tail": run.log_tail, **{k: v for k, v in run.report.items() if k not in ("reasons",)}}
