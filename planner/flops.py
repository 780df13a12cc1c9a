"""FLOPs of a training step: model FLOPs (no recompute) and hardware FLOPs (with recompute).

Counting rule (formulas.md B1, Megatron-LM ``training.py::num_floating_point_operations`` at HEAD,
commit 8873b55 with causal halving): per token and layer,

* attention ``6 * [h*(q + 2*g*d_h) + q*s/2*2 + q*h]`` (QKV, causal QK^T and PV, output projection);
* MLP ``6 * h * f * (3 if gated (SwiGLU, GeGLU) else 2)``;
* logits ``6 * h * V`` once per token.

The factor 6 is 3 passes (forward, weight grad, data grad) x 2 FLOPs per multiply-add. Norms,
biases, softmax and the embedding lookup are not counted (they are memory-bound). With
``causal=False`` the attention scores are counted in full, as Narayanan et al. 2021, PaLM and
``torch.utils.flop_counter`` do (formulas.md, contradiction 2).
"""

from __future__ import annotations

from planner.specs import ModelSpec

PASSES_TRAIN = 3  # forward + backward (data grad + weight grad), Narayanan et al. 2021 appendix


def gemm_flops_per_token_per_layer(model: ModelSpec) -> float:
    """Forward FLOPs per token of one layer's weight GEMMs: ``2 * (params of its matrices)``."""
    h, q, f = model.hidden_size, model.q_size, model.ffn_size
    kv = 2 * model.kv_heads * model.kv_channels
    mlp = (3 if model.gated_mlp else 2) * h * f
    return 2.0 * (h * (q + kv) + q * h + mlp)


def attention_flops_per_token_per_layer(model: ModelSpec, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs per token of QK^T and PV: ``2 * 2 * q * s``, halved when causal (Megatron HEAD)."""
    full = 4.0 * model.q_size * seq_len
    return full / 2 if causal else full


def logits_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs per token of the output layer: ``2 * h * V``."""
    return 2.0 * model.hidden_size * model.vocab_size


def recompute_flops_per_token_per_layer(model: ModelSpec, seq_len: int, recompute: str, causal: bool = True) -> float:
    """Extra forward FLOPs per token and layer spent recomputing (formulas.md B1 "Recompute cost").

    Full recompute repeats the layer's forward; selective repeats only the attention core
    (Korthikanti et al. 2022 section 5).
    """
    if recompute == "full":
        return gemm_flops_per_token_per_layer(model) + attention_flops_per_token_per_layer(model, seq_len, causal)
    if recompute == "selective":
        return attention_flops_per_token_per_layer(model, seq_len, causal)
    return 0.0


def model_flops_per_token(model: ModelSpec, seq_len: int, causal: bool = True, num_layers: int | None = None,
                          logits: bool = True) -> float:
    """Training model FLOPs per token (no recompute), for ``num_layers`` layers (default: all)."""
    L = model.num_layers if num_layers is None else num_layers
    per_layer = gemm_flops_per_token_per_layer(model) + attention_flops_per_token_per_layer(model, seq_len, causal)
    return PASSES_TRAIN * (L * per_layer + (logits_flops_per_token(model) if logits else 0.0))


def model_flops_per_step(model: ModelSpec, global_batch_size: int, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one optimizer step: ``B * s * model_flops_per_token`` (Megatron HEAD)."""
    return global_batch_size * seq_len * model_flops_per_token(model, seq_len, causal)


def hardware_flops_per_step(model: ModelSpec, global_batch_size: int, seq_len: int, recompute: str,
                            causal: bool = True) -> float:
    """Executed FLOPs of one step: model FLOPs plus the recomputed forward work (PaLM appendix B HFU)."""
    extra = model.num_layers * recompute_flops_per_token_per_layer(model, seq_len, recompute, causal)
    return model_flops_per_step(model, global_batch_size, seq_len, causal) + global_batch_size * seq_len * extra


def stage_flops_per_microbatch(model: ModelSpec, layers: int, micro_batch_size: int, seq_len: int,
                               last_stage: bool, recompute: str = "none", causal: bool = True) -> tuple[float, float]:
    """(model, hardware) FLOPs of one micro-batch on a stage of ``layers`` layers, over all its GPUs."""
    tokens = micro_batch_size * seq_len
    mf = tokens * model_flops_per_token(model, seq_len, causal, num_layers=layers, logits=last_stage)
    hf = mf + tokens * layers * recompute_flops_per_token_per_layer(model, seq_len, recompute, causal)
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
