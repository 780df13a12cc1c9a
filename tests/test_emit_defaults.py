"""`plan3d emit` writes the plan's own framework's launch files by default, and says so when asked for another's."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.emit import default_formats, framework_notes
from planner.presets import load_hardware, load_model

runner = CliRunner()


def _plan_file(tmp_path: Path, framework: str) -> Path:
    """A Llama-3-8B plan on 16 H100 (TP 2, PP 2, DP 4) searched, as its file says, for ``framework``."""
    path = tmp_path / f"{framework}.plan.json"
    path.write_text(json.dumps({
        "model": load_model("llama3-8b").model_dump(), "hardware": load_hardware("h100-sxm-80gb").model_dump(),
        "training": {"num_gpus": 16, "global_batch_size": 64, "seq_len": 4096, "framework": framework},
        "plan": {"tp": 2, "pp": 2, "dp": 4, "micro_batch_size": 1, "num_microbatches": 16,
                 "layers_per_stage": [16, 16], "zero_stage": 1}}))
    return path


@pytest.mark.parametrize("framework, suffixes", [
    ("megatron", {".megatron.args", ".torchrun.sh", ".slurm", ".plan.json"}),
    ("nemo", {".megatron.args", ".torchrun.sh", ".slurm", ".plan.json"}),
    ("torchtitan", {".torchtitan.sh"}),
    ("deepspeed", {".deepspeed.json", ".plan.json"}),
])
def test_emit_without_format_writes_the_plans_own_framework(tmp_path, framework, suffixes):
    out = tmp_path / "launch"
    res = runner.invoke(app, ["emit", str(_plan_file(tmp_path, framework)), "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    written = {p.name.split("_mbs1", 1)[1] for p in out.iterdir()}
    assert written == suffixes
    assert "note:" not in res.output


def test_emit_of_another_frameworks_format_says_whose_prediction_it_is(tmp_path):
    out = tmp_path / "launch"
    res = runner.invoke(app, ["emit", str(_plan_file(tmp_path, "torchtitan")), "-f", "megatron,plan",
                              "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    assert len(list(out.iterdir())) == 2  # still written: check judges the file under Megatron's semantics
    assert "note: --format megatron runs megatron, but the plan was searched for framework torchtitan" in res.stderr
    assert "note" not in res.stdout


def test_framework_notes():
    assert framework_notes("megatron", ["megatron", "torchrun", "slurm", "plan"]) == []
    assert framework_notes("nemo", ["megatron", "slurm"]) == []  # NeMo runs Megatron-Core
    assert [n.split(" runs")[0] for n in framework_notes("megatron", ["torchtitan", "deepspeed", "plan"])] == \
        ["note: --format torchtitan", "note: --format deepspeed"]
    assert framework_notes("torch", ["megatron", "torchtitan"]) == []
    assert default_formats("megatron") == default_formats("nemo") == default_formats("torch") == \
        "megatron,torchrun,slurm"
    assert default_formats("torchtitan") == "torchtitan" and default_formats("deepspeed") == "deepspeed"


def test_megatron_args_always_name_max_position_embeddings():
    """Megatron-LM's validate_args requires --max-position-embeddings (core_v0.16.1 arguments.py ``required_args``;
    "max_position_embeddings argument is None") and at least --seq-length. A Hugging Face config that states no
    limit (tests/data/hf/deepseek-v2-lite.json has no max_position_embeddings) gets the job's sequence length; one
    that does, its own. tests/test_megatron_params.py runs Megatron's own validation on such a launch."""
    from planner.emit import render_all
    from planner.specs import Plan, Scenario, TrainingSpec

    hw = load_hardware("h100-sxm-80gb")
    for name, want in (("deepseek-v2-lite.json", "4096"), ("deepseek-v2.json", "163840")):
        model = load_model(str(Path(__file__).parent / "data" / "hf" / name))
        sc = Scenario(model=model, hardware=hw, training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=4096),
                      plan=Plan(tp=1, pp=1, dp=64, ep=8, micro_batch_size=1))
        (args,) = [t for f, t in render_all(sc, ["megatron"]).items() if f.endswith(".megatron.args")]
        words = " ".join(ln for ln in args.splitlines() if not ln.startswith("#")).split()
        assert words[words.index("--max-position-embeddings") + 1] == want, name


def test_biases_on_every_linear_layer_are_megatrons_default_and_the_validate_block_has_them():
    """A spec whose Q/K/V, output projection and MLP each carry a bias (GPT-OSS's fields: linear_bias false, the three
    flags true) has biases on every linear layer: Megatron's --add-bias-linear default, so no --disable-bias-linear
    (which would drop the output and MLP biases); and plan3d validate's block builds the same biases the estimator
    counts (memory.layer_params_per_rank)."""
    torch = pytest.importorskip("torch")
    from planner.emit import render_all
    from planner.memory import layer_params_per_rank
    from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec
    from planner.validate.model import Block

    model = ModelSpec(name="all-biases", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=128, vocab_size=1000, activation="swiglu", norm="rmsnorm", linear_bias=False,
                      qkv_bias=True, out_proj_bias=True, mlp_bias=True)
    assert model.all_linear_biases and not model.megatron_gaps()
    sc = Scenario(model=model, hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=128),
                  plan=Plan(tp=1, pp=1, dp=1, micro_batch_size=1))
    (args,) = [t for f, t in render_all(sc, ["megatron"]).items() if f.endswith(".megatron.args")]
    assert "--disable-bias-linear" not in args and "--add-qkv-bias" not in args
    with torch.device("meta"):
        block = Block(model)
    assert sum(p.numel() for p in block.parameters()) == layer_params_per_rank(model, 1)
