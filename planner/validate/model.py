"""A GPT/Llama decoder built from a ModelSpec, split into pipeline chunks and tensor-parallelised with DTensor.

Tensor parallelism follows torchtitan's plan for Llama (``parallelize_module`` with
``ColwiseParallel`` for Q, K, V, gate, up and the output layer; ``RowwiseParallel`` for the
attention output, down projection and the vocab-parallel embedding; ``SequenceParallel`` for the
norms and ``PrepareModuleInput`` to gather the sequence once per block when the plan has SP).
Saved tensors match Megatron's fused kernels through ``planner.validate.kernels``, except that
DTensor's sequence parallelism keeps the gathered input of the column-parallel linears (the
``framework="torch"`` case of ``planner.memory.layer_activation_terms``). With context parallelism
the attention core is torch's ring attention (planner.validate.ring) and positions are the global
positions of the rank's tokens (``positions``, set by the worker).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.specs import ModelSpec
from planner.validate.kernels import (DropoutFn, GeGLUFn, KeepFn, LayerNormFn, RMSNormFn, RopeFn, SwiGLUFn,
                                      rope_tables)


class Norm(nn.Module):
    def __init__(self, model: ModelSpec):
        super().__init__()
        h = model.hidden_size
        self.weight = nn.Parameter(torch.ones(h))
        self.layernorm = model.norm == "layernorm"
        self.bias = nn.Parameter(torch.zeros(h)) if model.norm_weights_per_channel == 2 else None  # norm_bias

    def forward(self, x):
        if self.layernorm:
            return LayerNormFn.apply(x, self.weight, self.bias, 1e-5)
        return RMSNormFn.apply(x, self.weight, 1e-5)


class Attention(nn.Module):
    def __init__(self, model: ModelSpec):
        super().__init__()
        h, d = model.hidden_size, model.kv_channels
        self.heads, self.kv_heads, self.head_dim = model.num_attention_heads, model.kv_heads, d
        self.rope = model.position_embedding == "rope"
        self.wq = nn.Linear(h, self.heads * d, bias=model.has_qkv_bias)
        self.wk = nn.Linear(h, self.kv_heads * d, bias=model.has_qkv_bias)
        self.wv = nn.Linear(h, self.kv_heads * d, bias=model.has_qkv_bias)
        self.wo = nn.Linear(self.heads * d, h, bias=model.has_out_proj_bias)
        self.recompute_core = False
        self.cp_group = None  # context parallelism (set by the worker): ring attention over these ranks
        self.positions = None  # with cp: the global positions of this rank's tokens (planner.validate.ring)

    def core(self, q, k, v):
        if self.cp_group is not None:
            from planner.validate.ring import ring_attention

            return ring_attention(q, k, v, self.cp_group)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        d = self.head_dim
        q, k, v = (proj(x).view(b, s, -1, d) for proj in (self.wq, self.wk, self.wv))
        if self.rope:
            pos = self.positions
            cos, sin = rope_tables(s if pos is None else int(pos.max()) + 1, d, dtype=q.dtype, device=q.device)
            if pos is not None:  # the rotation of each local token's global position
                cos, sin = cos[pos], sin[pos]
            q, k = RopeFn.apply(q, cos, sin), RopeFn.apply(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.recompute_core:  # selective recompute: the attention core only
            q, k, v = KeepFn.apply(q, k, v)
            o = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            o = self.core(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """The dense MLP, a routed expert (``ffn`` = moe_ffn_size) or the shared experts (their total width)."""

    def __init__(self, model: ModelSpec, ffn: int | None = None):
        super().__init__()
        h, f = model.hidden_size, ffn or model.ffn_size
        self.swiglu = model.activation == "swiglu"
        self.geglu = model.activation == "geglu"
        self.squared_relu = model.activation == "squared_relu"
        self.w1 = nn.Linear(h, f, bias=model.has_mlp_bias)
        self.w3 = nn.Linear(h, f, bias=model.has_mlp_bias) if model.gated_mlp else None
        self.w2 = nn.Linear(f, h, bias=model.has_mlp_bias)

    def forward(self, x):
        if self.swiglu:
            return self.w2(SwiGLUFn.apply(torch.cat([self.w1(x), self.w3(x)], dim=-1)))
        if self.geglu:
            return self.w2(GeGLUFn.apply(torch.cat([self.w1(x), self.w3(x)], dim=-1)))
        if self.squared_relu:  # Megatron-Core activations.squared_relu: pow(relu(x), 2), saving the ReLU output
            return self.w2(torch.pow(F.relu(self.w1(x)), 2))
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """One pre-norm transformer layer. ``saved_hooks`` (set by the worker) wraps its forward in a
    ``saved_tensors_hooks`` context that measures what autograd keeps for backward."""

    def __init__(self, model: ModelSpec, moe: bool = False):
        super().__init__()
        self.attention_norm = Norm(model)
        self.attention = Attention(model)
        self.ffn_norm = Norm(model)
        if moe:
            from planner.validate.moe_layer import MoE

            self.feed_forward = MoE(model)
        else:
            self.feed_forward = MLP(model)
        self.is_moe = moe
        self.dropout = model.dropout
        self.recompute = "none"
        self.saved_hooks = None

    def _drop(self, x):
        return DropoutFn.apply(x, 0.1) if self.dropout and self.training else x

    def _layer(self, x):
        h = x + self._drop(self.attention(self.attention_norm(x)))
        return h + self._drop(self.feed_forward(self.ffn_norm(h)))

    def forward(self, x):
        ctx = self.saved_hooks() if self.saved_hooks is not None else contextlib.nullcontext()
        with ctx:
            if self.recompute == "full":
                (x,) = KeepFn.apply(x)
                return checkpoint(self._layer, x, use_reentrant=False)
            return self._layer(x)


class Chunk(nn.Module):
    """One pipeline chunk (virtual stage): optional embedding, some layers, optional output layer.

    Learned positions are added to the full-sequence word embedding and the sum is then split along
    the sequence for sequence parallelism (``sp_mesh``), as Megatron's ``LanguageModelEmbedding``
    does (``scatter_to_sequence_parallel_region`` after the position add; its backward all-gathers).
    ``embedding_norm`` (BLOOM) follows the embedding.
    """

    def __init__(self, model: ModelSpec, first: bool, last: bool, layers: list[Block]):
        super().__init__()
        self.tok_embeddings = nn.Embedding(model.vocab_size, model.hidden_size) if first else None
        self.pos_embeddings = (nn.Embedding(model.max_seq_len, model.hidden_size)
                               if first and model.position_embedding == "learned" else None)
        self.embedding_norm = Norm(model) if first and model.embedding_norm else None
        self.layers = nn.ModuleList(layers)
        self.norm = Norm(model) if last else None
        self.output = nn.Linear(model.hidden_size, model.vocab_size, bias=model.output_bias) if last else None
        self.sp_mesh = None  # set by tensor_parallelize when positions are added before the SP split
        self.positions = None  # with cp: the global positions of this rank's tokens (set by the worker)

    def forward(self, x):
        if self.tok_embeddings is not None:
            tokens = x
            x = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                pos = self.positions if self.positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
                x = x + self.pos_embeddings(pos)
                if self.sp_mesh is not None:
                    from torch.distributed.tensor import DTensor, Replicate, Shard

                    x = DTensor.from_local(x, self.sp_mesh, [Replicate()], run_check=False) \
                        .redistribute(self.sp_mesh, [Shard(1)]).to_local()
            if self.embedding_norm is not None:
                x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def build_chunks(model: ModelSpec, layers_per_chunk: list[int], seed: int = 1234) -> list[Chunk]:
    """The whole model, cut into chunks, initialised identically on every rank (same seed).

    Tied embeddings: in one chunk the output layer shares the embedding's parameter; across
    pipeline stages the last stage holds a copy initialised from the embedding, and the worker
    all-reduces the two gradients over the embedding group, as Megatron does
    (``LanguageModule.setup_embeddings_and_output_layer``, ``_allreduce_word_embedding_grads``).
    """
    torch.manual_seed(seed)
    blocks = [Block(model, moe=model.is_moe_layer(i)) for i in range(model.num_layers)]
    for blk in blocks:
        for name, p in blk.named_parameters():
            if p.dim() == 2 or name.endswith("shared_gate.weight"):  # the h -> 1 gate is a vector (moe_layer.Gate)
                nn.init.normal_(p, std=0.02)
    chunks, start = [], 0
    for i, n in enumerate(layers_per_chunk):
        chunks.append(Chunk(model, first=i == 0, last=i == len(layers_per_chunk) - 1, layers=blocks[start:start + n]))
        start += n
    for c in chunks:
        for name in ("tok_embeddings", "pos_embeddings", "output"):
            mod = getattr(c, name)
            if mod is not None:
                nn.init.normal_(mod.weight, std=0.02)
    if model.tied_embeddings:
        first, last = chunks[0], chunks[-1]
        if first is last:
            last.output.weight = first.tok_embeddings.weight
        else:
            with torch.no_grad():
                last.output.weight.copy_(first.tok_embeddings.weight)
    return chunks


def set_recompute(chunk: Chunk, recompute: str, num_layers: int | None = None, interval: int | None = None,
                  start: int = 0) -> int:
    """``recompute`` on every layer of the chunk; with ``num_layers`` K (full only) on its first K layers, the
    others keeping everything, as Megatron's block method runs each model chunk (``Plan.recompute_num_layers``);
    with ``interval`` N (full only) on the rank's k-th layer where k % N == 0, k counted from ``start`` + 1 over the
    rank's chunks, as torchtitan's per-layer AC (``_apply_layer_sac``, ``Plan.recompute_interval``). Returns
    ``start`` plus the chunk's layers, the count the rank's next chunk starts from."""
    for i, blk in enumerate(chunk.layers):
        rc = recompute
        if num_layers is not None and i >= num_layers:
            rc = "none"
        if interval is not None and (start + i + 1) % interval:
            rc = "none"
        blk.recompute = rc
        blk.attention.recompute_core = rc == "selective"
    return start + len(chunk.layers)


def tensor_parallelize(chunk: Chunk, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan's Llama TP plan (torchtitan/models/llama3/infra/parallelize.py), with or without SP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    tied = chunk.tok_embeddings is not None and chunk.output is not None and \
        chunk.output.weight is chunk.tok_embeddings.weight
    if chunk.tok_embeddings is not None:
        split_later = chunk.pos_embeddings is not None and sequence_parallel
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate() if split_later else seq)
        if split_later:
            chunk.sp_mesh = tp_mesh
        if chunk.embedding_norm is not None and sequence_parallel:
            plan["embedding_norm"] = SequenceParallel(use_local_output=True)  # the residual stream is local
    if chunk.output is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if plan:
        parallelize_module(chunk, tp_mesh, plan)
    if tied:  # both vocab-parallel: Shard(0) of the [vocab, hidden] matrix on the TP mesh
        chunk.output.weight = chunk.tok_embeddings.weight
    for blk in chunk.layers:
        layer_plan = {
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if blk.is_moe:
            layer_plan |= moe_tp_plan(blk.feed_forward, sequence_parallel)
        else:
            layer_plan |= {
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            }
            if blk.feed_forward.w3 is not None:
                layer_plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            layer_plan |= {"attention_norm": SequenceParallel()}
            layer_plan.setdefault("ffn_norm", SequenceParallel())
        parallelize_module(blk, tp_mesh, layer_plan)
        tp = tp_mesh.size()
        blk.attention.heads //= tp
        blk.attention.kv_heads = max(blk.attention.kv_heads // tp, 1)


def moe_tp_plan(moe, sequence_parallel: bool) -> dict:
    """TP plan of a MoE layer (sequence parallelism required, planner.validate.moe.moe_refusal): the norm hands
    the layer its local sequence shard; the router and the gate run on it with their weights replicated over
    TP (``SequenceParallel`` on the flattened tokens: their gradients are summed over TP); the shared experts
    gather the sequence, run column/row parallel and scatter it again (Megatron-Core's ``SharedExpertMLP`` is a
    TP-parallel MLP); the routed experts are whole (etp = 1) and see only local tokens."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if not sequence_parallel:
        raise ValueError("a MoE layer with tp > 1 needs sequence parallelism")
    plan = {"ffn_norm": SequenceParallel(use_local_output=True),
            "feed_forward.router": SequenceParallel(sequence_dim=0, use_local_output=True)}
    if moe.shared is not None:
        plan |= {"feed_forward.shared": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
                 "feed_forward.shared.w1": ColwiseParallel(),
                 "feed_forward.shared.w2": RowwiseParallel(output_layouts=Shard(0))}
        if moe.shared.w3 is not None:
            plan["feed_forward.shared.w3"] = ColwiseParallel()
    if moe.shared_gate is not None:
        plan["feed_forward.shared_gate"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return plan


def build_local_chunks(model: ModelSpec, layers_per_chunk: list[int], pp: int, pp_rank: int,
                       seed: int = 1234) -> list[Chunk]:
    """This pipeline rank's chunks only, on the meta device: no storage is allocated.

    The full-size path of ``plan3d validate`` builds these, applies TP (:func:`tensor_parallelize`)
    and FSDP2 (``fully_shard``) while they are still on meta, and only then materialises the local
    shards with :func:`materialize_local` -- torchtitan's order (``torchtitan/train.py``: model on
    ``torch.device("meta")``, ``parallelize``, ``model.to_empty(device=...)``,
    ``init_weights``). A 70B plan's rank never holds more than its shard (tests/test_validate_fullsize.py).
    Tied embeddings across stages are refused by the caller (the copy needs the first stage's values).
    """
    del seed  # values are drawn after sharding, per local shard (materialize_local)
    starts = [sum(layers_per_chunk[:i]) for i in range(len(layers_per_chunk))]
    with torch.device("meta"):
        last = len(layers_per_chunk) - 1
        return [Chunk(model, first=i == 0, last=i == last,
                      layers=[Block(model, moe=model.is_moe_layer(starts[i] + j)) for j in range(n)])
                for i, n in enumerate(layers_per_chunk) if i % pp == pp_rank]


@torch.no_grad()
def materialize_local(chunks: list[Chunk], device, seed: int = 1234) -> None:
    """Allocate each parameter's local shard on ``device`` and initialise it as :func:`build_chunks`
    does (matrices and embeddings N(0, 0.02), norm weights 1, biases 0), drawn per shard from a seed
    that depends on the rank so shards differ. A full-size run measures memory and time, not the loss
    against a single process (that is the miniature's check), so the values need not match it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator(device="cpu").manual_seed(seed + rank)
    for chunk in chunks:
        chunk.to_empty(device=device)
        for name, p in chunk.named_parameters():
            local = p._local_tensor if hasattr(p, "_local_tensor") else p
            if name.endswith("bias"):
                local.zero_()
            elif local.dim() >= 2:
                local.copy_(torch.randn(local.shape, generator=gen, dtype=local.dtype) * 0.02)
            else:
                local.fill_(1.0)
