"""Command-line arguments as argparse reads them, with the source line of each flag."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from planner.presets import SpecError
from planner.readers.bash import is_unknown, unknown_sources

# Megatron-DeepSpeed's own switches (microsoft/Megatron-DeepSpeed megatron/arguments.py), which
# Megatron-LM core_v0.16.1 no longer has; and launcher switches (torchrun, deepspeed, srun).
EXTRA_SWITCHES = {
    "--deepspeed", "--checkpoint-activations", "--deepspeed-activation-checkpointing", "--no-pipeline-parallel",
    "--use-flash-attn", "--use-flash-attn-v2", "--use-flash-attn-triton", "--partition-activations",
    "--contigious-checkpointing", "--checkpoint-in-cpu", "--synchronize-each-layer", "--profile-backward",
    "--cpu-optimizer", "--cpu-torch-adam", "--no-query-key-layer-scaling", "--use-rotary-position-embeddings",
    "--recompute-activations", "--standalone", "--no-python", "--exclusive", "--no_local_rank", "--no-local-rank",
    "--use_env", "--use-env", "--embed-layernorm", "--fp8-e4m3", "--fp8-hybrid", "--bind_cores_to_rank",
    "--no_ssh_check", "--autotuning",
}


@lru_cache(maxsize=1)
def megatron_flag_table() -> tuple[frozenset, dict]:
    """Switches and multi-value options of Megatron-LM core_v0.16.1 (see megatron_flags.json)."""
    data = json.loads(resources.files("planner.readers").joinpath("megatron_flags.json").read_text())
    return frozenset(data["switches"]) | EXTRA_SWITCHES, data["nargs"]


@dataclass
class Args:
    """Flags of one command line: the last occurrence wins, as in argparse."""

    path: Path
    values: dict = field(default_factory=dict)   # flag -> str | None (switch) | list[str] (nargs)
    lines: dict = field(default_factory=dict)
    line0: int = 1

    def has(self, flag: str) -> bool:
        return flag in self.values

    def get(self, flag: str, default=None):
        value = self.values.get(flag, default)
        if isinstance(value, str) and is_unknown(value):
            raise SpecError(f"{self.path}:{self.line(flag)}: {flag}: the value comes from "
                            f"{', '.join(unknown_sources(value))}, which the script does not set "
                            "(check never reads the environment); set it in the script")
        return value

    def line(self, *flags: str) -> int:
        return min((self.lines[f] for f in flags if f in self.lines), default=self.line0)

    def int(self, flag: str, default: int | None = None) -> int | None:
        if flag not in self.values:
            return default
        value = self.get(flag)
        if isinstance(value, list):
            value = value[0] if value else None
        try:
            return int(str(value))
        except ValueError:
            raise SpecError(f"{self.path}:{self.line(flag)}: {flag}: '{value}' is not an integer") from None

    def count(self, flag: str, default: int | None = None) -> int | None:
        """A size that must be at least 1 (parallel degrees, batch sizes, divisors)."""
        value = self.int(flag, default)
        if value is not None and value < 1:
            raise SpecError(f"{self.path}:{self.line(flag)}: {flag}: {value} must be at least 1")
        return value

    def float(self, flag: str, default: float) -> float:
        if flag not in self.values:
            return default
        value = self.get(flag)
        try:
            return float(str(value))
        except ValueError:
            raise SpecError(f"{self.path}:{self.line(flag)}: {flag}: '{value}' is not a number") from None


def parse_args(words: list[str], lines: list[int], path: Path, line0: int = 1, underscores: bool = False) -> Args:
    """``--flag value``, ``--flag=value``, switches and multi-value options, in argparse's manner.

    A word such as ``"--fp8-format hybrid"`` (one argument holding a space, as a quoted array entry
    expanded with ``"${A[@]}"`` gives) is what argparse rejects ("unrecognized arguments"), so it is
    refused here too rather than read as the flag it looks like. ``underscores``: a launcher's flags,
    where ``--nproc_per_node`` and ``--nproc-per-node`` are one option (torchrun accepts both).
    """
    switches, nargs = megatron_flag_table()
    out = Args(path=path, line0=line0)
    i = 0
    while i < len(words):
        word, line = words[i], lines[i] if i < len(lines) else line0
        if underscores and re.fullmatch(r"-[A-Za-z]{1,3}", word):  # srun -N 2, -n 16, mpirun -np 16
            if i + 1 < len(words) and not words[i + 1].startswith("-"):
                out.values[word], out.lines[word] = words[i + 1], line
                i += 1
            i += 1
            continue
        if word.startswith("--") and len(word) > 2:
            flag, eq, value = word.partition("=")
            if " " in flag or "\n" in flag:  # a quoted entry (SpecError escapes its line breaks)
                raise SpecError(f"{path}:{line}: '{word}' is one argument (a quoted entry); Megatron-LM's argparse "
                                f"rejects it as unrecognized: write {flag.split()[0]} and its value as two words")
            flag = flag.replace("_", "-") if underscores else flag
            if eq:
                out.values[flag] = value
            elif flag in switches:
                out.values[flag] = None
            elif flag in nargs:
                count = nargs[flag]
                taken = []
                while i + 1 < len(words) and not words[i + 1].startswith("--") and (
                        not isinstance(count, int) or len(taken) < count):
                    taken.append(words[i + 1])
                    i += 1
                out.values[flag] = taken
            else:
                nxt = words[i + 1] if i + 1 < len(words) else None
                if nxt is not None and not nxt.startswith("--"):
                    out.values[flag] = nxt
                    i += 1
                else:
                    out.values[flag] = None
            out.lines[flag] = line
        i += 1
    return out
