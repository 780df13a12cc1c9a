"""The rank program of `plan3d validate`, started by torchrun on every rank.

It builds a DeviceMesh in the plan's rank layout, the model with DTensor tensor parallelism,
``torch.distributed.pipelining`` stages and schedule (1F1B, or interleaved 1F1B when vpp > 1),
FSDP2 over the data-parallel ranks (in bf16 with torchtitan's mixed precision, :func:`mp_policy`),
activation checkpointing for recompute and AdamW. Then it
measures collectives on the plan's own groups, runs warm-up and measured steps on a fixed
synthetic batch, and gathers every rank's measurements to rank 0, which writes them as JSON.

A mixture-of-experts plan also gets an expert grid (:func:`moe_mesh`): each rank keeps its ``E/ep``
experts of every MoE layer (planner.validate.moe_layer), FSDP2 shards them over the expert-data-parallel
ranks, the worker records the tokens each rank's experts received per layer and micro-batch, and rank 0
compares its first-step gradients with the single-process model's (:func:`_grad_check`).

Context parallelism (cp > 1, gloo) adds a ``cp`` mesh axis between tp and dp (Megatron's tp-cp-dp-pp):
each rank keeps its head-tail share of every sequence (tokens, labels, positions), attention is torch's
ring attention over the cp group (planner.validate.ring), FSDP2 reduces gradients over dp x cp
(:func:`dp_cp_mesh`), the reported loss is the mean over cp, and rank 0 runs :func:`_grad_check` too.

Each rank writes its current phase to ``--phase-dir``/rank<N>, so that the launcher can say which
rank stalled where. ``PLAN3D_VALIDATE_FAULT=rank:phase`` makes that rank exit in that phase
(used by the failure tests); ``rank:phase:hang`` makes it stall there instead.

Test-only sabotage (``PLAN3D_VALIDATE_SABOTAGE``, comma-separated), so that the tests can show the
verdict fails for each kind of miss; never set it in a real run:

* ``gpipe``: run GPipe (every micro-batch in flight) instead of 1F1B, a wrong in-flight count;
* ``local_attention``: with cp, each rank attends to its own s/cp tokens only (the ring dropped);
* ``corrupt:<rank>``: add 0.5 to that rank's local shard of the first down projection (FFN w2) after building;
* ``slow:<rank>:<seconds>``: that rank sleeps this long in every step;
* ``oom:<rank>``: that rank raises ``torch.OutOfMemoryError`` in its second step.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from planner.presets import load_scenario
from planner.specs import Scenario
from planner.validate.calibrate import time_it
from planner.validate.launch import OOM_EXIT_CODE, refusal, run_precision
from planner.validate.model import build_chunks, build_local_chunks, materialize_local, set_recompute, tensor_parallelize

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # slowest to fastest: Megatron order tp-cp-dp-pp


class TiedEmbedding:
    """A tied word embedding split over the first and last pipeline stage: both copies start equal
    and their gradients are summed over the pair of ranks that hold them (Megatron's embedding group,
    ``_allreduce_word_embedding_grads``). Both are vocab-parallel with the same TP and FSDP layout,
    so the local shards match element for element."""

    def __init__(self, weight, group):
        self.weight, self.group = weight, group

    def _local(self, t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    def sync_grads(self) -> None:
        dist.all_reduce(self._local(self.weight.grad), group=self.group)

    def max_abs_diff(self) -> float:
        mine = self._local(self.weight).detach().clone()
        other = mine.clone()
        dist.all_reduce(other, group=self.group)  # other = mine + peer's
        return float((other - 2 * mine).abs().max())


def tied_pair(sc: Scenario, mine, pp_rank: int, mesh) -> TiedEmbedding | None:
    """The tied-embedding pair this rank belongs to, when the model ties and pp > 1 (every rank makes
    every group, as ``dist.new_group`` requires)."""
    p = sc.plan
    if not sc.model.tied_embeddings or p.pp == 1:
        return None
    import itertools

    grid = mesh.mesh  # [pp, ..., tp] of global ranks (mesh_dims)
    mine_group = None
    for idx in itertools.product(*(range(n) for n in grid.shape[1:])):
        ranks = [int(grid[0][idx]), int(grid[-1][idx])]
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine_group = g
    if pp_rank == 0:
        return TiedEmbedding(mine[0].tok_embeddings.weight, mine_group)
    if pp_rank == p.pp - 1:
        return TiedEmbedding(mine[-1].output.weight, mine_group)
    return None


class Phases:
    def __init__(self, folder: str | None, rank: int):
        self.path = Path(folder) / f"rank{rank}" if folder else None
        self.rank = rank
        self.fault = os.environ.get("PLAN3D_VALIDATE_FAULT", "")
        self.current = "init"

    def __call__(self, phase: str) -> None:
        self.current = phase
        if self.path is not None:
            self.path.write_text(phase)
        if self.fault == f"{self.rank}:{phase}":
            sys.stderr.write(f"rank {self.rank}: injected fault in phase '{phase}'\n")
            sys.stderr.flush()
            os._exit(17)
        if self.fault == f"{self.rank}:{phase}:hang":
            time.sleep(3600)


def sabotage(rank: int) -> dict:
    """This rank's share of ``PLAN3D_VALIDATE_SABOTAGE`` (module docstring)."""
    out: dict = {}
    for item in filter(None, os.environ.get("PLAN3D_VALIDATE_SABOTAGE", "").split(",")):
        kind, *rest = item.split(":")
        if kind in ("gpipe", "local_attention"):
            out[kind] = True
        elif rest and int(rest[0]) == rank:
            out[kind] = float(rest[1]) if kind == "slow" else True
    return out


def mp_policy(precision: str):
    """FSDP2's mixed precision for the run's precision (``launch.run_precision``): none in fp32; in bf16
    torchtitan's defaults, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
    (torchtitan ``models/llama3/infra/parallelize.py::apply_fsdp``, commit 018740b, with
    ``training.mixed_precision_param = "bfloat16"``, ``mixed_precision_reduce = "float32"``). The sharded
    parameters stay fp32 (``FSDPParam.orig_dtype`` is the sharded parameter's dtype), so do their sharded
    gradients (``foreach_reduce`` casts the reduce output to ``orig_dtype``) and AdamW's states; each
    module's forward casts its floating-point inputs to bf16 (``cast_forward_inputs``) and computes in bf16
    with the all-gathered bf16 parameters, so the activations it saves are bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _storage_tensor(t):
    """The plain tensor that owns the memory: a DTensor's local shard, an AsyncCollectiveTensor's result."""
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.elem if type(t).__name__ == "AsyncCollectiveTensor" else t


class SavedBytes:
    """Bytes autograd keeps for backward inside the transformer blocks, per micro-batch, at their peak.

    Every pack is counted once per storage and charged to the micro-batch whose chunk forward is
    running. Weights are not activations: leaf tensors that require grad (and views of them; FSDP's
    unsharded parameters are such leaves) are skipped. A micro-batch's bytes are released when
    backward first unpacks one of its tensors, that is when the backward of its chunk starts. So the
    peak is the largest sum over the micro-batches in flight, which is what the memory model
    predicts: in-flight count x layers x bytes per layer.
    """

    def __init__(self):
        self.live: dict[tuple, dict[int, int]] = {}
        self.owner: dict[int, tuple] = {}
        self.current_key: tuple | None = None
        self.current = 0
        self.peak = 0
        self.per_microbatch: list[int] = []
        self.events: list[str] = []
        self.by_key: dict[tuple, int] = {}  # bytes of each (chunk, micro-batch), at its release
        self.routed: dict[tuple, list[int]] = {}  # tokens this rank's experts received, per MoE layer in order
        self.peak_keys: list[tuple] = []  # the micro-batches in flight at the peak

    @staticmethod
    def _is_weight(t) -> bool:
        base = t._base if getattr(t, "_base", None) is not None else t
        return isinstance(base, torch.nn.Parameter)

    def reset(self) -> None:
        """Forget everything so far (the first step also runs torch's shape-inference forward)."""
        self.live, self.owner, self.current, self.peak = {}, {}, 0, 0
        self.per_microbatch, self.events = [], []
        self.by_key, self.routed, self.peak_keys = {}, {}, []

    def begin(self, key: tuple) -> None:
        self.current_key = key
        self.live[key] = {}
        self.routed[key] = []
        self.events.append(f"F{key}")

    def note_routed(self, tokens: int) -> None:
        """A MoE layer of the running chunk forward received ``tokens`` tokens for its local experts
        (not counted during a recompute in backward, which runs outside any chunk forward)."""
        if self.current_key is not None and self.current_key in self.live:
            self.routed[self.current_key].append(tokens)

    def release(self, key: tuple) -> None:
        freed = self.live.pop(key, None)
        if freed is None:
            return
        self.events.append(f"B{key}")
        for storage in freed:
            self.owner.pop(storage, None)
        self.per_microbatch.append(sum(freed.values()))
        self.by_key[key] = sum(freed.values())
        self.current -= sum(freed.values())

    def pack(self, t):
        bucket = self.live.get(self.current_key)
        if bucket is None or self._is_weight(t):
            return t
        storage = _storage_tensor(t).untyped_storage()
        key = storage._cdata
        if key not in bucket:
            bucket[key] = storage.nbytes()
            self.owner[key] = self.current_key
            self.current += bucket[key]
            if self.current > self.peak:
                self.peak = self.current
                self.peak_keys = list(self.live)
        return t

    def unpack(self, t):
        owner = self.owner.get(_storage_tensor(t).untyped_storage()._cdata)
        if owner is not None:
            self.release(owner)
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def watch(self, chunk_index: int, chunk) -> None:
        """Charge packs to (chunk, micro-batch) during each forward of the chunk."""
        counter = iter(range(1 << 30))

        def pre(module, args):
            self.begin((chunk_index, next(counter)))

        def post(module, args, output):
            self.current_key = None

        chunk.register_forward_pre_hook(pre)
        chunk.register_forward_hook(post)


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        total += local.numel() * local.element_size()
    return total


def chunk_layer_counts(sc: Scenario) -> list[int]:
    """Layers of every chunk in pipeline order: virtual stage c is chunk c // pp of rank c mod pp, each rank's
    chunks as the plan splits its stage (``Plan.chunk_layers``: uneven stages, and the embedding's and the
    loss's chunks that may hold no layer)."""
    plan = sc.plan
    chunks = plan.chunk_layers(sc.model.num_layers)
    return [chunks[c % plan.pp][c // plan.pp] for c in range(plan.pp * plan.vpp)]


def batch(sc: Scenario, dp_rank: int, device):
    """A fixed synthetic batch for one data-parallel replica: tokens and next-token labels."""
    p = sc.resolved_plan()
    per_replica = p.micro_batch_size * p.num_microbatches
    g = torch.Generator().manual_seed(4321 + dp_rank)
    tokens = torch.randint(0, sc.model.vocab_size, (per_replica, sc.training.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def busbw_gbps(kind: str, size_bytes: float, n: int, seconds: float) -> float:
    """nccl-tests bus bandwidth (planner.comm.bus_factor)."""
    from planner.comm import bus_factor

    factor = 1.0 if kind == "p2p" else bus_factor(kind, n)
    return factor * size_bytes / seconds / 1e9 if seconds > 0 else 0.0


def microbenchmarks(sc: Scenario, mesh, device, grad_bytes: int) -> dict:
    """Achieved bus bandwidth on the plan's own TP, PP, CP and DP groups: every sample starts after a
    barrier on the group and ends after the device is synchronised, so it times the collective, not
    its launch (nccl-tests does the same; busbw as nccl-tests defines it)."""
    p = sc.plan
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    b, s, h = p.micro_batch_size, sc.training.seq_len, sc.model.hidden_size
    out = {}
    if p.tp > 1:
        buf = torch.ones(b * s * h, device=device)
        group = mesh["tp"].get_group()
        t = time_it(lambda: (dist.all_reduce(buf, group=group), sync()), repeats=5,
                    before=lambda: dist.barrier(group=group))
        out["tp_all_reduce"] = {"bytes": buf.numel() * 4, "ranks": p.tp, "seconds": t,
                                "busbw_gbps": busbw_gbps("all_reduce", buf.numel() * 4, p.tp, t)}
    if p.pp > 1:
        buf = torch.ones(b * s * h // (p.tp if p.sequence_parallel else 1), device=device)
        pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
        peer = dist.get_global_rank(pp_group, pp_rank ^ 1) if (pp_rank ^ 1) < p.pp else None

        def exchange():
            if peer is None:
                return
            if pp_rank % 2 == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        t = time_it(lambda: (exchange(), sync()), repeats=5, before=lambda: dist.barrier(group=pp_group)) / 2
        out["pp_send_recv"] = {"bytes": buf.numel() * 4, "ranks": 2, "seconds": t,
                               "busbw_gbps": busbw_gbps("p2p", buf.numel() * 4, 2, t)}
    if p.cp > 1:  # one step of the K/V ring of one micro-batch (planner.cost: 2·b·(s/cp)·g_r·d_h per step)
        from planner.validate.ring import ring_exchange

        kv_r = max(sc.model.kv_heads // p.tp, 1) * sc.model.kv_channels
        buf = torch.ones(2 * b * (s // p.cp) * kv_r, device=device)
        group = mesh["cp"].get_group()
        t = time_it(lambda: (ring_exchange(buf, group), sync()), repeats=5, before=lambda: dist.barrier(group=group))
        out["cp_ring_exchange"] = {"bytes": buf.numel() * 4, "ranks": p.cp, "seconds": t,
                                   "busbw_gbps": busbw_gbps("p2p", buf.numel() * 4, 2, t)}
    if p.dp * p.cp > 1:  # gradients are reduced over dp x cp (planner.cost does the same)
        buf = torch.ones(max(grad_bytes // 4, 1), device=device)
        group, n = _dp_group(mesh, p.zero_stage, p.cp), p.dp * p.cp
        t = time_it(lambda: (dist.all_reduce(buf, group=group), sync()), repeats=3,
                    before=lambda: dist.barrier(group=group))
        out["dp_all_reduce"] = {"bytes": buf.numel() * 4, "ranks": n, "seconds": t,
                                "busbw_gbps": busbw_gbps("all_reduce", buf.numel() * 4, n, t)}
    return out


def moe_mesh(sc: Scenario, device):
    """The expert grid of a MoE plan over the same ranks, in Megatron's order (etp-ep-edp-pp over the ranks of
    tp-cp-dp-pp; etp = 1 here): ``(pp, expert_dp, ep)`` with ep fastest, so an EP group is ep consecutive ranks
    of a stage, drawn from its tp x dp ranks (Megatron-Core ``parallel_state``, parallel folding). The expert-data-parallel dimension is split into
    replicate and shard as the dense one is (ZeRO-0 replicates, ZeRO-2/3 shard)."""
    from torch.distributed.device_mesh import DeviceMesh

    p = sc.plan
    edp = p.expert_dp
    replicate, shard = (edp, 1) if p.zero_stage == 0 else (1, edp)
    layout = torch.arange(p.world_size).view(p.pp, replicate, shard, p.ep)
    return DeviceMesh(device.type, layout, mesh_dim_names=("pp", "edp_replicate", "edp_shard", "ep"))


def mesh_dims(sc: Scenario) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Names and sizes of the worker mesh, slowest to fastest (:data:`MESH_DIMS`, Megatron's tp-cp-dp-pp).
    With cp and ZeRO-0, cp comes before the (size-1) dp_shard axis: the same rank layout, and dp_replicate and
    cp are then neighbours that :func:`dp_cp_mesh` can flatten."""
    p = sc.plan
    replicate, shard = (p.dp, 1) if p.zero_stage == 0 else (1, p.dp)
    sizes = {"pp": p.pp, "dp_replicate": replicate, "dp_shard": shard, "cp": p.cp, "tp": p.tp}
    dims = ("pp", "dp_replicate", "cp", "dp_shard", "tp") if p.cp > 1 and p.zero_stage == 0 else MESH_DIMS
    return dims, tuple(sizes[d] for d in dims)


def dp_cp_mesh(sc: Scenario, mesh):
    """The mesh FSDP2 shards or replicates over: the dp x cp ranks of one stage and TP rank, as Megatron
    (gradients reduced over the data-parallel group with context parallelism, ``parallel_state``
    ``get_data_parallel_group(with_context_parallel=True)``) and torchtitan (FSDP over the flattened
    ``dp_shard_cp`` mesh, ``parallel_dims.py``) do. ZeRO-0 replicates over all of them, ZeRO-2/3 shard over
    all of them. Flattened from the worker mesh, so that FSDP2 composes with the TP DTensors on it."""
    p = sc.plan
    if p.cp == 1:
        return mesh["dp_replicate", "dp_shard"]
    if p.zero_stage == 0:
        mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp")
        return mesh["dp_replicate_cp", "dp_shard"]
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard_cp"]


def _dp_group(mesh, zero_stage: int, cp: int = 1):
    """The data-parallel group: the replicate dimension without ZeRO, the shard dimension with it; with cp
    the dp x cp dimension that :func:`dp_cp_mesh` flattened."""
    return mesh[("dp_replicate" if zero_stage == 0 else "dp_shard") + ("_cp" if cp > 1 else "")].get_group()


def main(argv: list[str] | None = None) -> int:
    """Run this rank; a rank that runs out of memory (in any phase) records ``oom in <phase>`` and exits
    with ``OOM_EXIT_CODE`` so that the launcher fails the run with that reason."""
    try:
        return _main(argv)
    except torch.OutOfMemoryError as exc:
        phase = _PHASE.get("phase")
        where = phase.current if phase is not None else "?"
        if phase is not None:
            phase(f"oom in {where}")
        rank = os.environ.get("RANK", "0")
        sys.stderr.write(f"rank {rank}: out of memory in {where}: {str(exc).splitlines()[0]}\n")
        sys.stderr.flush()
        os._exit(OOM_EXIT_CODE)


_PHASE: dict = {}  # this rank's Phases, for main's out-of-memory report


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--phase-dir", default=None)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--reference", action="store_true", help="compare the first loss with a single-process run")
    ap.add_argument("--full-size", action="store_true",
                    help="the plan as written: build this rank's chunks on meta, shard, then materialise the shards")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                    help="what the run computes in (default: launch.run_precision of the plan's precision)")
    args = ap.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    phase = Phases(args.phase_dir, rank)
    _PHASE["phase"] = phase
    phase("init")
    use_cuda = args.backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    sc = load_scenario(args.plan)
    p = sc.resolved_plan()
    mp = mp_policy(args.precision or run_precision(sc.training.precision))
    refused = refusal(sc, args.backend)
    if refused:
        raise SystemExit(f"validate: {refused}")
    if dist.get_world_size() != p.world_size:
        raise SystemExit(f"validate: world size {dist.get_world_size()} != tp*pp*dp*cp = {p.world_size}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    dims, sizes = mesh_dims(sc)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=dims)
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()
    expert_mesh = moe_mesh(sc, device) if sc.model.is_moe else None

    phase("build")
    bad = sabotage(rank)
    counts = chunk_layer_counts(sc)
    if args.full_size:
        if sc.model.is_moe:
            raise SystemExit("validate: a full-size run of a mixture-of-experts plan is not supported yet; "
                             "run the miniature")
        if sc.model.tied_embeddings and p.pp > 1:
            raise SystemExit("validate: a full-size run with tied embeddings across pipeline stages is not supported "
                             "(the last stage's copy needs the first stage's values); run the miniature")
        mine = build_local_chunks(sc.model, counts, p.pp, pp_rank)  # meta: nothing allocated yet
    else:
        all_chunks = build_chunks(sc.model, counts)
        mine = [c for i, c in enumerate(all_chunks) if i % p.pp == pp_rank]
        if expert_mesh is not None:  # every rank built all experts from the same seed; keep the local ones
            for blk in (b for c in mine for b in c.layers if b.is_moe):
                blk.feed_forward.localize(expert_mesh["ep"].get_local_rank(), p.ep, expert_mesh["ep"].get_group())
    reference_chunks = build_chunks(sc.model, [sc.model.num_layers]) if args.reference and rank == 0 else None
    stages = []
    fsdp_mesh = dp_cp_mesh(sc, mesh)
    tokens, labels = batch(sc, dp_rank, device)
    if p.cp > 1:  # this cp rank's tokens, labels and their global positions (torch's head-tail sharding)
        from planner.validate.ring import shard_sequence

        seq = sc.training.seq_len
        tokens, labels, positions = shard_sequence(mesh["cp"], [tokens, labels, torch.arange(seq, device=device)],
                                                   [1, 1, 0], seq)
        for c in mine:
            c.positions = positions
            for blk in c.layers:
                blk.attention.cp_group = None if bad.get("local_attention") else mesh["cp"].get_group()
                blk.attention.positions = positions
    built = 0  # the rank's layers so far, in build order (torchtitan's per-layer AC counts across its chunks)
    for k, chunk in enumerate(mine):
        built = set_recompute(chunk, p.recompute, p.recompute_num_layers, p.recompute_interval, built)
        if p.tp > 1:
            tensor_parallelize(chunk, mesh["tp"], p.sequence_parallel)
        if bad.get("corrupt") and len(chunk.layers) and not any(len(c.layers) for c in mine[:k]):
            # the rank's first chunk that has a layer (an embedding chunk has none), before FSDP takes it over
            with torch.no_grad():
                w = chunk.layers[0].feed_forward.w2.weight
                (w._local_tensor if hasattr(w, "_local_tensor") else w).add_(0.5)
        if not args.full_size:
            chunk.to(device)
        dp_mesh = fsdp_mesh
        for blk in chunk.layers:
            if blk.is_moe:  # the experts first: over the expert-data-parallel ranks (torchtitan's EP layout)
                experts = blk.feed_forward.experts
                fully_shard(experts, mesh=expert_mesh["edp_replicate", "edp_shard"],
                            reshard_after_forward=p.zero_stage >= 3, mp_policy=mp)
                # each expert saw the tokens of ep data-parallel replicas: divide the sum by dp, not expert_dp
                # (torchtitan parallelize.py sets the same factor). A sharded group needs plain sums on gloo
                # (no PREMUL_SUM); with one rank per shard torch 2.13 would then divide twice (foreach_reduce
                # divides its single-rank copy and again after), so the sums are forced only when shard > 1.
                experts.set_gradient_divide_factor(float(p.dp * p.cp))
                if expert_mesh["edp_shard"].size() > 1:
                    experts.set_force_sum_reduction_for_comms(True)
            fully_shard(blk, mesh=dp_mesh, reshard_after_forward=p.zero_stage >= 3, mp_policy=mp)
        fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=p.zero_stage >= 3, mp_policy=mp)
        if args.full_size:
            materialize_local([chunk], device)
        stages.append(PipelineStage(chunk, pp_rank + k * p.pp, p.pp * p.vpp, device, group=mesh["pp"].get_group()))
    params = list(dict.fromkeys(q for c in mine for q in c.parameters()))
    grad_check = None
    tied = tied_pair(sc, mine, pp_rank, mesh)
    saved = SavedBytes()
    for k, c in enumerate(mine):
        saved.watch(k, c)
        for blk in c.layers:
            blk.saved_hooks = saved.context
            if blk.is_moe:
                blk.feed_forward.on_routed = saved.note_routed
    expert_params = {id(q) for c in mine for blk in c.layers if blk.is_moe
                     for q in blk.feed_forward.experts.parameters()}
    if bad.get("gpipe"):
        from torch.distributed.pipelining import ScheduleGPipe, ScheduleLoopedBFS

        schedule = ScheduleLoopedBFS(stages, n_microbatches=p.num_microbatches, loss_fn=loss_fn) if p.vpp > 1 \
            else ScheduleGPipe(stages[0], n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    elif p.vpp > 1:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(stages[0], n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    is_first, is_last = pp_rank == 0, pp_rank == p.pp - 1
    # torch's step() keeps the last stage's outputs and returns their concatenation unless told not to, where it
    # can be (planner.memory.pipeline_kept_output_bytes)
    keeps_no_outputs = "return_outputs" in inspect.signature(schedule.step).parameters

    phase("microbenchmarks")
    grad_size = local_bytes(params) * (p.dp * p.cp if p.zero_stage >= 3 else 1)
    bench = microbenchmarks(sc, mesh, device, grad_size)

    losses_per_step, step_s = [], []
    # dropout masks: the same on the TP peers of a replica (they hold the same activations), new per replica
    torch.manual_seed(100 + 1000 * dp_rank + pp_rank)
    blocks = [blk for c in mine for blk in c.layers]
    if use_cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        phase(f"step {step}")
        if step == args.warmup:
            saved.reset()
        for blk in blocks:  # the warm-up step (compared with the reference loss) runs without dropout
            blk.dropout = sc.model.dropout and step >= args.warmup
        optimizer.zero_grad(set_to_none=True)
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        losses: list = []
        kwargs = {}
        if is_last:
            kwargs = {"target": labels, "losses": losses}
        if keeps_no_outputs:  # as torchtitan 0.3.0 (trainer.py): the estimate's pipeline_kept_outputs "none"
            kwargs["return_outputs"] = False
        if is_first:
            schedule.step(tokens, **kwargs)
        else:
            schedule.step(**kwargs)
        if bad.get("oom") and step == 1:
            raise torch.OutOfMemoryError("injected: CUDA out of memory (PLAN3D_VALIDATE_SABOTAGE)")
        if tied is not None:
            tied.sync_grads()
        if step == 0 and args.reference and (sc.model.is_moe or p.cp > 1 or mp.param_dtype is not None):
            full = _full_grads(mine[0])  # collective over each parameter's mesh: every rank takes part
            if reference_chunks is not None:
                grad_check = _grad_check(reference_chunks[0], mine[0], full, sc, device, expert_params)
        if bad.get("slow"):
            time.sleep(bad["slow"])
        optimizer.step()
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            step_s.append(elapsed)
        if is_last and losses:
            loss = torch.stack([torch.as_tensor(x).detach().float() for x in losses]).mean()
            if p.cp > 1:  # each cp rank's loss is the mean over its s/cp tokens: the sequence's is their mean
                dist.all_reduce(loss, group=mesh["cp"].get_group())
                loss /= p.cp
            losses_per_step.append(float(loss))

    phase("report")
    result = {
        "rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": mesh["tp"].get_local_rank(),
        "cp_rank": mesh["cp"].get_local_rank(), "local_seq_len": int(tokens.shape[1]),
        "step_s": step_s, "losses": losses_per_step,
        "weights_bytes": local_bytes(params),
        "grads_bytes": local_bytes([q.grad for q in params]),
        "optimizer_bytes": sum(local_bytes(v for k, v in st.items() if k != "step") for st in optimizer.state.values()),
        **({"expert_weights_bytes": local_bytes(q for q in params if id(q) in expert_params),
            "expert_grads_bytes": local_bytes(q.grad for q in params if id(q) in expert_params),
            "expert_optimizer_bytes": sum(local_bytes(v for k, v in st.items() if k != "step")
                                          for q, st in optimizer.state.items() if id(q) in expert_params),
            "saved_by_microbatch": [{"key": list(k), "bytes": n, "routed": saved.routed.get(k, []),
                                     "dense_layers": sum(not b.is_moe for b in mine[k[0]].layers)}
                                    for k, n in sorted(saved.by_key.items())],
            "saved_peak_keys": [list(k) for k in saved.peak_keys],
            "grad_check": grad_check} if sc.model.is_moe else {}),
        **({"grad_check": grad_check} if p.cp > 1 or mp.param_dtype is not None else {}),
        "saved_activation_peak_bytes": saved.peak,
        "saved_bytes_per_microbatch": sorted(set(saved.per_microbatch)),
        "unreleased_microbatches": len(saved.live),
        "events": saved.events[-40:],
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if use_cuda else None,
        "max_memory_reserved_bytes": torch.cuda.max_memory_reserved() if use_cuda else None,
        "tied_max_abs_diff": tied.max_abs_diff() if tied is not None else None,
        "microbenchmarks": bench,
    }
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        report = {"ranks": gathered}
        if reference_chunks is not None:
            report["reference_loss"] = _reference_loss(reference_chunks[0], sc, device)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
    phase("done")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _full_grads(chunk) -> dict:
    """The whole gradient of every parameter of ``chunk`` (DTensor ``full_tensor``: FSDP and TP shards gathered)."""
    return {name: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad)
            for name, q in chunk.named_parameters() if q.grad is not None}


def _grad_check(model, chunk, full: dict, sc: Scenario, device, expert_params: set) -> dict:
    """Rank 0's first-step gradients of its first chunk against the single-process model (same weights)
    on every data-parallel replica's batch, the loss averaged over replicas and micro-batches.

    With cp it checks the ring attention's backward and the gradient reduction over dp x cp.
    For a MoE plan this checks dispatch and combine backward through the all-to-all, TP's sums over the
    router and gate, and the expert gradients' reduction over the expert-data-parallel ranks (divided by
    dp, not expert_dp). ``full`` holds the gathered gradients (:func:`_full_grads`). Returns the largest
    absolute difference over each group, relative to that group's largest gradient."""
    p = sc.resolved_plan()
    model.to(device)
    model.eval()  # no dropout: the distributed warm-up step runs without it
    model.zero_grad(set_to_none=True)
    n = p.dp * p.num_microbatches
    for replica in range(p.dp):
        tokens, labels = batch(sc, replica, device)
        for t, y in zip(tokens.split(p.micro_batch_size), labels.split(p.micro_batch_size)):
            (loss_fn(model(t), y) / n).backward()
    ref = dict(model.named_parameters())
    out = {}
    for group, pick in (("expert", True), ("dense", False)):
        diff = scale = 0.0
        count = 0
        for name, q in chunk.named_parameters():
            if (id(q) in expert_params) != pick or name not in full:
                continue
            mine, want = full[name], ref[name].grad
            diff = max(diff, float((mine - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
            count += 1
        out[group] = {"params": count, "max_abs_diff": diff, "max_abs_grad": scale,
                      "rel_diff": diff / scale if scale else 0.0}
    model.zero_grad(set_to_none=True)
    return out


def _reference_loss(model, sc: Scenario, device) -> float:
    """Loss of data-parallel replica 0's batch in one process, same weights, before any update, without
    dropout (the distributed warm-up step that it is compared with runs without dropout too)."""
    model.to(device)
    model.eval()
    tokens, labels = batch(sc, 0, device)
    p = sc.resolved_plan()
    with torch.no_grad():
        losses = [loss_fn(model(t), y) for t, y in zip(tokens.split(p.micro_batch_size), labels.split(p.micro_batch_size))]
    return float(torch.stack(losses).mean())


if __name__ == "__main__":
    from planner.validate import exit_after_run

    exit_after_run(main())
