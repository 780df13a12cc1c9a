"""FSDP2's per-micro-batch passes as torch runs them (tests/fsdp2_accumulation_probe.py: ``fully_shard`` and
``torch.distributed.pipelining`` on four gloo ranks) against what plan3d's torchtitan profile charges
(``planner.frameworks.torchtitan.microbatch_passes``: ``GRAD_PASSES`` and ``GATHER_COPY_OUT``, ``cost.grad_accum_s``)."""

import pytest

pytest.importorskip("torch.distributed.fsdp")

from planner import cost  # noqa: E402
from planner.frameworks import torchtitan as tt  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.specs import Plan, TrainingSpec  # noqa: E402
from tests.fsdp2_accumulation_probe import MICROBATCHES, WORLD, run_probe  # noqa: E402

#: What else a micro-batch runs over parameter-sized tensors, none of it on the compute stream: the collectives; the
#: all-gather's copy-in on its own stream (``foreach_all_gather``: ``all_gather_copy_in_stream``); the reduce-scatter's
#: output copied and added into the sharded gradient on the reduce-scatter stream (``foreach_reduce``: ``with
#: device_handle.stream(reduce_scatter_stream)``; torch 2.13 distributed/fsdp/_fully_shard/_fsdp_collectives.py)
ELSEWHERE = {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "aten::_foreach_copy_", "fsdp::all_gather_copy_in",
             "aten::copy_", "aten::add_"}
#: the probe's cases as (framework, plan): pipeline pp 2 x dp 2 under torchtitan (no reshard after forward under PP) and
#: plan3d validate's miniature at zero_stage 3 (reshard after forward); without one dp 4 with torchtitan's default
#: reshard after forward (plan3d's zero_stage 3) and "never" (zero_stage 1)
PLANS = {"pipeline": ("torchtitan", Plan(tp=1, pp=2, dp=2, micro_batch_size=2, zero_stage=3)),
         "pipeline_reshard": ("torch", Plan(tp=1, pp=2, dp=2, micro_batch_size=2, zero_stage=3)),
         "plain": ("torchtitan", Plan(tp=1, pp=1, dp=4, micro_batch_size=2, zero_stage=3)),
         "plain_never": ("torchtitan", Plan(tp=1, pp=1, dp=4, micro_batch_size=2, zero_stage=1))}


@pytest.fixture(scope="module")
def probe():
    return run_probe()


def _summed(passes) -> list:
    out: dict = {}
    for name, r, w in passes:
        a, b = out.get(name, (0.0, 0.0))
        out[name] = (a + r, b + w)
    return sorted([name, r, w] for name, (r, w) in out.items())


@pytest.mark.parametrize("kind", list(PLANS))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp2_microbatch_passes_are_the_ones_torch_runs(probe, kind, precision):
    """On every rank, a steady micro-batch (the second and third of four: after the first, before the last) runs
    exactly the profile's compute-stream passes with their bytes per parameter element, besides operations that run
    elsewhere (``ELSEWHERE``): under a pipeline the unsharded fp32 accumulation in the backward and nothing in the
    forward (the parameters stay gathered), with reshard after forward (plan3d validate's miniature) one all-gather
    copy-out in the backward too; without one the reduce-scatter's fp32 copy-in and one all-gather copy-out
    per gather, two with reshard after forward, one without. All over the stage's whole parameters. The step's first
    backward under a pipeline casts instead of adding (2 B read, 4 written: the overstatement GRAD_PASSES states)."""
    ranks = probe["ranks"]
    assert len(ranks) == WORLD
    framework, plan = PLANS[kind]
    training = TrainingSpec(num_gpus=WORLD, global_batch_size=2 * MICROBATCHES * plan.dp, seq_len=16,
                            framework=framework, precision=precision)
    ours = _summed(tt.microbatch_passes(training, plan))
    charged = {name for name, _, _ in ours}
    for rank in ranks:
        calls = rank[f"{kind}_{precision}"]
        assert len(calls) == MICROBATCHES
        assert calls[1] == calls[2]
        steady = [[name, r, w] for name, r, w, _ in calls[1] if name not in ELSEWHERE or name in charged]
        assert steady == ours, (kind, precision, calls[1])
        if kind.startswith("pipeline"):  # the steady forwards find the parameters gathered
            forwards = rank[f"{kind}_forward_{precision}"]
            assert len(forwards) == MICROBATCHES and forwards[2:] == [[]] * (MICROBATCHES - 2)
            assert [n for n, *_ in forwards[0]] == ["c10d::_allgather_base_", "fsdp::all_gather_copy_in",
                                                    "fsdp::split_with_sizes_copy"]  # gathered in the first
            if kind == "pipeline":  # and only there, without reshard after forward
                assert forwards[1] == []
                if precision == "bf16":
                    assert [[n, r, w] for n, r, w, _ in calls[0]] == [["aten::_to_copy", 2.0, 4.0]]
    assert tt.grad_accum_bytes_per_param(training, plan) == sum(r + w for _, r, w in ours)
    assert tt.grad_accum_bytes_per_param(training, plan) == {
        ("pipeline", "bf16"): 10, ("pipeline_reshard", "bf16"): 14, ("plain", "bf16"): 14, ("plain_never", "bf16"): 10,
        ("pipeline", "fp32"): 12, ("pipeline_reshard", "fp32"): 20, ("plain", "fp32"): 24,
        ("plain_never", "fp32"): 16}[(kind, precision)]


def test_fsdp2_gradient_passes_hand_computed():
    """The step charges them per micro-batch at the profile's HBM rate over each stage's local parameters:
    Llama-3-8B under torchtitan, tp 1 pp 2 dp 8 (stage 0: 16 layers of 218,112,000 parameters and the 128,256 x
    4,096 embedding; the last stage the same layers, the final norm and the output layer, which paces), 10 B per
    parameter; without a pipeline (pp 1 dp 16) 6 B of gradient copy-in and 2 x 4 B of all-gather copy-outs over all
    8.03 B at zero_stage 3, one copy-out at zero_stage 1; none without FSDP (ZeRO 0)."""
    model, h100 = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    last = 16 * layer + 4096 + 128256 * 4096
    rate = 3350e9 * 0.8  # h100-sxm-80gb: hbm_bandwidth_gbps x hbm_efficiency
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework="torchtitan")
    piped = Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=1)
    est = cost.estimate_time(model, h100, tr, piped)
    assert est.stages[1].total > est.stages[0].total
    assert est.breakdown["param_passes"] == pytest.approx(8 * 10 * last / rate, rel=1e-9)  # m = 64 / 8
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    plain = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=3)
    whole = 32 * layer + 4096 + 2 * 128256 * 4096
    assert cost.estimate_time(model, h100, tr, plain).breakdown["param_passes"] == \
        pytest.approx(4 * 14 * whole / rate, rel=1e-9)  # m = 64 / 16
    never = plain.model_copy(update={"zero_stage": 1})
    assert cost.estimate_time(model, h100, tr, never).breakdown["param_passes"] == \
        pytest.approx(4 * 10 * whole / rate, rel=1e-9)
    ddp = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=0)
    assert cost.estimate_time(model, h100, tr, ddp).breakdown["param_passes"] == 0
