"""CLI tests through typer's CliRunner: listings, show, estimate, and every bad-input case."""

import json
from pathlib import Path

import pytest

from planner.cli import app

JOB = ["--model", "llama3-8b", "--hardware", "a100-80gb", "--gpus", "8", "--global-batch", "64", "--seq-len", "4096"]


def _bad(runner, args, *needles):
    res = runner.invoke(app, args)
    out = res.output
    assert res.exit_code == 2, out
    assert "Traceback" not in out
    assert res.exception is None or isinstance(res.exception, SystemExit)
    for needle in needles:
        assert needle in out, out
    return out


def test_help(runner):
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "estimate" in res.output and "models" in res.output


def test_models_lists_presets(runner):
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0
    assert "llama3-70b" in res.output and "megatron-gpt-1t" in res.output


@pytest.mark.parametrize("command", ["models", "hardware"])
@pytest.mark.parametrize("columns", ["80", "120", "200"])
def test_listings_never_cut_a_name_or_figure_short(runner, command, columns):
    """The names are what --model / --hardware take: at any width (a pipe or CI log is 80 columns) each is
    printed whole, and no cell is cut to an ellipsis (narrow terminals get fewer columns instead)."""
    from planner import presets

    res = runner.invoke(app, [command], env={"COLUMNS": columns})
    assert res.exit_code == 0
    kind = presets.MODEL_DIRNAME if command == "models" else presets.HARDWARE_DIRNAME
    names = presets.preset_names(kind)
    assert names and all(f" {n} " in res.output for n in names), res.output
    assert "\u2026" not in res.output, res.output


def test_models_json(runner):
    res = runner.invoke(app, ["models", "--json"])
    data = {m["name"]: m for m in json.loads(res.output)}
    assert data["llama2-7b"]["num_params"] == 6_738_415_616


def test_hardware_lists_presets(runner):
    res = runner.invoke(app, ["hardware"])
    assert res.exit_code == 0 and "h100-sxm-80gb" in res.output and "cpu-gloo" in res.output


def test_show_model_prints_param_count(runner):
    res = runner.invoke(app, ["show", "llama3-8b"])
    assert res.exit_code == 0 and "8,030,261,248" in res.output


def test_show_hardware_and_path(runner):
    assert "usable_memory_gib" in runner.invoke(app, ["show", "h100-sxm-80gb"]).output
    res = runner.invoke(app, ["show", "tests/data/mistral-7b.config.json", "--json"])
    assert json.loads(res.output)["num_params"] == 7_241_732_096


def test_unknown_preset_lists_close_names(runner):
    _bad(runner, ["show", "llama3-9b"], "llama3-8b")
    _bad(runner, ["estimate", *JOB[:1], "lama3-8b", *JOB[2:], "--tp", "1", "--pp", "1"], "--model", "llama3-8b")
    _bad(runner, ["estimate", "--model", "llama3-8b", "--hardware", "h100", *JOB[4:], "--tp", "1", "--pp", "1"],
         "--hardware", "h100-sxm-80gb")


def test_yaml_with_wrong_key(runner, tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("name: x\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 100\nnum_layer: 3\n")
    _bad(runner, ["show", str(f)], "num_layer: unknown key")


def test_yaml_with_wrong_type(runner, tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("name: x\nnum_layers: many\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 100\n")
    _bad(runner, ["show", str(f)], "num_layers", "integer")


def test_yaml_syntax_error_names_line(runner, tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("name: x\nnum_layers: [2\nhidden_size: 64\n")
    _bad(runner, ["show", str(f)], str(f), "invalid YAML")


def test_hardware_file_with_negative_memory(runner, tmp_path):
    f = tmp_path / "hw.yaml"
    f.write_text("name: h\ngpu_memory_gib: -80\npeak_bf16_tflops: 1\nhbm_bandwidth_gbps: 1\ngpus_per_node: 8\n"
                 "intra_node_bandwidth_gbps: 1\nintra_node_latency_us: 1\ninter_node_bandwidth_gbps: 1\n"
                 "inter_node_latency_us: 1\n")
    _bad(runner, ["show", str(f)], "gpu_memory_gib", "greater than 0")


@pytest.mark.parametrize("flag", ["--gpus", "--global-batch", "--seq-len", "--tp", "--pp"])
@pytest.mark.parametrize("value", ["0", "-4"])
def test_zero_or_negative_sizes(runner, flag, value):
    args = JOB + ["--tp", "2", "--pp", "1"]
    i = args.index(flag) if flag in args else None
    args[i + 1] = value
    _bad(runner, ["estimate", *args], flag)


def test_indivisible_degrees(runner):
    _bad(runner, ["estimate", *JOB, "--tp", "3", "--pp", "1"], "--gpus: 8 is not divisible by tp(3)")
    _bad(runner, ["estimate", *JOB, "--tp", "8", "--pp", "1", "--micro-batch-size", "3"],
         "global_batch_size: 64 is not divisible by micro_batch_size(3) * dp(1) = 3")
    _bad(runner, ["estimate", *JOB[:5], "8", *JOB[6:], "--tp", "1", "--pp", "8", "--vpp", "3"],
         "num_layers(32) is not divisible by pp(8) * vpp(3) = 24")


def test_bad_choice(runner):
    _bad(runner, ["estimate", *JOB, "--tp", "2", "--pp", "1", "--recompute", "some"], "recompute")
    _bad(runner, ["estimate", *JOB, "--tp", "2", "--pp", "1", "--precision", "fp4"], "precision")


def test_missing_required_option(runner):
    _bad(runner, ["estimate", "--model", "llama3-8b"], "--hardware: required")


def test_missing_plan_file(runner):
    _bad(runner, ["estimate", "nope.json"], "nope.json does not exist")


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="no /dev/null on this system")
@pytest.mark.parametrize("args", [["estimate", "/dev/null"], ["emit", "/dev/null"],
                                  ["estimate", "--model", "/dev/null", "--hardware", "h100-sxm-80gb"]])
def test_plan_path_that_is_no_regular_file(runner, args):
    """A path that exists but is a device (or FIFO, socket) is named as such, not as missing."""
    out = _bad(runner, args, "/dev/null is not a regular file")
    assert "does not exist" not in out


GPT3 = ["--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "64", "--global-batch", "64", "--seq-len", "2048",
        "--tp", "8", "--pp", "8", "--vpp", "3", "--sequence-parallel", "--recompute", "selective"]


def test_estimate_json_contract(runner):
    res = runner.invoke(app, ["estimate", *GPT3, "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert set(d["plan"]) >= {"tp", "pp", "dp", "cp", "vpp", "micro_batch_size", "num_microbatches", "recompute",
                              "sequence_parallel", "zero_stage", "layers_per_stage"}
    assert d["plan"]["num_microbatches"] == 64 and d["plan"]["layers_per_stage"] == [12] * 8
    mem = d["memory"]
    assert set(mem) >= {"capacity_gib", "usable_gib", "peak_gib", "fits", "stages"}
    assert len(mem["stages"]) == 8
    for s in mem["stages"]:
        assert set(s) >= {"stage", "layers", "weights_gib", "grads_gib", "optimizer_gib", "activations_gib",
                          "other_gib", "total_gib"}
    assert mem["peak_gib"] == max(s["total_gib"] for s in mem["stages"])
    assert mem["fits"] is True
    assert set(d["flops"]) >= {"model_flops_per_step", "hardware_flops_per_step"}
    assert d["flops"]["hardware_flops_per_step"] > d["flops"]["model_flops_per_step"]
    t = d["time"]
    assert set(t) >= {"step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "breakdown"}
    assert set(t["breakdown"]) == {"compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble",
                                   "dp_comm_exposed", "optimizer"}
    assert abs(sum(t["breakdown"].values()) - t["step_time_s"]) < 1e-9
    assert 0 < t["mfu"] <= t["hfu"] < 1


def test_estimate_table_shows_every_stage_and_verdict(runner):
    res = runner.invoke(app, ["estimate", *GPT3])
    assert res.exit_code == 0
    assert "fits" in res.output and "usable" in res.output
    assert "Step time" in res.output and "bubble" in res.output and "MFU" in res.output
    rows = [line for line in res.output.splitlines() if line.startswith("│")]
    assert len(rows) >= 8


def test_estimate_does_not_fit_verdict(runner):
    res = runner.invoke(app,
                        ["estimate", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "16",
                         "--global-batch", "64", "--seq-len", "2048", "--tp", "8", "--pp", "2", "--json"])
    assert res.exit_code == 1  # does not fit: exit 1, as `check` (README, docs/ci.md)
    assert json.loads(res.output)["memory"]["fits"] is False
    table = runner.invoke(app, ["estimate", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "16",
                                "--global-batch", "64", "--seq-len", "2048", "--tp", "8", "--pp", "2"])
    assert "does NOT fit" in table.output and table.exit_code == 1


def test_estimate_quiet_is_one_line_with_the_verdict(runner):
    """`estimate --quiet`: the plan, its step time and peak memory against the usable memory on one line, the exit
    code as without it (0 fits, 1 does not)."""
    job = ["estimate", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "16", "--global-batch", "64",
           "--seq-len", "2048", "--tp", "8", "--pp", "2"]
    res = runner.invoke(app, [*job, "--quiet"])
    assert res.exit_code == 1
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tp8-pp2-dp1") and lines[0].endswith("does NOT fit")
    full = json.loads(runner.invoke(app, [*job, "--json"]).stdout)  # the same estimate, rendered whole
    assert f"usable {full['memory']['usable_gib']:.1f} GiB" in lines[0]
    assert f"peak {full['memory']['peak_gib']:.1f} GiB" in lines[0]
    assert f"step {full['time']['step_time_s']:.3f} s" in lines[0]
    fits = runner.invoke(app, ["estimate", *JOB, "--tp", "2", "--pp", "1", "--recompute", "full", "-q"])
    assert fits.exit_code == 0 and fits.stdout.splitlines()[-1].endswith(": fits")
    assert len(fits.stdout.splitlines()) == 1


def test_estimate_from_plan_file_and_override(runner, tmp_path):
    from planner.presets import load_hardware, load_model

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({
        "model": load_model("llama3-8b").model_dump(), "hardware": load_hardware("h100-sxm-80gb").model_dump(),
        "training": {"num_gpus": 16, "global_batch_size": 64, "seq_len": 8192},
        "plan": {"tp": 2, "pp": 2, "dp": 4, "micro_batch_size": 1, "recompute": "selective"}}))
    res = runner.invoke(app, ["estimate", str(plan_file), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["plan"]["dp"] == 4 and d["plan"]["num_microbatches"] == 16
    res = runner.invoke(app, ["estimate", str(plan_file), "--tp", "4", "--json"])
    d2 = json.loads(res.output)
    assert d2["plan"]["tp"] == 4 and d2["plan"]["dp"] == 2
    assert d2["memory"]["stages"][0]["weights_gib"] < d["memory"]["stages"][0]["weights_gib"]


LAUNCH = Path(__file__).parent / "data" / "launch"


def test_estimate_reads_a_launch_file_as_check_does(runner):
    """A Megatron-LM script (16 nodes of 8, --tensor-model-parallel-size 8, --pipeline-model-parallel-size 16,
    --micro-batch-size 1, --global-batch-size 1536: read off the script) estimated on --hardware, with check's notes
    on stderr; its peak is the one `plan3d check` judges, and a flag still wins over the file."""
    script = str(LAUNCH / "megatron_gpt3_175b.sh")
    res = runner.invoke(app, ["estimate", script, "--hardware", "a100-80gb", "--json"])
    assert res.exit_code in (0, 1), res.output
    d = json.loads(res.stdout)
    plan = d["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"], plan["micro_batch_size"]) == (8, 16, 1, 1)
    assert plan["num_microbatches"] == 1536  # 1536 sequences / (dp 1 x micro-batch 1)
    checked = runner.invoke(app, ["check", script, "--hardware", "a100-80gb", "--format", "json"])
    (row,) = json.loads(checked.stdout)
    assert d["memory"]["fits"] == row["fits"]
    assert d["memory"]["peak_gib"] == pytest.approx(row["memory"]["peak_gib"], rel=1e-9)
    table = runner.invoke(app, ["estimate", script, "--hardware", "a100-80gb"])
    assert "note: --ffn-hidden-size absent: Megatron uses 49152 (4h)" in table.stderr
    wider = json.loads(runner.invoke(app, ["estimate", script, "--hardware", "a100-80gb", "--pp", "8", "--json"]).stdout)
    assert (wider["plan"]["pp"], wider["plan"]["dp"]) == (8, 2)


def test_estimate_reads_a_deepspeed_config_with_the_script_that_passes_it(runner):
    """ds_config_gpt_1.3B.json: zero_optimization.stage 1, train_micro_batch_size_per_gpu 8 (read off the file), the
    model from the Megatron-DeepSpeed script beside it, as check pairs them."""
    cfg = str(LAUNCH / "ds_config_gpt_1.3B.json")
    d = json.loads(runner.invoke(app, ["estimate", cfg, "--hardware", "h100-sxm-80gb", "--json"]).stdout)
    assert (d["plan"]["zero_stage"], d["plan"]["micro_batch_size"]) == (1, 8)
    (row,) = json.loads(runner.invoke(app, ["check", cfg, "--hardware", "h100-sxm-80gb", "--format", "json"]).stdout)
    assert d["memory"]["peak_gib"] == pytest.approx(row["memory"]["peak_gib"], rel=1e-9)


def test_a_plan_file_of_another_name_is_still_a_plan_file(runner, tmp_path):
    """`plan3d search --out plan.txt` writes the plan's JSON whatever the name; estimate and report read it back (the
    first launch-file routing left it unread: an UnboundLocalError)."""
    out = tmp_path / "plan.txt"
    res = runner.invoke(app, ["search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "4096", "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    est = runner.invoke(app, ["estimate", str(out), "--json"])
    assert est.exit_code == 0, est.output  # the search's plan fits
    keys = ("tp", "pp", "dp", "micro_batch_size", "zero_stage", "recompute")
    written, read = json.loads(out.read_text())["plan"], json.loads(est.stdout)["plan"]
    assert [read[k] for k in keys] == [written[k] for k in keys]
    assert runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "r"), "-q"]).exit_code == 0


def test_a_partial_plan_file_completed_by_flags_is_not_read_as_a_launch_file(runner, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"training": {"num_gpus": 8, "global_batch_size": 8, "seq_len": 4096}}))
    res = runner.invoke(app, ["estimate", str(job), "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--tp", "1",
                              "--pp", "1", "--micro-batch-size", "1", "--zero-stage", "1", "--json"])
    assert res.exit_code in (0, 1), res.output
    assert json.loads(res.stdout)["plan"]["dp"] == 8


def test_a_launch_file_that_cannot_be_read_as_one_plan_is_refused(runner):
    case = str(LAUNCH / "megatron_size_case.sh")  # case ${MODEL_SIZE} in 7B) 13B) 70B)
    out = _bad(runner, ["estimate", case, "--hardware", "h100-sxm-80gb"], "launches 3 configurations", "70B")
    assert "plan3d check" in out
    _bad(runner, ["estimate", str(LAUNCH / "torchtitan_llama3_8b.toml")], "--hardware is required to read a launch file")
    for command in ("report", "emit"):  # plan files only: the error says which command reads a launch file
        for launch in ("torchtitan_llama3_8b.toml", "ds_config_gpt_1.3B.json"):
            _bad(runner, [command, str(LAUNCH / launch)], "not a plan file", "plan3d estimate")


def test_bad_plan_file_names_file_and_field(runner, tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text('{"model": "x", "hardware": {}, "training": {}, "plan": {"tp": 0}}')
    _bad(runner, ["estimate", str(plan_file)], str(plan_file), "plan.tp")


def test_estimate_job_options_overlap_and_framework(runner):
    job = ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "64", "--global-batch", "128",
           "--seq-len", "4096", "--tp", "2", "--pp", "1", "--sequence-parallel", "--json"]
    base = json.loads(runner.invoke(app, job).stdout)
    exposed = json.loads(runner.invoke(app, [*job, "--no-overlap-grad-reduce"]).stdout)
    assert exposed["time"]["breakdown"]["dp_comm_exposed"] > base["time"]["breakdown"]["dp_comm_exposed"]
    torch_sp = json.loads(runner.invoke(app, [*job, "--framework", "torch"]).stdout)
    # DTensor SP keeps the gathered inputs of the column-parallel linears: more activation memory
    assert torch_sp["memory"]["stages"][0]["activations_gib"] > base["memory"]["stages"][0]["activations_gib"]
    _bad(runner, [*job, "--framework", "jax"], "training.framework")
    res = runner.invoke(app, ["search", *job[1:11], "--framework", "torch", "--no-overlap-grad-reduce", "--top", "0",
                              "--json"])
    assert res.exit_code == 0, res.output


def test_estimate_uneven_layers_per_stage(runner):
    job = ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "64", "--global-batch", "64",
           "--seq-len", "4096", "--tp", "2", "--pp", "4"]
    even = json.loads(runner.invoke(app, [*job, "--json"]).stdout)
    res = runner.invoke(app, [*job, "--layers-per-stage", "6,9,9,8", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["plan"]["layers_per_stage"] == [6, 9, 9, 8]
    assert [s["layers"] for s in d["memory"]["stages"]] == [6, 9, 9, 8]
    table = runner.invoke(app, [*job, "--layers-per-stage", "6,9,9,8"]).output
    peak = d["memory"]["peak_stage"]  # tp 2 x dp 8 = 16 ranks per stage
    assert f"Peak on stage {peak} (global ranks {16 * peak}-{16 * peak + 15})" in table
    # the stage with 6 layers instead of 8 holds fewer weights; the stages with 9 hold more
    stages, even_stages = d["memory"]["stages"], even["memory"]["stages"]
    assert stages[0]["weights_gib"] < even_stages[0]["weights_gib"]
    assert stages[1]["weights_gib"] > even_stages[1]["weights_gib"]
    quiet = runner.invoke(app, [*job, "--layers-per-stage", "6,9,9,8", "--quiet"]).output
    assert "uneven 6/9/9/8" in quiet
    # an even split written out (a search's plan file stores [32] for pp 1) is not called uneven
    assert "uneven" not in runner.invoke(app, [*job, "--layers-per-stage", "8,8,8,8", "--quiet"]).output
    _bad(runner, [*job, "--layers-per-stage", "6,9,x"], "--layers-per-stage")
    _bad(runner, [*job, "--layers-per-stage", "8,8,8"], "layers_per_stage", "pp(4)")
    _bad(runner, [*job, "--layers-per-stage", "8,8,8,9"], "layers_per_stage", "num_layers(32)")


def test_show_json_loads_back_as_a_spec(runner, tmp_path):
    """`plan3d show NAME --json > FILE` writes a file that loads back (the derived figures it adds are checked, not
    refused as unknown keys), so a preset can be copied and edited: here to a longer context."""
    from planner.presets import load_hardware, load_model

    for name, load in (("llama3-8b", load_model), ("deepseek-v3", load_model), ("h100-sxm-80gb", load_hardware)):
        res = runner.invoke(app, ["show", name, "--json"])
        assert res.exit_code == 0, res.output
        path = tmp_path / f"{name}.json"
        path.write_text(res.output)
        back, preset = load(str(path)), load(name)
        if hasattr(preset, "kv_channels"):  # show writes head_dim resolved (hidden / heads where the preset has none)
            assert back.kv_channels == preset.kv_channels and back.model_copy(update={"head_dim": None}) == \
                preset.model_copy(update={"head_dim": None}), name
        else:
            assert back == preset, name
    doc = json.loads((tmp_path / "llama3-8b.json").read_text()) | {"max_seq_len": 65536}
    longer = tmp_path / "llama3-8b-64k.json"
    longer.write_text(json.dumps(doc))
    assert load_model(str(longer)).max_seq_len == 65536
    res = runner.invoke(app, ["estimate", "--model", str(longer), "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "65536", "--tp", "8", "--pp", "1"])
    assert res.exit_code in (0, 1), res.output  # judged (fits or not), not refused


@pytest.mark.parametrize("key, value, edit", [("kv_heads", 4, "num_kv_heads"), ("ffn_size", 1024, "ffn_hidden_size"),
                                              ("num_params", 7_000_000_000, "the shape fields")])
def test_an_edited_derived_figure_is_refused_naming_the_field(runner, tmp_path, key, value, edit):
    doc = json.loads(runner.invoke(app, ["show", "llama3-8b", "--json"]).output) | {key: value}
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    out = _bad(runner, ["show", str(path)], f"{key}: {value} is derived", f"edit {edit}")
    assert len([line for line in out.splitlines() if line.startswith("error:")]) == 1, out


def test_an_edited_usable_memory_is_refused_naming_its_inputs(runner, tmp_path):
    doc = json.loads(runner.invoke(app, ["show", "h100-sxm-80gb", "--json"]).output) | {"usable_memory_gib": 80}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(doc))
    _bad(runner, ["estimate", *JOB[:2], "--hardware", str(path), *JOB[4:], "--tp", "1", "--pp", "1"],
         "usable_memory_gib: 80 is derived", "edit gpu_memory_gib")


def test_a_sequence_past_the_models_context_names_the_fix(runner):
    """Megatron asserts --max-position-embeddings >= --seq-length and torchtitan refuses a seq_len above its RoPE
    max_seq_len, so plan3d refuses too, but says how to plan a longer context."""
    out = _bad(runner, ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8",
                        "--global-batch", "8", "--seq-len", "65536", "--tp", "8", "--pp", "1"],
               "seq_len: 65536 > max_seq_len(8192) of llama3-8b", "max_seq_len >= 65536", "plan3d show MODEL --json")
    assert "no parameters" in out
    out = _bad(runner, ["estimate", "--model", "gpt3-175b", "--hardware", "h100-sxm-80gb", "--gpus", "64",
                        "--global-batch", "64", "--seq-len", "4096", "--tp", "8", "--pp", "8"],
               "seq_len: 4096 > max_seq_len(2048) of gpt3-175b", "learned position table")
