"""``plan3d check`` reads what a Megatron-DeepSpeed launch's DeepSpeed config sets for the engine's own buffers and
optimizer (planner/readers/megatron.py deepspeed_zero_settings, planner/frameworks/deepspeed.py): the reduce buckets
(``reduce_bucket_size``, ``contiguous_gradients``, ``overlap_comm``), ``data_types.grad_accum_dtype``, and whether
the model is a ``PipelineModule`` (no ``--no-pipeline-parallel``). The engine's side of each rule is asked of
DeepSpeed itself in tests/test_deepspeed_engine.py; here the figures are hand-computed from the model's parameter
count."""

import json
import shutil
from pathlib import Path

import pytest

from planner.check import check_file_branches
from planner.estimate import estimate
from planner.memory import GIB, stage_params_per_rank
from planner.presets import load_hardware

H100 = load_hardware("h100-sxm-80gb")
LAUNCH = Path(__file__).parent / "data" / "launch"


def _check(tmp_path, zero: dict, bf16: bool = True, data_types: dict | None = None, script_edit=None):
    script = (LAUNCH / "megatron_deepspeed_gpt_1.3B.sh").read_text()
    if bf16:
        script = script.replace("--fp16\"", "--bf16\"")
    if script_edit:
        script = script_edit(script)
    (tmp_path / "run.sh").write_text(script)
    config = json.loads((LAUNCH / "ds_config_gpt_1.3B.json").read_text())
    config["zero_optimization"] = zero
    if bf16:
        config.pop("fp16")
        config["bf16"] = {"enabled": True}
    if data_types:
        config["data_types"] = data_types
    (tmp_path / "ds_config_gpt_1.3B.json").write_text(json.dumps(config))
    (r,) = check_file_branches(tmp_path / "run.sh", H100, None, None)
    return r


def _stage0(r):
    return estimate(r.scenario).memory.stages[0]


def test_reduce_bucket_size_and_overlap_comm_size_the_buckets(tmp_path):
    """ZeRO 2 with overlap_comm holds two buffers of reduce_bucket_size bf16 elements: 2e9 elements is 8e9 B against
    the 5e8 default's 2e9; without contiguous_gradients, none (0.19.8 stage_1_and_2.py setup_buckets)."""
    base = _check(tmp_path, {"stage": 2, "overlap_comm": True})
    big = _check(tmp_path, {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 2e9})
    none = _check(tmp_path, {"stage": 2, "overlap_comm": True, "contiguous_gradients": False})
    one = _check(tmp_path, {"stage": 2})  # overlap_comm's default at stage 2 is false: one buffer
    for r in (base, big, none, one):
        assert not r.errors, r.errors
    assert big.scenario.training.deepspeed.reduce_bucket_elements == 2_000_000_000
    assert _stage0(big).grads_bytes - _stage0(base).grads_bytes == pytest.approx(2 * (2e9 - 5e8) * 2)
    assert _stage0(base).grads_bytes - _stage0(none).grads_bytes == pytest.approx(2 * 5e8 * 2)
    assert _stage0(base).grads_bytes - _stage0(one).grads_bytes == pytest.approx(5e8 * 2)
    assert one.scenario.training.overlap_grad_reduce is False and base.scenario.training.overlap_grad_reduce is True


def test_bf16_zero0_without_a_pipeline_holds_the_whole_optimizer(tmp_path):
    """bf16 at ZeRO 0 with --no-pipeline-parallel runs FP16_Optimizer in bf16 (deepspeedai/DeepSpeed#7790): the fp32
    master and Adam states whole, 12 B per parameter on every rank, where the BF16_Optimizer plan3d used to assume
    held 12/dp. The same launch as a one-stage PipelineModule (no --no-pipeline-parallel) runs BF16_Optimizer."""
    plain = _check(tmp_path, {"stage": 0})
    piped = _check(tmp_path, {"stage": 0}, script_edit=lambda s: s.replace("    --no-pipeline-parallel \\\n", ""))
    for r in (plain, piped):
        assert not r.errors, r.errors
    plan = plain.scenario.resolved_plan()
    p = stage_params_per_rank(plain.scenario.model, plan, 0, 24)
    assert _stage0(plain).optimizer_bytes == pytest.approx(12 * p)
    assert _stage0(piped).optimizer_bytes == pytest.approx(12 * p / plan.dp)
    assert any("FP16_Optimizer" in n for n in plain.notes) and any("BF16_Optimizer" in n for n in piped.notes)
    assert _stage0(plain).total_bytes - _stage0(piped).total_bytes > 1.0 * GIB


def test_zero1_with_fp32_accumulation_is_bf16_optimizer(tmp_path):
    """ZeRO 1 in bf16 with data_types.grad_accum_dtype fp32 runs BF16_Optimizer, not the ZeRO optimizer: the
    full-size fp32 accumulation buffer instead of a 1/dp fp32 partition, and no reduce buckets."""
    zero = _check(tmp_path, {"stage": 1})
    bf16opt = _check(tmp_path, {"stage": 1}, data_types={"grad_accum_dtype": "float32"})
    for r in (zero, bf16opt):
        assert not r.errors, r.errors
    assert bf16opt.scenario.training.deepspeed.grad_accum_dtype == "fp32"
    plan = zero.scenario.resolved_plan()
    p = stage_params_per_rank(zero.scenario.model, plan, 0, 24)
    assert _stage0(zero).grads_bytes == pytest.approx(2 * p + 4 * p / plan.dp + 5e8 * 2)
    assert _stage0(bf16opt).grads_bytes == pytest.approx(6 * p)
    assert any("BF16_Optimizer" in n for n in bf16opt.notes)


def test_zero2_needs_no_pipeline_parallel(tmp_path):
    """Without --no-pipeline-parallel Megatron-DeepSpeed builds a PipelineModule even on one stage, and DeepSpeed's
    PipelineEngine asserts ZeRO < 2: refused with the flag named."""
    r = _check(tmp_path, {"stage": 2}, script_edit=lambda s: s.replace("    --no-pipeline-parallel \\\n", ""))
    assert r.errors and "--no-pipeline-parallel" in r.errors[0]


def test_zero0_with_fp32_accumulation_is_noted(tmp_path):
    """DeepSpeed 0.19.8 refuses ZeRO 0 with bf16 weights and fp32 accumulation; earlier releases ran BF16_Optimizer,
    which check counts and says so."""
    r = _check(tmp_path, {"stage": 0}, data_types={"grad_accum_dtype": "fp32"})
    assert not r.errors, r.errors
    assert any("refuses ZeRO stage 0" in n for n in r.notes)


def test_emitted_config_round_trips_its_bucket_settings(tmp_path):
    """A plan's DeepSpeed settings are written by ``emit deepspeed``; ``check`` on the written config (with its plan
    file) reads them back and judges the same memory, and refuses the pair once the config is edited away from the
    plan."""
    from planner.emit import render_all
    from planner.io import write_all

    r = _check(tmp_path, {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 123456789,
                          "contiguous_gradients": True})
    out = tmp_path / "out"
    files = write_all(out, render_all(r.scenario, ["deepspeed", "plan"]))
    (config,) = [f for f in files if f.name.endswith(".deepspeed.json")]
    assert json.loads(config.read_text())["zero_optimization"] == {
        "stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 123456789}
    (back,) = check_file_branches(config, H100, None, None)
    assert not back.errors, back.errors
    assert back.scenario.training.deepspeed == r.scenario.training.deepspeed
    assert estimate(back.scenario).memory.peak_gib == pytest.approx(estimate(r.scenario).memory.peak_gib)
    edited = json.loads(config.read_text())
    edited["zero_optimization"]["reduce_bucket_size"] = 5e8
    config.write_text(json.dumps(edited))
    (bad,) = check_file_branches(config, H100, None, None)
    assert bad.errors and "reduce_bucket_size" in bad.errors[0]


def test_deepspeed_settings_on_another_framework_are_refused():
    """A plan file with a ``deepspeed:`` section under another framework would have it ignored: a one-line problem
    naming the field."""
    from planner.specs import DeepSpeedZero, TrainingSpec, job_problems
    from planner.presets import load_model

    model = load_model("llama3-8b")
    odd = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, deepspeed=DeepSpeedZero(reduce_bucket_elements=5))
    (line,) = [p for p in job_problems(model, H100, odd) if p.startswith("deepspeed:")]
    assert "framework deepspeed" in line
    assert not [p for p in job_problems(model, H100, odd.model_copy(update={"framework": "deepspeed"}))
                if p.startswith("deepspeed:")]


def test_a_pipeline_engine_plan_at_zero2_is_a_plan_problem():
    """A plan file that says the model is a PipelineModule (pipeline_engine) cannot take ZeRO 2-3, as the engine
    asserts, even on one stage."""
    from planner.presets import load_model
    from planner.specs import DeepSpeedZero, Plan, TrainingSpec, plan_problems

    model = load_model("llama3-8b")
    training = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, framework="deepspeed",
                            deepspeed=DeepSpeedZero(pipeline_engine=True))
    for zero, refused in ((1, False), (2, True), (3, True)):
        plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=1, zero_stage=zero)
        lines = [p for p in plan_problems(model, H100, training, plan) if "pipeline engine" in p]
        assert bool(lines) is refused, (zero, lines)


def test_zero3_coordinator_limits_are_read_and_round_trip(tmp_path):
    """ZeRO 3: the config's stage3_max_live_parameters, stage3_max_reuse_distance, stage3_param_persistence_threshold
    and stage3_prefetch_bucket_size reach the plan, and the weights gathered move with them. With no prefetch, no
    reuse distance and nothing persisted DeepSpeed's coordinator holds one module's parameters at a time, the largest:
    GPT-1.3B's tied 50,304-word x 2,048 embedding (Megatron pads 50,257 to 50,304) = 103,022,592 elements, by hand.
    The emitted config carries the four keys and checks back to the same memory."""
    from planner.emit import render_all
    from planner.io import write_all

    lean = {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 10**9}
    r = _check(tmp_path, lean)
    base = _check(tmp_path, {"stage": 3})
    assert not r.errors and not base.errors, (r.errors, base.errors)
    ds = r.scenario.training.deepspeed
    assert (ds.prefetch_bucket_elements, ds.max_reuse_elements, ds.persistence_threshold_elements,
            ds.max_live_elements) == (0, 0, 0, 10**9)
    model, plan = r.scenario.model, r.scenario.resolved_plan()
    assert plan.pp == 1 and plan.tp == 1 and model.tied_embeddings
    p = stage_params_per_rank(model, plan, 0, model.num_layers)
    n = plan.dp * plan.cp
    assert _stage0(r).weights_bytes == pytest.approx(2 * p / n + 2 * 50304 * 2048)
    # DeepSpeed's defaults keep more gathered (the reuse distance and the prefetcher); check says how much
    assert _stage0(base).weights_bytes > _stage0(r).weights_bytes + 2 * 5e7
    assert any("gathered at once" in n and "103M parameters" in n for n in r.notes), r.notes
    out = tmp_path / "out"
    files = write_all(out, render_all(r.scenario, ["deepspeed", "plan"]))
    (config,) = [f for f in files if f.name.endswith(".deepspeed.json")]
    zero = json.loads(config.read_text())["zero_optimization"]
    assert {k: zero[k] for k in lean} == lean
    (back,) = check_file_branches(config, H100, None, None)
    assert not back.errors, back.errors
    assert back.scenario.training.deepspeed == ds
    assert estimate(back.scenario).memory.peak_gib == pytest.approx(estimate(r.scenario).memory.peak_gib)
    zero["stage3_max_reuse_distance"] = 10**9
    config.write_text(json.dumps({**json.loads(config.read_text()), "zero_optimization": zero}))
    (bad,) = check_file_branches(config, H100, None, None)
    assert bad.errors and "stage3_max_reuse_distance" in bad.errors[0]


@pytest.mark.parametrize("zero, extra, message", [
    # ZeRO++ hpZ: a second, node-local partition of the 16-bit weights that plan3d does not count
    ({"stage": 3, "zero_hpz_partition_size": 8}, {}, "zero_hpz_partition_size 8"),
    # keys DeepSpeed 0.19.8 itself refuses (runtime/config.py _reject_removed_config_keys)
    ({"stage": 3, "mics_shard_size": 8}, {}, "zero_optimization.mics_shard_size: removed"),
    ({"stage": 1}, {"compression_training": {}}, "compression_training: removed"),
    # an optimizer whose states plan3d does not know: a torch.optim class DeepSpeed would build by name
    ({"stage": 1}, {"optimizer": {"type": "RMSprop", "params": {"lr": 0.1}}}, "optimizer.type RMSprop"),
    ({"stage": 1}, {"optimizer": {"type": "muon", "params": {"lr": 0.1}}}, "optimizer.type muon"),
])
def test_deepspeed_settings_plan3d_would_misread_are_refused(tmp_path, zero, extra, message):
    """Refused with the reason (exit 2) rather than read as the ZeRO and Adam plan3d counts; before 2026-12-05 each was
    ignored (hpZ: a false pass)."""
    _check(tmp_path, zero)  # writes the script and its config; the top-level keys go on top
    config = json.loads((tmp_path / "ds_config_gpt_1.3B.json").read_text()) | extra
    (tmp_path / "ds_config_gpt_1.3B.json").write_text(json.dumps(config))
    (r,) = check_file_branches(tmp_path / "run.sh", H100, None, None)
    assert r.errors and message in r.errors[0], r.errors


@pytest.mark.parametrize("optimizer, note", [("AdamW", None), ("lamb", None), ("SGD", "upper bound"),
                                             ("Adagrad", "upper bound"), ("lion", "upper bound")])
def test_deepspeed_optimizer_states_counted_as_adam(tmp_path, optimizer, note):
    """Adam-like optimizers (two fp32 moments) are what plan3d counts; one-state optimizers are counted as Adam, an
    upper bound said in a note."""
    _check(tmp_path, {"stage": 1})
    config = json.loads((tmp_path / "ds_config_gpt_1.3B.json").read_text())
    config["optimizer"] = {"type": optimizer, "params": {"lr": 0.1}}
    (tmp_path / "ds_config_gpt_1.3B.json").write_text(json.dumps(config))
    (r,) = check_file_branches(tmp_path / "run.sh", H100, None, None)
    assert not r.errors, r.errors
    assert (note is None) == (not any("DeepSpeed optimizer" in n for n in r.notes)), r.notes


def test_removed_keys_are_the_ones_deepspeed_refuses():
    """The keys plan3d refuses as removed are DeepSpeed's own list (0.19.8 runtime/config.py), and DeepSpeed's config
    check raises on each."""
    config = pytest.importorskip("deepspeed.runtime.config")
    from planner.readers.megatron import DEEPSPEED_REMOVED_KEYS, DEEPSPEED_REMOVED_ZERO_KEYS

    assert set(DEEPSPEED_REMOVED_KEYS) == set(config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert set(DEEPSPEED_REMOVED_ZERO_KEYS) == set(config._REMOVED_ZERO_CONFIG_KEYS)
    for key in DEEPSPEED_REMOVED_KEYS:
        with pytest.raises(config.DeepSpeedConfigError):
            config._reject_removed_config_keys({key: {}})
    for key in DEEPSPEED_REMOVED_ZERO_KEYS:
        with pytest.raises(config.DeepSpeedConfigError):
            config._reject_removed_config_keys({"zero_optimization": {key: 1}})
    names = {n.lower() for n in config.DEEPSPEED_OPTIMIZERS}
    from planner.readers.megatron import DEEPSPEED_ADAM_LIKE_OPTIMIZERS, DEEPSPEED_ONE_STATE_OPTIMIZERS

    # every DeepSpeed optimizer is either counted or refused by name (muon: refused), none unknown to plan3d
    assert names - set(DEEPSPEED_ADAM_LIKE_OPTIMIZERS + DEEPSPEED_ONE_STATE_OPTIMIZERS) == {"muon"}
