"""Peak **reserved** memory of a torchtitan stage: a synthetic allocation trace of its training step,
built from the estimator's own terms, replayed through the caching-allocator model
(:class:`planner.fake_rank.CachingAllocator`, ``c10/cuda/CUDACachingAllocator.cpp``).

torchtitan logs ``torch.cuda.max_memory_reserved`` (``components/metrics.py``,
``DeviceMemoryMonitor.get_peak_stats``). ``planner.memory`` predicts the peak *allocated* bytes; the
caching allocator reserves more because a freed block serves only requests that fit in it (best
fit, ``get_free_block``) and a segment is returned to the device only when a ``cudaMalloc`` fails
(``release_cached_blocks``). The gap comes from the order and the sizes of the allocations, so this
module writes one training step as the list of allocations torch issues, tensor by tensor, with the
sizes ``planner.memory`` already knows, and replays it. Pure arithmetic, no torch.

The event order, one rank of one stage (each source cited where used below):

* **states** (allocated before the step, never freed): the fp32 FSDP2 shards of the root module and of
  every block (``fully_shard``: one group per block, then the root, torchtitan ``apply_fsdp``);
  the int64 tokens and labels.
* **FSDP2 unshard** of a group (``_fsdp_param_group.py::FSDPParamGroup.unshard`` ->
  ``_fsdp_collectives.py::foreach_all_gather``: the bf16 all-gather input (the shard cast, 2 B / N),
  the all-gather output (2 B x group), then ``foreach_all_gather_copy_out`` into each parameter's
  unsharded storage (``FSDPParam.alloc_all_gather_outputs``: one block per parameter), output freed:
  in forward only once the next group's copy-out is done, or at the root's post_forward
  (``wait_for_unshard``: ``comm_ctx.all_gather_state``, "defer free to allow for overlap of this copy-out with
  next all-gather"; ``FSDPState._post_forward``), in backward at once).
  Reshard frees the per-parameter storages (``FSDPParam.free_unsharded_param``, storage resized to 0).
  With ``reshard_after_forward`` (ZeRO-3 without PP, ``planner.frameworks.torchtitan``) each block
  is gathered in its forward and again in its backward, where the backward of block ``i`` prefetches
  block ``i - 1`` (FSDP2's implicit backward prefetch, ``FSDPState._pre_backward`` ->
  ``_backward_prefetch``); without, the parameters are gathered once per step and kept.
* **forward of a block**: the tensors of ``planner.memory.layer_activation_terms`` in the block's
  order (norm, Q/K/V, attention, out-projection, norm, W1/W3, SiLU, W2); a tensor the recompute
  policy does not keep lives until the next one is made (autograd frees it when its consumer has
  run), except the attention's and the MLP's input argument and the attention's own locals (Q, K, V, its
  output), which live until the module returns (torchtitan ``Attention.forward`` / ``FeedForward.forward``);
  the block's output (the next block's input) ends it.
* **TP's collectives on the activations** (torchtitan ``apply_tp``: ``SequenceParallel`` norms,
  ``PrepareModuleInput`` ``Shard(1)`` -> ``Replicate`` before the attention and the MLP, ``RowwiseParallel``
  ``wo``/``w2`` back to ``Shard(1)``; torch 2.13 ``_functional_collectives.py``): each sequence-parallel
  all-gather keeps the norm's own output (this rank's tokens) until the module returns, and
  ``all_gather_single`` gathers on dim 0, so ``_maybe_view_chunk_cat`` re-concatenates on the sequence dim with
  a copy when the micro-batch holds more than one sequence (a view only when every dimension before it has size
  1): the all-gather output is one more full (s x b x h) transient then; each row-parallel output (full, partial
  sums) is copied into rank-major order by ``reduce_scatter_single`` (``_chunk_or_narrow_cat``: ``torch.cat``,
  a copy at any micro-batch) before the reduce-scatter writes this rank's tokens; both are freed once the
  reduced tensor exists, which lives until the residual sum is made. The backward mirrors them: each
  row-parallel output's gradient is all-gathered (its copy with more than one sequence), each gathered input's
  gradient (partial sums) reduce-scattered through the same copy. Without SP a functional all-reduce
  writes a new full tensor. The output layer (``ColwiseParallel``) saves its input gathered, and its input's
  gradient is reduce-scattered before the final norm's backward.
* **loss** (torchtitan ``train.py::forward_backward_step``: ``pred = model(inputs)``, ``loss =
  loss_fn(pred, labels)``, ``del pred``, ``loss.backward()``; ``components/loss.py``:
  ``cross_entropy(pred.flatten(0, 1).float(), labels)``): the bf16 logits, their fp32 copy, the
  log-softmax output (saved); the fp32 copy and, at ``del pred``, the bf16 logits freed; backward:
  the fp32 gradient of the log-softmax output, the fp32 gradient of its input, the saved output and
  the first gradient freed, the bf16 cast of the gradient (``_to_copy`` backward). With TP
  (``loss_parallel``, DTensor's decomposed ``_log_softmax`` on the vocabulary shard) the sequence torch
  issues is replayed as recorded (:data:`LOSS_PARALLEL_EVENTS`). Compiled (``training.compiled_loss``, no TP):
  the bf16 logits are saved by the compiled loss (``del pred`` frees nothing) and the backward makes the
  bf16 gradient in one kernel, then frees them (inductor's generated code, planner/compile_probe.py). The root module (embedding, final
  norm, output layer) is resharded when its forward ends, after the output layer; its bf16 gradients
  live until FSDP2's final callback reduce-scatters them at the end of the backward.
* **backward of a block**: the recomputed tensors (``planner.memory.recompute_working_bytes``'s
  terms, re-made in forward order), then the gradients, in reverse order: one activation gradient
  per saved tensor (each lives until the next), each MLP / attention weight's bf16 gradient, the
  saved tensors freed as their backward ends; then FSDP2's ``post_backward``
  (``_fsdp_collectives.py::foreach_reduce``), after the group's reshard (``post_backward`` reshards before it
  reduces): the fp32 reduce-scatter input (4 B x group, the bf16
  gradients cast to ``reduce_dtype``), the bf16 gradients freed, the fp32 reduce-scatter output
  (4 B / N: the sharded gradient, or added into it with gradient accumulation); the input is kept until the
  next group's post_backward, or the backward's final callback (``comm_ctx.reduce_scatter_states``,
  ``reduce_scatter_max_input_buffers`` 1).
  Under PP (``PipelineStage.backward_maybe_with_nosync``: no gradient sync) the bf16 gradient is
  added into an fp32 unsharded accumulator kept for the step (``FSDPParam.to_accumulated_grad_if_needed``),
  reduce-scattered in ``perform_reduce_grad`` after the last micro-batch.
* **the word embedding's gradient** with TP (``frameworks.torchtitan.embedding_grad_bytes``): the embedding's
  backward makes the gradient of every row of the vocabulary, t times this rank's; FSDP2 copies out this rank's
  rows in its post_backward, or under PP upcasts the whole of it into the accumulator and takes the rows at
  ``perform_reduce_grad``.
* **kept stage outputs** (``training.pipeline_kept_outputs``; torch ``pipelining/stage.py`` ``output_chunks``,
  ``memory.pipeline_kept_output_bytes``): the loss stage's fp32 logits, made by the model (torchtitan's 2024
  Llama: ``self.output(h).float()``) and held past their loss, and with ``all`` every other stage's output past its
  backward; after the gradient reduction ``step()`` concatenates the held logits (``_merge_outputs``, one
  transient of their sum), and ``clear_runtime_states`` frees them when the next step starts.
* **optimizer**: AdamW allocates ``exp_avg`` and ``exp_avg_sq`` (8 B / N) at its first step;
  ``zero_grad(set_to_none=True)`` frees the sharded gradients.

Pipeline stages run their micro-batches in 1F1B order (``Schedule1F1B``: ``min(m, p - r)`` warm-up
forwards, then one backward and one forward, then the cool-down backwards; :func:`traced_microbatches`).
Two steps are replayed: the first has no Adam states, the second finds the first's cached segments
(the peak is in the first for shallow stages, in the second for deep ones).

* **streams**: FSDP2's all-gather copy-in stream makes the shard casts and the all-gather outputs, its
  reduce-scatter stream the reduce-scatter outputs (this rank's gradients); each stream has its own pools in the
  caching allocator (:class:`~planner.fake_rank.CachingAllocator`), so they are written with their stream.
* **cuBLAS's workspaces**: one per thread that runs a GEMM (``HardwareSpec.blas_workspace_mib``, 32 MiB on
  Hopper and Blackwell), made at the forward's first GEMM and the backward's first, and kept: small, but a block
  that never leaves the segment it was cut from (on an H100 they move ``max_memory_reserved`` by up to 9.5 %,
  benchmarks/data/h100_allocator_check_meta.json).

What is left out: the small per-op temporaries (rstd, RNG), the
foreach AdamW's temporaries (torchtitan's default; they come after the activations are freed, into
the cache they leave), torch.compile and Float8, and async TP (its fused all-gather-matmul writes no chunk
copies: the eager collectives are written). Interleaved and zero-bubble schedules and MoE are
not written (``planner.frameworks.torchtitan.reserved_modelled``). ``tests/test_torchtitan_reserved.py``
compares the replay with the replay of torch's own trace (``planner.fake_rank.measure_step``).
"""

from __future__ import annotations

import functools

from planner.fake_rank import HOPPER_BLAS_WORKSPACE_BYTES

BF16, FP32 = 2, 4
TOKEN_ID_BYTES = 8  # int64 token ids and labels
#: the block's tensors that TP gathers (``planner.memory.layer_activation_terms`` names): the column-parallel
#: inputs, and the first tensor after the attention's row-parallel output (the residual sum)
GATHERED_INPUTS = ("QKV input", "FC1 input")
ATTENTION_END = "norm2 input"


def _param_blocks(model, plan) -> tuple[list[float], list[float]]:
    """(attention, MLP) parameter tensors of one block on one TP rank, one entry per ``nn.Parameter``
    (FSDP2 keeps one unsharded storage per parameter): Llama's wq, wk, wv, wo and w1, w2, w3 (torchtitan
    ``models/llama3/model/model.py``), the two norm weights with the attention; MLA or MoE blocks as
    one attention and one MLP tensor (their split into parameters is not modelled)."""
    from planner.memory import attention_params_per_rank, kv_heads_per_rank, layer_param_split

    t, h = plan.tp, model.hidden_size
    norms = model.norms_per_layer * model.norm_params
    dense, expert = layer_param_split(model, t, model.is_moe, plan.ep, plan.expert_tp)
    attn = attention_params_per_rank(model, t)
    mlp = dense + expert - attn - norms
    if model.is_mla or model.is_moe:
        return [attn, norms], [mlp]
    q, kv = model.q_size / t, kv_heads_per_rank(model, t) * model.kv_channels
    rest = attn - h * (2 * q + 2 * kv)  # biases, QK norms, sinks: with wq
    per_mlp = mlp / (3 if model.gated_mlp else 2)
    return [h * q + rest, h * kv, h * kv, q * h, norms], [per_mlp] * (3 if model.gated_mlp else 2)


#: DTensor's ``loss_parallel`` cross entropy on vocabulary-sharded logits, as torch 2.13 issues its
#: allocations (``torch/distributed/tensor/parallel/loss.py``: ``_log_softmax`` and ``_nll_loss_forward``
#: / ``_nll_loss_and_log_softmax_backward`` on the local shard), recorded from torch's own loss by
#: ``planner.fake_rank``'s harness (the output layer's ``Shard(-1)`` logits, ``cross_entropy(pred.flatten(0,
#: 1).float(), labels.flatten(0, 1))``, FakeTensorMode with DTensor's sharding propagation in a fake mode of its
#: own, ``fake_rank._dtensor_propagation_apart``; the same sequence at tp 2 and 8): (event, tensor id, bytes in
#: units of the bf16 local logits ``2 B x s b V / t``). Forward: the first ``LOSS_PARALLEL_FORWARD`` events,
#: ending with ``del pred`` (id 0, the bf16 logits; id 1 its fp32 copy; id 4 the saved log-softmax), 7 units at
#: most. Backward: the rest, 8 units at its peak (16 B per local logit,
#: ``planner.frameworks.torchtitan.LOSS_PARALLEL_BYTES_PER_ELEMENT``, what real gloo ranks allocate too:
#: tests/test_loss_parallel_gloo.py); id 9 is the bf16 gradient of the logits, live through the output layer's
#: backward (its free is the trace's, not recorded here). Before 2026-12-04 the sequence was recorded with the
#: propagation's global-shape tensors counted as the rank's (22 B per local logit at tp 2, more at larger tp).
LOSS_PARALLEL_EVENTS = (
    ("A", 0, 1.0), ("A", 1, 2.0), ("A", 2, 2.0), ("A", 3, 2.0), ("D", 3, 2.0), ("A", 4, 2.0), ("D", 2, 2.0),
    ("D", 1, 2.0), ("D", 0, 1.0),
    ("A", 5, 2.0), ("A", 6, 2.0), ("A", 7, 2.0), ("D", 6, 2.0), ("A", 8, 2.0), ("D", 7, 2.0), ("D", 5, 2.0),
    ("D", 4, 2.0), ("A", 9, 1.0), ("D", 8, 2.0))
LOSS_PARALLEL_FORWARD = 9
LOSS_PARALLEL_GRAD_ID = 9


def _play(tr, events, unit_bytes, live=None, after=None) -> dict:
    """Replay a recorded op sequence (``LOSS_PARALLEL_EVENTS``) into ``tr``; returns the live tensors by id.
    ``after``: callbacks run after the allocation of the given id."""
    live = dict(live or {})
    for kind, i, units in events:
        if kind == "A":
            tr.free(live.pop(i, None))
            live[i] = tr.new(units * unit_bytes)
            if after and after.get(i):
                after[i]()
        else:
            tr.free(live.pop(i, None))
    return live


class _Trace:
    """Allocation events ``(kind, key, bytes[, stream])`` as :func:`planner.fake_rank.replay_reserved` reads them."""

    def __init__(self):
        self.events: list = []
        self._n = 0
        self.kept: set = set()  # persistent tensors: their frees are not written
        self.held: dict = {}  # the pipeline's kept stage outputs (key: bytes), freed by release_held only

    def hold(self, key, nbytes: float) -> None:
        """Keep ``key`` past its last use: a stage output in ``output_chunks`` (``pipeline_kept_outputs``)."""
        self.held[key] = nbytes

    def release_held(self) -> None:
        """``clear_runtime_states`` at the start of the next step drops the kept outputs."""
        keys, self.held = list(self.held), {}
        for k in keys:
            self.events.append(("DEL", k, 0))


    def new(self, nbytes: float, key=None, stream=0):
        """Allocate ``nbytes`` on ``stream`` (0: the default stream; FSDP2's own streams by name)."""
        if key is None:
            self._n += 1
            key = self._n
        if nbytes > 0:
            self.events.append(("ADD", key, int(nbytes), stream))
        return key

    def free(self, key) -> None:
        if key is not None and key not in self.kept and key not in self.held:
            self.events.append(("DEL", key, 0))

    def free_all(self, keys) -> None:
        for k in keys:
            self.free(k)


@functools.lru_cache(maxsize=256)
def stage_events(model, training, plan, stage: int, layers: int, num_microbatches: int, steps: int = 2,
                 step_microbatches: int = 0, blas_workspace_bytes: int = HOPPER_BLAS_WORKSPACE_BYTES) -> tuple:
    """The allocation events of ``steps`` training steps of one GPU of stage ``stage`` (module docstring);
    ``num_microbatches`` written, of ``step_microbatches`` (default: as many) in the step, which sets the
    pipeline's receive buffers. ``blas_workspace_bytes``: cuBLAS's workspace, one per thread that runs a GEMM
    (``HardwareSpec.blas_workspace_mib``), made at the first GEMM of the forward and of the backward and kept."""
    from planner.frameworks.torchtitan import reshard_after_forward
    from planner.memory import (act_bytes, kept_under, layer_activation_terms, param_bytes, stage_param_split,
                                vocab_rows_params)
    from planner.specs import padded_vocab_size, pipeline_kept_mode

    tr = _Trace()
    p, m, t = plan.pp, num_microbatches, plan.tp

    def blas_workspace(thread: str) -> None:
        """cuBLAS's workspace of the thread that runs this GEMM, made after the GEMM's output, the first time that
        thread runs one (aten/src/ATen/cuda/CublasHandlePool.cpp: ``getCurrentCUDABlasHandle`` keeps a workspace
        per handle and stream, handles per thread; the forward runs on the caller's thread, the backward on
        autograd's device thread), and kept for the process."""
        if blas_workspace_bytes and ("blas", thread) not in tr.kept:
            tr.kept.add(("blas", thread))
            tr.new(blas_workspace_bytes, ("blas", thread))

    n = max(plan.dp * plan.cp, 1) if plan.zero_stage >= 1 else 1
    fsdp = plan.zero_stage >= 1
    raf = reshard_after_forward(plan)
    wb, e = param_bytes(training)[0], act_bytes(training)  # compute-copy weights, activations
    sp = t if plan.sequence_parallel else 1
    s, b, h = training.seq_len // plan.cp, plan.micro_batch_size, model.hidden_size
    sb = s * b
    first, last = stage == 0, stage == plan.loss_stage
    attn_p, mlp_p = _param_blocks(model, plan)
    layer_p = sum(attn_p) + sum(mlp_p)
    dense, expert = stage_param_split(model, plan, stage, layers)
    root_p = max(dense + expert - layers * layer_p, 0.0)
    v_local = padded_vocab_size(model.vocab_size, t) / t  # this rank's logits per token
    rows_p = vocab_rows_params(model, t)
    emb_p = rows_p if first else 0.0
    out_p = rows_p if last and root_p - emb_p > rows_p / 2 else 0.0
    root_blocks = [x for x in (emb_p, root_p - emb_p - out_p, out_p) if x > 0]
    groups = [root_blocks] + [attn_p + mlp_p] * layers  # group 0: the root module
    # the word embedding's gradient is one of the whole vocabulary with TP (frameworks.torchtitan.embedding_grad_bytes):
    # (group, block) of the embedding, or none
    partial_embedding = (0, 0) if first and emb_p and t > 1 else (None, None)
    terms = layer_activation_terms(model, training, plan)
    split = next((i for i, x in enumerate(terms) if x.name.startswith("norm2")), len(terms))
    # per layer, the policy it runs under: torchtitan's per-layer AC (plan.recompute_interval) checkpoints every
    # N-th block of the rank and leaves the others alone (Plan.checkpointed_layers)
    policies = [plan.recompute] * layers if not plan.partial_recompute else \
        ["full" if c else "none" for c in plan.checkpointed_layers(stage, layers)]
    tp_collectives = t > 1 and not (model.is_mla or model.parallel_attention or model.shared_input_norm)
    # the row-parallel outputs and their reduce-scatter outputs are terms only for what op AC keeps of them
    # (memory.layer_activation_terms, autograd False); where nothing keeps them they are the partial sums and reduced
    # tensors the TP collectives below write, not tensors of their own
    forward_by = {rc: [(x.name, x.bytes, kept_under(x, rc), j < split) for j, x in enumerate(terms)
                       if not x.layer_input and (x.autograd or kept_under(x, rc) or not tp_collectives)]
                  for rc in set(policies)}
    recompute_by = {rc: [(x.name, x.bytes) for x in terms if x.autograd and not kept_under(x, rc) and not x.layer_input]
                    for rc in set(policies)}
    backward_halves = [([(x.name, x.bytes) for x in reversed(half) if x.autograd], blocks)
                       for half, blocks in ((terms[split:], mlp_p), (terms[:split], attn_p))]
    # TP's collectives on the activations (DTensor, torchtitan apply_tp; module docstring): their outputs and the
    # copies torch's functional collectives make, written where the block's dense layout has them
    full = sb * h * e  # one (s x b x h) activation on this rank: a gathered input, a partial sum
    gather_copy = tp_collectives and sp > 1 and b > 1  # _maybe_view_chunk_cat: a view only when b = 1

    def gather():
        """Sequence-parallel all-gather of a norm's output (``PrepareModuleInput``/``ColwiseParallel``,
        ``Shard(1)`` -> ``Replicate``): ``all_gather_single`` gathers on dim 0 and ``_maybe_view_chunk_cat``
        re-concatenates on the sequence dim, a view when the micro-batch is one sequence and a copy otherwise.
        Returns the transient to free once the gathered tensor (the next one written) exists."""
        if not gather_copy:  # one sequence (or no SP): the gathered input is the all-gather's output itself
            return None
        return tr.new(full)  # all_gather_into_tensor's output; the copy is the next tensor written

    def all_gathered():
        """A sequence-parallel all-gather whose result is written here (not a term of the block): the all-gather's
        output, and with more than one sequence per micro-batch the copy :func:`gather` describes, which is kept.
        Returns the gathered tensor."""
        transient = gather()
        out = tr.new(full)
        tr.free(transient)
        return out

    def reduce_partial(partial):
        """The partial sums ``partial`` (a row-parallel output, or a column-parallel input's gradient) reduced:
        with SP ``reduce_scatter_single`` copies them into rank-major order first (``_chunk_or_narrow_cat``:
        ``torch.cat`` of the sequence chunks, a copy at any micro-batch), then the reduce-scatter's output
        (this rank's tokens); without SP a functional all-reduce's full output. Returns the reduced tensor."""
        if sp > 1:
            cat = tr.new(full)
            out = tr.new(full / sp)
            tr.free(partial)
            tr.free(cat)
            return out
        out = tr.new(full)
        tr.free(partial)
        return out

    # --- states: fp32 shards (or, without FSDP, fp32 parameters), tokens and labels
    for g, blocks in enumerate(groups):
        for j, x in enumerate(blocks):
            tr.new(FP32 * x / n, ("shard", g, j))
    if first:
        tr.new(sb * TOKEN_ID_BYTES)
    if last:
        tr.new(sb * TOKEN_ID_BYTES)
    # torch.distributed.pipelining's receive buffers, one per micro-batch of the step, made at the first
    # step and kept (planner.memory.pipeline_buffer_bytes): the stage input (not on stage 0) and the
    # gradient of its output (not on the last stage)
    boundary = sb * h * e / sp
    recv_x, recv_g = [], []
    if p > 1:
        for i in range(step_microbatches or m):
            if not first:
                recv_x.append(tr.new(boundary, ("recv", i)))
            if stage < p - 1:
                recv_g.append(tr.new(boundary, ("recv_grad", i)))
        tr.kept.update(recv_x + recv_g)
    gathered = set()
    # torch.distributed.pipelining's kept stage outputs (memory.pipeline_kept_output_bytes); none without PP
    kept_mode = pipeline_kept_mode(training, plan)

    # FSDP2's deferred frees (torch 2.13 fsdp/_fully_shard/_fsdp_param_group.py): in forward the all-gather's
    # output is kept past its copy-out until the next group's copy-out, or the root's post_forward
    # (``comm_ctx.all_gather_state``, "defer free to allow for overlap of this copy-out with next all-gather"); a
    # reduce-scatter's fp32 input is kept until the next group's post_backward, or the backward's final callback
    # (``comm_ctx.reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` = 1)
    deferred = {"all_gather": None, "reduce_scatter": None}

    def settle(kind):
        """Free the deferred ``kind`` ("all_gather" or "reduce_scatter"), if one is held."""
        tr.free(deferred[kind])
        deferred[kind] = None

    def unshard(g, in_forward=False):
        if g in gathered or not groups[g]:
            return
        gathered.add(g)
        if not fsdp or n == 1:  # no all-gather: the compute copy is the bf16 cast (autocast) or the shard
            if wb != FP32 or fsdp:
                for j, x in enumerate(groups[g]):
                    tr.new(wb * x, ("full", g, j))
            return
        total = sum(groups[g])
        # the shard's bf16 cast and the all-gather's output are made on FSDP2's all-gather copy-in stream
        # (_fsdp_collectives.py foreach_all_gather: ``with device_handle.stream(all_gather_copy_in_stream)``; the
        # forward's and the backward prefetch's unshards both take it, FSDPCommContext.get_all_gather_streams)
        ag_in = tr.new(wb * total / n, stream="all_gather")
        ag_out = tr.new(wb * total, stream="all_gather")
        tr.free(ag_in)
        for j, x in enumerate(groups[g]):
            tr.new(wb * x, ("full", g, j))
        settle("all_gather")  # the previous group's, once this copy-out is done
        if in_forward:
            deferred["all_gather"] = ag_out
        else:
            tr.free(ag_out)

    def reshard(g):
        if g in gathered:
            gathered.discard(g)
            tr.free_all(("full", g, j) for j in range(len(groups[g])))

    def reduce_grads(g, grads, mb_first):
        """FSDP2 post_backward (pp = 1) or the PP accumulator (module docstring)."""
        total = sum(groups[g])
        if p > 1 and fsdp:
            for j, x in enumerate(groups[g]):
                if mb_first:
                    tr.new(FP32 * x * (t if (g, j) == partial_embedding else 1), ("acc", g, j))
            tr.free_all(grads)
            return
        if fsdp and n > 1:
            settle("reduce_scatter")
            rs_in = tr.new(FP32 * total)  # on the default stream (foreach_reduce: reduce_scatter_comm.allocate)
            tr.free_all(grads)
            # the output, this rank's gradient, on the reduce-scatter stream (``with device_handle.stream(
            # reduce_scatter_stream): reduce_output = ...``), where it stays as the sharded gradient
            out = tr.new(FP32 * total / n, ("grad", g) if mb_first else None, stream="reduce_scatter")
            deferred["reduce_scatter"] = rs_in
            if not mb_first:
                tr.free(out)
            return
        # no all-gather (DDP / one replica): fp32 gradients accumulated in place
        if mb_first:
            tr.new(FP32 * total, ("grad", g))
        tr.free_all(grads)

    def root_forward_done():
        """The root module's post_forward frees the deferred all-gather output."""
        settle("all_gather")

    # --- one micro-batch, forward and backward
    saved: dict = {}

    def forward(mb):
        keep = []
        if first:
            unshard(0, in_forward=True)
        if recv_x:  # block 0's input: the received one
            x = recv_x[mb]
        elif t > 1:  # the vocabulary-parallel embedding's output (RowwiseParallel): partial sums of every
            x = reduce_partial(tr.new(full))  # token, reduced to this rank's tokens (Shard(1)) with SP, or all-reduced
        else:
            x = tr.new(boundary)
        for i in range(layers):
            g = i + 1
            unshard(g, in_forward=True)
            layer = [x]
            prev = None
            norm_out = reduced = module_input = None
            scope = []  # the attention's own tensors it does not save: alive until it returns
            for name, nbytes, kept, attention in forward_by[policies[i]]:
                transient = None
                if tp_collectives and name in GATHERED_INPUTS:
                    if sp > 1:
                        norm_out = tr.new(full / sp)  # the norm's output on this rank's tokens, until the half ends
                    transient = gather()
                elif name == ATTENTION_END:  # the attention's row-parallel output, reduced
                    if tp_collectives:
                        reduced = reduce_partial(tr.new(full))
                    tr.free(norm_out)
                    tr.free(module_input)
                    tr.free_all(scope)
                    norm_out = module_input = None
                k = tr.new(nbytes)
                if name == "Q":  # the block's first GEMM (wq) has run
                    blas_workspace("forward")
                tr.free(prev)
                tr.free(transient)
                if name == ATTENTION_END:
                    tr.free(reduced)  # the residual sum exists
                    reduced = None
                prev = None
                if kept:
                    layer.append(k)
                elif name in GATHERED_INPUTS:  # the attention's / MLP's input argument: alive until it returns
                    module_input = k
                elif attention:  # Attention.forward's locals (xq, xk, xv, output)
                    scope.append(k)
                else:
                    prev = k
            if tp_collectives:  # the MLP's row-parallel output, reduced
                reduced = reduce_partial(tr.new(full))
                tr.free(norm_out)
            tr.free(module_input)
            tr.free_all(scope)  # (a layer without ATTENTION_END: parallel attention)
            x = tr.new(sb * h * e / sp)  # the block's output: the next block's input
            tr.free(prev)
            tr.free(reduced)
            keep.append(layer)
            if raf:
                reshard(g)
        loss = None
        if last:
            unshard(0, in_forward=True)
            normed = tr.new(sb * h * e / sp)  # the final norm's output
            saved_input = normed  # what the output layer saves: with SP its input gathered (ColwiseParallel)
            if tp_collectives and sp > 1:
                saved_input = all_gathered()
            logits = sb * v_local

            def logits_made():  # the norm's own output goes once the output layer has run
                if saved_input != normed:
                    tr.free(normed)
                if raf:
                    reshard(0)  # the root module's forward ends with the output layer (FSDP2 post_forward)
                root_forward_done()
            if t > 1 and training.precision != "fp32":  # loss_parallel: torch's own op sequence
                events = LOSS_PARALLEL_EVENTS[:LOSS_PARALLEL_FORWARD]
                if kept_mode:  # the stage output the schedule keeps: the fp32 logits (memory.kept_output_bytes),
                    out = tr.new(FP32 * logits)  # made by the model (2024: self.output(h).float()), so the loss's
                    tr.hold(out, FP32 * logits)  # bf16 logits (id 0) and its .float() copy (id 1) are not written
                    logits_made()
                    events = tuple(ev for ev in events if ev[1] not in (0, 1))
                live = _play(tr, events, BF16 * logits, after={0: logits_made})
                loss = ("lp", live)
            else:
                pred = tr.new((FP32 if kept_mode else e) * logits)  # kept: the model's fp32 logits, as above
                if kept_mode:
                    tr.hold(pred, FP32 * logits)
                logits_made()
                if training.compiled_loss and e != FP32:  # the compiled loss saves the bf16 logits themselves
                    loss = [pred]
                else:
                    f32 = tr.new(FP32 * logits) if e != FP32 and not kept_mode else None
                    lsm = tr.new(FP32 * logits)
                    tr.free(f32)
                    tr.free(pred)  # train.py: del pred
                    loss = [lsm]
            keep.append([x, saved_input])
        else:
            keep.append([x])  # the stage's output, held until its gradient comes back
            if kept_mode == "all":  # and past it: every stage's output_chunks (before pytorch#153383)
                tr.hold(x, sb * h * e / sp)
        root_forward_done()  # (the loss stage's was at its logits: the loss runs outside the model)
        saved[mb] = (keep, loss)

    def backward(mb, mb_first):
        keep, loss = saved.pop(mb)
        tail = keep.pop()
        grad = None
        root_grads = []
        if last:
            logits = sb * v_local
            if isinstance(loss, tuple):  # loss_parallel's backward, then its last bf16 gradient
                live = _play(tr, LOSS_PARALLEL_EVENTS[LOSS_PARALLEL_FORWARD:], BF16 * logits, live=loss[1])
                gb = live.pop(LOSS_PARALLEL_GRAD_ID)
                tr.free_all(live.values())
            elif training.compiled_loss and e != FP32:  # one fused kernel: the bf16 gradient, then the saved logits go
                g2 = None
                gb = tr.new(e * logits)
                tr.free_all(loss)
            else:
                g1 = tr.new(FP32 * logits)
                g2 = tr.new(FP32 * logits)
                tr.free(g1)
                tr.free_all(loss)
                gb = tr.new(e * logits) if e != FP32 else None
                tr.free(g2 if gb is not None else None)
            unshard(0)
            # the output layer's and final norm's bf16 gradients: the root group's post_backward runs
            # in FSDP2's final callback (FSDPState._root_post_backward_final_callback), so they live
            # until the end of the backward
            root_grads += [tr.new(wb * x) for x in groups[0][1 if first else 0:]]
            blas_workspace("backward")  # the output layer's weight gradient: the backward's first GEMM
            if raf and layers:  # FSDP2's prefetch of the last block: after that GEMM in torch's own trace
                unshard(layers)
            # the gradient of the output layer's input: TP's partial sums, reduced, then the final norm's backward
            reduced = reduce_partial(tr.new(full)) if tp_collectives else None
            grad = tr.new(sb * h * e / sp)
            tr.free(reduced)
            tr.free(gb if gb is not None else g2)
            tr.free_all(tail)
        else:
            grad = recv_g[mb]  # the gradient the next stage sends, into its receive buffer
            tr.free_all(tail)
        for i in reversed(range(layers)):
            g = i + 1
            unshard(g)
            if raf and i > 0:
                unshard(g - 1)  # FSDP2's backward prefetch of the block before
            layer = keep.pop()
            # recompute: what the policy dropped, re-made in forward order
            recomputed = []
            for name, x in recompute_by[policies[i]]:
                transient = reduced = None
                if tp_collectives and name in GATHERED_INPUTS:
                    transient = gather()
                elif tp_collectives and name == ATTENTION_END:  # full AC re-runs the attention's reduction
                    reduced = reduce_partial(tr.new(full))
                recomputed.append(tr.new(x))
                tr.free(transient)
                tr.free(reduced)
            held = layer + recomputed
            wgrads = []
            prev = grad
            for half, blocks in backward_halves:
                pending = None
                if tp_collectives and sp > 1:  # the gradient of the row-parallel output, all-gathered
                    pending = all_gathered()
                for name, x in half:
                    k = tr.new(x)
                    blas_workspace("backward")  # (a stage without the loss: FC2's input gradient is its first)
                    tr.free(prev)
                    tr.free(pending)
                    pending = None
                    if tp_collectives and name in GATHERED_INPUTS:  # the gathered input's gradient, reduced
                        k = reduce_partial(k)
                    prev = k
                tr.free(pending)
                wgrads += [tr.new(wb * y) for y in blocks]
            grad = tr.new(sb * h * e / sp)  # the gradient of the block's input
            tr.free(prev)
            tr.free_all(held)
            # FSDP2 post_backward: reshard (after backward; not under PP), then reduce (_fsdp_param_group.py)
            if raf or (plan.zero_stage < 3 and p == 1 and fsdp):
                reshard(g)
            reduce_grads(g, wgrads, mb_first)
        if first and emb_p:
            if t > 1:  # the vocabulary-parallel embedding's weight gradient (torchtitan.embedding_grad_bytes)
                output_grad = all_gathered() if sp > 1 else None  # Shard(1) -> Replicate: its output's gradient
                tr.free(grad)
                whole = tr.new(wb * emb_p * t)  # every row of the vocabulary, on every rank
                tr.free(output_grad)
                grad = None
                if p > 1 and fsdp:  # no gradient sync: the whole gradient itself goes into the accumulator
                    root_grads.append(whole)
                else:  # post_backward takes this rank's rows of it (_get_grad_inner_tensor's redistribute: a copy)
                    root_grads.append(tr.new(wb * emb_p))
                    tr.free(whole)
            else:
                root_grads.append(tr.new(wb * emb_p))
        tr.free(grad)
        if groups[0]:
            if p == 1 and (raf or plan.zero_stage < 3):
                reshard(0)
            reduce_grads(0, root_grads, mb_first)
        settle("reduce_scatter")  # the final callback (is_last_backward: every backward without PP)

    def step(k):
        tr.release_held()  # the schedule's clear_runtime_states: the previous step's kept outputs
        warm = min(m, p - stage) if p > 1 else 1
        f = bwd = 0
        while bwd < m:  # 1F1B (Schedule1F1B); pp = 1: forward, backward per micro-batch
            if f < m and f - bwd < warm:
                forward(f)
                f += 1
                continue
            backward(bwd, bwd == 0)
            bwd += 1
        if p > 1 and fsdp:  # perform_reduce_grad: each group's post_backward: reshard, reduce the accumulators
            for g, blocks in enumerate(groups):
                if not blocks:
                    continue
                reshard(g)
                local = None
                if g == partial_embedding[0]:  # the whole accumulator redistributed to this rank's rows
                    local = tr.new(FP32 * emb_p)  # (FSDPParam._get_grad_inner_tensor), the accumulator dropped
                    tr.free(("acc", *partial_embedding))
                rs_in = None
                if n > 1:
                    settle("reduce_scatter")
                    rs_in = tr.new(FP32 * sum(blocks))
                tr.free_all(("acc", g, j) for j in range(len(blocks)))  # copied in: unsharded_grads.clear()
                tr.free(local)
                tr.new(FP32 * sum(blocks) / n, ("grad", g), stream="reduce_scatter" if n > 1 else 0)
                deferred["reduce_scatter"] = rs_in
            settle("reduce_scatter")
        if kept_mode and last:  # step() returns merge_chunks(output_chunks): one torch.cat of the kept logits
            merged = tr.new(sum(tr.held.values()))
            tr.free(merged)
        for g, blocks in enumerate(groups):  # AdamW: states at the first step, one temporary per group
            if k == 0:
                for j, x in enumerate(blocks):
                    tr.new(FP32 * x / n, ("m", g, j))
                    tr.new(FP32 * x / n, ("v", g, j))
            tmp = tr.new(FP32 * sum(blocks) / n)
            tr.free(tmp)
        for g in range(len(groups)):  # zero_grad(set_to_none=True)
            tr.free(("grad", g))

    for k in range(steps):
        step(k)
    return tuple(tr.events)


STEADY_CYCLES = 3  # 1F1B cycles written after the warm-up (stage_reserved)


def traced_microbatches(plan, stage: int, num_microbatches: int, training=None) -> int:
    """Micro-batches the trace writes: after the warm-up of ``min(m, p - r)`` forwards, 1F1B repeats one
    backward and one forward of the same tensors, so the allocator's state repeats from cycle to cycle;
    the trace keeps ``STEADY_CYCLES`` of them (``tests/test_torchtitan_reserved.py`` checks the peak is the
    one of all ``m``). Gradient accumulation at pp = 1 likewise. Where the pipeline keeps its stage outputs
    (``training.pipeline_kept_outputs``) the state grows from one micro-batch to the next: all are written."""
    warm = min(num_microbatches, plan.pp - stage) if plan.pp > 1 else 1
    from planner.specs import pipeline_kept_mode

    if training is not None and pipeline_kept_mode(training, plan):
        return num_microbatches  # the kept outputs grow from one micro-batch to the next
    return min(num_microbatches, warm + STEADY_CYCLES)


@functools.lru_cache(maxsize=256)
def stage_reserved(model, training, plan, stage: int, layers: int, num_microbatches: int,
                   capacity_bytes: float | None = None, all_microbatches: bool = False,
                   blas_workspace_bytes: int = HOPPER_BLAS_WORKSPACE_BYTES) -> tuple[float, float, bool]:
    """(peak reserved bytes, peak allocated bytes, out of memory) of the replay of :func:`stage_events`
    through :class:`~planner.fake_rank.CachingAllocator` with ``capacity_bytes`` as the device limit
    (the allocator releases its wholly free cached segments when a new one would pass it; out of
    memory: a segment still does not fit after that, ``CUDACachingAllocator.cpp`` ``malloc`` ->
    ``release_cached_blocks`` -> ``alloc_block`` fails -> OutOfMemoryError). The micro-batches written are
    :func:`traced_microbatches` (all ``num_microbatches`` with ``all_microbatches``); ``blas_workspace_bytes`` as
    :func:`stage_events` takes it."""
    from planner.fake_rank import replay_reserved

    m = num_microbatches if all_microbatches else traced_microbatches(plan, stage, num_microbatches, training)
    alloc = replay_reserved(stage_events(model, training, plan, stage, layers, m, step_microbatches=num_microbatches,
                                         blas_workspace_bytes=blas_workspace_bytes), capacity_bytes)
    return float(alloc.peak_reserved), float(alloc.peak_allocated), bool(alloc.oom)
