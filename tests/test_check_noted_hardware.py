"""`plan3d check` on the launch files `plan3d emit` writes, without ``--hardware``: the files name a bundled
profile in a ``# plan3d: hardware=NAME`` comment (``planner.emit.megatron.annotations``) only when the plan's
profile is that bundled one unchanged; check loads only bundled names (never a path) and ``--hardware`` wins."""

from __future__ import annotations

import json

import pytest

from planner.cli import app
from planner.presets import load_hardware, load_model
from planner.render import scenario_json
from planner.specs import Plan, Scenario, TrainingSpec

FORMATS = "megatron,torchrun,slurm,torchtitan"


def _emit(runner, tmp_path, hw, name="launch"):
    sc = Scenario(model=load_model("llama3-8b"), hardware=hw,
                  training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096),
                  plan=Plan(tp=2, pp=2, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1))
    plan = tmp_path / f"{name}.plan.json"
    plan.write_text(scenario_json(sc))
    out = tmp_path / name
    res = runner.invoke(app, ["emit", str(plan), "--format", FORMATS, "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    return sorted(p for p in out.iterdir() if not p.name.endswith(".plan.json"))


def _check(runner, files, *extra):
    res = runner.invoke(app, ["check", *map(str, files), "--format", "json", *extra])
    return res.exit_code, res.output


def test_emitted_files_of_a_bundled_profile_check_without_hardware(runner, tmp_path):
    files = _emit(runner, tmp_path, load_hardware("h100-sxm-80gb"))
    assert len(files) == 4  # .megatron.args, .torchrun.sh, .slurm, .torchtitan.sh
    for f in files:
        assert "# plan3d: hardware=h100-sxm-80gb\n" in f.read_text()
    code, out = _check(runner, files)
    assert code == 0, out
    noted = json.loads(out)
    assert all(r["notes"][0] == "hardware: h100-sxm-80gb, from the file's '# plan3d: hardware=' comment"
               for r in noted)
    # the same figures as with the profile given on the command line
    code, out = _check(runner, files, "--hardware", "h100-sxm-80gb")
    assert code == 0
    given = json.loads(out)
    assert [r["memory"] for r in noted] == [r["memory"] for r in given]
    assert {r["memory"]["usable_gib"] for r in noted} == {load_hardware("h100-sxm-80gb").usable_memory_gib}


def test_hardware_on_the_command_line_wins_over_the_comment(runner, tmp_path):
    files = _emit(runner, tmp_path, load_hardware("h100-sxm-80gb"))
    code, out = _check(runner, files, "--hardware", "a100-40gb")
    usable = {r["memory"]["usable_gib"] for r in json.loads(out) if r.get("memory")}
    assert usable == {load_hardware("a100-40gb").usable_memory_gib}
    assert not any("from the file's" in n for r in json.loads(out) for n in r["notes"])


@pytest.mark.parametrize("change", [{"gpu_memory_gib": 70.0}, {"name": "my-cluster"}])
def test_a_profile_that_is_not_a_bundled_one_unchanged_is_not_named(runner, tmp_path, change):
    """A bundled profile edited under its own name (or calibrated) would be judged by the bundled figures if its
    name were written: it is not, and check asks for --hardware in one line, exit 2."""
    hw = load_hardware("h100-sxm-80gb").model_copy(update=change)
    files = _emit(runner, tmp_path, hw)
    for f in files:
        assert "plan3d: hardware=" not in f.read_text()
    code, out = _check(runner, files[:1])
    assert code == 2
    assert "--hardware is required" in json.loads(out)[0]["errors"][0]


@pytest.mark.parametrize("value", ["../hardware_profiles/h100-sxm-80gb.yaml", "/etc/passwd", "h100"])
def test_a_comment_naming_anything_but_a_bundled_profile_is_refused(runner, tmp_path, value):
    """Only a bundled name is loaded: a path in the comment is not read."""
    files = _emit(runner, tmp_path, load_hardware("h100-sxm-80gb"))
    args = next(f for f in files if f.name.endswith(".megatron.args"))
    args.write_text(args.read_text().replace("hardware=h100-sxm-80gb", f"hardware={value}"))
    code, out = _check(runner, [args])
    assert code == 2
    err = json.loads(out)[0]["errors"][0]
    assert f"'# plan3d: hardware={value}' is not a bundled hardware profile" in err and "--hardware" in err


def test_an_emitted_deepspeed_config_is_checked_with_its_plan_without_hardware(runner, tmp_path):
    """`plan3d emit --format deepspeed` writes the config and the plan beside it; the plan carries the hardware."""
    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("a100-80gb"),
                  training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096),
                  plan=Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=1))
    plan = tmp_path / "ds.plan.json"
    plan.write_text(scenario_json(sc))
    out = tmp_path / "ds"
    res = runner.invoke(app, ["emit", str(plan), "--format", "deepspeed", "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    config = next(out.glob("*.deepspeed.json"))
    code, text = _check(runner, [config])
    assert code == 0, text
    (result,) = json.loads(text)
    assert result["memory"]["usable_gib"] == load_hardware("a100-80gb").usable_memory_gib
    assert any("the plan it was emitted from" in n for n in result["notes"])
    code, text = _check(runner, [config], "--hardware", "h100-sxm-80gb")  # --hardware still wins
    assert json.loads(text)[0]["memory"]["usable_gib"] == load_hardware("h100-sxm-80gb").usable_memory_gib


def test_a_deepspeed_config_passed_by_an_unannotated_script_needs_hardware(runner, tmp_path):
    """The config's launch script is hand-written (no '# plan3d: hardware='): one line asking for --hardware."""
    (tmp_path / "ds_config.json").write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
                                                         "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}))
    (tmp_path / "train.sh").write_text("deepspeed --num_gpus 8 pretrain_gpt.py --deepspeed --deepspeed_config "
                                       "ds_config.json --num-layers 2\n")
    code, text = _check(runner, [tmp_path / "ds_config.json"])
    assert code == 2
    assert "train.sh: --hardware is required" in json.loads(text)[0]["errors"][0]


def test_a_plan_file_judged_on_another_profile_is_held_to_that_profile(runner, tmp_path):
    """`check PLAN --hardware X` applies the plan rules on X, as `estimate PLAN --hardware X` and check's launch files
    do: an fp8 plan on an A100 (no fp8 peak) is invalid input (exit 2, the field named), where it used to be judged
    on memory alone and pass."""
    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096, precision="fp8"),
                  plan=Plan(tp=2, pp=2, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1))
    plan = tmp_path / "fp8.plan.json"
    plan.write_text(scenario_json(sc))
    code, out = _check(runner, [plan], "--hardware", "h100-sxm-80gb")
    assert code == 0, out
    code, out = _check(runner, [plan], "--hardware", "a100-80gb")
    assert code == 2, out
    (row,) = json.loads(out)
    assert any("precision: a100-80gb has no fp8 peak" in e for e in row["errors"]), row
    res = runner.invoke(app, ["estimate", str(plan), "--hardware", "a100-80gb"])
    assert res.exit_code == 2 and "precision: a100-80gb has no fp8 peak" in res.output


def test_a_plan_file_is_built_once_on_the_profile_given(runner, tmp_path):
    """With ``--hardware X`` the file's own profile is not consulted: a plan file whose own profile cannot run it (an
    fp8 plan saved with an A100 profile) is judged on X alone and fits there, where it used to be refused for the
    profile it was about to be judged without. Without ``--hardware`` the file's own profile refuses it (exit 2)."""
    sc = Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096, precision="fp8"),
                  plan=Plan(tp=2, pp=2, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1))
    doc = json.loads(scenario_json(sc))
    doc["hardware"] = load_hardware("a100-80gb").model_dump(mode="json")
    plan = tmp_path / "fp8-on-a100.plan.json"
    plan.write_text(json.dumps(doc))
    code, out = _check(runner, [plan])
    assert code == 2, out
    assert any("precision: a100-80gb has no fp8 peak" in e for e in json.loads(out)[0]["errors"]), out
    code, out = _check(runner, [plan], "--hardware", "h100-sxm-80gb")
    assert code == 0, out
    (row,) = json.loads(out)
    assert row["memory"]["usable_gib"] == load_hardware("h100-sxm-80gb").usable_memory_gib
