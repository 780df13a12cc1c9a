"""Nothing is silently changed by validate: the features the miniature used to drop are run and
measured (tied embeddings, dropout, learned positions, the embedding norm, weight-only LayerNorms, the output
layer's bias; context parallelism on gloo:
tests/test_validate_cp.py), and what the run cannot represent (ALiBi; context parallelism on NCCL) is
refused with a one-line reason.

Two 2-rank gloo runs carry all the features (module-scoped fixtures); each test checks one feature.
"""

import subprocess
import sys

import pytest

pytest.importorskip("torch")

from planner.presets import SpecError, load_hardware, load_model  # noqa: E402
from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec  # noqa: E402
from planner.validate import launch  # noqa: E402


def _model(**update):
    return ModelSpec.model_validate(load_model("llama3-8b").model_dump() | {"max_seq_len": 8192} | update)


def _scenario(model, tp=2, pp=1, **plan):
    base = dict(tp=tp, pp=pp, dp=64 // (tp * pp), micro_batch_size=1, recompute="none", sequence_parallel=False,
                zero_stage=0)
    return Scenario(model=model, hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048), plan=Plan(**(base | plan)))


FEATURES = dict(tied_embeddings=True, position_embedding="learned", embedding_norm=True, dropout=True,
                norm="layernorm", norm_bias=False, output_bias=True)  # weight-only LayerNorms (MPT), Phi's head bias


def _validate(sc):
    mini, outcome = launch.validate_local(sc, steps=2, max_ranks=2, timeout_s=120)
    assert outcome.ok, outcome.message
    assert outcome.report["verdict"] == "pass", outcome.report["reasons"]
    return mini, outcome.report


@pytest.fixture(scope="module")
def tp_sp_run():
    """TP2 with sequence parallelism, one stage: tied in one module, learned positions split after the add."""
    return _validate(_scenario(_model(**FEATURES), sequence_parallel=True))


@pytest.fixture(scope="module")
def pp_run():
    """PP2: the tied embedding's two copies live on different stages."""
    return _validate(_scenario(_model(**FEATURES), tp=1, pp=2))


def _rows(report, metric):
    return [row for row in report["memory"] if row["metric"] == metric]


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_the_miniature_keeps_the_feature(feature):
    mini = launch.miniature(_scenario(_model(**FEATURES), sequence_parallel=True), max_ranks=2)
    assert getattr(mini.model, feature) == FEATURES[feature]


def test_tied_embeddings_in_one_stage(tp_sp_run):
    mini, report = tp_sp_run
    # one shared matrix: the weights match the prediction that counts the tied head once
    assert all(row["rel_error"] == 0.0 for row in _rows(report, "weights_bytes"))
    untied = launch.predicted_rank_memory(mini.model_copy(update={"model": mini.model.model_copy(
        update={"tied_embeddings": False})}), 0)["weights_bytes"]
    assert _rows(report, "weights_bytes")[0]["measured"] < untied
    assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE


def test_tied_embeddings_across_stages_stay_equal(pp_run):
    _, report = pp_run
    assert report["tied_max_abs_diff"] == 0.0  # the copies got the summed gradient on both stages
    assert all(row["rel_error"] == 0.0 for row in _rows(report, "weights_bytes"))
    assert report["reference"]["rel_error"] == pytest.approx(0.0, abs=launch.LOSS_TOLERANCE)


def test_dropout_masks_are_saved_and_measured(tp_sp_run, pp_run):
    """Dropout keeps a 1-byte mask per residual element: the measured saved bytes equal the prediction
    with dropout, which is larger than without it (Korthikanti et al. 2022, Table 2 mask terms)."""
    for mini, report in (tp_sp_run, pp_run):
        measured = _rows(report, "saved_activation_peak_bytes")
        assert all(row["rel_error"] == 0.0 for row in measured)
        no_drop = mini.model_copy(update={"model": mini.model.model_copy(update={"dropout": False})})
        for row in measured:
            assert row["measured"] > launch.predicted_rank_memory(no_drop, row["stage"])["saved_activation_peak_bytes"]
        assert report["losses"][-1] < report["losses"][0]


def test_learned_positions_with_sequence_parallelism(tp_sp_run):
    mini, report = tp_sp_run
    assert mini.plan.sequence_parallel and mini.model.position_embedding == "learned"
    first = [row for row in _rows(report, "weights_bytes") if row["stage"] == 0]
    assert first and all(row["rel_error"] == 0.0 for row in first)  # the table, replicated on each TP rank
    assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE


def test_output_bias_and_bias_free_norms_are_held_as_counted(tp_sp_run, pp_run):
    """The output layer's bias (``output_bias``, DTensor ColwiseParallel splits it with the vocabulary rows) and the
    weight-only LayerNorms (``norm_bias`` False) are in the measured weights exactly as predicted, and the prediction
    differs from one without them."""
    for mini, report in (tp_sp_run, pp_run):
        rows = _rows(report, "weights_bytes")
        assert rows and all(row["rel_error"] == 0.0 for row in rows)
        last = max(row["stage"] for row in rows)
        measured = next(row["measured"] for row in rows if row["stage"] == last)

        def predicted(**update):
            other = mini.model_copy(update={"model": mini.model.model_copy(update=update)})
            return launch.predicted_rank_memory(other, last)["weights_bytes"]
        assert predicted(output_bias=False) < measured < predicted(norm_bias=None)
        assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE


def test_embedding_norm(tp_sp_run):
    mini, report = tp_sp_run
    assert mini.model.embedding_norm
    assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE


def test_context_parallelism_is_kept_on_gloo_and_refused_on_nccl_with_one_line():
    sc = _scenario(_model(), tp=2, pp=1, dp=16, cp=2)
    mini = launch.miniature(sc, max_ranks=8)
    assert (mini.plan.tp, mini.plan.cp, mini.plan.dp, mini.plan.world_size) == (2, 2, 2, 8)
    assert mini.training.seq_len % (2 * 2 * 2) == 0  # 2cp head-tail chunks, each split over TP
    with pytest.raises(SpecError) as err:
        launch.miniature(sc, max_ranks=8, backend="nccl")
    text = str(err.value)
    assert "\n" not in text and "cp=2" in text and "gloo" in text


def test_alibi_is_refused_with_one_line():
    with pytest.raises(SpecError) as err:
        launch.miniature(_scenario(_model(position_embedding="alibi")), max_ranks=2)
    assert "\n" not in str(err.value) and "alibi" in str(err.value)


def test_mtp_is_refused_with_one_line():
    with pytest.raises(SpecError) as err:
        launch.miniature(_scenario(_model(mtp_num_layers=1)), max_ranks=2)
    assert "\n" not in str(err.value) and "mtp_num_layers=1" in str(err.value)


PROBE = """
import os, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))
x = torch.randn(1, 2, 16, 8)
w = torch.randn(8, 8, requires_grad=True)
try:
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
        F.scaled_dot_product_attention(x @ w, x @ w, x, is_causal=True).sum().backward()
    print("CP-RUNS")
except NotImplementedError as e:
    print("CP-REFUSED", e)
dist.destroy_process_group()
"""


def test_the_cp_refusal_is_still_true_for_this_torch():
    """torch's public context_parallel still has no rule for the CPU attention kernel, which is why the worker
    calls torch's ring templates itself (planner.validate.ring). When this fails, torch's context_parallel
    handles the CPU kernel: the worker could then use it directly."""
    import os

    env = dict(os.environ, PROBE_PORT=str(launch.free_port()))
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert "CP-REFUSED" in res.stdout, res.stdout + res.stderr[-2000:]
    assert "_scaled_dot_product_flash_attention_for_cpu" in res.stdout


def test_geglu_runs_gated_and_measures_as_predicted():
    """A GeGLU model (Gemma) runs its gated MLP (planner.validate.kernels.GeGLUFn, saving the FC1 output as the fused
    GLU kernels do): weights and saved activations equal the prediction exactly; before, the validate MLP ran a
    non-gated GeLU of half the FC1 width for it."""
    mini, report = _validate(_scenario(_model(activation="geglu"), sequence_parallel=True))
    assert mini.model.activation == "geglu"
    for metric in ("weights_bytes", "saved_activation_peak_bytes"):
        rows = _rows(report, metric)
        assert rows and all(row["rel_error"] == 0.0 for row in rows), metric
    assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE


def test_the_miniature_keeps_each_bias():
    """GPT-J's pattern (no attention biases, MLP biases) and Seed-OSS's (Q/K/V biases, none on the output
    projection): the miniature keeps each bias as the plan's model sets it."""
    for biases in (dict(linear_bias=False, qkv_bias=False, out_proj_bias=False, mlp_bias=True),
                   dict(linear_bias=False, qkv_bias=True, out_proj_bias=False, mlp_bias=False)):
        mini = launch.miniature(_scenario(_model(**biases)), max_ranks=2).model
        assert (mini.has_qkv_bias, mini.has_out_proj_bias, mini.has_mlp_bias) == \
            (biases["qkv_bias"], biases["out_proj_bias"], biases["mlp_bias"])


def test_layer_structure_the_validate_model_does_not_build_is_listed_not_dropped_silently():
    """What planner/validate/model.py does not build (launch.UNBUILT_STRUCTURE) is named in the report's changes,
    for the miniature and for the full-size run (whose prediction is of the layer it builds, launch.buildable_model);
    a plain Llama layer lists none."""
    phi_like = _model(parallel_attention=True, shared_input_norm=True, rotary_percent=0.5)
    gemma_like = _model(norm_placement="sandwich", attn_logit_softcap=50.0, sliding_window=4096,
                        sliding_window_layers=16)
    for model, names in ((phi_like, ("parallel_attention", "shared_input_norm", "rotary_percent")),
                         (gemma_like, ("norm_placement", "attn_logit_softcap", "sliding_window"))):
        sc = _scenario(model)
        for run in (launch.miniature(sc, max_ranks=2), launch.run_scenario(sc)):
            line = [c for c in launch.changes(sc, run) if c.startswith("layer structure")]
            assert len(line) == 1 and all(f"{name} " in line[0] for name in names), line
            assert all(getattr(run.model, n) == getattr(_model(), n) for n in launch.UNBUILT_STRUCTURE)
    plain = _scenario(_model())
    assert not [c for c in launch.changes(plain, launch.run_scenario(plain)) if c.startswith("layer structure")]
