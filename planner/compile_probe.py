"""What a torchtitan Llama block and its loss save for backward, eager and under ``torch.compile``,
measured with torch's own machinery on real (small) CPU tensors (issue 13).

The block is torchtitan's Llama 3 ``TransformerBlock`` as the published readings ran it (torchtitan
9dec370 ``models/llama/model.py``; the same ops as 0.3.0's ``models/llama3/model.py`` with
``fuse_qkv=False`` and the SDPA backend): ``nn.RMSNorm`` (``F.rms_norm``), Q/K/V projections, complex
RoPE (``apply_rotary_emb``: ``view_as_complex(x.float()) * freqs_cis``, ``type_as``), causal
``F.scaled_dot_product_attention``, the output projection, and SwiGLU ``w2(F.silu(w1(x)) * w3(x))``,
in bf16 as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` runs it. Activation checkpointing as
torchtitan wraps it before compiling (0.3.0 ``models/llama3/parallelize.py``: "turn on
per-TransformerBlock compile after AC wrapping and before FSDP"): ``full`` checkpoints the block,
``selective`` is the op-level policy (0.3.0 ``distributed/activation_checkpoint.py::_get_custom_policy``:
save the outputs of mm and SDPA, every second mm recomputed). ``torch.compile(block, fullgraph=True)``
as ``distributed/compile.py::apply_compile`` does; the loss is ``torch.compile(cross_entropy_loss)`` as
``components/loss.py::BaseLoss._maybe_compile`` does.

Counting: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps (eager
nodes' saved tensors and the compiled graph's ``ctx.save_for_backward``); tensors are counted once
per storage and the module's parameters (and views of them) are left out: they are not activations, nor
is the generator state a checkpoint keeps (uint8, a constant per block).

Where CPU may differ from the GPU: eager ``F.rms_norm`` has a fused CUDA kernel
(``_fused_rms_norm``: saves the input and the fp32 rstd) but is decomposed on CPU, so the eager CPU
count is not the GPU's for the norms (plan3d's eager model is the CUDA one, measured in
planner/fake_rank.py); SDPA is ``_scaled_dot_product_flash_attention_for_cpu`` here and
``_scaled_dot_product_flash_attention`` on H100, both save q, k, v, out and the fp32 log-sum-exp
(CUDA also two philox scalars). Under compile the min-cut partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``) decides on the joint graph
after decomposition, which is device independent; inductor's fusion does not change what is saved.
"""

from __future__ import annotations


def _block_class(torch):
    nn, F = torch.nn, torch.nn.functional

    def apply_rotary_emb(xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        return (torch.view_as_real(xq_ * fc).flatten(3).type_as(xq),
                torch.view_as_real(xk_ * fc).flatten(3).type_as(xk))

    class Block(nn.Module):
        def __init__(self, h, heads, kv_heads, f, seq, head_dim=None):
            super().__init__()
            d = head_dim or h // heads
            self.heads, self.kv_heads, self.d = heads, kv_heads, d
            self.attention_norm, self.ffn_norm = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
            self.wq = nn.Linear(h, heads * d, bias=False)
            self.wk = nn.Linear(h, kv_heads * d, bias=False)
            self.wv = nn.Linear(h, kv_heads * d, bias=False)
            self.wo = nn.Linear(heads * d, h, bias=False)
            self.w1 = nn.Linear(h, f, bias=False)
            self.w2 = nn.Linear(f, h, bias=False)
            self.w3 = nn.Linear(h, f, bias=False)
            freqs = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
            angles = torch.outer(torch.arange(seq).float(), freqs)
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

        def attention(self, x):
            b, s, _ = x.shape
            q = self.wq(x).view(b, s, -1, self.d)
            k = self.wk(x).view(b, s, -1, self.d)
            v = self.wv(x).view(b, s, -1, self.d)
            q, k = apply_rotary_emb(q, k, self.freqs_cis)
            rep = self.heads // self.kv_heads  # torchtitan repeat_kv before SDPA
            k = k.repeat_interleave(rep, dim=2) if rep > 1 else k
            v = v.repeat_interleave(rep, dim=2) if rep > 1 else v
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x))
            n = self.ffn_norm(h)
            return h + self.w2(F.silu(self.w1(n)) * self.w3(n))

    return Block


def _op_sac_context_fn(torch):
    """torchtitan's op-level policy (module docstring) with the CPU SDPA kernel in the save list."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    mm = (aten.mm.default, aten.linear.default)
    save = {*mm, aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten.max.default}

    def context_fn():
        meta = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            key = "recompute" if ctx.is_recompute else "forward"
            if func in mm:
                meta[key] += 1
            if func in save and not (func in mm and meta[key] % 2 == 0):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _saved_bytes(torch, run, exclude) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` builds its graph, less ``exclude``."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        # uint8: a generator state the compiled checkpoint keeps for the recompute (CPU's 5056 B; CUDA's is a
        # 16 B seed and offset), per block, not per token
        if st.data_ptr() not in exclude and t.dtype != torch.uint8:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def block_saved_bytes(recompute: str, compile: str | None, b: int = 1, s: int = 256, h: int = 256,
                      heads: int = 8, kv_heads: int = 2, f: int = 768, head_dim: int | None = None,
                      float8: str | None = None) -> int:
    """Bytes one block saves for backward for a ``b x s`` bf16 input (module docstring).

    ``compile``: None (eager), or a ``torch.compile`` backend ("aot_eager", "inductor"). ``recompute``:
    "none", "selective" (torchtitan's op SAC) or "full". ``head_dim``: the attention heads' width (default
    ``h / heads``). ``float8``: a torchao float8 recipe ("rowwise", torchtitan 0.3.0's
    ``Float8LinearConverter`` default, or "tensorwise"): every linear converted by torchao's
    ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``, as torchtitan's converter swaps
    them in (with ``emulate_precision_casts`` for rowwise under compile, as the converter sets it). Runs forward
    and backward once each (the backward checks the graph is whole)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = _block_class(torch)(h, heads, kv_heads, f, s, head_dim).to(torch.bfloat16)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(float8))
        if float8 == "rowwise":  # pytorch/pytorch#150859, as torchtitan's Float8LinearConverter sets it
            torch._inductor.config.emulate_precision_casts = True
    if recompute == "none":
        fn = block
    else:
        ctx = _op_sac_context_fn(torch) if recompute == "selective" else None
        kw = {"context_fn": ctx} if ctx else {}

        def fn(x):
            return checkpoint(block, x, use_reentrant=False, **kw)
    if compile:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=compile, fullgraph=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    params |= {b_.untyped_storage().data_ptr() for b_ in block.buffers()}
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    fn(x)  # compile / warm up outside the count
    nbytes, out = _saved_bytes(torch, lambda: fn(x), params)
    out.float().sum().backward()
    return nbytes


def loss_saved_bytes(compile: str | None, tokens: int = 512, vocab: int = 4096) -> int:
    """Bytes ``cross_entropy(pred.flatten(0, 1).float(), labels)`` (torchtitan ``components/loss.py``)
    saves for backward for bf16 logits of ``tokens x vocab``; the bf16 logits themselves are the output
    layer's output and are counted only if the loss saves them."""
    import torch
    F = torch.nn.functional

    def loss_fn(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")

    fn = loss_fn
    if compile:
        torch._dynamo.reset()
        fn = torch.compile(loss_fn, backend=compile)
    torch.manual_seed(0)
    pred = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    fn(pred, labels)
    nbytes, out = _saved_bytes(torch, lambda: fn(pred, labels), {labels.untyped_storage().data_ptr()})
    out.backward()
    return nbytes


def loss_inductor_buffers(tokens: int = 512, vocab: int = 4096) -> list[list[tuple[tuple[int, ...], str]]]:
    """The buffers inductor's generated code allocates for the compiled loss of :func:`loss_saved_bytes`:
    one list of (shape, dtype) per graph (forward, then backward), read from the ``empty_strided_*``
    calls of the code it writes (a fused kernel's intermediates live in registers, not in buffers)."""
    import re

    import torch
    import torch._inductor.codecache as cc

    codes = []
    load = cc.PyCodeCache.load_by_key_path

    def record(key, path, *args, **kwargs):
        with open(path, encoding="utf-8") as fh:
            codes.append(fh.read())
        return load(key, path, *args, **kwargs)

    cc.PyCodeCache.load_by_key_path = record
    try:
        torch._inductor.config.force_disable_caches = True
        loss_saved_bytes("inductor", tokens, vocab)
    finally:
        cc.PyCodeCache.load_by_key_path = load
    pattern = re.compile(r"=\s*empty_strided_\w+\(\(([\d, ]*)\),\s*\([\d, ]*\),\s*torch\.(\w+)\)")
    return [[(tuple(int(x) for x in m.group(1).split(",") if x.strip()), m.group(2)) for m in pattern.finditer(code)]
            for code in codes if "def call(" in code]
