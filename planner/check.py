"""`plan3d check`: read plan files, Megatron-LM argument files and launch scripts, and estimate every stage's memory.

A launch script is read the way bash would see its words: comments dropped, line continuations
joined, ``NAME=value`` assignments and ``${NAME:-default}`` substituted (the environment itself is
never read, so a check gives the same answer everywhere). Megatron-LM flags are collected from
all words; the GPU count comes from a ``# plan3d: num_gpus=N`` note, torchrun's ``--nnodes`` x
``--nproc-per-node``, or Slurm's ``#SBATCH --nodes`` x ``--gpus-per-node``, else from ``--gpus``.
Megatron-LM's defaults apply where a flag is absent (biases on, dropout 0.1, learned absolute
positions, LayerNorm, tied embeddings), as ``megatron/training/arguments.py`` sets them.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from planner.presets import SpecError, build, load_scenario, read_document
from planner.specs import HardwareSpec, ModelSpec, Scenario

# Megatron-LM / torchrun / Slurm flags that take no value (store_true); every other flag takes one.
SWITCHES = {
    "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--add-qkv-bias", "--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--bf16",
    "--fp16", "--overlap-grad-reduce", "--overlap-param-gather", "--grad-reduce-in-bf16", "--mock-data",
    "--deepspeed", "--standalone", "--exclusive", "--use-flash-attn", "--no-python", "--recompute-activations",
}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")
_ASSIGN = re.compile(r"^([A-Za-z_]\w*)=")


@dataclass
class Flags:
    """The flags of one file: value and line of each (the last occurrence wins, as argparse does)."""

    path: Path
    values: dict[str, str | None] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    sbatch: dict[str, str | None] = field(default_factory=dict)

    def get(self, flag: str, default=None):
        return self.values.get(flag, default)

    def has(self, flag: str) -> bool:
        return flag in self.values

    def line(self, *flags: str) -> int:
        return min((self.lines[f] for f in flags if f in self.lines), default=1)

    def int(self, flag: str, default: int | None = None) -> int | None:
        if flag not in self.values:
            return default
        value = self.values[flag]
        try:
            return int(str(value))
        except ValueError:
            raise SpecError(f"{self.path}:{self.lines[flag]}: {flag}: '{value}' is not an integer") from None

    def float(self, flag: str, default: float) -> float:
        if flag not in self.values:
            return default
        try:
            return float(str(self.values[flag]))
        except ValueError:
            raise SpecError(f"{self.path}:{self.lines[flag]}: {flag}: '{self.values[flag]}' is not a number") from None


def _logical_lines(text: str):
    """(first line number, text) of each logical line, continuations joined."""
    buf, start = [], None
    for n, raw in enumerate(text.splitlines(), start=1):
        if start is None:
            start = n
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        yield start, " ".join(buf)
        buf, start = [], None
    if buf:
        yield start, " ".join(buf)


def _substitute(line: str, env: dict[str, str]) -> str:
    def repl(m):
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        return m.group(0)

    return _VAR.sub(repl, line)


def read_flags(path: Path) -> Flags:
    """Every ``--flag [value]`` word of a script or argument file, with its line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read: {err.__class__.__name__}") from None
    out, env = Flags(path=path), {}
    for lineno, line in _logical_lines(text):
        stripped = line.strip()
        if stripped.startswith("# plan3d:"):
            key, _, value = stripped[len("# plan3d:"):].strip().partition("=")
            out.notes[key.strip()] = value.strip()
            continue
        if stripped.startswith("#SBATCH"):
            words = stripped[len("#SBATCH"):].split()
            _collect(words, lineno, out.sbatch, {})
            continue
        line = _substitute(line, env)
        try:
            words = shlex.split(line, comments=True)
        except ValueError as err:
            raise SpecError(f"{path}:{lineno}: cannot split the line into words: {err}") from None
        for word in words:  # NAME=value assignments, e.g. GPT_ARGS="--num-layers 80 ..."
            m = _ASSIGN.match(word)
            if m and not word.split("=", 1)[1].startswith("("):
                env[m.group(1)] = word.split("=", 1)[1]
                _collect(_split_quiet(env[m.group(1)]), lineno, out.values, out.lines)
        _collect(words, lineno, out.values, out.lines)
    return out


def _split_quiet(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def _collect(words: list[str], lineno: int, values: dict, lines: dict) -> None:
    i = 0
    while i < len(words):
        w = words[i].strip("()")
        if w.startswith("--") and len(w) > 2:
            flag, eq, value = w.partition("=")
            flag = "--nproc-per-node" if flag == "--nproc_per_node" else flag
            if not eq:
                value = None
                nxt = words[i + 1].strip("()") if i + 1 < len(words) else ""
                if flag not in SWITCHES and nxt and not nxt.startswith("--"):
                    value, i = nxt, i + 1
            values[flag] = value
            lines[flag] = lineno
        i += 1


def _gpus(f: Flags, override: int | None) -> int:
    if override is not None:
        return override
    if "num_gpus" in f.notes:
        return int(f.notes["num_gpus"])
    nnodes, nproc = f.get("--nnodes"), f.get("--nproc-per-node")
    if nproc and str(nproc).isdigit():
        if nnodes is not None and str(nnodes).isdigit():
            return int(nnodes) * int(nproc)
        nodes = f.sbatch.get("--nodes") or f.sbatch.get("-N")
        if nodes and str(nodes).isdigit():
            return int(nodes) * int(nproc)
        if f.has("--standalone") or nnodes is None:
            return int(nproc)
    nodes, per_node = f.sbatch.get("--nodes"), f.sbatch.get("--gpus-per-node")
    if nodes and per_node and str(nodes).isdigit() and str(per_node).isdigit():
        return int(nodes) * int(per_node)
    raise SpecError(f"{f.path}: cannot tell the GPU count: no torchrun --nnodes/--nproc-per-node, no #SBATCH "
                    "--nodes/--gpus-per-node and no '# plan3d: num_gpus=N'; pass --gpus")


def _require(f: Flags, *flags: str) -> None:
    missing = [x for x in flags if not f.has(x)]
    if missing:
        raise SpecError(f"{f.path}: no {', '.join(missing)}: not a Megatron-LM launch (or add the flags)")


def model_from_flags(f: Flags) -> dict:
    _require(f, "--num-layers", "--hidden-size", "--num-attention-heads", "--vocab-size")
    h, heads = f.int("--hidden-size"), f.int("--num-attention-heads")
    dropout = f.float("--attention-dropout", 0.1) > 0 or f.float("--hidden-dropout", 0.1) > 0
    pos = {"learned_absolute": "learned", "rope": "rope", "none": "alibi"}.get(
        f.get("--position-embedding-type", "learned_absolute"), "rope")
    if f.has("--use-rotary-position-embeddings"):
        pos = "rope"
    model = {
        "name": f.notes.get("name", f.path.stem),
        "num_layers": f.int("--num-layers"), "hidden_size": h, "num_attention_heads": heads,
        "num_kv_heads": f.int("--num-query-groups") if f.has("--group-query-attention") else None,
        "head_dim": f.int("--kv-channels"), "ffn_hidden_size": f.int("--ffn-hidden-size"),
        "vocab_size": f.int("--vocab-size"), "max_seq_len": f.int("--max-position-embeddings"),
        "activation": "swiglu" if f.has("--swiglu") else "gelu",
        "norm": "rmsnorm" if f.get("--normalization") == "RMSNorm" else "layernorm",
        "tied_embeddings": not f.has("--untie-embeddings-and-output-weights"),
        "position_embedding": pos, "linear_bias": not f.has("--disable-bias-linear"),
        "qkv_bias": True if f.has("--add-qkv-bias") else None,
        "embedding_norm": f.notes.get("embedding_norm") == "true", "dropout": dropout,
    }
    return model


def _zero_stage(f: Flags) -> int:
    if f.has("--zero-stage"):
        return f.int("--zero-stage")
    if f.has("--use-megatron-fsdp"):
        strategy = f.get("--data-parallel-sharding-strategy", "no_shard")
        return {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}.get(strategy, 0)
    return 1 if f.has("--use-distributed-optimizer") else 0


def _layers_per_stage(f: Flags, layers: int, pp: int) -> list[int] | None:
    if f.has("--pipeline-model-parallel-layout"):
        from planner.emit.megatron import layout_layers

        return list(layout_layers(str(f.get("--pipeline-model-parallel-layout")), pp)[0])
    first, last = f.int("--decoder-first-pipeline-num-layers"), f.int("--decoder-last-pipeline-num-layers")
    if pp == 1 or (first is None and last is None):
        return None
    ends = [x for x in (first, last) if x is not None]
    rest, others = layers - sum(ends), pp - len(ends)
    if others == 0:
        return [first, last]
    if rest % others:
        raise SpecError(f"{f.path}:{f.line('--decoder-first-pipeline-num-layers', '--decoder-last-pipeline-num-layers')}: "
                        f"{rest} remaining layers do not split evenly over {others} stages")
    middle = [rest // others] * others
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def scenario_from_flags(f: Flags, hardware: HardwareSpec, gpus: int | None) -> Scenario:
    _require(f, "--seq-length", "--micro-batch-size")
    model = build(ModelSpec, model_from_flags(f), f"{f.path}:{f.line('--num-layers')}")
    tp, pp, cp = (f.int(x, 1) for x in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                        "--context-parallel-size"))
    n = _gpus(f, gpus)
    if n % (tp * pp * cp):
        raise SpecError(f"{f.path}:{f.line('--tensor-model-parallel-size')}: {n} GPUs are not divisible by "
                        f"tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp}")
    dp = n // (tp * pp * cp)
    mbs = f.int("--micro-batch-size")
    vpp = 1
    if f.has("--num-layers-per-virtual-pipeline-stage"):
        per_chunk = f.int("--num-layers-per-virtual-pipeline-stage")
        vpp = max(1, model.num_layers // (pp * per_chunk)) if per_chunk else 1
    elif f.has("--num-virtual-stages-per-pipeline-rank"):
        vpp = f.int("--num-virtual-stages-per-pipeline-rank")
    elif f.has("--pipeline-model-parallel-layout"):
        from planner.emit.megatron import layout_layers

        vpp = layout_layers(str(f.get("--pipeline-model-parallel-layout")), pp)[1]
    granularity = f.get("--recompute-granularity") or ("selective" if f.has("--recompute-activations") else None)
    training = {"num_gpus": n, "global_batch_size": f.int("--global-batch-size", mbs * dp),
                "seq_len": f.int("--seq-length"), "precision": "fp8" if f.has("--fp8-format") else "bf16",
                "attention": "materialized" if f.get("--attention-backend") == "unfused" else "flash",
                "overlap_grad_reduce": f.has("--overlap-grad-reduce"),
                "grad_reduce_in_bf16": f.has("--grad-reduce-in-bf16")}
    plan = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "vpp": vpp, "micro_batch_size": mbs,
            "recompute": granularity or "none", "sequence_parallel": f.has("--sequence-parallel"),
            "zero_stage": _zero_stage(f), "layers_per_stage": _layers_per_stage(f, model.num_layers, pp)}
    where = f"{f.path}:{f.line('--tensor-model-parallel-size', '--micro-batch-size')}"
    return build(Scenario, {"model": model.model_dump(), "hardware": hardware.model_dump(),
                            "training": training, "plan": plan}, where)


def is_plan_file(path: Path) -> bool:
    if path.suffix not in (".json", ".yaml", ".yml"):
        return False
    doc = read_document(path)
    return isinstance(doc, dict) and "plan" in doc and "model" in doc


@dataclass
class CheckResult:
    path: Path
    line: int
    scenario: Scenario | None = None
    errors: list[str] = field(default_factory=list)


def check_file(path: Path, hardware: HardwareSpec | None, headroom: float | None, gpus: int | None) -> CheckResult:
    """One file's scenario, on ``hardware`` (a plan file keeps its own when none is given)."""
    try:
        if not path.is_file():
            raise SpecError(f"{path}: no such file")
        if is_plan_file(path):
            sc = load_scenario(str(path))
            hw = hardware or sc.hardware
            line = 1
        else:
            if hardware is None:
                raise SpecError(f"{path}: --hardware is required to check a Megatron-LM launch")
            flags = read_flags(path)
            sc, hw = scenario_from_flags(flags, hardware, gpus), hardware
            line = flags.line("--micro-batch-size", "--tensor-model-parallel-size")
        if headroom is not None:
            hw = hw.model_copy(update={"fragmentation_headroom": headroom})
        return CheckResult(path=path, line=line, scenario=sc.model_copy(update={"hardware": hw}))
    except SpecError as err:
        return CheckResult(path=path, line=_error_line(err), errors=err.lines)


def _error_line(err: SpecError) -> int:
    m = re.match(r"[^:]+:(\d+):", err.lines[0]) if err.lines else None
    return int(m.group(1)) if m else 1


def to_json(results: list[CheckResult]) -> str:
    from planner.memory import estimate_scenario_memory

    out = []
    for r in results:
        if r.errors:
            out.append({"file": str(r.path), "line": r.line, "valid": False, "errors": r.errors})
            continue
        mem = estimate_scenario_memory(r.scenario)
        out.append({"file": str(r.path), "line": r.line, "valid": True, "fits": mem.fits,
                    "plan": r.scenario.resolved_plan().model_dump(), "memory": mem.to_dict()})
    return json.dumps(out, indent=2)
