"""Megatron-Core's Muon optimizer (``--optimizer muon`` / ``dist_muon``, planner/muon.py): its states by hand, the
layer-wise dealing of dist_muon, the Newton-Schulz FLOPs, Megatron's rules, the search tables, emit and check.

Hand figures: Llama-3-8B (h 4,096, 32 heads, 8 KV heads of 128, SwiGLU FFN 14,336, vocabulary 128,256) at tp 2 x
pp 2 on 64 H100s (dp 16), stage 0: 16 layers; per layer on one TP rank the fused QKV (2,048 + 2 x 512) x 4,096, the
output projection 4,096 x 2,048, FC1 (2 x 14,336 / 2) x 4,096, FC2 4,096 x 7,168 (Muon: 2-D, not the embedding),
two RMSNorm weights of 4,096 (Adam), and the embedding's rows 128,256 / 2 x 4,096 (Adam).
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.memory import stage_memory
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec, job_problems, plan_problems
from tests.test_emit_consumers import megatron  # noqa: F401 (the session fixture)

H100 = load_hardware("h100-sxm-80gb")
LLAMA8B = load_model("llama3-8b")
PLAN = Plan(tp=2, pp=2, dp=16, micro_batch_size=1, zero_stage=0)
MUON_PER_LAYER = 4096 * (3072 + 2048 + 14336 + 7168)  # QKV, projection, FC1, FC2 on one TP rank
EMBEDDING_ROWS = 128256 // 2 * 4096
NORMS_PER_LAYER = 2 * 4096


def _training(optimizer: str, **kw) -> TrainingSpec:
    return TrainingSpec(num_gpus=64, global_batch_size=512, seq_len=8192, optimizer=optimizer, **kw)


def test_muon_states_by_hand():
    """Muon: fp32 master + fp32 momentum (8 B) per Muon weight, Adam's 12 B per other parameter, on every rank."""
    st = stage_memory(LLAMA8B, _training("muon"), PLAN, 16, 0, 16, H100)
    expected = 8 * 16 * MUON_PER_LAYER + 12 * (EMBEDDING_ROWS + 16 * NORMS_PER_LAYER)
    assert st.optimizer_bytes == expected  # 17,112,236,032 B = 15.94 GiB (Adam: 12 B on all, 22.44 GiB)


def test_dist_muon_deals_whole_parameters_by_size():
    """dist_muon (LayerWiseDistributedOptimizer.shard_params): sorted by numel, dealt 0..15, 15..0 over dp 16. The 32
    norm weights take one round trip (two each), then the projections (forward), QKV (back), FC2 (forward), FC1 (back):
    one of each per rank; the embedding, last, lands on rank 0 (position 96 = 3 x 32): that rank holds the most."""
    st = stage_memory(LLAMA8B, _training("dist_muon"), PLAN, 16, 0, 16, H100)
    rank0 = 12 * 2 * 4096 + 8 * MUON_PER_LAYER + 12 * EMBEDDING_ROWS
    assert st.optimizer_bytes == rank0  # 4,024,532,992 B = 3.75 GiB
    adam = stage_memory(LLAMA8B, _training("adam"), PLAN.model_copy(update={"zero_stage": 1}), 16, 0, 16, H100)
    assert st.optimizer_bytes > adam.optimizer_bytes  # whole parameters: the embedding on one rank


def test_dealing_matches_megatrons_loop():
    """planner.muon.dealt_max against a direct transcription of shard_params' ping-pong loop."""
    from planner.muon import dealt_max

    rng = np.random.default_rng(0)
    for ranks in (1, 2, 3, 8):
        numel = rng.integers(1, 50, size=40).astype(float)
        loop = list(range(ranks)) + list(range(ranks))[::-1]
        totals, idx = [0.0] * ranks, 0
        for n in sorted(numel):  # Python's sort is stable, as the list sort in shard_params
            totals[loop[idx]] += n
            idx = (idx + 1) % len(loop)
        assert dealt_max(numel, numel, ranks) == max(totals)


def test_newton_schulz_flops_of_a_layer():
    """Five steps of A = X X^T, B = bA + cAA, X = aX + BX on each m x n (m <= n) Muon weight, QKV as Q, K and V:
    counted with a GEMM 'time' of 2 m k n FLOPs."""
    from planner.muon import ns_step_s

    def ns(m, n):
        return 5 * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)

    layer = ns(2048, 4096) + 2 * ns(512, 4096) + ns(2048, 4096) + ns(4096, 14336) + ns(4096, 7168)
    got = ns_step_s(LLAMA8B, PLAN, 1, 16, "muon", 16, 16, lambda m, k, n: 2.0 * m * k * n)
    assert got == 16 * layer


def test_muon_update_bytes_per_muon_weight():
    """A Muon weight's step moves 62 B per parameter outside the Newton-Schulz GEMMs (planner.muon.MUON_UPDATE_BYTES:
    4 + 8 + 12 + 16 + 12 + 6 + 4, each op of Emerging-Optimizers' step counted), Adam's parameters 42 B. Stage 1 of
    Llama-3-8B at TP 2 (16 layers, the output layer's rows Adam's): the two differ by 20 B per Muon weight, each layer's
    being Q, K, V, O and the three MLP weights: 4096 x (4096 + 2 x 1024) + 4096 x 4096 + 3 x 4096 x 14336, over TP 2."""
    from planner.muon import MUON_UPDATE_BYTES, owned_params, update_bytes

    assert MUON_UPDATE_BYTES == 62
    muon_weights = 16 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) / 2
    owned = owned_params(LLAMA8B, PLAN, 1, 16, "muon", 16, 16)
    assert update_bytes(LLAMA8B, PLAN, 1, 16, "muon", 16, 16, 42) == pytest.approx(42 * owned + 20 * muon_weights)


def test_muon_step_and_exposed_gradient_reduce():
    """Muon adds its Newton-Schulz step; Megatron runs it without gradient-reduce overlap, so the all-reduce is
    exposed; dist_muon steps a sixteenth and all-gathers the updated weights."""
    from planner.cost import estimate_time

    adam, muon, dist = (estimate_time(LLAMA8B, H100, _training(o), PLAN) for o in ("adam", "muon", "dist_muon"))
    assert muon.breakdown["optimizer"] > 5 * adam.breakdown["optimizer"]
    assert dist.breakdown["optimizer"] < muon.breakdown["optimizer"] / 8
    assert muon.breakdown["dp_comm_exposed"] > 4 * adam.breakdown["dp_comm_exposed"]
    assert dist.breakdown["dp_comm_exposed"] > muon.breakdown["dp_comm_exposed"]


def test_megatrons_rules():
    """validate_args: no distributed optimizer or Megatron-FSDP (ZeRO 0); muon.py: no precision-aware optimizer;
    frameworks other than Megatron-Core's are refused."""
    assert any(e.startswith("zero_stage: Megatron runs dist_muon") for e in
               plan_problems(LLAMA8B, H100, _training("dist_muon"), PLAN.model_copy(update={"zero_stage": 1})))
    assert not plan_problems(LLAMA8B, H100, _training("dist_muon"), PLAN)
    assert any(e.startswith("optimizer: muon") for e in job_problems(LLAMA8B, H100, _training("muon",
                                                                                               framework="torchtitan")))
    assert any("optimizer_dtype fp32" in e for e in job_problems(LLAMA8B, H100, _training("muon", optimizer_dtype="bf16")))


def test_search_tables_are_the_estimate_with_dist_muon():
    """The search's tables hold Muon's states and step where estimate_time and stage_memory do (a MoE model: the
    experts dealt over the expert-data-parallel group), and only ZeRO 0 is legal."""
    from planner.candidates import SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("tiny-moe")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=512, optimizer="dist_muon")
    tables = build_tables(model, H100, tr, SearchSpace(max_micro_batch_size=2))
    keys = legal_keys(tables)
    checked = [assert_entry_is_estimate(model, H100, tr, tables, k) for k in keys[:: max(1, len(keys) // 25)]]
    assert checked and {p.zero_stage for p in checked} == {0} and any(p.ep > 1 for p in checked)


@pytest.mark.parametrize("optimizer", ["muon", "dist_muon"])
def test_emit_passes_megatron_and_check_reads_it_back(megatron, monkeypatch, tmp_path, optimizer):  # noqa: F811
    """The emitted launch names the optimizer and leaves out the overlap flags Megatron refuses with it; Megatron-LM
    core_v0.16.1's parse_args + validate_args take it; `plan3d check` reads it back to the same states."""
    from planner.check import check_file_branches
    from planner.memory import estimate_scenario_memory
    from tests.test_emit_consumers import megatron_validate
    from tests.test_emit_moe import _args_file_argv
    from planner.specs import Scenario

    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, optimizer=optimizer)
    sc = Scenario(model=LLAMA8B, hardware=H100, training=tr,
                  plan=Plan(tp=2, pp=2, dp=4, micro_batch_size=1, zero_stage=0, sequence_parallel=True))
    argv = _args_file_argv(sc, tmp_path)
    assert f"--optimizer {optimizer}" in " ".join(argv) and "--overlap-grad-reduce" not in argv
    args, _, _ = megatron_validate(megatron, monkeypatch, argv, "1")
    assert args.optimizer == optimizer and not args.use_distributed_optimizer and not args.overlap_grad_reduce
    (path,) = list((tmp_path / "args").iterdir())
    (r,) = check_file_branches(path, None, None, None)
    assert r.scenario.training.optimizer == optimizer
    mine = estimate_scenario_memory(sc)
    back = estimate_scenario_memory(r.scenario)
    assert [s.optimizer_bytes for s in back.stages] == [s.optimizer_bytes for s in mine.stages]


def test_validate_refuses_muon_plans():
    """The validate miniature steps torch's AdamW: a Muon plan is refused with the reason, not measured as Adam."""
    from planner.specs import Scenario
    from planner.validate.launch import refusal

    sc = Scenario(model=load_model("tiny-gpt"), hardware=H100,
                  training=TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=256, optimizer="dist_muon"),
                  plan=Plan(tp=2, pp=1, dp=4, micro_batch_size=1, zero_stage=0))
    assert "optimizer dist_muon" in refusal(sc)
    assert refusal(sc.model_copy(update={"training": sc.training.model_copy(update={"optimizer": "adam"})})) is None


@pytest.mark.parametrize("fmt", ["torchtitan", "deepspeed"])
def test_other_formats_refuse_a_muon_job(fmt):
    """torchtitan's and DeepSpeed's files as plan3d writes them train with AdamW: a Muon job is refused there, not
    written as an AdamW run the estimate did not cost."""
    from planner.emit import job_problems

    (line,) = job_problems(LLAMA8B, _training("dist_muon"), [fmt])
    assert line.startswith(f"--format {fmt}: {fmt} as plan3d emits it trains with AdamW")
    assert not job_problems(LLAMA8B, _training("dist_muon"), ["megatron"])


def test_search_does_not_offer_fp8_weights_to_muon():
    """--fp8-param-gather needs the distributed optimizer, which Megatron runs Muon without: the search must not
    offer fp8 weights to a Muon job (a job it would then refuse whole: 'no legal plan'), and with fp8 it finds one."""
    from planner.candidates import SearchSpace, fp8_params_options, switch_options
    from planner.search import search

    tr = TrainingSpec(num_gpus=64, global_batch_size=256, seq_len=4096, precision="fp8", optimizer="dist_muon")
    assert fp8_params_options(tr, None) is None
    assert fp8_params_options(tr.model_copy(update={"optimizer": "adam"}), None) == (False, True)
    best = search(LLAMA8B, H100, tr, SearchSpace(**switch_options(tr))).best
    assert best is not None and best.zero_stage == 0


@pytest.mark.parametrize("name", ["llama3-8b", "gpt3-175b", "mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b",
                                  "gpt-oss-20b", "kimi-k2", "tiny-moe", "bloom-176b", "llama4-scout-17b-16e"])
def test_stage_tensors_add_up_to_the_stage_count(name):
    """planner.muon.stage_tensors splits exactly memory.stage_param_split's parameters (dense and expert) of every
    stage: its Muon weights never exceed them (the 1-D rest is what remains, never clamped)."""
    from planner.memory import stage_param_split
    from planner.muon import stage_tensors

    model = load_model(name)
    ep = min(model.num_experts, 8) if model.is_moe else 1
    for tp in (1, 2, 4):
        if model.num_attention_heads % tp or model.kv_heads % tp and tp % model.kv_heads:
            continue
        plan = Plan(tp=tp, pp=4, dp=8 * ep // tp if model.is_moe else 8, micro_batch_size=1, ep=ep,
                    etp=1 if model.is_moe else None)
        for stage, layers in enumerate(plan.stage_layers(model.num_layers)):
            rows = stage_tensors(model, plan, stage, layers)
            dense, expert = stage_param_split(model, plan, stage, layers)
            got = [sum(n * k for n, k, _, e, _ in rows if e == want) for want in (False, True)]
            assert got == pytest.approx([dense, expert], rel=1e-12), (name, tp, stage)
            adam_big = [n for n, k, muon, e, _ in rows if not muon and not e and n > model.hidden_size]
            assert len(adam_big) <= 3  # the embedding's rows, a position table, the output layer's rows
            # the rest is 1-D (norms, biases, sinks, router biases): no 2-D weight left out of the Muon list
            small = sum(n * k for n, k, muon, _, _ in rows if not muon and n <= model.hidden_size)
            assert small <= (layers + 2) * (16 * model.hidden_size + (model.num_experts or 0)), (name, tp, stage, small)
