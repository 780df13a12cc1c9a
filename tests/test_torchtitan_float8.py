"""torchtitan's float8 (torchao) as its converter swaps it in (issue 13): what a Llama block saves for backward with
torchao's own Float8Linear, measured by torch on this CPU (planner/compile_probe.py), against plan3d's model.

Transformer Engine saves a GEMM input in fp8 for the weight gradient; torchao saves the 16-bit input and casts again
in backward (``matmul_with_hp_or_float8_args``), so plan3d counted a torchtitan fp8 job's GEMM inputs at half their
size before 2026-12-04 (Llama-3-8B, 8 GPUs, 8K tokens, no AC: 4.5 GiB too little, a false pass). Measured values come
from torch and torchao; the expected values are the model's terms (planner/memory.py), not derived from the
measurement. The recipes: rowwise (torchtitan 0.3.0 ``Float8LinearConverter``'s default) and tensorwise.
"""

import pytest

from planner.memory import layer_activation_terms, saved_bytes_per_layer
from planner.presets import load_model
from planner.specs import ModelSpec, Plan, TrainingSpec

torch = pytest.importorskip("torch")
pytest.importorskip("torchao", reason="torchao (requirements-consumers.txt, torchtitan's float8 converters) is "
                    "not installed")

# (b, s, h, heads, kv_heads, f, head_dim): MHA and GQA, a second batch, and heads wider than h / heads (so the
# out-projection input is not h wide: which GEMM inputs the compiled graph recomputes is then visible)
SHAPES = [(1, 256, 256, 8, 8, 768, None), (2, 256, 256, 8, 2, 768, None), (1, 256, 256, 8, 2, 768, 64)]
IDS = ["mha", "gqa-b2", "gqa-wide-heads"]


def _model(b, s, h, heads, kv, f, head_dim, recompute, precision, compiled):
    model = ModelSpec(name="probe", num_layers=2, hidden_size=h, num_attention_heads=heads, num_kv_heads=kv,
                      ffn_hidden_size=f, vocab_size=4096, activation="swiglu", norm="rmsnorm", head_dim=head_dim)
    tr = TrainingSpec(num_gpus=1, global_batch_size=b, seq_len=s, framework="torchtitan", compile=compiled,
                      precision=precision)
    return saved_bytes_per_layer(layer_activation_terms(model, tr, Plan(tp=1, pp=1, dp=1, micro_batch_size=b)),
                                 recompute)


def _measured(shape, recompute, compile, float8):
    from planner.compile_probe import block_saved_bytes

    b, s, h, heads, kv, f, head_dim = shape
    return block_saved_bytes(recompute, compile, b=b, s=s, h=h, heads=heads, kv_heads=kv, f=f, head_dim=head_dim,
                             float8=float8)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_eager_float8_block_saves_what_the_bf16_block_saves(shape, recipe):
    """Eager, no AC: torchao keeps the 16-bit GEMM inputs, so the float8 block saves byte for byte what the bf16
    block saves, and so does the model (where TE's 1-byte inputs would be less). The eager count itself is not
    compared with the model here: eager RMSNorm is decomposed on the CPU (planner/compile_probe.py docstring; the
    model's eager terms are the CUDA kernels')."""
    assert _measured(shape, "none", None, recipe) == _measured(shape, "none", None, None)
    assert _model(*shape, "none", "fp8", compiled=False) == _model(*shape, "none", "bf16", compiled=False)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_compiled_float8_block_recomputes_the_norm_outputs_and_the_swiglu_product(shape):
    """Compiled (inductor), no AC: the partitioner does not save the two norm outputs (h wide) and the SwiGLU
    product; the out-projection input (heads x head_dim wide) stays. Compared as the difference from the bf16 block
    for every shape; whole for MHA, since with GQA the probe's block repeats K and V before SDPA as torchtitan
    9dec370 did, which the model does not (tests/test_torchtitan_compile.py)."""
    b, s, h, heads, kv, f, head_dim = shape
    measured = _measured(shape, "none", "inductor", "rowwise")
    drop = _measured(shape, "none", "inductor", None) - measured
    assert drop == _model(*shape, "none", "bf16", compiled=True) - _model(*shape, "none", "fp8", compiled=True)
    assert drop == b * s * (2 * h + f) * 2
    if kv == heads:
        assert measured == _model(*shape, "none", "fp8", compiled=True)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=IDS[1:])
def test_compiled_float8_block_under_op_sac_keeps_two_rowwise_scales_more(shape):
    b, s = shape[:2]
    measured = _measured(shape, "selective", "inductor", "rowwise")
    assert measured == _model(*shape, "selective", "fp8", compiled=True)
    assert measured - _measured(shape, "selective", "inductor", None) == 2 * b * s * 4


def test_compiled_float8_block_under_full_ac_keeps_its_input():
    shape = SHAPES[1]
    b, s, h = shape[:3]
    assert _measured(shape, "full", "inductor", "rowwise") == _model(*shape, "full", "fp8", compiled=True) == b * s * h * 2


def test_torchtitan_fp8_keeps_16_bit_gemm_inputs_where_megatron_keeps_fp8():
    """The same Llama-3-8B layer: under torchtitan fp8 saves as much as bf16 (eager); under Megatron (TE) less."""
    model = load_model("llama3-8b")
    plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=1)

    def saved(framework, precision):
        tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192, framework=framework, precision=precision)
        return saved_bytes_per_layer(layer_activation_terms(model, tr, plan), "none")

    assert saved("torchtitan", "fp8") == saved("torchtitan", "bf16")
    assert saved("megatron", "fp8") < saved("megatron", "bf16")  # TE's fp8 copies (tests/test_memory_*.py)
