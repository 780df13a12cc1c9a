"""What every `plan3d` command shares: the typer app, the option types, error handling, the console.

Precedence of settings: CLI flag > plan file > preset > model default.
Bad input ends with one line per problem on stderr and exit code 2, never a traceback.
Command modules import from here; this module imports no command module, so there is no cycle.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from typing import Annotated, Callable, Optional

import typer
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors click as typer._click; its exceptions are not click's
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer on the real click
    from click import exceptions as click_exc

from planner.errors import MAX_COUNT, MAX_GPUS, SpecError

def terminal_columns() -> int:
    """The terminal width: ``COLUMNS`` when set (as CI and tests set it), else the tty's, else 120."""
    try:
        cols = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        cols = 0
    return cols if cols > 0 else shutil.get_terminal_size((120, 24)).columns


class OneLineErrors(TyperGroup):
    """click's usage errors (a bad option value, an unknown option, a missing one) as one ``error:`` line.

    click prints a usage block, a hint and a boxed message; plan3d's contract is one line naming the
    field, exit code 2, as for every other bad input.
    """

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click_exc.NoArgsIsHelpError as err:
            err.show()
            sys.exit(err.exit_code)
        except click_exc.ClickException as err:
            hint = ""
            ctx = getattr(err, "ctx", None)
            if isinstance(err, click_exc.UsageError) and ctx is not None:
                hint = f" (see '{ctx.command_path} --help')"
            message = " ".join(err.format_message().split())
            typer.echo(f"error: {message}{hint}", err=True)
            sys.exit(err.exit_code)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="plan3d",
    cls=OneLineErrors,
    help="Plan 3D-parallel (TP x PP x DP) training of large transformers: memory, step time, best plan, launch files.",
    # Plain click help: it wraps to any terminal width. typer's rich option tables squeeze the help
    # column to one word per line under ~100 columns, and beside long flag pairs even at 120.
    rich_markup_mode=None,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 1
EXIT_INFEASIBLE = 3

# --- shared options -----------------------------------------------------------------------------

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model preset name, YAML/JSON spec, or Hugging Face config.json.", rich_help_panel="Job")]
HardwareOpt = Annotated[str, typer.Option("--hardware", "-H", help="Hardware preset name or YAML/JSON profile.", rich_help_panel="Job")]
GlobalBatchOpt = Annotated[int, typer.Option("--global-batch", min=1, max=MAX_COUNT, help="Global batch size in sequences.", rich_help_panel="Job")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", min=1, max=MAX_COUNT, help="Sequence length in tokens.", rich_help_panel="Job")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress spinner; search prints only the best plan's line.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite output files that exist.")]

OptModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model preset, YAML/JSON spec or HF config.json.", rich_help_panel="Job")]
OptHardwareOpt = Annotated[Optional[str], typer.Option("--hardware", "-H", help="Hardware preset or profile file.", rich_help_panel="Job")]
OptGpusOpt = Annotated[Optional[int], typer.Option("--gpus", min=1, max=MAX_GPUS, help="Number of GPUs.", rich_help_panel="Job")]
OptGlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", min=1, max=MAX_COUNT, help="Global batch in sequences.", rich_help_panel="Job")]
OptSeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", min=1, max=MAX_COUNT, help="Sequence length.", rich_help_panel="Job")]

TpOpt = Annotated[Optional[int], typer.Option("--tp", min=1, max=MAX_GPUS, help="Tensor-parallel degree.", rich_help_panel="Plan")]
PpOpt = Annotated[Optional[int], typer.Option("--pp", min=1, max=MAX_GPUS, help="Pipeline-parallel degree.", rich_help_panel="Plan")]
VppOpt = Annotated[Optional[int], typer.Option("--vpp", min=1, max=1024, help="Virtual stages per pipeline rank (interleaved 1F1B).", rich_help_panel="Plan")]
CpOpt = Annotated[Optional[int], typer.Option("--cp", min=1, max=MAX_GPUS, help="Context-parallel degree.", rich_help_panel="Plan")]
MoeDispatcherOpt = Annotated[Optional[str], typer.Option("--moe-dispatcher", help="MoE token dispatch: alltoall (what plan3d emits), allgather (Megatron-Core's default when the flag is left out) deepep (--moe-token-dispatcher-type flex with DeepEP) or hybridep (the flex dispatcher with NVIDIA's HybridEP backend).", rich_help_panel="Job")]
MoeA2aOverlapOpt = Annotated[Optional[bool], typer.Option("--moe-a2a-overlap/--no-moe-a2a-overlap", help="Overlap the MoE all-to-all with another micro-batch's compute (Megatron --overlap-moe-expert-parallel-comm); default off.", rich_help_panel="Job")]
CudaGraphOpt = Annotated[Optional[str], typer.Option("--cuda-graph-modules", help="Per-layer parts captured in CUDA graphs, comma-separated: attn, moe_router, moe_preprocess, or moe (the whole MoE layer: drop-and-pad routing only) (Megatron --cuda-graph-impl transformer_engine --cuda-graph-scope); default none.", rich_help_panel="Job")]
MoeImbalanceOpt = Annotated[Optional[float], typer.Option("--moe-load-imbalance", min=1.0, max=1000.0, help="Tokens on the busiest expert-parallel rank over the mean (default 1.0, balanced).", rich_help_panel="Job")]
KeptOutputsOpt = Annotated[Optional[str], typer.Option("--pipeline-kept-outputs", help="Stage outputs torch.distributed.pipelining keeps until the step ends: none (torchtitan 0.3.0, return_outputs=False; default), last (torch's default step(), the loss stage) or all (torch before 2025-05: every stage); torchtitan and torch only.", rich_help_panel="Job")]
OptimizerOpt = Annotated[Optional[str], typer.Option("--optimizer", help="adam (default) or Megatron-Core's Muon: muon, or dist_muon (its layer-wise distributed form); megatron and nemo, ZeRO 0 (Megatron --optimizer).", rich_help_panel="Job")]
DistOptInstancesOpt = Annotated[Optional[int], typer.Option("--dist-optimizer-instances", min=1, max=1_000_000, help="Copies of Megatron's distributed optimizer across the data-parallel ranks (--num-distributed-optimizer-instances; megatron and nemo, ZeRO 1): each shards its states over dp x cp / N.", rich_help_panel="Job")]
DistributeSavedOpt = Annotated[Optional[bool], typer.Option("--distribute-saved-activations", help="Under full recompute keep 1/tp of each checkpointed layer input (Megatron --distribute-saved-activations: tp > 1, no sequence parallelism).", rich_help_panel="Job")]
GradBf16Opt = Annotated[Optional[bool], typer.Option("--grad-reduce-in-bf16/--no-grad-reduce-in-bf16", help="Gradients kept and reduced in bf16 (Megatron --grad-reduce-in-bf16; NeMo grad_sync_dtype bf16); default fp32.", rich_help_panel="Job")]
Fp8ParamsOpt = Annotated[Optional[bool], typer.Option("--fp8-params/--no-fp8-params", help="fp8 weights with no bf16 copy (Megatron --fp8-param-gather, NeMo fp8_params); fp8 or mxfp8 with megatron/nemo and ZeRO 1.", rich_help_panel="Job")]
CompileOpt = Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="torch.compile of each block and the loss (torchtitan --compile.enable, components model,loss); torchtitan only; default off.", rich_help_panel="Job")]
RecomputeModulesOpt = Annotated[Optional[str], typer.Option("--recompute-modules", help="What selective recompute recomputes, comma-separated: core_attn (default), mla_up_proj, mlp, moe_act, moe, shared_experts, layernorm (Megatron --recompute-modules; megatron and nemo).", rich_help_panel="Job")]
CrossEntropyFusionOpt = Annotated[Optional[str], typer.Option("--cross-entropy-fusion", help="Megatron's loss kernel: none (default), native (--cross-entropy-loss-fusion) or te (+ --cross-entropy-fusion-impl te: 2 B per logit, not 6).", rich_help_panel="Job")]
Fp8RecipeOpt = Annotated[Optional[str], typer.Option("--fp8-recipe", help="Scaling of fp8: delayed (default; Megatron --fp8-recipe delayed), tensorwise (current scaling, NVIDIA's FP8-CS recipes) or blockwise (1x128 / 128x128 block scales, DeepSeek-V3's recipe; megatron and nemo).", rich_help_panel="Job")]
OptimizerDtypeOpt = Annotated[Optional[str], typer.Option("--optimizer-dtype", help="Adam state dtype: fp32 (default); bf16: Megatron-Core's precision-aware optimizer (--use-precision-aware-optimizer with bf16 moments; ZeRO 1), under megatron and nemo (NeMo 2); bf16-apex: NeMo 1's Apex distributed_fused_adam with optim.dtype bf16 (nemo only).", rich_help_panel="Job")]
ScheduleOpt = Annotated[Optional[str], typer.Option("--pipeline-schedule", help="1f1b, interleaved, interleaved_zb, zbv or dualpipev (docs/schedules.md); default 1f1b, or interleaved with --vpp > 1; search picks among those --framework runs.", rich_help_panel="Plan")]
RecomputeLayersOpt = Annotated[Optional[int], typer.Option("--recompute-num-layers", min=1, max=100000, help="With --recompute full: recompute only the first N layers of each model chunk (Megatron --recompute-method block --recompute-num-layers N); megatron and nemo. Estimated, not searched.", rich_help_panel="Plan")]
RecomputeIntervalOpt = Annotated[Optional[int], typer.Option("--recompute-interval", min=1, max=100000, help="With --recompute full: recompute only every N-th layer of each pipeline rank (torchtitan --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option N, TOML-era torchtitan); torchtitan. Estimated, not searched.", rich_help_panel="Plan")]
RecomputeGroupOpt = Annotated[Optional[int], typer.Option("--recompute-group-layers", min=2, max=100000, help="With --recompute full: recompute each model chunk's layers in groups of N, each checkpointed at its input (Megatron --recompute-method uniform --recompute-num-layers N); megatron and nemo. Estimated, not searched.", rich_help_panel="Plan")]
OffloadOpt = Annotated[Optional[int], typer.Option("--cpu-offload-layers", min=0, max=100000, help="Layers whose activations go to host memory (Megatron --cpu-offloading-num-layers; pp 1, no recompute).", rich_help_panel="Plan")]
EpOpt = Annotated[Optional[int], typer.Option("--ep", min=1, max=MAX_GPUS, help="Expert-parallel degree (MoE; Megatron --expert-model-parallel-size), drawn from the tp x cp x dp ranks.", rich_help_panel="Plan")]
EtpOpt = Annotated[Optional[int], typer.Option("--etp", min=1, max=MAX_GPUS, help="Expert tensor-parallel degree (MoE; Megatron --expert-tensor-parallel-size); default tp.", rich_help_panel="Plan")]
MbsOpt = Annotated[Optional[int], typer.Option("--micro-batch-size", min=1, max=MAX_GPUS, help="Sequences per micro-batch.", rich_help_panel="Plan")]
RecomputeOpt = Annotated[Optional[str], typer.Option("--recompute", help="none, selective or full.", rich_help_panel="Plan")]
SpOpt = Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel", help="Megatron sequence parallelism.", rich_help_panel="Plan")]
ZeroOpt = Annotated[Optional[int], typer.Option("--zero-stage", min=0, max=3, help="0-3; 1 = distributed optimizer.", rich_help_panel="Plan")]
GroupOpt = Annotated[Optional[int], typer.Option("--microbatch-group-size", min=1, max=MAX_COUNT, help="Interleaved 1F1B: micro-batches per virtual-stage group (Megatron --microbatch-group-size-per-virtual-pipeline-stage); default pp.", rich_help_panel="Plan")]
LayersOpt = Annotated[Optional[str], typer.Option("--layers-per-stage", help="Uneven pipeline: layers of each stage, comma-separated (18,22,22,18); default even split.", rich_help_panel="Plan")]
PrecisionOpt = Annotated[Optional[str], typer.Option("--precision", help="bf16, fp16 (Megatron --fp16, DeepSpeed fp16; costed as bf16), fp8, mxfp8 or nvfp4 (the last two on Blackwell).", rich_help_panel="Job")]
AttentionOpt = Annotated[Optional[str], typer.Option("--attention", help="flash (default: the GPU's fastest fused kernel), flash2 (FlashAttention-2's speed: flash-attn 2, torch SDPA on Hopper before torch 2.9) or materialized attention scores.", rich_help_panel="Job")]
OverlapOpt = Annotated[Optional[bool], typer.Option("--overlap-grad-reduce/--no-overlap-grad-reduce", help="DP gradient reduction overlapped with backward (Megatron --overlap-grad-reduce; default on).", rich_help_panel="Job")]
TpOverlapOpt = Annotated[Optional[bool], typer.Option("--tp-comm-overlap/--no-tp-comm-overlap", help="Overlap TP collectives with GEMMs (Megatron --tp-comm-overlap, needs SP; torchtitan async TP); default: the framework's.", rich_help_panel="Job")]
P2pOverlapOpt = Annotated[Optional[bool], typer.Option("--overlap-p2p/--no-overlap-p2p", help="Overlap pipeline send/receive with the next chunk in the interleaved schedule; default: the framework's.", rich_help_panel="Job")]
FrameworkOpt = Annotated[Optional[str], typer.Option("--framework", help="megatron (default), nemo, torchtitan, deepspeed or torch: the framework that runs the plan; sets how weights, gradients, optimizer states and logits are held (docs/memory.md), the overlap defaults, and which plans search proposes; torch = torchtitan's torch.distributed semantics with plan3d validate's kernels.", rich_help_panel="Job")]


def fail(lines: list[str], code: int = EXIT_BAD_INPUT) -> None:
    """Print each problem on its own line to stderr and exit."""
    for line in lines:
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(code)


def handle_errors(fn: Callable) -> Callable:
    """Turn SpecError (bad input) into clean lines and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecError as err:
            fail(err.lines)

    return wrapper


def console(stderr: bool = False):
    """A rich console as wide as the terminal (``COLUMNS``); tables pick their layout from its width."""
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=False, width=terminal_columns())


def spinner(quiet: bool, text: str, animate: bool = True):
    """A transient status line on stderr while ``text``'s work runs. ``animate=False`` draws it once and starts no
    refresh thread: the search forks its table workers (planner.search.can_fork_workers), which a thread forbids."""
    import contextlib

    if quiet:
        return contextlib.nullcontext()
    if not animate:
        from rich.live import Live
        from rich.spinner import Spinner

        return Live(Spinner("dots", text), console=console(stderr=True), auto_refresh=False, transient=True)
    return console(stderr=True).status(text, spinner="dots")
