"""Memory-bound traffic of torchtitan's eager block and loss, and the attention kernel frameworks run (issue 12).

The counts come from torchtitan 0.3.0's own block and loss run on this CPU (planner/eager_probe.py); the expected
values are the coefficients planner.frameworks.torchtitan carries, not derived from the probe. The attention tables
are the H200 measurements in benchmarks/data/h200_kernels.json.
"""

import json
from pathlib import Path

import pytest

from planner import cost
from planner.frameworks import torchtitan
from planner.presets import load_hardware, load_model
from planner.specs import ModelSpec, Plan, TrainingSpec

ROOT = Path(__file__).resolve().parent.parent
H100, A100 = load_hardware("h100-sxm-80gb"), load_hardware("a100-80gb")

# (h, heads, kv_heads, ffn): widths, GQA ratios and head dims apart, so that each coefficient is exercised
SHAPES = [(256, 8, 2, 768), (512, 16, 4, 768), (256, 8, 4, 1536), (256, 4, 4, 768), (384, 6, 2, 1024)]
TOKENS = 512


def _formula(h, heads, kv_heads, ffn):
    d = h // heads
    widths = {"h": h, "q": h, "kv": kv_heads * d, "f": ffn, "d": d, "one": 1}
    return tuple(sum(c * widths[k] for k, c in coef.items()) for coef in torchtitan.EAGER_BLOCK_BYTES)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-a{}-g{}-f{}".format(*s))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_eager_block_bytes_and_launches_match_torchtitans_block(shape, recompute):
    """Forward and backward bytes per token within 0.5 % (the norms' weight gradients, per call, are the rest) and
    the launches exactly; with op-SAC or full AC the backward also re-runs every forward memory-bound kernel."""
    pytest.importorskip("torchtitan")
    from planner.eager_probe import block_traffic, per_token

    got = per_token(block_traffic(recompute, s=TOKENS, h=shape[0], heads=shape[1], kv_heads=shape[2], ffn=shape[3]),
                    TOKENS)
    fwd, bwd = _formula(*shape)
    k_f, k_b = torchtitan.EAGER_BLOCK_KERNELS
    if recompute != "none":
        bwd, k_b = bwd + fwd, k_b + k_f
    assert got["fwd"] == pytest.approx(fwd, rel=0.005)
    assert got["bwd"] == pytest.approx(bwd, rel=0.005)
    assert (got["fwd_kernels"], got["bwd_kernels"]) == (k_f, k_b)


def test_decomposed_norms_move_more_than_the_fused_pair():
    """Before torch 2.8 CUDA decomposed F.rms_norm (as the CPU build still does): the same block then moves about
    twice the forward bytes, which is why the coefficients name the fused kernel."""
    pytest.importorskip("torchtitan")
    from planner.eager_probe import block_traffic, per_token

    fused = per_token(block_traffic("none", fused_norm=True, s=TOKENS), TOKENS)
    decomposed = per_token(block_traffic("none", fused_norm=False, s=TOKENS), TOKENS)
    assert decomposed["fwd"] > 1.8 * fused["fwd"] and decomposed["fwd_kernels"] > fused["fwd_kernels"] + 10


def test_eager_loss_bytes_match_torchtitans_cross_entropy():
    pytest.importorskip("torchtitan")
    from planner.eager_probe import loss_traffic, per_token

    tokens, vocab = 256, 4096
    got = per_token(loss_traffic(tokens, vocab), tokens * vocab)
    assert (got["fwd"], got["bwd"]) == pytest.approx(torchtitan.EAGER_LOSS_BYTES_PER_LOGIT, rel=0.001)


def _layer(framework, compile=False, hw=H100, model="llama3-8b", tp=1, seq=8192, attention="flash"):
    m = load_model(model)
    training = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=seq, framework=framework, compile=compile,
                            attention=attention)
    plan = Plan(tp=tp, pp=1, dp=8 // tp, micro_batch_size=1, sequence_parallel=tp > 1)
    return cost.layer_time(m, hw, training, plan)


def test_eager_torchtitan_block_is_slower_than_compiled_and_compiled_matches_megatrons_fused_count():
    eager, compiled, megatron = _layer("torchtitan"), _layer("torchtitan", compile=True), _layer("megatron")
    assert eager.fwd_compute > compiled.fwd_compute and eager.bwd_compute > compiled.bwd_compute
    m = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192, framework="torchtitan", compile=True)
    assert cost.eager_block(m, tr, Plan(tp=1, pp=1, dp=8, micro_batch_size=1)) is None
    assert compiled.fwd_compute == pytest.approx(megatron.fwd_compute)
    assert compiled.bwd_compute == pytest.approx(megatron.bwd_compute)


def test_eager_bytes_per_token_scale_under_tp_with_sp():
    m = load_model("llama3-70b")
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192, framework="torchtitan")
    (f1, b1), _ = cost.eager_block(m, tr, Plan(tp=1, pp=1, dp=8, micro_batch_size=1))
    (f8, b8), _ = cost.eager_block(m, tr, Plan(tp=8, pp=1, dp=1, micro_batch_size=1, sequence_parallel=True))
    # everything but the RoPE cis rows (per token, on every rank) splits 8 ways
    d = m.kv_channels
    (cis_f, cis_b) = (coef["d"] * d for coef in torchtitan.EAGER_BLOCK_BYTES)
    assert f8 - cis_f == pytest.approx((f1 - cis_f) / 8)
    assert b8 - cis_b == pytest.approx((b1 - cis_b) / 8)


def test_eager_block_applies_only_to_the_block_it_was_counted_on():
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=2048, framework="torchtitan")
    plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=1)
    gpt = ModelSpec(name="gpt", num_layers=2, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                    vocab_size=4096, activation="gelu", norm="layernorm", position_embedding="learned", max_seq_len=2048)
    assert cost.eager_block(gpt, tr, plan) is None
    assert cost.eager_block(load_model("llama3-8b"), tr.model_copy(update={"framework": "megatron"}), plan) is None


def test_eager_loss_costs_more_than_the_fused_one_unless_compiled():
    m, plan = load_model("llama3-8b"), Plan(tp=1, pp=1, dp=8, micro_batch_size=1)
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192, framework="torchtitan")
    eager = cost._head_time_s(m, H100, tr, plan, cost.DEFAULT_ORDER)[0]
    fused = cost._head_time_s(m, H100, tr.model_copy(update={"framework": "megatron"}), plan, cost.DEFAULT_ORDER)[0]
    compiled = cost._head_time_s(m, H100, tr.model_copy(update={"compile": True}), plan, cost.DEFAULT_ORDER)[0]
    hbm = cost.Rates.of(H100, "bf16").hbm_bytes_per_s
    extra = 8192 * 128256 * (sum(torchtitan.EAGER_LOSS_BYTES_PER_LOGIT) - 20) / hbm  # 20 B per logit fused
    assert eager - fused == pytest.approx(extra, rel=1e-3) and compiled == pytest.approx(fused)


def _h200_attention(backend, seq, head_dim=128):
    rows = json.loads((ROOT / "benchmarks/data/h200_kernels.json").read_text())["rows"]
    (row,) = [r for r in rows if r["kind"] == "attention" and r["backend"] == backend and r["seq"] == seq
              and r["head_dim"] == head_dim and r["heads"] == 32 and r["kv_heads"] == 8]
    return row


@pytest.mark.parametrize("seq", [1024, 4096, 16384])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fa2_table_reproduces_the_measured_flash_to_cudnn_ratio(seq, pass_, head_dim):
    measured = (_h200_attention("flash", seq, head_dim)[f"{pass_}_tflops"]
                / _h200_attention("cudnn", seq, head_dim)[f"{pass_}_tflops"])
    model = (cost.attention_shape(seq, True, pass_, head_dim, "fa2")
             / cost.attention_shape(seq, True, pass_, head_dim))
    assert model == pytest.approx(measured, rel=0.01)


def test_flash2_is_slower_on_hopper_and_the_same_on_a100():
    assert cost.Rates.of(H100, "bf16", "flash2").attention_kernel == "fa2"
    assert cost.Rates.of(H100, "bf16").attention_kernel == "fused"
    assert cost.Rates.of(A100, "bf16", "flash2").attention_kernel == "fused"  # FA2 is A100's level itself
    fa2, fused = _layer("megatron", attention="flash2"), _layer("megatron")
    # Llama-3-8B at 8k on H100: the attention core takes about 1.7-2x longer forward
    att_fa2 = cost._attention_core_s(load_model("llama3-8b"), TrainingSpec(num_gpus=8, global_batch_size=8,
                                     seq_len=8192, attention="flash2"), Plan(tp=1, pp=1, dp=8, micro_batch_size=1),
                                     cost.Rates.of(H100, "bf16", "flash2"))
    att = cost._attention_core_s(load_model("llama3-8b"), TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192),
                                 Plan(tp=1, pp=1, dp=8, micro_batch_size=1), cost.Rates.of(H100, "bf16"))
    assert fa2.fwd_compute - fused.fwd_compute == pytest.approx(att_fa2[0] - att[0])
    assert 1.7 < att_fa2[0] / att[0] < 2.1
    assert _layer("megatron", hw=A100, attention="flash2").fwd_compute == pytest.approx(_layer("megatron", hw=A100).fwd_compute)
