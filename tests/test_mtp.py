"""Multi-token prediction (``ModelSpec.mtp_num_layers``): FLOPs as Megatron-LM counts them, the loss stage's
parameters, memory and time, and the job rules (DeepSeek-V3: arXiv:2412.19437 section 2.2; Megatron-Core
core_v0.16.1 ``multi_token_prediction.py``, ``training.py`` ``num_floating_point_operations``)."""

from __future__ import annotations

import pytest

from planner import flops
from planner.cost import estimate_time
from planner.memory import estimate_memory, mtp_param_split, stage_param_split
from planner.presets import load_hardware, load_model
from planner.specs import ModelSpec, Plan, TrainingSpec, job_problems

H100 = load_hardware("h100-sxm-80gb")
DENSE = ModelSpec(name="d", num_layers=8, hidden_size=1024, num_attention_heads=8, vocab_size=32000)


def test_flops_count_mtp_as_megatron_does():
    """Megatron-LM: ``num_layers + mtp_num_layers`` layers, ``+ mtp * (3h + 2h^2)`` FMAs for the norms and eh_proj,
    the logit term ``* (mtp + 1)``; all times 3 (forward and backward) x 2 (FMA)."""
    h, v, s = 1024, 32000, 2048
    with_mtp = DENSE.model_copy(update={"mtp_num_layers": 1})
    one_more_layer = DENSE.model_copy(update={"num_layers": 9})
    layer = flops.model_flops_per_token(one_more_layer, s) - flops.model_flops_per_token(DENSE, s)
    expected = layer + 6 * (3 * h + 2 * h * h) + 6 * h * v
    assert flops.model_flops_per_token(with_mtp, s) - flops.model_flops_per_token(DENSE, s) == pytest.approx(expected)
    # a stage without the output layer has no MTP either
    assert flops.model_flops_per_token(with_mtp, s, num_layers=4, logits=False) == \
        flops.model_flops_per_token(DENSE, s, num_layers=4, logits=False)


def test_mtp_params_sit_on_the_loss_stage_with_an_embedding_copy():
    """Per module: a layer of the last layer's kind, three norms, eh_proj 2h x h over TP; off the first stage
    also the word embedding (``gpt_model.py``: ``if self.pre_process or self.mtp_process``), untied models."""
    m = DENSE.model_copy(update={"mtp_num_layers": 1, "tied_embeddings": False})
    plan = Plan(tp=2, pp=2, dp=1, micro_batch_size=1)
    base = m.model_copy(update={"mtp_num_layers": 0})
    first, last = (stage_param_split(m, plan, r, 4)[0] - stage_param_split(base, plan, r, 4)[0] for r in (0, 1))
    assert first == 0
    h, norm = 1024, 2 * 1024  # LayerNorm (the default): weight and bias
    layer = 12 * h * h / 2 + 2 * norm  # QKV, proj, fc1 (4h), fc2 over TP 2, no biases; two norms, replicated
    vocab = 32000  # padded to a multiple of 128 x 2: 32000 already is
    assert last == layer + 3 * norm + 2 * h * h / 2 + vocab * h / 2
    assert mtp_param_split(m, plan, 0) == (layer + 3 * norm + 2 * h * h / 2, 0.0)


def test_deepseek_v3_mtp_costs_memory_and_time_on_the_last_stage_only():
    """The published PP16 layout (3 + 14 x 4 + 2): the MTP module adds to the last stage's weights, activations
    and per-micro-batch time; every other stage is unchanged."""
    m = load_model("deepseek-v3")
    assert m.mtp_num_layers == 1
    base = m.model_copy(update={"mtp_num_layers": 0})
    tr = TrainingSpec(num_gpus=2048, global_batch_size=4096, seq_len=4096)
    plan = Plan(tp=1, pp=16, dp=128, ep=64, micro_batch_size=1, zero_stage=1, recompute="full",
                layers_per_stage=(3,) + (4,) * 14 + (2,))
    mem, mem0 = estimate_memory(m, H100, tr, plan), estimate_memory(base, H100, tr, plan)
    assert [a.total_bytes for a in mem.stages[:-1]] == [b.total_bytes for b in mem0.stages[:-1]]
    assert mem.stages[-1].weights_bytes > mem0.stages[-1].weights_bytes
    assert mem.stages[-1].other_bytes > mem0.stages[-1].other_bytes
    t, t0 = estimate_time(m, H100, tr, plan), estimate_time(base, H100, tr, plan)
    assert [a.total for a in t.stages[:-1]] == [b.total for b in t0.stages[:-1]]
    assert t.stages[-1].total > t0.stages[-1].total
    assert t.step_time_s >= t0.step_time_s


def test_mtp_is_refused_where_the_framework_trains_none():
    m = load_model("deepseek-v3")
    for framework in ("torchtitan", "deepspeed"):
        tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, framework=framework)
        assert any(p.startswith(f"mtp_num_layers: {framework}") for p in job_problems(m, H100, tr))
    gpt = ModelSpec(name="g", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100,
                    position_embedding="learned", max_seq_len=128, mtp_num_layers=1)
    assert any(g.startswith("mtp_num_layers:") for g in gpt.megatron_gaps())  # arguments.py: rope or none only


def test_megatron_launch_carries_mtp_and_check_reads_it_back(tmp_path):
    """``--emit megatron`` writes ``--mtp-num-layers``; ``plan3d check`` reads it back (it used to refuse more
    than one MTP layer and to read one as none)."""
    from planner.check import check_file
    from planner.emit import render_all
    from planner.io import write_all
    from planner.specs import Scenario

    model = load_model("llama3-8b").model_copy(update={"mtp_num_layers": 2})
    sc = Scenario(model=model, hardware=H100, training=TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096),
                  plan=Plan(tp=2, pp=2, dp=2, micro_batch_size=1, sequence_parallel=True))
    (script,) = write_all(tmp_path, render_all(sc, ["megatron"]))  # the .megatron.args file
    assert "--mtp-num-layers 2" in " ".join(script.read_text().split())
    read = check_file(script, H100, None, None)
    assert not read.errors, read.errors
    assert read.scenario.model.mtp_num_layers == 2
    assert estimate_memory(read.scenario.model, H100, read.scenario.training, read.scenario.resolved_plan()) \
        .stages[-1].weights_bytes == estimate_memory(model, H100, sc.training, sc.resolved_plan()).stages[-1].weights_bytes
