"""Which frameworks run TP wider than the KV heads (each KV head replicated) and which refuse it at startup.

Megatron-Core replicates them (core_v0.16.1 ``attention.py``: ``num_query_groups < world_size`` gathers the QKV
output); torchtitan 0.3.0 raises "tensor_parallel_degree ... must divide n_kv_heads" (``models/common/decoder.py``,
checked below on the installed library); Megatron-DeepSpeed's ``ParallelAttention`` divides the KV heads by tp."""

import pytest

from planner import frameworks
from planner.candidates import SearchSpace, shapes
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec, plan_problems

QWEN3_30B = "qwen3-30b-a3b"  # 32 query heads, 4 KV heads


def _job(framework: str, tp: int):
    model, hw = load_model(QWEN3_30B), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=64, global_batch_size=256, seq_len=4096, framework=framework)
    plan = Plan(tp=tp, pp=1, dp=64 // tp, micro_batch_size=1, zero_stage=3 if framework == "torchtitan" else 1,
                sequence_parallel=tp > 1, ep=1)
    return model, hw, tr, plan


@pytest.mark.parametrize("framework", ["torchtitan", "deepspeed"])
def test_tp_wider_than_the_kv_heads_is_refused_where_the_framework_refuses_it(framework):
    model, hw, tr, plan = _job(framework, 8)
    problems = [p for p in plan_problems(model, hw, tr, plan) if p.startswith("tp:")]
    assert problems and "must divide num_kv_heads" in problems[0] and "use tp 1 or 2 or 4" in problems[0]
    model, hw, tr, plan = _job(framework, 4)
    assert not [p for p in plan_problems(model, hw, tr, plan) if p.startswith("tp:")]


def test_megatron_replicates_the_kv_heads():
    model, hw, tr, plan = _job("megatron", 8)
    assert not [p for p in plan_problems(model, hw, tr, plan) if p.startswith("tp:")]


@pytest.mark.parametrize("framework,widest", [("torchtitan", 4), ("megatron", 8)])
def test_search_offers_only_the_tp_the_framework_runs(framework, widest):
    model, hw, tr, _ = _job(framework, 1)
    assert max(sh[0] for sh in shapes(model, hw, tr, SearchSpace())) == widest


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_torchtitans_own_check_agrees_with_the_profile(tp):
    """torchtitan's Qwen3-30B-A3B model config (its registry's "30B-A3B") run through its own update_from_config
    with tensor_parallel_degree tp: it raises exactly where the profile refuses."""
    pytest.importorskip("torchtitan")
    from types import SimpleNamespace

    from torchtitan.config import ParallelismConfig
    from torchtitan.models.qwen3 import model_registry

    config = SimpleNamespace(parallelism=ParallelismConfig(tensor_parallel_degree=tp))
    try:
        model_registry("30B-A3B").model.update_from_config(config=config)
        runs = True
    except ValueError as e:
        assert "must divide n_kv_heads" in str(e)
        runs = False
    assert runs == frameworks.get("torchtitan").allows_tp(tp, load_model(QWEN3_30B))


def _mqa_like(framework: str = "megatron", tp: int = 4):
    """A Llama-shaped model with 2 KV heads at TP 4: each rank holds half a KV head's share of the fused QKV."""
    from planner.specs import ModelSpec

    model = ModelSpec(name="gqa2", num_layers=4, hidden_size=4096, num_attention_heads=32, num_kv_heads=2,
                      ffn_hidden_size=14336, vocab_size=32000, activation="swiglu", norm="rmsnorm",
                      position_embedding="rope", tied_embeddings=False, linear_bias=False)
    hw = load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, framework=framework)
    plan = Plan(tp=tp, pp=1, dp=8 // tp, micro_batch_size=1, sequence_parallel=True)
    return model, hw, tr, plan


def test_megatrons_qkv_gather_by_hand():
    """Megatron all-gathers the QKV output (forward) and reduce-scatters its gradient (backward) when tp > KV heads:
    4,096 tokens x (32 x 128 + 2 x 2 x 128) x 2 B = 37.7 MB each way, over the TP group."""
    from planner import comm
    from planner.cost import replicated_kv_gather_s
    from planner.layout import axis_span

    model, hw, tr, plan = _mqa_like()
    group = axis_span(plan, "tp", hw.nvlink_domain)
    nbytes = 4096 * (32 * 128 + 2 * 2 * 128) * 2
    assert replicated_kv_gather_s(model, hw, tr, plan, 4096, group) == pytest.approx(
        (comm.collective_time_s("all_gather", nbytes, group, hw), comm.collective_time_s("reduce_scatter", nbytes,
                                                                                            group, hw)))
    for m, _, t, p in (_mqa_like(tp=2), _mqa_like("torch")):  # tp <= KV heads; plan3d validate's miniature
        assert replicated_kv_gather_s(m, hw, t, p, 4096, group) == (0.0, 0.0)


def test_the_gather_is_in_the_layers_tp_time(monkeypatch):
    from planner import cost

    model, hw, tr, plan = _mqa_like()
    with_gather = cost.layer_time(model, hw, tr, plan)
    f, b = cost.replicated_kv_gather_s(model, hw, tr, plan, 4096, cost.axis_span(plan, "tp", hw.nvlink_domain))
    monkeypatch.setattr(cost, "replicated_kv_gather_s", lambda *a: (0.0, 0.0))
    without = cost.layer_time(model, hw, tr, plan)
    assert (with_gather.tp_fwd - without.tp_fwd, with_gather.tp_bwd - without.tp_bwd) == pytest.approx((f, b))
    assert f > 0 and with_gather.fwd_compute == without.fwd_compute
