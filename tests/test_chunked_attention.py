"""Chunked attention (Llama 4: ``ModelSpec.attention_chunk``, ``chunked_layers``): FLOPs, time, import, launch files.

A chunked layer's query attends causally within its own block of ``chunk`` tokens (transformers
``masking_utils.chunked_overlay``: key and query in the same block, on top of the causal mask). Expected values are
counted by hand here, not taken from the code under test.
"""

import json
from pathlib import Path

import pytest

from planner import cost, flops
from planner.emit import job_problems, render_all
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec

HF = Path(__file__).resolve().parent / "data" / "hf"
SCOUT = load_model("llama4-scout-17b-16e")


@pytest.mark.parametrize("seq, chunk, pairs", [
    (8, 4, 2 * 4 * 4 / 2),           # two full blocks of 4: 8 pairs each in the s^2/2 convention
    (10, 4, 2 * 8 + 2 * 2 / 2),      # and a last block of 2
    (8, 8, 8 * 8 / 2),               # a chunk as long as the sequence: causal
    (8, 16, 8 * 8 / 2),
])
def test_chunked_pairs(seq, chunk, pairs):
    assert flops.chunked_pairs(seq, chunk) == pairs


def test_llama4_attention_flops_over_its_chunked_and_global_layers():
    """36 of Scout's 48 layers attend within 8,192 tokens, 12 over the whole sequence: at 32K the mean attention is
    1/4 + 3/4 x 8192/32768 = 7/16 of full causal; at 8K and below exactly causal."""
    full = flops.attention_flops_per_token_per_layer(SCOUT, 32768)
    assert flops.mean_attention_flops_per_token_per_layer(SCOUT, 32768) == pytest.approx(full * 7 / 16)
    assert flops.mean_attention_flops_per_token_per_layer(SCOUT, 8192) == \
        flops.attention_flops_per_token_per_layer(SCOUT, 8192)


def test_chunked_layers_cost_their_chunks_only():
    """The attention core of one layer, averaged over the model's layers: at 32K the chunked model spends less than
    its unchunked twin (its chunked layers do 1/4 of the FLOPs at the 8K kernel speed); at 8K the two are equal."""
    twin = SCOUT.model_copy(update={"attention_chunk": None, "chunked_layers": None})
    plan = Plan(tp=8, pp=1, dp=1, micro_batch_size=1, sequence_parallel=True)
    rates = cost.Rates.of(load_hardware("h100-sxm-80gb"), "bf16")
    for seq, relation in ((32768, "less"), (8192, "equal")):
        tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=seq)
        chunked = cost._attention_core_s(SCOUT, tr, plan, rates)
        whole = cost._attention_core_s(twin, tr, plan, rates)
        if relation == "equal":
            assert chunked == pytest.approx(whole)
        else:
            assert chunked[0] < 0.6 * whole[0] and chunked[1] < 0.6 * whole[1]


def test_llama4_chunks_read_from_its_config(tmp_path):
    data = json.loads((HF / "llama4-scout-17b-16e.json").read_text())
    assert (SCOUT.attention_chunk, SCOUT.chunked_layers) == (8192, 36)  # the RoPE layers, 3 of every 4
    path = tmp_path / "config.json"
    # layer_types, where given, names them; no chunk size: no chunked layer
    path.write_text(json.dumps(data | {"layer_types": ["chunked_attention"] * 40 + ["full_attention"] * 8}))
    assert load_model(str(path)).chunked_layers == 40
    path.write_text(json.dumps(data | {"attention_chunk_size": None}))
    assert load_model(str(path)).attention_chunk is None
    path.write_text(json.dumps(data | {"no_rope_layer_interval": 2}))
    assert load_model(str(path)).chunked_layers == 24
    path.write_text(json.dumps(data | {"attention_chunk_size": "big"}))
    with pytest.raises(SpecError, match="attention_chunk_size: expected a positive whole number"):
        load_model(str(path))


@pytest.mark.parametrize("fields, message", [
    ({"chunked_layers": 2}, "chunked_layers: needs attention_chunk"),
    ({"attention_chunk": 64, "chunked_layers": 3, "sliding_window": 16, "sliding_window_layers": 2},
     "chunked_layers: 3 chunked and 2 windowed layers > num_layers(4)"),
    ({"attention_chunk": 64, "sliding_window": 16, "sliding_window_layers": 2}, "says how many layers are chunked"),
])
def test_bad_chunk_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(name="x", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100, **fields)


def test_megatron_launch_refused_past_the_chunk():
    """Megatron-LM core_v0.16.1 has no chunked attention: up to the chunk the launch is exact and written; past it
    the layers would attend over the whole sequence, so it is refused, before a search and when emitting."""
    plan = Plan(tp=8, pp=2, dp=4, ep=8, etp=1, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    hw = load_hardware("h100-sxm-80gb")
    short = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    long = short.model_copy(update={"seq_len": 32768})
    assert not job_problems(SCOUT, short, ["megatron"])
    assert render_all(Scenario(model=SCOUT, hardware=hw, training=short, plan=plan), ["megatron"])
    (line,) = job_problems(SCOUT, long, ["megatron", "slurm"])
    assert line.startswith("--format megatron: llama4-scout-17b-16e: 36 layers attend within 8192-token chunks")
    assert "--seq-len 8192 or less" in line
    with pytest.raises(SpecError, match="cannot express"):
        render_all(Scenario(model=SCOUT, hardware=hw, training=long, plan=plan), ["megatron"])
    assert not job_problems(SCOUT, long, ["plan"])
