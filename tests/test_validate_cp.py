"""Context parallelism runs in `plan3d validate` on gloo: torch's ring attention around the CPU
flash-attention kernel (planner.validate.ring), the sequence head-tail sharded over the cp ranks.

One 2-process unit test of the ring against full-sequence SDPA, three gloo runs of a miniature
(cp2; tp2 x cp2 with SP and every model feature; pp2 x cp2 with selective recompute) and one
sabotaged run where each rank attends only to its own tokens, which the verdict must fail.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from planner.presets import SpecError, load_hardware, load_model  # noqa: E402
from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec  # noqa: E402
from planner.validate import launch  # noqa: E402


def _model(**update):
    return ModelSpec.model_validate(load_model("llama3-8b").model_dump() | {"max_seq_len": 8192} | update)


def _scenario(model, tp=1, pp=1, cp=2, **plan):
    base = dict(tp=tp, pp=pp, cp=cp, dp=64 // (tp * pp * cp), micro_batch_size=1, recompute="none",
                sequence_parallel=False, zero_stage=0)
    return Scenario(model=model, hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048), plan=Plan(**(base | plan)))


def _validate(sc, max_ranks):
    mini, outcome = launch.validate_local(sc, steps=2, max_ranks=max_ranks, timeout_s=120)
    assert outcome.ok, outcome.message
    return mini, outcome.report


def _rows(report, metric):
    return [row for row in report["memory"] if row["metric"] == metric]


def _check_pass(mini, report):
    """Verdict pass; loss and rank 0's gradients equal the single process's; every memory component of
    every rank equals its prediction; the tokens of each rank are s/cp (CP was not dropped)."""
    assert report["verdict"] == "pass", report["reasons"]
    assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE
    dense = report["grad_check"]["dense"]
    assert dense["params"] > 0 and dense["rel_diff"] <= launch.GRAD_TOLERANCE
    assert len(report["memory"]) == 4 * mini.plan.world_size
    assert all(abs(row["rel_error"]) < 1e-9 for row in report["memory"]), report["memory"]
    ranks = report["measured"]["ranks"]
    assert {r["local_seq_len"] for r in ranks} == {mini.training.seq_len // mini.plan.cp}
    # Megatron's order tp-cp-dp-pp: tp fastest, then cp
    p = mini.plan
    assert all(r["tp_rank"] == r["rank"] % p.tp and r["cp_rank"] == r["rank"] // p.tp % p.cp for r in ranks)
    assert report["losses"][-1] < report["losses"][0]
    assert report["microbenchmarks"]["cp_ring_exchange"]["ranks"] == p.cp
    assert report["microbenchmarks"]["dp_all_reduce"]["ranks"] == p.dp * p.cp  # gradients: over dp x cp
    # without cp the same miniature would save twice the activations: the measurement is the s/cp one
    no_cp = mini.model_copy(update={"plan": mini.plan.model_copy(update={"cp": 1, "dp": mini.plan.dp * mini.plan.cp})})
    for row in _rows(report, "saved_activation_peak_bytes"):
        whole = launch.predicted_rank_memory(no_cp, row["stage"])["saved_activation_peak_bytes"]
        assert row["measured"] < 0.6 * whole


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    """`plan3d validate plan.json --max-ranks 2` on a cp=2 plan: exit 0 (pass) and its JSON report."""
    import json

    from typer.testing import CliRunner

    from planner.cli import app
    from planner.render import scenario_json

    folder = tmp_path_factory.mktemp("cp")
    sc = _scenario(_model())
    (folder / "plan.json").write_text(scenario_json(sc))
    res = CliRunner().invoke(app, ["validate", str(folder / "plan.json"), "--max-ranks", "2", "--steps", "2",
                                   "--out", str(folder / "report.json"), "--quiet"])
    assert res.exit_code == 0, res.output
    return launch.miniature(sc, max_ranks=2), json.loads((folder / "report.json").read_text()), res.output


def test_cp2_passes_validate(cp_run):
    mini, report, output = cp_run
    assert mini.plan.cp == 2 and mini.plan.world_size == 2 and report["miniature"]["plan"]["cp"] == 2
    assert not any("cp" in c for c in report["changed"])
    assert "dense gradients (rank 0" in output and "verdict: PASS" in output
    _check_pass(mini, report)


def test_tp2_cp2_with_sequence_parallelism_and_model_features():
    """Learned positions at the global position of each local token, tied embeddings, dropout, embedding norm."""
    features = dict(tied_embeddings=True, position_embedding="learned", embedding_norm=True, dropout=True)
    mini, report = _validate(_scenario(_model(**features), tp=2, sequence_parallel=True), max_ranks=4)
    assert (mini.plan.tp, mini.plan.cp, mini.plan.sequence_parallel) == (2, 2, True)
    _check_pass(mini, report)


def test_pp2_cp2_with_selective_recompute_and_zero3():
    mini, report = _validate(_scenario(_model(), pp=2, recompute="selective", zero_stage=3), max_ranks=4)
    assert (mini.plan.pp, mini.plan.cp, mini.plan.zero_stage) == (2, 2, 3)
    _check_pass(mini, report)


def test_dropping_the_ring_fails_the_verdict(monkeypatch):
    """Each rank attending only to its own s/cp tokens saves the same bytes but computes another model. At
    initialisation the attention is nearly uniform, so the first loss moves less than its tolerance (6.8e-5
    here); the gradients (rank 0 against the single process) are off by most of their size."""
    monkeypatch.setenv("PLAN3D_VALIDATE_SABOTAGE", "local_attention")
    _, report = _validate(_scenario(_model()), max_ranks=2)
    assert report["verdict"] == "fail"
    assert any(r.startswith("gradients: rank 0's dense gradients") for r in report["reasons"]), report["reasons"]
    assert report["grad_check"]["dense"]["rel_diff"] > 0.1
    assert all(abs(row["rel_error"]) < 1e-9 for row in _rows(report, "saved_activation_peak_bytes"))


def test_cp_is_refused_on_nccl_and_with_experts_in_one_line():
    with pytest.raises(SpecError) as err:
        launch.miniature(_scenario(_model()), max_ranks=8, backend="nccl")
    assert "\n" not in str(err.value) and "cp=2" in str(err.value) and "gloo" in str(err.value)
    moe = Scenario(model=load_model("mixtral-8x7b"), hardware=load_hardware("h100-sxm-80gb"),
                   training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048),
                   plan=Plan(tp=2, pp=1, cp=2, dp=16, ep=8, micro_batch_size=1, sequence_parallel=True))
    with pytest.raises(SpecError) as err:
        launch.miniature(moe, max_ranks=8)
    assert "\n" not in str(err.value) and "experts" in str(err.value)


def test_too_many_ranks_names_cp():
    with pytest.raises(SpecError) as err:
        launch.miniature(_scenario(_model(), tp=2, cp=4, dp=8), max_ranks=4)
    assert "cp(4)" in str(err.value) and "--max-ranks" in str(err.value)


RING = textwrap.dedent("""
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from planner.validate.ring import ring_attention, shard_sequence
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    b, h, g, s, d = 2, 4, 2, 16, 8  # GQA: 2 query heads per K/V head
    q = torch.randn(b, s, h, d).transpose(1, 2).requires_grad_()  # the model's layout
    k, v = (torch.randn(b, g, s, d, requires_grad=True) for _ in range(2))
    dy = torch.randn(b, h, s, d)
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dy)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).detach()
    pos = torch.arange(s)
    ql, kl, vl, dyl, mine = shard_sequence(mesh["cp"], [q.detach(), k.detach(), v.detach(), dy, pos], [2, 2, 2, 2, 0], s)
    ql, kl, vl = (t.clone().requires_grad_() for t in (ql, kl, vl))
    out = ring_attention(ql, kl, vl, mesh["cp"].get_group())
    out.backward(dyl)
    err = lambda a, ref: float((a - ref[:, :, mine]).abs().max())
    print("RING", dist.get_rank(), mine.tolist(), err(out.detach(), full), err(ql.grad, q.grad),
          err(kl.grad, k.grad), err(vl.grad, v.grad), out.transpose(1, 2).is_contiguous())
    dist.destroy_process_group()
""")


def test_ring_attention_equals_full_sequence_sdpa():
    """Two gloo ranks: each rank's output and Q/K/V gradients equal full-sequence causal SDPA (one process)
    at its tokens, which are the head-tail chunks r and 3-r of 4 (torch's _HeadTailLoadBalancer)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = str(launch.free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RING], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2"))
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    lines = [ln.split(" ", 3) for o in outs for ln in o.splitlines() if ln.startswith("RING")]
    assert len(lines) == 2, outs
    want = {"0": [0, 1, 2, 3, 12, 13, 14, 15], "1": [4, 5, 6, 7, 8, 9, 10, 11]}
    for _, rank, positions_and_errors in ((ln[0], ln[1], ln[2] + " " + ln[3]) for ln in lines):
        positions, rest = positions_and_errors.split("] ")
        assert [int(x) for x in positions.strip("[").split(", ")] == want[rank]
        *errors, layout = rest.split()
        assert all(float(e) < 1e-5 for e in errors), errors
        assert layout == "True"  # the output keeps the [b, s, heads, d] layout: saved once
