"""`plan3d search` through the CLI: pins, top-K, infeasible exit 3, sweeps, JSON, plan files."""

import json

import pytest

from planner.cli import app

JOB = ["--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--global-batch", "64", "--seq-len", "4096"]


def _json(runner, args):
    res = runner.invoke(app, ["search", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_search_json_schema(runner):
    d = _json(runner, [*JOB, "--gpus", "16", "--top", "2"])
    assert set(d) >= {"plan", "memory", "flops", "time", "alternatives", "solver"}
    assert d["solver"]["status"] == "OPTIMAL" and d["solver"]["candidates"] > 100 and d["solver"]["wall_s"] > 0
    assert 0 < d["solver"]["cp_sat_s"] < d["solver"]["wall_s"]  # CP-SAT's part of the whole search
    assert len(d["alternatives"]) == 2
    for alt in d["alternatives"]:
        assert set(alt) >= {"plan", "memory", "time", "loses_on"}
        assert alt["time"]["step_time_s"] >= d["time"]["step_time_s"]
        assert alt["loses_on"]["term"] in d["time"]["breakdown"]
    assert d["memory"]["fits"]


def test_pins(runner):
    d = _json(runner, [*JOB, "--gpus", "16", "--tp", "4", "--recompute", "full", "--zero-stage", "1",
                       "--micro-batch-size", "1", "--no-sequence-parallel", "--top", "0"])
    p = d["plan"]
    assert (p["tp"], p["recompute"], p["zero_stage"], p["micro_batch_size"], p["sequence_parallel"]) == \
        (4, "full", 1, 1, False)
    d = _json(runner, [*JOB, "--gpus", "16", "--pp", "2", "--vpp", "2", "--top", "0"])
    assert (d["plan"]["pp"], d["plan"]["vpp"]) == (2, 2)


def test_table_shows_alternatives_and_reasons(runner):
    res = runner.invoke(app, ["search", *JOB, "--gpus", "16", "--top", "2"])
    assert res.exit_code == 0, res.output
    assert "Best plan and alternatives" in res.output and "OPTIMAL" in res.output
    assert " +" in res.output  # each alternative names the term it loses on


def test_quiet_prints_only_the_best_plan(runner):
    res = runner.invoke(app, ["search", *JOB, "--gpus", "16", "--top", "2", "--quiet"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("best: ") and "step" in lines[0] and "GiB" in lines[0]
    assert "Best plan and alternatives" not in res.output


def test_infeasible_exit_3_names_binding_constraint_and_smallest_cluster(runner):
    res = runner.invoke(app, ["search", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "2048"])
    assert res.exit_code == 3
    assert "needing" in res.output and "GiB usable" in res.output
    # 8 x 2^k first (64 fits, 32 does not), then whole nodes between 32 and 64: 40 is the first that fits
    assert "the smallest GPU count that fits is 40 (tried 8 x 2^k, then steps of 8 between 32 and 64)" in res.output
    res = runner.invoke(app, ["search", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "2048", "--json"])
    assert res.exit_code == 3
    d = json.loads(res.stdout)  # the same answer as data on stdout
    assert d["plan"] is None and d["smallest_fitting_gpus"] == 40 and d["solver"]["status"] == "INFEASIBLE"
    assert d["closest"]["peak_gib"] > d["closest"]["usable_gib"] and d["closest"]["plan"]["tp"] >= 1
    assert len(d["message"]) == 2 and d["message"][0].startswith("no plan fits gpt3-175b on 8 x a100-80gb")
    for gpus, code in ((40, 0), (32, 3)):  # what the search itself says at those counts
        res = runner.invoke(app, ["search", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", str(gpus),
                                  "--global-batch", "8", "--seq-len", "2048", "--quiet"])
        assert res.exit_code == code, res.output


def test_sweep_list_and_range(runner):
    d = _json(runner, [*JOB, "--gpus", "8..32"])
    assert [r["gpus"] for r in d["sweep"]] == [8, 16, 32]
    assert d["smallest_fitting_gpus"] == 8
    assert all(r["fits"] and r["time"]["tokens_per_s"] > 0 for r in d["sweep"])
    res = runner.invoke(app, ["search", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "8,64",
                              "--global-batch", "64", "--seq-len", "2048", "--quiet"])
    assert res.exit_code == 0 and "no plan fits" in res.output
    assert "Smallest GPU count in the sweep that fits: 64" in res.output


def test_exhaustive_flag_agrees(runner):
    a = _json(runner, [*JOB, "--gpus", "8", "--top", "0"])
    b = _json(runner, [*JOB, "--gpus", "8", "--exhaustive"])
    assert b["solver"]["status"] == "EXHAUSTIVE" and b["solver"]["cp_sat_s"] is None
    assert abs(a["time"]["step_time_s"] / b["time"]["step_time_s"] - 1) < 1e-6


def test_out_writes_plan_file_that_estimate_reads(runner, tmp_path):
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["search", *JOB, "--gpus", "16", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    again = runner.invoke(app, ["estimate", str(out), "--json"])
    assert again.exit_code == 0, again.output
    est = json.loads(again.stdout)
    assert est["plan"]["tp"] * est["plan"]["pp"] * est["plan"]["dp"] * est["plan"]["cp"] == 16
    # never overwrite without --force
    before = out.read_text()
    res = runner.invoke(app, ["search", *JOB, "--gpus", "8", "--out", str(out)])
    assert res.exit_code == 2 and "--force" in res.output and out.read_text() == before
    res = runner.invoke(app, ["search", *JOB, "--gpus", "8", "--out", str(out), "--force", "--quiet"])
    assert res.exit_code == 0 and out.read_text() != before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary files left


def test_bad_search_input(runner):
    for args, needle in ((["--gpus", "abc"], "--gpus"), (["--gpus", "64..8"], "--gpus"),
                         (["--gpus", "8", "--recompute", "half"], "--recompute")):
        res = runner.invoke(app, ["search", *JOB, *args])
        assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output


def test_json_silences_the_spinner(runner):
    res = runner.invoke(app, ["search", *JOB, "--gpus", "8", "--json", "--top", "0"])
    json.loads(res.stdout)  # nothing but JSON on stdout


PIN_CASES = [  # (framework, model, pins, refused): each refusal is one the search would find no plan for
    ("deepspeed", "tiny-gpt", {"pp": 2, "vpp": 2}, "vpp: deepspeed's pipeline has no interleaved schedule"),
    ("deepspeed", "tiny-gpt", {"cp": 2}, "cp: deepspeed has no context parallelism"),
    ("deepspeed", "tiny-moe", {"ep": 2}, "ep: deepspeed as plan3d emits it has no expert parallelism"),
    ("deepspeed", "tiny-gpt", {"pp": 2, "zero_stage": 3}, "zero_stage: deepspeed runs ZeRO [0, 1] with pp=2"),
    ("torchtitan", "tiny-gpt", {"cpu_offload_layers": 2}, "cpu_offload_layers: torchtitan as plan3d emits it has no"),
    ("torchtitan", "tiny-moe", {"ep": 2, "zero_stage": 0, "tp": 1, "cp": 1}, "lives inside its FSDP mesh"),
    ("torchtitan", "tiny-moe", {"ep": 2, "zero_stage": 0}, None),  # tp or cp 2 gives EP its ranks without FSDP
    ("megatron", "tiny-gpt", {"pp": 2, "vpp": 2, "zero_stage": 1}, None),
    ("megatron", "tiny-gpt", {"pp": 2, "cpu_offload_layers": 2}, "offloads activations only without pipeline"),
    ("megatron", "tiny-gpt", {"recompute": "full", "cpu_offload_layers": 2}, "only without recomputation"),
    ("megatron", "tiny-gpt", {"cpu_offload_layers": 2}, None),
    ("torchtitan", "tiny-moe", {"tp": 2, "ep": 2, "etp": 2}, "etp: torchtitan runs experts with etp=1 when ep=2"),
    ("torchtitan", "tiny-moe", {"tp": 2, "etp": 1}, None),  # legal with the ep the search picks (> 1)
    ("torchtitan", "tiny-gpt", {"cp": 2, "zero_stage": 0}, "shards the parameters over the context-parallel ranks"),
    ("torchtitan", "tiny-gpt", {"zero_stage": 0}, None),  # cp 1 is the search's to pick
]


@pytest.mark.parametrize("framework,model,pins,refused", PIN_CASES)
def test_pins_a_framework_cannot_run_are_refused_up_front(runner, framework, model, pins, refused):
    """`search --framework F` with a pin F does not run says which pin and why (exit 2), not "no legal plan";
    and it refuses only what the search itself could not find a plan for."""
    from planner.candidates import Pins, SearchSpace, pinned_problems
    from planner.presets import load_hardware, load_model
    from planner.search import search
    from planner.specs import TrainingSpec

    lines = pinned_problems(framework, Pins(**pins))
    assert (refused is None and not lines) or (len(lines) == 1 and refused in lines[0]), lines
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=512, framework=framework)
    found = search(load_model(model), load_hardware("h100-sxm-80gb"), tr, SearchSpace(pins=Pins(**pins))).best
    assert (found is None) == (refused is not None)
    flags = [w for k, v in pins.items() for w in (f"--{k.replace('_', '-')}", str(v))]
    res = runner.invoke(app, ["search", "--model", model, "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "16", "--seq-len", "512", "--framework", framework, *flags, "--quiet"])
    if refused:
        assert res.exit_code == 2 and refused in res.output and "Traceback" not in res.output, res.output
    else:
        assert res.exit_code == 0, res.output


@pytest.mark.parametrize("model,emit,refused", [
    ("bloom-176b", "megatron", "--format megatron: bloom-176b: position_embedding: alibi is not a Megatron-LM"),
    ("bloom-176b", "torchrun,deepspeed", "--format torchrun: bloom-176b: position_embedding: alibi"),
    ("gpt3-175b", "torchtitan", "--emit torchtitan: torchtitan ships no model for gpt3-175b"),
    ("llama3-8b", "megatron,foo", "--format/--emit: unknown foo"),
])
def test_search_emit_refuses_what_no_plan_can_fix_before_searching(runner, monkeypatch, tmp_path, model, emit, refused):
    """A launch format that cannot build the model (or does not exist) is refused before the search runs, exit 2,
    one line; nothing is written, not even the --out plan file (it used to be written, then the emit failed)."""
    import planner.cli.plan as cli_plan

    def no_search(*a, **k):
        raise AssertionError("the search ran")

    monkeypatch.setattr(cli_plan, "_run_search", no_search)
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["search", "--model", model, "--hardware", "h100-sxm-80gb", "--gpus", "64",
                              "--global-batch", "128", "--seq-len", "2048", "--emit", emit, "--out-dir",
                              str(tmp_path / "launch"), "--out", str(out), "--quiet"])
    assert res.exit_code == 2 and refused in res.output and "Traceback" not in res.output, res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output
    assert not out.exists() and not (tmp_path / "launch").exists()


def test_search_emit_refuses_nemo_1_apex_states_in_a_megatron_launch_before_searching(runner, monkeypatch, tmp_path):
    """NeMo 1's Apex optimizer (optimizer_dtype bf16-apex) has no Megatron-LM flag: the Megatron launch formats
    refuse it before the search, as they do a model gap; the plan file alone is written."""
    import planner.cli.plan as cli_plan

    def no_search(*a, **k):
        raise AssertionError("the search ran")

    monkeypatch.setattr(cli_plan, "_run_search", no_search)
    job = ["search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "16", "--global-batch", "32",
           "--seq-len", "2048", "--framework", "nemo", "--optimizer-dtype", "bf16-apex", "--quiet"]
    res = runner.invoke(app, [*job, "--emit", "slurm", "--out-dir", str(tmp_path / "launch")])
    assert res.exit_code == 2 and "--format slurm: optimizer_dtype bf16-apex is NeMo 1's Apex" in res.output, res.output
    assert not (tmp_path / "launch").exists()
    monkeypatch.undo()
    res = runner.invoke(app, [*job, "--emit", "plan", "--out-dir", str(tmp_path / "plan")])
    assert res.exit_code == 0, res.output
    assert any(f.name.endswith(".plan.json") for f in (tmp_path / "plan").iterdir())


def test_search_emit_a_format_that_can_build_the_model_still_searches(runner, tmp_path):
    # BLOOM's ALiBi has no Megatron-LM flag, but DeepSpeed's config holds no model: that emit is not refused
    res = runner.invoke(app, ["search", "--model", "bloom-176b", "--hardware", "a100-80gb", "--gpus", "384",
                              "--global-batch", "2048", "--seq-len", "2048", "--framework", "deepspeed",
                              "--emit", "deepspeed", "--out-dir", str(tmp_path), "--quiet"])
    assert res.exit_code == 0, res.output
    assert any(p.name.endswith(".deepspeed.json") for p in tmp_path.iterdir())


def test_no_legal_plan_without_pins_does_not_blame_pins(runner, monkeypatch):
    from planner import search as S

    monkeypatch.setattr(S, "search", lambda *a, **k: S.SearchResult(best=None, candidates=0))
    monkeypatch.setattr(S, "smallest_fitting_gpus", lambda *a, **k: None)
    base = ["search", *JOB, "--gpus", "8", "--quiet"]
    res = runner.invoke(app, base)
    assert res.exit_code == 3 and "no legal plan for 8 GPUs under megatron" in res.output, res.output
    assert "with these pins" not in res.output
    res = runner.invoke(app, [*base, "--tp", "2"])
    assert res.exit_code == 3 and "with these pins" in res.output, res.output


@pytest.mark.parametrize("pins,gpus,batch,why", [
    # OPT-175B's layout with a batch its data-parallel size does not divide: 992 / 8 = 124 replicas, 1024 sequences
    (["--tp", "8", "--pp", "1", "--cp", "1"], "992", "1024",
     "global_batch_size: 1024 is not divisible by micro_batch_size(1) * dp(124) = 124"),
    # cp searched: every dp the pins leave (96 / 8 / cp) fails the batch with micro-batch 4
    (["--tp", "2", "--pp", "4", "--micro-batch-size", "4"], "96", "1538",
     "global_batch_size: 1538 is not divisible by micro_batch_size(4) * dp for any dp these pins leave "
     "(12, 6, 4, 3, 2, 1)"),
    (["--tp", "2", "--pp", "5"], "96", "1536", "plan: tp(2) * pp(5) = 10 does not divide num_gpus(96)"),
    # cp searched, and no one rule binds: cp 1, 2 and 4 leave dp 124, 62 and 31, none of which divides 1000; cp 31, 62
    # and 124 leave dp 4, 2 and 1, which do, but split no 4,096-token sequence into 2 x cp chunks (pinned_split_problems)
    (["--tp", "8", "--pp", "1"], "992", "1000",
     "global_batch_size: 1000 is not divisible by micro_batch_size(1) * dp(124) = 124 (tp 8 x pp 1 x cp 1 x dp 124, "
     "and 2 more splits); cp: seq_len(4096) is not divisible by 2 * cp(31) = 62 (load-balanced causal split) "
     "(tp 8 x pp 1 x cp 31 x dp 4, and 2 more splits)"),
    # a tp that divides neither the GPUs nor the heads: both said, the heads being what no GPU count rescues
    (["--tp", "3"], "8", "8", "plan: tp(3) = 3 does not divide num_gpus(8); tp: num_attention_heads(32) is not "
     "divisible by tp(3)"),
    (["--pp", "64"], "64", "64", "pp: pp(64) is more than num_layers(32); every stage holds a layer"),
    (["--pp", "1", "--vpp", "2"], "16", "16", "vpp: vpp(2) > 1 needs pp > 1 (pp is 1)"),
    (["--pp", "8", "--vpp", "8"], "64", "64", "vpp: pp(8) * vpp(8) = 64 model chunks for num_layers(32); every chunk "
     "but the first and the last holds a layer, so at most 34"),
])
def test_no_legal_plan_names_the_pin_that_binds(runner, pins, gpus, batch, why):
    """A pinned layout no search can complete says which rule the pins break (`plan_problems`' words), not the
    generic "check --tp/--pp/..." line, and the smallest-cluster line does not call a layout problem a fit."""
    res = runner.invoke(app, ["search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", gpus,
                              "--global-batch", batch, "--seq-len", "4096", *pins, "--quiet"])
    assert res.exit_code == 3, res.output
    assert f"no legal plan for {gpus} GPUs with these pins: {why}" in res.output, res.output
    assert "has a legal plan that fits" in res.output and "check --tp" not in res.output


def test_pinned_split_problems_is_empty_where_a_split_passes():
    """Where some split the pins leave breaks no layout rule, the reason the search found none lies elsewhere (what the
    framework runs, the micro-batch options): no rule is named, and the CLI keeps its generic line."""
    from planner.candidates import Pins, pinned_split_problems
    from planner.presets import load_hardware, load_model
    from planner.specs import TrainingSpec

    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    job = TrainingSpec(num_gpus=992, global_batch_size=992, seq_len=4096)  # tp 8 x cp 1 leaves dp 124, which divides it
    assert pinned_split_problems(model, hw, job, Pins(tp=8, pp=1)) == []
    assert len(pinned_split_problems(model, hw, job.model_copy(update={"global_batch_size": 1000}),
                                     Pins(tp=8, pp=1))) == 2
    # a pp that does not divide the 32 layers is probed with the uneven split the search would try (15 + 16 + 1 would
    # not do: valid_splits keeps the ends within MAX_UNEVEN_SHIFT of the middle), so it breaks no layout rule here
    assert pinned_split_problems(model, hw, job.model_copy(update={"num_gpus": 24, "global_batch_size": 24}),
                                 Pins(pp=3)) == []
    # Plan's own rule (vpp > 1 needs pp > 1), which a constructed probe would not check
    assert pinned_split_problems(model, hw, job.model_copy(update={"num_gpus": 1, "global_batch_size": 8}),
                                 Pins(vpp=2)) == ["vpp: vpp(2) > 1 needs pp > 1 (pp is 1) (tp 1 x pp 1 x cp 1 x dp 1)"]


def test_no_legal_plan_names_dist_optimizer_instances_that_divide_no_dp(runner):
    """--dist-optimizer-instances N must divide dp x cp (core_v0.16.1 parallel_state.py); with N not dividing the GPU
    count no split holds it, and the line says so instead of "no tp x pp x cp x dp split suits the model's heads"."""
    res = runner.invoke(app, ["search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "16",
                              "--global-batch", "16", "--seq-len", "4096", "--dist-optimizer-instances", "3",
                              "--quiet"])
    assert res.exit_code == 3, res.output
    assert "--dist-optimizer-instances 3 must divide dp x cp" in res.output and "heads and layers" not in res.output


def test_one_line_per_problem_of_a_misplaced_microbatch_group(runner):
    """--microbatch-group-size without interleaving: one line (it said the same thing twice in other words)."""
    res = runner.invoke(app, ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "16",
                              "--global-batch", "16", "--seq-len", "4096", "--tp", "2", "--pp", "2",
                              "--microbatch-group-size", "3"])
    assert res.exit_code == 2 and res.output.count("microbatch_group_size") == 1, res.output


def test_sequence_parallel_pinned_with_tp_1_runs_as_megatron_runs_it(runner):
    """Megatron-LM turns sequence parallelism off at tp 1 (core_v0.16.1 arguments.py: "Disabling sequence
    parallelism because tensor model parallelism is disabled"), so a published layout with TP 1 and SP on ran:
    the search plans it with SP off instead of finding no legal plan; with tp searched, SP on means SP wherever
    there is TP (candidates.Pins.sp_ok): every tp > 1 plan has it, a tp 1 plan has none."""
    d = _json(runner, [*JOB, "--gpus", "8", "--tp", "1", "--pp", "1", "--sequence-parallel"])
    assert d["plan"]["tp"] == 1 and d["plan"]["sequence_parallel"] is False
    d = _json(runner, [*JOB, "--gpus", "8", "--tp", "2", "--sequence-parallel"])
    assert d["plan"]["tp"] == 2 and d["plan"]["sequence_parallel"] is True
    d = _json(runner, [*JOB, "--gpus", "8", "--sequence-parallel", "--top", "5"])
    plans = [d["plan"], *(a["plan"] for a in d["alternatives"])]
    assert any(p["tp"] > 1 for p in plans)
    assert all(p["sequence_parallel"] is (p["tp"] > 1) for p in plans)


def test_precision_fp16_is_a_bf16_costed_job_in_fp16(runner, tmp_path):
    """``--precision fp16`` (the A100-era format: Megatron --fp16, DeepSpeed fp16.enabled) is the job's 16-bit
    format, costed as bf16 (TrainingSpec.fp16): the plan file records it, the Megatron file says --fp16, the
    DeepSpeed config enables fp16, and torchtitan, which has no fp16 parameter dtype, refuses it up front; a later
    ``--precision bf16`` over that plan file is bf16 again."""
    from planner.cli.inputs import scenario_from_options

    job = ["--model", "llama3-8b", "--hardware", "a100-80gb", "--global-batch", "64", "--seq-len", "4096",
           "--gpus", "16"]
    plan = tmp_path / "fp16.plan.json"
    res = runner.invoke(app, ["search", *job, "--precision", "fp16", "--out", str(plan), "--quiet"])
    assert res.exit_code == 0, res.output
    training = json.loads(plan.read_text())["training"]
    assert (training["precision"], training["fp16"]) == ("bf16", True)
    bf16 = _json(runner, [*job, "--precision", "bf16"])
    fp16 = _json(runner, [*job, "--precision", "fp16"])
    assert fp16["time"]["step_time_s"] == bf16["time"]["step_time_s"] and fp16["plan"] == bf16["plan"]
    out = tmp_path / "launch"
    res = runner.invoke(app, ["emit", str(plan), "--format", "megatron,deepspeed", "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    args = next(out.glob("*.megatron.args")).read_text().split()
    assert "--fp16" in args and "--bf16" not in args
    ds = json.loads(next(out.glob("*.deepspeed.json")).read_text())
    assert ds["fp16"]["enabled"] is True and ds["bf16"]["enabled"] is False
    res = runner.invoke(app, ["search", *job, "--precision", "fp16", "--emit", "torchtitan"])
    assert res.exit_code == 2 and "torchtitan 0.3.0 trains in bfloat16 or float32" in res.output, res.output
    res = runner.invoke(app, ["search", *job, "--precision", "fp16", "--framework", "torchtitan"])
    assert res.exit_code == 2 and "fp16: torchtitan 0.3.0 trains in bfloat16 or float32" in res.output, res.output
    again = scenario_from_options(str(plan), model=None, hardware=None, gpus=None, global_batch=None, seq_len=None,
                                  precision="bf16")
    assert again.training.fp16 is False


def test_search_says_before_searching_what_emit_of_the_plan_will_refuse(runner, tmp_path):
    """A plan searched for torchtitan of a model torchtitan ships no config for (Mixtral-8x7B) cannot be emitted in
    the framework's own format: `plan3d emit plan.json` refuses it. The search says so on stderr, once, with the
    reason, and still writes the plan (its memory and time stand); --quiet and --json stay silent."""
    job = ["search", "--model", "mixtral-8x7b", "--hardware", "h100-sxm-80gb", "--gpus", "64", "--global-batch",
           "512", "--seq-len", "4096", "--framework", "torchtitan", "--top", "0", "--pp", "1"]
    out = tmp_path / "plan.json"
    res = runner.invoke(app, [*job, "--out", str(out)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("note: `plan3d emit` will not write this job's torchtitan launch files (1 reason")
    assert lines[1] == ("  - torchtitan ships no model for mixtral-8x7b; it has deepseek-v3, llama3-405b, llama3-70b, "
                        "llama3-8b, qwen3-30b-a3b among plan3d's presets (use --format megatron, or search with "
                        "--framework megatron for a plan Megatron-LM runs)")
    assert out.exists()
    emitted = runner.invoke(app, ["emit", str(out), "--out-dir", str(tmp_path / "launch")])
    assert emitted.exit_code == 2 and "torchtitan ships no model for mixtral-8x7b" in emitted.output
    for quiet in ("--quiet", "--json"):
        res = runner.invoke(app, [*job, quiet])
        assert res.exit_code == 0 and "plan3d emit" not in res.output, res.output
    plain = runner.invoke(app, [*job[:-6], "--top", "0", "--pp", "1"])  # the Megatron default: its files can be written
    assert plain.exit_code == 0 and "note: `plan3d emit`" not in plain.output, plain.output
    gaps = ["search", "--model", "gpt-oss-20b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "16",
            "--seq-len", "4096", "--top", "0", "--tp", "1", "--pp", "1", "--micro-batch-size", "1"]
    megatron = runner.invoke(app, gaps)  # three Megatron-LM gaps of GPT-OSS, one line each under the note
    assert megatron.exit_code == 0 and "launch files (3 reasons" in megatron.output, megatron.output
    torch_run = runner.invoke(app, [*gaps, "--framework", "torch"])  # plan3d validate's run: no launch format
    assert torch_run.exit_code == 0 and "note: `plan3d emit`" not in torch_run.output, torch_run.output
