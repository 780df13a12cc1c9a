"""How often each framework reduces the gradients under gradient accumulation, and what the time model charges
for it (planner.cost.grad_reduced_every_microbatch, cost.compose_step; docs/cost-model.md "DP")."""

import numpy as np
import pytest

from planner import cost
from planner.cost import estimate_time, overlapped_s
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec

H100 = load_hardware("h100-sxm-80gb")


def test_fsdp2_reduce_scatters_every_backward_unless_sync_is_off():
    """Measured on torch's FSDP2 (fake process group, 2 ranks, two ``fully_shard`` units): a loop of backwards
    as torchtitan's ``train_step`` runs it without PP reduce-scatters both units in every backward; with
    ``set_requires_gradient_sync(False)`` on all but the last (what ``PipelineStage.backward_maybe_with_nosync``
    does) only the last backward reduces."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from planner.fake_rank import fake_world

    calls = []
    original = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with fake_world(2):
        dist.reduce_scatter_single = counted
        try:
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            per_backward = {}
            for last_only in (False, True):
                calls.clear()
                counts = []
                for i in range(3):
                    model.set_requires_gradient_sync(not last_only or i == 2)
                    model(torch.randn(4, 8)).sum().backward()
                    counts.append(len(calls))
                per_backward[last_only] = counts
        finally:
            dist.reduce_scatter_single = original
    assert per_backward[False] == [2, 4, 6]  # one reduce-scatter per unit per backward
    assert per_backward[True] == [0, 0, 2]


def test_deepspeed_reduces_every_microbatch_from_zero_2():
    """Measured on DeepSpeed's ZeRO engine on this CPU (tests/deepspeed_grad_sync_probe.py, 3 accumulation
    steps): ZeRO-1 reduces its gradient bucket only in the boundary's backward, ZeRO-2 and ZeRO-3 in every one."""
    pytest.importorskip("deepspeed")
    from tests.deepspeed_grad_sync_probe import run_probe

    seen = run_probe()
    assert seen[1] == [[False, 0], [False, 0], [True, 1]], seen
    assert seen[2] == [[False, 1], [False, 1], [True, 1]], seen
    assert seen[3] == [[False, 1], [False, 1], [True, 1]], seen


@pytest.mark.parametrize("framework,zero,pp,expected", [
    ("megatron", 0, 4, False), ("megatron", 1, 1, False), ("megatron", 2, 1, True), ("megatron", 3, 4, True),
    ("nemo", 1, 4, False), ("nemo", 3, 4, True),
    ("deepspeed", 0, 4, False), ("deepspeed", 1, 1, False), ("deepspeed", 2, 1, True), ("deepspeed", 3, 1, True),
    ("torchtitan", 0, 1, True), ("torchtitan", 1, 1, True), ("torchtitan", 3, 1, True), ("torchtitan", 2, 4, False),
    ("torch", 3, 1, True), ("torch", 3, 2, False),
])
def test_which_frameworks_reduce_every_microbatch(framework, zero, pp, expected):
    assert cost.grad_reduced_every_microbatch(framework, zero, pp) is expected


def test_compose_step_charges_the_reduction_per_microbatch_hand_computed():
    """One stage (pp 1), m = 4, backward 3 s, forward 1 s, reduce-scatter 5 s, all-gather 0.5 s, contention 0.1.

    Once per step (ZeRO-1): exposed = (5 - 3) + 0.1 x 3 = 2.3 under the last backward, + 0.1 x 0.5 = 0.05 for
    the all-gather under the first forward: step = 4 x 4 + 2.35 = 18.35.
    Every micro-batch (ZeRO-2, overlapped): X = 4 + 2.3 = 6.3, step = 4 x 6.3 + 0.05 = 25.25.
    Every micro-batch, nothing overlapped (DeepSpeed without overlap_comm): X = 4 + 5, step = 36 + 0.5 = 36.5.
    With a ZeRO-3 gather of 2 s (1 s in backward), the backward left to the reduce-scatter is 3 - 1 = 2:
    X = 4 + (0 + 0.1 x 2) + (5 - 2 + 0.1 x 2) = 7.4, step = 4 x 7.4 = 29.6 (ZeRO-3: no all-gather after the step)."""
    terms = {k: np.array([[v]]) for k, v in dict(total=4.0, compute=4.0, fwd=1.0, bwd=3.0, wgrad=0.0).items()}
    args = dict(optimizer=0.0, m=4, pp=1, vpp=1, counts=np.ones(1), before=np.zeros((1, 1)),
                overlap_grad_reduce=True, c=0.1)
    once = cost.compose_step(terms, np.zeros(1), np.array([5.0]), np.array([0.5]), **args)
    assert once["step"][0] == pytest.approx(18.35)
    each = cost.compose_step(terms, np.zeros(1), np.array([5.0]), np.array([0.5]), **args, grad_every_mb=True)
    assert each["step"][0] == pytest.approx(25.25)
    assert each["grad_mb"][0, 0] == pytest.approx(2.3) and each["dp_exposed"][0] == pytest.approx(0.05)
    args_off = args | {"overlap_grad_reduce": False}
    exposed = cost.compose_step(terms, np.zeros(1), np.array([5.0]), np.array([0.5]), **args_off, grad_every_mb=True,
                                grad_mb_overlap=False)
    assert exposed["step"][0] == pytest.approx(36.5)
    z3 = cost.compose_step(terms, np.array([2.0]), np.array([5.0]), np.array([0.0]), **args, grad_every_mb=True)
    assert z3["step"][0] == pytest.approx(29.6)


def test_zero2_pays_the_reduce_scatter_every_microbatch():
    """Megatron-FSDP optim_grads (ZeRO-2) on Llama-3-8B, 16 H100, m = 4 micro-batches, pp 1, on a slow network:
    its exposed DP time is 4 x the per-micro-batch excess of the reduce-scatter over the backward and the part of
    the next forward its queue lets it trail into (grad_reduce_trail_s), plus the weight all-gather's under the
    first forward (hand-composed from the same parts); ZeRO-1 pays the reduce-scatter once. ZeRO-2 is therefore
    slower than ZeRO-1, no longer the same communication."""
    model = load_model("llama3-8b")
    slow = H100.model_copy(update={"inter_node_bandwidth_gbps": 2.0})
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096)
    plan = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=2)
    t2 = estimate_time(model, slow, tr, plan)
    t1 = estimate_time(model, slow, tr, plan.model_copy(update={"zero_stage": 1}))
    rs, ag = cost.dp_sync_parts_s(model, slow, tr, plan, 0, 32)
    c, st = cost.contention(slow), t2.stages[0]
    trail = cost.grad_reduce_trail_s(slow, tr, plan)
    assert rs > st.bwd and trail > 0
    per_mb = overlapped_s(rs, st.bwd + min(st.fwd, trail), c)
    assert per_mb < overlapped_s(rs, st.bwd, c)  # the next forward hides part of what the backward did not
    expected = 4 * per_mb + overlapped_s(ag, st.fwd, c)
    assert t2.breakdown["dp_comm_exposed"] == pytest.approx(expected)
    assert t1.breakdown["dp_comm_exposed"] == pytest.approx(overlapped_s(rs, st.bwd, c) + overlapped_s(ag, st.fwd, c))
    assert t2.step_time_s - t1.step_time_s == pytest.approx(4 * per_mb - overlapped_s(rs, st.bwd, c))
    assert t2.dp_comm_s == pytest.approx(4 * rs + ag)
    assert sum(t2.breakdown.values()) == pytest.approx(t2.step_time_s)  # the per-micro-batch part is in the breakdown


def test_compose_step_lets_the_reduction_trail_into_the_next_forward_hand_computed():
    """The hand-computed case above (backward 3 s, forward 1 s, reduce-scatter 5 s per micro-batch, contention 0.1,
    m = 4) with a reduction that may trail its backward by 0.6 s (a queue) or by 2 s (more than the forward):
    X = 4 + (5 - 3.6) + 0.1 x 3.6 = 5.76, step = 4 x 5.76 + 0.05 = 23.09; past the forward the window is
    backward + forward: X = 4 + (5 - 4) + 0.1 x 4 = 5.4, step = 21.65."""
    terms = {k: np.array([[v]]) for k, v in dict(total=4.0, compute=4.0, fwd=1.0, bwd=3.0, wgrad=0.0).items()}
    args = dict(optimizer=0.0, m=4, pp=1, vpp=1, counts=np.ones(1), before=np.zeros((1, 1)),
                overlap_grad_reduce=True, c=0.1, grad_every_mb=True)
    queued = cost.compose_step(terms, np.zeros(1), np.array([5.0]), np.array([0.5]), **args, grad_trail_s=0.6)
    assert queued["step"][0] == pytest.approx(23.09)
    free = cost.compose_step(terms, np.zeros(1), np.array([5.0]), np.array([0.5]), **args, grad_trail_s=2.0)
    assert free["step"][0] == pytest.approx(21.65)


def test_only_megatron_fsdp_lets_the_reduction_trail_its_backward():
    """FSDP2 waits for its reduce-scatters at the end of every backward (``_root_post_backward_final_callback``) and
    DeepSpeed in its reduction epilogue: no trail. Megatron-FSDP queues up to 1e9 elements per model chunk: the trail
    is vpp x the reduce-scatter of 1e9 gradient elements over the DP group, on the same collective model."""
    slow = H100.model_copy(update={"inter_node_bandwidth_gbps": 2.0})
    plan = Plan(tp=1, pp=2, dp=8, vpp=2, micro_batch_size=1, zero_stage=2)
    for fw in ("torchtitan", "deepspeed", "torch"):
        assert cost.grad_reduce_trail_s(slow, TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096,
                                                           framework=fw), plan) == 0.0
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096)
    from planner.layout import axis_span
    group = axis_span(plan, "dp", slow.nvlink_domain)
    one = cost.comm.collective_time_s("reduce_scatter", 1e9 * 4, group, slow)  # fp32 gradients
    assert cost.grad_reduce_trail_s(slow, tr, plan) == pytest.approx(2 * one)
    assert cost.grad_reduce_trail_s(slow, tr, plan.model_copy(update={"dp": 1, "pp": 2, "tp": 8})) == 0.0


def test_torchtitan_with_pp_reduces_once_and_without_every_microbatch():
    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework="torchtitan",
                      overlap_grad_reduce=False)
    slow = H100.model_copy(update={"inter_node_bandwidth_gbps": 2.0})
    flat = estimate_time(model, slow, tr, Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=3))
    rs, _ = cost.dp_sync_parts_s(model, slow, tr, Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=3), 0, 32)
    assert flat.dp_comm_s == pytest.approx(4 * rs)  # FSDP2's stream overlaps it whatever overlap_grad_reduce says
    piped = estimate_time(model, slow, tr, Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=3))
    rs2 = max(cost.dp_sync_parts_s(model, slow, tr, Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=3), r, 16)[0]
              for r in range(2))
    assert piped.dp_comm_s == pytest.approx(rs2)


@pytest.mark.parametrize("framework,overlap,pp", [("megatron", True, 2), ("torchtitan", True, 1),
                                                  ("torchtitan", True, 2), ("deepspeed", False, 1)])
def test_search_tables_are_estimate_time_with_per_microbatch_reduction(framework, overlap, pp):
    """The search's tables charge the reductions as estimate_time does, ZeRO 2/3 included."""
    from planner.candidates import Pins, SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model, hw = load_model("llama3-8b"), H100.model_copy(update={"inter_node_bandwidth_gbps": 5.0})
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework=framework,
                      overlap_grad_reduce=overlap)
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=2, pins=Pins(pp=pp)))
    # (a zero-bubble schedule's bubble is simulated only for the entries that fit: the others cannot be chosen)
    keys = [k for k in legal_keys(tables) if tables.mem_kib[tables.unindex(k)].max() <= tables.usable_kib]
    checked = {assert_entry_is_estimate(model, hw, tr, tables, k).zero_stage for k in keys[:: max(1, len(keys) // 25)]}
    assert checked & {2, 3}


def test_pipelining_reduces_after_the_last_backward_hand_computed():
    """Two stages, m = 2, backward 3 s each, reduce-scatter 5 s each, contention 0.1, no all-gather.
    Megatron's buckets start during the stage's last backward: stage 0 hides it under its own 3 s
    (5 - 3 + 0.3 = 2.3), stage 1 under its own and stage 0's drain, 6 s (0.5): exposed 2.3.
    torch.distributed.pipelining reduces after the last backward (REDUCE_GRAD): stage 0 has nothing to hide it
    (5), stage 1 only stage 0's 3 s (2.3): exposed 5."""
    terms = {k: np.array([[v, v]]) for k, v in dict(total=4.0, compute=4.0, fwd=1.0, bwd=3.0, wgrad=0.0).items()}
    args = dict(optimizer=0.0, m=2, pp=2, vpp=1, counts=np.ones(2), before=np.array([[0.0, 0.0], [1.0, 0.0]]),
                overlap_grad_reduce=True, c=0.1)
    megatron = cost.compose_step(terms, np.zeros(2), np.array([5.0, 5.0]), np.zeros(2), **args)
    torch_pp = cost.compose_step(terms, np.zeros(2), np.array([5.0, 5.0]), np.zeros(2), **args,
                                 grad_under_own_bwd=False)
    assert megatron["dp_exposed"][0] == pytest.approx(2.3)
    assert torch_pp["dp_exposed"][0] == pytest.approx(5.0)
    assert cost.grad_reduce_overlaps_last_backward("torchtitan", 2) is False
    assert cost.grad_reduce_overlaps_last_backward("torchtitan", 1) is True
    assert cost.grad_reduce_overlaps_last_backward("megatron", 4) is True


@pytest.mark.parametrize("name", ["llama3-70b", "deepseek-v3"])
def test_cached_dp_sync_is_the_stage_param_split(name):
    """dp_sync_parts_s is cached on the plan fields it reads, through a stand-in plan of the same stage kind: for
    plans that differ in every other field, and for every stage, it equals the reduction of the stage's own
    (dense, expert) parameters (memory.stage_param_split). DeepSeek-V3's loss stage holds its MTP module, whose
    experts are reduced over the expert-data-parallel group like the other experts."""
    from planner.cost import DEFAULT_ORDER, _dp_sync_split, dp_sync_parts_s
    from planner.memory import stage_param_split

    model, hw = load_model(name), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=512, global_batch_size=1024, seq_len=4096)
    for tp, pp, cp, zero, sched in [(1, 1, 1, 0, None), (2, 4, 1, 1, None), (8, 2, 2, 3, None), (2, 4, 2, 1, "zbv"),
                                    (1, 8, 1, 2, None)]:
        dp = 512 // (tp * pp * cp)
        ep = 8 if model.is_moe else 1
        plan = Plan.model_construct(tp=tp, pp=pp, dp=dp, cp=cp, vpp=2 if sched else 1, micro_batch_size=1,
                                    zero_stage=zero, ep=ep, etp=None, layers_per_stage=None, pipeline_schedule=sched)
        layers = plan.stage_layers(model.num_layers)
        for stage in range(pp):
            want = _dp_sync_split(*stage_param_split(model, plan, stage, layers[stage]), hw, tr, plan, DEFAULT_ORDER)
            assert dp_sync_parts_s(model, hw, tr, plan, stage, layers[stage]) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("framework", ["torchtitan", "torch"])
def test_fsdp2_overlaps_whatever_the_flag_says(framework):
    """FSDP2 reduce-scatters on its own stream after each module's backward and has no switch to do otherwise, so a
    job's overlap_grad_reduce False changes nothing there (cost.overlap_grad_reduce_of), with a pipeline too (where
    the reduction runs once after the last backward); under Megatron it exposes the reduction."""
    model = load_model("llama3-8b")
    slow = H100.model_copy(update={"inter_node_bandwidth_gbps": 2.0})
    plan = Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=2)
    on = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework=framework)
    off = on.model_copy(update={"overlap_grad_reduce": False})
    assert estimate_time(model, slow, off, plan).step_time_s == estimate_time(model, slow, on, plan).step_time_s
    mega = Plan(tp=1, pp=2, dp=8, micro_batch_size=1, zero_stage=1)
    m_on = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096)
    m_off = m_on.model_copy(update={"overlap_grad_reduce": False})
    assert estimate_time(model, slow, m_off, mega).step_time_s > estimate_time(model, slow, m_on, mega).step_time_s
