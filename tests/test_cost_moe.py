"""MoE and MLA step time: the all-to-all, the expert-grid placement, grouped expert GEMMs, stages as dense +
MoE layers, expert gradients over the expert-data-parallel group. Expected values are hand-computed from
the hardware profile's figures (cited in hardware_profiles/h100-sxm-80gb.yaml), not from the code."""

import math

import numpy as np
import pytest

from planner import comm, cost, flops
from planner.cost import estimate_time, layer_time, micro_factors, moe_layer_extra, stage_terms
from planner.layout import GroupSpan, expert_span
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec

H100 = load_hardware("h100-sxm-80gb")
MIXTRAL = load_model("mixtral-8x7b")
DSV3 = load_model("deepseek-v3")
TINY = load_model("tiny-moe")
# H100 profile: NVLink busbw 370 GB/s, 1.5 us; IB 46 GB/s per GPU, 5 us
NVL, NVL_A, IB, IB_A = 370e9, 1.5e-6, 46e9, 5e-6


def test_all_to_all_inside_one_nvlink_domain():
    # nccl-tests AlltoAll: (n-1)/n of the buffer leaves each rank; one alpha (grouped send/recv)
    s = 1e9
    assert comm.all_to_all_time_s(s, GroupSpan(size=8, nodes=1, per_node=8), H100) == pytest.approx(
        NVL_A + 7 / 8 * s / NVL)
    assert comm.collective_time_s("all_to_all", s, GroupSpan(size=8, nodes=1, per_node=8), H100) == \
        comm.all_to_all_time_s(s, GroupSpan(size=8, nodes=1, per_node=8), H100)


def test_all_to_all_across_nodes_is_paced_by_the_nic():
    # 64 ranks, 8 per node: 56/64 of the buffer over the NIC, 7/64 over NVLink at the same time
    s = 1e9
    got = comm.all_to_all_time_s(s, GroupSpan(size=64, nodes=8, per_node=8), H100)
    assert got == pytest.approx(IB_A + 56 / 64 * s / IB)
    assert comm.all_to_all_time_s(s, GroupSpan(size=1, nodes=1, per_node=1), H100) == 0.0


def test_expert_grid_places_ep_groups_after_etp():
    # Megatron expert grid ETP x EP x EDP x PP, fastest first: EP stride etp, EDP stride etp*ep
    plan = Plan(tp=2, pp=8, dp=64, ep=64, etp=1, micro_batch_size=1, sequence_parallel=True)
    assert expert_span(plan, "ep", 8) == GroupSpan(size=64, nodes=8, per_node=8)  # ranks 0..63
    plan2 = plan.model_copy(update={"etp": 2})
    assert expert_span(plan2, "ep", 8) == GroupSpan(size=64, nodes=16, per_node=4)  # ranks 0, 2, ..., 126
    assert expert_span(plan2, "etp", 8) == GroupSpan(size=2, nodes=1, per_node=2)
    assert expert_span(plan, "edp", 8) == GroupSpan(size=2, nodes=2, per_node=1)  # tp*dp/(etp*ep) = 2


def _tr(**kw):
    return TrainingSpec(num_gpus=kw.pop("num_gpus", 8), global_batch_size=kw.pop("global_batch_size", 64),
                        seq_len=kw.pop("seq_len", 4096), **kw)


def test_expert_gemms_run_the_activated_flops_at_the_gemm_rate():
    # Mixtral on one GPU, 8k tokens: 2 of 8 experts per token, f = 14336, SwiGLU (3 matrices);
    # large per-expert GEMMs (m = 8192 * 2 / 8 = 2048) run near the H100's sustained MAMF rate
    tr = _tr(num_gpus=1, global_batch_size=2, seq_len=4096)
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=2)
    x = moe_layer_extra(MIXTRAL, H100, tr, plan, tokens=8192)
    expert_fwd_flops = 2 * 8192 * 2 * 3 * 4096 * 14336
    rate = 989.4e12 * 0.801 * H100.sustained_fraction  # peak x MAMF (stas00 table) x sustained (profile)
    assert x.fwd_compute == pytest.approx(expert_fwd_flops / rate, rel=0.08)
    assert x.bwd_compute == pytest.approx(2 * expert_fwd_flops / rate, rel=0.08)
    assert x.comm_fwd == x.comm_bwd == 0.0  # ep = etp = 1: no dispatch


def test_expert_parallel_keeps_the_flops_per_rank_and_adds_the_all_to_all():
    tr = _tr()
    one = Plan(tp=1, pp=1, dp=8, micro_batch_size=1)
    eight = one.model_copy(update={"ep": 8})
    a, b = moe_layer_extra(MIXTRAL, H100, tr, one, 4096), moe_layer_extra(MIXTRAL, H100, tr, eight, 4096)
    # one expert per rank at 4x the tokens (m = 4096*2*8/8) against 8 experts at m = 1024: same FLOPs
    assert b.fwd_compute == pytest.approx(a.fwd_compute, rel=0.05)
    # dispatch + combine: each rank sends its 4096 x 2 copies of h = 4096 bf16 values over 8 NVLink ranks
    s = 4096 * 2 * 4096 * 2
    assert b.comm_fwd == pytest.approx(2 * (NVL_A + 7 / 8 * s / NVL))
    assert b.comm_bwd == b.comm_fwd


def test_fine_grained_experts_run_less_efficiently():
    # DeepSeek-V3: 256 experts of f = 2048; at 4096 tokens, ep = 8 leaves m = 4096*8*8/256 = 1024 rows
    # per expert, ep = 1 only 128: wave quantisation and weight traffic cost more per FLOP
    tr = _tr(seq_len=4096)
    small = moe_layer_extra(DSV3, H100, tr, Plan(tp=1, pp=1, dp=8, micro_batch_size=1), 4096)
    big = moe_layer_extra(DSV3, H100, tr, Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1), 4096)
    assert small.fwd_compute > 1.1 * big.fwd_compute


def test_load_imbalance_scales_expert_compute_and_dispatch():
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    a = moe_layer_extra(MIXTRAL, H100, _tr(), plan, 4096)
    b = moe_layer_extra(MIXTRAL, H100, _tr(moe_load_imbalance=1.5), plan, 4096)
    assert b.comm_fwd == pytest.approx(1.5 * a.comm_fwd, rel=0.01)  # bandwidth-bound, alpha is small
    assert 1.3 * a.fwd_compute < b.fwd_compute < 1.55 * a.fwd_compute


def test_a_capacity_factor_pads_every_expert_to_its_capacity():
    """plan3d emits a capacity factor with --moe-pad-expert-input-to-capacity, so each expert computes and receives
    exactly its capacity, cf times the balanced rows, whatever the imbalance (memory.moe_row_scale, the rows the memory
    estimate holds too); an imbalance past every copy the group can send a rank stops there (Mixtral, ep 8, top-2:
    8 x min(2, 1) / 2 = 4 times the balanced rows)."""
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    padded = MIXTRAL.model_copy(update={"capacity_factor": 1.5})
    a = moe_layer_extra(MIXTRAL, H100, _tr(), plan, 4096)
    b = moe_layer_extra(padded, H100, _tr(), plan, 4096)
    assert b.comm_fwd == pytest.approx(1.5 * a.comm_fwd, rel=0.01)
    assert moe_layer_extra(padded, H100, _tr(moe_load_imbalance=3.0), plan, 4096) == b
    capped = moe_layer_extra(MIXTRAL, H100, _tr(moe_load_imbalance=50.0), plan, 4096)
    assert capped == moe_layer_extra(MIXTRAL, H100, _tr(moe_load_imbalance=4.0), plan, 4096)
    assert capped.comm_fwd == pytest.approx(4 * a.comm_fwd, rel=0.01)


def test_deepep_sends_a_token_once_per_destination_node():
    # EP 64 over 16 nodes (etp 2 stride): alltoall sends k = 8 copies, DeepEP one per remote node:
    # 16 * (1 - (15/16)^8) * 15/16 = 6.03 of them
    tr = _tr(num_gpus=1024, global_batch_size=1024)
    plan = Plan(tp=2, pp=8, dp=64, ep=64, etp=2, micro_batch_size=1, sequence_parallel=True)
    grp = expert_span(plan, "ep", 8)
    assert grp == GroupSpan(size=64, nodes=16, per_node=4)
    tok = 2048 * 7168 * 2
    remote = 16 * (1 - (15 / 16) ** 8) * 15 / 16
    assert cost.deepep_time_s(tok, 8, grp, H100) == pytest.approx(IB_A + remote * tok / IB)
    a2a = comm.all_to_all_time_s(8 * tok, grp, H100)
    assert a2a == pytest.approx(IB_A + 60 / 64 * 8 * tok / IB)
    x = moe_layer_extra(DSV3, H100, tr.model_copy(update={"moe_token_dispatcher": "deepep"}), plan, 4096)
    y = moe_layer_extra(DSV3, H100, tr, plan, 4096)
    assert x.comm_fwd < y.comm_fwd


@pytest.mark.parametrize("parts, groups, group_topk, want", [
    (8, None, None, 8 * (1 - (7 / 8) ** 8)),        # 8 experts over 8 ranks: 5.25 distinct ranks
    (1, None, None, 1.0),
    (8, 8, 4, 4.0),                                  # one group per rank, 4 groups picked: exactly 4 ranks
    (4, 8, 4, 4 * (1 - 15 / 70)),                    # 2 groups per node: 1 - C(6,4)/C(8,4) of the nodes hit
    (16, 8, 4, 8 * (1 - (7 / 8) ** 8)),              # groups span 2 ranks: the 8 ranks of the 4 groups
    (8, 8, 8, 8 * (1 - (7 / 8) ** 8)),               # every group allowed: no tighter than without groups
    (6, 8, 4, 6 * (1 - (5 / 6) ** 8)),               # blocks that neither split nor join groups: no limit taken
])
def test_distinct_destinations_of_a_token(parts, groups, group_topk, want):
    """A token goes once to each rank (DeepEP's ``is_token_in_rank``) or node that holds one of its top-8 experts;
    group-limited routing (Megatron ``group_limited_topk``) bounds them (hand-computed values)."""
    assert cost.expected_destinations(parts, 8, groups, group_topk) == pytest.approx(want)


#: Megatron-Core MoE report (arXiv:2603.07685 v2) Table 7: HybridEP dispatch latency, hidden 7168, 4,096 tokens,
#: 256 experts (top 8), microseconds: (profile, EP, nodes, measured)
HYBRIDEP_TABLE7 = [("h100-sxm-80gb", 8, 1, 661), ("h100-sxm-80gb", 16, 2, 1485), ("h100-sxm-80gb", 32, 4, 3064),
                   ("h100-sxm-80gb", 64, 8, 4626), ("gb200-nvl72", 8, 1, 391), ("gb200-nvl72", 16, 1, 578),
                   ("gb200-nvl72", 32, 1, 612), ("gb200-nvl72", 64, 1, 675)]


@pytest.mark.parametrize("profile, ep, nodes, measured_us", HYBRIDEP_TABLE7)
def test_deepep_dispatch_against_nvidias_measured_hybridep(profile, ep, nodes, measured_us):
    """The DeepEP-style dispatch time against NVIDIA's measured HybridEP (Table 7 above), the routing taken as uniform
    (the table does not state it), within 30 %. Counting one copy per expert instead of one per destination rank was
    68 % slow at H100 EP8 (1.11 ms)."""
    hw = load_hardware(profile)
    group = GroupSpan(size=ep, nodes=nodes, per_node=ep // nodes)
    predicted_us = cost.deepep_time_s(4096 * 7168 * 2, 8, group, hw) * 1e6
    assert predicted_us == pytest.approx(measured_us, rel=0.30), predicted_us


def test_node_limited_routing_sends_fewer_copies_across_nodes():
    """DeepSeek-V3's node-limited routing (8 groups, 4 per token; ModelSpec.router_num_groups / router_group_topk):
    at EP 64 over 8 nodes a token reaches 4 nodes, 3.5 of them remote, where uniform routing reaches 5.25 (4.59
    remote)."""
    group = GroupSpan(size=64, nodes=8, per_node=8)
    tok = 4096 * 7168 * 2
    limited = cost.deepep_time_s(tok, 8, group, H100, DSV3)
    free = cost.deepep_time_s(tok, 8, group, H100, DSV3.model_copy(update={"router_num_groups": None,
                                                                           "router_group_topk": None}))
    assert limited == pytest.approx(IB_A + 3.5 * tok / IB)
    assert free == pytest.approx(IB_A + 8 * (1 - (7 / 8) ** 8) * 7 / 8 * tok / IB)


def test_a2a_overlap_hides_the_dispatch_under_compute():
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    off = moe_layer_extra(MIXTRAL, H100, _tr(), plan, 4096)
    on = moe_layer_extra(MIXTRAL, H100, _tr(moe_a2a_overlap=True), plan, 4096)
    total = off.comm_fwd + off.comm_bwd
    assert total < off.fwd_compute + off.bwd_compute  # all of it fits under the compute here
    c = min(1.0, H100.nccl_channels / H100.sm_count)
    assert on.comm_fwd + on.comm_bwd == pytest.approx(c * total)  # merged with another micro-batch's compute
    assert on.comm_alone == pytest.approx((1 - c) * total)  # what a micro-batch run alone exposes beyond that
    assert off.comm_alone == 0.0


@pytest.mark.parametrize("pp, vpp, m, group, alone", [
    (1, 1, 8, None, 1 / 8),  # the first forward and the last backward alone, the other 7 steps merged
    (1, 1, 1, None, 1.0),    # nothing to merge with
    # v 2, N 2: rank 0 runs 2 x 1 + 1 x 2 + 1 = 5 warm-up chunk forwards of 8 alone, rank 1 0 + 2 + 1 = 3
    (2, 2, 4, 2, (5 + 3) / 2 / 8),
    # 2 micro-batches, v 2 on 4 ranks: every rank's warm-up (11, 9, 7, 5) covers all 4 chunk forwards
    (4, 2, 2, None, 1.0),
])
def test_a2a_overlap_merges_only_the_steady_steps(pp, vpp, m, group, alone):
    assert cost.a2a_alone_share(m, pp, vpp, group) == pytest.approx(alone)
    assert cost.a2a_alone_share(np.array([m, m]), pp, vpp, group) == pytest.approx([alone, alone])


def test_a2a_overlap_step_exposes_the_lone_micro_batches():
    """The step of a pp-1 plan under the overlap: each MoE layer's exposed EP time per micro-batch is the merged
    exposure plus 1/m of what a lone micro-batch exposes beyond it (m = 64 / 8 = 8), as the stage terms add it."""
    tr = _tr(moe_a2a_overlap=True)
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    lt = cost.layer_time(MIXTRAL, H100, tr, plan, moe=True)
    (st,) = cost.stage_times(MIXTRAL, H100, tr, plan)
    assert lt.ep_alone > 0
    assert st.ep_comm == pytest.approx(MIXTRAL.num_layers * (lt.ep + lt.ep_alone / 8))


def test_mla_linear_shapes_carry_the_attention_weights():
    # the five MLA projections on one rank hold exactly the GEMM weights flops.attention_gemm_params counts, which
    # adds the q and kv norms as Megatron-LM's num_floating_point_operations does (q_lora_rank + kv_lora_rank)
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1)
    shapes = cost._linear_shapes(DSV3, plan, moe=True)
    att = sum(k * n for name, (k, n, _) in shapes.items() if name not in ("fc1", "fc2"))
    assert att + DSV3.q_lora_rank + DSV3.kv_lora_rank == flops.attention_gemm_params(DSV3)
    # the shared expert is the MoE layer's only ordinary MLP: 2048 wide, gated
    assert shapes["fc1"][:2] == (7168, 2 * 2048) and shapes["fc2"][:2] == (2048, 7168)
    # one TP region opens at the q down-projection, one at the shared expert
    assert [kind for _, _, kind in shapes.values()].count("column") == 2
    assert "fc1" not in cost._linear_shapes(MIXTRAL, plan, moe=True)  # no shared expert: attention only


def test_a_stage_is_its_dense_layers_plus_its_moe_layers():
    tr = _tr(num_gpus=1, global_batch_size=1, seq_len=1024)
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1)
    f = micro_factors(TINY, H100, tr, plan)
    dense, moe = layer_time(TINY, H100, tr, plan), layer_time(TINY, H100, tr, plan, moe=True)
    assert f["fwd"] == dense.fwd_compute and f["moe_fwd"] == moe.fwd_compute
    t = stage_terms(np.array([4.0]), np.array([False]), f, 0.0, 1, 1, False, 0.0, n_moe=np.array([3.0]))
    assert t["compute"][0] == pytest.approx(dense.fwd_compute + dense.bwd_compute
                                               + 3 * (moe.fwd_compute + moe.bwd_compute))
    # tiny-moe's first layer is dense (first_k_dense = 1): estimate_time costs rank 0 of pp 2 as 1 dense + 1 MoE
    est = estimate_time(TINY, H100, _tr(num_gpus=2, global_batch_size=4, seq_len=1024),
                        Plan(tp=1, pp=2, dp=1, micro_batch_size=1))
    assert est.stages[0].compute < est.stages[1].compute


def test_expert_gradients_sync_over_the_expert_data_parallel_group():
    # 8 GPUs, dp 8: with ep 8 each expert lives on one rank (expert dp 1): only the dense part syncs
    tr = _tr(global_batch_size=8, seq_len=1024)
    base = Plan(tp=1, pp=1, dp=8, micro_batch_size=1, zero_stage=1)
    ep8 = base.model_copy(update={"ep": 8})
    dense, expert = cost.stage_param_split(MIXTRAL, ep8, 0, 32)
    assert expert == pytest.approx(32 * 8 * 3 * 4096 * 14336 / 8)
    rs, ag = cost.dp_sync_parts_s(MIXTRAL, H100, tr, ep8, 0, 32)
    g = GroupSpan(size=8, nodes=1, per_node=8)
    assert rs == pytest.approx(7 * NVL_A + 7 / 8 * dense * 4 / NVL)  # reduce-scatter of fp32 grads
    assert ag == pytest.approx(comm.collective_time_s("all_gather", dense * 2, g, H100))
    rs1, _ = cost.dp_sync_parts_s(MIXTRAL, H100, tr, base, 0, 32)
    assert rs1 > 5 * rs  # ep 1: every expert's gradient is reduced over all 8 ranks


def test_estimate_reports_ep_comm_and_activated_mfu():
    tr = _tr(num_gpus=16, global_batch_size=64, precision="bf16")
    plan = Plan(tp=1, pp=2, dp=8, ep=8, micro_batch_size=1, zero_stage=1)
    est = estimate_time(MIXTRAL, H100, tr, plan)
    assert est.breakdown["ep_comm"] > 0
    # MFU on the activated FLOPs (Megatron/DeepSeek convention), 6 x 12.9B-ish per token plus attention
    per_token = flops.model_flops_per_token(MIXTRAL, 4096)
    assert per_token < 6 * 14e9 + 6 * 32 * 4096 * 4096 * 2  # far below the 46.7B total parameters' 280 GFLOP
    assert est.mfu == pytest.approx(64 * 4096 * per_token / (est.step_time_s * 16 * 989.4e12))
    dense = estimate_time(load_model("llama3-8b"), H100, tr, Plan(tp=1, pp=2, dp=8, micro_batch_size=1))
    assert "ep_comm" not in dense.breakdown
    assert math.isfinite(est.step_time_s)


GPT_OSS = load_model("gpt-oss-120b")


def test_eager_expert_kernels_of_gpt_oss_counted_from_megatrons_code():
    """GPT-OSS's clamped activation (16 B forward, 20 B backward per copy and unit of the expert width) and
    expert output biases (28 B and 40 B per unit of h; 2 and 6 launches per local expert plus 2 and 3), counted
    by hand from core_v0.16.1 moe/experts.py TEGroupedMLP._apply_bias and fused_bias_geglu.py (cost.py
    EXPERT_CLAMP_*, EXPERT_BIAS_*). h = f = 2880, 128 experts over EP 8 = 16 local experts."""
    (b_f, b_b), (k_f, k_b) = cost.expert_eager_ops(GPT_OSS, 16)
    assert (b_f, b_b) == (16 * 2880 + 28 * 2880, 20 * 2880 + 40 * 2880)
    assert (k_f, k_b) == (4 + 2 * 16 + 2, 3 + 6 * 16 + 3)
    # expert TP 2 halves the activation's width, not the full-width output the bias is added to
    (b2_f, _), _ = cost.expert_eager_ops(GPT_OSS, 16, etp=2)
    assert b2_f == 16 * 1440 + 28 * 2880
    # neither a clamp nor biases: nothing
    plain = GPT_OSS.model_copy(update={"swiglu_limit": None, "mlp_bias": False})
    assert cost.expert_eager_ops(plain, 16) == ((0.0, 0.0), (0.0, 0.0))


def test_eager_expert_kernels_add_their_bytes_to_the_layer_and_launches_to_the_host():
    """The forward of GPT-OSS's MoE block on H100 at EP 8 (4096 tokens, top 4: 16,384 copies on the rank)
    grows by copies x 126,720 B at the H100's HBM rate (3,350 GB/s x 0.8, hardware_profiles/h100-sxm-80gb.yaml),
    and the host's issue time by 38 launches of host_launch_us."""
    tr = TrainingSpec(num_gpus=64, global_batch_size=1280, seq_len=4096)
    plan = Plan(tp=1, pp=4, dp=16, ep=8, micro_batch_size=1)
    plain = GPT_OSS.model_copy(update={"swiglu_limit": None, "mlp_bias": False})
    with_ops, without = (moe_layer_extra(m, H100, tr, plan, 4096.0) for m in (GPT_OSS, plain))
    copies = 4096 * 4 * tr.moe_load_imbalance
    assert with_ops.fwd_compute - without.fwd_compute == pytest.approx(copies * 126720 / (3350e9 * 0.8), rel=1e-9)
    assert with_ops.bwd_compute - without.bwd_compute == pytest.approx(copies * 172800 / (3350e9 * 0.8), rel=1e-9)
    host, host_plain = cost.moe_host_s(GPT_OSS, H100, tr, plan), cost.moe_host_s(plain, H100, tr, plan)
    assert host[0] - host_plain[0] == pytest.approx(38 * H100.host_launch_us * 1e-6)
    assert host[1] - host_plain[1] == pytest.approx(102 * H100.host_launch_us * 1e-6)


def test_moe_act_recompute_runs_the_clamps_again():
    """Megatron checkpoints TEGroupedMLP's bias_act_func, which holds the clamps and torch.cat of
    weighted_bias_quick_geglu_impl (core_v0.16.1 moe/experts.py, fusions/fused_bias_geglu.py): recomputing
    moe_act repeats their 16 B per copy and unit of the expert width. H100, 4096 tokens, top 4: 16,384 copies x
    16 B x 2880 at 3,350 GB/s x 0.8 (hardware_profiles/h100-sxm-80gb.yaml), and 4 more launches on the host
    (3 kernels and the host-to-device copy); 1 for the activation itself with or without a clamp."""
    tr = TrainingSpec(num_gpus=64, global_batch_size=1280, seq_len=4096, recompute_modules=("layernorm", "moe_act"))
    plan = Plan(tp=1, pp=4, dp=16, ep=8, micro_batch_size=1, recompute="selective")
    unclamped = GPT_OSS.model_copy(update={"swiglu_limit": None})
    rates = cost.Rates.of(H100, "bf16")
    got = {}
    for name, m in (("clamp", GPT_OSS), ("plain", unclamped)):
        x = moe_layer_extra(m, H100, tr, plan, 4096.0)
        got[name] = cost.module_recompute_s(m, tr, plan, rates, 4096.0, 0.0, {}, 0.0, x)[0]
    copies = 4096 * 4 * tr.moe_load_imbalance
    assert got["plain"] == pytest.approx(copies * 3 * 2880 * 2 / (3350e9 * 0.8))
    assert got["clamp"] - got["plain"] == pytest.approx(copies * 16 * 2880 / (3350e9 * 0.8))
    no_recompute = tr.model_copy(update={"recompute_modules": ("core_attn",)})
    for m, extra in ((GPT_OSS, 5), (unclamped, 1)):
        with_rc, without = cost.moe_host_s(m, H100, tr, plan), cost.moe_host_s(m, H100, no_recompute, plan)
        assert with_rc[0] == without[0]
        assert with_rc[1] - without[1] == pytest.approx(extra * H100.host_launch_us * 1e-6)


def test_yarn_rope_runs_eager_under_megatron_bridge():
    """Megatron-Bridge turns TE's fused RoPE off for a YaRN model (GPTModelProvider.provide and
    utils/fusions.py validate_rope_fusion_compatibility: position_embedding_type 'yarn' is not 'rope'), so
    GPT-OSS runs Megatron-Core's eager _apply_rotary_pos_emb_bshd on its query (64 x 64 = 4096 wide) and key
    (8 x 64 = 512): 24 B forward and 28 B backward per element, 12 and 7 launches per call (counted in cost.py
    UNFUSED_ROPE_*), in place of the fused kernel's 4 B x (q + 2 kv) and one launch per tensor."""
    nemo = TrainingSpec(num_gpus=64, global_batch_size=1280, seq_len=4096, framework="nemo")
    megatron = nemo.model_copy(update={"framework": "megatron"})
    plan = Plan(tp=1, pp=4, dp=16, ep=8, micro_batch_size=1)
    assert cost.unfused_rope(GPT_OSS, nemo, plan) == ((24 * 4608, 28 * 4608), (24, 14))
    assert cost.unfused_rope(GPT_OSS, megatron, plan) is None  # Megatron-LM keeps --apply-rope-fusion
    assert cost.unfused_rope(GPT_OSS.model_copy(update={"rope_scaling": None}), nemo, plan) is None
    mla_yarn = DSV3.model_copy(update={"rope_scaling": "yarn"})  # DeepSeek-V3's config is YaRN too
    assert cost.unfused_rope(mla_yarn, nemo, Plan(tp=1, pp=1, dp=64, ep=8, micro_batch_size=1)) is None  # MLA's path
    tp2 = Plan(tp=2, pp=4, dp=8, ep=8, micro_batch_size=1, sequence_parallel=True)
    assert cost.unfused_rope(GPT_OSS, nemo, tp2)[0] == (24 * (2048 + 256), 28 * (2048 + 256))
    # the layer: 4096 tokens on H100 at 3,350 GB/s x 0.8 (bytes, not launches, bound both RoPEs here); a fast host,
    # so that the host's issue time (moe_host_s, checked below) does not pace the layer
    hbm = 3350e9 * 0.8
    gpu = H100.model_copy(update={"host_launch_us": 0.01})
    a, b = layer_time(GPT_OSS, gpu, nemo, plan, moe=True), layer_time(GPT_OSS, gpu, megatron, plan, moe=True)
    fused = 4 * (4096 + 2 * 512)
    assert a.fwd_compute - b.fwd_compute == pytest.approx(4096 * (24 * 4608 - fused) / hbm, rel=1e-6)
    assert a.bwd_compute - b.bwd_compute == pytest.approx(4096 * (28 * 4608 - 2 * fused) / hbm, rel=1e-6)
    # and the host issues 24 - 2 more launches forward, 14 - 2 backward
    (hf_n, hb_n), (hf_m, hb_m) = cost.moe_host_s(GPT_OSS, H100, nemo, plan), cost.moe_host_s(GPT_OSS, H100, megatron, plan)
    assert hf_n - hf_m == pytest.approx(22 * H100.host_launch_us * 1e-6)
    assert hb_n - hb_m == pytest.approx(12 * H100.host_launch_us * 1e-6)


def test_a_clamped_activation_syncs_the_host_a_second_time_in_the_forward():
    """weighted_bias_quick_geglu_impl builds torch.tensor(linear_offset, device=...): a blocking host-to-device
    copy, which PyTorch ends with a stream synchronisation (tensor_new.cpp to(non_blocking=false); Copy.cu
    memcpy_and_sync). With the dispatcher's sync, GPT-OSS's forward is cut in two parts, each paced by the slower of
    host and GPU. H100, EP 8 (16 local experts), 4096 tokens, top 4: between the syncs the host issues 2 all-to-alls,
    the sort, 16 FC1 GEMMs, 2 clamps, the cat and the copy (23 launches of 20 us); the GPU runs half the
    permutation traffic, the dispatch all-to-all, FC1 (1,024 rows per expert, 2880 -> 5760) and the clamps
    (16 B per copy and unit of 2880)."""
    tr = TrainingSpec(num_gpus=64, global_batch_size=1280, seq_len=4096)
    plan = Plan(tp=1, pp=4, dp=16, ep=8, micro_batch_size=1)
    rates = cost.Rates.of(H100, "bf16")
    hbm = 3350e9 * 0.8
    x = moe_layer_extra(GPT_OSS, H100, tr, plan, 4096.0)
    copies = 4096 * 4 * tr.moe_load_imbalance
    perm_half = (2 * 4096 * 2880 * 2 * (1 + 4 * tr.moe_load_imbalance) + 4 * copies * 2880 * 2) / hbm / 2
    dispatch = comm.all_to_all_time_s(copies * 2880 * 2, expert_span(plan, "ep", H100.nvlink_domain), H100)
    # Megatron's TEGroupedMLP: 16 per-expert cuBLAS GEMMs on TE's 4 streams (test_te_grouped_gemm_*)
    fc1 = cost.grouped_gemm_time_s(copies / 16, 2880, 5760, rates, 16, cost.TE_GROUPED_GEMM_STREAMS)
    clamp = copies * 16 * 2880 / hbm
    assert x.fwd_to_activation == pytest.approx(perm_half + dispatch + fc1 + clamp, rel=1e-9)
    h1, g1 = cost.activation_sync_split(GPT_OSS, H100, plan, x)
    assert h1 == pytest.approx(23 * 20e-6) and g1 == x.fwd_to_activation
    # no clamp, no second sync
    assert cost.activation_sync_split(GPT_OSS.model_copy(update={"swiglu_limit": None}), H100, plan, x) is None
    # the layer: the GPU's forward g (read with a host too fast to matter) and the host's h (moe_host_s) combine
    # part by part; a host of 30 us per launch makes this layer host-bound, the case the second sync matters in
    slow = H100.model_copy(update={"host_launch_us": 30.0})
    h1 = 23 * 30e-6
    g_lt = layer_time(GPT_OSS, H100.model_copy(update={"host_launch_us": 1e-6}), tr, plan, moe=True)
    g = g_lt.fwd_compute + g_lt.tp_fwd + g_lt.ep_fwd
    h = cost.moe_host_s(GPT_OSS, slow, tr, plan)[0]
    lt = layer_time(GPT_OSS, slow, tr, plan, moe=True)
    assert h > g and g1 > h1
    assert lt.fwd_compute + lt.tp_fwd + lt.ep_fwd == pytest.approx(max(h1, g1) + max(h - h1, g - g1), rel=1e-6)
    assert lt.fwd_compute + lt.tp_fwd + lt.ep_fwd > max(h, g)


def test_te_grouped_gemm_runs_one_kernel_per_expert_on_four_streams_hand_computed():
    """Transformer Engine's GroupedLinear issues one cuBLAS GEMM per local expert, round-robin on 4 streams
    (cublaslt_gemm.cu multi_stream_cublas_gemm; multi_stream.cpp num_compute_streams = 4); torch._grouped_mm
    one kernel. 10 experts of [512, 1024] x [1024, 1024], 100 SMs, 100 TFLOP/s, 5 us per kernel, HBM not binding:
    each expert's output is 2 x 8 (or 4 x 4) = 16 tiles, 67,108,864 FLOP of tile each (2 x 256 x 128 x 1024)."""
    rates = cost.Rates(gemm_flops=100e12, sm_count=100, gemm_overhead_s=5e-6, attention_flops=1e12,
                       hbm_bytes_per_s=1e18)
    tile = 2 * 256 * 128 * 1024
    # one grouped kernel: 160 tiles -> 2 waves of 100, one fixed cost
    assert cost.grouped_gemm_time_s(512, 1024, 1024, rates, 10, 0) == pytest.approx(200 * tile / 100e12 + 5e-6)
    # 4 streams: rounds of 4, 4, 2 kernels (64, 64, 32 tiles: one wave each), one fixed cost a round
    assert cost.grouped_gemm_time_s(512, 1024, 1024, rates, 10, 4) == pytest.approx(300 * tile / 100e12 + 15e-6)
    # 1 stream: 10 kernels of one wave each, 10 fixed costs
    assert cost.grouped_gemm_time_s(512, 1024, 1024, rates, 10, 1) == pytest.approx(1000 * tile / 100e12 + 50e-6)
    # 400 tiles an expert (4 x 100): whole waves either way, only the fixed costs differ
    assert cost.grouped_gemm_time_s(1024, 1024, 12800, rates, 8, 4) - cost.grouped_gemm_time_s(
        1024, 1024, 12800, rates, 8, 0) == pytest.approx(5e-6)
    # one expert: one kernel either way
    assert cost.grouped_gemm_time_s(512, 1024, 1024, rates, 1, 4) == cost.gemm_time_s(512, 1024, 1024, rates)


def test_megatron_and_nemo_run_the_experts_as_te_grouped_gemms_torchtitan_as_one_kernel():
    """The framework profiles: Megatron (--moe-grouped-gemm, planner/emit/megatron.py) and NeMo (the providers'
    moe_grouped_gemm=True) run TEGroupedMLP, TE's 4-stream per-expert GEMMs; torchtitan torch._grouped_mm."""
    from planner import frameworks

    assert frameworks.get("megatron").expert_gemm_streams == 4 == frameworks.get("nemo").expert_gemm_streams
    assert frameworks.get("torchtitan").expert_gemm_streams == 0
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1)
    tokens = 4096.0
    got = {fw: moe_layer_extra(DSV3, H100, TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096, framework=fw),
                               plan, tokens) for fw in ("nemo", "torchtitan")}
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096)
    rates = cost.Rates.of(H100, "bf16")
    m = tr.moe_load_imbalance * tokens * DSV3.top_k / 32  # 32 local experts
    h, f = DSV3.hidden_size, DSV3.moe_ffn_size
    d_fwd = d_bwd = 0.0
    for k, n in ((h, 2 * f), (f, h)):
        te = cost.gemm_fwd_bwd_s(m, k, n, rates, batch=32, streams=4)
        one = cost.gemm_fwd_bwd_s(m, k, n, rates, batch=32)
        d_fwd += te[0] - one[0]
        d_bwd += te[1] + te[2] - one[1] - one[2]
    assert d_fwd > 0 and d_bwd > 0
    assert got["nemo"].fwd_compute - got["torchtitan"].fwd_compute == pytest.approx(d_fwd, rel=1e-9)
    assert got["nemo"].bwd_compute - got["torchtitan"].bwd_compute == pytest.approx(d_bwd, rel=1e-9)
