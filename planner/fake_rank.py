"""Fake-rank harness: one CPU process plays one rank of a large job and runs the real torch
code of a full-size training step (FSDP2 ``fully_shard``, DTensor tensor parallelism, AdamW)
without allocating anything, and reports the peak memory torch's own tracker sees.

The reference for the torchtitan profile of ``planner.memory`` (``tests/test_fake_rank.py``).
What it is made of, all torch's:

* ``torch._subclasses.fake_tensor.FakeTensorMode``: tensors with shapes and dtypes, no storage;
* the fake process group (``torch.testing._internal.distributed.fake_pg.FakeStore``, backend
  ``"fake"``): collectives return at once, so one process is rank ``rank`` of ``world``;
* ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``: counts every live tensor
  storage by category (sharded / unsharded parameters and gradients, optimizer state,
  activations, temporaries) and keeps the peak.

The trace of allocations is replayed through a model of the CUDA caching allocator
(:class:`CachingAllocator`) to predict the peak **reserved** memory, what ``nvidia-smi`` and
torchtitan's logs show, next to the peak allocated the tracker gives.

Two things differ from a plain CPU run and are set here to match a GPU:

* RMSNorm saves its input and the fp32 rstd, as torch's fused CUDA kernel does (the composite
  CPU ``F.rms_norm`` keeps fp32 copies as well);
* attention is ``plan3d::flash_attention``, an op that saves what FlashAttention-2 saves
  for backward (q, k, v, the output and the fp32 log-sum-exp per query and head; Dao 2023,
  arXiv:2307.08691, Algorithm 1 line 15) and no ``s x s`` scores; K and V stay at their
  ``num_kv_heads`` (GQA without repetition, as flash-attn's kernel takes them);
* every storage is rounded up to the CUDA caching allocator's 512-byte block
  (``c10/cuda/CUDACachingAllocator.cpp``: ``kMinBlockSize = 512``, ``round_size``); the tracker
  rounds only for CUDA devices, the fake tensors here are CPU tensors.

AdamW runs its for-loop implementation: its states are the same as the foreach one's, but
foreach over FSDP2's DTensor shards under fake tensors reports about 13x the optimizer states
at the step (35 GiB for 8 layers of Llama-3-8B at FSDP 8), which the real run of torchtitan's
benchmark (FSDP 8, 82.4 GiB reserved on 95 GiB) shows a GPU does not allocate.

The model is the Llama family of ``ModelSpec`` (RMSNorm, SwiGLU, GQA, RoPE not materialised:
a fused RoPE saves nothing; no biases) built as torchtitan builds it: one ``fully_shard`` per
block, then the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, loss
``cross_entropy(logits.float())``. Torch is imported inside the functions only: importing this
module does not import torch.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from dataclasses import dataclass, replace

from planner.specs import HOPPER_BLAS_WORKSPACE_MIB

ALLOCATOR_BLOCK_BYTES = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize


@dataclass(frozen=True)
class FakeRankResult:
    """Peak memory of one rank, bytes by the tracker's categories, and the peak total."""

    peak_bytes: float
    by_category_bytes: dict
    wall_s: float
    reserved_bytes: float = 0.0  # the caching allocator's peak reserved for this trace (CachingAllocator)

    def category(self, *names: str) -> float:
        return sum(self.by_category_bytes.get(n, 0) for n in names)


MIB = 1024 * 1024
SMALL_SIZE = 1 * MIB  # kSmallSize: requests up to this size use the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: segment size of the small pool
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: large requests below this get a kLargeBuffer segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer
ROUND_LARGE = 2 * MIB  # kRoundLarge: larger segments are rounded up to this


class _Block:
    __slots__ = ("addr", "size", "small", "stream", "prev", "next", "free")

    def __init__(self, addr, size, small, stream=0):
        self.addr, self.size, self.small, self.stream = addr, size, small, stream
        self.prev, self.next, self.free = None, None, True


#: Where the replay starts handing out segment addresses: cudaMalloc gives each new large segment a lower address
#: than the one before (seen in every trace of benchmarks/data/h100_allocator_check*.json, H100, driver 580, torch
#: 2.11), so a newer segment comes first among equal-sized free blocks (``BlockComparatorSize``: size, then address).
_TOP_ADDRESS = 1 << 60


class CachingAllocator:
    """The CUDA caching allocator's block policy (``c10/cuda/CUDACachingAllocator.cpp``, default
    ``PYTORCH_CUDA_ALLOC_CONF``), replayed on an allocation trace to predict **reserved** memory.

    * requests round up to 512 B (``round_size``); up to 1 MiB they use the small pool, else the large;
    * each CUDA stream has pools of its own: a block cut from a segment made for one stream serves only that stream
      (``BlockComparatorSize`` orders the free blocks by stream first, and ``get_free_block`` takes only its own
      stream's); FSDP2 makes its reduce-scatter outputs on its reduce-scatter stream and, with more than one rank,
      its all-gather inputs and outputs on its all-gather copy-in stream (``_fsdp_collectives.py``), so those
      gigabytes never reuse the default stream's cache, nor it theirs;
    * a request takes the smallest cached free block of its stream's pool that fits (``get_free_block``:
      best fit in (size, address) order; segments come at falling addresses, ``_TOP_ADDRESS``); none fits: a new
      segment (``cudaMalloc``) of 2 MiB (small pool), 20 MiB (large request under 10 MiB) or the request rounded up
      to 2 MiB (``get_allocation_size``), and reserved grows by it;
    * the remainder of a block is split off when it is at least 512 B (small pool) or more than
      1 MiB (large pool) (``should_split``); a freed block merges with free neighbours of its
      segment (``try_merge_blocks``); nothing is returned to the device unless a new segment would
      exceed the capacity, when every wholly free segment is released first (``release_cached_blocks``).

    Checked against the real allocator (``tests/test_gpu_allocator.py``): replayed on the allocation traces torch
    recorded on an H100 (``torch.cuda.memory._record_memory_history``: ten runs of two FSDP2 training steps on one
    rank), it gives each run's ``max_memory_reserved`` to the byte. No ``expandable_segments``.
    """

    def __init__(self, capacity_bytes: float | None = None):
        self.capacity = capacity_bytes
        self.free_blocks: dict = {}  # (stream, small pool?) -> sorted [(size, addr, block)]
        self.live: dict = {}
        self.reserved = self.peak_reserved = self.allocated = self.peak_allocated = 0
        self._next_addr = _TOP_ADDRESS
        self.oom = False  # a segment did not fit under ``capacity`` even after the release

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def _pool(self, stream, small: bool) -> list:
        """The free blocks of ``stream``'s small or large pool, sorted [(size, addr, block)]."""
        return self.free_blocks.setdefault((stream, small), [])

    def _insert(self, b):
        # (size, address) is unique: blocks partition the address space, which is never reused
        bisect.insort(self._pool(b.stream, b.small), (b.size, b.addr, b))

    def _remove(self, b):
        pool = self._pool(b.stream, b.small)
        pool.pop(bisect.bisect_left(pool, (b.size, b.addr)))

    @staticmethod
    def _join(left, right):
        """Coalesce two neighbouring blocks into ``left`` and return it (the caller keeps the free lists)."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        return left

    def malloc(self, key, nbytes: int, stream=0) -> None:
        """Allocate ``nbytes`` for ``key`` on ``stream`` (any hashable; 0: the default stream)."""
        size = max(ALLOCATOR_BLOCK_BYTES, -(-nbytes // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES)
        small = size <= SMALL_SIZE
        pool = self._pool(stream, small)
        i = bisect.bisect_left(pool, (size,))
        if i < len(pool):
            b = pool.pop(i)[2]
        else:
            seg = self.allocation_size(size)
            if self.capacity and self.reserved + seg > self.capacity:
                self._release_cached()
                # still over: cudaMalloc fails and torch raises OutOfMemoryError (alloc_block after
                # release_cached_blocks); the replay records it and goes on
                self.oom = self.oom or self.reserved + seg > self.capacity
            self._next_addr -= seg
            b = _Block(self._next_addr, seg, small, stream)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if rest >= ALLOCATOR_BLOCK_BYTES if small else rest > SMALL_SIZE:
            r = _Block(b.addr + size, rest, small, stream)
            r.prev, r.next = b, b.next
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, size
            self._insert(r)
        b.free = False
        self.live[key] = b
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key) -> None:
        b = self.live.pop(key, None)
        if b is None:
            return
        self.allocated -= b.size
        b.free = True
        if b.prev is not None and b.prev.free:
            self._remove(b.prev)
            b = self._join(b.prev, b)
        if b.next is not None and b.next.free:
            self._remove(b.next)
            b = self._join(b, b.next)
        self._insert(b)

    def _release_cached(self) -> None:
        for key, pool in self.free_blocks.items():
            keep = []
            for item in pool:
                if item[2].prev is None and item[2].next is None:  # a whole segment, unused
                    self.reserved -= item[2].size
                else:
                    keep.append(item)
            self.free_blocks[key] = keep


#: cuBLAS's default workspace on Hopper and Blackwell, bytes (``planner.specs.HOPPER_BLAS_WORKSPACE_MIB``, its
#: source); one per thread and stream that runs a GEMM (``HardwareSpec.blas_workspace_mib``).
HOPPER_BLAS_WORKSPACE_BYTES = int(HOPPER_BLAS_WORKSPACE_MIB * 2**20)


@contextlib.contextmanager
def _allocation_trace(events: list, blas_workspace_bytes: int = 0):
    """Record the tracker's storage events (created, freed, resized) in order, with the stream each was made on,
    for the replay; with ``blas_workspace_bytes``, cuBLAS's workspace of the forward's thread after its first GEMM
    and of the backward's after its first (``allocator_trace.stage_events`` says why), as a GPU makes them."""
    import torch
    from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker

    original = mem_tracker.MemTracker._update_snap

    default = torch.cpu.current_stream()
    streams: dict = {}

    pending: list = []  # a workspace whose GEMM's output the tracker has not recorded yet (DTensor's ops)

    def record(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        name = getattr(u_type, "name", str(u_type))
        if name in ("ADD", "DEL", "SIZE"):
            # FSDP2 on the CPU enters its streams as on a GPU (torch.cpu.stream: torch.cpu.current_stream follows)
            current = torch.cpu.current_stream()
            stream = 0 if current is default else streams.setdefault(id(current), len(streams) + 1)
            events.append((name, id(winfo), winfo.mem_consumed, stream))
            if name == "ADD" and pending:
                events.append(pending.pop())
        return original(self, u_type, winfo, old_mem_consumed, old_reftype)

    aten = torch.ops.aten
    gemms = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default}
    dispatch = fsdp2_mem_tracker.FSDPMemTracker.__torch_dispatch__
    threads: set = set()

    def dispatch_with_workspace(self, func, types, args=(), kwargs=None):
        before = len(events)
        out = dispatch(self, func, types, args, kwargs)
        if blas_workspace_bytes and func in gemms:
            # autograd's backward (and the recompute inside it) runs on its device thread on a GPU
            thread = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            if thread not in threads:
                threads.add(thread)
                workspace = ("ADD", ("blas", thread), blas_workspace_bytes, 0)
                # on a GPU the GEMM's output is allocated before cuBLAS takes its workspace (at::mm's structured
                # output, then getCurrentCUDABlasHandle); a DTensor GEMM's local output reaches the tracker after
                # this call returns, so its workspace waits for that
                if any(e[0] == "ADD" for e in events[before:]):
                    events.append(workspace)
                else:
                    pending.append(workspace)
        return out

    mem_tracker.MemTracker._update_snap = record
    fsdp2_mem_tracker.FSDPMemTracker.__torch_dispatch__ = dispatch_with_workspace
    try:
        yield
    finally:
        mem_tracker.MemTracker._update_snap = original
        fsdp2_mem_tracker.FSDPMemTracker.__torch_dispatch__ = dispatch


def replay_reserved(events: list, capacity_bytes: float | None = None) -> CachingAllocator:
    """The caching allocator after the trace (``peak_reserved``, ``peak_allocated``). Events: ``(kind, key, bytes)``
    or ``(kind, key, bytes, stream)``; kind "ADD" (made), "DEL" (freed) or "SIZE" (resized: freed, and made again
    on the stream current at the resize, as ``resize_`` allocates)."""
    alloc = CachingAllocator(capacity_bytes)
    free, malloc = alloc.free, alloc.malloc
    for event in events:
        kind, key, nbytes = event[:3]
        if kind != "ADD":
            free(key)
        if kind != "DEL" and nbytes:
            malloc(key, nbytes, event[3] if len(event) > 3 else 0)
    return alloc


@contextlib.contextmanager
def _allocator_rounding():
    """Round every tracked storage up to the caching allocator's 512-byte block (module docstring)."""
    from torch.distributed._tools import mem_tracker

    original = mem_tracker._WeakRefInfo._calculate_mem_consumed

    def rounded(self) -> int:
        return math.ceil(self.size * self.element_size / ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES

    mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    try:
        yield
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = original


@contextlib.contextmanager
def _real_device_meshes():
    """Build every DeviceMesh with real tensors: FSDP2 + TP concatenates the DP and TP meshes
    (``FSDPParam._init_sharding_spec_tp``) while fake mode is on, and a mesh holds rank ids."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def _dtensor_propagation_apart():
    """Run DTensor's sharding propagation in a fake mode of its own, as it runs on a real rank.

    DTensor computes each op's output metadata by running the op on fake tensors of the *global* shape
    (torch 2.13 ``distributed/tensor/_sharding_prop.py``, ``_propagate_tensor_meta_non_cached``: ``fake_mode =
    detect_fake_mode() or FakeTensorMode()``). On a real rank there is no fake mode, so it makes a new one, and
    ``MemTracker`` skips what runs there (``mem_tracker.py`` ``__torch_dispatch__``: only ops under the fake mode
    active at the tracker's entry are counted). Under this harness's FakeTensorMode the propagation found and reused
    that mode, so the tracker counted its global-shape outputs as allocations of the rank: under ``loss_parallel``
    (DTensors throughout) 22, 38 and 70 B per local logit at tp 2, 4 and 8 where real ranks allocate 16 at any tp
    (tests/test_loss_parallel_gloo.py). Here the propagation gets a fresh fake mode, as on a real rank."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *a, **k: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """The fake process group: this process is ``rank`` of ``world`` (collectives are no-ops)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


_FLASH_OP = []


def _flash_attention_op(torch):
    """``plan3d::flash_attention``: causal attention as one op that returns (out, fp32 log-sum-exp)
    and saves q, k, v, out and the log-sum-exp, as FlashAttention-2 does (module docstring). An op,
    not an autograd.Function, so that an op-level AC policy can keep its outputs as torchtitan's
    keeps ``aten._scaled_dot_product_flash_attention``'s."""
    if _FLASH_OP:
        return _FLASH_OP[0]
    @torch.library.custom_op("plan3d::flash_attention", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
    def flash_attention(q, k, v):
        b, s, heads, _ = q.shape
        return torch.empty_like(q), torch.empty((b, heads, s), dtype=torch.float32, device=q.device)

    @flash_attention.register_fake
    def _(q, k, v):
        b, s, heads, _ = q.shape
        return torch.empty_like(q), torch.empty((b, heads, s), dtype=torch.float32, device=q.device)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    flash_attention.register_autograd(backward, setup_context=setup_context)
    _FLASH_OP.append(flash_attention)
    return flash_attention


def _op_sac_context_fn(torch):
    """torchtitan's selective op-level AC policy (``distributed/activation_checkpoint.py``:
    ``_save_list`` and ``_get_custom_policy``): keep the outputs of mm (every second one
    recomputed), attention, reduce-scatter and max; recompute everything else."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save_list = {torch.ops.aten.mm.default, torch.ops.plan3d.flash_attention.default,
                 torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops.aten.max.default}

    def context_fn():
        meta = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
            if func == torch.ops.aten.mm.default:
                meta[key] += 1
            keep = func in save_list and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _modules(torch):
    """The model classes, built here so that importing planner.fake_rank does not import torch."""
    nn, F = torch.nn, torch.nn.functional

    flash_attention = _flash_attention_op(torch)

    class RMSNormFn(torch.autograd.Function):
        """Saves the input and the fp32 rstd, as the fused CUDA kernel (``torch._fused_rms_norm``) does."""

        @staticmethod
        def forward(ctx, x, weight):
            rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
            ctx.save_for_backward(x, rstd, weight)
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, grad):
            x, rstd, weight = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(weight)

    class RMSNorm(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            return RMSNormFn.apply(x, self.weight)

    class Attention(nn.Module):
        def __init__(self, h, heads, kv_heads, d):
            super().__init__()
            self.heads, self.kv_heads, self.d = heads, kv_heads, d
            self.wq = nn.Linear(h, heads * d, bias=False)
            self.wk = nn.Linear(h, kv_heads * d, bias=False)
            self.wv = nn.Linear(h, kv_heads * d, bias=False)
            self.wo = nn.Linear(heads * d, h, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.wq(x).view(b, s, -1, self.d)  # -1: the heads of this TP rank
            k = self.wk(x).view(b, s, -1, self.d)
            v = self.wv(x).view(b, s, -1, self.d)
            out, _ = flash_attention(q, k, v)
            return self.wo(out.reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self, h, f):
            super().__init__()
            self.w1 = nn.Linear(h, f, bias=False)
            self.w2 = nn.Linear(f, h, bias=False)
            self.w3 = nn.Linear(h, f, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, spec):
            super().__init__()
            h = spec.hidden_size
            self.attention_norm = RMSNorm(h)
            self.attention = Attention(h, spec.num_attention_heads, spec.kv_heads, spec.kv_channels)
            self.ffn_norm = RMSNorm(h)
            self.feed_forward = FeedForward(h, spec.ffn_size)

        def forward(self, x):
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class Transformer(nn.Module):
        def __init__(self, spec, layers, embedding=True, output=True):
            super().__init__()
            self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size) if embedding else None
            self.layers = nn.ModuleList(Block(spec) for _ in range(layers))
            self.norm = RMSNorm(spec.hidden_size) if output else None
            self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if output else None

        def forward(self, tokens):
            x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x)) if self.output is not None else x

    return Transformer


def _apply_tp(torch, model, tp_mesh, loss_parallel: bool):
    """torchtitan's ``apply_tp`` (models/llama3/infra/parallelize.py): colwise Q/K/V/W1/W3, rowwise
    O/W2, sequence-parallel norms, vocab-parallel embedding and output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if model.tok_embeddings is not None:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))})
    if model.output is not None:
        parallelize_module(model, tp_mesh, {
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel),
        })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def measure_step(spec, layers: int, seq_len: int, micro_batch_size: int, dp: int, tp: int = 1,
                 reshard_after_forward: bool = True, recompute: str = "none", microbatches: int = 1,
                 pipeline_nosync: bool = False, last_stage: bool = False, first_stage_in_flight: int = 0,
                 steps: int = 2, recompute_interval: int | None = None,
                 capacity_gib: float | None = None, zero_grad_set_to_none: bool = True,
                 blas_workspace_bytes: int = HOPPER_BLAS_WORKSPACE_BYTES) -> FakeRankResult:
    """Peak memory of rank 0 of a ``dp`` x ``tp`` job training ``spec`` with ``layers`` layers.

    FSDP2 over ``dp`` (torchtitan's ``apply_fsdp``: each block, then the root; bf16 params, fp32
    reduce), TP over ``tp`` with sequence parallelism and loss parallelism (torchtitan's
    ``apply_tp``), AdamW (foreach). ``recompute="full"`` wraps each block in
    ``checkpoint_wrapper`` (torchtitan's full AC), ``"selective"`` adds torchtitan's op-level policy; with
    ``recompute_interval`` N (full) only every N-th block is wrapped, as torchtitan's per-layer AC
    (``_apply_layer_sac``: count % N == 0). ``microbatches`` forward+backward passes per
    step; with ``pipeline_nosync`` they run as a pipeline stage runs them under FSDP2
    (``PipelineStage.backward_maybe_with_nosync``: no gradient sync, no reshard after backward,
    then ``perform_reduce_grad``). ``last_stage``: the last stage of a pipeline (no embedding; its
    input is the previous stage's bf16 hidden states). ``first_stage_in_flight`` = k > 0: the first
    stage of a pipeline (no output layer) run in 1F1B order with k micro-batches in flight (k = p for
    stage 0): k forwards, then one backward (with the gradient the next stage would send, received into
    that micro-batch's own kept buffer as ``PipelineStage`` receives it) per forward, as ``Schedule1F1B`` orders them. ``steps`` optimizer steps (2: the second has
    Adam's states). The trace of every allocation is replayed through :class:`CachingAllocator`
    (device of ``capacity_gib``) for the peak reserved memory. ``zero_grad_set_to_none`` False zeroes the gradients
    in place between steps, as torchtitan does under its whole-step CUDA graph
    (``optimizers.zero_grad(set_to_none=disable_cuda_graphs)``; the graph itself needs a GPU and is not run).
    The replay writes each allocation on the stream FSDP2 made it on and cuBLAS's workspaces
    (``blas_workspace_bytes``, Hopper's by default; 0: none), which makes it give an H100's
    ``max_memory_reserved`` to within 0.1 % (tests/test_gpu_allocator.py).
    """
    import time

    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    t0 = time.perf_counter()
    Transformer = _modules(torch)
    world = dp * tp
    events: list = []
    with fake_world(world), _allocator_rounding(), _real_device_meshes(), _dtensor_propagation_apart(), \
            _allocation_trace(events, blas_workspace_bytes):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))  # outside fake mode: real rank ids
        mesh = {"dp": mesh["dp"], "tp": mesh["tp"]}
        fake = FakeTensorMode(allow_non_fake_inputs=True)  # DeviceMesh keeps real int tensors of rank ids
        fake.__enter__()
        try:
            result = _run(torch, F, mesh, Transformer, spec, layers, seq_len, micro_batch_size, tp,
                        reshard_after_forward, recompute, microbatches, pipeline_nosync or first_stage_in_flight > 0,
                        last_stage, first_stage_in_flight, steps, t0, recompute_interval, zero_grad_set_to_none)
        finally:
            fake.__exit__(None, None, None)
    reserved = replay_reserved(events, capacity_gib * 2**30 if capacity_gib else None).peak_reserved
    return replace(result, reserved_bytes=float(reserved))


def _run(torch, F, mesh, Transformer, spec, layers, seq_len, micro_batch_size, tp, reshard_after_forward,
         recompute, microbatches, pipeline_nosync, last_stage, first_stage_in_flight, steps, t0,
         recompute_interval=None, zero_grad_set_to_none=True, after_shard=None):
    """The training step of :func:`measure_step`, on whatever device the caller makes the default
    (benchmarks/gpu_allocator_check.py runs it on a GPU). ``after_shard(model)``, when given, runs after
    ``fully_shard`` and before the optimizer is made: torchtitan's ``to_empty`` of a model built on meta."""
    import time

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Transformer(spec, layers, embedding=not last_stage, output=not first_stage_in_flight)
    if tp > 1:
        _apply_tp(torch, model, mesh["tp"], loss_parallel=True)
    if recompute in ("full", "selective"):  # torchtitan's full AC, or its selective op-level AC
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        extra = {"context_fn": _op_sac_context_fn(torch)} if recompute == "selective" else {}
        for i, block in enumerate(model.layers):
            if recompute_interval is None or (i + 1) % recompute_interval == 0:
                model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False, **extra)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if after_shard is not None:
        after_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # see the module docstring
    tracker = FSDPMemTracker(model, opt)
    tokens = torch.randint(0, spec.vocab_size, (micro_batch_size, seq_len))
    inputs = tokens
    if last_stage:  # what the previous stage sends: bf16 hidden states (sequence-sharded with TP)
        inputs = torch.empty(micro_batch_size, seq_len // tp, spec.hidden_size, dtype=torch.bfloat16,
                             requires_grad=True)
    tracker.track_inputs((inputs,))
    loss_ctx = contextlib.nullcontext
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel as loss_ctx
    with tracker:
        # the first stage's receive buffers for its output's gradient, one per micro-batch, made once and kept
        # (torch distributed/pipelining/stage.py ``_setup_backward_recv_info``; planner.memory.pipeline_buffer_bytes)
        grad_recv = [None] * (microbatches if first_stage_in_flight else 0)
        for _ in range(steps):
            if pipeline_nosync:
                model.set_is_last_backward(False)
                model.set_reshard_after_backward(False)
                model.set_requires_gradient_sync(False)
            in_flight = []

            def backward_one(out, i):
                if grad_recv[i] is None:
                    grad_recv[i] = torch.empty_like(out)
                out.backward(grad_recv[i])

            for i in range(microbatches if first_stage_in_flight else 0):  # 1F1B on the first stage
                tracker.reset_mod_stats()
                in_flight.append((i, model(inputs)))
                if len(in_flight) == first_stage_in_flight:
                    j, out = in_flight.pop(0)
                    backward_one(out, j)
                    del out
            while in_flight:
                j, out = in_flight.pop(0)
                backward_one(out, j)
                del out
            for _ in range(0 if first_stage_in_flight else microbatches):
                tracker.reset_mod_stats()  # per-module stats cover one forward; the peak is kept
                with loss_ctx():
                    pred = model(inputs)
                    loss = F.cross_entropy(pred.flatten(0, 1).float(), tokens.flatten(0, 1))
                    del pred
                    loss.backward()
            if pipeline_nosync:  # torch's own PipelineStage.perform_reduce_grad on this module
                from types import SimpleNamespace

                from torch.distributed.pipelining.stage import _PipelineStageBase
                _PipelineStageBase.perform_reduce_grad(SimpleNamespace(submod=model), 1)
            opt.step()
            opt.zero_grad(set_to_none=zero_grad_set_to_none)
        snap = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(snap.values()))
    cats = {str(getattr(k, "value", k)): v for k, v in per_device.items()}
    total = cats.pop("Total", sum(cats.values()))
    return FakeRankResult(peak_bytes=float(total), by_category_bytes=cats, wall_s=time.perf_counter() - t0)


def loss_created_bytes(weight, h, labels, mesh=None) -> float:
    """Peak bytes torchtitan's loss creates on this rank, by torch's ``MemTracker``: the output layer's bf16
    logits ``h @ weight.t()`` (``h``: [..., hidden]), ``cross_entropy(pred.flatten(0, -2).float(), labels.flatten())``
    (torchtitan ``components/loss.py``) and its backward; with a ``mesh`` the output layer is vocabulary-parallel
    over it (``ColwiseParallel`` with ``Shard(-1)`` output, ``apply_tp``) and the loss runs under ``loss_parallel``.
    What it counts: activations and temporaries, not the tracked inputs, weights and labels. Real or fake tensors
    alike: :func:`measure_loss_bytes` runs it under fake tensors, tests/loss_parallel_probe.py on real gloo ranks."""
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    tracker = MemTracker()
    tracker.track_external(weight, h, labels)
    with tracker:
        if mesh is not None:
            w = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
            pred = F.linear(DTensor.from_local(h, mesh, [Replicate()]), w)  # Shard(-1): vocab-parallel
            ctx = loss_parallel()
        else:
            pred = h @ weight.t()
            ctx = contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(pred.flatten(0, -2).float(), labels.flatten())
            del pred
            loss.backward()
        snap = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(snap.values()))
    return float(sum(v for k, v in per_device.items() if str(getattr(k, "value", k)) in ("Activation", "Temp")))


def measure_loss_bytes(tokens: int, vocab: int, tp: int = 1) -> float:
    """Peak bytes of torchtitan's loss on one rank (:func:`loss_created_bytes`) for ``tokens`` tokens and
    ``vocab`` entries, under fake tensors: one rank of ``tp``; with ``tp > 1`` the logits are vocabulary-sharded
    and the loss runs under ``loss_parallel``. DTensor's sharding propagation runs apart
    (:func:`_dtensor_propagation_apart`), so the figure is what real ranks allocate (tests/test_loss_parallel_gloo.py)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    hidden = 64
    with fake_world(tp), _allocator_rounding(), _real_device_meshes(), _dtensor_propagation_apart():
        mesh = init_device_mesh("cpu", (tp,))
        with FakeTensorMode(allow_non_fake_inputs=True):
            weight = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16))
            h = torch.empty(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
            labels = torch.randint(0, vocab, (tokens,))
            return loss_created_bytes(weight, h, labels, mesh if tp > 1 else None)
