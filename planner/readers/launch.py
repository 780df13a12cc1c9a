"""Find the training launch in a script's commands: the launcher (torchrun, deepspeed, srun), the
program it starts, the program's arguments, and the GPU count the launcher gives it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from planner.presets import SpecError
from planner.readers.args import Args, parse_args
from planner.readers.bash import Command, is_unknown, unknown_sources

# Megatron-LM entry points that build a model plan3d does not model, with the reason.
UNMODELLED_PROGRAMS = {
    "pretrain_mamba.py": "a Mamba (state-space) or hybrid Mamba-Transformer model, which plan3d does not model",
    "pretrain_hybrid.py": "a hybrid model, which plan3d does not model",
    "pretrain_bert.py": "a BERT encoder, which plan3d does not model (decoder-only GPT models only)",
    "pretrain_t5.py": "a T5 encoder-decoder, which plan3d does not model (decoder-only GPT models only)",
    "pretrain_retro.py": "a RETRO model, which plan3d does not model",
    "pretrain_vlm.py": "a vision-language model, which plan3d does not model",
    "pretrain_ict.py": "an ICT retriever, which plan3d does not model",
}
MEGATRON_PROGRAMS = {"pretrain_gpt.py", "pretrain_gpt_core.py"}  # pretrain_gpt_core.py: Megatron-LM 2023
TORCHRUN = {"torchrun", "torch.distributed.run", "torch.distributed.launch"}
PYTHON = re.compile(r"^python(\d(\.\d+)?)?$")


@dataclass
class Launch:
    kind: str                 # megatron | torchtitan | unmodelled
    program: str
    args: Args                # the program's arguments
    launcher: str | None      # torchrun | deepspeed | srun | None
    launcher_args: Args | None
    srun_args: Args | None
    line: int
    words: list[str]          # the program's arguments as words
    reason: str = ""
    env: dict = field(default_factory=dict)  # the script's variables when the launch runs (bash.Command.env)


def _base(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def find_launches(commands: list[Command], path: Path) -> list[Launch]:
    """Every command that starts a training program plan3d knows (or knows it does not model)."""
    out = []
    for cmd in commands:
        launch = _classify(cmd, path)
        if launch is not None:
            out.append(launch)
    return out


def _classify(cmd: Command, path: Path) -> Launch | None:
    """The program a command starts (the first ``*.py`` or ``-m module`` word), its launcher (the
    nearest torchrun / ``python -m torch.distributed.run`` / deepspeed before it) and srun/mpirun."""
    argv, lines = cmd.argv, cmd.lines or [cmd.line] * len(cmd.argv)
    # `echo $CMD` prints the launch and runs nothing; `eval $CMD` runs it, and bash.py evaluates that string as its
    # own commands (one of which is the launch)
    if _base(argv[0]) in ("echo", "printf", "eval"):
        return None
    prog, kind, start = None, None, 0
    for j, word in enumerate(argv):
        if word == "-m" and j + 1 < len(argv):
            if argv[j + 1] in TORCHRUN:
                continue
            if argv[j + 1] == "torchtitan.train":
                prog, kind, start = j + 1, "torchtitan", j + 2
            break
        if word.endswith(".py"):
            name = _base(word)
            if name in UNMODELLED_PROGRAMS:
                prog, kind = j, "unmodelled"
            elif name in MEGATRON_PROGRAMS:
                prog, kind = j, "megatron"
            elif word.endswith("torchtitan/train.py"):
                prog, kind = j, "torchtitan"
            elif any(_base(x) in ("torchrun", "deepspeed", "srun") for x in argv[:j]):
                prog, kind = j, "unknown"  # a distributed launch of a program check does not read
            start = j + 1
            break
    if prog is None:
        return None
    launcher, launcher_words, srun_words = None, None, None
    for i in range(prog - 1, -1, -1):
        word = _base(argv[i])
        if launcher is None and (word in ("torchrun", "deepspeed") or
                                 (word == "-m" and i + 1 < len(argv) and argv[i + 1] in TORCHRUN)):
            launcher = "deepspeed" if word == "deepspeed" else "torchrun"
            first = i + 1 if word != "-m" else i + 2
            launcher_words = (argv[first:prog], lines[first:prog])
        elif word in ("srun", "mpirun", "mpiexec"):
            end = next((k for k in range(i + 1, prog + 1) if _is_program(argv[k])), prog)
            srun_words = (argv[i + 1:end], lines[i + 1:end])
            launcher = launcher or "srun"
            break
    out = _launch(kind, argv[prog], argv, lines, start, launcher, launcher_words, srun_words, cmd, path)
    if kind == "unmodelled":
        out.reason = f"{_base(argv[prog])} trains {UNMODELLED_PROGRAMS[_base(argv[prog])]}"
    if kind == "unknown":
        out.reason = (f"{launcher} starts {_base(argv[prog])}, a program check does not read (it reads Megatron-LM's "
                      "pretrain_gpt.py, Megatron-DeepSpeed's and torchtitan.train); write the plan with `plan3d "
                      "search --out` and check that")
    return out


def _is_program(word: str) -> bool:
    return bool(PYTHON.match(_base(word))) or _base(word) in ("torchrun", "deepspeed", "bash", "sh") \
        or word.endswith(".py")


def _launch(kind, program, argv, lines, start, launcher, launcher_words, srun_words, cmd, path) -> Launch:
    args = parse_args(argv[start:], lines[start:], path, line0=cmd.line)
    largs = parse_args(*launcher_words, path, line0=cmd.line, underscores=True) if launcher_words else None
    sargs = parse_args(*srun_words, path, line0=cmd.line, underscores=True) if srun_words else None
    return Launch(kind=kind, program=program, args=args, launcher=launcher, launcher_args=largs, srun_args=sargs,
                  line=cmd.line, words=list(argv[start:]), env=dict(cmd.env))


#: PyTorch's own parse of ``CUBLAS_WORKSPACE_CONFIG`` (aten/src/ATen/cuda/CublasHandlePool.cpp,
#: ``parseChosenWorkspaceSize``): every ``:SIZE:COUNT`` pair, SIZE in KiB
CUBLAS_WORKSPACE_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_mib(launch: Launch, path: Path) -> tuple[float | None, str | None]:
    """(PyTorch's cuBLAS workspace per GEMM thread in MiB, a note) where the script sets ``CUBLAS_WORKSPACE_CONFIG``
    before the launch (NVIDIA's deterministic Megatron-LM runs export ``:4096:8``, 32 MiB, whatever the GPU): the sum
    of its ``:SIZE:COUNT`` pairs, as PyTorch reads it; ``(None, note)`` where the value is unknown or PyTorch would
    not parse it (it then warns and keeps its default, the hardware profile's ``blas_workspace_mib``)."""
    value = launch.env.get("CUBLAS_WORKSPACE_CONFIG")
    if value is None or not isinstance(value, str):
        return None, None
    if is_unknown(value):
        return None, (f"{path}: CUBLAS_WORKSPACE_CONFIG comes from {', '.join(unknown_sources(value))}: the profile's "
                      "cuBLAS workspace is used")
    pairs = CUBLAS_WORKSPACE_PAIR.findall(value)
    if not pairs:
        return None, (f"{path}: CUBLAS_WORKSPACE_CONFIG={value} does not parse as :SIZE:COUNT pairs; PyTorch keeps its "
                      "default workspace, the profile's")
    mib = sum(int(size) * int(count) for size, count in pairs) / 1024
    return mib, f"CUBLAS_WORKSPACE_CONFIG={value}: PyTorch's cuBLAS workspace {mib:g} MiB per GEMM thread"


#: The variables HybridEP reads for the expert group's ranks per NVLink domain: deepseek-ai/DeepEP hybrid-ep
#: ``deep_ep/hybrid_ep_buffer.py`` (@ 098da2a6 ``NUM_OF_RANKS_PER_NVLINK_DOMAIN``; later
#: ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN``, the name NVIDIA's Megatron-Bridge recipes export), the later first
HYBRIDEP_DOMAIN_VARS = ("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "NUM_OF_RANKS_PER_NVLINK_DOMAIN")


def hybridep_ranks_per_domain(launch: Launch, path: Path) -> tuple[int | None, str | None]:
    """(the expert group's ranks per NVLink domain HybridEP is told, a note) where the script exports one of
    ``HYBRIDEP_DOMAIN_VARS`` before the launch (``TrainingSpec.hybridep_ranks_per_domain``); ``(None, note)`` where
    the value is unknown, ``(None, None)`` where it is not set (plan3d then takes the layout's)."""
    for name in HYBRIDEP_DOMAIN_VARS:
        value = launch.env.get(name)
        if value is None or not isinstance(value, str):
            continue
        if is_unknown(value):
            return None, (f"{path}: {name} comes from {', '.join(unknown_sources(value))}: HybridEP's buffer is sized "
                          "with the ranks the layout puts in one NVLink domain")
        if not value.strip().isdigit() or int(value) < 1:
            raise SpecError(f"{path}: {name}={value} is not a whole number of ranks; HybridEP reads it with int()")
        return int(value), f"{name}={value}: HybridEP's buffer is sized for NVLink domains of {int(value)} ranks"
    return None, None


def _known_int(value, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None or is_unknown(value):
        return None
    if not str(value).isdigit():
        raise SpecError(f"{what}: '{value}' is not a whole number of GPUs or nodes")
    return int(value)


def world_size(launch: Launch, sbatch: dict, path: Path) -> int:
    """Processes (one per GPU) the launcher starts.

    torchrun: ``--nnodes`` x ``--nproc-per-node`` (torchrun's defaults are 1 and 1; an unknown
    ``--nnodes`` such as ``$SLURM_NNODES`` is the Slurm node count, torchrun being started once per
    node). deepspeed: ``--num_nodes`` x ``--num_gpus``. srun running the program itself: its tasks.
    """
    sb_nodes = _known_int(sbatch.get("--nodes") or sbatch.get("-N"), f"{path}: #SBATCH --nodes")
    s = launch.srun_args
    srun_nodes = _known_int(s.values.get("--nodes") or s.values.get("-N"), f"{path}: srun --nodes") if s else None
    nodes = srun_nodes or sb_nodes
    la = launch.launcher_args
    if launch.launcher == "torchrun" and la is not None:
        raw_nproc = la.values.get("--nproc-per-node", "1")
        if raw_nproc is not None and not is_unknown(str(raw_nproc)) and not str(raw_nproc).isdigit():
            raise SpecError(f"{path}:{la.line('--nproc-per-node')}: torchrun --nproc-per-node {raw_nproc} depends on "
                            "the machine; pass --gpus")
        nproc = _known_int(raw_nproc, f"{path}: torchrun --nproc-per-node")
        raw_nnodes = la.values.get("--nnodes", "1")
        if raw_nnodes is not None and ":" in str(raw_nnodes) and not is_unknown(str(raw_nnodes)):
            lo, _, hi = str(raw_nnodes).partition(":")
            if lo != hi:
                raise SpecError(f"{path}:{la.line('--nnodes')}: torchrun --nnodes {raw_nnodes} is elastic; pass --gpus")
            raw_nnodes = lo
        nnodes = _known_int(raw_nnodes, f"{path}: torchrun --nnodes") or nodes
        if nproc is None:
            raise SpecError(f"{path}:{la.line('--nproc-per-node')}: torchrun --nproc-per-node comes from "
                            f"{', '.join(unknown_sources(str(raw_nproc)))}, which the script does not set; pass --gpus")
        if nnodes is None:
            raise SpecError(f"{path}:{la.line('--nnodes')}: torchrun --nnodes comes from "
                            f"{', '.join(unknown_sources(str(raw_nnodes)))}, which the script does not set and no "
                            "#SBATCH --nodes gives; pass --gpus")
        return nnodes * nproc
    if launch.launcher == "deepspeed" and la is not None:
        gpus = _known_int(la.values.get("--num-gpus"), f"{path}: deepspeed --num_gpus")
        if gpus is None:
            raise SpecError(f"{path}:{launch.line}: deepspeed without --num_gpus uses every GPU of the hosts; pass --gpus")
        if la.has("--num-nodes"):
            n = _known_int(la.values.get("--num-nodes"), f"{path}: deepspeed --num_nodes")
        elif la.has("--hostfile"):
            n = None
        else:
            n = 1
        if n is None:
            raise SpecError(f"{path}:{launch.line}: deepspeed --hostfile without a known --num_nodes; pass --gpus")
        return n * gpus
    if launch.launcher == "srun" and s is not None:
        tasks = _known_int(s.values.get("--ntasks") or s.values.get("-n") or s.values.get("-np"),
                           f"{path}: srun --ntasks")
        per_node = _known_int(s.values.get("--ntasks-per-node") or sbatch.get("--ntasks-per-node"),
                              f"{path}: --ntasks-per-node")
        if tasks:
            return tasks
        if per_node and nodes:
            return per_node * nodes
        raise SpecError(f"{path}:{launch.line}: srun without a known --ntasks or --nodes x --ntasks-per-node; "
                        "pass --gpus")
    if launch.launcher is None:
        return 1
    raise SpecError(f"{path}:{launch.line}: cannot tell the GPU count; pass --gpus")
