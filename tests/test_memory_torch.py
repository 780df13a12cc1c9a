"""The estimator against real torch modules, on the CPU (see tests/torch_ref.py for the kernels' assumptions).

* parameter, gradient and Adam-state bytes of one TP rank's layer: exact;
* saved-activation bytes per layer and micro-batch (saved_tensors_hooks) for none / selective /
  full recompute: within 5 %;
* FLOPs of forward + backward (FlopCounterMode): within 1 %.
"""

import pytest

torch = pytest.importorskip("torch")

from planner import flops  # noqa: E402
from planner.memory import (GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES, layer_activation_terms,  # noqa: E402
                            layer_params_per_rank, saved_bytes_per_layer)
from planner.presets import load_model  # noqa: E402
from planner.specs import ModelSpec, Plan, TrainingSpec  # noqa: E402
from tests.torch_ref import RefLayer, layer_input, saved_activation_bytes  # noqa: E402

ACT_TOLERANCE = 0.05
FLOP_TOLERANCE = 0.01

GPT = ModelSpec(name="gpt-small", num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=512,
                max_seq_len=256, activation="gelu", norm="layernorm", position_embedding="learned",
                linear_bias=True, dropout=True)
LLAMA = ModelSpec(name="llama-small", num_layers=2, hidden_size=256, num_attention_heads=8, num_kv_heads=2,
                  ffn_hidden_size=688, vocab_size=512, activation="swiglu", norm="rmsnorm")
QWEN = LLAMA.model_copy(update={"name": "qwen-small", "qkv_bias": True, "num_kv_heads": 4})
MODELS = {"gpt-mha-gelu-dropout": GPT, "llama-gqa-swiglu": LLAMA, "qwen-qkv-bias": QWEN}


def _plan(tp, sp=False, recompute="none"):
    return Plan(tp=tp, pp=1, dp=1, micro_batch_size=2, sequence_parallel=sp, recompute=recompute)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_parameter_gradient_and_adam_bytes_exact(name, tp):
    model = MODELS[name]
    layer = RefLayer(model, tp=tp, dtype=torch.bfloat16)
    n = sum(p.numel() for p in layer.parameters())
    assert n == layer_params_per_rank(model, tp)
    assert sum(p.numel() * p.element_size() for p in layer.parameters()) == WEIGHT_BYTES * n
    # Megatron keeps fp32 main grads and an fp32 master copy that AdamW updates.
    master = [p.detach().float().requires_grad_() for p in layer.parameters()]
    for p in master:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(master, lr=1e-3)
    opt.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in master)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    master_bytes = sum(p.numel() * p.element_size() for p in master)
    assert grads == GRAD_BYTES * n
    assert master_bytes + state == OPTIMIZER_BYTES * n  # fp32 master + exp_avg + exp_avg_sq


@pytest.mark.parametrize("name,tp", [("llama3-70b", 8), ("llama3-8b", 2), ("gpt3-175b", 8), ("llama3-405b", 8)])
def test_real_shapes_on_meta_device(name, tp):
    model = load_model(name)
    layer = RefLayer(model, tp=tp, device="meta")
    assert sum(p.numel() for p in layer.parameters()) == layer_params_per_rank(model, tp)


CASES = [(name, tp, sp, rc, attn)
         for name in MODELS for tp in (1, 2, 4) for sp in (False, True) if not (sp and tp == 1)
         for rc in ("none", "selective", "full") for attn in ("flash", "materialized")]


@pytest.mark.parametrize("name,tp,sp,recompute,attention", CASES)
def test_saved_activation_bytes_within_5_percent(name, tp, sp, recompute, attention):
    torch.manual_seed(0)
    model, seq, batch = MODELS[name], 128, 2
    layer = RefLayer(model, tp=tp, sequence_parallel=sp, recompute=recompute, attention=attention)
    measured = saved_activation_bytes(layer, layer_input(model, seq, batch, tp, sp))
    training = TrainingSpec(num_gpus=tp, global_batch_size=batch, seq_len=seq, attention=attention)
    plan = Plan(tp=tp, pp=1, dp=1, micro_batch_size=batch, sequence_parallel=sp, recompute=recompute)
    predicted = saved_bytes_per_layer(layer_activation_terms(model, training, plan), recompute)
    assert abs(predicted / measured - 1) <= ACT_TOLERANCE, (predicted, measured)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_flops_within_1_percent(name, tp):
    from torch.utils.flop_counter import FlopCounterMode

    model, seq, batch = MODELS[name], 128, 2
    layer = RefLayer(model, tp=tp, attention="materialized", dtype=torch.float32)
    x = layer_input(model, seq, batch, tp, False, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    tokens = seq * batch
    # Non-causal attention: FlopCounterMode counts the full s x s matmuls.
    per_token = flops.gemm_flops_per_token_per_layer(model) + \
        flops.attention_flops_per_token_per_layer(model, seq, causal=False)
    predicted = flops.PASSES_TRAIN * tokens * per_token / tp
    if tp > model.kv_heads:  # replicated KV heads are computed on every rank
        predicted += flops.PASSES_TRAIN * tokens * 2 * model.hidden_size * 2 * model.kv_channels * \
            (1 - model.kv_heads / tp)
    assert abs(counter.get_total_flops() / predicted - 1) <= FLOP_TOLERANCE


@pytest.mark.parametrize("name,tp,sp,recompute", [("llama3-70b", 8, True, "none"), ("llama3-70b", 8, False, "selective"),
                                                  ("gpt3-175b", 8, True, "selective"), ("llama3-405b", 8, True, "full")])
def test_real_shapes_under_fake_tensor_mode(name, tp, sp, recompute):
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, seq = load_model(name), 8192 if name.startswith("llama") else 2048
    with FakeTensorMode():
        layer = RefLayer(model, tp=tp, sequence_parallel=sp, recompute=recompute)
        measured = saved_activation_bytes(layer, layer_input(model, seq, 1, tp, sp), backward=False)
    training = TrainingSpec(num_gpus=tp, global_batch_size=1, seq_len=seq)
    plan = Plan(tp=tp, pp=1, dp=1, micro_batch_size=1, sequence_parallel=sp, recompute=recompute)
    predicted = saved_bytes_per_layer(layer_activation_terms(model, training, plan), recompute)
    assert abs(predicted / measured - 1) <= ACT_TOLERANCE, (predicted, measured)
