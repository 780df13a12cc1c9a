"""DeepSpeed's data-parallel communication as its engine runs it (deepspeed 0.19.8, installed by the Makefile): when the
gradient reduction starts, the weights' all-gather inside the optimizer step, BF16_Optimizer's gather at ZeRO stage
0, and the reduction dtype its config sets (planner.cost.grad_reduce_overlaps_last_backward, param_gather_overlapped,
_sync_s; planner/readers/megatron.py deepspeed_comm_16bit; docs/cost-model.md "DP")."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from planner import comm, cost
from planner.check import check_file_branches
from planner.layout import axis_span
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec

H100 = load_hardware("h100-sxm-80gb")
LAUNCH = Path(__file__).parent / "data" / "launch"


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (12, 16)])
def test_pipeline_engine_reduces_after_the_last_backward(stages, micro_batches):
    """DeepSpeed's own 1F1B program (``pipe/schedule.py`` ``TrainSchedule``): on every stage ``ReduceGrads`` comes
    after the stage's last ``BackwardPass``, so the reduction cannot hide under that backward; plan3d says so for
    every ZeRO stage the pipeline engine takes (0 and 1), and lets only ZeRO >= 1 without a pipeline (the ZeRO
    optimizer's hooks) start inside it."""
    schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for stage_id in range(stages):
        cmds = [type(c).__name__ for step in schedule.TrainSchedule(micro_batches, stages, stage_id).steps()
                for c in step]
        last_backward = max(i for i, c in enumerate(cmds) if c == "BackwardPass")
        assert cmds.count("ReduceGrads") == 1 and cmds.index("ReduceGrads") > last_backward
        assert cmds.count("BackwardPass") == micro_batches
    for zero in (0, 1):
        assert cost.grad_reduce_overlaps_last_backward("deepspeed", stages, zero) is False
    assert cost.grad_reduce_overlaps_last_backward("deepspeed", 1, 0) is False  # engine._backward_epilogue
    assert cost.grad_reduce_overlaps_last_backward("deepspeed", 1, 1) is True   # ZeRO hooks at the boundary
    assert cost.grad_reduce_overlaps_last_backward("megatron", stages, 0) is True


def test_bf16_optimizer_all_gathers_its_weights():
    """BF16_Optimizer steps 1/dp of the fp32 master weights and all-gathers the bf16 weights (``update_lp_params``):
    an all-gather of 2 B per parameter after the all-reduce. DeepSpeed 0.19.8 runs it for bf16 at ZeRO 0 under
    the pipeline engine and for ZeRO 1 with fp32 gradient accumulation (tests/test_deepspeed_engine.py asks the
    engine); bf16 at ZeRO 0 without a pipeline runs FP16_Optimizer in bf16 (deepspeedai/DeepSpeed#7790), which
    gathers nothing, and so do fp16 and Megatron's ZeRO 0."""
    model = load_model("llama3-8b")
    base = dict(num_gpus=16, global_batch_size=64, seq_len=4096)
    ds = TrainingSpec(**base, framework="deepspeed")
    accum_fp32 = TrainingSpec(**base, framework="deepspeed", deepspeed={"grad_accum_dtype": "fp32"})
    for training, plan in ((ds, Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=0)),
                           (accum_fp32, Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=1))):
        group = axis_span(plan, "dp", H100.nvlink_domain)
        layers = 16 if plan.pp > 1 else 32
        params = sum(cost.stage_param_split(model, plan, 0, layers))
        reduce_s, gather_s = cost.dp_sync_parts_s(model, H100, training, plan, 0, layers)
        assert reduce_s == pytest.approx(comm.collective_time_s("all_reduce", params * 4, group, H100))
        assert gather_s == pytest.approx(comm.collective_time_s("all_gather", params * 2, group, H100)) and gather_s > 0
    plain = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=0)
    for other in (ds, TrainingSpec(**base, framework="deepspeed", fp16=True), TrainingSpec(**base)):
        assert cost.dp_sync_parts_s(model, H100, other, plain, 0, 32)[1] == 0.0
    # the ZeRO optimizer at stage 1 reduce-scatters; BF16_Optimizer at stage 1 all-reduces after the backward
    zero1 = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=1)
    group = axis_span(zero1, "dp", H100.nvlink_domain)
    params = sum(cost.stage_param_split(model, zero1, 0, 32))
    assert cost.dp_sync_parts_s(model, H100, ds, zero1, 0, 32)[0] == \
        pytest.approx(comm.collective_time_s("reduce_scatter", params * 4, group, H100))
    assert cost.grad_reduction_args(ds, 1, 1)["grad_under_own_bwd"] is True
    assert cost.grad_reduction_args(accum_fp32, 1, 1)["grad_under_own_bwd"] is False


def test_deepspeed_gathers_inside_the_optimizer_step_hand_computed():
    """One stage, backward 3 s, forward 1 s, reduction 2 s, gather 4 s, contention 0.1, overlap on. Megatron hides
    the gather under the next forward (4 - 1 + 0.1 = 3.1) and the reduction under its backward (0.2): 3.3.
    DeepSpeed's optimizer step all-gathers before it returns: 4 + 0.2 = 4.2."""
    terms = {k: np.array([[v]]) for k, v in dict(total=4.0, compute=4.0, fwd=1.0, bwd=3.0, wgrad=0.0).items()}
    args = dict(optimizer=0.0, m=1, pp=1, vpp=1, counts=np.ones(1), before=np.zeros((1, 1)),
                overlap_grad_reduce=True, c=0.1)
    megatron = cost.compose_step(terms, np.zeros(1), np.array([2.0]), np.array([4.0]), **args)
    deepspeed = cost.compose_step(terms, np.zeros(1), np.array([2.0]), np.array([4.0]), **args,
                                  param_gather_overlapped=False)
    assert megatron["dp_exposed"][0] == pytest.approx(3.1 + 0.2)
    assert deepspeed["dp_exposed"][0] == pytest.approx(4.0 + 0.2)
    assert cost.param_gather_overlapped(TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=128,
                                                     framework="deepspeed")) is False


def test_search_tables_match_estimate_for_a_deepspeed_pipeline():
    """The per-ZeRO-stage flags reach the search's tables as estimate_time applies them (pp 2, ZeRO 0 and 1)."""
    from planner.candidates import Pins, SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model, hw = load_model("llama3-8b"), H100.model_copy(update={"inter_node_bandwidth_gbps": 5.0})
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework="deepspeed")
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=2, pins=Pins(pp=2)))
    keys = [k for k in legal_keys(tables) if tables.mem_kib[tables.unindex(k)].max() <= tables.usable_kib]
    checked = {assert_entry_is_estimate(model, hw, tr, tables, k).zero_stage for k in keys[:: max(1, len(keys) // 25)]}
    assert checked == {0, 1}


@pytest.mark.parametrize("config_update, bf16_comm", [
    ({}, True),  # fp16.enabled, no communication_data_type: DeepSpeed reduces in fp16
    ({"communication_data_type": "fp32"}, False),
    ({"communication_data_type": "BF16"}, True),
    ({"fp16": {"enabled": False}}, False),  # neither 16-bit section: fp32
])
def test_check_reads_deepspeeds_reduction_dtype(tmp_path, config_update, bf16_comm):
    """``communication_data_type`` of a Megatron-DeepSpeed launch's config, or DeepSpeed's default for it (0.19.8
    ``engine.py``: the training's 16-bit type), is the gradient bytes plan3d reduces."""
    shutil.copy(LAUNCH / "megatron_deepspeed_gpt_1.3B.sh", tmp_path / "run.sh")
    config = json.loads((LAUNCH / "ds_config_gpt_1.3B.json").read_text()) | config_update
    (tmp_path / "ds_config_gpt_1.3B.json").write_text(json.dumps(config))
    (r,) = check_file_branches(tmp_path / "run.sh", H100, None, None)
    assert not r.errors, r.errors
    assert r.scenario.training.grad_reduce_in_bf16 is bf16_comm


def test_check_refuses_an_unknown_reduction_dtype(tmp_path):
    shutil.copy(LAUNCH / "megatron_deepspeed_gpt_1.3B.sh", tmp_path / "run.sh")
    config = json.loads((LAUNCH / "ds_config_gpt_1.3B.json").read_text()) | {"communication_data_type": "int8"}
    (tmp_path / "ds_config_gpt_1.3B.json").write_text(json.dumps(config))
    (r,) = check_file_branches(tmp_path / "run.sh", H100, None, None)
    assert r.errors and "communication_data_type" in r.errors[0] and "int8" in r.errors[0]


def test_gradient_accumulation_passes_hand_computed():
    """BF16_Optimizer's per-micro-batch passes (tests/test_deepspeed_engine.py records them on the engine): 26 B per
    local parameter with its fp32 buffer on the pipeline's last stage (28 on a stage before it, which zeroes twice),
    moved at the profile's HBM rate, on every micro-batch, and the step grows by m times the pacing stage's share.
    Llama-3-8B, tp 1 pp 2 dp 8 under the pipeline engine:
    stage 0 holds 16 layers of 218,112,000 parameters (4096 x 6144 QKV, 4096 x 4096 out, 3 x 4096 x 14336 MLP, two
    4096 norms) and the 128,256 x 4096 embedding; the last stage the same 16 layers, the final norm and the output
    layer. Megatron accumulates inside the weight-gradient GEMM: no such term."""
    model = load_model("llama3-8b")
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert layer == 218_112_000
    stage0 = 16 * layer + 128256 * 4096
    rate = 3350e9 * 0.8  # h100-sxm-80gb: hbm_bandwidth_gbps x hbm_efficiency
    ds = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework="deepspeed")
    plan = Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=0)
    assert cost.grad_accum_s(model, H100, ds, plan, stage0) == pytest.approx(26 * stage0 / rate)
    # a stage before the pipeline's last zeroes its gradients twice (tests/test_deepspeed_engine.py)
    assert cost.grad_accum_s(model, H100, ds, plan, stage0, last_stage=False) == pytest.approx(28 * stage0 / rate)
    bf16_buffer = ds.model_copy(update={"deepspeed": ds.deepspeed.model_copy(update={"grad_accum_dtype": "bf16"})})
    assert cost.grad_accum_s(model, H100, bf16_buffer, plan, stage0) == pytest.approx(14 * stage0 / rate)
    zero1 = plan.model_copy(update={"zero_stage": 1})  # the ZeRO-1 optimizer: autograd's add alone
    assert cost.grad_accum_s(model, H100, ds, zero1, stage0) == pytest.approx(6 * stage0 / rate)
    zero2 = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=2)  # the bucket's 8 B, the partition's 14 B / 16
    assert cost.grad_accum_s(model, H100, ds, zero2, stage0) == pytest.approx((8 + 14 / 16) * stage0 / rate)
    zero3 = zero2.model_copy(update={"zero_stage": 3})  # the bucket's 8 B, the partition's 10 B / 16
    assert cost.grad_accum_s(model, H100, ds, zero3, stage0) == pytest.approx((8 + 10 / 16) * stage0 / rate)

    est = cost.estimate_time(model, H100, ds, plan)
    last = 16 * layer + 4096 + 128256 * 4096
    m = 64 // 8
    # the last stage paces the step: the same layers, with the output layer's GEMMs and loss, and 4,096 more
    # parameters (the final norm) to accumulate
    assert est.stages[1].total > est.stages[0].total and last > stage0
    assert est.breakdown["param_passes"] == pytest.approx(m * 26 * last / rate, rel=1e-9)
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    megatron = cost.estimate_time(model, H100, ds.model_copy(update={"framework": "megatron"}), plan)
    assert "param_passes" not in megatron.breakdown
    assert cost.grad_accum_s(model, H100, ds.model_copy(update={"framework": "megatron"}), plan, stage0) == 0
