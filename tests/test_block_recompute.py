"""Megatron's block recompute (``Plan.recompute_num_layers``): ``--recompute-method block --recompute-num-layers K``
recomputes the first K transformer layers of each model chunk and lets the others keep every activation
(Megatron-LM core_v0.16.1 ``transformer_block.py`` ``_checkpointed_forward``).

Oracles: hand composition from the per-layer terms; Megatron's own validate_args (tests/test_emit_consumers.py,
case ``block-recompute-vpp2``); torch itself on gloo (tests/test_validate.py, variant ``block-recompute``).
"""

from __future__ import annotations

import re

import pytest

from planner import flops
from planner.cost import estimate_time
from planner.memory import (estimate_memory, layer_activation_terms, layer_recompute_working_bytes,
                            saved_bytes_per_layer, stage_saved_bytes)
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec, plan_problems, recomputed_share

H100 = load_hardware("h100-sxm-80gb")
L70 = load_model("llama3-70b")


def _plan(**kw) -> Plan:
    base = dict(tp=8, pp=1, dp=8, micro_batch_size=1, recompute="full", sequence_parallel=True, zero_stage=1)
    return Plan(**(base | kw))


def test_shares_by_hand():
    # 10 layers in 2 chunks of 5, K = 3: 6 of 10 recomputed; each chunk 3/5
    assert recomputed_share(10, 2, False, "full", 3) == (0.6, 0.6)
    # 7 layers in chunks (4, 3) (the longer first off rank 0, specs.stage_chunks), K = 3: 6 of 7; chunk shares 3/4, 1
    assert recomputed_share(7, 2, False, "full", 3) == (6 / 7, 0.75)
    # rank 0 puts the shorter first, and an empty (embedding-only) chunk recomputes nothing and holds nothing
    assert recomputed_share(7, 8, True, "full", 1) == (1.0, 1.0)
    assert recomputed_share(10, 2, False, "full", None) == (1.0, 1.0)
    assert recomputed_share(10, 2, False, "full", 5) == (1.0, 1.0)  # K >= the chunk: every layer, as uniform
    assert recomputed_share(10, 2, False, "selective", None) == (0.0, 0.0)


def test_needs_full_recompute_and_a_framework_that_runs_it():
    with pytest.raises(ValueError, match="recompute_num_layers: .*needs recompute full"):
        _plan(recompute="selective", recompute_num_layers=2)
    tr = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    for fw, refused in (("megatron", False), ("nemo", False), ("torch", False), ("torchtitan", True),
                        ("deepspeed", True)):
        lines = plan_problems(L70, H100, tr.model_copy(update={"framework": fw}), _plan(recompute_num_layers=2))
        assert any(line.startswith("recompute_num_layers:") for line in lines) == refused, (fw, lines)


def test_saved_activations_are_the_kept_layers_plus_the_recomputed_inputs():
    """pp 1, one micro-batch in flight: K layers keep their input only (full recompute's bytes per layer), the other
    L - K everything (no recompute's), composed by hand from the per-layer terms."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=1, seq_len=8192)
    plan = _plan(dp=1, recompute_num_layers=30)
    terms = layer_activation_terms(L70, tr, plan, moe=False)
    by_hand = 30 * saved_bytes_per_layer(terms, "full") + 50 * saved_bytes_per_layer(terms, "none")
    assert stage_saved_bytes(L70, tr, plan, 1, 0, 80) == pytest.approx(by_hand)
    # and on top of them at most one layer's recompute working set, as under full recompute (the part above the
    # loss spike counts on this one stage that also holds the output layer: memory.layer_phase_bytes)
    act = estimate_memory(L70, H100, tr, plan).stages[0].activations_bytes
    assert by_hand <= act <= by_hand + layer_recompute_working_bytes(L70, tr, plan)


def test_interleaved_chunks_each_recompute_their_first_k():
    """pp 4, vpp 2 (chunks of 10 layers), K = 3: each in-flight chunk holds 3 inputs and 7 full layers."""
    tr = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    m = 64 // 2
    plan = _plan(pp=4, dp=2, vpp=2, recompute_num_layers=3)
    full, none = plan.model_copy(update={"recompute_num_layers": None}), plan.model_copy(
        update={"recompute_num_layers": None, "recompute": "none"})
    for r in range(4):
        got = stage_saved_bytes(L70, tr, plan, m, r, 20)
        want = 0.3 * stage_saved_bytes(L70, tr, full, m, r, 20) + 0.7 * stage_saved_bytes(L70, tr, none, m, r, 20)
        assert got == pytest.approx(want)


def test_time_recomputes_the_share_of_the_layers():
    tr = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    plan = _plan(pp=4, dp=2, vpp=2, recompute_num_layers=3)
    t = estimate_time(L70, H100, tr, plan)
    t_full = estimate_time(L70, H100, tr, plan.model_copy(update={"recompute_num_layers": None}))
    t_none = estimate_time(L70, H100, tr, plan.model_copy(update={"recompute_num_layers": None, "recompute": "none"}))
    assert t.breakdown["recompute"] == pytest.approx(0.3 * t_full.breakdown["recompute"])
    assert t_none.step_time_s < t.step_time_s < t_full.step_time_s
    # K at least the chunk's layers is full recompute, term for term
    assert estimate_time(L70, H100, tr, plan.model_copy(update={"recompute_num_layers": 10})).breakdown == \
        pytest.approx(t_full.breakdown)
    # hardware FLOPs: the model's plus 6 of every 20 layers' forward again (PaLM appendix B)
    from planner.cost import recomputed_layers_share

    assert recomputed_layers_share(L70, plan) == pytest.approx(0.3)
    for rc in ("selective", "full"):  # the recompute counted whole otherwise
        assert recomputed_layers_share(L70, plan.model_copy(update={"recompute": rc, "recompute_num_layers": None})) == 1
    hf = flops.hardware_flops_per_step(L70, 64, 8192, "full", 0.3)
    mf = flops.model_flops_per_step(L70, 64, 8192)
    assert hf - mf == pytest.approx(0.3 * (flops.hardware_flops_per_step(L70, 64, 8192, "full") - mf))


def _emit_and_check(tmp_path, sc: Scenario, formats: list[str], method: str, n: int) -> int:
    """Emit ``sc`` in ``formats``, check that each launch carries ``--recompute-method METHOD
    --recompute-num-layers N`` and that `check` reads back the same plan and memory; the launches checked."""
    from planner.check import check_file
    from planner.emit import render_all
    from planner.memory import estimate_scenario_memory

    checked = 0
    for name, text in render_all(sc, formats).items():
        if name.endswith(".plan.json"):
            continue
        assert re.search(rf"--recompute-method\s+{method}\s+--recompute-num-layers\s+{n}\s", text), name
        path = tmp_path / name
        path.write_text(text)
        result = check_file(path, H100, None, None)
        assert not result.errors, result.errors
        assert result.scenario.resolved_plan() == sc.resolved_plan()
        assert estimate_scenario_memory(result.scenario).stages == estimate_scenario_memory(sc).stages
        checked += 1
    return checked


def test_emit_and_check_round_trip(tmp_path):
    from planner.emit import render_all

    tr = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    sc = Scenario(model=L70, hardware=H100, training=tr, plan=_plan(pp=4, dp=2, vpp=2, recompute_num_layers=3))
    assert _emit_and_check(tmp_path, sc, ["megatron", "torchrun"], "block", 3) == 2
    for fmt in ("torchtitan", "deepspeed"):
        with pytest.raises(SpecError, match=f"--emit {fmt}: .*block recompute"):
            render_all(sc, [fmt])


# --- Megatron's uniform method in groups of N > 1 (Plan.recompute_group_layers) -------------------------------

def test_uniform_groups_keep_one_input_per_group_and_recompute_a_group_at_once():
    """--recompute-method uniform --recompute-num-layers N (core_v0.16.1 transformer_block.py _checkpointed_forward:
    ``checkpoint_handler(custom(layer_idx, layer_idx + N))``): a chunk of 20 layers in groups of 3 keeps ceil(20/3)
    = 7 inputs, and the backward of a group holds its 3 layers' recomputed tensors and its 2 inner layers' inputs
    on top. Composed by hand from the per-layer terms, stage 1 of pp 4 (no loss, ZeRO 1: no other working set)."""
    from planner.memory import recompute_working_bytes, stage_memory

    tr = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    plan = _plan(pp=4, dp=2, recompute_group_layers=3)
    m = 64 // 2
    terms = layer_activation_terms(L70, tr, plan, moe=False)
    inp, one = saved_bytes_per_layer(terms, "full"), recompute_working_bytes(terms, "full")
    in_flight = 4 - 1  # 1F1B on rank 1 of 4: p - r micro-batches
    assert stage_saved_bytes(L70, tr, plan, m, 1, 20) == pytest.approx(in_flight * 7 * inp)
    assert layer_recompute_working_bytes(L70, tr, plan) == pytest.approx(3 * one + 2 * inp)
    st = stage_memory(L70, tr, plan, m, 1, 20)
    assert st.activations_bytes == pytest.approx(in_flight * 7 * inp + 3 * one + 2 * inp)
    # a group longer than the chunk is the chunk
    assert layer_recompute_working_bytes(L70, tr, plan.model_copy(update={"recompute_group_layers": 50})) == \
        pytest.approx(20 * one + 19 * inp)
    # time: every layer recomputed once, as in groups of one
    ones = plan.model_copy(update={"recompute_group_layers": None})
    assert estimate_time(L70, H100, tr, plan).breakdown == pytest.approx(estimate_time(L70, H100, tr, ones).breakdown)


def test_uniform_groups_rules_and_refusals():
    with pytest.raises(ValueError, match="recompute_group_layers: .*needs recompute full"):
        _plan(recompute="selective", recompute_group_layers=2)
    with pytest.raises(ValueError, match="recompute_group_layers: .*exclude each other"):
        _plan(recompute_group_layers=2, recompute_num_layers=1)
    tr = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    for fw, refused in (("megatron", False), ("nemo", False), ("torch", True), ("torchtitan", True),
                        ("deepspeed", True)):
        lines = plan_problems(L70, H100, tr.model_copy(update={"framework": fw}), _plan(recompute_group_layers=2))
        assert any(line.startswith("recompute_group_layers:") for line in lines) == refused, (fw, lines)
    from planner.emit import render_all
    from planner.validate.launch import refusal

    sc = Scenario(model=L70, hardware=H100, training=tr, plan=_plan(pp=4, dp=2, recompute_group_layers=2))
    for fmt in ("torchtitan", "deepspeed"):
        with pytest.raises(SpecError, match=f"--emit {fmt}: .*groups of 2"):
            render_all(sc, [fmt])
    assert "recompute_group_layers=2" in refusal(sc)


def test_uniform_groups_emit_and_check_round_trip(tmp_path):
    tr = TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=8192)
    sc = Scenario(model=L70, hardware=H100, training=tr, plan=_plan(pp=4, dp=2, recompute_group_layers=4))
    assert _emit_and_check(tmp_path, sc, ["megatron", "torchrun"], "uniform", 4) == 2
