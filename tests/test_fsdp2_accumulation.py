"""FSDP2's per-micro-batch gradient passes as torch runs them (tests/fsdp2_accumulation_probe.py: ``fully_shard`` and
``torch.distributed.pipelining`` on four gloo ranks) against what plan3d's torchtitan profile charges
(``planner.frameworks.torchtitan.GRAD_PASSES``, ``cost.grad_accum_s``)."""

import pytest

pytest.importorskip("torch.distributed.fsdp")

from planner import cost  # noqa: E402
from planner.frameworks import torchtitan as tt  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.specs import Plan, TrainingSpec  # noqa: E402
from tests.fsdp2_accumulation_probe import MICROBATCHES, WORLD, run_probe  # noqa: E402

#: What else a backward runs over parameter-sized tensors, none of it a gradient pass on the compute stream: the
#: collectives; the all-gather's copy-in on its own stream (``foreach_all_gather``: ``all_gather_copy_in_stream``);
#: the all-gather's copy-out into the unsharded parameters (``wait_for_unshard``: a parameter pass, not charged, see
#: GRAD_PASSES); the reduce-scatter's output copied and added into the sharded gradient on the reduce-scatter stream
#: (``foreach_reduce``: ``with device_handle.stream(reduce_scatter_stream)``; torch 2.13
#: distributed/fsdp/_fully_shard/_fsdp_collectives.py)
ELSEWHERE = {"plain": {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "aten::_foreach_copy_",
                       "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "aten::copy_", "aten::add_"},
             "pipeline": set()}


@pytest.fixture(scope="module")
def probe():
    return run_probe()


@pytest.mark.parametrize("kind", ["pipeline", "plain"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp2_gradient_passes_are_the_ones_torch_runs(probe, kind, precision):
    """On every rank, a steady micro-batch's backward (the second and third of four: after the first, before the
    last) runs exactly the profile's compute-stream gradient passes with their bytes per parameter element, besides
    operations that run elsewhere (``ELSEWHERE``); under a pipeline over the stage's whole parameters (the unsharded
    fp32 accumulation), without one the reduce-scatter's fp32 copy-in, also whole. The step's first backward under a
    pipeline casts instead of adding (2 B read, 4 written: the overstatement GRAD_PASSES states)."""
    ranks = probe["ranks"]
    assert len(ranks) == WORLD
    ours = [[name, r, w] for name, r, w in tt.GRAD_PASSES[(kind, precision)]]
    for rank in ranks:
        calls = rank[f"{kind}_{precision}"]
        assert len(calls) == MICROBATCHES
        assert calls[1] == calls[2]
        steady = [[name, r, w] for name, r, w, _ in calls[1] if name not in ELSEWHERE[kind] or
                  [name, r, w] in ours]
        assert steady == ours, (kind, precision, calls[1])
        if kind == "pipeline" and precision == "bf16":
            assert [[n, r, w] for n, r, w, _ in calls[0]] == [["aten::_to_copy", 2.0, 4.0]]
    plan = Plan(tp=1, pp=2 if kind == "pipeline" else 1, dp=2 if kind == "pipeline" else 4, micro_batch_size=2,
                zero_stage=3)
    training = TrainingSpec(num_gpus=WORLD, global_batch_size=16, seq_len=16, framework="torchtitan",
                            precision=precision)
    assert tt.grad_accum_bytes_per_param(training, plan) == sum(r + w for _, r, w in ours)


def test_fsdp2_gradient_passes_hand_computed():
    """The step charges them per micro-batch at the profile's HBM rate over each stage's local parameters:
    Llama-3-8B under torchtitan, tp 1 pp 2 dp 8 (stage 0: 16 layers of 218,112,000 parameters and the 128,256 x
    4,096 embedding; the last stage the same layers, the final norm and the output layer, which paces), 10 B per
    parameter; without a pipeline (pp 1 dp 16) 6 B over all 8.03 B; none without FSDP (ZeRO 0)."""
    model, h100 = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    last = 16 * layer + 4096 + 128256 * 4096
    rate = 3350e9 * 0.8  # h100-sxm-80gb: hbm_bandwidth_gbps x hbm_efficiency
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework="torchtitan")
    piped = Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=1)
    est = cost.estimate_time(model, h100, tr, piped)
    assert est.stages[1].total > est.stages[0].total
    assert est.breakdown["grad_accum"] == pytest.approx(8 * 10 * last / rate, rel=1e-9)  # m = 64 / 8
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    plain = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=3)
    whole = 32 * layer + 4096 + 2 * 128256 * 4096
    assert cost.estimate_time(model, h100, tr, plain).breakdown["grad_accum"] == \
        pytest.approx(4 * 6 * whole / rate, rel=1e-9)  # m = 64 / 16
    ddp = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=0)
    assert cost.estimate_time(model, h100, tr, ddp).breakdown["grad_accum"] == 0
