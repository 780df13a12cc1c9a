"""How many parameter elements DeepSpeed ZeRO-3 holds gathered: its parameter coordinator, ported.

DeepSpeed 0.19.8 ``runtime/zero/partitioned_param_coordinator.py`` (``PartitionedParameterCoordinator``) decides,
per module hook, which partitioned parameters to all-gather and which to release, from element counts and the
module trace alone:

* ``fetch_sub_module`` (each module's pre-forward and pre-backward hook, also for modules that hold no parameter of
  their own): gathers the module's own parameters, pops them off the trace's parameter queue, then prefetches the
  next parameters of the queue until ``stage3_prefetch_bucket_size`` elements, or ``stage3_max_live_parameters`` less
  those already gathered (``__n_available_params``), are in flight; every queue entry it scans past, gathered or not,
  is marked as fetched for the step it is used at (``__most_recent_step_id_param_fetched_for``);
* ``release_sub_module`` (each post-forward and post-backward hook) releases the module's parameters except those
  marked for a later step and those used again within ``stage3_max_reuse_distance`` elements of the trace
  (``__params_to_release``, which is ``functools.lru_cache``-d per module and step, so the first traced step's
  decisions hold for every later one);
* ``reset_step`` (the model's pre-forward) rewinds the queue and sets ``__n_available_params`` to 0;
  ``release_backward_leftovers`` (``stage3.py::backward_epilogue``) releases the modules whose post-backward hook
  never fired (those whose input needs no gradient: the embedding and the modules around it);
* parameters of at most ``stage3_param_persistence_threshold`` elements are never partitioned
  (``parameter_offload.py::mark_persistent_parameters``; ``stage3_model_persistence_threshold``, which caps their
  total, is taken at its default, unlimited: ``partition_parameters.py`` applies it per partition against a counter
  shared by every model of the process).

The forward runs the module tree's hooks in call order (pre-forward, the children, post-forward); the backward runs
them mirrored (``parameter_offload.py``: a module's pre-backward function wraps its outputs, its post-backward
function its inputs, so the gradient meets them in reverse nesting). The first forward records the trace; from
the second on the trace is complete. The recording step releases every partitioned parameter after its module and
ends with only the persisted ones gathered, and so does every complete step (a parameter's last use in the backward
releases it), so each complete step starts alike and repeats the one before: :func:`gathered_elements` replays one
and returns the most elements gathered (in flight or available) right after any fetch. ``tests/test_deepspeed_zero3.py`` replays the real
coordinator on CPU (``tests/deepspeed_zero3_probe.py``) over the same module trees and compares every fetch.

Pure Python, no torch: ``plan3d search`` imports it.
"""

from __future__ import annotations

import bisect
import collections
import functools
from dataclasses import dataclass

#: DeepSpeed 0.19.8 ``runtime/zero/config.py`` defaults (elements)
PREFETCH_BUCKET_DEFAULT = 50_000_000
MAX_LIVE_DEFAULT = 1_000_000_000
MAX_REUSE_DEFAULT = 1_000_000_000
PERSISTENCE_THRESHOLD_DEFAULT = 100_000


@dataclass(frozen=True)
class Module:
    """One ``nn.Module`` as DeepSpeed sees it: its own parameters (``recurse=False``) as ``(id, elements)`` pairs,
    ids in the order DeepSpeed numbers them (``ds_id``: ``module.parameters()`` order; a tied weight repeats its
    first id), and the children it calls, in call order, each once."""

    params: tuple[tuple[int, int], ...] = ()
    children: tuple["Module", ...] = ()
    #: called by its parent through reentrant activation checkpointing (``torch.utils.checkpoint`` with
    #: ``use_reentrant=True``, DeepSpeed's ``checkpointing.checkpoint``): its first forward runs without autograd, and
    #: the backward runs its forward again before its backward
    checkpointed: bool = False


@dataclass(frozen=True)
class Settings:
    """The ``zero_optimization`` keys the coordinator reads, in elements."""

    prefetch_bucket: int = PREFETCH_BUCKET_DEFAULT
    max_live: int = MAX_LIVE_DEFAULT
    max_reuse: int = MAX_REUSE_DEFAULT
    persistence_threshold: int = PERSISTENCE_THRESHOLD_DEFAULT


def hook_events(root: Module) -> list[tuple[str, int, bool]]:
    """The coordinator calls of one forward and backward, as ``(kind, module index, forward)``; ``kind`` is
    "fetch", "release" or "leftovers" (the last, once, for ``release_backward_leftovers``). Module indices number
    the tree in pre-order. The root and the modules on the path to the first one called with parameters (whose
    input needs no gradient) never run their post-backward hook."""
    events: list[tuple[str, int, bool]] = []
    index = {id(m): i for i, m in enumerate(flatten(root))}

    # the forward, and which modules see an input that needs a gradient: none before the first parameter is used
    grad_seen = [False]
    no_post_backward: set[int] = set()

    def forward(m: Module, mark: bool = True) -> None:
        i = index[id(m)]
        if mark and not grad_seen[0]:
            no_post_backward.add(i)
        events.append(("fetch", i, True))
        if m.params and mark:
            grad_seen[0] = True
        for c in m.children:
            forward(c, mark)
        events.append(("release", i, True))

    def backward(m: Module) -> None:
        # a module's pre-backward function wraps its outputs and its post-backward function its inputs
        # (parameter_offload.py), so the gradient meets them in reverse nesting; a checkpointed module's
        # backward starts with its forward again (CheckpointFunction.backward), whose hooks count as forward ones
        i = index[id(m)]
        if m.checkpointed:
            forward(m, mark=False)
        events.append(("fetch", i, False))
        for c in reversed(m.children):
            backward(c)
        if i not in no_post_backward:
            events.append(("release", i, False))

    forward(root)
    backward(root)
    events.append(("leftovers", -1, False))
    return events


def flatten(root: Module) -> list[Module]:
    """The tree's modules in pre-order (the numbering of :func:`hook_events`)."""
    out: list[Module] = []

    def walk(m: Module) -> None:
        out.append(m)
        for c in m.children:
            walk(c)
    walk(root)
    return out


def replay(root: Module, settings: Settings, steps: int = 1) -> list[int]:
    """Elements gathered (available or in flight, persisted ones included) right after each fetch of ``steps``
    complete steps (steps 2, 3, ... of a run: the first records the trace and leaves only the persisted parameters
    gathered), as the coordinator (module docstring) leaves them."""
    modules = flatten(root)
    events = hook_events(root)
    numel: dict[int, int] = {}
    for m in modules:
        for pid, n in m.params:
            numel[pid] = n
    persisted = {pid for pid, n in numel.items() if n <= settings.persistence_threshold}
    own = [tuple(sorted({pid for pid, _ in m.params})) for m in modules]

    trace = [i for kind, i, _ in events if kind == "fetch"]  # __submodule_order
    param_order = [(pid, step) for step, i in enumerate(trace) for pid in own[i]]
    used_at: dict[int, list[int]] = collections.defaultdict(list)  # trace steps using each parameter, ascending
    for pid, step in param_order:
        if not used_at[pid] or used_at[pid][-1] != step:
            used_at[pid].append(step)
    cum = [0]  # elements of the trace's modules before each step
    for i in trace:
        cum.append(cum[-1] + sum(numel[pid] for pid in own[i]))

    gathered: set[int] = set(persisted)  # gathered once and never released
    held = [sum(numel[pid] for pid in persisted)]  # elements of ``gathered``
    active: dict[int, set[int]] = collections.defaultdict(set)
    cache: dict[tuple[int, int], frozenset[int]] = {}
    seen: list[int] = []

    def gather(pids) -> int:
        added = 0
        for pid in pids:
            if pid not in gathered:
                gathered.add(pid)
                added += numel[pid]
        held[0] += added
        return added

    def release_param(pid: int) -> int:
        if pid in gathered and not active[pid]:
            gathered.discard(pid)
            held[0] -= numel[pid]
            return numel[pid]
        return 0

    for _ in range(steps):
        queue = collections.deque(param_order)  # reset_step
        fetched_for: dict[int, int] = collections.defaultdict(lambda: int(-1e10))
        n_available = 0
        step_id = 0
        active_backward: dict[int, bool] = {}

        def to_release(i: int, at: int) -> frozenset[int]:
            # __params_to_release (cached per module and step, as DeepSpeed's lru_cache does): a parameter marked
            # for a later step is kept, and so is one used again at trace step j >= at while the elements of the
            # modules at .. j-1 stay under max_reuse (the loop's check before each module; the first use decides)
            if (i, at) not in cache:
                out = {pid for pid in own[i] if pid not in persisted and fetched_for[pid] <= at}
                for pid in list(out):
                    uses = used_at[pid]
                    k = bisect.bisect_left(uses, at)
                    if k < len(uses) and cum[uses[k]] - cum[at] < settings.max_reuse:
                        out.discard(pid)
                cache[(i, at)] = frozenset(out)
            return cache[(i, at)]

        for kind, i, fwd in events:
            if kind == "fetch":
                if not fwd:
                    active_backward.setdefault(i, True)
                n_available += gather(own[i])
                for pid in own[i]:
                    active[pid].add(i)
                # pop the module's own parameters off the queue unless a prefetch already did
                not_fetched = {pid for pid in own[i] if fetched_for[pid] < step_id}
                discarded: set[int] = set()
                while queue and len(discarded) < len(not_fetched):
                    pid, at = queue.popleft()
                    fetched_for[pid] = at
                    discarded.add(pid)
                if discarded != not_fetched:
                    raise AssertionError(f"trace out of order at step {step_id}")
                if settings.prefetch_bucket > 0:
                    limit = min(settings.max_live - n_available, settings.prefetch_bucket)
                    picked: list[int] = []
                    count = 0
                    while queue and count < limit:
                        pid, at = queue.popleft()
                        fetched_for[pid] = max(fetched_for[pid], at)
                        if pid not in gathered and pid not in picked:
                            picked.append(pid)
                            count += numel[pid]
                    if count > 0:
                        n_available += gather(picked)
                seen.append(held[0])
                step_id += 1
            elif kind == "release":
                rel = to_release(i, step_id)
                if not fwd:
                    active_backward.pop(i, None)
                for pid in own[i]:
                    active[pid].discard(i)
                    if pid in rel:
                        n_available -= release_param(pid)
            else:  # release_backward_leftovers: last in, first out
                while active_backward:
                    j, _ = active_backward.popitem()
                    for pid in own[j]:
                        active[pid].discard(j)
                        if pid not in persisted:
                            n_available -= release_param(pid)
    return seen


@functools.lru_cache(maxsize=256)
def gathered_elements(root: Module, settings: Settings) -> int:
    """The most parameter elements DeepSpeed ZeRO-3 holds gathered at once in a step, persisted ones included
    (module docstring)."""
    return max(replay(root, settings), default=0)
