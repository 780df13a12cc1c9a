"""Megatron-Core's allgather token dispatcher (its default ``--moe-token-dispatcher-type``): the gathered hidden states
in Megatron's global memory buffer, the saved routing terms over the gathered tokens, and the dispatch/combine as an
all-gather and a reduce-scatter over the etp x ep group. Expected values are hand-computed from Megatron-Core
core_v0.16.1's shapes (``moe/token_dispatcher.py::MoEAllGatherTokenDispatcher``) and the H100 profile's figures
(NVLink ring: busbw 370 GB/s, 1.5 us per step, ``(n - 1) / n`` of the buffer; nccl-tests' PERFORMANCE.md), not
from the code under test."""

import pytest

from planner.cost import moe_layer_extra
from planner.layout import GroupSpan, expert_span
from planner.memory import (estimate_memory, moe_activation_terms, moe_allgather_buffer_bytes, stage_memory)
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec, job_problems, plan_problems

H100 = load_hardware("h100-sxm-80gb")
MIXTRAL = load_model("mixtral-8x7b")  # h 4096, 8 experts, top-2, fp32 router (plan3d's default router_dtype)
DSV3 = load_model("deepseek-v3")
NVL, NVL_A = 370e9, 1.5e-6


def _tr(dispatcher: str = "allgather", **kw) -> TrainingSpec:
    return TrainingSpec(**({"num_gpus": 8, "global_batch_size": 64, "seq_len": 4096,
                            "moe_token_dispatcher": dispatcher} | kw))


def test_the_gathered_hidden_states_stay_in_megatrons_global_buffer():
    # tp 2 with SP: a GPU routes 4096 / 2 = 2048 tokens; the etp 2 x ep 4 group gathers 8 x 2048 = 16,384 of them,
    # h 4096 in bf16: 16384 * 4096 * 2 B = 128 MiB, twice that at micro-batch 2; nothing without the allgather
    plan = Plan(tp=2, pp=1, dp=4, ep=4, etp=2, micro_batch_size=1, sequence_parallel=True)
    assert moe_allgather_buffer_bytes(MIXTRAL, _tr(), plan) == 16384 * 4096 * 2 == 128 * 2**20
    two = plan.model_copy(update={"micro_batch_size": 2})
    assert moe_allgather_buffer_bytes(MIXTRAL, _tr(), two) == 256 * 2**20
    assert moe_allgather_buffer_bytes(MIXTRAL, _tr("alltoall"), plan) == 0.0
    dense = load_model("llama3-8b")
    assert moe_allgather_buffer_bytes(dense, _tr(), Plan(tp=1, pp=1, dp=8, micro_batch_size=1)) == 0.0


def test_the_buffer_is_held_where_a_stage_has_moe_layers_only():
    # DeepSeek-V3's first three layers are dense: a stage of those three holds no dispatcher buffer, the other does
    tr = TrainingSpec(num_gpus=1024, global_batch_size=1024, seq_len=4096, moe_token_dispatcher="allgather")
    plan = Plan(tp=1, pp=2, dp=512, ep=8, micro_batch_size=1, layers_per_stage=(3, 58))
    buffer = moe_allgather_buffer_bytes(DSV3, tr, plan)
    assert buffer == 4096 * 8 * 7168 * 2  # tp 1: all 4096 tokens routed, gathered over 8 ranks
    a2a = tr.model_copy(update={"moe_token_dispatcher": "alltoall"})
    m = 1024 // 512
    got = [stage_memory(DSV3, tr, plan, m, r, n, H100) for r, n in enumerate((3, 58))]
    ref = [stage_memory(DSV3, a2a, plan, m, r, n, H100) for r, n in enumerate((3, 58))]
    assert got[0].other_bytes == ref[0].other_bytes
    assert got[1].other_bytes == pytest.approx(ref[1].other_bytes + buffer)


def test_its_routing_terms_cover_the_gathered_tokens():
    # dispatch_postprocess keeps the local routing map and transposed probabilities over the gathered tokens,
    # [T etp ep, E / ep] = etp times the all-to-all's [T, E], and one int64 index per local row (T k etp)
    plan = Plan(tp=2, pp=1, dp=4, ep=4, etp=2, micro_batch_size=1, sequence_parallel=True)
    t, k, e = 2048, 2, 8

    def by_name(tr):
        return {a.name: a.bytes for a in moe_activation_terms(MIXTRAL, tr, plan)}
    ag, a2a = by_name(_tr()), by_name(_tr("alltoall"))
    assert a2a["permutation routing map (bool)"] == t * e
    assert ag["permutation routing map (bool)"] == t * 2 * e
    assert ag["router probabilities, transposed (permute's masked_select saves them)"] == t * 2 * e * 4
    assert a2a["permutation sorted indices (int64)"] == t * k * 8
    assert ag["permutation sorted indices (int64)"] == t * k * 2 * 8
    same = set(ag) - {"permutation routing map (bool)", "router probabilities, transposed (permute's masked_select "
                      "saves them)", "permutation sorted indices (int64)"}
    assert all(ag[n] == a2a[n] for n in same)


def test_dispatch_and_combine_are_a_gather_and_a_reduce_scatter_of_every_token():
    # tp 1, ep 8 on one node: each GPU routes its 4096 tokens; the group of 8 gathers 32,768 tokens of
    # h 4096 bf16 plus the fp32 probabilities and bool map over 8 experts (5 B each), and reduce-scatters
    # 32,768 x 4096 in the probabilities' fp32; a ring over 8: 7 steps, 7/8 of the buffer; backward the same sizes
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    assert expert_span(plan, "etp_ep", 8) == GroupSpan(size=8, nodes=1, per_node=8)
    gathered = 32768
    ag_bytes = gathered * (4096 * 2 + 8 * 5)
    rs_bytes = gathered * 4096 * 4
    ring = 7 * NVL_A
    want = ring + 7 / 8 * ag_bytes / NVL + ring + 7 / 8 * rs_bytes / NVL
    x = moe_layer_extra(MIXTRAL, H100, _tr(), plan, 4096)
    assert x.comm_fwd == pytest.approx(want) and x.comm_bwd == pytest.approx(want)
    # the all-to-all sends only the k = 2 copies: 4096 x 2 x 4096 x 2 B, 7/8 of it, one alpha, each way
    y = moe_layer_extra(MIXTRAL, H100, _tr("alltoall"), plan, 4096)
    a2a = NVL_A + 7 / 8 * 4096 * 2 * 4096 * 2 / NVL
    assert y.comm_fwd == pytest.approx(2 * a2a)
    assert x.comm_fwd > 3 * y.comm_fwd  # gathering all 8 ranks' tokens costs more than sending 2 copies


def test_a_bf16_router_reduce_scatters_in_bf16():
    # Megatron without --moe-router-dtype: the probabilities in the input's bf16 (router.py), 3 B per expert gathered
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    bf16 = MIXTRAL.model_copy(update={"router_dtype": "bf16"})
    gathered = 32768
    ag_bytes = gathered * (4096 * 2 + 8 * 3)
    rs_bytes = gathered * 4096 * 2
    want = 2 * 7 * NVL_A + 7 / 8 * (ag_bytes + rs_bytes) / NVL
    assert moe_layer_extra(bf16, H100, _tr(), plan, 4096).comm_fwd == pytest.approx(want)


def test_jobs_megatron_refuses_or_does_not_run():
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    errs = plan_problems(MIXTRAL, H100, _tr(moe_a2a_overlap=True), plan)
    assert sum("alltoall or flex dispatcher" in e for e in errs) == 1, errs  # said once
    # a contradiction of the job's own switches: refused before any search (not "no legal plan")
    assert any("alltoall or flex dispatcher" in e for e in job_problems(MIXTRAL, H100, _tr(moe_a2a_overlap=True)))
    errs = plan_problems(MIXTRAL, H100, _tr(framework="torchtitan"), plan.model_copy(update={"zero_stage": 3}))
    assert any("allgather is Megatron-Core's MoEAllGatherTokenDispatcher" in e for e in errs), errs
    assert not plan_problems(MIXTRAL, H100, _tr(), plan)


def test_search_tables_hold_the_buffer_as_the_estimate_does():
    """The search's tables add the buffer, linear in the micro-batch, where stage_memory does
    (tests/table_checks.py)."""
    from planner.candidates import SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("tiny-moe")
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=512, moe_token_dispatcher="allgather")
    tables = build_tables(model, H100, tr, SearchSpace(max_micro_batch_size=2))
    keys = legal_keys(tables)
    assert keys
    checked = [assert_entry_is_estimate(model, H100, tr, tables, k) for k in keys[:: max(1, len(keys) // 25)]]
    assert any(p.pp > 1 for p in checked) and any(p.micro_batch_size == 2 for p in checked)
    assert all(moe_allgather_buffer_bytes(model, tr, p) > 0 for p in checked)
    peak = estimate_memory(model, H100, tr, checked[0]).peak.total_bytes
    a2a = estimate_memory(model, H100, tr.model_copy(update={"moe_token_dispatcher": "alltoall"}), checked[0])
    assert peak > a2a.peak.total_bytes


def test_without_grouped_gemm_the_experts_run_one_after_another():
    """Megatron-Core's SequentialMLP (no --moe-grouped-gemm; TransformerConfig.moe_grouped_gemm = False in core_v0.16.1)
    runs each local expert's GEMMs in turn on one stream, where TE's GroupedLinear runs them 4 at a time side by side
    (grouped_gemm_time_s), and keeps no multi-stream workspaces."""
    from planner.frameworks import expert_gemm_streams

    tr = _tr("alltoall")
    seq = tr.model_copy(update={"moe_grouped_gemm": False})
    assert expert_gemm_streams(tr) == (4, 4) and expert_gemm_streams(seq) == (1, 0)
    assert expert_gemm_streams(tr.model_copy(update={"framework": "torchtitan"})) == (0, 0)
    assert expert_gemm_streams(seq.model_copy(update={"framework": "torchtitan"})) == (0, 0)
    # 8 local experts (ep 1) of 1,024 rows each: FC1 [1024 x 4096] x [4096 x 28672] is 896 tiles of 256 x 128, 7 waves
    # on 132 SMs alone or 28 for four side by side (4 x 896 / 132); FC2 [1024 x 14336] x [14336 x 4096] 128 tiles, one
    # wave alone or 4 for four. So the waves are the same either way and SequentialMLP pays only its 8 kernels'
    # fixed cost per matrix against GroupedLinear's 2 rounds: (8 - 2) x 2 matrices x 5 us (kernel_overhead_us) forward
    plan = Plan(tp=1, pp=1, dp=8, ep=1, micro_batch_size=1)
    a, b = moe_layer_extra(MIXTRAL, H100, tr, plan, 4096), moe_layer_extra(MIXTRAL, H100, seq, plan, 4096)
    assert b.fwd_compute - a.fwd_compute == pytest.approx((8 - 2) * 2 * 5e-6, rel=1e-6)


def test_check_reads_the_grouped_gemm_flag(tmp_path):
    from planner.check import check_file

    base = ("# plan3d: num_gpus=8\n--num-layers 4 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 "
            "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 --bf16 --tokenizer-type "
            "NullTokenizer --vocab-size 511 --position-embedding-type rope --swiglu --normalization RMSNorm "
            "--disable-bias-linear --num-experts 8 --expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall")
    got = []
    for extra in ("", " --moe-grouped-gemm"):
        path = tmp_path / f"moe{len(got)}.megatron.args"
        path.write_text(base + extra + "\n")
        result = check_file(path, H100, None, None)
        assert not result.errors, result.errors
        got.append(result.scenario.training.moe_grouped_gemm)
    assert got == [False, True]
