"""DeepEP's communication buffer in memory, and DeepEP's own limits on the expert group (issues 13, 16).

The expected sizes are DeepEP's ``csrc/config.hpp`` size hints written out by hand for the group sizes at hand
(``Config::get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint``, with the recommended configs of
``deep_ep/buffer.py``), plus the 32 MiB workspace of ``csrc/deep_ep.cpp``; Megatron-Core's ``get_buffer``
(core_v0.16.1 ``moe/fused_a2a.py``) passes ``hidden_bytes = hidden * 2`` in bf16 and DeepEP's 20 SMs
(``moe_deepep_num_sms``), so 10 channels.
"""

from __future__ import annotations

import pytest

from planner.memory import deepep_buffer_bytes, estimate_memory, stage_memory
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec, plan_problems

DSV3 = load_model("deepseek-v3")
H100 = load_hardware("h100-sxm-80gb")
WORKSPACE = 32 * 2**20
GRANULE = 2**29  # NVSHMEM_CUMEM_GRANULARITY as DeepEP sets it


def _align128(n: int) -> int:
    return (n + 127) // 128 * 128


def _training(dispatcher: str = "deepep", gpus: int = 1024) -> TrainingSpec:
    return TrainingSpec(num_gpus=gpus, global_batch_size=8192, seq_len=4096, moe_token_dispatcher=dispatcher)


def test_deepseek_v3_over_64_ranks_by_hand():
    """hidden 7,168 x 2 B = 14,336 B; 64 ranks: 8 NVLink peers, 8 RDMA ranks, 288 NVLink and 128 RDMA receive tokens
    per channel. Per received token besides the hidden state: 8 B source meta, 128 x 8 B top-k indices, 128 x 4 B
    weights, 128 x 4 B scales = 2,056 B (the RDMA side adds an int4, 16 B, and sends and receives: x 2)."""
    nvl = _align128(10 * 8 * (2 * 8 + 3) * 4 + 10 * 8 * 288 * (14336 + 2056))
    rdma = 10 * 8 * (8 * 2 + 2) * 2 * 4 + 2 * 10 * 8 * 128 * (14336 + 2056 + 16) + 2**20
    assert nvl == 377_677_824 and rdma == 337_095_936  # 377.7 and 337.1 MB
    plan = Plan(tp=2, pp=8, dp=64, vpp=4, micro_batch_size=1, ep=64, etp=1)
    assert deepep_buffer_bytes(DSV3, _training(), plan) == nvl + GRANULE + WORKSPACE  # the RDMA part: one granule


def test_inside_one_node_there_is_no_rdma_buffer():
    """8 ranks: DeepEP's "legacy mode", no NVSHMEM (get_rdma_buffer_size_hint returns 0); 256 receive tokens."""
    nvl = _align128(10 * 8 * (2 * 1 + 3) * 4 + 10 * 8 * 256 * (14336 + 2056))
    plan = Plan(tp=1, pp=16, dp=64, micro_batch_size=1, ep=8, etp=1)
    assert deepep_buffer_bytes(DSV3, _training(), plan) == nvl + WORKSPACE


def test_the_expert_group_counts_expert_tp():
    """Megatron's flex dispatcher runs over the etp x ep group: ep 8 with etp 2 is DeepEP over 16 ranks."""
    nvl = _align128(10 * 8 * (2 * 2 + 3) * 4 + 10 * 8 * 288 * (14336 + 2056))
    plan = Plan(tp=2, pp=8, dp=64, vpp=4, micro_batch_size=1, ep=8, etp=2)
    assert deepep_buffer_bytes(DSV3, _training(), plan) == nvl + GRANULE + WORKSPACE


def test_nothing_without_deepep_or_experts():
    plan = Plan(tp=2, pp=8, dp=64, vpp=4, micro_batch_size=1, ep=64, etp=1)
    assert deepep_buffer_bytes(DSV3, _training("alltoall"), plan) == 0.0
    dense = load_model("llama3-8b")
    assert deepep_buffer_bytes(dense, _training(), Plan(tp=1, pp=1, dp=1024, micro_batch_size=1)) == 0.0


def test_only_stages_with_a_moe_layer_hold_it():
    """DeepSeek-V3's first three layers are dense: a first stage of only those never dispatches, so it never
    builds the buffer; the stages after it do. The rest of the stage is the same as with the all-to-all."""
    plan = Plan(tp=8, pp=2, dp=64, micro_batch_size=1, ep=64, etp=1, layers_per_stage=(3, 58))
    m = 8192 // 64
    with_deepep = [stage_memory(DSV3, _training(), plan, m, r, n, H100) for r, n in enumerate((3, 58))]
    plain = [stage_memory(DSV3, _training("alltoall"), plan, m, r, n, H100) for r, n in enumerate((3, 58))]
    buffer = deepep_buffer_bytes(DSV3, _training(), plan)
    assert buffer > 0
    assert with_deepep[0].other_bytes == plain[0].other_bytes
    assert with_deepep[1].other_bytes == pytest.approx(plain[1].other_bytes + buffer)


def test_estimate_counts_it_on_every_moe_stage():
    plan = Plan(tp=2, pp=8, dp=64, vpp=4, micro_batch_size=1, ep=64, etp=1)
    a = estimate_memory(DSV3, H100, _training(), plan)
    b = estimate_memory(DSV3, H100, _training("alltoall"), plan)
    buffer = deepep_buffer_bytes(DSV3, _training(), plan)
    for x, y in zip(a.stages, b.stages):
        assert x.other_bytes == pytest.approx(y.other_bytes + buffer)


def test_group_sizes_deepep_has_no_config_for_are_refused():
    """DeepEP asserts "Unsupported number of EP ranks" outside its config table (256 here) and Megatron's flex
    dispatcher "requires TPxEP > 1"."""
    plan = Plan(tp=1, pp=8, dp=256, micro_batch_size=1, ep=256, etp=1, layers_per_stage=(7, 8, 8, 8, 8, 8, 8, 6))
    problems = plan_problems(DSV3, H100, _training(gpus=2048), plan)
    assert any("moe_token_dispatcher: DeepEP has no buffer config for an expert group of 256 ranks" in p
               for p in problems), problems
    assert not plan_problems(DSV3, H100, _training("alltoall", gpus=2048), plan)
    qwen = load_model("qwen3-30b-a3b")
    single = Plan(tp=1, pp=1, dp=8, micro_batch_size=1, ep=1)
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096, moe_token_dispatcher="deepep")
    assert any("deepep needs an expert group of more than one rank" in p for p in plan_problems(qwen, H100, tr, single))


def test_search_keeps_to_what_deepep_runs_and_its_tables_are_the_estimate():
    """The search's shapes leave out the groups DeepEP refuses (here ep 1 at tp 1), and its tables hold the buffer
    where estimate_time and stage_memory do (tests/table_checks.py)."""
    from planner.candidates import Pins, SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("tiny-moe")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=512, moe_token_dispatcher="deepep")
    tables = build_tables(model, H100, tr, SearchSpace(max_micro_batch_size=2, pins=Pins(tp=1)))
    keys = legal_keys(tables)
    assert keys
    groups = {tables.plan(k).ep * tables.plan(k).expert_tp for k in keys}
    assert 1 not in groups and groups <= {2, 4, 8, 16}
    checked = [assert_entry_is_estimate(model, H100, tr, tables, k) for k in keys[:: max(1, len(keys) // 20)]]
    assert any(p.pp > 1 for p in checked) and any(deepep_buffer_bytes(model, tr, p) for p in checked)


def test_check_reads_the_flex_dispatcher_back(tmp_path):
    """An emitted DeepEP launch reads back as DeepEP (tests/test_round_trip_sweep.py checks its verdict); the same
    file with HybridEP reads back as HybridEP (tests/test_hybridep_buffer.py sizes its buffer)."""
    from planner.check import check_file_branches
    from planner.emit import render_all
    from planner.io import write_all
    from planner.specs import Scenario

    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, moe_token_dispatcher="deepep")
    sc = Scenario(model=load_model("mixtral-8x7b"), hardware=H100, training=tr,
                  plan=Plan(tp=1, pp=2, dp=8, vpp=2, ep=8, zero_stage=1, micro_batch_size=1))
    (path,) = [p for p in write_all(tmp_path, render_all(sc, ["megatron"]), force=True) if p.name.endswith(".args")]
    text = path.read_text()
    assert "--moe-flex-dispatcher-backend deepep" in text
    (r,) = check_file_branches(path, None, None, None)
    assert r.scenario.training.moe_token_dispatcher == "deepep"
    path.write_text(text.replace("--moe-flex-dispatcher-backend deepep", "--moe-flex-dispatcher-backend hybridep"))
    (r,) = check_file_branches(path, None, None, None)
    assert r.scenario.training.moe_token_dispatcher == "hybridep"


@pytest.mark.parametrize("framework", ["torchtitan", "deepspeed", "torch"])
def test_deepep_outside_megatron_is_refused(framework):
    """plan3d's DeepEP is Megatron-Core's flex dispatcher; the torchtitan and DeepSpeed launch files never ran it (their
    emitters write the all-to-all), so a job asking for it there is refused before any plan."""
    from planner.specs import job_problems

    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, framework=framework, moe_token_dispatcher="deepep")
    problems = job_problems(load_model("mixtral-8x7b"), H100, tr)
    assert any(p.startswith("moe_token_dispatcher: deepep is modelled as Megatron-Core's flex dispatcher") for p in problems)
    assert not job_problems(load_model("mixtral-8x7b"), H100, tr.model_copy(update={"moe_token_dispatcher": "alltoall"}))


def test_validate_runs_deepep_plans_with_the_all_to_all():
    """The validate run (torch's all-to-all) and a torchtitan run of a Megatron DeepEP plan are predicted with the
    dispatcher they run, and say so; the job check then accepts them."""
    from planner.specs import Scenario, job_problems
    from planner.validate import framework_run
    from planner.validate.launch import changes, run_scenario

    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, moe_token_dispatcher="deepep")
    sc = Scenario(model=load_model("mixtral-8x7b"), hardware=H100, training=tr,
                  plan=Plan(tp=1, pp=2, dp=8, vpp=2, ep=8, zero_stage=1, micro_batch_size=1))
    run = run_scenario(sc)
    assert run.training.moe_token_dispatcher == "alltoall" and not job_problems(run.model, run.hardware, run.training)
    assert "token dispatch deepep -> alltoall (torch's all-to-all)" in changes(sc, run)
    pred = framework_run.predicted_scenario(sc, "torchtitan")
    assert pred.training.moe_token_dispatcher == "alltoall"
    assert "token dispatch deepep -> alltoall" in framework_run.changes(sc, pred)
    assert framework_run.predicted_scenario(sc, "nemo").training.moe_token_dispatcher == "deepep"


def test_check_reads_megatrons_default_dispatcher_as_the_allgather(tmp_path):
    """Without --moe-token-dispatcher-type Megatron runs its allgather dispatcher (core_v0.16.1
    ``TransformerConfig.moe_token_dispatcher_type = "allgather"``): the check costs that one and says so."""
    from planner.check import check_file_branches
    from planner.emit import render_all
    from planner.io import write_all
    from planner.specs import Scenario

    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096)
    sc = Scenario(model=load_model("mixtral-8x7b"), hardware=H100, training=tr,
                  plan=Plan(tp=1, pp=2, dp=8, vpp=2, ep=8, zero_stage=1, micro_batch_size=1))
    (path,) = [p for p in write_all(tmp_path, render_all(sc, ["megatron"]), force=True) if p.name.endswith(".args")]
    text = path.read_text()
    (r,) = check_file_branches(path, None, None, None)
    assert not any("allgather dispatcher" in n for n in r.notes)  # plan3d writes the all-to-all
    assert r.scenario.training.moe_token_dispatcher == "alltoall"
    path.write_text(text.replace("--moe-token-dispatcher-type alltoall", ""))
    (r,) = check_file_branches(path, None, None, None)
    assert any(n.startswith("no --moe-token-dispatcher-type: Megatron-Core's default allgather") for n in r.notes), \
        r.notes
    assert r.scenario.training.moe_token_dispatcher == "allgather"
    path.write_text(text.replace("--moe-token-dispatcher-type alltoall", "--moe-token-dispatcher-type allgather"))
    (r,) = check_file_branches(path, None, None, None)
    assert r.scenario.training.moe_token_dispatcher == "allgather"
    assert not any("allgather" in n for n in r.notes)  # stated, nothing to say
