"""The rank program of `plan3d validate`, started by torchrun on every rank.

It builds a DeviceMesh in the plan's rank layout, the model with DTensor tensor parallelism,
``torch.distributed.pipelining`` stages and schedule (1F1B, or interleaved 1F1B when vpp > 1),
FSDP2 over the data-parallel ranks, activation checkpointing for recompute and AdamW. Then it
measures collectives on the plan's own groups, runs warm-up and measured steps on a fixed
synthetic batch, and gathers every rank's measurements to rank 0, which writes them as JSON.

Each rank writes its current phase to ``--phase-dir``/rank<N>, so that the launcher can say which
rank stalled where. ``PLAN3D_VALIDATE_FAULT=rank:phase`` makes that rank exit in that phase
(used by the failure tests); ``rank:phase:hang`` makes it stall there instead.
"""

from __future__ import annotations

import argparse
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
from planner.validate.model import build_chunks, set_recompute, tensor_parallelize

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # slowest to fastest: Megatron order tp-cp-dp-pp


class Phases:
    def __init__(self, folder: str | None, rank: int):
        self.path = Path(folder) / f"rank{rank}" if folder else None
        self.rank = rank
        self.fault = os.environ.get("PLAN3D_VALIDATE_FAULT", "")

    def __call__(self, phase: str) -> None:
        if self.path is not None:
            self.path.write_text(phase)
        if self.fault == f"{self.rank}:{phase}":
            sys.stderr.write(f"rank {self.rank}: injected fault in phase '{phase}'\n")
            sys.stderr.flush()
            os._exit(17)
        if self.fault == f"{self.rank}:{phase}:hang":
            time.sleep(3600)


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

    @staticmethod
    def _is_weight(t) -> bool:
        base = t._base if getattr(t, "_base", None) is not None else t
        return isinstance(base, torch.nn.Parameter)

    def reset(self) -> None:
        """Forget everything so far (the first step also runs torch's shape-inference forward)."""
        self.live, self.owner, self.current, self.peak = {}, {}, 0, 0
        self.per_microbatch, self.events = [], []

    def begin(self, key: tuple) -> None:
        self.current_key = key
        self.live[key] = {}
        self.events.append(f"F{key}")

    def release(self, key: tuple) -> None:
        freed = self.live.pop(key, None)
        if freed is None:
            return
        self.events.append(f"B{key}")
        for storage in freed:
            self.owner.pop(storage, None)
        self.per_microbatch.append(sum(freed.values()))
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
            self.peak = max(self.peak, self.current)
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
    """Layers of every chunk in pipeline order (chunk c lives on rank c mod pp)."""
    plan, v = sc.plan, sc.plan.vpp
    return [n // v for n in sc.stage_layers for _ in range(v)] if v == 1 else \
        [sc.stage_layers[c % plan.pp] // v for c in range(plan.pp * v)]


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
    """Achieved bus bandwidth on the plan's own TP, PP and DP groups."""
    p = sc.plan
    b, s, h = p.micro_batch_size, sc.training.seq_len, sc.model.hidden_size
    out = {}
    if p.tp > 1:
        buf = torch.ones(b * s * h, device=device)
        group = mesh["tp"].get_group()
        t = time_it(lambda: dist.all_reduce(buf, group=group), repeats=5)
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

        t = time_it(exchange, repeats=5) / 2
        out["pp_send_recv"] = {"bytes": buf.numel() * 4, "ranks": 2, "seconds": t,
                               "busbw_gbps": busbw_gbps("p2p", buf.numel() * 4, 2, t)}
    if p.dp > 1:
        buf = torch.ones(max(grad_bytes // 4, 1), device=device)
        group = _dp_group(mesh, p.zero_stage)
        t = time_it(lambda: dist.all_reduce(buf, group=group), repeats=3)
        out["dp_all_reduce"] = {"bytes": buf.numel() * 4, "ranks": p.dp, "seconds": t,
                                "busbw_gbps": busbw_gbps("all_reduce", buf.numel() * 4, p.dp, t)}
    return out


def _dp_group(mesh, zero_stage: int):
    """The data-parallel group: the replicate dimension without ZeRO, the shard dimension with it."""
    return mesh["dp_replicate" if zero_stage == 0 else "dp_shard"].get_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--phase-dir", default=None)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--reference", action="store_true", help="compare the first loss with a single-process run")
    args = ap.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    phase = Phases(args.phase_dir, rank)
    phase("init")
    use_cuda = args.backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    sc = load_scenario(args.plan)
    p = sc.resolved_plan()
    if p.cp > 1:
        raise SystemExit("validate: context parallelism is not run by validate yet; use cp=1")
    if dist.get_world_size() != p.world_size:
        raise SystemExit(f"validate: world size {dist.get_world_size()} != tp*pp*dp*cp = {p.world_size}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    replicate, shard = (p.dp, 1) if p.zero_stage == 0 else (1, p.dp)
    mesh = init_device_mesh(device.type, (p.pp, replicate, shard, p.tp), mesh_dim_names=MESH_DIMS)
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp_replicate"].get_local_rank() * shard + mesh["dp_shard"].get_local_rank()

    phase("build")
    counts = chunk_layer_counts(sc)
    all_chunks = build_chunks(sc.model, counts)
    mine = [c for i, c in enumerate(all_chunks) if i % p.pp == pp_rank]
    reference_chunks = build_chunks(sc.model, [sc.model.num_layers]) if args.reference and rank == 0 else None
    stages = []
    for k, chunk in enumerate(mine):
        set_recompute(chunk, p.recompute)
        if p.tp > 1:
            tensor_parallelize(chunk, mesh["tp"], p.sequence_parallel)
        chunk.to(device)
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        for blk in chunk.layers:
            fully_shard(blk, mesh=dp_mesh, reshard_after_forward=p.zero_stage >= 3)
        fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=p.zero_stage >= 3)
        stages.append(PipelineStage(chunk, pp_rank + k * p.pp, p.pp * p.vpp, device, group=mesh["pp"].get_group()))
    params = [q for c in mine for q in c.parameters()]
    saved = SavedBytes()
    for k, c in enumerate(mine):
        saved.watch(k, c)
        for blk in c.layers:
            blk.saved_hooks = saved.context
    if p.vpp > 1:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(stages[0], n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    tokens, labels = batch(sc, dp_rank, device)
    is_first, is_last = pp_rank == 0, pp_rank == p.pp - 1

    phase("microbenchmarks")
    grad_size = local_bytes(params) * (p.dp if p.zero_stage >= 3 else 1)
    bench = microbenchmarks(sc, mesh, device, grad_size)

    losses_per_step, step_s = [], []
    for step in range(args.warmup + args.steps):
        phase(f"step {step}")
        if step == args.warmup:
            saved.reset()
        optimizer.zero_grad(set_to_none=True)
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        losses: list = []
        kwargs = {}
        if is_last:
            kwargs = {"target": labels, "losses": losses}
        if is_first:
            schedule.step(tokens, **kwargs)
        else:
            schedule.step(**kwargs)
        optimizer.step()
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            step_s.append(elapsed)
        if is_last and losses:
            losses_per_step.append(float(torch.stack([torch.as_tensor(x).detach().float() for x in losses]).mean()))

    phase("report")
    result = {
        "rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": mesh["tp"].get_local_rank(),
        "step_s": step_s, "losses": losses_per_step,
        "weights_bytes": local_bytes(params),
        "grads_bytes": local_bytes([q.grad for q in params]),
        "optimizer_bytes": sum(local_bytes(v for k, v in st.items() if k != "step") for st in optimizer.state.values()),
        "saved_activation_peak_bytes": saved.peak,
        "saved_bytes_per_microbatch": sorted(set(saved.per_microbatch)),
        "unreleased_microbatches": len(saved.live),
        "events": saved.events[-40:],
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if use_cuda else None,
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


def _reference_loss(model, sc: Scenario, device) -> float:
    """Loss of data-parallel replica 0's batch in one process, same weights, before any update."""
    model.to(device)
    tokens, labels = batch(sc, 0, device)
    p = sc.resolved_plan()
    with torch.no_grad():
        losses = [loss_fn(model(t), y) for t, y in zip(tokens.split(p.micro_batch_size), labels.split(p.micro_batch_size))]
    return float(torch.stack(losses).mean())


if __name__ == "__main__":
    sys.exit(main())
