"""FLOPs of a training step: model FLOPs (no recompute) and hardware FLOPs (with recompute).

Counting rule (formulas.md B1, Megatron-LM ``training.py::num_floating_point_operations`` at HEAD,
commit 8873b55 with causal halving): per token and layer,

* attention ``6 * [h*(q + 2*g*d_h) + q*s/2*2 + q*h]`` (QKV, causal QK^T and PV, output projection);
* MLP ``6 * h * f * (3 if gated (SwiGLU, GeGLU) else 2)``;
* logits ``6 * h * V`` once per token.

The factor 6 is 3 passes (forward, weight grad, data grad) x 2 FLOPs per multiply-add. Norms,
biases, softmax and the embedding lookup are not counted (they are memory-bound). With
``causal=False`` the attention scores are counted in full, as Narayanan et al. 2021, PaLM and
``torch.utils.flop_counter`` do (formulas.md, contradiction 2). Sliding-window layers (GPT-OSS,
``ModelSpec.sliding_window``) count the pairs their window attends to (:func:`attended_pairs`), in the
model FLOPs as well as in the time: Megatron-Bridge's ``num_floating_point_operations`` does the same,
so MFU figures stay comparable with its published TFLOP/s.
"""

from __future__ import annotations

from planner.specs import ModelSpec

PASSES_TRAIN = 3  # forward + backward (data grad + weight grad), Narayanan et al. 2021 appendix


def attention_gemm_params(model: ModelSpec) -> float:
    """Weights of one layer's attention projections (no biases, no norms): ``h*(q + 2*g*d_h) + q*h``; under
    MLA the five projections of DeepSeek-V2 (arXiv:2405.04434 section 2.1): ``h*r_q + r_q*a*d_qk`` (or
    ``h*a*d_qk``), ``h*(r_kv + d_rope) + r_kv*a*(d_nope + d_v)`` and ``a*d_v*h``, plus ``r_q + r_kv`` for the q and
    kv norms, as Megatron-LM counts them (core_v0.16.1 ``training.py::num_floating_point_operations``,
    multi-latent-attention branch: ``q_lora_rank * (... + 1)``, ``kv_lora_rank * (... + 1)``)."""
    h, a = model.hidden_size, model.num_attention_heads
    if model.is_mla:
        rq, rkv, dqk = model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim
        q = h * rq + rq * a * dqk + rq if rq else h * a * dqk
        kv = h * (rkv + model.qk_rope_head_dim) + rkv * a * (model.qk_nope_head_dim + model.v_head_dim) + rkv
        return float(q + kv + a * model.v_head_dim * h)
    q, kv = model.q_size, 2 * model.kv_heads * model.kv_channels
    return float(h * (q + kv) + q * h)


def mlp_gemm_params(model: ModelSpec, moe: bool | None = None, active: bool = True) -> float:
    """Weights of one layer's MLP GEMMs one token runs through, as Megatron-LM counts them
    (``num_floating_point_operations``: ``moe_ffn_hidden_size * moe_router_topk + shared_expert_ffn_hidden_size``):
    ``(3 if gated else 2) * h * f`` for a dense layer; for a MoE layer ``top_k`` routed experts (all ``E`` with
    ``active=False``) and the shared experts. The ``h x E`` router and Qwen2-MoE's ``h -> 1`` shared-expert gate are
    not counted, as Megatron does not (2*h*E FLOPs per token, under 0.5 % of a layer for every preset), so plan3d's
    model FLOPs are the ones Megatron logs (tests/test_megatron_params.py runs Megatron's own function)."""
    h, m = model.hidden_size, (3 if model.gated_mlp else 2)
    moe = model.is_moe if moe is None else moe
    if not moe:
        return float(m * h * model.ffn_size)
    experts = (model.top_k if active else model.num_experts) * m * h * model.moe_ffn_size
    return float(experts + m * h * (model.shared_expert_ffn_hidden_size or 0))


def gemm_flops_per_token_per_layer(model: ModelSpec, moe: bool | None = None) -> float:
    """Forward FLOPs per token of one layer's weight GEMMs: ``2 * (params of the matrices it uses)``
    (a MoE layer: the activated experts only; ``moe`` picks the layer kind, default MoE for MoE models)."""
    return 2.0 * (attention_gemm_params(model) + mlp_gemm_params(model, moe))


def attended_pairs(seq_len: int, window: int | None = None) -> float:
    """Query-key pairs of one sequence's causal attention, the count the FLOPs below are proportional to.

    Full causal: ``s^2 / 2`` (Megatron-LM's halving convention, module docstring; the exact count is
    ``s(s+1)/2``). A sliding window of ``w`` keys (Hugging Face semantics, query included): query ``i``
    (0-based) attends to ``min(i+1, w)`` keys, so for ``w < s`` exactly
    ``sum_{i<s} min(i+1, w) = (1 + 2 + ... + w) + (s - w) * w = w(w+1)/2 + (s-w)*w``; for ``w >= s`` the
    window covers every prefix and the full-causal ``s^2/2`` is used. Megatron-Bridge counts GPT-OSS
    the same way (``src/megatron/bridge/training/utils/flop_utils.py::num_floating_point_operations``,
    commit 0494433: ``swa_context = W - W(W-1)/(2T)`` per token if ``W < T``, else the causal ``T/2``).
    """
    if window is None or window >= seq_len:
        return seq_len * seq_len / 2
    return window * (window + 1) / 2 + (seq_len - window) * window


def chunked_pairs(seq_len: int, chunk: int) -> float:
    """Query-key pairs of one sequence's chunked causal attention (Llama 4, ``ModelSpec.attention_chunk``): each
    block of ``chunk`` tokens attends causally within itself (transformers ``masking_utils.chunked_overlay``: key
    and query in the same block, key not after the query), ``c^2 / 2`` per full block and ``r^2 / 2`` for the last
    ``r`` tokens, in the halving convention of :func:`attended_pairs`; a chunk of at least ``s`` is full causal."""
    if chunk >= seq_len:
        return seq_len * seq_len / 2
    full, rest = divmod(seq_len, chunk)
    return full * chunk * chunk / 2 + rest * rest / 2


def attention_flops_per_token_per_layer(model: ModelSpec, seq_len: int, causal: bool = True,
                                        window: int | None = None, chunk: int | None = None) -> float:
    """Forward FLOPs per token of QK^T and PV: ``2 * a * s * (d_qk + d_v)`` (``2 * 2 * q * s`` when
    ``d_qk = d_v = d_h``), halved when causal (Megatron HEAD; MLA head widths from DeepSeek-V2).

    ``window``: a sliding-window layer of that many keys; ``2 * a * (d_qk + d_v)`` FLOPs per attended
    pair times :func:`attended_pairs` / s (equal to the causal count when ``window >= seq_len``). ``chunk``: a
    chunked layer (Llama 4), the same per pair times :func:`chunked_pairs` / s. A window or chunk applies to causal
    counting only: ``causal=False`` is the count of papers that ignore every mask.
    """
    full = 2.0 * model.num_attention_heads * seq_len * (model.qk_head_dim + model.v_dim)
    if not causal:
        return full
    per_pair = 2.0 * model.num_attention_heads * (model.qk_head_dim + model.v_dim)
    if chunk is not None and chunk < seq_len:  # a chunked layer (chunked_pairs)
        return per_pair * chunked_pairs(seq_len, chunk) / seq_len
    if window is None or window >= seq_len:
        return full / 2
    return per_pair * attended_pairs(seq_len, window) / seq_len


def mean_attention_flops_per_token_per_layer(model: ModelSpec, seq_len: int, causal: bool = True) -> float:
    """:func:`attention_flops_per_token_per_layer` averaged over the model's layers: ``windowed_layers`` at
    the sliding window (GPT-OSS: 18 of 36 at 128 keys, ``layer_types``), ``chunked`` layers in their chunks (Llama 4:
    36 of 48 at 8,192), the rest full causal. Exact for the whole model; for a pipeline stage it assumes the stage holds the model's mix (exact when it holds
    whole periods of the pattern, e.g. an even number of GPT-OSS layers)."""
    full = attention_flops_per_token_per_layer(model, seq_len, causal)
    n_w, n_c, L = model.windowed_layers, model.chunked, model.num_layers
    if not (n_w or n_c) or not causal:
        return full
    windowed = attention_flops_per_token_per_layer(model, seq_len, causal, window=model.sliding_window) if n_w else 0.0
    chunked = attention_flops_per_token_per_layer(model, seq_len, causal, chunk=model.attention_chunk) if n_c else 0.0
    return (n_w * windowed + n_c * chunked + (L - n_w - n_c) * full) / L


def logits_flops_per_token(model: ModelSpec, vocab_size: int | None = None) -> float:
    """Forward FLOPs per token of the output layer: ``2 * h * V``, with ``vocab_size`` the vocabulary the output
    layer has (default the model's; Megatron counts ``args.padded_vocab_size``, the vocabulary padded to a multiple
    of 128 x tp, ``specs.padded_vocab_size``)."""
    return 2.0 * model.hidden_size * (model.vocab_size if vocab_size is None else vocab_size)


def mtp_flops_per_token(model: ModelSpec, seq_len: int, causal: bool = True, vocab_size: int | None = None) -> float:
    """Forward FLOPs per token of the multi-token-prediction modules (``ModelSpec.mtp_num_layers``): each is a
    layer of the last layer's kind, the ``2h -> h`` projection of the concatenated embedding and hidden state,
    its three norms and one more pass of the output layer. As Megatron-LM counts them
    (core_v0.16.1 ``training/training.py`` ``num_floating_point_operations``: ``num_layers + mtp_num_layers``
    with the MTP layers MoE where the last layer is, ``+ mtp_num_layers * (3h + 2h^2)`` FMAs for the norms and
    the projection, the logit term times ``mtp_num_layers + 1``)."""
    n = model.mtp_num_layers
    if not n:
        return 0.0
    h = model.hidden_size
    layer = (gemm_flops_per_token_per_layer(model, model.mtp_is_moe())
             + mean_attention_flops_per_token_per_layer(model, seq_len, causal))
    return n * (layer + 2.0 * (3 * h + 2 * h * h) + logits_flops_per_token(model, vocab_size))


def recompute_flops_per_token_per_layer(model: ModelSpec, seq_len: int, recompute: str, causal: bool = True,
                                        moe: bool | None = None) -> float:
    """Extra forward FLOPs per token and layer spent recomputing (formulas.md B1 "Recompute cost").

    Full recompute repeats the layer's forward; selective repeats only the attention core
    (Korthikanti et al. 2022 section 5).
    """
    if recompute == "full":
        return gemm_flops_per_token_per_layer(model, moe) + mean_attention_flops_per_token_per_layer(model, seq_len, causal)
    if recompute == "selective":
        return mean_attention_flops_per_token_per_layer(model, seq_len, causal)
    return 0.0


def moe_share(model: ModelSpec, num_layers: float, moe_layers: float | None) -> float:
    """MoE layers among ``num_layers``: ``moe_layers`` when given, else the model's share (all its MoE
    layers when ``num_layers`` is the whole model)."""
    if moe_layers is not None:
        return moe_layers
    return num_layers * model.num_moe_layers / model.num_layers


def model_flops_per_token(model: ModelSpec, seq_len: int, causal: bool = True, num_layers: int | None = None,
                          logits: bool = True, moe_layers: float | None = None, vocab_size: int | None = None) -> float:
    """Training model FLOPs per token (no recompute), for ``num_layers`` layers (default: all) of which
    ``moe_layers`` have experts (default: :func:`moe_share`); MoE layers count the activated experts; the output
    layer has ``vocab_size`` rows (default the model's vocabulary; :func:`logits_flops_per_token`)."""
    L = model.num_layers if num_layers is None else num_layers
    n_moe = moe_share(model, L, moe_layers)
    attn = mean_attention_flops_per_token_per_layer(model, seq_len, causal)  # sliding windows counted, as
    # Megatron-Bridge counts GPT-OSS's (attended_pairs)
    layers = ((L - n_moe) * gemm_flops_per_token_per_layer(model, False)
              + n_moe * (gemm_flops_per_token_per_layer(model, True) if model.is_moe else 0.0) + L * attn)
    head = logits_flops_per_token(model, vocab_size) + mtp_flops_per_token(model, seq_len, causal, vocab_size) \
        if logits else 0.0
    return PASSES_TRAIN * (layers + head)


def model_flops_per_step(model: ModelSpec, global_batch_size: int, seq_len: int, causal: bool = True,
                         vocab_size: int | None = None) -> float:
    """Model FLOPs of one optimizer step: ``B * s * model_flops_per_token`` (Megatron HEAD). With the plan's
    padded ``vocab_size`` it is Megatron-LM's own ``num_floating_point_operations`` (core_v0.16.1
    ``training/training.py``; tests/test_megatron_params.py runs it on emitted arguments)."""
    return global_batch_size * seq_len * model_flops_per_token(model, seq_len, causal, vocab_size=vocab_size)


def hardware_flops_per_step(model: ModelSpec, global_batch_size: int, seq_len: int, recompute: str,
                            recomputed_share: float = 1.0, causal: bool = True, vocab_size: int | None = None) -> float:
    """Executed FLOPs of one step: model FLOPs plus the recomputed forward work (PaLM appendix B HFU);
    ``recomputed_share`` of the layers recomputed (Megatron's block method, ``Plan.recompute_num_layers``)."""
    extra = recomputed_share * _recompute_layers(model, model.num_layers, None, seq_len, recompute, causal)
    return model_flops_per_step(model, global_batch_size, seq_len, causal, vocab_size) \
        + global_batch_size * seq_len * extra


def _recompute_layers(model: ModelSpec, layers: float, moe_layers: float | None, seq_len: int, recompute: str,
                      causal: bool) -> float:
    """Recomputed forward FLOPs per token over ``layers`` layers, ``moe_layers`` of them with experts."""
    n_moe = moe_share(model, layers, moe_layers)
    dense = recompute_flops_per_token_per_layer(model, seq_len, recompute, causal, moe=False)
    moe = recompute_flops_per_token_per_layer(model, seq_len, recompute, causal, moe=True) if model.is_moe else 0.0
    return (layers - n_moe) * dense + n_moe * moe


def stage_flops_per_microbatch(model: ModelSpec, layers: int, micro_batch_size: int, seq_len: int,
                               last_stage: bool, recompute: str = "none", causal: bool = True,
                               moe_layers: float | None = None) -> tuple[float, float]:
    """(model, hardware) FLOPs of one micro-batch on a stage of ``layers`` layers (``moe_layers`` of them
    with experts), over all its GPUs."""
    tokens = micro_batch_size * seq_len
    mf = tokens * model_flops_per_token(model, seq_len, causal, num_layers=layers, logits=last_stage,
                                        moe_layers=moe_layers)
    hf = mf + tokens * _recompute_layers(model, layers, moe_layers, seq_len, recompute, causal)
    return mf, hf


def narayanan_flops_per_step(model: ModelSpec, global_batch_size: int, seq_len: int) -> float:
    """Narayanan et al. 2021 (arXiv:2104.04473) appendix, eq. 3: ``96 B s L h^2 (1 + s/(6h) + V/(16 L h))``.

    Counts full recompute and non-causal attention, assumes MHA with f = 4h. This is the formula
    behind the TFLOP/s per GPU of that paper's Tables 1 and 2; use it only to convert those.
    """
    B, s, L, h, V = global_batch_size, seq_len, model.num_layers, model.hidden_size, model.vocab_size
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def mfu(model_flops: float, step_time_s: float, num_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation (Chowdhery et al. 2022, PaLM, section 4.1 and appendix B)."""
    return model_flops / (step_time_s * num_gpus * peak_flops)


def hfu(hardware_flops: float, step_time_s: float, num_gpus: int, peak_flops: float) -> float:
    """Hardware FLOPs utilisation: executed FLOPs, recompute included (PaLM appendix B)."""
    return hardware_flops / (step_time_s * num_gpus * peak_flops)
