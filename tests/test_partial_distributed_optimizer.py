"""Megatron-Core's partial distributed optimizers (``TrainingSpec.dist_optimizer_instances``, Megatron-LM
``--num-distributed-optimizer-instances N``): the states each GPU holds are measured on Megatron-Core itself in
tests/test_megatron_states.py (jobs ``zero1-2-instances*``) and the emitted flag goes through Megatron's own argument
validation in tests/test_emit_consumers.py (``partial-distributed-optimizer``). Here: the groups the communication is
costed over (core_v0.16.1 ``parallel_state.py``: each data-parallel group cut into N consecutive slices), the time
identities, the rules, the refusals of the formats that have no such optimizer, and ``plan3d check`` reading it."""

import json

import pytest

from planner.check import check_file_branches, check_paths, exit_code
from planner.cli import app
from planner.cost import dp_sync_parts_s, estimate_time
from planner.emit import job_problems, render_all
from planner.layout import partial_dp_spans, rank_grid, span
from planner.memory import estimate_memory
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec, plan_problems

H100 = load_hardware("h100-sxm-80gb")
L70 = load_model("llama3-70b")


def _megatron_slices(plan: Plan, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra, inter) groups as core_v0.16.1 ``parallel_state.py`` builds them: each dp x cp group's ranks in Megatron's
    order (tp-cp-dp-pp: the cp index fastest, so ascending), cut into n consecutive slices; the inter groups take the
    rank at the same place in every slice."""
    grid = rank_grid(plan)  # [tp, cp, dp, pp]
    intra, inter = [], []
    for t in range(plan.tp):
        for p in range(plan.pp):
            ranks = sorted(int(r) for r in grid[t, :, :, p].ravel())
            size = len(ranks) // n
            slices = [ranks[i * size:(i + 1) * size] for i in range(n)]
            intra += slices
            inter += [list(col) for col in zip(*slices)]
    return intra, inter


@pytest.mark.parametrize("tp, cp, dp, pp, n", [(8, 2, 4, 2, 2), (8, 1, 8, 2, 4), (4, 2, 8, 1, 2), (2, 1, 16, 1, 8),
                                               (8, 1, 4, 1, 4)])
def test_groups_are_megatrons_slices(tp, cp, dp, pp, n):
    """The worst-placed intra- and inter-instance groups (layout.partial_dp_spans) are those of the slices
    Megatron makes, rank by rank, on nodes of 8."""
    plan = Plan(tp=tp, cp=cp, dp=dp, pp=pp, micro_batch_size=1, zero_stage=1)
    intra, inter = _megatron_slices(plan, n)

    def worst(groups):
        return max((span(g, 8) for g in groups), key=lambda s: (s.nodes, -s.per_node))
    assert partial_dp_spans(plan, n, 8) == (worst(intra), worst(inter))


def _sync(n: int, plan: Plan, zero: int = 1):
    tr = TrainingSpec(num_gpus=plan.world_size, global_batch_size=plan.dp * 8, seq_len=4096, dist_optimizer_instances=n)
    return dp_sync_parts_s(L70, H100, tr, plan.model_copy(update={"zero_stage": zero}), 1, 40)


def test_one_instance_per_rank_is_an_all_reduce():
    """N = dp x cp: each instance is one rank, so nothing is reduce-scattered or all-gathered within it and the
    gradients are all-reduced across all of them: the ZeRO-0 reduction over the same ranks, to the last bit."""
    plan = Plan(tp=8, pp=2, dp=8, cp=1, micro_batch_size=1, zero_stage=1)
    reduce_s, gather_s = _sync(8, plan)
    assert gather_s == 0.0
    assert reduce_s == _sync(1, plan, zero=0)[0]


def test_instances_trade_the_reduce_scatter_for_an_all_reduce_of_the_shard():
    """N = 2 over dp 8 (one node each way): the reduction is the reduce-scatter over 4 ranks plus the all-reduce of
    its quarter across 2; the gather over 4 ranks. Both differ from one instance's, and one instance is unchanged."""
    from planner import comm
    from planner.memory import stage_param_split

    plan = Plan(tp=8, pp=2, dp=8, cp=1, micro_batch_size=1, zero_stage=1)
    tr = TrainingSpec(num_gpus=128, global_batch_size=64, seq_len=4096)
    params = sum(stage_param_split(L70, plan, 1, 40))
    intra, inter = partial_dp_spans(plan, 2, H100.nvlink_domain)
    g = params * 4  # fp32 gradients
    want_reduce = comm.collective_time_s("reduce_scatter", g, intra, H100) + \
        comm.collective_time_s("all_reduce", g / 4, inter, H100)
    want_gather = comm.collective_time_s("all_gather", params * 2, intra, H100)
    assert _sync(2, plan) == pytest.approx((want_reduce, want_gather), rel=1e-12)
    assert _sync(1, plan) == dp_sync_parts_s(L70, H100, tr, plan, 1, 40)


def test_memory_and_step_time_of_a_plan():
    """The optimizer states double with two instances and quadruple with four (each shards over dp x cp / N); the
    weights and gradients do not move; the step is not faster."""
    plan = Plan(tp=8, pp=2, dp=8, cp=1, micro_batch_size=1, zero_stage=1, recompute="selective",
                sequence_parallel=True)
    out = {}
    for n in (1, 2, 4):
        tr = TrainingSpec(num_gpus=128, global_batch_size=128, seq_len=4096, dist_optimizer_instances=n)
        st = estimate_memory(L70, H100, tr, plan).stages[0]
        out[n] = (st.weights_bytes, st.grads_bytes, st.optimizer_bytes, estimate_time(L70, H100, tr, plan).step_time_s)
    assert out[1][:2] == out[2][:2] == out[4][:2]
    assert out[2][2] == 2 * out[1][2] and out[4][2] == 4 * out[1][2]
    assert out[1][3] <= out[2][3] <= out[4][3]


@pytest.mark.parametrize("framework, zero, dp, cp, n, fragment", [
    ("megatron", 1, 8, 1, 3, "3 does not divide dp(8) * cp(1)"),
    ("megatron", 0, 8, 1, 2, "Partial DistOpt cannot be used without DistOpt"),
    ("megatron", 3, 8, 1, 2, "hybrid sharding"),
    ("torchtitan", 3, 8, 1, 2, "torchtitan has none"),
    ("megatron", 1, 4, 2, 8, None),  # dp x cp = 8: one instance per rank
])
def test_rules(framework, zero, dp, cp, n, fragment):
    plan = Plan(tp=8, pp=2, dp=dp, cp=cp, micro_batch_size=1, zero_stage=zero)
    tr = TrainingSpec(num_gpus=plan.world_size, global_batch_size=64, seq_len=4096, framework=framework,
                      dist_optimizer_instances=n)
    problems = plan_problems(L70, H100, tr, plan)
    if fragment is None:
        assert problems == []
    else:
        assert any(fragment in p for p in problems), problems


def test_expert_data_parallel_group_must_divide():
    """MoE: N divides the expert-data-parallel size too (parallel_state.py asserts it)."""
    model = load_model("mixtral-8x7b")
    plan = Plan(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=1, ep=8, etp=1)  # expert dp 2
    for n, ok in ((2, True), (4, False)):
        tr = TrainingSpec(num_gpus=16, global_batch_size=16, seq_len=4096, dist_optimizer_instances=n)
        problems = plan_problems(model, H100, tr, plan)
        assert (problems == []) == ok, problems


def test_formats_without_it_refuse_before_and_after_a_search():
    tr = TrainingSpec(num_gpus=128, global_batch_size=128, seq_len=4096, dist_optimizer_instances=2)
    problems = job_problems(L70, tr, ["megatron", "deepspeed", "torchtitan"])
    assert [p.split(":")[0] for p in problems if "partial distributed optimizer" in p] == \
        ["--format deepspeed", "--format torchtitan"]
    sc = Scenario(model=L70, hardware=H100, training=tr,
                  plan=Plan(tp=8, pp=2, dp=8, micro_batch_size=1, zero_stage=1))
    (args,) = render_all(sc, ["megatron"]).values()
    assert "--num-distributed-optimizer-instances 2" in args.splitlines()
    for fmt in ("deepspeed", "torchtitan"):
        with pytest.raises(SpecError, match="partial distributed optimizer"):
            render_all(sc, [fmt])


def test_check_reads_the_flag(tmp_path):
    """A Megatron-LM launch with --num-distributed-optimizer-instances: read with the distributed optimizer (its
    states N times as large as without), refused without it (Megatron refuses) and with Megatron-FSDP (not
    modelled)."""
    from pathlib import Path

    text = (Path(__file__).parent / "data" / "launch" / "megatron_gqa_default.sh").read_text()
    assert "--use-distributed-optimizer" in text
    script = tmp_path / "train.sh"
    script.write_text(text.replace("--bf16 ", "--bf16 --num-distributed-optimizer-instances 2 "))
    (two,) = check_file_branches(script, H100, None, None)
    script.write_text(text)
    (one,) = check_file_branches(script, H100, None, None)
    assert not two.errors and two.scenario.training.dist_optimizer_instances == 2
    assert one.scenario.training.dist_optimizer_instances == 1
    opt = [estimate_memory(r.scenario.model, H100, r.scenario.training, r.scenario.resolved_plan()).stages[0]
           .optimizer_bytes for r in (one, two)]
    assert opt[1] == 2 * opt[0]
    for optimizer_flags, fragment in (("", "Partial DistOpt cannot be used without DistOpt"),  # ZeRO 0
                                      ("--use-distributed-optimizer --use-megatron-fsdp "  # ZeRO 3
                                       "--data-parallel-sharding-strategy optim_grads_params", "Megatron-FSDP")):
        script.write_text(text.replace("--use-distributed-optimizer", optimizer_flags)
                          .replace("--bf16 ", "--bf16 --num-distributed-optimizer-instances 2 "))
        (r,) = check_paths([str(script)], H100, None, None)
        assert exit_code([r]) == 2 and fragment in r.errors[0], r.errors


def test_cli_estimate_and_search_take_it(runner):
    base = ["--model", "llama3-70b", "--hardware", "h100-sxm-80gb", "--gpus", "128", "--global-batch", "128",
            "--seq-len", "4096", "--json"]
    res = runner.invoke(app, ["estimate", *base, "--tp", "8", "--pp", "2", "--zero-stage", "1",
                              "--dist-optimizer-instances", "2"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["search", *base, "--dist-optimizer-instances", "2", "--top", "0"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)["plan"]
    assert plan["zero_stage"] == 1 and (plan["dp"] * plan.get("cp", 1)) % 2 == 0
    res = runner.invoke(app, ["estimate", *base, "--tp", "8", "--pp", "2", "--zero-stage", "0",
                              "--dist-optimizer-instances", "2"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    # a pinned ZeRO stage the instances cannot run with: said up front, not "no legal plan"
    res = runner.invoke(app, ["search", *base, "--dist-optimizer-instances", "2", "--zero-stage", "0"])
    assert res.exit_code == 2 and "--zero-stage 0 with --dist-optimizer-instances 2" in res.output, res.output


def test_search_offers_only_what_megatron_runs():
    """Every legal entry of the search tables with two instances is ZeRO 1 with dp x cp (and the expert-data-parallel
    size) divisible by 2, and plan_problems finds nothing wrong with it; the search's plan is one of them."""
    from planner.candidates import Pins, SearchSpace
    from planner.search import build_tables, search
    from planner.specs import dist_optimizer_problems

    model = load_model("mixtral-8x7b")
    tr = TrainingSpec(num_gpus=32, global_batch_size=64, seq_len=2048, dist_optimizer_instances=2)
    space = SearchSpace(pins=Pins(ep=8), max_micro_batch_size=1, max_cp=2)
    tables = build_tables(model, H100, tr, space, workers=1)
    legal = [int(k) for k in tables.legal.ravel().nonzero()[0]]
    assert legal
    for k in legal:
        plan = tables.plan(k)
        assert plan.zero_stage == 1 and not dist_optimizer_problems(tr, plan), plan
    for k in legal[::max(1, len(legal) // 25)]:
        assert plan_problems(model, H100, tr, tables.plan(k)) == [], tables.plan(k)
    best = search(model, H100, tr, space).best
    assert best is not None and best.zero_stage == 1 and not plan_problems(model, H100, tr, best)


def test_nemo_1_apex_optimizer_is_not_megatrons():
    tr = TrainingSpec(num_gpus=128, global_batch_size=128, seq_len=4096, framework="nemo", optimizer_dtype="bf16-apex",
                      dist_optimizer_instances=2)
    plan = Plan(tp=8, pp=2, dp=8, micro_batch_size=1, zero_stage=1)
    assert any("Apex" in p for p in plan_problems(L70, H100, tr, plan))
    assert plan_problems(L70, H100, tr.model_copy(update={"optimizer_dtype": "fp32"}), plan) == []
