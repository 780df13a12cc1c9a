"""`plan3d check` on launch files in the style of each framework's own examples (tests/data/launch).

Each case in tests/data/launch/expected.json gives the exit code the gate must give and the figures it
must read; tests/data/launch/README.md says where each file's style comes from and how each figure
follows from the file and the framework's rules.
"""

import json
from pathlib import Path

import pytest

from planner.check import check_file, check_file_branches, check_paths, exit_code
from planner.cli import app
from planner.emit import render_all
from planner.memory import estimate_scenario_memory
from planner.presets import load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec

LAUNCH = Path(__file__).parent / "data" / "launch"
CASES = json.loads((LAUNCH / "expected.json").read_text())["cases"]


def _figures(result) -> dict:
    sc = result.scenario
    plan, model, tr = sc.resolved_plan(), sc.model, sc.training
    out = plan.model_dump() | model.model_dump() | tr.model_dump()
    out["fits"] = estimate_scenario_memory(sc).fits
    return out


def _case_id(case) -> str:
    extra = [f"{k}={case[k]}" for k in ("hardware", "gpus", "vocab_size") if k in case]
    return f"{case['file']}[{','.join(extra)}]"


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=case["xfail"])] if "xfail" in case else []
        yield pytest.param(case, id=_case_id(case), marks=marks)


@pytest.mark.parametrize("case", _params())
def test_launch_file_exit_code_and_figures(case):
    path = LAUNCH / case["file"]
    results = check_file_branches(path, load_hardware(case["hardware"]), None, case.get("gpus"),
                                  case.get("vocab_size"))
    assert exit_code(results) == case["exit"], [(r.branch, r.errors) for r in results]
    if case["exit"] == 2:
        assert len(results) == 1 and case["error"] in results[0].errors[0], results[0].errors
        assert "\n" not in results[0].errors[0]  # one line
        return
    expected = case.get("results", [])
    if expected:
        assert len(results) == len(expected), [r.branch for r in results]
    for want, got in zip(expected, results):
        if "branch" in want:
            assert want["branch"] in (got.branch or ""), got.branch
        figures = _figures(got)
        for key, value in want.items():
            if key != "branch":
                assert figures[key] == value, (key, got.branch)


def test_every_file_in_the_folder_has_a_case():
    files = {p.name for p in LAUNCH.iterdir() if p.is_file() and p.name not in ("README.md", "expected.json")}
    assert files == {c["file"] for c in CASES}


def test_branches_that_exit_are_dropped_and_identical_branches_merge():
    # megatron_llama3_8b_fp8.sh forks on `[ ! -f "$PRETRAIN_SCRIPT_PATH" ]` (the branch exits) and decides
    # `[[ "$DTYPE" == "fp8" ]]` from a literal: one result, no branch label.
    (r,) = check_file_branches(LAUNCH / "megatron_llama3_8b_fp8.sh", load_hardware("h200-141gb"), None, None)
    assert r.branch is None and not r.errors
    assert any("turns it off" in n for n in r.notes) and any("NullTokenizer" in n for n in r.notes)


def test_check_file_returns_the_worst_branch():
    r = check_file(LAUNCH / "megatron_size_case.sh", load_hardware("h100-sxm-80gb"), None, None)
    assert "70B)" in r.branch and not estimate_scenario_memory(r.scenario).fits
    assert any("worst of 3 branches" in n for n in r.notes)


def test_cli_check_names_the_failing_branch_stage_and_ranks(runner):
    res = runner.invoke(app, ["check", str(LAUNCH / "megatron_size_case.sh"), "--hardware", "h100-sxm-80gb",
                              "--format", "github"])
    assert res.exit_code == 1, res.output
    assert "stage 0 (global ranks 0-7)" in res.stdout  # tp 8 x dp 1 ranks hold stage 0


@pytest.mark.parametrize("name,code", [("megatron_moe.sh", 1), ("megatron_mamba.sh", 2),
                                       ("megatron_llama3_8b_fp8_quoted.sh", 2), ("megatron_if_branch.sh", 1),
                                       ("megatron_llama3_70b.slurm", 0)])
def test_cli_exit_codes(runner, name, code):
    res = runner.invoke(app, ["check", str(LAUNCH / name), "--hardware", "h100-sxm-80gb"])
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output


def _llama_scenario(**plan):
    base = dict(tp=8, pp=4, dp=2, micro_batch_size=1, recompute="selective", sequence_parallel=True, zero_stage=1)
    return Scenario(model=load_model("llama3-70b"), hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192),
                    plan=Plan(**(base | plan)))


def test_a_folder_plan3d_emitted_checks_whole(tmp_path):
    """`plan3d check launch/*` on everything `plan3d emit` writes: every file is read, none refused. Each is judged
    as its framework runs it: the Megatron and DeepSpeed files of this Megatron-planned layout fit, and the
    torchtitan file is judged by the torchtitan profile (FSDP2 under PP keeps the stage's bf16 parameters and
    fp32 gradients whole), as `estimate --framework torchtitan` judges the same plan."""
    from planner.memory import estimate_scenario_memory

    sc = _llama_scenario()  # vpp 1: DeepSpeed's pipeline engine has no interleaved schedule (emit refuses it)
    for name, text in render_all(sc, ["megatron", "torchrun", "slurm", "deepspeed", "torchtitan", "plan"]).items():
        (tmp_path / name).write_text(text)
    files = sorted(str(p) for p in tmp_path.iterdir())
    assert {Path(f).suffix for f in files} >= {".json", ".args", ".sh", ".slurm"}
    results = check_paths(files, load_hardware("h100-sxm-80gb"), None, None)
    assert [r.errors for r in results if r.errors] == []
    titan = [r for r in results if r.path.name.endswith(".torchtitan.sh")]
    assert len(titan) == 1 and titan[0].scenario.training.framework == "torchtitan"
    as_titan = sc.model_copy(update={"training": sc.training.model_copy(update={"framework": "torchtitan"})})
    titan_fits = estimate_scenario_memory(titan[0].scenario).fits
    assert titan_fits == estimate_scenario_memory(as_titan.model_copy(update={"plan": titan[0].scenario.plan})).fits
    assert all(estimate_scenario_memory(r.scenario).fits for r in results if r not in titan)
    assert exit_code(results) == (0 if titan_fits else 1)
    for r in results:  # the slurm script's MODE=validate branch runs plan3d, not a training: dropped
        assert r.branch is None, (r.path, r.branch)
        p = r.scenario.resolved_plan()
        assert (p.tp, p.pp, p.dp, p.vpp, p.micro_batch_size, p.num_microbatches) == (8, 4, 2, 1, 1, 64), r.path
        assert r.scenario.training.global_batch_size == 128 and r.scenario.model.num_layers == 80


def test_vocab_override_and_padding_note(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text((LAUNCH / "megatron_hf_tokenizer_unknown.sh").read_text().replace(
        "--bf16", "--bf16 --make-vocab-size-divisible-by 64"))
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None, vocab_size=50000)
    # Megatron pads 50000 to a multiple of 64 x tp(1): 50048; plan3d's estimator pads to 128 x tp: 50048 too
    assert r.scenario.model.vocab_size == 50048 and not r.errors
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None, vocab_size=50100)
    # 50100 -> 50112 (64); the estimator pads 50112 -> 50176 (128): the note says 64 rows more
    assert r.scenario.model.vocab_size == 50112
    assert any("64 rows more" in n for n in r.notes)


def test_unknown_value_is_named(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers $LAYERS --hidden-size 1024 "
                      "--num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
                      "--micro-batch-size 1 --vocab-size 50000 --tokenizer-type NullTokenizer\n")
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None)
    assert r.errors and "$LAYERS" in r.errors[0] and "--num-layers" in r.errors[0] and r.line == 1


def test_deepspeed_pipeline_refuses_zero_2(tmp_path):
    for name in ("megatron_deepspeed_llama2.sh",):
        text = (LAUNCH / name).read_text().replace("ZERO_STAGE=0", "ZERO_STAGE=2")
        (tmp_path / name).write_text(text)
        (r,) = check_file_branches(tmp_path / name, load_hardware("h100-sxm-80gb"), None, None, vocab_size=32000)
        assert r.errors and "pipeline engine" in r.errors[0]


def test_deepspeed_config_disagreeing_with_the_flags(tmp_path):
    for name in ("megatron_deepspeed_gpt_1.3B.sh", "ds_config_gpt_1.3B.json"):
        (tmp_path / name).write_text((LAUNCH / name).read_text())
    cfg = tmp_path / "ds_config_gpt_1.3B.json"
    cfg.write_text(cfg.read_text().replace('"train_micro_batch_size_per_gpu": 8', '"train_micro_batch_size_per_gpu": 4'))
    (r,) = check_file_branches(tmp_path / "megatron_deepspeed_gpt_1.3B.sh", load_hardware("h100-sxm-80gb"), None, None)
    assert r.errors and "train_micro_batch_size_per_gpu 4" in r.errors[0]
    lone = tmp_path / "other.json"
    lone.write_text('{"train_batch_size": 8}')
    (r,) = check_file_branches(lone, load_hardware("h100-sxm-80gb"), None, None)
    assert r.errors and "holds no model" in r.errors[0]


HOSTILE = {
    "tp0.sh": "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
              "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --tokenizer-type NullTokenizer "
              "--vocab-size 100 --tensor-model-parallel-size 0\n",
    "divisor0.sh": "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                   "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --tokenizer-type NullTokenizer "
                   "--vocab-size 100 --make-vocab-size-divisible-by 0\n",
    "tp_text.toml": '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ntensor_parallel_degree = "x"\n',
    "tp_neg.toml": '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ntensor_parallel_degree = -3\n',
    "seq_list.toml": '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nseq_len = [1]\n',
    "bad.toml": "[model\nname=",
    "stage.json": '{"train_batch_size": 8, "zero_optimization": []}',
    "notjson.json": "{",
    "nolaunch.sh": "echo hello\n",
    "elastic.sh": "torchrun --nnodes 1:4 --nproc_per_node 8 pretrain_gpt.py --num-layers 2\n",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_input_is_one_line_exit_2(runner, tmp_path, name):
    path = tmp_path / name
    path.write_text(HOSTILE[name])
    res = runner.invoke(app, ["check", str(path), "--hardware", "h100-sxm-80gb", "--gpus", "8"])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    results = check_file_branches(path, load_hardware("h100-sxm-80gb"), None, 8)
    assert len(results) == 1 and len(results[0].errors) >= 1 and name in results[0].errors[0]


SEEDS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".slurm", ".toml"))


def test_corrupted_launch_files_never_raise_and_stay_fast(tmp_path):
    """Random edits of every launch file here: a result or a one-line error, each within 5 s."""
    import time

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    hw = load_hardware("h100-sxm-80gb")

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(seed=st.sampled_from(SEEDS), edits=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(["del", "ins", "dup"]),
                                                                  st.text(alphabet="\"'$(){}[]#\\\n =-0123456789abx;|&`",
                                                                          max_size=6)), min_size=1, max_size=5))
    def run(seed, edits):
        text = seed.read_text()
        for where, op, piece in edits:
            i = int(where * (len(text) - 1))
            text = {"del": text[:i] + text[i + len(piece) + 1:], "ins": text[:i] + piece + text[i:],
                    "dup": text[:i] + text[i:i + 40] + text[i:]}[op]
        path = tmp_path / seed.name
        path.write_text(text)
        start = time.perf_counter()
        results = check_file_branches(path, hw, None, 64 if seed.suffix == ".toml" else None, None)
        assert time.perf_counter() - start < 5
        for r in results:
            assert r.scenario is not None or (r.errors and all("\n" not in e for e in r.errors))

    run()


def test_json_output_names_branches_and_notes():
    from planner.check import to_json

    results = check_paths([str(LAUNCH / "megatron_size_case.sh"), str(LAUNCH / "megatron_moe.sh")],
                          load_hardware("h100-sxm-80gb"), None, None)
    out = json.loads(to_json(results))
    assert [o["valid"] for o in out] == [True, True, True, True]
    assert [o["fits"] for o in out] == [True, True, False, False]  # the MoE file: see tests/data/launch/README.md
    assert all("case ${MODEL_SIZE} in" in o["branch"] for o in out[:3]) and out[3]["branch"] is None
    assert any("vocabulary" in n for n in out[0]["notes"])


def test_no_precision_flag_is_fp32_as_in_megatron(tmp_path):
    """Megatron-LM trains in fp32 unless --bf16/--fp16 (arguments.py: params_dtype torch.float by default)."""
    script = tmp_path / "fp32.sh"
    script.write_text((LAUNCH / "megatron_gqa_default.sh").read_text().replace("--bf16 ", ""))
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None)
    assert r.scenario.training.precision == "fp32" and any("fp32" in n for n in r.notes)


def test_uniform_recompute_in_groups_is_read_as_megatron_runs_it(tmp_path):
    """--recompute-method uniform --recompute-num-layers 2 on 16 layers per stage: 8 groups of 2, each checkpointed
    at its input and recomputed whole (core_v0.16.1 transformer_block.py _checkpointed_forward): half of full
    recompute's saved inputs, and a two-layer working set in the backward. Under --deepspeed (no groups there) it
    stays no recompute, an upper bound."""
    script = tmp_path / "uniform.sh"
    text = (LAUNCH / "megatron_gqa_default.sh").read_text()
    flags = ("--bf16 --pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method uniform "
             "--recompute-num-layers 2")
    script.write_text(text.replace("--bf16", flags))
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, 16)
    plan = r.scenario.plan
    assert (plan.recompute, plan.recompute_num_layers, plan.recompute_group_layers) == ("full", None, 2)
    assert not any("upper bound" in n for n in r.notes)
    from planner.memory import stage_saved_bytes

    sc = r.scenario
    m = sc.training.global_batch_size // (plan.micro_batch_size * plan.dp)
    ones = plan.model_copy(update={"recompute_group_layers": None})
    assert stage_saved_bytes(sc.model, sc.training, plan, m, 0, 16) == \
        pytest.approx(stage_saved_bytes(sc.model, sc.training, ones, m, 0, 16) / 2)


def test_block_recompute_is_read_as_megatron_runs_it(tmp_path):
    """--recompute-method block --recompute-num-layers 2 on 16 layers per stage: the first 2 layers of the stage's
    chunk recomputed, the other 14 keeping everything (core_v0.16.1 transformer_block.py _checkpointed_forward),
    so its saved activations lie between full recompute's and none's, 2/16 of the way from none."""
    script = tmp_path / "block.sh"
    script.write_text((LAUNCH / "megatron_gqa_default.sh").read_text().replace(
        "--bf16", "--bf16 --pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method block "
                  "--recompute-num-layers 2"))
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, 16)
    plan = r.scenario.plan
    assert (plan.recompute, plan.recompute_num_layers) == ("full", 2) and not any("upper bound" in n for n in r.notes)
    from planner.memory import stage_saved_bytes

    sc = r.scenario
    m = sc.training.global_batch_size // (plan.micro_batch_size * plan.dp)

    def saved(p):
        return stage_saved_bytes(sc.model, sc.training, p, m, 0, p.stage_layers(sc.model.num_layers)[0])
    full = saved(plan.model_copy(update={"recompute_num_layers": None}))
    none = saved(plan.model_copy(update={"recompute_num_layers": None, "recompute": "none"}))
    assert saved(plan) == pytest.approx(none + 2 / 16 * (full - none))


def test_emitted_deepspeed_config_is_checked_with_its_plan(tmp_path):
    """`plan3d emit --format deepspeed` writes the config and its plan; check reads the pair and refuses
    a config edited to disagree with the plan."""
    sc = _llama_scenario()
    for name, text in render_all(sc, ["deepspeed"]).items():
        (tmp_path / name).write_text(text)
    (config,) = tmp_path.glob("*.deepspeed.json")
    (r,) = check_paths([str(config)], load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors and r.scenario.resolved_plan() == sc.resolved_plan()
    doc = json.loads(config.read_text())
    doc["train_micro_batch_size_per_gpu"] = 4
    config.write_text(json.dumps(doc))
    (r,) = check_paths([str(config)], load_hardware("h100-sxm-80gb"), None, None)
    assert any("train_micro_batch_size_per_gpu is 4" in e for e in r.errors) and exit_code([r]) == 2


@pytest.mark.parametrize("flags, fp16, grads_16bit", [
    ("--bf16", False, False),  # validate_args: bf16 accumulates and reduces in fp32
    ("--bf16 --grad-reduce-in-bf16", False, True),
    ("--bf16 --use-precision-aware-optimizer --main-grads-dtype bf16", False, True),
    ("--fp16", True, True),  # fp16: accumulate_allreduce_grads_in_fp32 stays off, the gradients are fp16
    ("--fp16 --accumulate-allreduce-grads-in-fp32", True, False),
    ("--fp16 --grad-reduce-in-bf16", True, True),  # read only under --bf16: fp16 gradients all the same
])
def test_gradient_dtype_is_read_as_megatron_sets_it(tmp_path, flags, fp16, grads_16bit):
    """Megatron-LM core_v0.16.1 arguments.py validate_args (the --bf16 and --fp16 branches) and training.py
    (DistributedDataParallelConfig.grad_reduce_in_fp32 = args.accumulate_allreduce_grads_in_fp32)."""
    script = tmp_path / "grads.sh"
    text = (LAUNCH / "megatron_gqa_default.sh").read_text()
    assert "--bf16 " in text
    script.write_text(text.replace("--bf16 ", flags + " "))
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors, r.errors
    assert (r.scenario.training.fp16, r.scenario.training.grad_reduce_in_bf16) == (fp16, grads_16bit)


@pytest.mark.parametrize("flags, code, said", [
    ("--optimizer dist_muon", 0, None),  # read (planner/muon.py), not refused
    ("--optimizer muon --use-distributed-optimizer", 2, "zero_stage: Megatron runs muon without"),
    ("--optimizer dist_muon --overlap-grad-reduce", 2, "Megatron refuses --overlap-grad-reduce with --optimizer"),
    ("--optimizer dist_muon --muon-tp-mode duplicated", 2, "--muon-tp-mode duplicated is not modelled"),
    ("--optimizer dist_muon --muon-tp-mode blockwise --muon-num-ns-steps 5", 0, None),
])
def test_muon_is_read_with_megatrons_own_rules(tmp_path, flags, code, said):
    """core_v0.16.1 validate_args: Muon without the distributed optimizer and without either overlap; the rest read."""
    text = (LAUNCH / "megatron_gqa_default.sh").read_text()
    assert "--bf16 --use-distributed-optimizer\n" in text
    script = tmp_path / "train.sh"
    script.write_text(text.replace("--bf16 --use-distributed-optimizer\n", f"--bf16 {flags}\n"))
    (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
    assert exit_code([r]) == code, r.errors
    assert said is None or said in r.errors[0], r.errors
    if said is None:
        assert r.scenario.training.optimizer == "dist_muon" and r.scenario.plan.zero_stage == 0


def test_dist_muon_with_legacy_grouped_experts_is_refused(tmp_path):
    """GroupedMLP (--moe-use-legacy-grouped-gemm) keeps a rank's experts in one weight per linear, which dist_muon
    deals whole: not what planner.muon deals (one weight per expert), so refused; TEGroupedMLP's is read (and judged:
    Mixtral at ZeRO 0 on 8 GPUs does not fit, exit 1), and so is plain muon, which keeps every weight on every rank."""
    text = (LAUNCH / "megatron_moe.sh").read_text()
    assert "    --moe-grouped-gemm\n" in text
    script = tmp_path / "moe.sh"
    for extra, code in (("--moe-use-legacy-grouped-gemm --optimizer dist_muon", 2), ("--optimizer dist_muon", 1),
                        ("--moe-use-legacy-grouped-gemm --optimizer muon", 1)):
        script.write_text(text.replace("    --moe-grouped-gemm\n", f"    --moe-grouped-gemm {extra}\n"))
        (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
        assert exit_code([r]) == code, (extra, r.errors)


@pytest.mark.parametrize("flags, refused", [
    ("--fp32-residual-connection", "fp32 residual"),  # TransformerConfig.fp32_residual_connection
    ("--heterogeneous-layers-config-path blocks.json", "heterogeneous"),  # per-layer blocks from a file
    ("--transformer-impl local --fp8-format hybrid", "no FP8"),  # fp8 needs TE's modules (gpt_layer_specs.py)
    # core_v0.16.1 TransformerConfig.experimental_attention_variant: linear (gated delta net) or sparse attention
    ("--experimental-attention-variant gated_delta_net --linear-attention-freq 4", "gated-delta-net"),
    ("--experimental-attention-variant dsa", "sparse (DSA)"),
    ("--te-precision-config-file recipe.yaml", "per-module precision"),  # load_quantization_recipe
    ("--attention-output-gate", "gated attention output"),  # TransformerConfig.attention_output_gate
    ("--yaml-cfg job.yaml", "YAML file"),  # parse_args: load_yaml replaces every argument
    # TransformerConfig.__post_init__: 'Delayed scaling does not support first / last layer in BF16' (modelled with
    # the other recipes: tests/test_bf16_end_layers.py)
    ("--fp8-format hybrid --first-last-layers-bf16", "delayed scaling"),
    ("--fp8-format hybrid --no-fp8-wgrad", "weight-gradient GEMMs run in bf16"),  # TEDelayedScaling override
])
def test_settings_read_as_plan3d_defaults_are_refused(tmp_path, flags, refused):
    """Flags whose memory plan3d does not model and which it would otherwise read as its own (smaller) default: the
    gate refuses the file with the reason (exit 2) rather than pass it on an under-count. Each one, left out or at
    its default, is accepted."""
    text = (LAUNCH / "megatron_gqa_default.sh").read_text()
    script = tmp_path / "train.sh"
    script.write_text(text.replace("--bf16 ", f"--bf16 {flags} "))
    (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
    assert exit_code([r]) == 2 and refused in r.errors[0], r.errors
    assert "\n" not in r.errors[0]
    for harmless in ("--num-distributed-optimizer-instances 1", "--optimizer adam", "--transformer-impl local",
                     "--first-last-layers-bf16", "--no-fp8-wgrad",  # inert without FP8
                     "--fp8-format hybrid --fp8-recipe tensorwise --no-fp8-wgrad"):  # only the delayed recipe reads it
        script.write_text(text.replace("--bf16 ", f"--bf16 {harmless} "))
        (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None)
        assert not r.errors, (harmless, r.errors)


@pytest.mark.parametrize("flags, attention", [
    ("", "flash"),  # Transformer Engine's attention (the default --transformer-impl transformer_engine)
    ("--transformer-impl transformer_engine", "flash"),
    # Megatron-Core's local spec: LocalSpecProvider.core_attention is DotProductAttention (core_v0.16.1
    # models/backends.py), the s x s scores materialised, whatever --attention-backend says
    ("--transformer-impl local", "materialized"),
    ("--transformer-impl local --attention-backend flash", "materialized"),
    # the legacy model's ParallelAttention: CoreAttention, or FlashAttention-2 under --use-flash-attn
    ("--transformer-impl local --use-legacy-models", "materialized"),
    ("--transformer-impl local --use-legacy-models --use-flash-attn", "flash2"),
])
def test_local_transformer_implementation_materialises_attention(tmp_path, flags, attention):
    text = (LAUNCH / "megatron_gqa_default.sh").read_text()
    script = tmp_path / "train.sh"
    script.write_text(text.replace("--bf16 ", f"--bf16 {flags} "))
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors and r.scenario.training.attention == attention
    if attention == "materialized":  # the scores count: more memory than the same file under TE
        script.write_text(text)
        (te,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None)
        assert estimate_scenario_memory(r.scenario).peak_gib > estimate_scenario_memory(te.scenario).peak_gib


@pytest.mark.parametrize("flags, note", [("--optimizer sgd", "--optimizer sgd"),
                                         ("--optimizer-cpu-offload", "--optimizer-cpu-offload")])
def test_optimizer_settings_counted_as_adam_on_the_gpu_say_so(tmp_path, flags, note):
    """SGD (one momentum) and optimizer offloading hold less on the GPU than the Adam states plan3d counts: an
    upper bound, said in a note, not a refusal."""
    text = (LAUNCH / "megatron_gqa_default.sh").read_text()
    script = tmp_path / "train.sh"
    script.write_text(text.replace("--bf16 ", f"--bf16 {flags} "))
    (r,) = check_file_branches(script, load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors and any(n.startswith(note) and "upper bound" in n for n in r.notes), r.notes


def test_encoder_seq_length_is_the_older_name_of_seq_length(tmp_path):
    """core_v0.16.1 validate_args: without --seq-length, args.seq_length = args.encoder_seq_length; with both it
    asserts. The reader refused such a script as having no --seq-length until 2026-12-05."""
    text = (LAUNCH / "megatron_gqa_default.sh").read_text()
    assert "--seq-length 4096 " in text
    script = tmp_path / "train.sh"
    script.write_text(text.replace("--seq-length 4096 ", "--encoder-seq-length 4096 "))
    (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
    assert not r.errors and r.scenario.training.seq_len == 4096, r.errors
    script.write_text(text.replace("--seq-length 4096 ", "--seq-length 4096 --encoder-seq-length 4096 "))
    (r,) = check_paths([str(script)], load_hardware("h100-sxm-80gb"), None, None)
    assert exit_code([r]) == 2 and "encoder_seq_length is None" in r.errors[0], r.errors
