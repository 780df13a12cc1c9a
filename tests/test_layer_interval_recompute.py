"""torchtitan's per-layer AC (``Plan.recompute_interval``): ``[activation_checkpoint] mode = "selective"`` with
``selective_ac_option = "N"`` checkpoints every N-th transformer block a rank builds and leaves the others whole
(torchtitan's TOML-era ``distributed/activation_checkpoint.py`` ``_apply_layer_sac``: a process-wide counter over
the blocks, ``if not ac_freq or _layer_sac_count % ac_freq == 0: return ptd_checkpoint_wrapper(module, ...)``;
JobConfig's default option is "2"). torchtitan 0.3.0 dropped it (its ``SelectiveAC`` is per-op only).

Oracles: counts and bytes composed by hand from the per-layer terms; torch's own allocation trace of the
real FSDP2 step with every N-th block wrapped in ``checkpoint_wrapper`` (tests/test_torchtitan_reserved.py, cases
``*layer-ac-every-*``); torch itself on gloo (tests/test_validate.py, variant ``layer-interval-recompute``).
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.check import check_file_branches
from planner.cli import app
from planner.cost import estimate_time, recomputed_layers_share
from planner.memory import layer_activation_terms, saved_bytes_per_layer, stage_saved_bytes
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec, checkpointed_layers, plan_problems, recomputed_share
from tests.test_check_launch import LAUNCH

H100 = load_hardware("h100-sxm-80gb")
L8 = load_model("llama3-8b")
TT = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=8192, framework="torchtitan")


def _plan(**kw) -> Plan:
    base = dict(tp=1, pp=1, dp=8, micro_batch_size=2, recompute="full", zero_stage=3)
    return Plan(**(base | kw))


def test_which_layers_by_hand():
    # the k-th block of the rank (k = 1, 2, ...) where k % N == 0
    assert checkpointed_layers(5, 1, True, "full", None, 2) == (False, True, False, True, False)
    assert checkpointed_layers(7, 1, False, "full", None, 3) == (False, False, True, False, False, True, False)
    # the counter runs on across a rank's chunks: chunks (4, 3) of rank 1, N = 2 -> blocks 2, 4 | 6
    assert checkpointed_layers(7, 2, False, "full", None, 2) == (False, True, False, True, False, True, False)
    # Megatron's block method for comparison: the first K of each chunk
    assert checkpointed_layers(7, 2, False, "full", 2, None) == (True, True, False, False, True, True, False)
    assert checkpointed_layers(4, 1, True, "selective", None, None) == (False,) * 4
    assert checkpointed_layers(4, 1, True, "full", None, None) == (True,) * 4


def test_shares_by_hand():
    assert recomputed_share(32, 1, True, "full", None, 2) == (0.5, 0.5)
    assert recomputed_share(7, 1, False, "full", None, 3) == (2 / 7, 2 / 7)
    # chunks (4, 3): 3 of 7 recomputed; a chunk of 3 holds at least floor(3/2) = 1 of them wherever it starts
    assert recomputed_share(7, 2, False, "full", None, 2) == (3 / 7, 1 / 3)
    assert recomputed_share(3, 1, False, "full", None, 4) == (0.0, 0.0)  # N beyond the rank's blocks: none
    assert recomputed_share(8, 1, False, "selective", None, None) == (0.0, 0.0)


def test_needs_full_recompute_and_a_framework_that_runs_it():
    with pytest.raises(ValueError, match="recompute_interval: .*needs recompute full"):
        _plan(recompute="selective", recompute_interval=2)
    with pytest.raises(ValueError, match="recompute_interval: .*give one"):
        _plan(recompute_interval=2, recompute_num_layers=1)
    for fw, refused in (("torchtitan", False), ("torch", False), ("megatron", True), ("nemo", True),
                        ("deepspeed", True)):
        lines = plan_problems(L8, H100, TT.model_copy(update={"framework": fw}), _plan(recompute_interval=2))
        assert any(line.startswith("recompute_interval:") for line in lines) == refused, (fw, lines)


def test_saved_activations_mix_the_two_policies_layer_by_layer():
    """pp 1, one micro-batch in flight: 16 of 32 layers keep their input only (full recompute's bytes per
    layer), the other 16 everything (no recompute's), composed by hand from the per-layer terms."""
    plan = _plan(recompute_interval=2)
    terms = layer_activation_terms(L8, TT, plan, moe=False)
    by_hand = 16 * saved_bytes_per_layer(terms, "full") + 16 * saved_bytes_per_layer(terms, "none")
    assert stage_saved_bytes(L8, TT, plan, 1, 0, 32) == pytest.approx(by_hand)
    # N = 3 on 32 layers: 10 recomputed
    by_hand = 10 * saved_bytes_per_layer(terms, "full") + 22 * saved_bytes_per_layer(terms, "none")
    assert stage_saved_bytes(L8, TT, _plan(recompute_interval=3), 1, 0, 32) == pytest.approx(by_hand)


def test_time_recomputes_the_share_of_the_layers():
    plan = _plan(recompute_interval=4)
    t = estimate_time(L8, H100, TT, plan)
    t_full = estimate_time(L8, H100, TT, plan.model_copy(update={"recompute_interval": None}))
    t_none = estimate_time(L8, H100, TT, plan.model_copy(update={"recompute_interval": None, "recompute": "none"}))
    assert t.breakdown["recompute"] == pytest.approx(0.25 * t_full.breakdown["recompute"])
    assert t_none.step_time_s < t.step_time_s < t_full.step_time_s
    assert recomputed_layers_share(L8, plan) == pytest.approx(0.25)


def _toml(tmp_path, option: str | None):
    text = (LAUNCH / "torchtitan_llama3_8b.toml").read_text()
    line = "selective_ac_option = 'op'"
    assert line in text
    path = tmp_path / "ac.toml"
    path.write_text(text.replace(line, "" if option is None else f"selective_ac_option = '{option}'"))
    return path


@pytest.mark.parametrize("option, want", [(None, ("full", 2)), ("2", ("full", 2)), ("3", ("full", 3)),
                                          ("1", ("full", None)), ("0", ("full", None)), ("op", ("selective", None))])
def test_check_reads_the_toml_option_as_torchtitan_runs_it(tmp_path, option, want):
    """JobConfig's default option is "2"; "1" and "0" checkpoint every block (``not ac_freq or count % 1 == 0``)."""
    (r,) = check_file_branches(_toml(tmp_path, option), H100, None, 64)
    assert (r.scenario.plan.recompute, r.scenario.plan.recompute_interval) == want
    assert not any("upper bound" in n for n in r.notes)


def test_check_refuses_an_option_torchtitan_refuses(tmp_path):
    (r,) = check_file_branches(_toml(tmp_path, "every"), H100, None, 64)
    assert r.scenario is None and len(r.errors) == 1
    assert "selective_ac_option = 'every': torchtitan takes 'op' or a layer frequency" in r.errors[0]
    res = CliRunner().invoke(app, ["check", str(_toml(tmp_path, "every")), "--hardware", "h100-sxm-80gb"])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_torchtitan_03_subcommand_selective_is_per_op(tmp_path):
    """torchtitan 0.3's ``activation_checkpoint:selective`` is SelectiveAC, per-op: no layer option to default."""
    from planner.readers.torchtitan import apply_overrides

    doc = apply_overrides({"activation_checkpoint": {"mode": "full"}}, ["activation_checkpoint:selective"])
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}


def test_emitters_refuse_what_they_cannot_write():
    from planner.emit import render_all

    sc = Scenario(model=L8, hardware=H100, training=TT, plan=_plan(recompute_interval=2))
    for fmt, reason in (("torchtitan", "per-op only"), ("megatron", "no per-layer AC"), ("deepspeed", "no per-layer AC")):
        with pytest.raises(SpecError, match=f"--emit {fmt}: .*{reason}"):
            render_all(sc, [fmt])


def test_estimate_cli_takes_it_and_refuses_it_where_the_framework_has_none():
    import json

    runner = CliRunner()
    base = ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "16",
            "--seq-len", "8192", "--tp", "1", "--pp", "1", "--zero-stage", "3", "--micro-batch-size", "2",
            "--recompute", "full", "--recompute-interval", "2"]
    res = runner.invoke(app, base + ["--framework", "torchtitan", "--json"])
    assert res.exit_code in (0, 1), res.output
    out = json.loads(res.output)
    assert out["plan"]["recompute_interval"] == 2
    res = runner.invoke(app, base + ["--framework", "megatron"])
    assert res.exit_code == 2 and "recompute_interval" in res.output and "Traceback" not in res.output
