"""Sliding-window attention (GPT-OSS ``layer_types`` / ``sliding_window``): FLOPs, time, spec and import.

References, none recomputed from the formula under test:

* the attended pairs by brute force over the mask Hugging Face builds (transformers
  ``masking_utils``: causal ``kv_idx <= q_idx`` and ``sliding_window_overlay`` ``kv_idx > q_idx - w``);
* Megatron-Bridge's GPT-OSS count (``training/utils/flop_utils.py::num_floating_point_operations``,
  commit 0494433): core attention per token ``2 * q * swa_context``, ``swa_context = W - W(W-1)/(2T)``;
* hand arithmetic for GPT-OSS-120B (64 heads of 64, q = 4096), written out below;
* the model card totals (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925,
  Table 1) for the presets.
"""

import json
from pathlib import Path

import pytest

from planner import cost, flops
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import ModelSpec, Plan, TrainingSpec

HF = Path(__file__).resolve().parent / "data" / "hf"
H100 = load_hardware("h100-sxm-80gb")
OSS = load_model("gpt-oss-120b")
NO_WINDOW = OSS.model_copy(update={"sliding_window": None, "sliding_window_layers": None})


def _brute_pairs(s: int, w: int) -> int:
    """(query, key) pairs the Hugging Face sliding-window causal mask keeps, one by one."""
    return sum(1 for q in range(s) for k in range(s) if k <= q and k > q - w)


@pytest.mark.parametrize("s", [1, 2, 3, 7, 16, 33])
@pytest.mark.parametrize("w", [1, 2, 5, 16, 32, 40])
def test_attended_pairs_against_the_mask(s, w):
    brute = _brute_pairs(s, w)
    if w < s:
        assert flops.attended_pairs(s, w) == brute
    else:  # the window covers every prefix: Megatron's causal s^2/2, the exact s(s+1)/2 less the diagonal half
        assert flops.attended_pairs(s, w) == brute - s / 2 == flops.attended_pairs(s)


def test_windowed_flops_of_gpt_oss_120b_by_hand():
    # a = 64 heads, d_qk + d_v = 64 + 64 = 128; s = 4096, w = 128:
    # pairs = 128*129/2 + (4096 - 128)*128 = 8256 + 507904 = 516160; per token 516160/4096 = 126.015625
    # windowed: 2 * 64 * 128 * 126.015625 = 2064640; full causal: 2 * 64 * 4096 * 128 / 2 = 33554432
    assert flops.attention_flops_per_token_per_layer(OSS, 4096, window=128) == 2064640
    assert flops.attention_flops_per_token_per_layer(OSS, 4096) == 33554432
    # 18 of 36 layers windowed: the mean is (2064640 + 33554432) / 2 = 17809536
    assert flops.mean_attention_flops_per_token_per_layer(OSS, 4096) == 17809536
    # Megatron-Bridge: forward core per token 2 * 2 * q * (W - W(W-1)/(2T)), q = 4096
    assert 4 * 4096 * (128 - 128 * 127 / (2 * 4096)) == 2064640


def test_model_flops_count_the_window_as_megatron_bridge_does():
    # 3 passes x 18 windowed layers x (33554432 - 2064640) fewer forward FLOPs per token
    saved = flops.model_flops_per_token(NO_WINDOW, 4096) - flops.model_flops_per_token(OSS, 4096)
    assert saved == 3 * 18 * (33554432 - 2064640)
    assert flops.model_flops_per_token(OSS, 4096, causal=False) == flops.model_flops_per_token(NO_WINDOW, 4096,
                                                                                             causal=False)


def test_window_at_least_the_sequence_is_full_attention():
    wide = OSS.model_copy(update={"sliding_window": 4096})
    assert flops.mean_attention_flops_per_token_per_layer(wide, 4096) == \
        flops.mean_attention_flops_per_token_per_layer(NO_WINDOW, 4096)
    tr, plan = _setup(4096)
    rates = cost.Rates.of(H100, "bf16")
    assert cost._attention_core_s(wide, tr, plan, rates) == cost._attention_core_s(NO_WINDOW, tr, plan, rates)


def _setup(seq, cp=1):
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=seq)
    return tr, Plan(tp=1, pp=1, dp=8 // cp, cp=cp, micro_batch_size=1)


@pytest.mark.parametrize("seq", [4096, 8192])
def test_windowed_attention_time_below_full(seq):
    tr, plan = _setup(seq)
    rates = cost.Rates.of(H100, "bf16")
    full = cost._attention_core_s(NO_WINDOW, tr, plan, rates)
    mixed = cost._attention_core_s(OSS, tr, plan, rates)
    every = cost._attention_core_s(OSS.model_copy(update={"sliding_window_layers": 36}), tr, plan, rates)
    assert every[0] < mixed[0] < full[0] and every[1] < mixed[1] < full[1]
    # half the layers windowed: their mean (the launches are counted once either way)
    assert mixed == pytest.approx(((full[0] + every[0]) / 2, (full[1] + every[1]) / 2), rel=1e-12)


def test_step_time_falls_with_the_window_and_materialised_attention_ignores_it():
    tr, plan = _setup(8192)
    # all 128 experts on each GPU: the MoE layer is host-bound (cost.moe_host_s), which would absorb the
    # saving; with no host cost the attention saving shows in the step
    hw = H100.model_copy(update={"host_launch_us": 0.0})
    assert cost.estimate_time(OSS, hw, tr, plan).step_time_s < cost.estimate_time(NO_WINDOW, hw, tr, plan).step_time_s
    mat = tr.model_copy(update={"attention": "materialized"})
    rates = cost.Rates.of(H100, "bf16")
    assert cost._attention_core_s(OSS, mat, plan, rates) == cost._attention_core_s(NO_WINDOW, mat, plan, rates)


def test_ring_attention_under_cp_is_not_windowed():
    """TE's p2p ring refuses sliding windows; the ring keeps the full causal count (an upper bound)."""
    tr, plan = _setup(8192, cp=2)
    assert cost.ring_attention(OSS, H100, tr, plan) == cost.ring_attention(NO_WINDOW, H100, tr, plan)


# --- spec and import ----------------------------------------------------------------------------

def test_spec_validation_one_line_each():
    base = OSS.model_dump()
    with pytest.raises(ValueError, match="sliding_window_layers: needs sliding_window"):
        ModelSpec(**base | {"sliding_window": None})
    with pytest.raises(ValueError, match=r"sliding_window_layers: 37 > num_layers\(36\)"):
        ModelSpec(**base | {"sliding_window_layers": 37})
    assert ModelSpec(**base | {"sliding_window_layers": None}).windowed_layers == 36  # a window alone: every layer
    assert NO_WINDOW.windowed_layers == 0


@pytest.mark.parametrize("name,layers,windowed", [("gpt-oss-120b.json", 36, 18), ("gpt-oss-20b.json", 24, 12)])
def test_hf_reads_layer_types(name, layers, windowed):
    data = json.loads((HF / name).read_text())
    assert data["layer_types"].count("sliding_attention") == windowed and len(data["layer_types"]) == layers
    spec = load_model(str(HF / name))
    assert (spec.sliding_window, spec.sliding_window_layers) == (128, windowed)


def _write(tmp_path, data):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_hf_defaults_and_refusals(tmp_path):
    data = json.loads((HF / "gpt-oss-20b.json").read_text())
    # GptOssConfig without layer_types: "sliding_attention" where (i + 1) % 2, i.e. layers 0, 2, 4 of 5
    five = {k: v for k, v in data.items() if k != "layer_types"} | {"num_hidden_layers": 5}
    assert load_model(_write(tmp_path, five)).sliding_window_layers == 3
    assert load_model(_write(tmp_path, data | {"sliding_window": None})).windowed_layers == 0
    for bad, text in [({"layer_types": ["sliding_attention"]}, "layer_types: 1 entries for num_hidden_layers 24"),
                      ({"layer_types": ["chunked"] * 24}, "layer_types: expected a list"),
                      ({"sliding_window": 0}, "sliding_window: expected a whole number >= 1")]:
        with pytest.raises(SpecError) as exc:
            load_model(_write(tmp_path, data | bad))
        assert len(exc.value.lines) == 1 and text in exc.value.lines[0]


@pytest.mark.parametrize("name,total,active", [("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)])
def test_presets_match_the_model_card_and_the_import(name, total, active):
    # Model card Table 1 (0.01B is its last digit); the card's active count leaves out the input
    # embedding, 201088 x 2880 (tests/test_hf_moe.py explains the split).
    preset = load_model(name)
    assert abs(preset.num_params - total) < 0.01e9
    assert abs(preset.num_active_params - 201088 * 2880 - active) < 0.01e9
    hf = load_model(str(HF / f"{name}.json"))
    assert hf.model_dump(exclude={"name"}) == preset.model_dump(exclude={"name"})


def test_hf_window_absent_is_the_class_default(tmp_path):
    # GptOssConfig: sliding_window 128, layer_types from (i + 1) % 2 (layers 0 and 2 of 3)
    data = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
            "num_hidden_layers": 3, "num_attention_heads": 8, "vocab_size": 1000}
    spec = load_model(_write(tmp_path, data))
    assert (spec.sliding_window, spec.sliding_window_layers) == (128, 2)
