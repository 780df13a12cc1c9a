"""plan3d validate in bf16: FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), as
torchtitan trains (planner/validate/worker.py ``mp_policy``), judged against the planner's prediction for that
bf16 run. 2 gloo ranks each (a few seconds per run on a 2-core machine)."""

import json
import sys

import pytest

pytest.importorskip("torch")

from planner.cli import app  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.render import scenario_json  # noqa: E402
from planner.specs import Plan, Scenario, TrainingSpec  # noqa: E402
from planner.validate import launch  # noqa: E402
from tests.torchrun_jobs import run_torchrun  # noqa: E402

LIMIT_S = 120


def _scenario(tp=2, pp=1, model="llama3-8b", precision="bf16", cp=1, **plan):
    """A 64-GPU plan whose miniature runs on 2 local ranks."""
    base = dict(tp=tp, pp=pp, cp=cp, dp=64 // (tp * pp * cp), micro_batch_size=1, recompute="none", sequence_parallel=False,
                zero_stage=0)
    return Scenario(model=load_model(model), hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048, precision=precision),
                    plan=Plan(**(base | plan)))


def _run(sc, steps=1):
    return launch.validate_local(sc, steps=steps, max_ranks=2, timeout_s=LIMIT_S, precision="bf16")


# Saved activations of one rank of the tp2-SP miniature (hidden 128, 8 heads of 16, 2 KV heads, ffn 448, seq 128,
# micro-batch 1, 2 layers), bf16 (2 B) except the fp32 RMSNorm rstd (4 B per token) and FlashAttention's fp32
# log-sum-exp (4 B per token and local head), the column-parallel inputs kept gathered (DTensor SP). Per layer:
# norm1 input 128*128*2/2 = 16384, rstd 128*4/2 = 256, QKV input 128*128*2 = 32768, Q 128*64*2 = 16384,
# K and V 2*128*16*2 = 8192, out-proj input 16384, log-sum-exp 128*4*4 = 2048, norm2 input 16384, rstd 256,
# FC1 input 32768, FC1 output 2*128*224*2 = 114688, FC2 input 128*224*2 = 57344: 313856; x 2 layers.
TP2_SP_SAVED_BF16 = 2 * 313856
TP2_SP_SAVED_FP32 = 2 * (2 * 313856 - 2 * 256 - 2048)  # everything 4 B, the fp32 statistics unchanged


VARIANTS = {
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "pp2-1f1b": {"tp": 1, "pp": 2},
    "dp2-zero3": {"tp": 1, "zero_stage": 3},
    "gpt-layernorm-tp2-sp": {"tp": 2, "sequence_parallel": True, "model": "megatron-gpt-1.7b"},
    "cp2-ring": {"tp": 1, "cp": 2},  # torch's ring attention (planner.validate.ring) on bf16 Q, K, V
}


@pytest.mark.parametrize("name", VARIANTS)
def test_bf16_miniature_matches_the_bf16_prediction(name):
    spec = dict(VARIANTS[name])
    sc = _scenario(**spec)
    mini, outcome = _run(sc)
    assert outcome.ok, outcome.message
    report = outcome.report
    assert mini.training.precision == "bf16" and report["verdict"] == "pass", report["reasons"]
    assert report["memory"] and all(abs(row["rel_error"]) <= launch.MEMORY_TOLERANCE for row in report["memory"])
    for r in report["measured"]["ranks"]:
        # FSDP2 keeps fp32 shards whatever param_dtype is: 4 B parameter, 4 B gradient, 8 B AdamW per parameter
        assert r["grads_bytes"] == r["weights_bytes"] and r["optimizer_bytes"] == 2 * r["weights_bytes"]
    if name == "tp2-sp":
        saved = {r["saved_activation_peak_bytes"] for r in report["measured"]["ranks"]}
        assert saved == {TP2_SP_SAVED_BF16} and TP2_SP_SAVED_BF16 < TP2_SP_SAVED_FP32
    if name == "pp2-1f1b":  # 1F1B: stage 0 holds 2 micro-batches in flight, stage 1 one (pp 2, 4 micro-batches)
        saved = {r["pp_rank"]: r["saved_activation_peak_bytes"] for r in report["measured"]["ranks"]}
        assert saved[0] == 2 * saved[1]
    # the gradient check runs in every bf16 run and passes at its tolerance; the loss is near the fp32 one
    dense = report["grad_check"]["dense"]
    assert dense["params"] > 0 and 0 < dense["rel_diff"] <= launch.GRAD_TOLERANCE_BF16
    assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE_BF16
    assert report["tolerances"]["loss"] == launch.LOSS_TOLERANCE_BF16


def test_a_wrong_in_flight_count_fails_in_bf16(monkeypatch):
    """GPipe instead of 1F1B (Narayanan et al. 2021, sec. 2.2): stage 0 saves 4/2 = 2x, stage 1 4/1 = 4x."""
    monkeypatch.setenv("PLAN3D_VALIDATE_SABOTAGE", "gpipe")
    _, outcome = _run(_scenario(tp=1, pp=2))
    assert outcome.ok, outcome.message
    report = outcome.report
    assert report["verdict"] == "fail"
    saved = {row["stage"]: row for row in report["memory"] if row["metric"] == "saved_activation_peak_bytes"}
    assert saved[0]["measured"] / saved[0]["predicted"] == pytest.approx(2.0, rel=1e-6)
    assert saved[1]["measured"] / saved[1]["predicted"] == pytest.approx(4.0, rel=1e-6)


def test_a_corrupted_shard_fails_the_bf16_gradient_check(monkeypatch):
    """+0.5 on TP rank 1's shard of one weight: rank 0's gradients (which see it through the forward) are far off
    the single-process model's. The first loss alone moves less than bf16's tolerance at initialisation, which
    is why every bf16 run makes the gradient check (launch.LOSS_TOLERANCE_BF16)."""
    monkeypatch.setenv("PLAN3D_VALIDATE_SABOTAGE", "corrupt:1")
    _, outcome = _run(_scenario(tp=2))
    assert outcome.ok, outcome.message
    report = outcome.report
    assert report["verdict"] == "fail"
    assert [r for r in report["reasons"] if r.startswith("gradients:")], report["reasons"]
    assert report["grad_check"]["dense"]["rel_diff"] > 8 * launch.GRAD_TOLERANCE_BF16


def test_fp8_plans_run_bf16_and_say_so():
    sc = _scenario(tp=2, sequence_parallel=True, precision="fp8")
    run = launch.run_scenario(sc)
    assert run.training.precision == "bf16" and run.training.framework == "torch"
    changed = launch.changes(sc, run)
    assert any(c.startswith("precision fp8 -> bf16 (the validate model has no fp8 GEMMs") for c in changed), changed
    assert launch.run_scenario(_scenario(precision="bf16")).training.precision == "bf16"
    assert launch.run_scenario(_scenario(precision="bf16"), "fp32").training.precision == "fp32"
    assert not any(c.startswith("precision") for c in launch.changes(_scenario(), launch.run_scenario(_scenario())))
    mini = launch.miniature(sc, max_ranks=2, precision="bf16")
    assert mini.training.precision == "bf16" and "precision fp8 -> bf16" in " ".join(launch.changes(sc, mini))
    assert launch.miniature(sc, max_ranks=2).training.precision == "fp32"  # the miniature's default


def test_validate_cli_precision(runner, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(scenario_json(_scenario(tp=2, sequence_parallel=True)))
    res = runner.invoke(app, ["validate", str(plan), "--precision", "fp8", "--quiet"])
    assert res.exit_code == 2 and "--precision" in res.output
    res = runner.invoke(app, ["validate", str(plan), "--precision", "bf16", "--framework", "torchtitan", "--quiet"])
    assert res.exit_code == 2 and "--precision" in res.output
    out = tmp_path / "report.json"
    res = runner.invoke(app, ["validate", str(plan), "--precision", "bf16", "--max-ranks", "2", "--steps", "1",
                              "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["miniature"]["training"]["precision"] == "bf16" and data["verdict"] == "pass"


def test_inside_torchrun_an_fp8_plan_runs_bf16_at_full_size(tmp_path):
    """The in-job path (worker --full-size: meta build, shard, materialise): an fp8 plan runs bf16, the report
    lists that change and judges the run against the bf16 prediction."""
    mini = launch.miniature(_scenario(tp=2, sequence_parallel=True), max_ranks=2, precision="bf16")
    fp8 = mini.model_copy(update={"hardware": load_hardware("h100-sxm-80gb"),
                                  "training": mini.training.model_copy(update={"precision": "fp8"})})
    plan = tmp_path / "fp8.plan.json"
    plan.write_text(scenario_json(fp8))
    report = tmp_path / "report.json"
    res = run_torchrun([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "planner.cli", "validate", str(plan), "--backend", "gloo", "--steps", "1",
                        "--out", str(report)], LIMIT_S)  # retried after gloo's native abort (tests/torchrun_jobs.py)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(report.read_text())
    assert any(c.startswith("precision fp8 -> bf16") for c in data["changed"]), data["changed"]
    assert "changed: precision fp8 -> bf16" in res.stdout
    assert data["verdict"] == "pass", data["reasons"]
    saved = {row["measured"] for row in data["memory"] if row["metric"] == "saved_activation_peak_bytes"}
    assert saved == {TP2_SP_SAVED_BF16}  # bf16 activations at full size too (same miniature shapes)


def test_layernorm_saves_fp32_statistics_in_bf16_and_matches_torch():
    """planner.validate.kernels.LayerNormFn: the input (bf16) and fp32 mean and rstd, as torch's CUDA kernel keeps
    them (torch's CPU F.layer_norm keeps bf16 ones when input and weight are bf16); values as F.layer_norm's."""
    import torch
    import torch.nn.functional as F

    from planner.validate.kernels import LayerNormFn

    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        if t is not w:
            saved.append((str(t.dtype), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LayerNormFn.apply(x, w, b, 1e-5)
    # x: 2*8*16 values * 2 B = 512; mean and rstd: 2*8 tokens * 4 B = 64 each
    assert sorted(saved) == sorted([("torch.bfloat16", 512), ("torch.float32", 64), ("torch.float32", 64)])
    torch_saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: torch_saved.append(t.dtype) or t, lambda t: t):
        F.layer_norm(x, (16,), w, b, 1e-5)
    assert torch.float32 not in torch_saved  # the CPU kernel's bf16 statistics, which LayerNormFn replaces

    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, b))
    g = torch.randn(2, 8, 16)
    LayerNormFn.apply(xf, wf, bf, 1e-5).backward(g)
    ours = [t.grad.clone() for t in (xf, wf, bf)]
    for t in (xf, wf, bf):
        t.grad = None
    F.layer_norm(xf, (16,), wf, bf, 1e-5).backward(g)
    for a, want in zip(ours, (xf.grad, wf.grad, bf.grad)):
        assert torch.allclose(a, want, atol=1e-5, rtol=1e-5)


def test_bf16_with_experts_is_refused_in_one_line():
    moe = Scenario(model=load_model("tiny-moe"), hardware=load_hardware("h100-sxm-80gb"),
                   training=TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=256),
                   plan=Plan(tp=1, pp=2, dp=4, ep=4, micro_batch_size=1, zero_stage=0))
    with pytest.raises(launch.SpecError, match="bf16 with a mixture of experts is not judged"):
        launch.miniature(moe, max_ranks=8, precision="bf16")
    assert launch.miniature(moe, max_ranks=8).training.precision == "fp32"


def test_fsdp2_unsharded_state_under_pp_matches_the_torch_profile(tmp_path):
    """What FSDP2 holds beyond the fp32 shards while a pipeline stage runs its micro-batches' backward in bf16:
    torch.distributed.pipelining's ``PipelineStage.backward_maybe_with_nosync`` turns off the gradient sync and
    the reshard after backward (torch 2.13 ``pipelining/stage.py``), so every parameter stays gathered in bf16
    (2 B) and its gradient is accumulated unsharded in ``reduce_dtype`` fp32 (4 B,
    ``FSDPParam.to_accumulated_grad_if_needed``), with no bf16 gradient left over. The torch profile's
    ``state_bytes`` for pp > 1 adds exactly those 2 B and 4 B per parameter to the shards. Measured here on one
    gloo rank (the shard is the whole parameter), the 2-layer miniature model, two micro-batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from planner.frameworks import get
    from planner.validate.model import build_chunks
    from planner.validate.worker import loss_fn, mp_policy

    mini = launch.miniature(_scenario(tp=1), max_ranks=1, precision="bf16")
    model = mini.model
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        (chunk,) = build_chunks(model, [model.num_layers])
        params = sum(p.numel() for p in chunk.parameters())
        layer_params = sum(p.numel() for p in chunk.layers[0].parameters())
        mp = mp_policy("bf16")
        for blk in chunk.layers:
            fully_shard(blk, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        chunk.set_is_last_backward(False)  # what backward_maybe_with_nosync sets for every micro-batch
        chunk.set_reshard_after_backward(False)
        chunk.set_requires_gradient_sync(False)
        tokens = torch.randint(0, model.vocab_size, (2, 1, 33))
        for mb in tokens:
            loss_fn(chunk(mb[:, :-1]), mb[:, 1:]).backward()
        fsdp_params = [f for m in chunk.modules() if hasattr(m, "_get_fsdp_state")
                       for f in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
        assert sum(f.sharded_param.numel() for f in fsdp_params) == params

        def nbytes(t):
            return t.numel() * t.element_size() if t is not None and t.untyped_storage().size() else 0

        gathered = sum(nbytes(t) for f in fsdp_params for t in f.all_gather_outputs)
        accumulated = sum(nbytes(f.unsharded_accumulated_grad) for f in fsdp_params)
        leftover = sum(nbytes(f._unsharded_param.grad) for f in fsdp_params)
        assert {t.dtype for f in fsdp_params for t in f.all_gather_outputs} == {torch.bfloat16}
        assert (gathered, accumulated, leftover) == (2 * params, 4 * params, 0)
    finally:
        dist.destroy_process_group()
    plan = mini.plan.model_copy(update={"pp": 2, "zero_stage": 2})
    st = get("torch").state_bytes(model, mini.training, plan, params, layer_params, model.num_layers)
    shards = 4 * params / (plan.dp * plan.cp)  # the fp32 parameter and gradient shards (dp = cp = 1 here)
    assert (st.weights_bytes - shards, st.grads_bytes - shards) == (gathered, accumulated)
