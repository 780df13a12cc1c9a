"""Training logs of the frameworks themselves, read back into numbers (pure Python, no torch).

Two formats, each taken from the framework's own format strings:

* **Megatron-LM** core_v0.16.1, ``megatron/training/training.py::training_log`` (lines 2033-2083):
  one line per logged iteration, printed by the last rank (``print_rank_last``)::

      [<datetime>] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} |
      throughput per GPU (TFLOP/s/GPU): {:.1f} | learning rate: {:.6E} | global batch size: {:5d} |
      lm loss: {:.6E} | loss scale: {:.1f} | grad norm: {:.3f} | number of skipped iterations: {:3d} |
      number of nan iterations: {:3d} |

  (one line; the throughput field only with ``--log-throughput``), and the memory report of
  ``megatron/training/utils.py::report_memory`` (lines 280-290), printed by every rank of data-parallel
  rank 0 after the first iterations and every ``--log-memory-interval``::

      [Rank {r}] (after {N} iterations) memory (MB) | allocated: {:.2f} | max allocated: {:.2f} |
      reserved: {:.2f} | max reserved: {:.2f}

  "MB" there is ``1024 * 1024`` bytes (``mega_bytes = 1024.0 * 1024.0``). ``max allocated`` is
  ``torch.cuda.max_memory_allocated()``, never reset by Megatron: the last report is the run's peak.
  Rank 0 also prints Megatron's own estimate
  (``megatron/training/theoretical_memory_usage.py::report_theoretical_memory``, line 366):
  ``Theoretical memory footprints: weight and optimizer={:.2f} MB, activation={:.2f} MB, total={:.2f} MB``.

* **torchtitan** 0.3.0, ``torchtitan/components/metrics.py::MetricsProcessor.log`` (lines 522-532),
  through its logger (``torchtitan/tools/logging.py``: ``[titan] %(asctime)s - %(name)s - %(levelname)s -
  %(message)s``), every ``metrics.log_freq`` steps on every rank::

      step: {step:2}  loss: {:8.5f}  grad_norm: {:7.4f}  memory: {:5.2f}GiB({:.2f}%)  tps: {round(tps):,}
      tflops: {:,.2f}  mfu: {:.2f}%   (or "mfu: N/A" under float8/MX)

  with ANSI colour codes unless ``metrics.disable_color_printing``. ``memory`` is the peak
  **reserved** memory (``reserved_bytes.all.peak``) since the previous log line, whose peak
  counters are reset after each line (``reset_peak_stats``); torchtitan prints no allocated peak.
  ``tps`` is tokens per second per device: the tokens this rank loaded since the previous line over
  (elapsed time x ``non_data_parallel_size``) (metrics.py lines 476-479).

The first ``warmup`` iterations / steps (default 1: they include initialisation and the first
allocations) are left out of the step time and the throughput, never out of the memory peak.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

MIB = 1024 * 1024  # Megatron's "MB" (utils.py report_memory: mega_bytes = 1024.0 * 1024.0)
GIB = 1024 ** 3  # torchtitan's "GiB" (metrics.py DeviceMemoryMonitor._to_gib)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUM = r"[-+]?(?:\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"


def _float(text: str) -> float:
    return float(text.replace(",", ""))


# --- Megatron-LM ------------------------------------------------------------------------------

_MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_MEGATRON_FIELD = re.compile(r"\|\s*([^|:]+?):\s*([^|]+?)\s*(?=\|)")
_MEGATRON_MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: (" + _NUM + r") \| max allocated: ("
    + _NUM + r") \| reserved: (" + _NUM + r") \| max reserved: (" + _NUM + r")")
_MEGATRON_THEORY = re.compile(
    r"Theoretical memory footprints: weight and optimizer=(" + _NUM + r") MB, activation=(" + _NUM
    + r") MB, total=(" + _NUM + r") MB")


@dataclass
class MegatronIteration:
    iteration: int
    train_iters: int
    elapsed_ms: float
    tflops_per_gpu: float | None = None
    loss: float | None = None
    global_batch_size: int | None = None
    skipped: int | None = None
    nan: int | None = None


@dataclass
class MemoryReport:
    """One ``report_memory`` line (bytes)."""

    rank: int
    iteration: int
    allocated_bytes: float
    max_allocated_bytes: float
    reserved_bytes: float
    max_reserved_bytes: float


@dataclass
class MegatronLog:
    iterations: list[MegatronIteration] = field(default_factory=list)
    memory: list[MemoryReport] = field(default_factory=list)
    theoretical_bytes: dict | None = None  # Megatron's own estimate: weight_and_optimizer, activation, total


def parse_megatron(text: str) -> MegatronLog:
    """Every training-log line and memory report in ``text`` (any prefix before them is ignored:
    torchrun's ``[rank3]:`` or a timestamp). An iteration logged twice (two ranks' files) counts once."""
    out = MegatronLog()
    seen: set[int] = set()
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        mem = _MEGATRON_MEMORY.search(line)
        if mem:
            r, it, a, ma, rs, mr = mem.groups()
            out.memory.append(MemoryReport(int(r), int(it), _float(a) * MIB, _float(ma) * MIB,
                                           _float(rs) * MIB, _float(mr) * MIB))
            continue
        theory = _MEGATRON_THEORY.search(line)
        if theory:
            w, act, tot = (_float(x) * MIB for x in theory.groups())
            out.theoretical_bytes = {"weight_and_optimizer": w, "activation": act, "total": tot}
            continue
        it = _MEGATRON_ITER.search(line)
        if not it or "elapsed time per iteration (ms)" not in line:
            continue  # "iteration N on validation set" and other lines that merely say "iteration"
        fields = {k.strip(): v.strip() for k, v in _MEGATRON_FIELD.findall(line[it.end() - 1:] + "|")}
        n = int(it.group(1))
        if n in seen:
            continue
        seen.add(n)
        loss = fields.get("lm loss")
        out.iterations.append(MegatronIteration(
            iteration=n, train_iters=int(it.group(2)),
            elapsed_ms=_float(fields["elapsed time per iteration (ms)"]),
            tflops_per_gpu=_float(fields["throughput per GPU (TFLOP/s/GPU)"])
            if "throughput per GPU (TFLOP/s/GPU)" in fields else None,
            loss=_float(loss) if loss is not None else None,
            global_batch_size=int(fields["global batch size"]) if "global batch size" in fields else None,
            skipped=int(fields["number of skipped iterations"]) if "number of skipped iterations" in fields else None,
            nan=int(fields["number of nan iterations"]) if "number of nan iterations" in fields else None))
    out.iterations.sort(key=lambda i: i.iteration)
    return out


# --- torchtitan -------------------------------------------------------------------------------

_TITAN_STEP = re.compile(
    r"(?<!validate )step:\s*(\d+)\s+loss:\s*(" + _NUM + r")\s+grad_norm:\s*(" + _NUM + r")\s+memory:\s*(" + _NUM
    + r")GiB\((" + _NUM + r")%\)\s+tps:\s*(" + _NUM + r")\s+tflops:\s*(" + _NUM + r")\s+mfu:\s*(N/A|" + _NUM + r"%)")


@dataclass
class TorchtitanStep:
    step: int
    loss: float
    grad_norm: float
    max_reserved_bytes: float
    max_reserved_pct: float
    tps: float
    tflops: float
    mfu_pct: float | None


def parse_torchtitan(text: str) -> list[TorchtitanStep]:
    """Every ``MetricsProcessor.log`` line of one rank's output, in order (validation lines excluded)."""
    steps = []
    for raw in text.splitlines():
        m = _TITAN_STEP.search(_ANSI.sub("", raw))
        if not m:
            continue
        step, loss, gn, mem, pct, tps, tfl, mfu = m.groups()
        steps.append(TorchtitanStep(int(step), _float(loss), _float(gn), _float(mem) * GIB, _float(pct),
                                    _float(tps), _float(tfl), None if mfu == "N/A" else _float(mfu.rstrip("%"))))
    return steps


# --- summaries --------------------------------------------------------------------------------

@dataclass
class LogSummary:
    """What a run's logs say, warm-up steps left out of the times (module docstring)."""

    steps_logged: int
    steps_measured: int
    step_time_s: float | None  # median over the measured steps
    step_times_s: list[float]
    losses: list[float]
    tflops_per_gpu: float | None  # median, the framework's own FLOP count
    tokens_per_s_per_gpu: float | None  # torchtitan's tps, median
    # per rank: {"max_allocated_bytes": ..., "max_reserved_bytes": ...} (None where the log has no figure)
    memory: dict[int, dict] = field(default_factory=dict)
    theoretical_bytes: dict | None = None
    step_time_source: str = ""


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize_megatron(log: MegatronLog, warmup: int = 1) -> LogSummary:
    kept = [i for i in log.iterations if i.iteration > warmup]
    memory: dict[int, dict] = {}
    for rep in log.memory:  # max over the reports: max_memory_allocated is never reset, the last is the peak
        m = memory.setdefault(rep.rank, {"max_allocated_bytes": 0.0, "max_reserved_bytes": 0.0})
        m["max_allocated_bytes"] = max(m["max_allocated_bytes"], rep.max_allocated_bytes)
        m["max_reserved_bytes"] = max(m["max_reserved_bytes"], rep.max_reserved_bytes)
    return LogSummary(
        steps_logged=len(log.iterations), steps_measured=len(kept),
        step_time_s=_median([i.elapsed_ms / 1e3 for i in kept]), step_times_s=[i.elapsed_ms / 1e3 for i in kept],
        losses=[i.loss for i in log.iterations if i.loss is not None],
        tflops_per_gpu=_median([i.tflops_per_gpu for i in kept if i.tflops_per_gpu is not None]),
        tokens_per_s_per_gpu=None, memory=memory, theoretical_bytes=log.theoretical_bytes,
        step_time_source="Megatron-LM elapsed time per iteration (ms)")


def summarize_torchtitan(per_rank: dict[int, list[TorchtitanStep]], tokens_per_step: float,
                         non_data_parallel_size: int, warmup: int = 1) -> LogSummary:
    """Step time from torchtitan's ``tps`` with ``metrics.log_freq = 1``: ``elapsed = tokens loaded /
    (tps x non_data_parallel_size)`` (metrics.py lines 476-479, inverted), ``tokens_per_step`` being the
    tokens one data-parallel rank loads per step (global batch / data-parallel degree x sequence).
    ``tps`` is printed rounded to an integer, so the step time is exact to ``0.5 / tps`` relative.
    The rank with the slowest median is kept (every rank waits for it at the step's collectives)."""
    memory, best = {}, None
    for rank, steps in sorted(per_rank.items()):
        if steps:
            memory[rank] = {"max_allocated_bytes": None,
                            "max_reserved_bytes": max(s.max_reserved_bytes for s in steps)}
        kept = [s for s in steps if s.step > warmup and s.tps > 0]
        times = [tokens_per_step / (s.tps * non_data_parallel_size) for s in kept]
        if times and (best is None or statistics.median(times) > statistics.median(best[1])):
            best = (kept, times)
    kept, times = best if best else ([], [])
    first = next((steps for _, steps in sorted(per_rank.items()) if steps), [])
    return LogSummary(
        steps_logged=max((len(s) for s in per_rank.values()), default=0), steps_measured=len(kept),
        step_time_s=_median(times), step_times_s=times, losses=[s.loss for s in first],
        tflops_per_gpu=_median([s.tflops for s in kept]), tokens_per_s_per_gpu=_median([s.tps for s in kept]),
        memory=memory, step_time_source="torchtitan tps (tokens per step / (tps x non-data-parallel size))")
