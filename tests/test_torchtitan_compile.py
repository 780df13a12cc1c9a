"""torch.compile as torchtitan applies it (issue 13): what a compiled block and the compiled loss save,
measured by torch on this CPU (planner/compile_probe.py), against plan3d's model; the published compile rows;
the emitted flags, the reader, the CLI option and the job problem.

Measured values come from torch's own partitioner (inductor, torchtitan's default ``compile.backend``); the
expected values are the model's terms (planner/memory.py), not derived from the measurement.
"""

import json
from pathlib import Path

import pytest

from planner.emit import torchtitan as emit
from planner.frameworks import torchtitan
from planner.memory import layer_activation_terms, saved_bytes_per_layer
from planner.readers import torchtitan as reader
from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec, job_problems
from tests.test_framework_memory import H100, LLAMA, TT, _torchtitan_estimate

torch = pytest.importorskip("torch")

# (b, s, h, heads, kv_heads, f): two sequence lengths at one width (the bytes must scale with the tokens),
# and a second width
SHAPES = [(1, 256, 256, 8, 8, 768), (2, 256, 256, 8, 8, 768), (1, 128, 512, 8, 8, 1536)]


def _model_saved_bytes(b, s, h, heads, kv, f, recompute, compiled=True) -> float:
    model = ModelSpec(name="probe", num_layers=2, hidden_size=h, num_attention_heads=heads, num_kv_heads=kv,
                      ffn_hidden_size=f, vocab_size=4096, activation="swiglu", norm="rmsnorm")
    tr = TrainingSpec(num_gpus=1, global_batch_size=b, seq_len=s, framework="torchtitan", compile=compiled)
    return saved_bytes_per_layer(layer_activation_terms(model, tr, Plan(tp=1, pp=1, dp=1, micro_batch_size=b)),
                                 recompute)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda x: "b{}-s{}-h{}".format(*x[:3]))
def test_compiled_block_without_recompute_saves_what_the_model_says(shape):
    """No AC: the compiled block saves the fused-SwiGLU set (W1 and W3 outputs and their product, no SiLU
    output) and the attention's q, k, v, output and log-sum-exp. MHA (kv = heads): the probe's block repeats K
    and V to every head before SDPA as torchtitan 9dec370 did (``repeat_kv``), which the model does not."""
    from planner.compile_probe import block_saved_bytes

    b, s, h, heads, kv, f = shape
    measured = block_saved_bytes("none", "inductor", b=b, s=s, h=h, heads=heads, kv_heads=kv, f=f)
    assert measured == _model_saved_bytes(*shape, "none")
    assert measured < _model_saved_bytes(*shape, "none", compiled=False)  # the eager SiLU output is gone


@pytest.mark.parametrize("shape", [(1, 256, 256, 8, 2, 768), (2, 256, 256, 8, 2, 768)], ids=["s256", "b2-s256"])
def test_compiled_block_under_op_sac_drops_the_w2_output(shape):
    """torchtitan's op SAC inside the compiled block (GQA): input, Q, V, attention output and log-sum-exp,
    W1 output; the W2 output the eager policy keeps is not saved (nothing in the backward reads it)."""
    from planner.compile_probe import block_saved_bytes

    b, s, h, heads, kv, f = shape
    measured = block_saved_bytes("selective", "inductor", b=b, s=s, h=h, heads=heads, kv_heads=kv, f=f)
    assert measured == _model_saved_bytes(*shape, "selective")
    assert _model_saved_bytes(*shape, "selective", compiled=False) - measured == b * s * h * 2  # one bf16 s b h


def test_compiled_block_under_full_ac_keeps_its_input():
    from planner.compile_probe import block_saved_bytes

    shape = (1, 256, 256, 8, 2, 768)
    b, s, h, heads, kv, f = shape
    measured = block_saved_bytes("full", "inductor", b=b, s=s, h=h, heads=heads, kv_heads=kv, f=f)
    assert measured == _model_saved_bytes(*shape, "full") == b * s * h * 2


def test_compiled_loss_keeps_the_bf16_logits_and_writes_one_bf16_gradient():
    """Eager ``cross_entropy(pred.float())`` saves the fp32 log-softmax (4 B per logit); compiled, the bf16
    logits (2 B) and two fp32 values per token; the backward's only per-logit buffer is the bf16 gradient.
    So 2 + 2 B per logit at the loss (``COMPILED_LOGITS_BYTES_PER_ELEMENT``)."""
    from planner.compile_probe import loss_inductor_buffers, loss_saved_bytes

    tokens, vocab = 512, 4096
    assert loss_saved_bytes(None, tokens, vocab) == 4 * tokens * vocab + 4  # + the fp32 total weight
    assert loss_saved_bytes("inductor", tokens, vocab) == 2 * tokens * vocab + 2 * 4 * tokens
    forward, backward = loss_inductor_buffers(tokens, vocab)
    per_logit = [(shape, dtype) for shape, dtype in forward + backward if torch.Size(shape).numel() >= vocab]
    assert per_logit == [((tokens, vocab), "bfloat16")]  # the backward's gradient; the forward has none
    assert torchtitan.COMPILED_LOGITS_BYTES_PER_ELEMENT == 2 + 2


@pytest.mark.parametrize("i", [i for i, r in enumerate(TT["runs"]) if r["techniques"] == "FSDP + torch.compile"],
                         ids=lambda i: f"table{TT['runs'][i]['table']}")
def test_published_compile_rows(i):
    """Tables 1 and 3, FSDP + torch.compile (tests/data/published_memory.json): within 10 % of the reading, and
    below the eager row's estimate by what compile saves."""
    run = TT["runs"][i]
    est = _torchtitan_estimate(run)
    assert abs(est.peak_gib / run["reading_gib"] - 1) <= 0.10, est.peak_gib
    eager = next(r for r in TT["runs"] if r["table"] == run["table"] and r["techniques"] == "FSDP")
    assert est.peak_gib < _torchtitan_estimate(eager).peak_gib


def _sc(compile: bool, components=("model", "loss"), model=LLAMA, precision="bf16"):
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=8192, framework="torchtitan", compile=compile,
                      compile_components=components, precision=precision)
    return Scenario(model=model, hardware=H100, training=tr, plan=Plan(tp=1, pp=1, dp=8, micro_batch_size=2,
                                                                      zero_stage=3, recompute="selective"))


def test_emitted_compile_flags():
    on = emit.args(_sc(True))
    assert on[on.index("--compile.enable"):][:3] == ["--compile.enable", "--compile.components", "model,loss"]
    assert "--compile.no-enable" in emit.args(_sc(False))
    assert "--compile.enable" not in emit.args(_sc(False))
    assert emit.compile_args("llama3_405b", _sc(False).training, 8) == [
        "--compile.no-enable", "--compile.no-enable-async-tensor-parallel"]
    # llama3_405b's config turns async TP on; a plan costed without the TP overlap turns it off (until 2026-12-05 the
    # compiled launch kept it: the run overlapped what the plan charged in full)
    assert emit.compile_args("llama3_405b", _sc(True).training, 8) == [
        "--compile.enable", "--compile.components", "model,loss", "--compile.no-enable-async-tensor-parallel"]
    overlap = _sc(True).training.model_copy(update={"tp_comm_overlap": True})
    assert emit.compile_args("llama3_8b", overlap, 8)[-1] == "--compile.enable-async-tensor-parallel"
    assert "--compile.enable-async-tensor-parallel" not in emit.compile_args("llama3_8b", overlap, 1)  # no TP mesh


def test_async_tp_round_trip_and_refusal(tmp_path):
    """A torchtitan plan costed with the TP overlap (``tp_comm_overlap``: async TP) is emitted with
    ``--compile.enable-async-tensor-parallel`` and read back with it (dropped on both sides until 2026-12-05: the launch
    ran without the overlap it was costed with); async TP without compiled blocks is refused, as torchtitan refuses it."""
    from planner.check import check_file_branches
    from planner.cost import estimate_time
    from planner.emit import render_all
    from planner.io import write_all

    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=8192, framework="torchtitan", compile=True,
                      tp_comm_overlap=True)
    sc = Scenario(model=LLAMA, hardware=H100, training=tr, plan=Plan(tp=4, pp=1, dp=2, micro_batch_size=1,
                                                                     zero_stage=3, recompute="selective",
                                                                     sequence_parallel=True))
    (path,) = [p for p in write_all(tmp_path, render_all(sc, ["torchtitan"]), force=True) if p.suffix == ".sh"]
    assert "--compile.enable-async-tensor-parallel" in path.read_text()
    (r,) = check_file_branches(path, H100, None, None)
    assert not r.errors and r.scenario.training.tp_comm_overlap is True
    t = estimate_time(LLAMA, H100, tr, sc.plan).step_time_s
    assert t < estimate_time(LLAMA, H100, tr.model_copy(update={"tp_comm_overlap": None}), sc.plan).step_time_s
    assert estimate_time(LLAMA, H100, r.scenario.training, r.scenario.plan).step_time_s == pytest.approx(t, rel=1e-12)
    eager = tr.model_copy(update={"compile": False})
    assert any(p.startswith("tp_comm_overlap: torchtitan's async TP") for p in job_problems(LLAMA, H100, eager))
    toml = tmp_path / "async.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 2\nseq_len = 8192\n'
                    '[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 4\n'
                    '[experimental]\nenable_async_tensor_parallel = true\n')
    (r,) = check_file_branches(toml, H100, None, None)
    assert "enable_async_tensor_parallel without the blocks compiled" in r.errors[0]
    toml.write_text(toml.read_text() + '[compile]\nenable = true\n')
    (r,) = check_file_branches(toml, H100, None, None)
    assert r.scenario.training.tp_comm_overlap is True


@pytest.mark.parametrize("compile,components", [(True, ("model", "loss")), (True, ("model",)), (False, ("model", "loss"))])
def test_torchtitan_parses_the_emitted_compile_flags(compile, components):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (requirements-consumers.txt)")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from torchtitan.config.manager import ConfigManager

    words = [w for w in emit.args(_sc(compile, components)) if not w.startswith("activation_checkpoint:")]
    cfg = ConfigManager().parse_args(words)
    assert cfg.compile.enable is compile
    assert tuple(cfg.compile.components) == components


def _read(words, config=None):
    doc = {"model": {"name": "llama3", "flavor": "8B"}, "parallelism": {"data_parallel_shard_degree": 8},
           "training": {"local_batch_size": 1}}
    doc = reader.apply_overrides(doc, (["--config", config] if config else []) + words)
    _, training, _, _ = reader.scenario_dicts(doc, 8, "job.toml")
    return TrainingSpec(**training)


def test_reader_reads_the_compile_setting():
    assert not _read([]).compile
    tr = _read(["--compile.enable"])
    assert tr.compiled_blocks and tr.compiled_loss
    tr = _read(["--compile.enable", "--compile.components", "model"])
    assert tr.compiled_blocks and not tr.compiled_loss
    assert _read([], config="llama3_405b").compiled_blocks  # its registry function enables compile
    assert not _read(["--compile.no-enable"], config="llama3_405b").compile
    tr = _read([], config="deepseek_v3_671b")
    assert tr.compiled_loss and not tr.compiled_blocks  # CompileConfig(enable=True, components=["loss"])


def test_job_problem_outside_torchtitan():
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=2048, framework="megatron", compile=True)
    assert job_problems(LLAMA, H100, tr) == [
        "compile: torch.compile of the blocks and the loss is modelled for torchtitan only (--compile.enable); "
        "megatron runs eager here, drop compile"]
    assert job_problems(LLAMA, H100, tr.model_copy(update={"framework": "torchtitan"})) == []


def test_cli_compile_option(runner):
    from planner.cli import app

    job = ["estimate", "-m", "llama3-8b", "-H", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "16",
           "--seq-len", "8192", "--tp", "1", "--pp", "1", "--micro-batch-size", "2", "--recompute", "selective",
           "--zero-stage", "3", "--framework", "torchtitan", "--json"]
    eager = json.loads(runner.invoke(app, job).stdout)
    compiled = runner.invoke(app, job + ["--compile"])
    assert compiled.exit_code in (0, 1), compiled.stdout
    assert json.loads(compiled.stdout)["memory"]["peak_gib"] < eager["memory"]["peak_gib"]
    res = runner.invoke(app, job[:-3] + ["--framework", "megatron", "--compile"])
    assert res.exit_code == 2 and "compile: torch.compile" in res.output, res.output


def test_torchtitan_parses_the_emitted_async_tp_flag():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (requirements-consumers.txt)")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from torchtitan.config.manager import ConfigManager

    for flags, want in ((["--compile.enable-async-tensor-parallel"], True),
                        (["--compile.no-enable-async-tensor-parallel"], False)):
        cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_8b", "--compile.enable",
                                          "--compile.components", "model,loss", *flags])
        assert cfg.compile.enable_async_tensor_parallel is want
