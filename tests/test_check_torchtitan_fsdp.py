"""`plan3d check` on torchtitan jobs: ``parallelism.fsdp_reshard_after_forward`` and ``training.mixed_precision_param``,
two keys that change what a GPU holds, read as torchtitan applies them (``parallelize.py::apply_fsdp``,
``distributed/utils.py::maybe_enable_amp``; planner/readers/torchtitan.py)."""

import itertools
from pathlib import Path

import pytest

from planner.check import check_file_branches, check_paths, exit_code
from planner.emit import render_all
from planner.io import write_all
from planner.memory import estimate_scenario_memory
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec

H100 = load_hardware("h100-sxm-80gb")
LAUNCH = Path(__file__).parent / "data" / "launch"


@pytest.mark.parametrize("zero, pp", list(itertools.product((2, 3), (1, 2))))
def test_emitted_torchtitan_launch_checks_as_emitted(tmp_path, zero, pp):
    """`plan3d emit torchtitan` writes ``fsdp_reshard_after_forward never`` for ZeRO 2 and ``default`` for ZeRO 3
    (planner/emit/torchtitan.py); `check` reads the same stage and so the same peak. Before, every FSDP job was
    read as ZeRO 3: an emitted ZeRO-2 launch of Llama-3-8B on 8 GPUs held 38.8 GiB and checked as 26.5."""
    sc = Scenario(model=load_model("llama3-8b"), hardware=H100,
                  training=TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096, framework="torchtitan"),
                  plan=Plan(tp=1, pp=pp, dp=8 // pp, micro_batch_size=1, zero_stage=zero, recompute="full"))
    (script,) = [p for p in write_all(tmp_path, render_all(sc, ["torchtitan"])) if p.name.endswith(".sh")]
    (r,) = check_file_branches(script, H100, None, None)
    assert not r.errors, r.errors
    want = estimate_scenario_memory(sc).peak_gib
    assert r.scenario.plan.zero_stage == zero
    assert estimate_scenario_memory(r.scenario).peak_gib == pytest.approx(want)


@pytest.mark.parametrize("compiled", [False, True])
def test_mxfp8_llama3_8b_launch_checks_as_emitted(tmp_path, compiled):
    """torchtitan 0.3.0's ``llama3_8b_mxfp8`` (MXFP8 linears, Blackwell): emitted for an mxfp8 plan on B200, read back
    by check as mxfp8 at the plan's own compile setting (the config function turns compile on for the model;
    the launch says the plan's), with the same peak."""
    b200 = load_hardware("b200-180gb")
    sc = Scenario(model=load_model("llama3-8b"), hardware=b200,
                  training=TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096, framework="torchtitan",
                                        precision="mxfp8", compile=compiled,
                                        compile_components=("model",) if compiled else ("model", "loss")),
                  plan=Plan(tp=1, pp=1, dp=8, micro_batch_size=1, zero_stage=3, recompute="selective"))
    (script,) = [p for p in write_all(tmp_path, render_all(sc, ["torchtitan"])) if p.name.endswith(".sh")]
    assert "llama3_8b_mxfp8" in script.read_text()
    (r,) = check_file_branches(script, b200, None, None)
    assert not r.errors, r.errors
    assert r.scenario.training.precision == "mxfp8" and r.scenario.training.compile == compiled
    assert estimate_scenario_memory(r.scenario).peak_gib == pytest.approx(estimate_scenario_memory(sc).peak_gib)


def _with(text: str, section: str, line: str) -> str:
    """``line`` added under ``[section]`` (TOML keys must stay inside their table)."""
    head = f"[{section}]"
    return text.replace(head, f"{head}\n{line}", 1) if head in text else text + f"\n{head}\n{line}\n"


@pytest.mark.parametrize("policy, zero", [("default", 3), ("always", 3), ("never", 2)])
def test_reshard_policy_sets_the_zero_stage(tmp_path, policy, zero):
    path = tmp_path / "job.toml"
    path.write_text(_with((LAUNCH / "torchtitan_llama3_8b.toml").read_text(), "parallelism",
                          f'fsdp_reshard_after_forward = "{policy}"'))
    (r,) = check_file_branches(path, H100, None, 8)
    assert not r.errors, r.errors
    assert r.scenario.plan.zero_stage == zero


def test_fp32_parameters_are_fp32_training(tmp_path):
    """``mixed_precision_param = "float32"``: FSDP2 gathers and computes in fp32, so weights and activations take
    twice the bytes; read as plan3d's fp32 training, whose peak is above the bf16 one."""
    text = (LAUNCH / "torchtitan_llama3_8b.toml").read_text()
    bf16, fp32 = tmp_path / "bf16.toml", tmp_path / "fp32.toml"
    bf16.write_text(text)
    fp32.write_text(_with(text, "training", 'mixed_precision_param = "float32"'))
    (a,) = check_file_branches(bf16, H100, None, 8)
    (b,) = check_file_branches(fp32, H100, None, 8)
    assert not a.errors and not b.errors, (a.errors, b.errors)
    assert (a.scenario.training.precision, b.scenario.training.precision) == ("bf16", "fp32")
    assert estimate_scenario_memory(b.scenario).peak_gib > estimate_scenario_memory(a.scenario).peak_gib
    assert any("mixed_precision_param float32" in n for n in b.notes)


@pytest.mark.parametrize("section, line, says", [
    ("parallelism", 'fsdp_reshard_after_forward = "sometimes"', "fsdp_reshard_after_forward"),
    ("training", 'mixed_precision_param = "float16"', "mixed_precision_param"),
])
def test_unknown_values_are_one_line_errors(tmp_path, section, line, says):
    path = tmp_path / "job.toml"
    path.write_text(_with((LAUNCH / "torchtitan_llama3_8b.toml").read_text(), section, line))
    (r,) = check_file_branches(path, H100, None, 8)
    assert r.errors and says in r.errors[0] and "\n" not in r.errors[0], r.errors


def test_torchtitan_reduces_gradients_in_fp32_only(tmp_path):
    """torchtitan 0.3.0 declares ``training.mixed_precision_reduce: Literal["float32"]`` (its own config class,
    asked here): a TOML asking for another reduce dtype is refused as torchtitan's config manager refuses it, and a
    torchtitan or torch (plan3d validate's FSDP2) job with bf16 gradient reduction is a one-line problem, where
    before it was costed at half the reduce-scatter bytes and emitted as a launch that reduces in fp32."""
    import typing

    configs = pytest.importorskip("torchtitan.config.configs")
    hint = typing.get_type_hints(configs.TrainingConfig)["mixed_precision_reduce"]
    assert typing.get_args(hint) == ("float32",)
    path = tmp_path / "job.toml"
    path.write_text(_with((LAUNCH / "torchtitan_llama3_8b.toml").read_text(), "training",
                          'mixed_precision_reduce = "bfloat16"'))
    (r,) = check_file_branches(path, H100, None, 8)
    assert r.errors and "mixed_precision_reduce" in r.errors[0]
    from planner.specs import job_problems

    model = load_model("llama3-8b")
    for fw, refused in (("torchtitan", True), ("torch", True), ("megatron", False), ("deepspeed", False)):
        training = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, framework=fw, grad_reduce_in_bf16=True)
        lines = [p for p in job_problems(model, H100, training) if p.startswith("grad_reduce_in_bf16")]
        assert bool(lines) is refused, (fw, lines)


@pytest.mark.parametrize("graph", [None, False])
def test_whole_step_cuda_graph_round_trips(tmp_path, graph):
    """A pp 1 dense plan runs torchtitan's whole-step CUDA graph unless it says otherwise: `emit torchtitan` writes
    ``--training.disable_cuda_graphs`` only for ``step_cuda_graph`` false, `check` reads the same setting back, and the
    fp32 gradient shards (4 B x the parameters / 8) are persistent under the graph, backward-only in an eager step."""
    model = load_model("llama3-8b")
    sc = Scenario(model=model, hardware=H100,
                  training=TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, framework="torchtitan",
                                        step_cuda_graph=graph),
                  plan=Plan(tp=1, pp=1, dp=8, micro_batch_size=1, zero_stage=3, recompute="none"))
    (script,) = [p for p in write_all(tmp_path, render_all(sc, ["torchtitan"])) if p.name.endswith(".sh")]
    assert ("--training.disable_cuda_graphs" in script.read_text()) is (graph is False)
    (r,) = check_file_branches(script, H100, None, None)
    assert not r.errors, r.errors
    assert r.scenario.training.step_cuda_graph == graph
    assert estimate_scenario_memory(r.scenario).peak_gib == pytest.approx(estimate_scenario_memory(sc).peak_gib)
    if graph is None:
        from planner.memory import stage_params_per_rank, stage_state_bytes

        eager = sc.training.model_copy(update={"step_cuda_graph": False})
        kept, freed = (stage_state_bytes(model, t, sc.plan, 0, 32) for t in (sc.training, eager))
        shard = 4 * stage_params_per_rank(model, sc.plan, 0, 32) / 8  # the fp32 gradient shard
        assert kept.grads_bytes - freed.grads_bytes == pytest.approx(shard)  # persistent: held through the forward
        assert freed.working_grads_bytes - kept.working_grads_bytes == pytest.approx(shard)  # eager: backward only


@pytest.mark.parametrize("zero", (2, 3))
def test_context_parallelism_alone_shards_the_parameters(tmp_path, zero):
    """torchtitan 0.3.0 turns FSDP on with cp > 1 even at data_parallel_shard_degree 1 (``ParallelDims.fsdp_enabled``:
    dp_shard > 1 or cp > 1), sharding over dp_shard x cp. An emitted dp 1 x cp 2 launch was read back as ZeRO 0
    (unsharded fp32 states: Llama-3-70B on 8 A100 at 302 GiB against the plan's 172) until 2026-12-05; and ZeRO 0
    with cp > 1, which torchtitan does not run, is refused."""
    from planner.specs import plan_problems

    model, hw = load_model("llama3-8b"), H100
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=8192, framework="torchtitan")
    sc = Scenario(model=model, hardware=hw, training=tr,
                  plan=Plan(tp=4, pp=1, dp=1, cp=2, micro_batch_size=1, zero_stage=zero, recompute="full",
                            sequence_parallel=True))
    (script,) = [p for p in write_all(tmp_path, render_all(sc, ["torchtitan"])) if p.name.endswith(".sh")]
    (r,) = check_file_branches(script, hw, None, None)
    assert not r.errors, r.errors
    assert r.scenario.plan.zero_stage == zero
    assert estimate_scenario_memory(r.scenario).peak_gib == pytest.approx(estimate_scenario_memory(sc).peak_gib)
    replicated = sc.plan.model_copy(update={"zero_stage": 0})
    assert any(p.startswith("zero_stage: torchtitan shards the parameters over the context-parallel ranks")
               for p in plan_problems(model, hw, tr, replicated))
    assert not any("context-parallel" in p for p in plan_problems(model, hw, tr.model_copy(
        update={"framework": "torch"}), replicated))  # plan3d validate's run replicates over dp x cp


def _toml_with(tmp_path, replace: dict[str, str], add: dict[str, str]) -> Path:
    """tests/data/launch/torchtitan_llama3_8b.toml with lines replaced and keys added under their sections."""
    text = (Path(__file__).parent / "data" / "launch" / "torchtitan_llama3_8b.toml").read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    for section, line in add.items():
        text = text.replace(f"[{section}]\n", f"[{section}]\n{line}\n", 1)
    path = tmp_path / "train.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("replace, add, message", [
    # parallelize.py: without loss parallel the output layer gathers the whole vocabulary on every TP rank
    ({"tensor_parallel_degree = 1": "tensor_parallel_degree = 8"}, {"parallelism": "disable_loss_parallel = true"},
     "disable_loss_parallel with tp 8"),
    ({"tensor_parallel_degree = 1": "tensor_parallel_degree = 8"}, {"training": "disable_loss_parallel = true"},
     "disable_loss_parallel with tp 8"),  # the 2024 TOMLs' [training] key
    ({"# converters = \"float8\"": "converters = [\"quantize.linear.nvfp4\"]"}, {}, "'quantize.linear.nvfp4' is not "
     "modelled"),
    ({"# converters = \"float8\"": "converters = [\"quantize.grouped_mm.float8\"]"}, {}, "alone"),
    ({"mode = 'selective'": "mode = 'partial'"}, {}, "activation_checkpoint.mode = 'partial'"),
    ({}, {"training": "enable_cpu_offload = 1"}, "enable_cpu_offload = 1"),
])
def test_toml_settings_plan3d_would_misread_are_refused(tmp_path, replace, add, message):
    """A key that changes what a rank holds and that plan3d does not model is refused with the reason (exit 2), not
    read as torchtitan's default: loss parallel off at tp > 1 (the whole vocabulary's logits on each rank, about
    tp x 12/16 the loss-parallel figure), a converter other than torchao's float8 linears, an AC mode torchtitan
    does not have."""
    (r,) = check_paths([str(_toml_with(tmp_path, replace, add))], load_hardware("h100-sxm-80gb"), None, 8)
    assert exit_code([r]) == 2 and message in r.errors[0], r.errors


@pytest.mark.parametrize("replace, add, precision, note", [
    ({"# converters = \"float8\"": "converters = [\"quantize.linear.float8\"]"}, {}, "fp8", None),
    ({"# converters = \"float8\"": "converters = [\"quantize.linear.float8\", \"quantize.grouped_mm.float8\"]"}, {},
     "fp8", None),
    ({"# converters = \"float8\"": "converters = \"float8\""}, {}, "fp8", None),
    ({}, {"parallelism": "disable_loss_parallel = true"}, "bf16", "no effect without tensor parallelism"),
    ({}, {"training": "enable_cpu_offload = true"}, "bf16", "an upper bound"),
    ({"mode = 'selective'": "mode = 'memory_budget'"}, {}, "bf16", "modelled as no recompute, an upper bound"),
])
def test_toml_settings_read_as_they_run(tmp_path, replace, add, precision, note):
    (r,) = check_file_branches(_toml_with(tmp_path, replace, add), load_hardware("h100-sxm-80gb"), None, 8)
    assert not r.errors, r.errors
    assert r.scenario.training.precision == precision
    assert note is None or any(note in n for n in r.notes), r.notes


MX = {"# converters = \"float8\"": "converters = [\"quantize.linear.mx\"]"}


def mx_with(table: str, replace: dict | None = None) -> dict:
    """``replace`` (the quantize.linear.mx converter by default) and the TOML ``table`` placed before [float8]."""
    return {**(MX if replace is None else replace), "[float8]\n": table + "\n\n[float8]\n"}


@pytest.mark.parametrize("replace, add, words, note", [
    ({"# converters = \"float8\"": "converters = [\"mx\"]"}, {}, [], None),  # 2025: MXConverter, options in [mx]
    (MX, {}, [], None),
    ({"# converters = \"float8\"": "converters = [\"quantize.linear.mx\", \"quantize.grouped_mm.mx\"]"}, {}, [], None),
    ({}, {}, ["--model.converters", "quantize.linear.mx,quantize.grouped_mm.mx"], None),  # comma-separated (string_list)
    (mx_with("[quantize.linear.mx]\nrecipe_name = \"mxfp8_cublas_rceil\""), {}, [], None),
    (MX, {}, ["--quantize.linear.mx.recipe_name", "mxfp8_cublas"], None),
    (mx_with("[quantize.linear.mx]\nfilter_fqns = [\"output\", \"attention.wq\"]"), {}, [],
     "plan3d counts every linear but the output layer in MXFP8"),
])
def test_mx_converters_read_as_mxfp8(tmp_path, replace, add, words, note):
    """torchao's MX linears in a TOML-era torchtitan config (``mx``, then ``quantize.linear.mx`` with
    ``quantize.grouped_mm.mx`` for the experts, components/quantization/mx.py) are read as mxfp8 on a Blackwell
    profile. Before 2026-12-07 check refused them as not modelled, though plan3d models torchao's MX linears (the
    ``llama3_8b_mxfp8`` config function of torchtitan 0.3.0 was read so)."""
    path = _toml_with(tmp_path, replace, add)
    if words:  # the overrides on torchrun's command line, after the TOML (ConfigManager: "CLI args > TOML")
        path = tmp_path / "run.sh"
        path.write_text("torchrun --nproc-per-node 8 -m torchtitan.train --job.config_file train.toml "
                        + " ".join(words) + "\n")
    (r,) = check_file_branches(path, load_hardware("b200-180gb"), None, 8)
    assert not r.errors, r.errors
    assert r.scenario.training.precision == "mxfp8"
    assert note is None or any(note in n for n in r.notes), r.notes


@pytest.mark.parametrize("replace, add, message", [
    ({"# converters = \"float8\"": "converters = [\"quantize.grouped_mm.mx\"]"}, {}, "alone"),
    ({"# converters = \"float8\"": "converters = [\"quantize.linear.mx\", \"quantize.grouped_mm.float8\"]"}, {},
     "mixes float8 and MX"),
    (MX, {"float8": "enable_float8_linear = true"}, "float8 and MX linears together"),
    (mx_with("[quantize.linear.mx]\nrecipe_name = \"mxfp4_cutlass\""), {}, "'mxfp4_cutlass' is not modelled"),
    (mx_with("[quantize.linear.mx]\nrecipe_name = \"mxfp8_emulated\""), {}, "'mxfp8_emulated' is not modelled"),
    (mx_with("[mx]\nrecipe_name = \"mxfp4_emulated\"", {"# converters = \"float8\"": "converters = \"mx\""}), {},
     "mx.recipe_name = 'mxfp4_emulated' is not modelled"),
    (mx_with("[compile]\nenable = true", {"# converters = \"float8\"": "converters = [\"mx\"]",
                                           "tensor_parallel_degree = 1": "tensor_parallel_degree = 2"}),
     {}, "TP not yet supported with torch.compile for mxfp8"),
])
def test_mx_converters_plan3d_would_misread_are_refused(tmp_path, replace, add, message):
    (r,) = check_paths([str(_toml_with(tmp_path, replace, add))], load_hardware("b200-180gb"), None, 8)
    assert exit_code([r]) == 2 and message in r.errors[0], r.errors


def test_quantize_linear_float8_all_gather_is_said_to_be_counted_in_bf16(tmp_path):
    """The same option in its 2025 section, ``[quantize.linear.float8]``, was not read before 2026-12-07."""
    path = _toml_with(tmp_path, {"# converters = \"float8\"": "converters = [\"quantize.linear.float8\"]"},
                      {})
    text = path.read_text().replace("[float8]\n", "[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n\n"
                                                  "[float8]\n")
    path.write_text(text)
    (r,) = check_file_branches(path, H100, None, 8)
    assert not r.errors, r.errors
    assert any(n.startswith("float8.enable_fsdp_float8_all_gather") for n in r.notes), r.notes


def test_float8_all_gather_is_said_to_be_counted_in_bf16():
    """torchtitan_llama3_405b_fp8.toml (float8 converter, ``enable_fsdp_float8_all_gather = true``): FSDP gathers fp8
    weights there; plan3d's gathered weights are bf16 (docs/memory.md), so check says it over-counts."""
    (r,) = check_file_branches(LAUNCH / "torchtitan_llama3_405b_fp8.toml", H100, None, 128)
    assert not r.errors, r.errors
    assert r.scenario.training.precision == "fp8"
    assert any(n.startswith("float8.enable_fsdp_float8_all_gather: FSDP all-gathers the weights in float8") and
               "over-estimate" in n for n in r.notes), r.notes


def _pp_toml(tmp_path, line: str) -> Path:
    """tests/data/launch/torchtitan_llama3_70b_pp.toml (80 layers, pp 4, Interleaved1F1B) with ``line`` in
    [parallelism]."""
    text = (Path(__file__).parent / "data" / "launch" / "torchtitan_llama3_70b_pp.toml").read_text()
    text = "\n".join(x + ("\n" + line if x == "[parallelism]" else "") for x in text.splitlines()) + "\n"
    path = tmp_path / "pp.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("line, layers, vpp, error", [
    # the stages the config names itself: 2025 TOMLs' split points (first module of each later stage) ...
    ('pipeline_parallel_split_points = ["layers.10", "layers.20", "layers.30", "layers.40", "layers.50", '
     '"layers.60", "layers.70"]', (20, 20, 20, 20), 2, None),
    ('pipeline_parallel_split_points = ["layers.20", "layers.40", "layers.60"]', (20, 20, 20, 20), 1, None),
    # ... and 0.3.0's module lists; a split the profile does not model is refused, not read as the even one
    ('module_fqns_per_model_part = [' + ", ".join(
        "[" + ", ".join(f'"layers.{i}"' for i in range(s * 20, s * 20 + 20)) + "]" for s in range(4)) + "]",
     (20, 20, 20, 20), 1, None),
    ('pipeline_parallel_split_points = ["layers.30", "layers.40", "layers.60"]', None, None,
     "[30, 10, 20, 20] layers"),
    ('module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1"]]', None, None, "once each"),
    ('pipeline_parallel_split_points = ["layers.20", "layers.40"]', None, None, "3 pipeline stages named for pp 4"),
    # a schedule from a CSV file: refused (plan3d models the named schedules)
    ('pipeline_parallel_schedule_csv = "schedule.csv"', None, None, "pipeline_parallel_schedule_csv"),
])
def test_pipeline_stages_named_in_the_config(tmp_path, line, layers, vpp, error):
    """Before 2026-12-05 these keys were ignored and the split read as torchtitan's automatic one: a config whose
    first stage held 30 layers of 80 was judged with 20 there."""
    (r,) = check_paths([str(_pp_toml(tmp_path, line))], load_hardware("h100-sxm-80gb"), None, None)
    if error is not None:
        assert exit_code([r]) == 2 and error in r.errors[0], r.errors
        return
    assert not r.errors, r.errors
    plan = r.scenario.resolved_plan()
    assert (plan.stage_layers(80), plan.vpp) == (layers, vpp)


@pytest.mark.parametrize("schedule, extra", [
    ("ZBVZeroBubble", {"pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_last_stage_less_layers": 1}),
    ("Interleaved1F1B", {"pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_last_stage_less_layers": 1}),
    ("Interleaved1F1B", {"pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_layers_per_stage": 7}),
    ("1F1B", {"pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_last_stage_less_layers": 1}),
])
def test_first_last_less_layers_split_is_torchtitans(schedule, extra):
    """The layers on each pipeline rank the reader gives an 80-layer, pp-4 config with torchtitan's first/last-stage
    keys are those torchtitan 0.3.0 itself builds: its virtual-stage count (``_get_pipeline_metadata``: 2 per rank for
    a multi-stage schedule without layers_per_stage), its split (``_generate_llm_fqn_per_model_part``) and its stage
    placement (``_get_pp_rank_to_stage_indices_mapping``: V for ZBV). Until 2026-12-05 the reader placed stages looped
    for the V schedules too and took one stage per rank without layers_per_stage."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (requirements-consumers.txt)")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from types import SimpleNamespace

    from torchtitan.distributed import pipeline_parallel as pipe

    from planner.readers.torchtitan import scenario_dicts

    par = {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 8, "pipeline_parallel_degree": 4,
           "pipeline_parallel_schedule": schedule, **extra}
    doc = {"model": {"name": "llama3", "flavor": "70B"}, "parallelism": par, "training": {"local_batch_size": 8}}
    try:
        _, _, plan, _ = scenario_dicts(doc, 64, "job.toml")
        ours, vpp = list(plan["layers_per_stage"] or [80 // 4] * 4), plan["vpp"]
    except SpecError as err:  # a split the torchtitan profile does not model: refused, naming the split it read
        ours, vpp = [int(x) for x in str(err).split("layers per virtual stage, [")[1].split("]")[0].split(", ")], None
    config = SimpleNamespace(pipeline_parallel_schedule=schedule,
                             pipeline_parallel_layers_per_stage=extra.get("pipeline_parallel_layers_per_stage"),
                             pipeline_parallel_first_stage_less_layers=extra.get(
                                 "pipeline_parallel_first_stage_less_layers", 1),
                             pipeline_parallel_last_stage_less_layers=extra.get(
                                 "pipeline_parallel_last_stage_less_layers", 1))
    stages, layers, first, last = pipe._get_pipeline_metadata(SimpleNamespace(pp=4), config,
                                                              SimpleNamespace(layers=[None] * 80))
    parts = [sum(n.startswith("layers.") for n in part)
             for part in pipe._generate_llm_fqn_per_model_part(stages, layers, first, last)]
    theirs = [sum(parts[s] for s in pipe._get_pp_rank_to_stage_indices_mapping(r, 4, schedule, stages))
              for r in range(4)]
    assert ours == theirs and vpp in (None, stages // 4)


def test_config_registry_jobs_split_as_torchtitan_defaults_do():
    """A torchtitan 0.3.0 command line (``--module``/``--config``) with PP and no first/last-stage keys gets
    torchtitan's defaults (1 and 1, ParallelismConfig): Llama-3-8B's 32 layers over 2 stages are 16 and 16 (the
    embedding and the output weigh one layer each); Llama-3-70B's 80 over 4 are 20/21/20/19 (until 2026-12-05 the
    reader assumed the even split for such a job; from then to the next day it refused this split, which the
    profile's first/middle/last shapes did not include; now the splits torchtitan's keys build are modelled), and over
    8 virtual stages (Interleaved1F1B: 2 per rank) 10/11/10/10/10/10/10/9, 20/21/20/19 per rank."""
    from planner.readers.torchtitan import scenario_dicts

    def doc(config: str, pp: int, schedule: str = "1F1B") -> dict:
        return {"_registry": {"module": "llama3", "config": config}, "model": {},
                "parallelism": {"pipeline_parallel_degree": pp, "data_parallel_shard_degree": 2,
                                "pipeline_parallel_schedule": schedule}, "training": {"local_batch_size": 4}}
    _, _, plan, _ = scenario_dicts(doc("llama3_8b", 2), 4, "run.sh")
    assert (plan["layers_per_stage"], plan["vpp"]) == ([16, 16], 1)
    _, _, plan, _ = scenario_dicts(doc("llama3_70b", 4), 8, "run.sh")
    assert (list(plan["layers_per_stage"]), plan["vpp"]) == ([20, 21, 20, 19], 1)
    _, _, plan, _ = scenario_dicts(doc("llama3_70b", 4, "Interleaved1F1B"), 8, "run.sh")
    assert (list(plan["layers_per_stage"]), plan["vpp"]) == ([20, 21, 20, 19], 2)


@pytest.mark.parametrize("section, refused", [
    ('[compile]\nenable = true\nbackend = "aot_eager"\n', True),
    ('[compile]\nenable = false\nbackend = "aot_eager"\n', False),  # no compile, no backend
    ('[compile]\nenable = true\nbackend = "inductor"\n', False),
])
def test_a_compile_backend_other_than_inductor_is_refused(tmp_path, section, refused):
    """CompileConfig.backend (torchtitan 0.3.0, handed to torch.compile): plan3d sizes a compiled model by inductor's
    min-cut partition (what it saves and recomputes); another backend keeps other tensors, so it is refused, not
    read as inductor (until 2026-12-05 the key was ignored)."""
    text = (Path(__file__).parent / "data" / "launch" / "torchtitan_llama3_8b.toml").read_text()
    path = tmp_path / "train.toml"
    path.write_text(text + "\n" + section)
    (r,) = check_paths([str(path)], load_hardware("h100-sxm-80gb"), None, 8)
    assert (exit_code([r]) == 2 and "compile.backend = 'aot_eager'" in r.errors[0]) if refused else not r.errors, \
        r.errors
