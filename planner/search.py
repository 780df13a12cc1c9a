"""plan3d search: the fastest plan that fits, found by OR-Tools CP-SAT over precomputed cost tables.

How it works:

1. ``planner.candidates`` lists the legal values of every knob: parallel *shapes* (tp, cp, dp, pp,
   vpp and the first/last-stage layer counts), *micro* options (micro-batch size, recompute,
   sequence parallelism) and ZeRO stages; for a MoE model each shape also carries (ep, etp)
   (``candidates.valid_expert``, Megatron-Core's folding rules).
   With pp = 1 and no recompute the micro options also carry ``cpu_offload_layers`` (activation offloading,
   ``candidates.offload_options``), an alternative to recomputation.
2. :func:`build_tables` evaluates the pure cost and memory functions once per factor
   (``cost.micro_factors`` per (tp, cp, micro-batch, recompute, SP); the P2P hop, DP sync and
   parameter counts per shape). It composes them into the step time with the same vectorised
   functions ``cost.estimate_time`` uses (``cost.stage_terms`` and ``cost.compose_step``: one cost
   model, written once), and into every stage's memory following ``memory.stage_memory`` term by
   term, for each (shape, micro, zero) combination, in integers (nanoseconds, KiB). A dense model's step
   composes three stage kinds, the first, the first middle one and the last (in-flight micro-batches fall with the
   stage index, and the overlap window of the DP sync grows with it); a MoE model's its distinct stage kinds
   (:func:`_moe_step`). Memory is computed for every stage and kept as three kinds: the first, the fullest middle
   one and the last (:func:`_memory_rows`: the first middle stage need not be the fullest). Shapes are
   independent: with many of them the tables are built over forked worker processes (:func:`table_workers`,
   ``PLAN3D_WORKERS``), the same tables bit for bit.
3. :func:`solve` builds a CP-SAT model. Its decision variables are the knobs (tp, pp, dp, cp,
   vpp, micro-batch size and count, recompute, SP, ZeRO, first/last layers), tied to one
   combination index by element constraints. The constraints are ``tp*pp*dp*cp = N`` and
   ``mbs*m*dp = B`` as multiplication equalities, the pins, and every stage's memory within the
   usable memory. The objective is the tabulated step time. CP-SAT proves the optimum; the
   status is reported. Alternatives are re-solves that forbid the (tp, pp, cp) already found. The
   candidates are first cut to the Pareto front of each (tp, pp, cp) in time, fullest-stage memory and
   ZeRO stage (:func:`pareto_by_group`).

``enumerate_plans`` + ``estimate_time`` is the brute-force reference (``--exhaustive`` and the tests).
"""

from __future__ import annotations

import importlib
import itertools
import sys
import time
import types
from dataclasses import dataclass, field, replace

import numpy as np

from planner.candidates import (RECOMPUTE, Pins, SearchSpace, StageSplit, enumerate_plans, micro_options,
                                offload_options, shapes, valid_micro_batch_sizes)
from planner.cost import (FACTOR_KEYS, a2a_alone_share, compose_step, contention, dp_sync_parts_s, grad_accum_s,
                          grad_reduce_trail_s, grad_reduction_args, micro_factors, optimizer_s, overlap_grad_reduce_of,
                          p2p_hop_s, resolved_overlap, schedule_family, stage_moe_counts, stage_param_split,
                          stage_terms,
                          zero3_gather_s, ZeroBubbleBatch)
from planner.layout import DEFAULT_ORDER, axis_span, pp_hop_crosses_nodes
from planner import frameworks
from planner.frameworks.deepspeed import runs_pipeline_engine
from planner.memory import (a2a_overlap_active, a2a_overlap_extra_layers, act_bytes, bf16_layer_delta_bytes,
                            bf16_layers_on_stage, chunk_peak_layers, dataloader_mask_bytes, deepep_buffer_bytes,
                            deepspeed_pipe_tensor_counts, deferred_wgrad_bytes_per_microbatch,
                            deferred_wgrad_microbatches, gemm_workspace_bytes, hybridep_domain_ranks,
                            hybridep_sized_bytes, in_flight_chunks, KIB, input_bytes_per_microbatch, kept_output_bytes, kept_outputs_bytes_of,
                            layer_recompute_working_bytes, megatron_p2p_tensor_count, moe_allgather_buffer_bytes,
                            offload_resident_layers, output_bytes, param_bytes, pipeline_buffer_count,
                            saved_bytes_per_layer_kind, schedule_w_fraction, stage_moe_layer_count,
                            stage_param_inputs, stage_params_per_rank, stage_state_bytes_of, step_excess_bytes,
                            tp_comm_overlap_bytes_per_element, usable_kib as usable_memory_kib)
from planner.schedules import schedule_problems
from planner.errors import MAX_GPUS, SpecError
from planner.specs import (HardwareSpec, ModelSpec, Plan, TrainingSpec, a2a_overlap_problems,
                           cuda_graph_problems, dist_optimizer_problems, distributed_checkpoint_problems,
                           empty_chunks, job_problems, microbatch_count, pipeline_switch_problems,
                           uneven_chunks)

NS = 1e9  # time unit of the tables: nanoseconds
INFEASIBLE = 2**52


@dataclass
class Tables:
    """Step time and stage memory for every (shape, micro, zero) combination, flattened."""

    shapes: list[tuple[int, int, int, StageSplit, int, int | None]]  # tp, cp, dp, split, ep, etp
    micros: list[tuple[int, str, bool, int]]  # micro-batch size, recompute, SP, cpu_offload_layers
    zeros: tuple[int, ...]
    time_ns: np.ndarray  # [S, U, Z] int64
    mem_kib: np.ndarray  # [S, U, Z, 3] int64: first, first-middle, last stage
    legal: np.ndarray  # [S, U, Z] bool
    usable_kib: int
    build_s: float = 0.0

    def unindex(self, k: int) -> tuple[int, int, int]:
        s, rest = divmod(k, len(self.micros) * len(self.zeros))
        u, z = divmod(rest, len(self.zeros))
        return s, u, z

    def plan(self, k: int) -> Plan:
        s, u, z = self.unindex(k)
        tp, cp, dp, split, ep, etp = self.shapes[s]
        mbs, rc, sp, off = self.micros[u]
        return Plan(tp=tp, pp=split.pp, dp=dp, cp=cp, vpp=split.vpp, micro_batch_size=mbs, recompute=rc,
                    sequence_parallel=sp, zero_stage=self.zeros[z], layers_per_stage=split.layers(), ep=ep, etp=etp,
                    pipeline_schedule=split.schedule, cpu_offload_layers=off)

    @property
    def candidates(self) -> int:
        return int(self.legal.sum())


def _micros(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace, dps: set[int]
            ) -> list[tuple[int, str, bool, int]]:
    """(micro-batch size, recompute, SP, cpu_offload_layers) options; the offload values are those of a pp = 1
    shape (candidates.offload_options), masked off the pipelined shapes in build_tables."""
    B = training.global_batch_size
    cap = max(space.max_micro_batch_size, space.pins.micro_batch_size or 1)
    sizes = sorted({b for d in dps if B % d == 0 for b in valid_micro_batch_sizes(B // d, cap)
                    if space.pins.ok(micro_batch_size=b)})
    # the options of tp 1 and of tp > 1 (a pinned SP means none at tp 1, Pins.sp_ok); each shape keeps its own
    options = dict.fromkeys([*micro_options(2, space), *micro_options(1, space)])
    return [(b, rc, sp, off) for b in sizes for rc, sp in options
            for off in offload_options(model, hw, training, space, rc)]


def _stage_rows(split: StageSplit) -> list[tuple[int, int]]:
    """(stage index, layers) of the three stage kinds that can be extreme: first, first middle, last."""
    p = split.pp
    mid = 1 if p > 2 else p - 1
    return [(0, split.first), (mid, split.middle if p > 2 else split.last), (p - 1, split.last)]


def build_tables(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace,
                 order: str = DEFAULT_ORDER, workers: int | None = None, memory_only: bool = False) -> Tables:
    """Every (shape, micro, zero) combination's step time and stage memory (module docstring, step 2).

    The shapes are independent, so with many of them (``PARALLEL_MIN_SHAPES``) they are split over ``workers``
    processes (default :func:`table_workers`), each shape group sharing its per-micro-batch factors kept in
    one process (:func:`_shape_chunks`); the zero-bubble schedules' simulations the shapes ask for then run once
    per action program, over workers too where there are many (``PARALLEL_MIN_STEPS``, :func:`simulation_workers`;
    ``workers`` for both where given). Every shape and every program is computed by the same code either way, so
    the tables are the same (``tests/test_search_parallel.py``). ``memory_only``: the legality and stage memory
    alone, every step time left INFEASIBLE (what :func:`any_plan_fits` needs: the same memory, sooner). ``hw`` is
    taken with the NVLink domain the job fills (``HardwareSpec.for_job``, as ``cost.estimate_time`` takes it; the
    same profile when the caller has done so)."""
    t0 = time.perf_counter()
    hw = hw.for_job(training.num_gpus)
    shape_list = table_shapes(model, hw, training, space)
    micros = _micros(model, hw, training, space, {sh[2] for sh in shape_list})
    zeros = tuple(z for z in space.zero_stages if space.pins.ok(zero_stage=z))
    S, U, Z = len(shape_list), len(micros), len(zeros)
    time_ns = np.full((S, U, Z), INFEASIBLE, dtype=np.int64)
    mem_kib = np.full((S, U, Z, 3), INFEASIBLE, dtype=np.int64)
    legal = np.zeros((S, U, Z), dtype=bool)
    usable_kib = usable_memory_kib(hw.usable_memory_gib)
    n = table_workers(S) if workers is None else (workers if can_fork_workers() else 1)
    chunks = _shape_chunks(shape_list, 2 * n) if n > 1 and S else [list(range(S))]
    jobs = [(model, hw, training, space, order, micros, zeros, [(si, shape_list[si]) for si in chunk], memory_only)
            for chunk in chunks]
    parts = _parallel_map(_fill_tables_job, jobs, n) if len(jobs) > 1 else None
    if parts is None:
        parts = [_fill_tables_job(job) for job in jobs]
    zb = ZeroBubbleBatch()  # the zero-bubble schedules' simulations, one per action program for all shapes
    for part in parts:
        zb.merge(part[4])
    tasks = zb.tasks()
    n_sim = simulation_workers(sum(zb.size(t[0]) for t in tasks)) if workers is None else n
    if n_sim > 1 and len(tasks) > 1:  # each program alone, largest first, over forked workers
        zb.run(lambda fn, items: _parallel_map(fn, items, n_sim) or [fn(x) for x in items], tasks)
    else:
        zb.run(tasks=tasks)
    for idx, t_part, m_part, l_part, _, owed_steps in parts:
        for si, ok, step, owed in owed_steps:
            _set_times(t_part, si, ok, step + owed)
        time_ns[idx], mem_kib[idx], legal[idx] = t_part, m_part, l_part
    return Tables(shapes=shape_list, micros=micros, zeros=zeros, time_ns=time_ns, mem_kib=mem_kib, legal=legal,
                  usable_kib=usable_kib, build_s=time.perf_counter() - t0)


def table_shapes(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace) -> list:
    """The shapes :func:`build_tables` tabulates (``candidates.shapes`` whose DP degree divides the global batch;
    none for a job with problems), without tabulating them: their count decides the workers (:func:`table_workers`)."""
    if job_problems(model, hw, training):
        return []
    return [sh for sh in shapes(model, hw, training, space) if training.global_batch_size % sh[2] == 0]


def _parallel_map(fn, items: list, n: int) -> list | None:
    """``fn`` of every item over ``n`` forked workers, in order (each worker takes the next item when it is free,
    so items listed largest first balance); None if the pool broke (a worker killed, by the kernel's OOM killer
    say), so that the caller runs them in this process instead. Fork: a worker starts as a copy of this process,
    with nothing to import or re-run (spawn and forkserver re-run the caller's main script, which a script without
    a ``__main__`` guard cannot survive)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(min(n, len(items)), mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(fn, items))
    except BrokenProcessPool:
        return None


#: Fewer shapes than this are tabulated in this process. A shape takes about 1-2 ms. On this project's 2-core
#: machine (``benchmarks/search_speed.py``, whole command, 2026-12-03) two workers took DeepSeek-V3 on 2,048 GPUs
#: (10,350 shapes) from 18.7 to 12.0 s and Mixtral-8x7B under torchtitan (1,804) from 6.7 to 5.8 s, but the dense
#: cases of 474-1,021 shapes moved by less than the run-to-run noise (-0.3 to +0.4 s), so they stay in one process.
PARALLEL_MIN_SHAPES = 1500
#: The most worker processes a search starts, whatever the machine.
MAX_WORKERS = 16


#: Zero-bubble simulations of fewer (rank, chunk, micro-batch) steps than this in all (``ZeroBubbleBatch.size``)
#: run in this process. A step takes about 10 us (benchmarks/search_speed.py's Mixtral-8x7B under torchtitan,
#: 136 programs, 2026-12-04: p 16, vpp 2, m 1,024 in 0.37 s), so this is about 0.2 s of simulation, a few times
#: what starting the workers costs.
PARALLEL_MIN_STEPS = 20_000


def table_workers(n_shapes: int) -> int:
    """Processes to build the tables with: ``PLAN3D_WORKERS`` if set (1: no workers), else the CPUs this
    process may run on (at most ``MAX_WORKERS``) when there are at least ``PARALLEL_MIN_SHAPES`` shapes, else 1."""
    return _workers(n_shapes >= PARALLEL_MIN_SHAPES)


def simulation_workers(steps: int) -> int:
    """Processes to run the zero-bubble schedules' simulations with (``ZeroBubbleBatch.run``, after the tables):
    ``PLAN3D_WORKERS`` if set (1: no workers), else the CPUs this process may run on (at most ``MAX_WORKERS``)
    when the programs have at least ``PARALLEL_MIN_STEPS`` steps in all, else 1."""
    return _workers(steps >= PARALLEL_MIN_STEPS)


def _workers(enough: bool) -> int:
    """``PLAN3D_WORKERS`` if set, else the CPUs (at most ``MAX_WORKERS``) where there is ``enough`` work, else 1;
    1 wherever :func:`can_fork_workers` says no."""
    import os

    env = os.environ.get("PLAN3D_WORKERS", "").strip()
    if env:
        try:
            asked = int(env)
        except ValueError:
            asked = 0
        if asked < 1:
            raise SpecError(f"PLAN3D_WORKERS: '{env}' is not a process count; set a whole number from 1 (1: no "
                            "workers)")
        return asked if can_fork_workers() else 1
    if not enough or not can_fork_workers():
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, MAX_WORKERS))


def can_fork_workers() -> bool:
    """Whether forked workers are safe here: Linux (macOS's system libraries are not fork-safe, Windows cannot
    fork), no other Python thread in this process (a fork copies only the calling thread: a lock another
    thread holds would stay held in the worker), and not a daemonic process (which may not have children)."""
    import multiprocessing
    import threading

    return (sys.platform.startswith("linux") and threading.active_count() == 1
            and not multiprocessing.current_process().daemon)


def _shape_chunks(shape_list: list, n_chunks: int) -> list[list[int]]:
    """The shape indices in at most ``n_chunks`` chunks of about equal size, the shapes of one (tp, cp, ep, etp)
    (which share their per-micro-batch factors, :func:`_micro_factors`) kept together, largest group first."""
    groups: dict = {}
    for si, (tp, cp, _, _, ep, etp) in enumerate(shape_list):
        groups.setdefault((tp, cp, ep, etp), []).append(si)
    chunks: list[list[int]] = [[] for _ in range(max(1, min(n_chunks, len(groups))))]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(chunks, key=len).extend(members)
    return [sorted(c) for c in chunks if c]


def _fill_tables_job(job) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, ZeroBubbleBatch, list]:
    """(shape indices, their step times [k, U, Z], stage memory [k, U, Z, 3], legality [k, U, Z], the zero-bubble
    simulations they ask for, the steps still owed those bubbles) of one chunk of shapes: the body of
    :func:`build_tables`, run in this process or a worker. The simulations are left to the caller, which runs
    each action program once for every chunk (a worker's asks and its owed steps travel in one pickle, so they
    still share their arrays)."""
    model, hw, training, space, order, micros, zeros, indexed, memory_only = job
    B = training.global_batch_size
    K, U, Z = len(indexed), len(micros), len(zeros)
    time_ns = np.full((K, U, Z), INFEASIBLE, dtype=np.int64)
    mem_kib = np.full((K, U, Z, 3), INFEASIBLE, dtype=np.int64)
    legal = np.zeros((K, U, Z), dtype=bool)
    c = contention(hw)
    overlap_p2p = resolved_overlap(training).overlap_p2p_comm
    gb = param_bytes(training)
    fw = frameworks.get(training.framework)
    mbs_u = np.array([u[0] for u in micros], dtype=np.int64)
    rc_full_u = np.array([u[1] == "full" for u in micros])  # no MoE all-to-all overlap (memory.a2a_overlap_active)
    off_u = np.array([u[3] for u in micros], dtype=np.int64)
    # layers resident on the GPU with offloading (memory.offload_resident_layers; pp 1: all L on rank 0)
    resident = np.array([offload_resident_layers(model, Plan.model_construct(cpu_offload_layers=o), model.num_layers)
                         if o else (0, 0) for o in off_u.tolist()], dtype=float).reshape(-1, 2)
    family = schedule_family(training)
    w_fraction = schedule_w_fraction(training)
    # memory.stage_boundary_bytes per micro; / tp under SP (applied per shape below)
    sp_u = np.array([bool(u[2]) for u in micros])
    boundary_full_u = mbs_u * model.hidden_size * act_bytes(training)
    # Transformer Engine's TP-overlap userbuffers (memory.tp_comm_overlap_buffer_bytes), per micro option below
    ub_per_element = tp_comm_overlap_bytes_per_element(training)
    # memory.gemm_workspace_bytes by (loss stage, MoE stage, TP-overlap userbuffers): constant over the job
    workspaces = {key: gemm_workspace_bytes(training, hw, *key) for key in itertools.product((False, True), repeat=3)}

    def in_flight(plan, m, r):  # memory.stage_in_flight_chunks: the framework's w_fraction and order
        return in_flight_chunks(plan, m, r, w_fraction, family)
    factors: dict = {}
    hops: dict = {}
    sync_cache: dict = {}  # a MoE stage kind's DP terms, shared by shapes of the same degrees (_moe_step)
    row_cache: dict = {}  # a dense stage kind's state and DP terms, shared likewise (_row_key)
    zb = ZeroBubbleBatch()  # collects this chunk's zero-bubble simulations; build_tables runs them
    owed_steps = []  # (shape, legal options, step without its simulated bubble, that bubble once zb has run)
    usable_kib = usable_memory_kib(hw.usable_memory_gib)

    def probe(tp, cp, dp, split, ep=1, etp=None, mbs=1, rc="none", sp=False, z=0):
        return Plan.model_construct(tp=tp, pp=split.pp, dp=dp, cp=cp, vpp=split.vpp, micro_batch_size=mbs,
                                    num_microbatches=None, recompute=rc, sequence_parallel=sp, zero_stage=z,
                                    layers_per_stage=split.layers(), ep=ep, etp=etp, microbatch_group_size=None,
                                    pipeline_schedule=split.schedule)

    for si, (_, (tp, cp, dp, split, ep, etp)) in enumerate(indexed):
        p, v = split.pp, split.vpp
        rows = _stage_rows(split)
        n = np.array([x[1] for x in rows], dtype=float)
        base = probe(tp, cp, dp, split, ep, etp)
        last = np.array([r == base.loss_stage for r, _ in rows])  # the output layer: rank p - 1, or 0 in a V
        # a layer's factors depend on (tp, cp), and a MoE layer's on (ep, etp) too (the EP group's
        # placement depends only on etp, ep and the GPU count, fixed here)
        boundary_u = training.seq_len // cp * boundary_full_u / np.where(sp_u, tp, 1)
        # the MoE all-to-all overlap runs, and so counts, only where Megatron takes it, which depends on the pipeline
        # too (specs.a2a_overlap_problems: virtual stages when pp > 1, an MTP layer only with pp > 1)
        key = (tp, cp, ep, etp, not a2a_overlap_problems(model, training, base))
        if key not in factors:
            factors[key] = _micro_factors(model, hw, training, micros, base, order, space.pins, memory_only)
        f = factors[key]
        crosses = pp_hop_crosses_nodes(base, hw.nvlink_domain, order)
        if (tp, cp, crosses) not in hops and not memory_only:
            tp_group = axis_span(base, "tp", hw.nvlink_domain, order)
            hops[(tp, cp, crosses)] = np.array([
                p2p_hop_s(model, hw, training, base.model_copy(update={"micro_batch_size": mbs, "sequence_parallel": sp}),
                          crosses, tp_group) for mbs, _, sp, _ in micros])
        m = microbatch_count(B, mbs_u, dp)
        if split.schedule is None:  # Megatron's interleaved rule (specs.plan_problems)
            sched_ok = (v == 1) | (m % p == 0)
        else:  # the framework's own rules for the schedule (schedules.schedule_problems)
            sched_ok = np.array([B % (b * dp) == 0 and not schedule_problems(split.schedule, training.framework, p, v,
                                                                              microbatch_count(B, b, dp))
                                 for b in mbs_u], dtype=bool)
        ok = np.asarray(f["valid"], dtype=bool) & (B % (mbs_u * dp) == 0) & sched_ok & ((off_u == 0) | (p == 1))
        if pipeline_switch_problems(model, training, p):  # the job's switches need another pipeline depth
            continue
        ok = ok[:, None] & np.array([fw.allows_zero(z, p, training.optimizer_key, ep, cp * tp, cp)
                                     # partial distributed optimizers: ZeRO 1, n dividing both DP groups
                                     and (training.dist_optimizer_instances == 1 or not dist_optimizer_problems(
                                         training, probe(tp, cp, dp, split, ep, etp, z=z)))
                                     for z in zeros])[None, :]  # [U, Z]: the framework's ZeRO
        if not ok.any():
            continue
        # memory of each stage kind [U, Z, 3], as memory.stage_memory. A MoE model's dense-first layers can
        # reach past rank 0, so its middle stages need not fall with the stage index: every middle stage
        # that may hold a dense layer, and the first one after them, is computed, and the middle kind is
        # their maximum (a stage the three kinds miss could not fit while the table says it does)
        mrows = _memory_rows(model, base, rows)
        static, work, released, step_extra = _state_rows_by_micro(model, hw, training, base, mrows, zeros, mbs_u, B,
                                                                  row_cache)
        if not model.is_moe and not memory_only:  # a MoE model's DP terms are composed over every stage (_moe_step)
            dpg_s, dpp_s, z3_s, opt_s, accum_s = _zero_terms(model, hw, training, base, rows, zeros, gb, order,
                                                             row_cache)
        nm = np.array([x[1] for x in mrows], dtype=float)
        inflight = np.stack([in_flight(base, m, r) for r, _ in mrows], axis=1)  # [U, R]
        # --- memory (owned with planner.memory): dense-first and MoE layers each with their own saved bytes
        n_moe = np.array([stage_moe_layer_count(model, base, r, x) for r, x in mrows], dtype=float)
        act = inflight / v * ((nm - n_moe) * f["saved"][:, None] + n_moe * f["saved_moe"][:, None])
        if p == 1 and off_u.any():  # offloading: only the resident layers (memory.stage_saved_bytes)
            held = inflight * (resident[:, :1] * f["saved"][:, None] + resident[:, 1:] * f["saved_moe"][:, None])
            act = np.where(off_u[:, None] > 0, held, act)
        for i, (r, x) in enumerate(mrows):  # a stage of unequal chunks (an empty one among them): its exact peak
            if x and uneven_chunks(x, v, first=r == 0):
                peak = {mu: chunk_peak_layers(training, base, mu, r, x) for mu in set(m[ok.any(axis=1)].tolist())}
                per_layer = ((x - n_moe[i]) * f["saved"] + n_moe[i] * f["saved_moe"]) / x
                act[:, i] = [peak[mu] * b if mu in peak else 0.0 for mu, b in zip(m.tolist(), per_layer)]
        if a2a_overlap_active(model, training, base):  # as memory.stage_saved_bytes; never with full recompute
            for i, (r, x) in enumerate(mrows):
                extra = a2a_overlap_extra_layers(model, training, base, m, r, x)
                heavier = np.maximum(f["saved"], f["saved_moe"]) if n_moe[i] else f["saved"]
                act[:, i] = act[:, i] + np.where(rc_full_u, 0.0, extra * heavier)
        if training.bf16_layers_at_start or training.bf16_layers_at_end:  # memory.bf16_layers_extra_bytes
            n_bf16 = np.array([bf16_layers_on_stage(training, p, r) for r, _ in mrows])
            act = act + n_bf16[None, :] * f["bf16_delta"][:, None] * np.minimum(m[:, None], inflight)
        first_inputs = np.ceil(in_flight(base, m, 0) / v) * f["input_bytes"]
        rows_r = np.array([r for r, _ in mrows])
        other = (rows_r == 0) * first_inputs[:, None] + (rows_r == base.loss_stage) * f["output_bytes"][:, None]
        if base.loss_stage != 0:  # the first stage's dataloader mask (memory.stage_other_bytes)
            other = other + (rows_r == 0) * f["mask_bytes"][:, None]
        if training.defer_embedding_wgrad:  # memory.deferred_wgrad_bytes
            deferred = deferred_wgrad_microbatches(training, m) * f["deferred_per_mb"]
            other = other + (rows_r == base.loss_stage) * deferred[:, None]
        ub_on_u = sp_u & bool(ub_per_element) & (tp > 1)  # memory.tp_comm_overlap_buffer_bytes > 0
        if ub_on_u.any():  # the userbuffers: every stage
            other = other + (ub_on_u * (training.seq_len * mbs_u // cp) * model.hidden_size * ub_per_element)[:, None]
        if p > 1 and fw.pipeline_recv_buffers:  # memory.pipeline_buffer_bytes
            other = other + pipeline_buffer_count(base, m[:, None], rows_r[None, :], inflight) * boundary_u[:, None]
        if p > 1 and fw.megatron_p2p_tensors:  # memory.megatron_p2p_bytes
            held = megatron_p2p_tensor_count(base, m[:, None], rows_r[None, :], inflight, overlap_p2p)
            other = other + held * boundary_u[:, None]
        if fw.deepspeed_pipe_buffers and runs_pipeline_engine(training.deepspeed.pipeline_engine, p):
            # memory.deepspeed_pipe_bytes
            whole, sent, kept_out = deepspeed_pipe_tensor_counts(base, m[:, None], rows_r[None, :])
            other = other + (whole + sent / tp) * boundary_u[:, None] + kept_out * f["kept_output_bytes"][:, None]
        other = other + (n_moe > 0) * deepep_buffer_bytes(model, training, base)  # stages with a MoE layer
        if training.moe_token_dispatcher == "hybridep" and model.is_moe:  # memory.hybridep_buffer_bytes, by micro-batch
            r_dom, n_dom = hybridep_domain_ranks(training, base, hw)
            hybridep = [hybridep_sized_bytes(model.hidden_size, model.num_experts // base.ep, r_dom, n_dom,
                                             b * training.seq_len // (cp * tp)) for b in mbs_u.tolist()]
            other = other + (n_moe > 0) * np.array(hybridep)[:, None]
        if training.moe_token_dispatcher == "allgather":
            # memory.moe_allgather_buffer_bytes: linear in the micro-batch, a GPU's share of the tokens set by SP
            per_sequence = [moe_allgather_buffer_bytes(model, training, base.model_copy(
                update={"micro_batch_size": 1, "sequence_parallel": sp})) for sp in (False, True)]
            other = other + (n_moe > 0) * (np.where(sp_u, per_sequence[1], per_sequence[0]) * mbs_u)[:, None]
        # memory.stage_other_bytes: the GEMMs' workspaces [U, R], TE's three where the TP-overlap userbuffers run
        ws_r = [np.array([workspaces[(bool(r == base.loss_stage), bool(k), ub)] for r, k in zip(rows_r, n_moe)])
                for ub in (False, True)]
        other = other + np.where(ub_on_u[:, None], ws_r[1][None, :], ws_r[0][None, :])
        out_spike = (rows_r == base.loss_stage) * f["output_bytes"][:, None]  # [U, R]
        layer_phase = work + f["working"][:, None, None]  # [U, Z, R]: memory.layer_phase_bytes
        work_peak = np.maximum(layer_phase - out_spike[:, None, :], 0.0)
        # torch.distributed.pipelining's kept stage outputs [U, Z, R] (memory.pipeline_kept_output_bytes)
        kept = kept_outputs_bytes_of(training.pipeline_kept_outputs, base, m[:, None, None], rows_r[None, None, :],
                                     f["kept_output_bytes"][:, None, None], boundary_u[:, None, None],
                                     (act + out_spike)[:, None, :] + released)
        step_excess = step_excess_bytes(step_extra, act[:, None, :] + work_peak)  # memory.stage_memory
        mem = np.ceil((static + (act + other)[:, None, :] + work_peak + kept + step_excess) / KIB)
        if len(mrows) > len(rows):  # back to the three kinds: first, the worst middle, last
            mem = np.stack([mem[..., 0], mem[..., 1:-1].max(axis=-1), mem[..., -1]], axis=-1)
        if memory_only:
            mem_kib[si, ok] = mem[ok].astype(np.int64)
            legal[si, ok] = True
            continue
        hop = hops[(tp, cp, crosses)]
        # the zero-bubble schedules' bubble is simulated (cost.schedule_bubble_s): only for the combinations
        # that are legal and fit (m = 0 elsewhere: no simulation, no time; they cannot be chosen)
        m_step = m[:, None] if split.schedule is None else \
            np.where(ok & (mem.max(axis=-1) <= usable_kib), m[:, None], 0)
        # step time of each (micro, zero) [U, Z], by the one composition cost.estimate_time uses,
        # over the three stage kinds: per-micro-batch terms [U, 3], then [U, Z, 3] with the ZeRO terms
        if model.is_moe:  # every stage: dense-first layers make the middle stages differ
            step = _moe_step(model, hw, training, base, f, hop, m_step, zeros, gb, order, c, overlap_p2p, zb,
                             sync_cache, microbatches=m)
        else:
            empty = np.array([empty_chunks(x, v, first=r == 0) for r, x in rows], dtype=float)
            t = stage_terms(n, last, f, hop, p, v, overlap_p2p, c, empty=empty)
            terms = {k: val[:, None, :] for k, val in t.items()}
            counts, before = _stage_counts(p), _stage_before(p)
            step = compose_step(terms, z3_s[None], dpg_s[None], dpp_s[None], opt_s[None], m_step, p, v, counts,
                                before, overlap_grad_reduce_of(training), c, split.schedule, family,
                                **grad_reduction_args(training, p, zeros,
                                                      grad_reduce_trail_s(hw, training, base, order)),
                                bubble_of=zb, grad_accum=accum_s[None])["step"]
        owed = zb.owed()
        if owed is not None:  # its bubble comes from a simulation still to run (zb.run below)
            owed_steps.append((si, ok, step, owed))
        else:
            _set_times(time_ns, si, ok, step)
        mem_kib[si, ok] = mem[ok].astype(np.int64)
        legal[si, ok] = True
    return np.array([si for si, _ in indexed], dtype=np.int64), time_ns, mem_kib, legal, zb, owed_steps


def _set_times(time_ns: np.ndarray, si: int, ok: np.ndarray, step: np.ndarray) -> None:
    """Shape ``si``'s step times [U, Z] into the table, in ns (an infinite step: INFEASIBLE)."""
    step = np.where(np.isfinite(step), step, INFEASIBLE / NS)
    time_ns[si, ok] = np.round(step[ok] * NS).astype(np.int64)


def _moe_step(model, hw, training, base: Plan, f, hop, m, zeros, gb, order, c, overlap_p2p,
              bubble_of=None, sync_cache: dict | None = None, *, microbatches) -> np.ndarray:
    """Step time [U, Z] of a MoE model's shape over all its stages, as cost.estimate_time composes it
    (``m``: micro-batches per step as compose_step takes them, [U, 1] or [U, Z], 0 where a zero-bubble schedule is
    not simulated; ``microbatches``: the micro-batches per step of each micro option [U], for the all-to-all
    overlap's lone micro-batches; ``bubble_of``: compose_step's).

    The dense layers (``first_k_dense``, or the 0s of a ``moe_layer_pattern``) can spill past rank 0's first chunk
    or sit anywhere, so the middle stages
    of a MoE model need not be alike and the three stage kinds of the dense path do not suffice. Each distinct
    stage kind is a row here (what :func:`stage_terms` and the DP terms read of a stage: its layers, MoE layers,
    empty chunks, and whether it holds the embedding, the loss or the last layer), with how many stages it
    stands for (``counts``) and how many stages of each kind come before its first stage (``before``), as the
    dense path's three rows: a kind's stages have the same per-micro-batch time, and the first of them has the
    least to hide its DP sync under, so it is the one that can bind (compose_step's windows only grow with the
    stage index). The same step as one row per stage (``cost.estimate_time``), on a few rows in place of pp
    (DeepSeek-V3 at pp 16: 3 or 4).

    ``sync_cache``: a dict kept across the shapes of one table build. A stage kind's DP terms (gradient
    reduction, parameter all-gather, ZeRO-3 gather) depend only on the degrees, whether the pipeline is a V and
    the kind itself (its layers, MoE layers, and whether it holds the embedding, the loss or the last layer):
    ``cost.dp_sync_parts_s`` and ``cost.zero3_gather_s`` read no other field of the plan (``stage_param_split``,
    ``expert_span``). Shapes that differ only in their virtual stages or schedule share them.
    """
    p, v = base.pp, base.vpp
    layers = base.stage_layers(model.num_layers)
    n_moe = stage_moe_counts(model, base)
    empty = base.empty_chunks(model.num_layers)
    # a stage's kind: all that its terms (stage_terms: layers, MoE layers, the loss, empty chunks) and its DP
    # terms (the embedding, the loss, the last layer) read
    stage_kind = [(layers[r], n_moe[r], r == 0, r == base.loss_stage, r == p - 1, empty[r]) for r in range(p)]
    row_of: dict = {}  # kind -> its row, in the order of the kinds' first stages (stage 0's kind is row 0)
    kind_rows = [row_of.setdefault(key, len(row_of)) for key in stage_kind]
    firsts = [kind_rows.index(k) for k in range(len(row_of))]  # each kind's first stage
    counts = np.bincount(kind_rows, minlength=len(row_of)).astype(float)
    before = np.zeros((len(row_of), len(row_of)))  # [k, j]: stages of kind j before kind k's first stage
    seen = np.zeros(len(row_of))
    for r, k in enumerate(kind_rows):
        if r == firsts[k]:
            before[k] = seen
        seen[k] += 1
    # the MoE all-to-all overlap's micro-batches that run alone (cost.a2a_alone_share), per micro option
    alone = a2a_alone_share(microbatches, p, v, base.microbatch_group_size)
    t = stage_terms(np.array([layers[r] for r in firsts], dtype=float), np.array(firsts) == base.loss_stage, f, hop,
                    p, v, overlap_p2p, c, np.array([n_moe[r] for r in firsts], dtype=float),
                    np.array([empty[r] for r in firsts], dtype=float), alone)
    terms = {k: val[:, None, :] for k, val in t.items()}
    dpg, dpp, z3, opt, accum = [], [], [], [], []
    kinds = [stage_kind[r][:5] for r in firsts]  # what the DP terms read (not the empty chunks)
    first_of = dict(zip(kinds, firsts))
    split = {key: stage_param_split(model, base, r, layers[r]) for key, r in first_of.items()}
    by_zero: dict = {}  # ZeRO 1 and 2 sync alike (reduce-scatter + all-gather)
    cache = {} if sync_cache is None else sync_cache
    degrees = (base.tp, base.cp, base.dp, p, base.ep, base.etp, base.v_shaped)
    for z in zeros:
        zp = base.model_copy(update={"zero_stage": z})
        zk = min(z, 1) if z < 3 else 3
        if zk not in by_zero:
            by_zero[zk] = {}
            for key, r in first_of.items():
                ck = (degrees, zk, key)
                if ck not in cache:
                    cache[ck] = (*dp_sync_parts_s(model, hw, training, zp, r, layers[r], order),
                                 zero3_gather_s(model, hw, zp, r, layers[r], order, gb[0]) if z == 3 else 0.0)
                by_zero[zk][key] = cache[ck]
        rows = [(*by_zero[zk][key], *split[key]) for key in kinds]
        dpg.append([x[0] for x in rows])
        dpp.append([x[1] for x in rows])
        z3.append([x[2] for x in rows])
        opt.append(optimizer_s(model, hw, training, zp, [x[3] for x in rows], [x[4] for x in rows],
                               [(first_of[key], layers[first_of[key]]) for key in kinds]))
        accum.append([grad_accum_s(model, hw, training, zp, x[3] + x[4], key[4]) for x, key in zip(rows, kinds)])
    return compose_step(terms, np.array(z3)[None], np.array(dpg)[None], np.array(dpp)[None], np.array(opt)[None],
                        m, p, v, counts, before, overlap_grad_reduce_of(training),
                        c, base.pipeline_schedule, schedule_family(training),
                        **grad_reduction_args(training, p, zeros, grad_reduce_trail_s(hw, training, base, order)),
                        bubble_of=bubble_of, grad_accum=np.array(accum)[None])["step"]


def _micro_factors(model, hw, training, micros, base: Plan, order, pins: Pins = Pins(), memory_only: bool = False
                   ) -> dict:
    """For one (tp, cp): every per-micro-batch factor of every micro option (cost.micro_factors, and the
    memory terms), as arrays over the options; ``valid`` False where the plan is illegal or off the pins (SP:
    :meth:`Pins.sp_ok`, which depends on tp). ``memory_only`` (:func:`build_tables`'): the step-time factors are
    left at zero, as for an illegal option; nothing reads them (a fifth of a MoE memory-only build)."""
    cols: dict = {k: [] for k in (*FACTOR_KEYS, "saved", "saved_moe", "working", "input_bytes", "output_bytes",
                                  "mask_bytes", "bf16_delta", "deferred_per_mb", "kept_output_bytes", "valid")}
    fw = frameworks.get(training.framework)
    for mbs, rc, sp, off in micros:
        plan = base.model_copy(update={"micro_batch_size": mbs, "recompute": rc, "sequence_parallel": sp,
                                       "cpu_offload_layers": off})
        valid = not (sp and base.tp == 1) and pins.sp_ok(base.tp, sp)
        # memory/profiles: Megatron's MoE layer trains with tp > 1 only with SP (FrameworkProfile.moe_needs_sp)
        valid = valid and not (fw.moe_needs_sp and model.is_moe and base.tp > 1 and not sp)
        # Megatron's --distribute-saved-activations: full recompute, tp > 1, no SP (specs.plan_problems)
        valid = valid and not distributed_checkpoint_problems(training, plan)
        # Megatron's rules for the MoE all-to-all overlap the job asks for (specs.plan_problems)
        valid = valid and not a2a_overlap_problems(model, training, plan)
        # and for CUDA graphs (specs.plan_problems): no full recompute, no offloading, Megatron's recompute rules
        valid = valid and not cuda_graph_problems(model, training, plan)
        row = micro_factors(model, hw, training, plan, order) if valid and not memory_only else \
            dict.fromkeys(FACTOR_KEYS, 0.0) | {"bwd": 1.0}
        # memory (owned with planner.memory): per dense and per MoE layer, as memory.stage_saved_bytes
        dense_b, moe_b = saved_bytes_per_layer_kind(model, training, plan)
        row |= {"saved": dense_b, "saved_moe": moe_b, "working": layer_recompute_working_bytes(model, training, plan),
                "input_bytes": input_bytes_per_microbatch(model, training, plan),
                "output_bytes": output_bytes(model, training, plan),
                "mask_bytes": dataloader_mask_bytes(training, plan),
                "bf16_delta": bf16_layer_delta_bytes(model, training, plan),
                "deferred_per_mb": deferred_wgrad_bytes_per_microbatch(model, training, plan),
                "kept_output_bytes": kept_output_bytes(model, training, plan), "valid": valid}
        for k, val in row.items():
            cols[k].append(val)
    return {k: np.array(v) for k, v in cols.items()}


def _stage_before(p: int) -> np.ndarray:
    """before[k, j]: stages of kind j whose backward ends before that of kind k (first, first middle, last).

    The DP sync of a stage hides under its own last backward and the drain of every stage before it
    (cost.compose_step); the first middle stage has only the first before it.
    """
    if p == 1:
        return np.zeros((3, 3))
    return np.array([[0, 0, 0], [1, 0, 0], [1, max(p - 2, 0), 0]], dtype=float)


def _row_key(plan: Plan, stage: int, layers: int) -> tuple:
    """What a dense model's stage state and DP terms depend on (:func:`_state_rows`, :func:`_zero_terms`): the
    degrees, the micro-batch size (torchtitan's one-micro-batch steps), whether the pipeline is a V, whether the
    stage holds the embedding or the loss, and its layers; not the virtual stages nor the other stages' split.
    ``tests/test_search_tables_sweep.py`` checks the tables built with and without these keys are the same."""
    return (plan.tp, plan.cp, plan.dp, plan.pp, plan.ep, plan.etp, plan.micro_batch_size, plan.v_shaped, stage == 0,
            stage == plan.loss_stage, layers)


def _zero_terms(model, hw, training, plan: Plan, rows, zeros, gb, order, cache: dict | None = None):
    """Per ZeRO stage and stage kind of a dense model: gradient reduction, parameter all-gather and ZeRO-3
    gather [Z, 3]; optimizer time [Z]. Each distinct communication is computed once (the static memory is
    :func:`_state_rows`); with ``cache``, once per :func:`_row_key` for all the shapes of a table build."""
    cols = []
    for r, n in rows:
        key = ("zero", *_row_key(plan, r, n)) if cache is not None else None
        col = cache.get(key) if key else None
        if col is None:
            params = stage_params_per_rank(model, plan, r, n)
            sync = {k: dp_sync_parts_s(model, hw, training, plan.model_copy(update={"zero_stage": k}), r, n, order)
                    for k in sorted({min(z, 1) if z < 3 else 3 for z in zeros})}
            gather = zero3_gather_s(model, hw, plan.model_copy(update={"zero_stage": 3}), r, n, order, gb[0]) \
                if 3 in zeros else 0.0
            col = (params, [sync[min(z, 1) if z < 3 else 3] + (gather if z == 3 else 0.0,) for z in zeros])
            if key:
                cache[key] = col
        cols.append(col)
    params = [c[0] for c in cols]
    terms = np.array([c[1] for c in cols], dtype=float)  # [R, Z, 3]: reduction, all-gather, ZeRO-3 gather
    by_zero = [plan.model_copy(update={"zero_stage": z}) for z in zeros]
    opt_s = [optimizer_s(model, hw, training, zp, params, stage_rows=rows) for zp in by_zero]
    last = [r == plan.pp - 1 for r, _ in rows]
    accum_s = np.array([[grad_accum_s(model, hw, training, zp, x, end) for x, end in zip(params, last)]
                        for zp in by_zero])  # [Z, R]
    return terms[..., 0].T, terms[..., 1].T, terms[..., 2].T, np.array(opt_s), accum_s


def _memory_rows(model: ModelSpec, plan: Plan, rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(stage, layers) whose memory the tables must compute: the first and last stages of :func:`_stage_rows` and,
    with ``p > 2``, every middle stage, whose maximum is the table's middle kind.

    The first middle stage holds the most in-flight activations of the middle stages, but it need not be the
    fullest: a MoE model's dense-first layers can leave it lighter than the next; Megatron's steady-state boundary
    tensors (``memory.megatron_p2p_tensor_count``) are held only by the stages that reach the steady state, which
    the first middle stage may not when all its forwards are warm-up; and where the optimizer step's extra bytes
    exceed the activations (``memory.step_excess_bytes``) the stage's peak no longer falls with its activations.
    A randomized sweep (table entries against ``memory.stage_memory`` of every stage) found the table's peak up to
    98 MiB under the estimate's when only the first middle stage was computed (Qwen3-235B-A22B, pp 4 x vpp 3 on
    A100; Mixtral-8x7B and DeepSeek-V3 likewise); ``tests/test_search_tables_sweep.py`` holds such a job. The middle
    stages share their states (``_row_key``), so the extra rows cost little: the dense ``search_speed.py`` cases
    moved within their run-to-run noise."""
    p = plan.pp
    if p <= 2:
        return rows
    layers = plan.stage_layers(model.num_layers)
    return [rows[0], *[(r, layers[r]) for r in range(1, p - 1)], rows[-1]]


def _state_rows(model, hw, training, plan: Plan, rows, zeros, cache: dict | None = None) -> tuple[np.ndarray, ...]:
    """Static memory (weights + gradients + optimizer), its transient working set, what the last backward
    releases of it (``StateBytes.released_at_last_backward_bytes``) and what the optimizer step holds beyond it
    (``StateBytes.step_extra_bytes``) [Z, R] of each (stage, layers) row
    (memory.stage_state_bytes): the rows of :func:`_memory_rows` (the first stage, every middle one, the last).
    With ``cache``, a row is computed once per :func:`_row_key` for all the shapes of a
    table build; a MoE stage's key adds its MoE layers (``memory.stage_moe_layer_count``: which of its layers are
    dense-first depends on the whole split), all that ``memory.stage_param_inputs`` reads of the split."""
    cols = []
    for r, n in rows:
        key = None
        if cache is not None:
            key = ("state", *_row_key(plan, r, n)) + ((stage_moe_layer_count(model, plan, r, n),) if model.is_moe else ())
        col = cache.get(key) if key else None
        if col is None:
            inputs = stage_param_inputs(model, plan, r, n)  # the same for every ZeRO stage
            col = []
            for z in zeros:
                st = stage_state_bytes_of(model, training, plan.model_copy(update={"zero_stage": z}), n, inputs, hw, r)
                col.append((st.weights_bytes + st.grads_bytes + st.optimizer_bytes,
                            st.working_weights_bytes + st.working_grads_bytes, st.released_at_last_backward_bytes,
                            st.step_extra_bytes))
            if key:
                cache[key] = col
        cols.append(col)
    out = np.array(cols, dtype=float).reshape(len(rows), len(zeros), 4)  # [R, Z, 4]
    return tuple(out[..., i].T for i in range(4))


def _state_rows_by_micro(model, hw, training, base: Plan, rows, zeros, mbs_u: np.ndarray, B: int,
                         cache: dict | None = None) -> tuple[np.ndarray, ...]:
    """:func:`_state_rows` [U, Z, R] for each micro-batch size of the tables. The states depend on the micro-batch
    size only through whether the step has one micro-batch (torchtitan: ``optimizer.zero_grad`` frees the gradient
    shards between steps, so with one micro-batch they exist during backward only, ``frameworks.torchtitan
    .state_bytes``): the shape's base plan gives every size, and the size of a one-micro-batch step (``B / dp``) its
    own. Until 2026-12-05 the tables took the base plan's states for every size, above the estimate there."""
    states = _state_rows(model, hw, training, base, rows, zeros, cache)
    out = [np.broadcast_to(x[None], (len(mbs_u),) + x.shape) for x in states]
    one = B // base.dp if B % base.dp == 0 else 0
    single = mbs_u == one
    if one and one != base.micro_batch_size and single.any():
        other = _state_rows(model, hw, training, base.model_copy(update={"micro_batch_size": one}), rows, zeros, cache)
        out = [np.where(single[:, None, None], y[None], x) for x, y in zip(out, other)]
    return tuple(out)


def _stage_counts(p: int) -> tuple[int, int, int]:
    """How many stages each of the three kinds stands for: first, middles, last (1 stage when p == 1)."""
    if p == 1:
        return (1, 0, 0)
    return (1, max(p - 2, 0), 1)


# --- CP-SAT -------------------------------------------------------------------------------------

@dataclass
class Solution:
    index: int
    plan: Plan
    status: str
    wall_s: float


def pareto_by_group(tables: Tables) -> np.ndarray:
    """Flat indices of the legal combinations not dominated within their (tp, pp, cp): no other of the
    same (tp, pp, cp) is no slower, needs no more memory on its fullest stage and shards no more.

    The optimum survives (a stage fits exactly when the fullest one does, and the ties go to the lower ZeRO
    stage as in :func:`solve`) and so does the best plan of every (tp, pp, cp), which the alternatives need.
    Every pin is applied when the tables are built (``candidates``), so no pinned plan is dropped for an
    unpinned one. Sort by time, then a running minimum of memory per ZeRO stage, in numpy per group: on the
    dense ``benchmarks/search_speed.py`` cases about 2,000-5,000 of 57,000-85,000 combinations survive, in
    0.02-0.03 s (the former per-shape pairwise front kept 11,000-17,000 in 0.3-0.5 s, with the same optimum and
    alternatives).
    """
    S, U, Z = tables.legal.shape
    idx = np.flatnonzero(tables.legal.ravel())
    if idx.size == 0:
        return idx.astype(np.int64)
    s_idx, _, z_idx = np.unravel_index(idx, (S, U, Z))
    group_of_shape = {}
    gid = np.array([group_of_shape.setdefault((sh[0], sh[3].pp, sh[1]), len(group_of_shape)) for sh in tables.shapes])
    group = gid[s_idx]
    t = tables.time_ns.ravel()[idx]
    mem = tables.mem_kib.reshape(-1, 3)[idx].max(axis=1)
    zero = np.array(tables.zeros)[z_idx]
    order = np.lexsort((mem, zero, t, group))
    group, t, mem, zero, idx = group[order], t[order], mem[order], zero[order], idx[order]
    keep = np.ones(idx.size, dtype=bool)
    bounds = np.flatnonzero(np.diff(group)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, idx.size]):
        m, zz = mem[lo:hi].astype(float), zero[lo:hi]
        for z in np.unique(zz):
            mz = np.where(zz <= z, m, np.inf)
            before = np.minimum.accumulate(np.r_[np.inf, mz[:-1]])  # best memory of the faster ones
            keep[lo:hi] &= ~((zz == z) & (before <= m))
    return np.sort(idx[keep])


CP_MODEL = "ortools.sat.python.cp_model"


class _PandasOnFirstUse(types.ModuleType):
    """Stands for pandas in ortools' ``cp_model`` module: the real pandas is imported on the first attribute read."""

    def __getattr__(self, name: str):
        import pandas

        return getattr(pandas, name)


def cp_model_module():
    """OR-Tools' CP-SAT Python module, imported without importing pandas.

    ortools 9.x ``ortools/sat/python/cp_model.py`` imports pandas at module level for its ``*_series`` helpers
    (``new_int_var_series`` and the like), which plan3d does not call; on a 2-core machine pandas is about 0.4 s
    of the 2 s a ``plan3d search`` process takes (``python -X importtime``; ``benchmarks/search_speed.py``).
    Where neither module is imported yet, ``cp_model`` is imported against a stand-in that has only the two
    names it reads at import time (``pd.Index`` and ``pd.Series``, for a type alias), and its ``pd`` is then
    replaced by :class:`_PandasOnFirstUse`, so the series helpers still find the real pandas in the same
    process. If the import reads anything else, it is redone the ordinary way."""
    if CP_MODEL in sys.modules or "pandas" in sys.modules:
        return importlib.import_module(CP_MODEL)
    stand_in = types.ModuleType("pandas")
    stand_in.Index, stand_in.Series = type("Index", (), {}), type("Series", (), {})
    sys.modules["pandas"] = stand_in
    try:
        module = importlib.import_module(CP_MODEL)
    except Exception:  # a later ortools that reads more of pandas at import: the ordinary import
        sys.modules.pop(CP_MODEL, None)
        module = None
    finally:
        if sys.modules.get("pandas") is stand_in:
            del sys.modules["pandas"]
    if module is None:
        return importlib.import_module(CP_MODEL)
    module.pd = _PandasOnFirstUse("pandas")
    return module


def solve(tables: Tables, pins: Pins, candidates: np.ndarray, forbid_shapes: list[tuple] = (),
          time_limit_s: float = 10.0) -> Solution | None:
    """The fastest combination among ``candidates`` that fits, as CP-SAT proves it; None when none fits."""
    cp_model = cp_model_module()

    t0 = time.perf_counter()
    if candidates.size == 0:
        return None
    model = cp_model.CpModel()
    s_idx, u_idx, z_idx = np.unravel_index(candidates, tables.legal.shape)
    # i indexes the candidate list; every knob, the step time and each stage's memory are tables over
    # i. The (tp, pp, cp) already reported are removed from i's domain (the same as forbidding
    # those knob values, but it keeps the element bounds tight).
    allowed = np.ones(candidates.size, dtype=bool)
    for shape in forbid_shapes:
        allowed &= ~np.array([(sh[0], sh[3].pp, sh[1]) == tuple(shape) for sh in tables.shapes])[s_idx]
    if not allowed.any():
        return None
    i = model.NewIntVarFromDomain(cp_model.Domain.FromValues(np.flatnonzero(allowed).tolist()), "candidate")

    def table_var(name: str, values) -> cp_model.IntVar:
        values = np.asarray(values, dtype=np.int64)
        var = model.NewIntVar(int(values.min()), int(values.max()), name)
        model.AddElement(i, values.tolist(), var)
        return var

    shape_arr = np.array([(tp, cp, dp, sp.pp, sp.vpp, sp.first, sp.last, ep, etp or tp)
                          for tp, cp, dp, sp, ep, etp in tables.shapes])[s_idx]
    micro_arr = np.array([(mbs, RECOMPUTE.index(rc), int(sp), off) for mbs, rc, sp, off in tables.micros])[u_idx]
    knob = {name: table_var(name, shape_arr[:, j])
            for j, name in enumerate(("tp", "cp", "dp", "pp", "vpp", "first_layers", "last_layers", "ep", "etp"))}
    knob |= {name: table_var(name, micro_arr[:, j])
             for j, name in enumerate(("micro_batch_size", "recompute", "sequence_parallel", "cpu_offload_layers"))}
    knob["zero_stage"] = table_var("zero_stage", np.array(tables.zeros)[z_idx])
    for j, kind in enumerate(("first", "middle", "last")):  # every stage within the usable memory
        model.Add(table_var(f"memory_{kind}_stage_kib", tables.mem_kib[s_idx, u_idx, z_idx, j]) <= tables.usable_kib)
    for name in ("tp", "pp", "dp", "cp", "vpp", "micro_batch_size", "zero_stage", "ep", "etp", "cpu_offload_layers"):
        if getattr(pins, name) is not None:
            model.Add(knob[name] == getattr(pins, name))
    if pins.recompute is not None:
        model.Add(knob["recompute"] == RECOMPUTE.index(pins.recompute))
    # a pinned SP is in the tables (Pins.sp_ok: SP at tp > 1, none at tp 1), not a constraint here
    # the step time first; among equally fast plans the lower ZeRO stage (less machinery, same result).
    # One precomputed table keeps the element bound tight, so CP-SAT proves the optimum at once.
    zero = np.array(tables.zeros, dtype=np.int64)[z_idx]
    model.Minimize(table_var("objective", 4 * tables.time_ns[s_idx, u_idx, z_idx] + zero))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    index = int(candidates[solver.Value(i)])
    return Solution(index=index, plan=tables.plan(index), status=solver.StatusName(status),
                    wall_s=time.perf_counter() - t0)


# --- the search ---------------------------------------------------------------------------------

@dataclass
class SearchResult:
    best: Plan | None
    alternatives: list[Plan] = field(default_factory=list)
    status: str = "INFEASIBLE"
    wall_s: float = 0.0  # the whole search: the cost and memory tables, CP-SAT, the reference checks
    solver_s: float = 0.0  # of it, CP-SAT's own solves
    candidates: int = 0
    closest: Plan | None = None  # when infeasible: the legal plan with the smallest memory overshoot
    # the job as each plan runs it: the input, with the switches the search picked (SWITCHES); None
    # where no plan was found
    training: TrainingSpec | None = None
    alternative_trainings: list[TrainingSpec] = field(default_factory=list)


#: How many of the solver's picks the reference memory estimate may refuse one by one. Each pick is confirmed by
#: :func:`reference_fits` before it is returned; from this many refusals on, a refused pick also drops every
#: candidate whose table peak is at least its own (the refusals come from the last GiB under the limit, where the
#: tables' allocated peak and the profile's verdict part), which bounds the re-solves. The plan found is then the
#: fastest among the candidates below that peak, not necessarily of all. (Before 2026-12-06 the pick after the
#: sixteenth refusal was returned unconfirmed.)
MAX_REFERENCE_REJECTIONS = 16


def reference_fits(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, plan: Plan) -> bool:
    """Whether ``planner.memory.estimate_memory`` (what ``estimate`` and ``check`` judge by) says ``plan`` fits.
    The search tables hold each stage's allocated peak; under torchtitan the estimate judges by the caching
    allocator's replayed reserved peak, which can exceed the usable memory where the allocated peak does not."""
    from planner.memory import estimate_memory

    return estimate_memory(model, hw, training, plan).fits


#: Job switches the search may choose (``SearchSpace`` fields of the same name), each as (the framework's default,
#: the lighter value). Each makes no plan slower and none larger at its lighter value (bf16 gradients: a smaller
#: gradient buffer and fewer bytes to reduce; fp8 weights: no bf16 copy or fp8 cache and fewer bytes to gather;
#: Transformer Engine's fused cross entropy, Megatron ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl te``:
#: 2 B per logit where Megatron's unfused loss keeps 6, ``frameworks.megatron``, and no time modelled either way),
#: and changes no plan's legality; tests/test_search_grad_dtype.py checks it on the tables. The default is
#: Megatron-LM's. One exception, listed in ``LARGER_AT_STEP_WHEN_TRUE``: Megatron's optimizer step makes fp32 copies
#: of a bf16 gradient buffer (``frameworks.megatron.step_grad_copy_bytes``: 4 B per parameter without the distributed
#: optimizer, 4 / (dp x cp) with it), so where a stage's activations are smaller than what the bf16 buffer saves (2 B
#: per parameter), bf16 gradients need more memory at the step. :func:`search` then searches again with the default
#: where the bf16 search finds no plan.
SWITCHES: dict[str, tuple] = {"grad_reduce_in_bf16": (False, True), "fp8_params": (False, True),
                              "cross_entropy_fusion": ("none", "te")}
LARGER_AT_STEP_WHEN_TRUE = ("grad_reduce_in_bf16",)


def _light(fields) -> dict:
    """Each switch of ``fields`` at its lighter value (``SWITCHES``)."""
    return {f: SWITCHES[f][1] for f in fields}


def _default(fields) -> dict:
    """Each switch of ``fields`` at the framework's default (``SWITCHES``)."""
    return {f: SWITCHES[f][0] for f in fields}


def switch_values(space: SearchSpace, training: TrainingSpec) -> dict[str, tuple]:
    """The values of each ``SWITCHES`` switch a search covers: ``space``'s, else the job's own."""
    return {f: getattr(space, f) or (getattr(training, f),) for f in SWITCHES}


def search(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace | None = None,
           top_k: int = 0, order: str = DEFAULT_ORDER) -> SearchResult:
    """The fastest plan that fits, and up to ``top_k`` alternatives, each with another (tp, pp, cp).

    Switches offered both ways (``SWITCHES``: ``SearchSpace.grad_reduce_in_bf16``, ``.fp8_params``,
    ``.cross_entropy_fusion``) are set to their lighter value for the tables: no plan is slower or larger with it,
    so the fastest plan over both values is the fastest with the lighter one. Each plan found then gets the default
    of each back, in that order, where it is as fast and still fits (:func:`_prefer_defaults`)."""
    space = space or SearchSpace()
    offered = {f: set(v) for f, v in switch_values(space, training).items()}
    training = training.model_copy(update={f: next(iter(v)) for f, v in offered.items() if len(v) == 1})
    searched = [f for f, v in offered.items() if len(v) > 1]
    if not searched:
        return _search(model, hw, training, space, top_k, order)
    t0 = time.perf_counter()
    light = training.model_copy(update=_light(searched))
    result = _search(model, hw, light, replace(space, **dict.fromkeys(searched, None)), top_k, order)
    heavier = [f for f in searched if f in LARGER_AT_STEP_WHEN_TRUE]
    if result.best is None and heavier:  # those switches' default may fit where True does not (LARGER_AT_STEP_...)
        light = light.model_copy(update=_default(heavier))
        searched = [f for f in searched if f not in heavier]
        first_solver_s = result.solver_s
        result = _search(model, hw, light, replace(space, **dict.fromkeys(searched + heavier, None)), top_k, order)
        result.solver_s += first_solver_s
    if result.best is not None:
        result.training = _prefer_defaults(model, hw, light, result.best, searched, order)
        result.alternative_trainings = [_prefer_defaults(model, hw, light, p, searched, order)
                                        for p in result.alternatives]
    result.wall_s = time.perf_counter() - t0
    return result


def _prefer_defaults(model: ModelSpec, hw: HardwareSpec, light: TrainingSpec, plan: Plan, searched: list[str],
                     order: str = DEFAULT_ORDER) -> TrainingSpec:
    """``light`` (the job with every switch of ``searched`` at its lighter value), with each switch in turn set back
    to its default where ``plan`` is as fast without it (to the tables' nanosecond) and still fits."""
    from planner.cost import estimate_time

    t_light = estimate_time(model, hw, light, plan, order).step_time_s
    run = light
    for f in searched:
        back = run.model_copy(update=_default([f]))
        if estimate_time(model, hw, back, plan, order).step_time_s <= t_light + 0.5 / NS \
                and reference_fits(model, hw, back, plan):
            run = back
    return run


def _search(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace, top_k: int,
            order: str) -> SearchResult:
    """:func:`search` with the job's switches as ``training`` has them."""
    t0 = time.perf_counter()
    hw = hw.for_job(training.num_gpus)  # the NVLink domain this job's ranks fill (HardwareSpec.job_nvlink_domain)
    tables = build_tables(model, hw, training, space, order)
    result = SearchResult(best=None, candidates=tables.candidates)
    candidates = pareto_by_group(tables)
    found = []
    rejected = 0
    while len(found) < top_k + 1:
        forbid = [(p.tp, p.pp, p.cp) for p in found]
        sol = solve(tables, space.pins, candidates, forbid)
        if sol is None:
            break
        result.solver_s += sol.wall_s
        if not reference_fits(model, hw, training, sol.plan):
            # the tables hold the allocated peak; a profile that judges by more (torchtitan: the caching
            # allocator's reserved peak, planner.allocator_trace) can refuse the pick: drop it, solve again.
            # Every pick is confirmed: none is returned on the tables' word alone
            rejected += 1
            if rejected <= MAX_REFERENCE_REJECTIONS:
                candidates = candidates[candidates != sol.index]
            else:  # from then on, drop every candidate at least as full by the tables as this refused pick
                peak = tables.mem_kib.reshape(-1, 3)[candidates].max(axis=1)
                candidates = candidates[peak < tables.mem_kib.reshape(-1, 3)[sol.index].max()]
            continue
        found.append(sol.plan)
        if len(found) == 1:
            result.status = sol.status
    if found:
        result.best, result.alternatives = found[0], found[1:]
        result.training, result.alternative_trainings = training, [training] * len(found[1:])
    elif tables.candidates:
        over = np.where(tables.legal, tables.mem_kib.max(axis=-1), INFEASIBLE).ravel()
        result.closest = tables.plan(int(over.argmin()))
    result.wall_s = time.perf_counter() - t0
    return result


def exhaustive(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace | None = None,
               order: str = DEFAULT_ORDER) -> tuple[Plan | None, float, int]:
    """Brute force: (best plan, its step time, plans tried), with the reference cost and memory functions."""
    return exhaustive_with_training(model, hw, training, space, order)[:3]


def exhaustive_with_training(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec,
                             space: SearchSpace | None = None, order: str = DEFAULT_ORDER
                             ) -> tuple[Plan | None, float, int, TrainingSpec]:
    """:func:`exhaustive` over every value of the switches ``SearchSpace`` offers (``SWITCHES``; by
    default the job's own), and the job as its best plan runs it (the first listed among equally fast)."""
    import itertools

    from planner.cost import estimate_time
    from planner.memory import estimate_memory

    space = space or SearchSpace()
    best, best_t, n, best_tr = None, float("inf"), 0, training
    for combo in itertools.product(*switch_values(space, training).values()):
        tr = training.model_copy(update=dict(zip(SWITCHES, combo)))
        for plan in enumerate_plans(model, hw, tr, space):
            n += 1
            if not estimate_memory(model, hw, tr, plan).fits:
                continue
            t = estimate_time(model, hw, tr, plan, order).step_time_s
            if t < best_t:
                best, best_t, best_tr = plan, t, tr
    return best, best_t, n, best_tr


def any_plan_fits(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace | None = None,
                  order: str = DEFAULT_ORDER) -> bool:
    """Whether :func:`search` would find a plan that fits, without costing any: the same tables (memory only,
    ``build_tables(memory_only=True)``), the same job switches (``SWITCHES`` at their lighter values, then the
    ``LARGER_AT_STEP_WHEN_TRUE`` ones back off), the same pins (the tables hold only what the pins allow: the
    shapes, micro-batch options and ZeRO stages are built from them) and the same reference memory check
    (:func:`reference_fits`) of up to ``MAX_REFERENCE_REJECTIONS`` fitting entries, the smallest peaks first.
    ``tests/test_search_smallest.py`` checks it against :func:`search`."""
    space = space or SearchSpace()
    offered = {f: set(v) for f, v in switch_values(space, training).items()}
    searched = [f for f, v in offered.items() if len(v) > 1]
    light = training.model_copy(update={f: next(iter(v)) for f, v in offered.items() if f not in searched}
                                | _light(searched))
    jobs = [light]
    heavier = [f for f in searched if f in LARGER_AT_STEP_WHEN_TRUE]
    if heavier:
        jobs.append(light.model_copy(update=_default(heavier)))
    space = replace(space, **dict.fromkeys(searched, None))
    for tr in jobs:
        tables = build_tables(model, hw.for_job(tr.num_gpus), tr, space, order, memory_only=True)
        peak = tables.mem_kib.max(axis=-1).ravel()
        candidates = np.flatnonzero(tables.legal.ravel() & (peak <= tables.usable_kib))
        smallest_first = candidates[np.argsort(peak[candidates], kind="stable")][:MAX_REFERENCE_REJECTIONS]
        if any(reference_fits(model, hw.for_job(tr.num_gpus), tr, tables.plan(int(k))) for k in smallest_first):
            return True
    return False


@dataclass(frozen=True)
class ClusterSize:
    """The answer of :func:`smallest_fitting_gpus`: ``gpus``, the smallest count tried that fits; the counts tried
    were ``start * 2**k`` up to the first that fits (``start`` itself does not), then, where that doubling left a
    gap, the counts ``low + step``, ``low + 2 step``, ... below ``gpus`` (``low``: the last doubling that does not
    fit), halved as a bisection would (fitting is taken to grow with the count there)."""
    gpus: int
    start: int
    low: int
    step: int

    def describe(self) -> str:
        tried = f"{self.start} x 2^k"
        if self.step and self.low + self.step < 2 * self.low:
            tried += f", then steps of {self.step} between {self.low} and {2 * self.low}"
        return f"the smallest GPU count that fits is {self.gpus} (tried {tried})"


def smallest_fitting_gpus(model: ModelSpec, hw: HardwareSpec, training: TrainingSpec, space: SearchSpace | None = None,
                          max_doublings: int = 12) -> ClusterSize | None:
    """The smallest GPU count found for which some plan fits, or None (:class:`ClusterSize` says which counts were
    tried). First ``num_gpus * 2**k`` (k = 1, 2, ...; at most ``MAX_GPUS``) up to the first that fits; then the gap
    below it, from the last count that does not fit, in steps of an eighth of the gap (whole nodes of
    ``gpus_per_node`` once the counts reach a node), by bisection. Each count is judged by :func:`any_plan_fits`:
    what the search would find, without costing any plan."""
    def fits(n: int) -> bool:
        return any_plan_fits(model, hw, training.model_copy(update={"num_gpus": n}), space)

    low, high = training.num_gpus, None
    for k in range(1, max_doublings + 1):
        n = training.num_gpus * 2**k
        if n > MAX_GPUS:
            break
        if fits(n):
            high = n
            break
        low = n
    if high is None:
        return None
    unit = hw.gpus_per_node if low >= hw.gpus_per_node else 1
    step = max(unit, (high - low) // 8 // unit * unit)
    # low + step, low + 2 step, ... each rounded up to whole nodes (a start that is not one: 12 GPUs -> 16)
    between = sorted(c for c in {-(-(low + j * step) // unit) * unit for j in range(1, (high - low) // step + 1)}
                     if low < c < high)
    best, a, b = high, 0, len(between) - 1
    while a <= b:
        mid = (a + b) // 2
        if fits(between[mid]):
            best, b = between[mid], mid - 1
        else:
            a = mid + 1
    return ClusterSize(gpus=best, start=training.num_gpus, low=low, step=step if between else 0)


def parse_gpu_counts(text: str, max_gpus: int = MAX_GPUS) -> list[int]:
    """``"64"``, ``"64,128,256"`` or ``"64..4096"`` (doubling from the first to the last), each at most ``max_gpus``."""
    text = text.strip()
    try:
        if ".." in text:
            lo_s, hi_s = text.split("..", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo < 1 or hi < lo:
                raise ValueError(f"'{text}': a range needs 1 <= first <= last")
            counts = []
            while lo <= hi:
                counts.append(lo)
                lo *= 2
        else:
            counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as err:
        if "range needs" in str(err):
            raise
        raise ValueError(f"'{text}': expected a GPU count (64), a list (64,128,256) or a range (64..4096)") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"'{text}': GPU counts must be positive integers")
    if max(counts) > max_gpus:
        raise ValueError(f"'{text}': at most {max_gpus:,} GPUs")
    return counts
