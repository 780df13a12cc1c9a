"""Megatron-Core's rules for per-layer CUDA graphs (``training.cuda_graph_modules``, emitted as ``--cuda-graph-impl
transformer_engine --cuda-graph-scope ...``): ``specs.cuda_graph_problems``, part of ``plan_problems``, refuses what
core_v0.16.1's ``TransformerConfig`` refuses, checked here against Megatron's own startup; the search proposes none of
it. Before, plan3d emitted, for example, full recompute with per-layer graphs, which Megatron refuses to start."""

import pytest

from planner.candidates import Pins, SearchSpace
from planner.presets import load_hardware, load_model
from planner.search import search
from planner.specs import Plan, TrainingSpec, cuda_graph_problems, job_problems, whole_moe_graph_problems
from tests.test_emit_consumers import megatron, megatron_validate  # noqa: F401 (the session fixture)
from tests.test_emit_moe import TINY, _args_file_argv, _grouped_gemm_capability, scenario

H100 = load_hardware("h100-sxm-80gb")


def _training(**kw):
    return TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024, **kw)


@pytest.mark.parametrize("model, graphs, plan, extra, says", [
    ("tiny-moe", ("attn",), dict(recompute="full"), {}, "full recompute"),
    ("tiny-moe", ("attn",), dict(cpu_offload_layers=1), {}, "CPU offloading"),
    ("tiny-gpt", ("moe_router",), {}, {}, "need a MoE model"),
    ("tiny-moe", ("moe_router",), dict(recompute="selective"), dict(recompute_modules=("moe",)), "moe recompute"),
    ("tiny-gpt+dropout", ("attn",), dict(recompute="selective"), {}, "attention dropout"),
])
def test_refused_combinations(model, graphs, plan, extra, says):
    m = load_model(model.removesuffix("+dropout"))
    m = m.model_copy(update={"dropout": True}) if model.endswith("+dropout") else m
    training = _training(cuda_graph_modules=graphs, **extra)
    p = Plan(tp=1, pp=1, dp=8, ep=8 if m.is_moe else 1, micro_batch_size=1, **plan)
    problems = cuda_graph_problems(m, training, p)
    assert len(problems) == 1 and says in problems[0] and problems[0].startswith("cuda_graph_modules:"), problems
    assert cuda_graph_problems(m, training.model_copy(update={"cuda_graph_modules": ()}), p) == []
    assert cuda_graph_problems(m, training.model_copy(update={"framework": "torchtitan"}), p) == []


@pytest.mark.parametrize("swap, says", [
    (("--recompute-granularity", "selective", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                               "--recompute-num-layers", "1"]),
     "full recompute is only supported with full iteration CUDA graph"),
    (("--recompute-granularity", "selective", ["--recompute-granularity", "selective", "--recompute-modules", "moe"]),
     "moe recompute is not supported with moe_router CUDA graph"),
    (("--attention-dropout", "0.0", ["--attention-dropout", "0.1"]),
     "attention dropout is not supported with graphed attention recomputation"),
])
def test_megatron_refuses_what_plan3d_refuses(megatron, monkeypatch, tmp_path, swap, says):  # noqa: F811
    """An emitted launch Megatron accepts (selective recompute of the attention core, graphed attn and moe_router, no
    dropout), then one flag changed to each refused combination: Megatron's own startup raises, with the sentence
    ``cuda_graph_problems`` cites."""
    sc = scenario(**TINY, tp=1, pp=1, dp=8, ep=8, recompute="selective")
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"cuda_graph_modules": ("attn", "moe_router")})})
    _grouped_gemm_capability(monkeypatch, 9)
    argv = _args_file_argv(sc, tmp_path)
    megatron_validate(megatron, monkeypatch, list(argv), "1")  # accepted as emitted
    flag, value, new = swap
    i = argv.index(flag)
    assert argv[i + 1] == value
    with pytest.raises((AssertionError, ValueError), match=says):
        megatron_validate(megatron, monkeypatch, argv[:i] + new + argv[i + 2:], "1")


def test_search_proposes_no_refused_plan():
    model = load_model("tiny-moe")
    training = TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=1024, cuda_graph_modules=("attn",))
    assert search(model, H100, training, SearchSpace(max_micro_batch_size=2, pins=Pins(recompute="full"))).best is None
    best = search(model, H100, training, SearchSpace(max_micro_batch_size=2)).best
    assert best is not None and best.recompute != "full" and not best.cpu_offload_layers


def test_estimate_refuses_in_one_line():
    from typer.testing import CliRunner

    from planner.cli import app

    res = CliRunner().invoke(app, ["estimate", "--model", "tiny-moe", "--hardware", "h100-sxm-80gb", "--gpus", "8",
                                   "--global-batch", "16", "--seq-len", "1024", "--tp", "1", "--pp", "1", "--ep", "8",
                                   "--recompute", "full", "--cuda-graph-modules", "attn"])
    assert res.exit_code == 2, res.output
    assert "cuda_graph_modules" in res.output and "Traceback" not in res.output


# --- the whole-MoE-layer scope (``moe``): drop-and-pad routing only ---------------------------------------------

def _padded(model_name="tiny-moe"):
    return load_model(model_name).model_copy(update={"capacity_factor": 1.0})


@pytest.mark.parametrize("padded, extra, says", [
    (False, {}, "drop-and-pad"),  # core_v0.16.1: 'moe cuda graph is only supported with drop-padding MoE'
    (True, dict(moe_a2a_overlap=True), "all-to-all overlap"),  # transformer_layer.py: 'EP overlap must be disabled'
])
def test_whole_moe_layer_graph_rules(padded, extra, says):
    """Rules of the job whatever the plan (job_problems): the search names them before it tries any plan."""
    m = _padded() if padded else load_model("tiny-moe")
    training = _training(cuda_graph_modules=("attn", "moe"), **extra)
    problems = whole_moe_graph_problems(m, training)
    assert len(problems) == 1 and says in problems[0], problems
    assert problems[0] in job_problems(m, H100, training)
    assert whole_moe_graph_problems(_padded(), _training(cuda_graph_modules=("attn", "moe"))) == []
    assert whole_moe_graph_problems(m, training.model_copy(update={"framework": "torchtitan"})) == []


def test_whole_moe_layer_graph_excludes_the_router_scope_and_a_clamped_activation():
    with pytest.raises(ValueError, match="moe and moe_router cannot both be captured"):
        _training(cuda_graph_modules=("moe", "moe_router"))
    oss = _padded("gpt-oss-120b")
    problems = whole_moe_graph_problems(oss, _training(cuda_graph_modules=("moe",)))
    assert len(problems) == 1 and "clamped activation" in problems[0]


def test_megatron_takes_the_whole_moe_layer_graph_only_with_padding(megatron, monkeypatch, tmp_path):  # noqa: F811
    """The emitted launch (capacity 1.0, padded; --cuda-graph-scope attn moe) passes Megatron's own startup; without
    the padding Megatron refuses with the sentence cuda_graph_problems cites."""
    sc = scenario(**TINY, tp=1, pp=1, dp=8, ep=8)
    sc = sc.model_copy(update={"model": sc.model.model_copy(update={"capacity_factor": 1.0}),
                               "training": sc.training.model_copy(update={"cuda_graph_modules": ("attn", "moe")})})
    _grouped_gemm_capability(monkeypatch, 9)
    argv = _args_file_argv(sc, tmp_path)
    i = argv.index("--cuda-graph-scope")
    assert argv[i + 1:i + 3] == ["attn", "moe"] and "--moe-pad-expert-input-to-capacity" in argv
    megatron_validate(megatron, monkeypatch, list(argv), "1")  # accepted as emitted
    unpadded = [a for a in argv if a != "--moe-pad-expert-input-to-capacity"]
    with pytest.raises((AssertionError, ValueError), match="moe cuda graph is only supported with drop-padding MoE"):
        megatron_validate(megatron, monkeypatch, unpadded, "1")


def test_search_names_a_whole_moe_layer_graph_of_dropless_routing():
    """`plan3d search --cuda-graph-modules attn,moe` on a dropless model: the one-line rule, exit 2 (it said "no
    legal plan ... check --gpus and --global-batch")."""
    from typer.testing import CliRunner

    from planner.cli import app

    res = CliRunner().invoke(app, ["search", "--model", "tiny-moe", "--hardware", "h100-sxm-80gb", "--gpus", "8",
                                   "--global-batch", "16", "--seq-len", "1024", "--cuda-graph-modules", "attn,moe"])
    assert res.exit_code == 2 and "only with drop-and-pad routing" in res.output, res.output


@pytest.mark.parametrize("framework", ["torchtitan", "deepspeed", "torch"])
def test_per_layer_graph_scopes_are_megatrons_only(framework):
    """No other framework's launch file carries --cuda-graph-scope: the scopes' launch saving was claimed for a
    torchtitan run that has none of them (its emitted TOML writes nothing of it)."""
    training = _training(cuda_graph_modules=("attn", "moe_router"), framework=framework)
    problems = job_problems(load_model("tiny-moe"), H100, training)
    assert any(p.startswith("cuda_graph_modules: per-layer CUDA-graph scopes are Megatron's") for p in problems), \
        problems
    assert not job_problems(load_model("tiny-moe"), H100, training.model_copy(update={"framework": "nemo"}))


def test_deepep_takes_no_padded_capacity():
    """core_v0.16.1 TransformerConfig: 'Flex token dispatcher with deepep backend does not support
    moe_pad_expert_input_to_capacity' (plan3d's capacity_factor is drop-and-pad): refused before any plan."""
    training = _training(moe_token_dispatcher="deepep")
    problems = job_problems(_padded(), H100, training)
    assert any("does not support moe_pad_expert_input_to_capacity" in p for p in problems), problems
    assert not any("moe_pad" in p for p in job_problems(load_model("tiny-moe"), H100, training))
    assert not any("moe_pad" in p for p in job_problems(_padded(), H100, _training(moe_token_dispatcher="alltoall")))


def test_megatron_refuses_deepep_with_padded_capacity(megatron, monkeypatch, tmp_path):  # noqa: F811
    """The rule above is Megatron's own: the emitted padded launch (alltoall) starts; with the flex dispatcher and
    DeepEP instead, Megatron raises the sentence job_problems cites."""
    sc = scenario(**TINY, tp=1, pp=1, dp=8, ep=8)
    sc = sc.model_copy(update={"model": sc.model.model_copy(update={"capacity_factor": 1.0})})
    _grouped_gemm_capability(monkeypatch, 9)
    argv = _args_file_argv(sc, tmp_path)
    megatron_validate(megatron, monkeypatch, list(argv), "1")
    i = argv.index("--moe-token-dispatcher-type")
    assert argv[i + 1] == "alltoall"
    flex = argv[:i] + ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"] + argv[i + 2:]
    with pytest.raises((AssertionError, ValueError), match="does not support moe_pad_expert_input_to_capacity"):
        megatron_validate(megatron, monkeypatch, flex, "1")
