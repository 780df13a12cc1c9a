"""Framework profiles (planner/frameworks): the bytes each framework holds, its search limits, and
published configurations and readings (tests/data/published_memory.json).

Expected values are written from each framework's documented bytes per parameter (cited per test),
with parameter counts from ``stage_params_per_rank`` (not under test here).
"""

import json
from pathlib import Path

import pytest

from planner.candidates import SearchSpace, enumerate_plans
from planner.frameworks import deepspeed as ds_profile
from planner.frameworks import torchtitan
from planner.memory import estimate_memory, layer_params_per_rank, stage_params_per_rank, stage_state_bytes
from planner.presets import load_hardware, load_model
from planner.search import search
from planner.specs import DeepSpeedZero, ModelSpec, Plan, Scenario, TrainingSpec, plan_problems

DATA = json.loads((Path(__file__).parent / "data" / "published_memory.json").read_text())
LLAMA = load_model("llama3-8b")
H100 = load_hardware("h100-sxm-80gb")


def _training(framework, num_gpus=64, **kw):
    return TrainingSpec(num_gpus=num_gpus, global_batch_size=kw.pop("gbs", 128), seq_len=4096, framework=framework, **kw)


def _params(plan, stage=0, layers=8):
    return stage_params_per_rank(LLAMA, plan, stage, layers)


def test_torch_shares_torchtitans_distributed_semantics():
    """'torch' (plan3d validate's model) holds states and logits as torchtitan does; its activations
    differ only by the SiLU output that torchtitan's unfused SwiGLU also keeps (s b f / t x 2 B)."""
    plan = Plan(tp=2, pp=2, dp=16, micro_batch_size=1, zero_stage=3, sequence_parallel=True)
    a = estimate_memory(LLAMA, H100, _training("torch"), plan).stages
    b = estimate_memory(LLAMA, H100, _training("torchtitan"), plan).stages
    for x, y in zip(a, b):
        assert (x.weights_bytes, x.grads_bytes, x.optimizer_bytes, x.other_bytes) == \
            (y.weights_bytes, y.grads_bytes, y.optimizer_bytes, y.other_bytes)
    silu = 4096 * 1 * LLAMA.ffn_size / 2 * 2
    in_flight = (2, 1)  # 1F1B: min(m, p - r)
    for r, (x, y) in enumerate(zip(a, b)):
        assert y.activations_bytes - x.activations_bytes == pytest.approx(in_flight[r] * 16 * silu)


@pytest.mark.parametrize("framework", ["megatron", "nemo"])
@pytest.mark.parametrize("bf16_grads", [False, True])
def test_megatron_distributed_optimizer_bytes(framework, bf16_grads):
    """formulas.md A1 (Megatron distrib_optimizer.md table): bf16 params + fp32 grads = 6 + 12/d B;
    with --grad-reduce-in-bf16 (NeMo grad_sync_dtype bf16) 4 + 12/d."""
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    st = stage_state_bytes(LLAMA, _training(framework, grad_reduce_in_bf16=bf16_grads), plan, 1, 8)
    p = _params(plan, 1)
    assert st.weights_bytes == pytest.approx(2 * p)
    assert st.grads_bytes == pytest.approx((2 if bf16_grads else 4) * p)
    assert st.optimizer_bytes == pytest.approx(12 * p / 16)


def test_megatron_fp8_weight_cache():
    """Transformer Engine keeps an fp8 weight and its fp8 transpose per GEMM weight: +2 B per
    linear parameter (norms excluded; Llama has no biases)."""
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    bf16 = stage_state_bytes(LLAMA, _training("megatron"), plan, 1, 8)
    fp8 = stage_state_bytes(LLAMA, _training("megatron", precision="fp8"), plan, 1, 8)
    linear = 8 * (layer_params_per_rank(LLAMA, 1) - 2 * LLAMA.hidden_size)
    assert fp8.weights_bytes - bf16.weights_bytes == pytest.approx(2 * linear)


@pytest.mark.parametrize("framework", ["megatron", "nemo"])
def test_megatron_fp8_params_drop_the_bf16_copy(framework):
    """--fp8-param-gather / NeMo fp8_params: each GEMM weight is a Float8Tensor in a uint8 param
    buffer (core_v0.16.1 distributed_data_parallel.py) plus TE's fp8 transpose: 1 + 1 B per linear
    parameter; norms stay bf16 (2 B); gradients and optimizer as without it."""
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    base = stage_state_bytes(LLAMA, _training(framework, precision="fp8"), plan, 1, 8)
    st = stage_state_bytes(LLAMA, _training(framework, precision="fp8", fp8_params=True), plan, 1, 8)
    p = _params(plan, 1)
    linear = 8 * (layer_params_per_rank(LLAMA, 1) - 2 * LLAMA.hidden_size)
    assert st.weights_bytes == pytest.approx(2 * (p - linear) + (1 + 1) * linear)
    assert (st.grads_bytes, st.optimizer_bytes) == (base.grads_bytes, base.optimizer_bytes)


@pytest.mark.parametrize("framework", ["megatron", "nemo"])
def test_megatron_mxfp8_params_are_mxfp8_tensors(framework):
    """--fp8-param-gather under mxfp8 (Megatron-Bridge bf16_with_mxfp8_mixed): each GEMM weight is a TE
    MXFP8Tensor with both block-scaled directions, 1 B each plus an E8M0 scale per 32 values, and no bf16
    copy (core_v0.16.1 param_and_grad_buffer.py shares the gradient buffer for the bf16 all-gather):
    2 + 2/32 B per linear parameter against bf16 2 + cached copies 2 + 2/32 without it; norms stay bf16."""
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    base = stage_state_bytes(LLAMA, _training(framework, precision="mxfp8"), plan, 1, 8)
    st = stage_state_bytes(LLAMA, _training(framework, precision="mxfp8", fp8_params=True), plan, 1, 8)
    p = _params(plan, 1)
    linear = 8 * (layer_params_per_rank(LLAMA, 1) - 2 * LLAMA.hidden_size)
    assert st.weights_bytes == pytest.approx(2 * (p - linear) + 2.0625 * linear)
    assert base.weights_bytes - st.weights_bytes == pytest.approx(2 * linear)
    assert (st.grads_bytes, st.optimizer_bytes) == (base.grads_bytes, base.optimizer_bytes)


def test_mxfp8_param_gather_emitted_and_read_back(tmp_path):
    """The emitter writes --fp8-param-gather and --reuse-grad-buf-for-mxfp8-param-ag for an mxfp8 plan with
    fp8_params, and the TE cross-entropy flags (tests/test_emit_consumers.py runs Megatron's own argument
    validation on them); `check` reads such a launch back as fp8_params under mxfp8 with cross_entropy_fusion te."""
    import shlex

    from planner.check import check_file_branches
    from planner.emit.megatron import megatron_flags

    gb200 = load_hardware("gb200-nvl72")
    sc = Scenario(model=LLAMA, hardware=gb200, training=_training("megatron", num_gpus=16, precision="mxfp8",
                                                                 fp8_params=True, cross_entropy_fusion="te"),
                  plan=Plan(tp=2, pp=2, dp=4, micro_batch_size=1, zero_stage=1, sequence_parallel=True))
    flags = megatron_flags(sc)
    assert ("--fp8-param-gather", None) in flags and ("--reuse-grad-buf-for-mxfp8-param-ag", None) in flags
    words = [w for f, v in flags for w in ((f,) if v is None else (f, str(v)))]
    launch = tmp_path / "mxfp8.sh"
    launch.write_text("#!/bin/bash\ntorchrun --nproc-per-node 4 --nnodes 4 pretrain_gpt.py "
                      + " ".join(shlex.quote(w) for w in words) + "\n")
    (read,) = check_file_branches(launch, gb200, None, None)
    assert not read.errors, read.errors
    t = read.scenario.training
    assert (t.precision, t.fp8_params, t.cross_entropy_fusion) == ("mxfp8", True, "te")


@pytest.mark.parametrize("fp8_params", [False, True])
def test_blackwell_keeps_no_fp8_transpose(fp8_params):
    """Per-tensor fp8 on Blackwell (HardwareSpec.fp8_any_layout_gemm): Transformer Engine makes no fp8 transpose
    (pytorch/csrc/quantizer.cpp: create_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported()), so
    the weight cache is 1 B per GEMM weight, not 2 (and fp8_params 1 B, not 1 + 1); mxfp8 keeps both directions."""
    from planner.memory import stage_state_bytes as ssb

    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    linear = 8 * (layer_params_per_rank(LLAMA, 1) - 2 * LLAMA.hidden_size)
    b200 = load_hardware("b200-180gb")
    tr = _training("megatron", precision="fp8", fp8_params=fp8_params)
    hopper = ssb(LLAMA, tr, plan, 1, 8, H100)
    blackwell = ssb(LLAMA, tr, plan, 1, 8, b200)
    assert hopper.weights_bytes - blackwell.weights_bytes == pytest.approx(1 * linear)
    assert ssb(LLAMA, tr, plan, 1, 8).weights_bytes == hopper.weights_bytes  # no hardware given: the larger
    mx = _training("megatron", precision="mxfp8", fp8_params=fp8_params)
    assert ssb(LLAMA, mx, plan, 1, 8, b200).weights_bytes == ssb(LLAMA, mx, plan, 1, 8).weights_bytes


def test_nvfp4_params_refused():
    """No fp4 parameter path is modelled (Megatron-Bridge: "fp4_param and fp4_param_gather are not supported
    for now")."""
    from planner.specs import job_problems

    b200 = load_hardware("b200-180gb")
    assert job_problems(LLAMA, b200, _training("megatron", precision="nvfp4", fp8_params=True)) == [
        "fp8_params: fp8 weights need precision fp8 or mxfp8 (Megatron --fp8-param-gather), not nvfp4; "
        "set precision fp8 or drop fp8_params"]


@pytest.mark.parametrize("fp8_params", [False, True])
def test_nemo_apex_bf16_optimizer_states(fp8_params):
    """NeMo distributed_fused_adam with optim.dtype bf16 (Apex DistributedFusedAdam StateBucket):
    m and v in bf16 (2 + 2 B), plus a bf16 master copy only with fp8_params (store_params), over dp."""
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    st = stage_state_bytes(LLAMA, _training("nemo", precision="fp8", fp8_params=fp8_params,
                                            optimizer_dtype="bf16-apex"), plan, 1, 8)
    assert st.optimizer_bytes == pytest.approx((6 if fp8_params else 4) * _params(plan, 1) / 16)


@pytest.mark.parametrize("precision,fp8_params,per_param", [
    ("bf16", False, 6),  # bf16 m, v (2 + 2) + TE's int16 master remainder (2)
    ("fp8", True, 8),  # fp8 weights: the fp32 master (4)
])
def test_nemo_bf16_optimizer_states_are_megatron_cores(precision, fp8_params, per_param):
    """NeMo 2 and Megatron-Bridge run Megatron-Core's optimizer, so optimizer_dtype bf16 under nemo is the
    precision-aware optimizer's 6-8 B per parameter (core_v0.16.1 optimizer_config.py, distrib_optimizer.py;
    docs/memory.md), not NeMo 1's Apex 4 B: counting a NeMo 2 job at 4 B would pass a plan that runs out of
    memory. The bytes match the megatron profile's, over the same dp."""
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    kw = dict(precision=precision, fp8_params=fp8_params, optimizer_dtype="bf16")
    nemo = stage_state_bytes(LLAMA, _training("nemo", **kw), plan, 1, 8)
    assert nemo.optimizer_bytes == pytest.approx(per_param * _params(plan, 1) / 16)
    assert nemo == stage_state_bytes(LLAMA, _training("megatron", **kw), plan, 1, 8)
    assert job_problems_of("nemo", "bf16", Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=0)) == [
        "zero_stage: nemo's bf16 optimizer states (Megatron --use-precision-aware-optimizer) need the distributed "
        "optimizer: use zero_stage 1 (plan has 0) or optimizer_dtype fp32"]
    assert job_problems_of("nemo", "bf16-apex", Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=3)) == [
        "zero_stage: nemo's bf16-apex optimizer states (NeMo 1's Apex distributed_fused_adam) run without "
        "Megatron-FSDP: use zero_stage 0 or 1 (plan has 3) or optimizer_dtype fp32"]
    assert job_problems_of("nemo", "bf16-apex", plan) == []


def job_problems_of(framework: str, optimizer_dtype: str, plan: Plan) -> list[str]:
    from planner.frameworks import get

    return get(framework).plan_problems(plan, LLAMA, optimizer_dtype)


def test_bf16_optimizer_states_only_where_modelled():
    from planner.specs import job_problems

    assert job_problems(LLAMA, H100, _training("megatron", optimizer_dtype="bf16")) == []
    assert job_problems(LLAMA, H100, _training("nemo", optimizer_dtype="bf16-apex")) == []
    assert job_problems(LLAMA, H100, _training("megatron", optimizer_dtype="bf16-apex")) == [
        "optimizer_dtype: bf16-apex is NeMo 1's Apex distributed_fused_adam (framework nemo); megatron as plan3d "
        "models it keeps fp32/bf16 optimizer states; use bf16 or fp32"]
    assert job_problems(LLAMA, H100, _training("torchtitan", optimizer_dtype="bf16")) == [
        "optimizer_dtype: torchtitan as plan3d models it keeps fp32 optimizer states, not bf16; use fp32"]


@pytest.mark.parametrize("precision,fp8_recipe,fp8_params,per_param", [
    ("bf16", "delayed", False, 6),  # TE's master: the int16 remainder (2) + bf16 m, v (2 + 2)
    ("fp8", "delayed", False, 6),  # delayed scaling keeps TE's master too (use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    ("fp8", "tensorwise", False, 8),  # current scaling: Megatron's fp32 master (4) + bf16 m, v
    ("fp8", "delayed", True, 8),  # fp8 weights: no bf16 parameter to take a remainder from, the fp32 master
    ("mxfp8", "delayed", False, 8)])
def test_megatron_precision_aware_optimizer_states(precision, fp8_recipe, fp8_params, per_param):
    """Megatron --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (core_v0.16.1
    optimizer_config.py lines 355-362: TE keeps the master in bf16 training and fp8 delayed scaling;
    distrib_optimizer.py line 802: an int16 master remainder with store_param_remainders, on by default):
    6 or 8 B per parameter over dp x cp, in place of 12; the other states are unchanged."""
    hw = load_hardware("b200-180gb") if precision == "mxfp8" else H100
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=1)
    kw = dict(precision=precision, fp8_recipe=fp8_recipe, fp8_params=fp8_params)
    bf16 = stage_state_bytes(LLAMA, _training("megatron", optimizer_dtype="bf16", **kw), plan, 1, 8, hw)
    fp32 = stage_state_bytes(LLAMA, _training("megatron", **kw), plan, 1, 8, hw)
    assert fp32.optimizer_bytes == pytest.approx(12 * _params(plan, 1) / 16)
    assert bf16.optimizer_bytes == pytest.approx(per_param * _params(plan, 1) / 16)
    assert (bf16.weights_bytes, bf16.grads_bytes) == (fp32.weights_bytes, fp32.grads_bytes)


def test_megatron_precision_aware_optimizer_needs_the_distributed_optimizer():
    """optimizer_config.py line 381: "--use-precision-aware-optimizer only supported with distributed optimizer":
    plan_problems names it, the search offers ZeRO 1 only, and the emitter writes the three flags."""
    from planner.candidates import SearchSpace, enumerate_plans
    from planner.emit.megatron import megatron_flags
    from planner.specs import Scenario, plan_problems

    tr = _training("megatron", num_gpus=8, gbs=16, optimizer_dtype="bf16")
    z0 = Plan(tp=2, pp=1, dp=4, micro_batch_size=1, zero_stage=0, sequence_parallel=True)
    assert plan_problems(LLAMA, H100, tr, z0) == [
        "zero_stage: megatron's bf16 optimizer states (Megatron --use-precision-aware-optimizer) need the distributed "
        "optimizer: use zero_stage 1 (plan has 0) or optimizer_dtype fp32"]
    z1 = z0.model_copy(update={"zero_stage": 1})
    assert plan_problems(LLAMA, H100, tr, z1) == []
    space = SearchSpace(max_micro_batch_size=1)
    assert {p.zero_stage for p in enumerate_plans(LLAMA, H100, tr, space)} == {1}
    flags = megatron_flags(Scenario(model=LLAMA, hardware=H100, training=tr, plan=z1))
    for flag in (("--use-precision-aware-optimizer", None), ("--exp-avg-dtype", "bf16"), ("--exp-avg-sq-dtype", "bf16"),
                 ("--use-distributed-optimizer", None)):
        assert flag in flags


def test_fp8_param_gather_read_from_a_launch_file_and_emitted():
    """A Megatron-LM launch with --fp8-param-gather (tests/data/launch, in the style of Megatron-LM's
    examples/llama/train_llama3_8b_h100_fp8.sh) is read as fp8_params; the emitter writes the flag
    back, and refuses it without the distributed optimizer (core_v0.16.1 arguments.py: "--fp8-param-gather
    only supported with distributed optimizer, ...")."""
    from planner.check import check_file_branches
    from planner.emit.megatron import megatron_flags
    from planner.presets import SpecError

    (r,) = check_file_branches(Path(__file__).parent / "data" / "launch" / "megatron_llama3_8b_fp8.sh",
                               load_hardware("h200-141gb"), None, None)
    assert r.scenario.training.fp8_params and r.scenario.training.precision == "fp8"
    assert ("--fp8-param-gather", None) in megatron_flags(r.scenario)
    z0 = r.scenario.model_copy(update={"plan": r.scenario.plan.model_copy(update={"zero_stage": 0})})
    with pytest.raises(SpecError, match="fp8_params needs the distributed optimizer"):
        megatron_flags(z0)
    apex = r.scenario.model_copy(update={"training": r.scenario.training.model_copy(
        update={"framework": "nemo", "optimizer_dtype": "bf16-apex"})})
    with pytest.raises(SpecError, match="optimizer_dtype bf16-apex is NeMo 1's Apex"):
        megatron_flags(apex)  # a Megatron-LM launch would hold fp32 Adam states the estimate left out
    nemo2 = apex.model_copy(update={"training": apex.training.model_copy(update={"optimizer_dtype": "bf16"})})
    assert ("--use-precision-aware-optimizer", None) in megatron_flags(nemo2)  # NeMo 2: Megatron-Core's optimizer


def test_torchtitan_pipeline_keeps_unsharded_params_and_fp32_grads():
    """torch.distributed.pipelining + FSDP2: no reshard after backward and no gradient sync until
    perform_reduce_grad, the unsharded gradient accumulated in reduce_dtype (fp32): 2 P + 4 P/N
    weights, 4 P + 4 P/N gradients, 8 P/N AdamW; the running layer's bf16 gradient transiently."""
    plan = Plan(tp=1, pp=4, dp=16, micro_batch_size=1, zero_stage=3)
    st = stage_state_bytes(LLAMA, _training("torchtitan"), plan, 1, 8)
    p = _params(plan, 1)
    assert st.weights_bytes == pytest.approx(2 * p + 4 * p / 16)
    assert st.grads_bytes == pytest.approx(4 * p + 4 * p / 16)
    assert st.optimizer_bytes == pytest.approx(8 * p / 16)
    assert st.working_weights_bytes == 0  # a layer's bf16 gradient, until it joins the fp32 accumulator
    assert st.working_grads_bytes == pytest.approx(2 * layer_params_per_rank(LLAMA, 1))


def test_torchtitan_reshard_after_forward_only_without_pp():
    """fsdp_reshard_after_forward "default" is True without PP (one layer gathered + one prefetched),
    and plan3d emits "never" below ZeRO-3 (all bf16 weights gathered)."""
    z3 = stage_state_bytes(LLAMA, _training("torchtitan"), Plan(tp=1, pp=1, dp=64, micro_batch_size=2, zero_stage=3), 0, 32)
    z2 = stage_state_bytes(LLAMA, _training("torchtitan"), Plan(tp=1, pp=1, dp=64, micro_batch_size=2, zero_stage=2), 0, 32)
    p = stage_params_per_rank(LLAMA, Plan(tp=1, pp=1, dp=64, micro_batch_size=1), 0, 32)
    assert z3.weights_bytes == pytest.approx(4 * p / 64)
    assert z2.weights_bytes == pytest.approx(2 * p + 4 * p / 64)


def test_deepspeed_zero2_matches_its_estimator_plus_buckets():
    """DeepSpeed estimate_zero2_model_states_mem_needs: 2 + 18/N B per parameter on the GPU; the
    engine also holds two ipg buffers of reduce_bucket_size (5e8) bf16 elements with overlap_comm."""
    plan = Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=2)
    st = stage_state_bytes(LLAMA, _training("deepspeed"), plan, 0, 32)
    p = stage_params_per_rank(LLAMA, plan, 0, 32)
    assert st.weights_bytes + st.grads_bytes + st.optimizer_bytes == pytest.approx(2 * p + 18 * p / 64 + 2 * 5e8 * 2)


@pytest.mark.parametrize("pp, fp16, accum, sharded, accum_bytes", [
    (2, False, None, True, 4),     # BF16_Optimizer under the pipeline engine; no dtype named: counted fp32
    (2, False, "bf16", True, 2),   # BF16_Optimizer with bf16 accumulation (grad_acc_dtype buffer)
    (1, False, None, False, 4),    # bf16 without a pipeline: FP16_Optimizer in bf16 (deepspeedai/DeepSpeed#7790)
    (1, True, None, False, 4),     # fp16: FP16_Optimizer
    (2, True, None, False, 4),
])
def test_deepspeed_zero0_is_bf16_optimizer_or_fp16_optimizer(pp, fp16, accum, sharded, accum_bytes):
    """ZeRO stage 0, the wrapper DeepSpeed 0.19.8's engine picks (frameworks.deepspeed.optimizer_wrapper, asked of the
    engine in tests/test_deepspeed_engine.py). BF16_Optimizer (bf16_optimizer.py: bf16 weights and gradients, a
    full-size accumulation buffer in grad_accum_dtype, fp32 master and Adam of 1/N of the parameters): 2 + 2 + 4 +
    12/N B per parameter; FP16_Optimizer (fp16/fused_optimizer.py), whose fp32 master and Adam states are whole:
    2 + 2 + 4 + 12 B."""
    plan = Plan(tp=1, pp=pp, dp=64 // pp, micro_batch_size=1, zero_stage=0)
    layers = 32 // pp
    tr = _training("deepspeed").model_copy(update={"fp16": fp16,
                                                   "deepspeed": DeepSpeedZero(grad_accum_dtype=accum)})
    st = stage_state_bytes(LLAMA, tr, plan, 0, layers)
    p = stage_params_per_rank(LLAMA, plan, 0, layers)
    assert (st.weights_bytes, st.grads_bytes) == pytest.approx((2 * p, (2 + accum_bytes) * p))
    assert st.optimizer_bytes == pytest.approx(12 * p / (plan.dp if sharded else 1))


@pytest.mark.parametrize("contiguous, overlap, elements, buffers", [
    (True, True, 2e8, 2), (True, False, 2e8, 1), (False, True, 5e8, 0)])
def test_deepspeed_zero2_buckets_follow_its_config(contiguous, overlap, elements, buffers):
    """The ZeRO-1/2 reduce buckets as the config sets them (0.19.8 stage_1_and_2.py setup_buckets, counted on the
    engine in tests/test_deepspeed_engine.py): reduce_bucket_size elements of bf16 each, one, two with overlap_comm,
    none without contiguous_gradients."""
    plan = Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=2)
    tr = _training("deepspeed").model_copy(update={
        "overlap_grad_reduce": overlap,
        "deepspeed": DeepSpeedZero(contiguous_gradients=contiguous, reduce_bucket_elements=int(elements))})
    st = stage_state_bytes(LLAMA, tr, plan, 0, 32)
    p = stage_params_per_rank(LLAMA, plan, 0, 32)
    assert st.grads_bytes == pytest.approx(6 * p / 64 + buffers * elements * 2)


TINY = ModelSpec(name="tiny", num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1024)


def test_deepspeed_search_space_is_what_its_engine_runs():
    """Pipeline engine: ZeRO 0/1 with pp > 1; no CP, no interleaving, even splits."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=2048, framework="deepspeed")
    plans = list(enumerate_plans(TINY, H100, tr, SearchSpace(max_micro_batch_size=2)))
    assert plans
    assert all(p.zero_stage <= 1 for p in plans if p.pp > 1)
    assert any(p.zero_stage == 3 for p in plans if p.pp == 1)
    assert all(p.cp == 1 and p.vpp == 1 and p.layers_per_stage is None for p in plans)


def test_nemo_search_space_is_ddp_distributed_optimizer_or_megatron_fsdp():
    """Megatron-Bridge runs DDP, the distributed optimizer or Megatron-FSDP (optim_grads_params): no ZeRO 2."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=2048, framework="nemo")
    assert {p.zero_stage for p in enumerate_plans(TINY, H100, tr, SearchSpace(max_micro_batch_size=2))} == {0, 1, 3}


def test_plan_problems_name_the_framework_limit():
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=2048, framework="deepspeed")
    errors = plan_problems(TINY, H100, tr, Plan(tp=1, pp=2, dp=4, micro_batch_size=1, zero_stage=2))
    assert errors == ["zero_stage: deepspeed runs ZeRO [0, 1] with pp=2, not 2"]


def test_search_for_deepspeed_finds_a_plan_it_can_emit():
    """The solver respects the profile, so `search --emit deepspeed` no longer finds a plan and then
    refuses it (emit/deepspeed.check_supported)."""
    from planner.emit import deepspeed

    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=2048, framework="deepspeed")
    best = search(TINY, H100, tr, SearchSpace(max_micro_batch_size=2)).best
    assert best is not None
    deepspeed.check_supported(Scenario(model=TINY, hardware=H100, training=tr, plan=best))


# --- published configurations and readings -----------------------------------------------------

TT = DATA["torchtitan_h100_202412"]
TT_DEVICE = H100.model_copy(update={"name": "h100-96gb", "gpu_memory_gib": TT["device_gib"]})


# What torchtitan 9dec370 (the benchmark's commit) compiled with training.compile: each TransformerBlock
# (parallelisms/parallelize_llama.py apply_compile); its train.py had the loss compile commented out ("TODO:
# compiling loss function causes CUDA errors, turning off for now"), docs/memory.md "torch.compile (torchtitan)".
PUBLISHED_COMPILE_COMPONENTS = ("model",)


# torch 1963fc8 (Dec 2024), which the published runs used, predates pytorch#153383 (May 2025): every pipeline stage kept
# its outputs until the end of the step, and torchtitan 9dec370 called schedule.step() with no return_outputs (torch
# had none then), so the last stage also concatenated its logits at the end (planner.memory.pipeline_kept_output_bytes)
PUBLISHED_KEPT_OUTPUTS = "all"


def _torchtitan_scenario(run):
    """(model, hardware, training, plan) of a published torchtitan run: its pipeline runs as torchtitan
    9dec370 laid them out (``torchtitan.published_layers_per_stage``, vpp 2 for Interleaved 1F1B), compiled where
    its techniques name torch.compile (``TrainingSpec.compile``)."""
    model = load_model(run["model"])
    vpp = run.get("vpp", 1)
    lps = torchtitan.published_layers_per_stage(model.num_layers, run["pp"], vpp)
    tr = TrainingSpec(num_gpus=run["gpus"], global_batch_size=run["local_batch"] * run["dp"], seq_len=run["seq_len"],
                      framework="torchtitan", compile="torch.compile" in run["techniques"],
                      compile_components=PUBLISHED_COMPILE_COMPONENTS, pipeline_kept_outputs=PUBLISHED_KEPT_OUTPUTS,
                      step_cuda_graph=False)  # 9dec370 predates the whole-step CUDA graph (pytorch/torchtitan#3559)
    plan = Plan(tp=run["tp"], pp=run["pp"], dp=run["dp"], cp=run["cp"], vpp=vpp, micro_batch_size=run["micro_batch"],
                recompute=run["ac"], sequence_parallel=run["tp"] > 1, zero_stage=3, layers_per_stage=lps)
    return model, TT_DEVICE, tr, plan


def _torchtitan_estimate(run):
    return estimate_memory(*_torchtitan_scenario(run))


def test_torchtitan_pipeline_runs_as_torchtitan_9dec370_split_them():
    """The data's micro-batch size is the local batch over torchtitan 9dec370's default micro-batch count
    (``published_microbatches``: the number of stages), and the interleaved run has two stages per rank."""
    for run in TT["runs"]:
        if run["pp"] > 1:
            m = torchtitan.published_microbatches(run["pp"], run["vpp"])
            assert run["micro_batch"] * m == run["local_batch"], run
            assert run["vpp"] == (2 if run["schedule"].startswith("Interleaved") else 1)


@pytest.mark.parametrize("i", range(len(TT["runs"])), ids=lambda i: f"table{TT['runs'][i]['table']}-{i}")
def test_torchtitan_published_runs_fit(i):
    """Every run of the benchmark ran on its 95.5 GiB GPUs: the estimate must say it fits."""
    est = _torchtitan_estimate(TT["runs"][i])
    assert est.fits, f"{est.peak_gib:.1f} GiB > usable {est.usable_gib:.1f}"


@pytest.mark.parametrize("i", [i for i, r in enumerate(TT["runs"]) if r["modelled"]])
def test_torchtitan_estimate_not_above_reserved_reading(i):
    """The readings are peak *reserved* memory; the estimate (the replayed reserved peak, planner/allocator_trace.py)
    must not exceed them on the runs the profile models (no Float8; compile runs with the blocks compiled)."""
    run = TT["runs"][i]
    assert _torchtitan_estimate(run).peak_gib <= run["reading_gib"]


def test_torchtitan_search_gives_the_ends_fewer_layers_only():
    """torchtitan's pipeline_parallel_first/last_stage_less_layers can only lighten the end stages
    (emit/torchtitan refuses the rest), so its search proposes no heavier end stage."""
    model = TINY.model_copy(update={"num_layers": 10})
    tr = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=2048, framework="torchtitan")
    splits = {p.layers_per_stage for p in enumerate_plans(model, H100, tr, SearchSpace(max_micro_batch_size=1))
              if p.pp == 4 and p.layers_per_stage}
    assert splits and all(max(s[0], s[-1]) <= s[1] for s in splits)
    megatron = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=2048)
    assert any(max(p.layers_per_stage[0], p.layers_per_stage[-1]) > p.layers_per_stage[1]
               for p in enumerate_plans(model, H100, megatron, SearchSpace(max_micro_batch_size=1))
               if p.pp == 4 and p.layers_per_stage)


def test_deepspeed_fp8_is_a_job_problem():
    from planner.specs import job_problems

    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=2048, precision="fp8", framework="deepspeed")
    assert job_problems(TINY, H100, tr) == ["precision: deepspeed as plan3d emits it has no fp8 recipe; use bf16"]
    assert search(TINY, H100, tr, SearchSpace(max_micro_batch_size=2)).best is None


# --- the caching-allocator model of planner/fake_rank.py (no torch needed) ----------------------

MIB = 2**20


def test_caching_allocator_segment_sizes():
    """CUDACachingAllocator.cpp get_allocation_size: 2 MiB small segments (<= 1 MiB requests),
    20 MiB for large requests under 10 MiB, else the request rounded up to 2 MiB."""
    from planner.fake_rank import CachingAllocator

    for nbytes, segment in [(1000, 2 * MIB), (3 * MIB, 20 * MIB), (100 * MIB, 100 * MIB), (101 * MIB, 102 * MIB)]:
        a = CachingAllocator()
        a.malloc("x", nbytes)
        assert a.reserved == segment


def test_caching_allocator_reuses_splits_and_merges():
    from planner.fake_rank import CachingAllocator

    a = CachingAllocator()
    a.malloc("a", 3 * MIB)
    a.malloc("b", 3 * MIB)  # split from the 20 MiB segment's remainder
    assert a.reserved == 20 * MIB
    a.free("a")
    a.free("b")
    a.malloc("c", 19 * MIB)  # the two blocks merged back into the whole segment
    assert a.reserved == 20 * MIB


def test_caching_allocator_fragmentation_and_release_on_capacity():
    """A freed 100 MiB block cannot serve 150 MiB: a new segment (reserved 350 MiB for 250 live).
    Without a capacity the cache keeps growing; at a 400 MiB capacity the wholly free segments are
    released first (release_cached_blocks) and the reserved peak stays under it."""
    from planner.fake_rank import replay_reserved

    trace = [("ADD", "a", 100 * MIB), ("ADD", "b", 100 * MIB), ("DEL", "a", 0), ("ADD", "c", 150 * MIB),
             ("DEL", "b", 0), ("DEL", "c", 0), ("ADD", "d", 200 * MIB)]
    assert replay_reserved(trace[:4]).peak_reserved == 350 * MIB
    assert replay_reserved(trace).peak_reserved == 550 * MIB
    assert replay_reserved(trace, 400 * MIB).peak_reserved == 350 * MIB


def test_megatron_fsdp_keeps_no_fp8_weight_cache():
    """Megatron-FSDP's keep_fp8_transpose_cache is off by default (core_v0.16.1 core/distributed/fsdp/src/
    README.md: keeping it costs parameters x 1 B): under ZeRO 3 fp8 adds no weight cache, under ZeRO 1 TE's
    cache of the fp8 weight and its transpose (2 B per GEMM weight) is there."""
    from planner.frameworks.megatron import state_bytes

    model = load_model("llama3-70b")
    tr8, tr16 = (TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192, precision=p) for p in ("fp8", "bf16"))
    for zero, cached in ((1, True), (3, False)):
        plan = Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=zero)
        params = model.num_params
        w8 = state_bytes(model, tr8, plan, params, params / model.num_layers, model.num_layers).weights_bytes
        w16 = state_bytes(model, tr16, plan, params, params / model.num_layers, model.num_layers).weights_bytes
        assert (w8 > w16) == cached


@pytest.mark.parametrize("framework", ["megatron", "nemo"])
def test_megatron_fsdp_fp8_params_shard_uint8_weights(framework):
    """Megatron-FSDP (ZeRO 3) with fp8 parameters (per-tensor fp8): core_v0.16.1 megatron_fsdp
    param_and_grad_buffer.py gives Float8Tensor groups a uint8 model-weight buffer, sharded: 1 B per GEMM weight
    over dp in place of bf16's 2; the gathered layers, gradients and optimizer shards are unchanged.
    Llama-3 8B GEMM weights per layer, by hand: QKV 4096 x (4096 + 2 x 8 x 128) = 25,165,824, out-proj
    4096 x 4096 = 16,777,216, FC1 + FC2 3 x 4096 x 14336 = 176,160,768; 218,103,808 per layer, 32 layers over
    dp 64: 1 B x 32 x 218,103,808 / 64 = 109,051,904 B fewer."""
    plan = Plan(tp=1, pp=1, dp=64, micro_batch_size=1, zero_stage=3)
    base = stage_state_bytes(LLAMA, _training(framework, precision="fp8"), plan, 0, 32)
    st = stage_state_bytes(LLAMA, _training(framework, precision="fp8", fp8_params=True), plan, 0, 32)
    assert base.weights_bytes - st.weights_bytes == pytest.approx(109_051_904)
    assert (st.grads_bytes, st.optimizer_bytes) == (base.grads_bytes, base.optimizer_bytes)
    # mxfp8 under Megatron-FSDP is left at the bf16 bytes (planner/frameworks/megatron.py)
    mx = stage_state_bytes(LLAMA, _training(framework, precision="mxfp8", fp8_params=True), plan, 0, 32)
    assert mx.weights_bytes == pytest.approx(base.weights_bytes)


def test_deepspeed_partitions_are_deepspeeds_own():
    """planner.frameworks.deepspeed.partition_balanced is DeepSpeed's runtime/utils.py partition_balanced, ported:
    the same part boundaries as the installed DeepSpeed's for every layer count and stage count tried."""
    utils = pytest.importorskip("deepspeed.runtime.utils")
    from planner.frameworks.deepspeed import partition_balanced

    for layers in range(1, 90):
        for pp in (2, 3, 4, 5, 6, 8, 12, 16):
            assert partition_balanced([1.0] * layers, pp) == [int(x) for x in utils.partition_balanced([1] * layers, pp)]


def test_bloom_176b_published_layout_fits_under_the_deepspeed_profile():
    """BLOOM-176B as it trained (bigscience-workshop/bigscience train/tr11-176B-ml, tr11-176B-ml.slurm and README
    @003b2505 / 00327f8c): Megatron-DeepSpeed on 384 A100 80GB, TP 4, PP 12, DP 8, micro-batch 2, global batch 2048
    of 2048 tokens, bf16 with ZeRO stage 0 (BF16_Optimizer), --checkpoint-activations, and
    --pp-partition-method 'type:transformer|embedding': "pp rank 0: [embed | 5 transformer blocks] ... pp rank 11:
    [5 transformer blocks | embed]" (README, Architecture). The split is one DeepSpeed builds, and the configuration
    that ran is predicted to fit; an uneven split DeepSpeed would not build is refused, naming the ones it would."""
    from planner.frameworks.deepspeed import pipeline_partitions

    model, a100 = load_model("bloom-176b"), load_hardware("a100-80gb")
    tr = TrainingSpec(num_gpus=384, global_batch_size=2048, seq_len=2048, framework="deepspeed")
    split = (5,) + (6,) * 10 + (5,)
    assert pipeline_partitions(70, 12)["type:transformer|embedding"] == split
    plan = Plan(tp=4, pp=12, dp=8, micro_batch_size=2, recompute="full", zero_stage=0, layers_per_stage=split)
    assert plan_problems(model, a100, tr, plan) == []
    assert estimate_memory(model, a100, tr, plan).fits
    odd = plan.model_copy(update={"layers_per_stage": (4,) + (6,) * 10 + (6,)})
    (err,) = plan_problems(model, a100, tr, odd)
    assert err.startswith("layers_per_stage: deepspeed's pipeline builds [6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5] "
                          "(type:transformer); [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5] (type:transformer|embedding)"), err


def test_search_offers_the_splits_deepspeeds_pipeline_builds():
    """The search may propose an uneven split under DeepSpeed exactly where DeepSpeed's own partition method builds
    it: BLOOM-176B's published layout (TP 4, PP 12 on 384 A100s, 5 + 10 x 6 + 5) is found when TP and PP are pinned
    (before, the search offered DeepSpeed even splits only, and 70 layers split evenly on no pp that 384 GPUs and a
    batch of 2048 allow: "no legal plan"); every uneven split it proposes is one of pipeline_partitions'."""
    from planner.candidates import Pins, SearchSpace, enumerate_plans
    from planner.frameworks.deepspeed import pipeline_partitions
    from planner.search import search

    model, a100 = load_model("bloom-176b"), load_hardware("a100-80gb")
    tr = TrainingSpec(num_gpus=384, global_batch_size=2048, seq_len=2048, framework="deepspeed")
    best = search(model, a100, tr, SearchSpace(pins=Pins(tp=4, pp=12))).best
    assert best is not None and best.layers_per_stage == (5,) + (6,) * 10 + (5,)
    assert search(model, a100, tr).best is not None
    small = TrainingSpec(num_gpus=7, global_batch_size=3, seq_len=2048, framework="deepspeed")
    llama = load_model("llama3-8b")
    plans = list(enumerate_plans(llama, load_hardware("h100-sxm-80gb"), small, SearchSpace()))
    uneven = {p.layers_per_stage for p in plans if p.layers_per_stage is not None}
    assert uneven and all(lps in pipeline_partitions(32, len(lps)).values() for lps in uneven), uneven
    assert all(p.vpp == 1 for p in plans)


def test_precision_aware_optimizer_read_from_a_launch_file(tmp_path):
    """`plan3d check` reads --use-precision-aware-optimizer with bf16 moments as optimizer_dtype bf16 (the launch
    of test_fp8_param_gather_read_from_a_launch_file_and_emitted with the three flags added), and the estimate
    then holds 8 B of optimizer state per parameter (fp8 weights: Megatron's fp32 master) in place of 12. Other
    moment dtypes are read as fp32 Adam's, the larger."""
    from planner.check import check_file_branches

    src = (Path(__file__).parent / "data" / "launch" / "megatron_llama3_8b_fp8.sh").read_text()
    assert src.count("    --use-distributed-optimizer\n") == 1
    hw = load_hardware("h200-141gb")
    results = {}
    for name, extra in (("bf16", "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"),
                        ("mixed", "--exp-avg-dtype bf16 --exp-avg-sq-dtype fp32"), ("none", None)):
        text = src if extra is None else src.replace(
            "    --use-distributed-optimizer\n", f"    --use-distributed-optimizer\n    --use-precision-aware-optimizer {extra}\n")
        path = tmp_path / f"{name}.sh"
        path.write_text(text)
        (r,) = check_file_branches(path, hw, None, None)
        results[name] = r
    assert [results[k].scenario.training.optimizer_dtype for k in ("bf16", "mixed", "none")] == ["bf16", "fp32", "fp32"]
    opt = {k: estimate_memory(r.scenario.model, hw, r.scenario.training, r.scenario.plan).stages[0].optimizer_bytes
           for k, r in results.items()}
    assert opt["bf16"] == pytest.approx(opt["none"] * 8 / 12) and opt["mixed"] == opt["none"]


def test_search_tables_hold_the_precision_aware_optimizer():
    """The search tables hold what the estimate holds for the precision-aware optimizer (tests/table_checks.py), and
    offer ZeRO 1 only."""
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    tr = _training("megatron", num_gpus=16, gbs=32, optimizer_dtype="bf16")
    tables = build_tables(LLAMA, H100, tr, SearchSpace(max_micro_batch_size=1))
    keys = legal_keys(tables)
    assert len(keys) > 20 and {tables.plan(k).zero_stage for k in keys} == {1}
    for k in keys[:: max(1, len(keys) // 25)]:
        assert_entry_is_estimate(LLAMA, H100, tr, tables, k)


@pytest.mark.parametrize("pp, stage, module_elements", [
    (1, 0, 128256 * 4096),   # both untied embeddings on the one stage, gathered one at a time
    (2, 0, 128256 * 4096),   # the input embedding
    (2, 1, 128256 * 4096),   # the output layer
])
def test_deepspeed_zero3_gathers_the_largest_module_on_the_stage(pp, stage, module_elements):
    """DeepSpeed ZeRO-3 gathers a whole module for its forward and backward (partitioned_param_coordinator.py
    fetch_sub_module): on Llama-3-8B's first and last stages that is a 128,256 x 4096 embedding (525e6 elements),
    more than a layer (218,112,000). Weights and gradients each hold it in bf16 beside their 1/N shards."""
    plan = Plan(tp=1, pp=pp, dp=8, micro_batch_size=1, zero_stage=3)
    layers = 32 // pp
    tr = _training("deepspeed")
    st = stage_state_bytes(LLAMA, tr, plan, stage, layers)
    p = stage_params_per_rank(LLAMA, plan, stage, layers)
    assert LLAMA.vocab_size == 128256 and LLAMA.hidden_size == 4096
    norm_b = 2 * 4096  # the final norm, which plan3d does not tell apart from the embedding it sits beside
    if pp == 1:
        # one stage: the weights gathered are what DeepSpeed's coordinator holds (the port, tests/
        # test_deepspeed_zero3.py), at the defaults more than the module and the prefetch bucket (its reuse distance
        # keeps the last layers gathered over the turn to the backward)
        gathered = ds_profile.zero3_gathered_elements(LLAMA, plan, tr.deepspeed)
        assert gathered > module_elements + 5e7
        assert st.weights_bytes == pytest.approx(2 * p / 8 + 2 * gathered)
    else:  # not a plan DeepSpeed runs (ZeRO-3 has no pipeline engine): the module and the prefetch bucket
        assert st.weights_bytes == pytest.approx(2 * p / 8 + 2 * module_elements + 2 * 5e7, abs=norm_b)
    assert st.grads_bytes == pytest.approx(6 * p / 8 + 2 * module_elements + 2 * 5e8, abs=norm_b)
    # a middle stage gathers a layer
    if pp == 4 or stage == 0:
        mid = stage_state_bytes(LLAMA, tr, Plan(tp=1, pp=4, dp=8, micro_batch_size=1, zero_stage=3), 1, 8)
        pm = stage_params_per_rank(LLAMA, Plan(tp=1, pp=4, dp=8, micro_batch_size=1, zero_stage=3), 1, 8)
        assert mid.weights_bytes == pytest.approx(2 * pm / 8 + 2 * 218_112_000 + 2 * 5e7)


@pytest.mark.parametrize("name, mbs, recompute, step_wins", [("llama3-8b", 1, "full", True),
                                                            ("megatron-gpt-1.7b", 8, "none", False)])
def test_deepspeed_fp16_optimizer_step_peak(name, mbs, recompute, step_wins):
    """DeepSpeed's FP16_Optimizer (bf16 at ZeRO 0 without a pipeline) builds fp32 copies of every gradient and then
    their flat concatenation in its step (fp16/fused_optimizer.py step) while the 16-bit gradients are still held:
    2 (weights) + 2 (16-bit gradients) + 4 + 4 (the fp32 copies and the flat fp32 gradient) + 4 (master) + 8 (Adam)
    = 24 B per parameter, by hand, after the activations are gone. The backward's peak is 20 B per parameter plus the
    activations. The stage holds the larger: the step's on Llama-3-8B with full recompute at micro-batch 1, the
    backward's on the 1.7B GPT at micro-batch 8 without recompute."""
    from planner.memory import stage_memory

    model = load_model(name)
    plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=mbs, zero_stage=0, recompute=recompute)
    tr = TrainingSpec(num_gpus=8, global_batch_size=8 * mbs, seq_len=2048, framework="deepspeed")
    assert ds_profile.optimizer_wrapper(tr, 0, 1) == "fp16_optimizer"
    p = stage_params_per_rank(model, plan, 0, model.num_layers)
    mem = stage_memory(model, tr, plan, 1, 0, model.num_layers)
    held = mem.weights_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes
    assert held == pytest.approx(max(20 * p + mem.activations_bytes, 24 * p))
    assert (24 * p > 20 * p + mem.activations_bytes) == step_wins


def test_search_tables_hold_deepspeeds_step_peak():
    """The search tables hold what the estimate holds for DeepSpeed plans whose optimizer step outgrows the backward
    (ZeRO 0's FP16_Optimizer under full recompute) and for the rest (tests/table_checks.py)."""
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    small = load_model("megatron-gpt-1.7b")
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=2048, framework="deepspeed")
    tables = build_tables(small, H100, tr, SearchSpace(max_micro_batch_size=2))
    keys = legal_keys(tables)
    picked = [k for k in keys if tables.plan(k).zero_stage == 0 and tables.plan(k).recompute == "full"]
    assert picked, "no ZeRO-0 full-recompute entry"
    for k in picked[:5] + keys[:: max(1, len(keys) // 20)]:
        assert_entry_is_estimate(small, H100, tr, tables, k)
