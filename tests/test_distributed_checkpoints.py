"""Megatron's ``--distribute-saved-activations`` (``TrainingSpec.distribute_saved_activations``): under full
recompute each checkpoint keeps its rank's 1/tp share of the layer input and all-gathers it over TP before the
recompute (core_v0.16.1 ``tensor_parallel/random.py`` ``CheckpointFunction``). Megatron's own acceptance of the
emitted flag and its refusals are in tests/test_emit_consumers.py."""

from __future__ import annotations

import re

import pytest

from planner import comm
from planner.candidates import SearchSpace
from planner.cost import estimate_time
from planner.layout import axis_span
from planner.memory import estimate_memory, saved_bytes_per_layer_kind, stage_saved_bytes
from planner.presets import SpecError, load_hardware, load_model
from planner.search import exhaustive, search
from planner.specs import HardwareSpec, Plan, Scenario, TrainingSpec, plan_problems

GPT3 = load_model("gpt3-175b")  # h 12288, 96 layers
A100 = load_hardware("a100-80gb")


def _tr(distribute: bool, **kw) -> TrainingSpec:
    return TrainingSpec(**({"num_gpus": 1024, "global_batch_size": 1536, "seq_len": 2048,
                            "distribute_saved_activations": distribute} | kw))


def _plan(**kw) -> Plan:
    return Plan(**({"tp": 8, "pp": 16, "dp": 8, "micro_batch_size": 1, "recompute": "full"} | kw))


def test_a_checkpoint_keeps_one_tp_share_of_the_layer_input():
    """Full recompute keeps the layer input, 2 s b h bytes in bf16 without SP (Korthikanti et al. 2022,
    arXiv:2205.05198 Table 2); distributed, each TP rank keeps 2 s b h / t."""
    s, b, h, t = 2048, 1, GPT3.hidden_size, 8
    whole, _ = saved_bytes_per_layer_kind(GPT3, _tr(False), _plan())
    shared, _ = saved_bytes_per_layer_kind(GPT3, _tr(True), _plan())
    assert whole == 2 * s * b * h
    assert shared == 2 * s * b * h / t
    # rank 0 of 1F1B with pp 16: 16 micro-batches in flight, 6 layers each
    assert stage_saved_bytes(GPT3, _tr(True), _plan(), 192, 0, 6) == 16 * 6 * 2 * s * b * h / t
    # only the checkpoints are shared: no recompute keeps everything, as without the flag (and the rules refuse it)
    none = _plan(recompute="none")
    assert saved_bytes_per_layer_kind(GPT3, _tr(True), none) == saved_bytes_per_layer_kind(GPT3, _tr(False), none)


def test_the_backward_gathers_one_input_back_whole():
    """The recompute of a distributed checkpoint first gathers its input back whole, in place of its 1/t share
    (CheckpointFunction.backward): the working set grows by the other (t - 1)/t of one 2 s b h input."""
    from planner.memory import layer_recompute_working_bytes

    grown = layer_recompute_working_bytes(GPT3, _tr(True), _plan()) - layer_recompute_working_bytes(GPT3, _tr(False),
                                                                                                   _plan())
    assert grown == pytest.approx(7 / 8 * 2 * 2048 * GPT3.hidden_size)


def test_block_recompute_shares_only_the_checkpointed_layers():
    """--recompute-method block: the first K layers of a chunk are checkpoints (1/t of their input), the others
    keep everything (stage_saved_bytes mixes the two by specs.recomputed_share)."""
    plan = _plan(recompute_num_layers=2)
    kept_all = stage_saved_bytes(GPT3, _tr(False), _plan(recompute="none"), 192, 0, 6)
    ckpt = stage_saved_bytes(GPT3, _tr(True), _plan(), 192, 0, 6)
    assert stage_saved_bytes(GPT3, _tr(True), plan, 192, 0, 6) == pytest.approx(2 / 6 * ckpt + 4 / 6 * kept_all)


def test_the_gather_is_charged_once_per_layer_and_micro_batch():
    """The backward gathers each checkpoint's input (the whole 2 s b h) over the TP group before the recompute,
    on the compute stream: each stage pays it for each of its 6 layers and micro-batches, and 1F1B's step is
    (m + p - 1) stage passes (Narayanan et al. 2021, arXiv:2104.04473 section 2.2.1: the bubble (p - 1)(t_f + t_b)
    grows with the backward too)."""
    plan = _plan()
    off, on = estimate_time(GPT3, A100, _tr(False), plan), estimate_time(GPT3, A100, _tr(True), plan)
    group = axis_span(plan, "tp", A100.for_job(1024).nvlink_domain)
    gather = comm.collective_time_s("all_gather", 2 * 2048 * GPT3.hidden_size, group, A100.for_job(1024))
    m = 1536 // 8
    assert gather > 0
    assert on.step_time_s - off.step_time_s == pytest.approx((m + 16 - 1) * 6 * gather, rel=0.01)
    # and memory falls by what the checkpoints no longer keep
    assert estimate_memory(GPT3, A100, _tr(True), plan).peak_gib < estimate_memory(GPT3, A100, _tr(False), plan).peak_gib


@pytest.mark.parametrize("change,reason", [
    (dict(tp=1, dp=64), "needs tp > 1"),
    (dict(recompute="selective"), "applies to full recompute only"),
    (dict(sequence_parallel=True), "refuses it with sequence parallelism"),
])
def test_megatrons_rules(change, reason):
    """core_v0.16.1 arguments.py validate_args asserts tp > 1 and full granularity; TransformerConfig raises with SP."""
    assert plan_problems(GPT3, A100, _tr(False), _plan(**change)) == []
    assert any(reason in line for line in plan_problems(GPT3, A100, _tr(True), _plan(**change)))
    assert plan_problems(GPT3, A100, _tr(True), _plan()) == []


def test_other_frameworks_refuse_it():
    line = plan_problems(GPT3, A100, _tr(True, framework="torchtitan"), _plan())
    assert any(x.startswith("distribute_saved_activations: torchtitan has no") for x in line)


def _hw() -> HardwareSpec:
    return HardwareSpec(name="test", gpu_memory_gib=16, peak_bf16_tflops=300, hbm_bandwidth_gbps=2000,
                        gpus_per_node=8, intra_node_bandwidth_gbps=200, intra_node_latency_us=2,
                        inter_node_bandwidth_gbps=20, inter_node_latency_us=5, cuda_context_gib=0,
                        nccl_buffers_gib=0, fragmentation_headroom=0)


def test_search_keeps_to_the_rules_and_matches_exhaustive():
    """With the flag the search offers only plans Megatron runs it with (full recompute, tp > 1, no SP), and its
    optimum is the brute-force one."""
    model = load_model("llama2-7b")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096, distribute_saved_activations=True)
    res = search(model, _hw(), tr, SearchSpace())
    ref_plan, ref_t, _ = exhaustive(model, _hw(), tr, SearchSpace())
    assert res.best is not None and ref_plan is not None
    assert estimate_time(model, _hw(), tr, res.best).step_time_s == pytest.approx(ref_t, rel=1e-6)
    for p in [res.best, *res.alternatives]:
        assert p.recompute == "full" and p.tp > 1 and not p.sequence_parallel, p
        assert plan_problems(model, _hw(), tr, p) == []


def test_emit_and_check_round_trip(tmp_path):
    """The Megatron launch carries the flag and `check` reads it back: the same memory, stage by stage."""
    from planner.check import check_file
    from planner.emit import render_all
    from planner.memory import estimate_scenario_memory

    sc = Scenario(model=GPT3, hardware=A100, training=_tr(True), plan=_plan())
    text = render_all(sc, ["torchrun"])
    (name,) = [n for n in text if n.endswith(".sh")]
    assert re.search(r"--distribute-saved-activations\s", text[name])
    path = tmp_path / name
    path.write_text(text[name])
    result = check_file(path, A100, None, None)
    assert not result.errors, result.errors
    assert result.scenario.training.distribute_saved_activations
    assert estimate_scenario_memory(result.scenario).stages == estimate_scenario_memory(sc).stages
    for fmt in ("torchtitan", "deepspeed"):
        with pytest.raises(SpecError, match=f"--emit {fmt}: .*"):
            render_all(sc, [fmt])


# --- DeepSpeed's partition_activations (Megatron-DeepSpeed --deepspeed-activation-checkpointing --partition-activations)

def test_deepspeed_partitions_the_checkpointed_input_sequence_shard_too():
    """deepspeed 0.19.8 ``checkpointing.py`` ``partition_activations`` keeps numel / mp_size of each floating-point
    input of the checkpointed layer, whatever its shape: without SP 2 s b h / t, with SP the already split
    2 s b h / t a second time, 2 s b h / t^2 (Megatron refuses its own form with SP)."""
    s, b, h, t = 2048, 1, GPT3.hidden_size, 8
    ds = dict(framework="deepspeed")
    shared, _ = saved_bytes_per_layer_kind(GPT3, _tr(True, **ds), _plan())
    assert shared == 2 * s * b * h / t
    sp = _plan(sequence_parallel=True)
    assert saved_bytes_per_layer_kind(GPT3, _tr(True, **ds), sp)[0] == 2 * s * b * h / t**2
    assert saved_bytes_per_layer_kind(GPT3, _tr(False, **ds), sp)[0] == 2 * s * b * h / t
    # one TP rank: DeepSpeed's partition is the whole input (no rule refuses it, nothing changes)
    one = _plan(tp=1, dp=64)
    assert saved_bytes_per_layer_kind(GPT3, _tr(True, **ds), one) == saved_bytes_per_layer_kind(GPT3, _tr(False, **ds), one)
    assert not [x for x in plan_problems(GPT3, A100, _tr(True, **ds), one) if x.startswith("distribute_saved")]
    # Megatron's rules still hold for Megatron
    assert any(x.startswith("distribute_saved_activations: Megatron refuses it with sequence parallelism")
               for x in plan_problems(GPT3, A100, _tr(True), sp))
    assert not [x for x in plan_problems(GPT3, A100, _tr(True, **ds), sp) if x.startswith("distribute_saved")]
    # only full recompute is checkpointed by DeepSpeed's function
    assert any(x.startswith("distribute_saved_activations: applies to full recompute only")
               for x in plan_problems(GPT3, A100, _tr(True, **ds), _plan(recompute="selective")))


def test_deepspeed_gathers_the_partitions_back_before_the_recompute():
    """``get_full_inputs``: one all-gather of the checkpointed input over the model-parallel group per layer and
    micro-batch, as Megatron's ``gather_split_1d_tensor``: the same time term, sized by the input it is handed."""
    from planner.cost import distributed_checkpoint_gather_s

    ds = _tr(True, framework="deepspeed")
    sp = _plan(sequence_parallel=True)
    group = axis_span(sp, "tp", A100.nvlink_domain)
    input_bytes = 2 * 2048 * GPT3.hidden_size / 8  # the SP shard
    assert distributed_checkpoint_gather_s(ds, sp, input_bytes, group, A100) == pytest.approx(
        comm.collective_time_s("all_gather", input_bytes, group, A100))
    assert distributed_checkpoint_gather_s(_tr(False, framework="deepspeed"), sp, input_bytes, group, A100) == 0.0


def test_check_reads_megatron_deepspeeds_partition_activations(tmp_path):
    """A Megatron-DeepSpeed launch with --deepspeed-activation-checkpointing --partition-activations: Megatron-
    DeepSpeed's ``_configure_deepspeed_activation_checkpointing`` hands ``args.partition_activations`` to
    ``deepspeed.checkpointing.configure``; without --deepspeed-activation-checkpointing the flag does nothing."""
    from pathlib import Path

    from planner.check import check_file

    launch = Path(__file__).parent / "data" / "launch"
    src = (launch / "megatron_deepspeed_gpt_1.3B.sh").read_text()
    (tmp_path / "ds_config_gpt_1.3B.json").write_text((launch / "ds_config_gpt_1.3B.json").read_text())
    src = src.replace("mp_size=1", "mp_size=2").replace("num_node=2", "num_node=4")
    h100 = load_hardware("h100-sxm-80gb")
    for extra, want in [("--deepspeed-activation-checkpointing --partition-activations", True),
                        ("--partition-activations", False), ("--deepspeed-activation-checkpointing", False)]:
        path = tmp_path / f"ds_{len(extra)}.sh"
        path.write_text(src.replace('    --zero-stage 1"', f'    --zero-stage 1 {extra}"'))
        result = check_file(path, h100, None, None)
        assert not result.errors, result.errors
        assert result.scenario.training.framework == "deepspeed"
        assert result.scenario.training.distribute_saved_activations is want, extra
        assert result.scenario.plan.tp == 2 and result.scenario.plan.recompute == "full"
