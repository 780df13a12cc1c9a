"""Small generators of legal values for each knob of a plan, kept apart from the solver.

The same generators feed the CP-SAT search (``planner.search``) and the brute-force
``enumerate_plans`` that checks it. Each yields values in increasing order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterator

from planner import frameworks
from planner.specs import (HardwareSpec, ModelSpec, Plan, TrainingSpec, deepep_group_problem, hybridep_domain_problem, moe_plan_problems,
                           offload_problems, plan_problems)

RECOMPUTE = ("none", "selective", "full")
MAX_UNEVEN_VPP = 4  # unpinned, uneven splits are searched with vpp up to this (a pinned vpp is searched at any value)
MAX_UNEVEN_SHIFT = 3  # first/last stages may hold up to this many layers fewer (or more) than the middle ones
MIN_CP_CHUNK = 512  # tokens per CP half-chunk (the load-balanced split cuts the sequence into 2 cp chunks)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp(model: ModelSpec, hw: HardwareSpec, num_gpus: int, cross_node: bool = False) -> list[int]:
    """tp divides the heads, the KV heads (or is a multiple of them: KV replicated) and the FFN size,
    divides the GPU count, and stays inside a node unless ``cross_node``."""
    limit = num_gpus if cross_node else min(num_gpus, hw.nvlink_domain)
    g = model.kv_heads
    return [t for t in divisors(limit) if num_gpus % t == 0 and model.num_attention_heads % t == 0
            and (g % t == 0 or t % g == 0) and model.ffn_size % t == 0]


def valid_cp(training: TrainingSpec, max_cp: int = 16) -> list[int]:
    """cp splits the sequence into 2 * cp balanced chunks of at least MIN_CP_CHUNK tokens (Megatron's
    load-balanced causal split needs seq_len divisible by 2 * cp)."""
    s = training.seq_len
    return [c for c in range(1, max_cp + 1)
            if c == 1 or (s % (2 * c) == 0 and s // (2 * c) >= MIN_CP_CHUNK and training.num_gpus % c == 0)]


def valid_pp(model: ModelSpec, gpus_left: int) -> list[int]:
    """pp divides what is left of the GPUs after tp and cp, and is at most the layer count."""
    return [p for p in divisors(gpus_left) if p <= model.num_layers]


@dataclass(frozen=True)
class StageSplit:
    """How the layers sit on the stages: even (``first == middle == last``), or fewer on the ends."""

    pp: int
    vpp: int
    first: int
    middle: int
    last: int
    schedule: str | None = None  # Plan.pipeline_schedule: None (1f1b / interleaved) or a zero-bubble schedule

    @property
    def resolved_schedule(self) -> str:
        """The schedule run: ``schedule``, or 1f1b (interleaved when ``vpp > 1``), as ``Plan.schedule``."""
        return self.schedule or ("interleaved" if self.vpp > 1 else "1f1b")

    def layers(self) -> tuple[int, ...] | None:
        """``layers_per_stage`` for a Plan: None when even."""
        if self.first == self.middle == self.last:
            return None
        return (self.first,) + (self.middle,) * (self.pp - 2) + (self.last,) if self.pp > 1 else (self.first,)


def valid_splits(model: ModelSpec, pp: int, allow_uneven: bool = True, max_vpp: int = MAX_UNEVEN_VPP) -> list[StageSplit]:
    """Even splits with every vpp that divides a stage's layers, and splits whose first and/or last
    stage hold up to MAX_UNEVEN_SHIFT layers fewer or more than the equal middle stages (Megatron
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``, or its
    ``--pipeline-model-parallel-layout`` when interleaved): fewer where the embedding or the output
    layer weigh on time or memory, more where the other end is the lighter one. With pp > 2 the
    uneven splits come with every vpp that divides the middle stages too, up to ``max_vpp`` (the search
    passes a pinned vpp: NVIDIA's Llama 3.1 405B runs, 126 layers on PP8 x VP8 with 15 + 6 x 16 + 15,
    Megatron-Bridge performance summary)."""
    return list(_splits(model.num_layers, pp, allow_uneven, max_vpp))


@functools.lru_cache(maxsize=1024)
def _splits(L: int, pp: int, allow_uneven: bool, max_vpp: int = MAX_UNEVEN_VPP) -> tuple[StageSplit, ...]:
    out = []
    if L % pp == 0:
        n = L // pp
        out += [StageSplit(pp, v, n, n, n) for v in divisors(n) if v == 1 or pp > 1]
    if not allow_uneven or pp == 1:
        return tuple(out)
    for mid in range(1, L + 1):
        ends = L - (pp - 2) * mid  # layers left for the first and last stage together
        if ends < 2:
            break
        for first in range(max(1, mid - MAX_UNEVEN_SHIFT), mid + MAX_UNEVEN_SHIFT + 1):
            last = ends - first
            if last < max(1, mid - MAX_UNEVEN_SHIFT) or last > mid + MAX_UNEVEN_SHIFT or first == last == mid:
                continue
            if pp == 2 and (first == last or max(first, last) != mid):
                continue  # with two stages only the pair (first, last) matters: list it once
            out.append(StageSplit(pp, 1, first, mid, last))
            # interleaved too, with the ends lighter (the case of the embedding and the loss: Meta's
            # Llama 3 405B, 7 + 14 x 8 + 7): the middle stages split into vpp equal chunks, the ends as
            # Plan.chunk_layers says, one layer per chunk at least except rank 0's embedding chunk and the
            # last rank's loss chunk, which may hold none (specs.min_stage_layers: NVIDIA's 405B on
            # PP16 x VP8); vpp <= 4 keeps an unpinned search under 2 s
            if pp > 2 and max(first, last) <= mid:
                out += [StageSplit(pp, v, first, mid, last) for v in divisors(mid)
                        if 1 < v <= min(first + 1, last + 1, max_vpp)]
            elif pp == 2:  # no middle stage to divide: any vpp the two stages' chunks can hold (DeepSeek-V3's
                # 61 layers on PP2 x VP4/VP8, Megatron-Bridge performance summary 25.11/26.02)
                out += [StageSplit(pp, v, first, mid, last) for v in range(2, min(first + 1, last + 1, max_vpp) + 1)]
    return tuple(out)


def valid_expert(model: ModelSpec, hw: HardwareSpec, tp: int, cp: int, dp: int,
                 pins: Pins | None = None) -> list[tuple[int, int | None]]:
    """(ep, etp) pairs for a MoE model on a (tp, cp, dp) shape, Megatron-Core's folding rules
    (``specs.moe_plan_problems``): ``ep`` divides the experts, ``etp*ep`` divides ``tp*cp*dp``, ``etp``
    divides the expert width and the NVLink domain (expert TP stays on NVLink, as TP does). A dense
    model has only ``(1, None)``.

    Unpinned, etp is searched over 1 (NVIDIA's MoE recipes: Megatron-Bridge ``scripts/performance``
    configs set ``expert_tensor_parallel_size=1`` for DeepSeek-V3 and Qwen3) and tp (Megatron's
    default); a pinned etp may be any legal value. This keeps the table small enough (each etp value
    multiplies the shapes); ``enumerate_plans`` covers the same space. An etp equal to tp is returned as
    None (``Plan.etp``'s default), so a plan reads back from a launch file without the flag unchanged."""
    pins = pins or Pins()
    if not model.is_moe:
        return [(1, None)] if pins.ok(ep=1, etp=None) else []
    ranks = tp * cp * dp
    out = []
    etps = divisors(hw.nvlink_domain) if pins.etp is not None else sorted({1, tp})
    for etp in etps:
        if model.moe_ffn_size % etp or ranks % etp or hw.nvlink_domain % etp:
            continue
        for ep in divisors(model.num_experts):
            if ranks % (etp * ep) == 0 and pins.ok(ep=ep, etp=etp):
                out.append((ep, None if etp == tp else etp))  # None: Megatron's default, etp = tp
    return out


def valid_micro_batch_sizes(samples_per_replica: int, max_mbs: int = 16) -> list[int]:
    """micro_batch_size divides the sequences each replica processes per step."""
    return [b for b in divisors(samples_per_replica) if b <= max_mbs]


@dataclass(frozen=True)
class Pins:
    """Knobs the user fixed; None = searched."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    vpp: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    zero_stage: int | None = None
    ep: int | None = None
    etp: int | None = None
    pipeline_schedule: str | None = None  # 1f1b, interleaved, interleaved_zb, zbv or dualpipev
    cpu_offload_layers: int | None = None  # Plan.cpu_offload_layers

    def ok(self, **values) -> bool:
        return all(getattr(self, k) is None or getattr(self, k) == v for k, v in values.items())

    def sp_ok(self, tp: int, sp: bool) -> bool:
        """Whether a plan with this tp and sequence parallelism matches the pinned ``sequence_parallel``. A pin of
        True means SP wherever there is TP: at tp 1 the plan has none (Plan's own rule), as Megatron-LM turns
        ``--sequence-parallel`` off at tp 1 ("Disabling sequence parallelism because tensor model parallelism is
        disabled", core_v0.16.1 arguments.py validate_args), so a pinned tp of 1 with SP still has plans."""
        return self.sequence_parallel is None or sp == (self.sequence_parallel and tp > 1)


@dataclass(frozen=True)
class SearchSpace:
    """The legal values the search covers (see the generators above)."""

    pins: Pins = field(default_factory=Pins)
    allow_uneven: bool = True
    cross_node_tp: bool = False
    max_cp: int = 16
    max_micro_batch_size: int = 16
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    # job switches the search may choose (TrainingSpec fields of the same name; None: only the job's own). The
    # CLI offers both values where the user set neither (switch_options)
    grad_reduce_in_bf16: tuple[bool, ...] | None = None
    fp8_params: tuple[bool, ...] | None = None
    cross_entropy_fusion: tuple[str, ...] | None = None


def grad_dtype_options(training: TrainingSpec, given: bool | None) -> tuple[bool, ...] | None:
    """The gradient dtypes a search offers (``SearchSpace.grad_reduce_in_bf16``): both fp32 and bf16 where the
    user set neither (``given`` None), the job is mixed precision and the framework emits the choice
    (``FrameworkProfile.allows_grad_reduce_in_bf16``, Megatron ``--grad-reduce-in-bf16``); else only the job's own (None).

    Megatron-LM keeps fp32 main gradients by default, but NVIDIA's published runs set bf16
    (NeMo-Framework-Launcher ``examples/training/gpt/h100/175b_fp8_16node.sh`` and its other H100 examples:
    ``+training.model.optim.grad_sync_dtype=bf16``; Megatron-Bridge's performance scripts set
    ``cfg.ddp.grad_reduce_in_fp32 = False`` for every model, see benchmarks/megatron_bridge.py), so neither is
    assumed: the search takes bf16 only where it is faster (the ties go to fp32, ``search.search``) and
    says so in the plan."""
    if given is None and frameworks.get(training.framework).allows_grad_reduce_in_bf16 and training.precision != "fp32":
        return (False, True)
    return None


def fp8_params_options(training: TrainingSpec, given: bool | None) -> tuple[bool, ...] | None:
    """Whether a search offers fp8 weights with no bf16 copy (``SearchSpace.fp8_params``; Megatron
    ``--fp8-param-gather``) as well as Megatron-LM's default bf16 ones: where the user set neither ``--fp8-params``
    nor ``--no-fp8-params``, the precision is fp8 or mxfp8, the framework runs it (Megatron, NeMo) and the optimizer
    keeps fp32 states (NeMo's bf16 Apex optimizer adds a bf16 master copy with fp8 weights,
    ``planner/frameworks/nemo.py``, so there they are not lighter) and is Adam (``--fp8-param-gather`` needs the
    distributed optimizer, which Megatron runs Muon without: ``specs.muon_problems``). Else only the job's own (None).

    NVIDIA's recipes set it: every fp8 and mxfp8 precision recipe of Megatron-Bridge sets ``fp8_param_gather = True``
    (src/megatron/bridge/training/mixed_precision.py, see benchmarks/megatron_bridge.py) and NVIDIA's Nemotron-4 340B
    recipe ``+model.fp8_params=True`` (dgxc-benchmarking, docs/memory.md). The search takes it only where faster
    (the ties go to bf16 weights, ``search.search``)."""
    fw = frameworks.get(training.framework)
    if given is None and fw.allows_fp8_params and training.precision in frameworks.FP8_PARAM_PRECISIONS \
            and training.optimizer_dtype == "fp32" and training.optimizer == "adam":
        return (False, True)
    return None


def cross_entropy_fusion_options(training: TrainingSpec, given: str | None) -> tuple[str, ...] | None:
    """The loss kernels a search offers (``SearchSpace.cross_entropy_fusion``): Megatron's default unfused loss and
    Transformer Engine's fused cross entropy (``--cross-entropy-loss-fusion --cross-entropy-fusion-impl te``: 2 B per
    logit where the unfused loss keeps 6, ``frameworks.megatron``), where the user did not give
    ``--cross-entropy-fusion`` and the framework runs it (megatron, nemo: ``specs.job_problems``); else only the
    job's own (None).

    NVIDIA's recipes set it: Megatron-Bridge's performance scripts set ``cross_entropy_fusion_impl = "te"`` for every
    model, over ``GPTModelProvider.cross_entropy_loss_fusion``'s default True (benchmarks/megatron_bridge.py). No time
    is modelled for either kernel, so the search keeps the unfused default wherever a plan fits with it
    (``search._prefer_defaults``) and takes the fused one only where a plan needs its memory, and says so."""
    if given is None and training.framework in ("megatron", "nemo") and training.cross_entropy_fusion == "none":
        return ("none", "te")
    return None


def switch_options(training: TrainingSpec, grad_reduce_in_bf16: bool | None = None,
                   fp8_params: bool | None = None, cross_entropy_fusion: str | None = None
                   ) -> dict[str, tuple | None]:
    """The ``SearchSpace`` keywords of the job switches a search offers (:func:`grad_dtype_options`,
    :func:`fp8_params_options`, :func:`cross_entropy_fusion_options`), given what the user set of each (None:
    neither ``--x`` nor ``--no-x``; no ``--cross-entropy-fusion``), as `plan3d search` builds them:
    ``SearchSpace(pins=..., **switch_options(training, ...))``."""
    return {"grad_reduce_in_bf16": grad_dtype_options(training, grad_reduce_in_bf16),
            "fp8_params": fp8_params_options(training, fp8_params),
            "cross_entropy_fusion": cross_entropy_fusion_options(training, cross_entropy_fusion)}


def shapes(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace
           ) -> Iterator[tuple[int, int, int, StageSplit, int, int | None]]:
    """(tp, cp, dp, split, ep, etp) for every legal parallel shape that respects the pins (ep = 1 and
    etp = None for a dense model; :func:`valid_expert` for a MoE model)."""
    N, pins = training.num_gpus, space.pins
    fw = frameworks.get(training.framework)  # what the framework can run (planner/frameworks)
    max_cp = max(space.max_cp, pins.cp or 1) if fw.allows_cp else 1
    # uneven splits where the framework runs them, or builds some itself (FrameworkProfile.allows_stage_split)
    uneven = space.allow_uneven and (fw.allows_uneven or fw.pipeline_partitions is not None)
    tps = [t for t in valid_tp(model, hw, N, space.cross_node_tp or (pins.tp or 0) > hw.nvlink_domain)
           if fw.allows_tp(t, model)]  # KV heads split or replicated as the framework does (FrameworkProfile)
    for tp in tps:
        for cp in valid_cp(training, max_cp):
            if (N // tp) % cp:
                continue
            for pp in valid_pp(model, N // (tp * cp)):
                dp = N // (tp * cp * pp)
                if not pins.ok(tp=tp, cp=cp, pp=pp, dp=dp):
                    continue
                experts = [(ep, etp) for ep, etp in valid_expert(model, hw, tp, cp, dp, pins)
                           if fw.allows_expert(ep, etp or tp, tp)  # what the framework runs
                           and not deepep_group_problem(model, training, ep, etp or tp)  # and DeepEP, if asked
                           and not hybridep_domain_problem(model, training, ep, etp or tp, hw)]  # and HybridEP
                for plain in valid_splits(model, pp, uneven, max(MAX_UNEVEN_VPP, pins.vpp or 0)):
                    if pins.ok(vpp=plain.vpp) and (plain.vpp == 1 or fw.allows_vpp) and \
                            fw.allows_stage_split(plain.pp, plain.vpp, plain.first, plain.middle, plain.last):
                        for split in schedule_splits(plain, training.framework, pins):
                            for ep, etp in experts:
                                yield tp, cp, dp, split, ep, etp


ZB_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")
MAX_ZB_VPP = 4  # interleaved_zb is searched with vpp up to this (beyond: `plan3d estimate --pipeline-schedule`)


def schedule_splits(split: StageSplit, framework: str, pins: Pins) -> list[StageSplit]:
    """``split`` with each pipeline schedule ``framework`` runs (``schedules.FRAMEWORK_SCHEDULES``) that fits it:
    the plain one (``schedule=None``: 1F1B, or interleaved with vpp > 1) and the zero-bubble ones on even
    splits (the V layout is modelled for even stages only, and each zero-bubble bubble is simulated, so the
    search keeps to even splits for all three), where the chunk count is right (zbv and dualpipev: 2 per
    rank; interleaved_zb: vpp up to ``MAX_ZB_VPP``). ``schedules.schedule_problems`` checks the rest per micro-batch
    count. The pin ``pipeline_schedule`` keeps only that schedule."""
    from planner.schedules import FRAMEWORK_SCHEDULES

    runs = FRAMEWORK_SCHEDULES.get(framework, ())
    out = [split] if split.resolved_schedule in runs or split.pp == 1 else []
    even = split.first == split.middle == split.last
    if split.pp > 1 and even:  # each zero-bubble bubble is simulated (cost.schedule_bubble_s): even splits only,
        for s in ZB_SCHEDULES:  # and interleaved_zb with vpp <= MAX_ZB_VPP, keep the table build in seconds
            if s in runs and ((s == "interleaved_zb" and split.vpp <= MAX_ZB_VPP) or split.vpp == 2):
                out.append(StageSplit(split.pp, split.vpp, split.first, split.middle, split.last, s))
    return [x for x in out if pins.pipeline_schedule is None or x.resolved_schedule == pins.pipeline_schedule]


def schedule_pin_problems(framework: str, schedule: str | None) -> str | None:
    """One line when ``--pipeline-schedule`` pins a schedule ``framework`` does not run (the search would
    find nothing), else None (``schedules.FRAMEWORK_SCHEDULES``)."""
    from planner.schedules import FRAMEWORK_SCHEDULES, SCHEDULES

    if schedule is None:
        return None
    if schedule not in SCHEDULES:
        return f"--pipeline-schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}"
    runs = FRAMEWORK_SCHEDULES.get(framework, SCHEDULES)
    if schedule not in runs:
        return f"--pipeline-schedule: {framework} does not run {schedule}; it runs {', '.join(runs)}"
    return None


def pinned_problems(framework: str, pins: Pins, optimizer_dtype: str = "fp32") -> list[str]:
    """The pinned knobs ``framework`` does not run (``FrameworkProfile.plan_problems``, and the offload limits of
    :func:`planner.specs.offload_problems`), one line each, so that
    `plan3d search --framework F --cp 2` says why instead of finding no legal plan. Only lines about a pinned
    knob count: the probe plan's unpinned fields are placeholders."""
    fw = frameworks.get(framework)
    pp = pins.pp or 1
    zero = pins.zero_stage
    if zero is None:  # a placeholder the framework runs with this pp (the search picks the real one)
        zero = next((z for z in fw.zero_stages if fw.allows_zero(z, pp, optimizer_dtype)), fw.zero_stages[0])
    # an unpinned tp or cp stands at ep, so a rule on cp x tp (torchtitan's EP inside FSDP) fires only when both are set
    tp = pins.tp if pins.tp is not None else (pins.ep or 1)
    # an etp rule reads tp and ep too (etp = tp, or 1 under EP): it counts only when all three are pinned
    pinned = {"cp": pins.cp, "vpp": pins.vpp, "cpu_offload_layers": pins.cpu_offload_layers, "ep": pins.ep,
              "etp": pins.etp if None not in (pins.tp, pins.ep) else None, "zero_stage": pins.zero_stage}

    def problems(cp: int) -> list[str]:
        # model_construct gives every field not named its default (Plan's), as the probes below rely on
        probe = Plan.model_construct(tp=tp, pp=pp, dp=1, cp=cp, vpp=pins.vpp or 1, micro_batch_size=1,
                                     recompute="none", sequence_parallel=bool(pins.sequence_parallel) and tp > 1,
                                     zero_stage=zero, ep=pins.ep or 1, etp=pins.etp,
                                     cpu_offload_layers=pins.cpu_offload_layers or 0)
        return [f"--framework {framework}: {line}" for line in fw.plan_problems(probe, None, optimizer_dtype)
                if pinned.get(line.split(":", 1)[0]) is not None]
    # an unpinned cp is a placeholder too: a line counts only where it holds at each value the search may take, at ep
    # (as tp) and at 1 (a rule on ZeRO 0 with cp > 1, FrameworkProfile.fsdp_with_cp, does not hold at cp 1)
    lines = problems(pins.cp if pins.cp is not None else (pins.ep or 1))
    if pins.cp is None and (pins.ep or 1) > 1:
        at_one = set(problems(1))
        lines = [line for line in lines if line in at_one]
    # the offload rules of every framework (Plan's own), where offload and pp or recompute are pinned
    return lines + offload_problems(pins.cpu_offload_layers or 0, pp, pins.recompute or "none")


def pinned_layout_problems(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, pins: Pins) -> list[str]:
    """Why no split of the GPUs is legal with these pins, where the pins alone decide it, one line each (in
    ``plan_problems``' words where one plan shows it); empty where the reason lies in the combinations the search tried.

    Only rules no unpinned knob can rescue count: the pinned degrees must divide the GPUs; a pinned tp against the
    model's heads, KV heads, FFN width and the NVLink domain (``tp:``); a pinned cp against the sequence (``cp:``);
    and the global batch against dp times the pinned micro-batch (or dp alone when the micro-batch is searched) for
    every dp the pins leave: the GPUs over tp x pp x cp, each unpinned one of those a divisor of the GPUs
    (``global_batch_size:``); a pinned vpp > 1 with pp 1; a pinned pp above the layers, or pp x vpp model chunks
    above the layers plus the embedding's and the loss's own chunks (``pp:``, ``vpp:``, the bounds of
    :func:`valid_pp` and :func:`_splits`)."""
    g = training.num_gpus
    fixed = {k: getattr(pins, k) for k in ("tp", "pp", "cp", "dp") if getattr(pins, k) is not None}
    product = 1
    for v in fixed.values():
        product *= v
    if g % product:  # and what no GPU count rescues: a pinned tp against the heads, a pinned cp against the sequence
        probe = Plan.model_construct(tp=pins.tp or 1, pp=pins.pp or 1, dp=1, cp=pins.cp or 1, micro_batch_size=1,
                                     recompute="none", zero_stage=0)
        model_rules = [line for line in plan_problems(model, hardware, training, probe)
                       if line.split(":", 1)[0] in {k for k in ("tp", "cp") if getattr(pins, k) is not None}]
        return [f"plan: {' * '.join(f'{k}({v})' for k, v in fixed.items())} = {product} does not divide num_gpus({g})",
                *model_rules]
    free = divisors(g)
    options = [(pins.tp,) if pins.tp else free, (pins.pp,) if pins.pp else free, (pins.cp,) if pins.cp else free]
    dps = sorted({g // (t * p * c) for t in options[0] for p in options[1] for c in options[2] if g % (t * p * c) == 0
                  and (pins.dp is None or g // (t * p * c) == pins.dp)}, reverse=True)
    b = pins.micro_batch_size or 1
    B = training.global_batch_size
    tp, pp, cp = pins.tp or 1, pins.pp or 1, pins.cp or 1
    probe = Plan.model_construct(tp=tp, pp=pp, dp=dps[0] if len(dps) == 1 else 1, cp=cp, micro_batch_size=b,
                                 recompute="none", zero_stage=0)
    keys = {"tp": pins.tp is not None, "cp": pins.cp is not None, "global_batch_size": len(dps) == 1}
    lines = [line for line in plan_problems(model, hardware, training, probe) if keys.get(line.split(":", 1)[0])]
    if len(dps) > 1 and all(B % (b * d) for d in dps):
        lines.append(f"global_batch_size: {B} is not divisible by micro_batch_size({b}) * dp for any dp these pins "
                     f"leave ({', '.join(map(str, dps))})")
    L = model.num_layers
    if pins.pp == 1 and (pins.vpp or 1) > 1:  # Plan's own rule
        lines.append(f"vpp: vpp({pins.vpp}) > 1 needs pp > 1 (pp is 1)")
    elif pins.pp is not None and pins.pp > L:  # valid_pp: a stage holds at least one layer
        lines.append(f"pp: pp({pins.pp}) is more than num_layers({L}); every stage holds a layer")
    elif pins.pp is not None and pins.vpp is not None and pins.pp * pins.vpp > L + 2:
        # _splits: every model chunk holds a layer, but rank 0's embedding chunk and the last rank's loss chunk
        lines.append(f"vpp: pp({pins.pp}) * vpp({pins.vpp}) = {pins.pp * pins.vpp} model chunks for num_layers({L}); "
                     f"every chunk but the first and the last holds a layer, so at most {L + 2}")
    return lines + _pinned_expert_problems(model, hardware, training, pins)


def pinned_split_problems(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, pins: Pins,
                          shown: int = 1) -> list[str]:
    """Why no split is legal where the pins leave several and each breaks a different rule, which
    :func:`pinned_layout_problems` (one rule that binds them all) cannot name: every tp x pp x cp x dp of the GPUs
    the pins leave, probed with ``plan_problems`` (the pinned micro-batch, vpp, recompute, SP, ep and etp, else their
    lightest values; a pp that does not divide the layers with the first uneven split the search would try,
    :func:`valid_splits`), grouped by the rule each first breaks: one line per rule, in ``plan_problems``' words for
    its first split, with the split and how many more break it. Empty when some split passes ``plan_problems`` (then
    the reason lies in what the framework runs or in the micro-batch options, not in the layout) or when the pins
    leave no split at all (:func:`pinned_layout_problems` says so)."""
    g = training.num_gpus
    vpp = pins.vpp or 1
    groups: dict[str, list[tuple[str, str]]] = {}
    for t in ([pins.tp] if pins.tp else divisors(g)):
        for p in ([pins.pp] if pins.pp else divisors(g // t) if g % t == 0 else []):
            for c in ([pins.cp] if pins.cp else divisors(g // (t * p)) if g % (t * p) == 0 else []):
                if g % (t * p * c) or (pins.dp is not None and g // (t * p * c) != pins.dp):
                    continue
                d = g // (t * p * c)
                if vpp > 1 and p == 1:  # Plan's own rule, which a constructed probe skips
                    groups.setdefault("vpp", []).append((f"tp {t} x pp 1 x cp {c} x dp {d}",
                                                         f"vpp: vpp({vpp}) > 1 needs pp > 1 (pp is 1)"))
                    continue
                layers = None
                if p > 1 and model.num_layers % (p * vpp):
                    split = next((s for s in valid_splits(model, p, True, max(MAX_UNEVEN_VPP, vpp)) if s.vpp == vpp),
                                 None)
                    layers = split.layers() if split is not None else None
                probe = Plan.model_construct(tp=t, pp=p, dp=d, cp=c, vpp=vpp, micro_batch_size=pins.micro_batch_size or 1,
                                             recompute=pins.recompute or "none",
                                             sequence_parallel=bool(pins.sequence_parallel) and t > 1,
                                             zero_stage=pins.zero_stage or 0, ep=pins.ep or 1, etp=pins.etp,
                                             layers_per_stage=layers)
                lines = plan_problems(model, hardware, training, probe)
                if not lines:
                    return []
                groups.setdefault(lines[0].split(":", 1)[0], []).append((f"tp {t} x pp {p} x cp {c} x dp {d}",
                                                                          lines[0]))
    out = []
    for found in groups.values():
        more = len(found) - shown
        where = ", ".join(label for label, _ in found[:shown]) + (f", and {more} more split{'s' * (more > 1)}"
                                                                  if more > 0 else "")
        out.append(f"{found[0][1]} ({where})")
    return out


def _pinned_expert_problems(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, pins: Pins) -> list[str]:
    """The expert-parallel rules (``specs.moe_plan_problems``) where the pins alone decide them: a pinned ep against
    the experts, a pinned etp against the expert width and the NVLink domain, and etp x ep against the ranks the
    pipeline leaves to tp x cp x dp, which are the GPUs over the pinned pp (over pp 1, the most, where pp is free)
    whatever the split of those ranks, so a probe with tp = cp = 1 stands for every split."""
    if not model.is_moe or (pins.ep is None and pins.etp is None):
        return []
    pp = pins.pp or 1
    probe = Plan.model_construct(tp=1, cp=1, dp=training.num_gpus // pp, pp=pp, ep=pins.ep or 1, etp=pins.etp)
    return moe_plan_problems(model, hardware, probe)


def micro_options(tp: int, space: SearchSpace, moe: bool = False) -> Iterator[tuple[str, bool]]:
    """(recompute, sequence_parallel) pairs for a given tp. A MoE model with tp > 1 needs sequence
    parallelism (Megatron-Core ``moe_layer.py`` refuses MoE + TP without it in training)."""
    for rc in RECOMPUTE:
        for sp in (((True,) if moe else (False, True)) if tp > 1 else (False,)):
            if space.pins.ok(recompute=rc) and space.pins.sp_ok(tp, sp):
                yield rc, sp


#: The search proposes CPU activation offloading only on hosts whose link to the GPU is faster than this (GB/s
#: per direction): NVLink-C2C (Grace-Blackwell, 225 GB/s per GPU), where NVIDIA publishes it (Megatron-Bridge's
#: GB200/GB300 Llama 3 FSDP recipes), not PCIe (64 GB/s Gen5 x16), where the GPUs of a node share the host's
#: memory bandwidth, which the model does not capture. A pinned value is estimated on any host.
OFFLOAD_SEARCH_MIN_HOST_LINK_GBPS = 100.0


def offload_options(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace, recompute: str,
                    pp: int = 1) -> tuple[int, ...]:
    """Values of ``Plan.cpu_offload_layers`` searched with ``recompute``: 0, and where Megatron offloads
    (pp 1, recompute none, the megatron/nemo framework: specs.Plan, planner.frameworks) on a C2C-class host
    link (``OFFLOAD_SEARCH_MIN_HOST_LINK_GBPS``) a quarter, half and three quarters of the layers (rounded
    down; at least 1, fewer than num_layers), as an alternative to recomputation (Megatron-Bridge's Llama 3
    FSDP recipes offload 20-92 layers). The pin keeps only itself."""
    L, pin = model.num_layers, space.pins.cpu_offload_layers
    offloads = recompute == "none" and pp == 1 and frameworks.get(training.framework).allows_cpu_offload
    if pin is not None:
        return (pin,) if pin == 0 or (offloads and 0 < pin < L) else ()
    if not offloads or hw.host_link_gbps <= OFFLOAD_SEARCH_MIN_HOST_LINK_GBPS:
        return (0,)
    return (0,) + tuple(sorted({n for n in (L // 4, L // 2, 3 * L // 4) if 0 < n < L}))


def enumerate_plans(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace) -> Iterator[Plan]:
    """Every legal plan in the space (brute force; the reference the solver is checked against)."""
    B = training.global_batch_size
    fw = frameworks.get(training.framework)
    for tp, cp, dp, split, ep, etp in shapes(model, hw, training, space):
        if B % dp:
            continue
        for mbs in valid_micro_batch_sizes(B // dp, max(space.max_micro_batch_size, space.pins.micro_batch_size or 1)):
            if not space.pins.ok(micro_batch_size=mbs):
                continue
            for rc, sp in micro_options(tp, space, model.is_moe):
                for off in offload_options(model, hw, training, space, rc, split.pp):
                    for z in space.zero_stages:
                        if not space.pins.ok(zero_stage=z) or not fw.allows_zero(z, split.pp, training.optimizer_key,
                                                                                 ep, cp * tp, cp):
                            continue
                        plan = Plan(tp=tp, pp=split.pp, dp=dp, cp=cp, vpp=split.vpp, micro_batch_size=mbs,
                                    recompute=rc, sequence_parallel=sp, zero_stage=z, layers_per_stage=split.layers(),
                                    ep=ep, etp=etp, pipeline_schedule=split.schedule, cpu_offload_layers=off)
                        if not plan_problems(model, hw, training, plan):
                            yield plan
