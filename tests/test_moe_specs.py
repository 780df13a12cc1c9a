"""MoE and MLA specs: parameter counts against the published totals and the Hugging Face checkpoints.

Goldens (total / activated parameters, as the publishers state them):
* Mixtral-8x7B: 46.7B / 12.9B (Mistral AI release post 2023-12-11; Jiang et al. 2024, arXiv:2401.04088);
  the exact total 46,702,792,704 is the Hugging Face checkpoint's (mistralai/Mixtral-8x7B-v0.1 model card).
* Mixtral-8x22B: 141B / 39B (Mistral AI release post 2024-04-17).
* DeepSeek-V3: 671B / 37B (arXiv:2412.19437, abstract; main model without the 14B MTP module).
* Qwen3-235B-A22B: 235B / 22B; Qwen3-30B-A3B: 30.5B / 3.3B (arXiv:2505.09388, Table 2).
The published figures are rounded: the tolerance is half a unit of their last digit plus 1 %.
"""

import pytest

from planner import flops
from planner.presets import load_model
from planner.specs import ModelSpec, Plan

GOLDENS = [  # name, total (B), active (B), last published digit (B)
    ("mixtral-8x7b", 46.7, 12.9, 0.1),
    ("mixtral-8x22b", 141, 39, 1),
    ("deepseek-v3", 671, 37, 1),
    ("qwen3-235b-a22b", 235, 22, 1),
    ("qwen3-30b-a3b", 30.5, 3.3, 0.1),
]


@pytest.mark.parametrize("name,total,active,unit", GOLDENS)
def test_published_parameter_counts(name, total, active, unit):
    m = load_model(name)
    for got, want in ((m.num_params / 1e9, total), (m.num_active_params / 1e9, active)):
        assert abs(got - want) <= unit / 2 + 0.01 * want, (name, got, want)


def test_mixtral_exact_checkpoint_count():
    assert load_model("mixtral-8x7b").num_params == 46_702_792_704


def test_dense_model_unchanged_by_moe_fields():
    m = load_model("llama3-70b")
    assert not m.is_moe and m.num_active_params == m.num_params == 70_553_706_496


def test_moe_flops_count_activated_experts():
    m = load_model("mixtral-8x7b")
    dense_twin = m.model_copy(update={"num_experts": None, "top_k": 2})
    # top-2 routing: the MLP GEMMs of a layer are twice a dense MLP's; the 4096 x 8 router is not counted, as
    # Megatron-LM's num_floating_point_operations does not count it (tests/test_megatron_params.py runs it)
    extra = flops.gemm_flops_per_token_per_layer(m) - flops.gemm_flops_per_token_per_layer(dense_twin)
    assert extra == 2 * 3 * 4096 * 14336
    # Model FLOPs per token ~ 6 x active parameters (no embedding lookups) at short sequences.
    per_token = flops.model_flops_per_token(m, 128)
    assert per_token == pytest.approx(6 * (m.num_active_params - 32000 * 4096), rel=0.02)


def test_mla_attention_flops_use_qk_and_v_widths():
    m = load_model("deepseek-v3")
    # 2 * a * s * (d_qk + d_v) / 2 for causal attention: 128 heads, 192 + 128 wide.
    assert flops.attention_flops_per_token_per_layer(m, 4096) == 2 * 128 * 4096 * (192 + 128) / 2


def test_dense_first_layers_counted_per_stage():
    m = load_model("deepseek-v3")
    plan = Plan(tp=1, pp=16, dp=128, ep=64, micro_batch_size=1, layers_per_stage=(4,) * 15 + (1,))
    assert plan.stage_moe_layers(m) == (1,) + (4,) * 14 + (1,)
    interleaved = Plan(tp=1, pp=2, dp=1, vpp=2, micro_batch_size=1)
    tiny = load_model("tiny-moe")  # layer 0 dense; chunks: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
    assert interleaved.stage_moe_layers(tiny) == (1, 2)


@pytest.mark.parametrize("fields,message", [
    ({"num_experts": 8, "top_k": 9}, "top_k: 9 > num_experts(8)"),
    ({"moe_ffn_hidden_size": 128}, "moe_ffn_hidden_size: applies to MoE models only"),
    ({"kv_lora_rank": 512}, "kv_lora_rank: MLA needs"),
    ({"num_experts": 8, "first_k_dense": 4}, "first_k_dense: 4 leaves no MoE layer"),
])
def test_bad_moe_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(name="x", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100, **fields)


def test_moe_flops_reproduce_the_modelzoo_tflops_per_gpu():
    """Golden: NVIDIA's Megatron-MoE-ModelZoo prints, for five H100 runs of Qwen3-235B-A22B (bf16, 4096 tokens,
    global batch 2048 on 256 GPUs), both the step time and the TFLOP/s per GPU its Megatron-LM counted
    (github.com/yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md @ 020b8136, copied into
    benchmarks/data/megatron_moe_modelzoo.json). plan3d's model FLOPs per token over each step time give the same
    TFLOP/s within 2 % (the page rounds step times to 0.1 s: up to 0.6 % at 17.6 s)."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent.parent / "benchmarks/data/megatron_moe_modelzoo.json").read_text())
    m = load_model("qwen3-235b-a22b")
    rows = [r for r in data["runs"] if r["step_time_s"]]
    assert len(rows) == 5
    for r in rows:
        tflops = r["gbs"] * r["seq"] * flops.model_flops_per_token(m, r["seq"]) / (r["step_time_s"] * r["gpus"]) / 1e12
        assert tflops == pytest.approx(r["tflops_per_gpu"], rel=0.02), r["name"]


def test_moe_layer_pattern_counts_layers_stages_and_parameters():
    """``moe_layer_pattern``: experts where the pattern has 1s, dense MLPs of ffn_hidden_size elsewhere, counted per
    pipeline rank as the schedule places its chunks."""
    tiny = load_model("tiny-moe")  # 4 layers, layer 0 dense
    alt = tiny.model_copy(update={"first_k_dense": 0, "moe_layer_pattern": (1, 0, 1, 0)})
    assert alt.num_moe_layers == 2 and [alt.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    dense, moe = alt.layer_params(False), alt.layer_params(True)
    assert alt.num_params - tiny.num_params == (2 * dense + 2 * moe) - (1 * dense + 3 * moe)
    assert Plan(tp=1, pp=2, dp=1, micro_batch_size=1).stage_moe_layers(alt) == (1, 1)
    # interleaved, one layer per chunk: rank 0 holds layers 0 and 2 (both MoE), rank 1 layers 1 and 3 (dense)
    assert Plan(tp=1, pp=2, dp=1, vpp=2, micro_batch_size=1).stage_moe_layers(alt) == (2, 0)
    assert alt.mtp_is_moe() is False  # the last layer's kind


@pytest.mark.parametrize("fields,message", [
    ({"moe_layer_pattern": (1, 0, 1)}, "moe_layer_pattern: 3 entries for num_layers(4)"),
    ({"moe_layer_pattern": (0, 0, 0, 0)}, "moe_layer_pattern: no layer has experts"),
    ({"moe_layer_pattern": (0, 1, 0, 1), "first_k_dense": 1}, "first_k_dense: give the dense layers in"),
    ({"moe_layer_pattern": (0, 2, 0, 1)}, "moe_layer_pattern"),
])
def test_bad_moe_layer_patterns_are_named(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(name="x", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100, num_experts=8,
                  **fields)


def test_moe_layer_pattern_applies_to_moe_models_only():
    with pytest.raises(ValueError, match="moe_layer_pattern: applies to MoE models only"):
        ModelSpec(name="x", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100,
                  moe_layer_pattern=(0, 1))


@pytest.mark.parametrize("fields,message", [
    ({"router_num_groups": 4}, "router_num_groups: group-limited routing needs router_num_groups and"),
    ({"router_group_topk": 2}, "router_num_groups: group-limited routing needs"),
    ({"router_num_groups": 3, "router_group_topk": 1}, "router_num_groups: 3 does not divide num_experts(8)"),
    ({"router_num_groups": 4, "router_group_topk": 5}, "router_group_topk: 5 > router_num_groups(4)"),
])
def test_bad_routing_groups_are_named(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(name="x", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100, num_experts=8,
                  **fields)


def test_deepseek_v3_routes_each_token_to_four_of_eight_groups():
    """Node-limited routing (arXiv:2412.19437 section 2.1.2, config.json n_group 8 / topk_group 4); no parameters."""
    m = load_model("deepseek-v3")
    assert (m.router_num_groups, m.router_group_topk) == (8, 4)
    assert m.num_params == m.model_copy(update={"router_num_groups": None, "router_group_topk": None}).num_params
