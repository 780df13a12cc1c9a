"""HybridEP, the flex dispatcher's other backend (``--moe-flex-dispatcher-backend hybridep``): its buffer in memory,
its limits, how plan3d writes it and reads it back (issues 13, 16).

The expected sizes are written out by hand from deepseek-ai/DeepEP's hybrid-ep sources, term by term:
``csrc/hybrid_ep/hybrid_ep.cu`` @ 098da2a6 (``allocate_buffer``: ``max_num_of_tokens = max_num_of_tokens_per_rank x
num_of_ranks_per_node x num_of_nodes``; with ``use_shared_buffer`` one ``uint16_t`` token buffer of ``M x hidden``,
one float probability buffer of ``M x experts_per_rank x ranks_per_node`` and a float scaling-factor buffer of
``M x hidden / 128``; the preprocessing scratch of ``108 x ranks_per_node`` 8-byte states) and
``csrc/hybrid_ep/internode.cu`` (``allocate_dispatch_rdma_buffers``, ``allocate_combine_rdma_buffers``), with
``max_num_of_tokens_per_rank = max(T, 512)`` from ``deep_ep/hybrid_ep_buffer.py`` and ``T`` the tokens a rank dispatches
per micro-batch (Megatron-Core core_v0.16.1 ``moe/fused_a2a.py``: ``seq_len, hidden_dim = x.shape[-2:]``).
"""

from __future__ import annotations

import pytest

from planner.memory import GIB, deepep_buffer_bytes, estimate_memory, hybridep_buffer_bytes, stage_memory
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec, job_problems, plan_problems
from tests.test_emit_consumers import megatron  # noqa: F401 (the session fixture)

DSV3 = load_model("deepseek-v3")
QWEN = load_model("qwen3-235b-a22b")
H100 = load_hardware("h100-sxm-80gb")
GB200 = load_hardware("gb200-nvl72")


def _training(gpus: int = 256, dispatcher: str = "hybridep", **kw) -> TrainingSpec:
    return TrainingSpec(num_gpus=gpus, global_batch_size=4096, seq_len=4096, moe_token_dispatcher=dispatcher, **kw)


def test_deepseek_v3_over_one_nvl72_domain():
    """EP 64 inside the 64 GPUs a 256-GPU job fills of each NVL72 rack, 4 local experts, 4,096 tokens: M = 4,096 x 64
    = 262,144 rows of 7,168 x 2 B tokens, 4 x 64 x 4 B probabilities and 56 x 4 B scales; 108 x 64 x 8 B of scratch.
    3.80 GiB, where DeepEP's buffer over the same group is 0.88 GiB."""
    plan = Plan(tp=1, pp=4, dp=64, vpp=4, ep=64, micro_batch_size=1)
    expected = 262_144 * (7_168 * 2 + 4 * 64 * 4 + 56 * 4) + 108 * 64 * 8
    assert expected == 4_085_307_392
    assert hybridep_buffer_bytes(DSV3, _training(), plan, GB200) == expected
    assert hybridep_buffer_bytes(DSV3, _training(), plan, GB200) / GIB == pytest.approx(3.80, abs=0.005)
    assert deepep_buffer_bytes(DSV3, _training(dispatcher="deepep"), plan) / GIB == pytest.approx(0.88, abs=0.01)


def test_qwen3_235b_over_four_dgx_nodes():
    """EP 32 on DGX H100: 8 ranks per NVLink domain, 4 domains (the multi-node build), 4 local experts, 4,096 tokens.
    NVLink part: M = 4,096 x 8 x 4 = 131,072 rows of 4,096 x 2 + 4 x 8 x 4 + 32 x 4 B, and 108 x 8 x 8 B.
    RDMA part, D = 3 remote domains: dispatch 4,096 x (4,096 x 2 + 4 x 8 x 4 x 4 + 32 x 4) for the local copies and
    4,096 x 3 x (4,096 x 2 + 4 x 8 x 4 + 32 x 4) for the receive slots; combine 2 x 4,096 x 3 x (4,096 x 2 + 4 x 8 x 4);
    flags 4 x 3 x 32 x 8 B."""
    plan = Plan(tp=1, pp=2, dp=128, ep=32, micro_batch_size=1)
    nvlink = 131_072 * (8_192 + 128 + 128) + 108 * 8 * 8
    rdma = 4_096 * (8_192 + 512 + 128) + 4_096 * 3 * (8_192 + 128 + 128) + 2 * 4_096 * 3 * (8_192 + 128) + 4 * 3 * 32 * 8
    assert nvlink + rdma == 1_451_763_456
    assert hybridep_buffer_bytes(QWEN, _training(), plan, H100) == nvlink + rdma
    # the same group inside one NVL72 domain has no RDMA part, and 32 ranks' probabilities per row
    assert hybridep_buffer_bytes(QWEN, _training(), plan, GB200) == 131_072 * (8_192 + 4 * 32 * 4 + 128) + 108 * 32 * 8


def test_tokens_floor_micro_batch_and_tensor_parallelism():
    """T = mbs x seq / (cp x tp), never below 512: 2 micro-batch sequences double the rows; TP 2 with SP (expert TP
    1, the same 64-rank group) halves them; 256 tokens are sized as 512."""
    base = Plan(tp=1, pp=4, dp=64, vpp=4, ep=64, micro_batch_size=1)
    one = hybridep_buffer_bytes(DSV3, _training(), base, GB200)
    scratch = 108 * 64 * 8
    two = hybridep_buffer_bytes(DSV3, _training(), base.model_copy(update={"micro_batch_size": 2}), GB200)
    assert two - scratch == 2 * (one - scratch)
    tp2 = Plan(tp=2, pp=4, dp=32, vpp=4, ep=64, etp=1, micro_batch_size=1, sequence_parallel=True)
    assert hybridep_buffer_bytes(DSV3, _training(), tp2, GB200) - scratch == (one - scratch) / 2
    short = _training().model_copy(update={"seq_len": 256})
    assert hybridep_buffer_bytes(DSV3, short, base, GB200) == hybridep_buffer_bytes(
        DSV3, _training().model_copy(update={"seq_len": 512}), base, GB200)


def test_the_jobs_domain_variable_sizes_it():
    """A job that tells HybridEP 8 ranks per domain (NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8) on an NVL72 rack gets
    the multi-domain buffers, as on 8-GPU nodes; one that does not divide the group is refused as HybridEP asserts."""
    plan = Plan(tp=1, pp=2, dp=128, ep=32, micro_batch_size=1)
    told = _training(hybridep_ranks_per_domain=8)
    assert hybridep_buffer_bytes(QWEN, told, plan, GB200) == hybridep_buffer_bytes(QWEN, _training(), plan, H100)
    problems = plan_problems(QWEN, GB200, _training(hybridep_ranks_per_domain=12), plan)
    assert any(p.startswith("hybridep_ranks_per_domain: HybridEP needs the expert group's 32 ranks") for p in problems)
    assert not plan_problems(QWEN, GB200, told, plan)


def test_nothing_without_hybridep_or_experts_and_only_on_moe_stages():
    """Zero for another dispatcher or a dense model; DeepSeek-V3's dense-only first stage never dispatches, the
    stage after it holds the buffer on top of what the all-to-all's holds."""
    plan = Plan(tp=8, pp=2, dp=16, micro_batch_size=1, ep=64, etp=1, layers_per_stage=(3, 58))
    assert hybridep_buffer_bytes(DSV3, _training(dispatcher="alltoall"), plan, H100) == 0.0
    dense = load_model("llama3-8b")
    assert hybridep_buffer_bytes(dense, _training(), Plan(tp=1, pp=1, dp=256, micro_batch_size=1), H100) == 0.0
    m = 4096 // 16
    with_it = [stage_memory(DSV3, _training(), plan, m, r, n, H100) for r, n in enumerate((3, 58))]
    plain = [stage_memory(DSV3, _training(dispatcher="alltoall"), plan, m, r, n, H100) for r, n in enumerate((3, 58))]
    buffer = hybridep_buffer_bytes(DSV3, _training(), plan, H100)
    assert buffer > 0
    assert with_it[0].other_bytes == plain[0].other_bytes
    assert with_it[1].other_bytes == pytest.approx(plain[1].other_bytes + buffer)
    est = estimate_memory(DSV3, H100, _training(), plan)
    assert est.stages[1].other_bytes == pytest.approx(with_it[1].other_bytes)


def test_hybridep_outside_megatron_and_single_rank_groups_are_refused():
    """Megatron-Core's flex dispatcher only (the torchtitan and DeepSpeed launch files never run it), over more than
    one rank ("Flex token dispatcher requires TPxEP > 1"; HybridEP: "at least 2 ranks")."""
    for framework in ("torchtitan", "deepspeed", "torch"):
        problems = job_problems(DSV3, H100, _training(framework=framework))
        assert any(p.startswith("moe_token_dispatcher: hybridep is modelled as Megatron-Core's flex dispatcher")
                   for p in problems), problems
    qwen30 = load_model("qwen3-30b-a3b")
    single = Plan(tp=1, pp=1, dp=8, micro_batch_size=1, ep=1)
    problems = plan_problems(qwen30, H100, _training(gpus=8), single)
    assert any("hybridep needs an expert group of more than one rank" in p for p in problems), problems
    # any group size is sized (no DeepEP-style table): 256 ranks is legal for HybridEP
    wide = Plan(tp=1, pp=8, dp=256, micro_batch_size=1, ep=256, etp=1, layers_per_stage=(7, 8, 8, 8, 8, 8, 8, 6))
    assert not [p for p in plan_problems(DSV3, H100, _training(gpus=2048), wide) if "hybridep" in p.lower()]


def test_search_tables_are_the_estimate_with_hybridep():
    """The search's tables hold HybridEP's buffer where estimate_time and stage_memory do, per micro-batch size
    (tests/table_checks.py)."""
    from planner.candidates import Pins, SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("tiny-moe")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=512, moe_token_dispatcher="hybridep")
    tables = build_tables(model, H100, tr, SearchSpace(max_micro_batch_size=2, pins=Pins(tp=1)))
    keys = legal_keys(tables)
    assert keys
    checked = [assert_entry_is_estimate(model, H100, tr, tables, k) for k in keys[:: max(1, len(keys) // 25)]]
    assert {p.micro_batch_size for p in checked} == {1, 2}
    assert any(p.pp > 1 for p in checked) and all(hybridep_buffer_bytes(model, tr, p, H100) for p in checked)


def test_emit_writes_the_backend_and_its_domain_and_check_reads_them_back(tmp_path):
    """The launch script selects HybridEP under the flex dispatcher and exports the ranks per NVLink domain it was
    sized with; `plan3d check` reads both back, and a script that exports another value is sized with that one."""
    from planner.check import check_file_branches
    from planner.emit import render_all
    from planner.io import write_all
    from planner.specs import Scenario

    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, moe_token_dispatcher="hybridep")
    sc = Scenario(model=load_model("mixtral-8x7b"), hardware=H100, training=tr,
                  plan=Plan(tp=1, pp=2, dp=8, vpp=2, ep=8, zero_stage=1, micro_batch_size=1))
    (path,) = [p for p in write_all(tmp_path, render_all(sc, ["torchrun"]), force=True) if p.name.endswith(".sh")]
    text = path.read_text()
    assert "--moe-token-dispatcher-type flex" in text and "--moe-flex-dispatcher-backend hybridep" in text
    assert "export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8" in text and "USE_MNNVL" not in text
    (r,) = check_file_branches(path, None, None, None)
    assert r.scenario.training.moe_token_dispatcher == "hybridep"
    assert r.scenario.training.hybridep_ranks_per_domain == 8
    # Mixtral (h 4,096, 8 experts) over EP 8 told 4 ranks per domain: two domains of 4 ranks, one local expert, T 4,096
    path.write_text(text.replace("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8", "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=4"))
    (r,) = check_file_branches(path, None, None, None)
    t = r.scenario.training
    assert t.hybridep_ranks_per_domain == 4
    assert any("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=4" in n for n in r.notes), r.notes
    nvlink = 32_768 * (4_096 * 2 + 4 * 1 * 4 + 32 * 4) + 108 * 4 * 8
    rdma = 4_096 * (8_192 + 4 * 1 * 4 * 2 + 128) + 4_096 * (8_192 + 16 + 128) + 2 * 4_096 * (8_192 + 16) + 4 * 32 * 8
    assert hybridep_buffer_bytes(r.scenario.model, t, r.scenario.plan, r.scenario.hardware) == nvlink + rdma


def test_emit_on_nvl72_exports_fabric_memory():
    """More than 8 ranks per domain: HybridEP shares fabric memory across the rack (USE_MNNVL=1)."""
    from planner.emit import megatron as emit_megatron
    from planner.specs import Scenario

    sc = Scenario(model=DSV3, hardware=GB200, training=_training(),
                  plan=Plan(tp=1, pp=4, dp=64, vpp=4, ep=64, micro_batch_size=1,
                            layers_per_stage=(16, 16, 16, 13)))
    assert emit_megatron.hybridep_env(sc) == [("NUM_OF_RANKS_PER_NVLINK_DOMAIN", "64"),
                                              ("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "64"), ("USE_MNNVL", "1")]


def test_megatron_accepts_the_emitted_hybridep_launch(megatron, monkeypatch, tmp_path):  # noqa: F811
    """Megatron-LM core_v0.16.1's own validation (parse_args, validate_args, the TransformerConfig build) takes the
    emitted flags and selects the flex dispatcher with HybridEP; unlike DeepEP, HybridEP takes drop-and-pad routing
    (``_HybridEPManager``: ``drop_and_pad``), and Megatron accepts that too."""
    from tests.test_emit_consumers import megatron_validate
    from tests.test_emit_moe import TINY, _args_file_argv, _grouped_gemm_capability, scenario

    sc = scenario(**TINY, tp=1, pp=1, dp=8, ep=8)
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"moe_token_dispatcher": "hybridep"})})
    _grouped_gemm_capability(monkeypatch, 9)
    _, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1")
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    padded = sc.model_copy(update={"model": sc.model.model_copy(update={"capacity_factor": 1.0})})
    _, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(padded, tmp_path / "padded"), "1")
    assert config.moe_pad_expert_input_to_capacity and config.moe_flex_dispatcher_backend == "hybridep"


@pytest.mark.parametrize("backend, code", [("deepep", 2), ("hybridep", 2), ("standard", 1)])
def test_torchtitan_deepep_backends_are_refused_not_read_as_the_all_to_all(tmp_path, backend, code):
    """torchtitan's parallelism.expert_parallel_comm_backend ("standard", "deepep", later "hybridep") builds DeepEP's
    or HybridEP's own buffers, which plan3d sizes only as Megatron-Core builds them: with EP the TOML is refused in
    one line rather than passed with the all-to-all's memory. DeepSeek-V3 671B's TOML (tests/data/launch/real), EP 8."""
    from pathlib import Path

    from planner.check import check_file_branches, exit_code

    real = Path(__file__).parent / "data" / "launch" / "real" / "torchtitan_deepseek_v3_671b.toml"
    text = real.read_text().replace("expert_parallel_degree = 1\n",
                                    f'expert_parallel_degree = 8\nexpert_parallel_comm_backend = "{backend}"\n')
    path = tmp_path / "dsv3.toml"
    path.write_text(text)
    results = check_file_branches(path, H100, None, 256, None)
    assert exit_code(results) == code, [r.errors for r in results]
    if code == 2:
        (err,) = results[0].errors
        assert f"parallelism.expert_parallel_comm_backend = {backend}: torchtitan's DeepEP/HybridEP buffers are not " \
               "modelled" in err and "\n" not in err


def test_groups_that_straddle_nvlink_domains_unevenly_are_refused():
    """HybridEP asserts that its group size divides by the ranks per NVLink domain, one count for the whole job: EP 32
    on four full NVL72 racks (288 GPUs) puts 32, 8 + 24 and 16 + 16 ranks of its consecutive groups in a rack, so no
    one count serves; on 256 GPUs (64-GPU rack segments) every group sits in one. Expert TP 3 x EP 4 on DGX nodes of
    8: groups of 8 + 4. The search leaves such groups out (EP 16, 32, 64 on the 288 GPUs; EP 8 divides 72)."""
    from planner.candidates import Pins, SearchSpace, shapes
    from planner.specs import hybridep_domain_problem

    model = DSV3.model_copy(update={"num_layers": 60, "first_k_dense": 2})
    problems = plan_problems(model, GB200, _training(gpus=288), Plan(tp=1, pp=2, dp=144, ep=32, micro_batch_size=1))
    assert any(p.startswith("moe_token_dispatcher: HybridEP needs every expert group of 32 ranks") and
               "they have 8, 16, 24, 32" in p for p in problems), problems
    assert not [p for p in plan_problems(model, GB200, _training(gpus=256),
                                         Plan(tp=1, pp=2, dp=128, ep=32, micro_batch_size=1)) if "HybridEP" in p]
    mixtral = load_model("mixtral-8x7b")
    dgx = TrainingSpec(num_gpus=96, global_batch_size=96, seq_len=4096, moe_token_dispatcher="hybridep")
    assert "they have 4, 8" in hybridep_domain_problem(mixtral, dgx, 4, 3, H100)
    assert hybridep_domain_problem(mixtral, dgx, 8, 1, H100) is None
    assert hybridep_domain_problem(mixtral, dgx.model_copy(update={"moe_token_dispatcher": "deepep"}), 4, 3, H100) is None
    eps = {ep for *_, ep, _ in shapes(model, GB200, _training(gpus=288), SearchSpace(pins=Pins(tp=1, pp=2)))}
    assert 8 in eps and not eps & {16, 32, 64}, eps
