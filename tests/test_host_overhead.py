"""The host-issue floor of a MoE layer (planner.cost.moe_host_s): its operator counts are measured on
Megatron-Core's own MoE layer, and it binds only where the host, not the GPU, bounds the layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cost import MOE_HOST_OPS, layer_time, moe_host_s
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec

ROOT = Path(__file__).resolve().parent.parent


def test_operator_counts_are_megatrons_own(megatron_lm_root):
    """MOE_HOST_OPS equals what benchmarks/megatron_host_ops.py measures on core_v0.16.1's MoELayer."""
    env = dict(os.environ, PYTHONPATH=f"{megatron_lm_root}{os.pathsep}{ROOT}")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/megatron_host_ops.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(out.stdout)
    assert {"fwd_base": got["fwd_kernel_base"], "fwd_per_expert": got["fwd_kernel_per_expert"],
            "bwd_base": got["bwd_kernel_base"], "bwd_per_expert": got["bwd_kernel_per_expert"],
            "router_fwd": got["router_fwd_kernel_base"], "router_bwd": got["router_bwd_kernel_base"],
            "fwd_after_sync_base": got["fwd_after_sync_kernel_base"],
            "fwd_after_sync_per_expert": got["fwd_after_sync_kernel_per_expert"]} == MOE_HOST_OPS


def _setup(mbs: int, **training):
    model, hw = load_model("qwen3-30b-a3b"), load_hardware("b200-180gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=512, seq_len=4096, precision="fp8", framework="nemo", **training)
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=mbs, zero_stage=1)
    return model, hw, tr, plan


def test_host_time_by_hand():
    """Qwen3-30B-A3B (128 experts, EP8: 16 local), fp8, TP1: attention block 2 linears (QKV, proj) + their
    2 casts + 1 attention kernel + 6 elementwise (2 norms, 2 adds, RoPE on Q and K) = 11 forward; backward
    2x2 GEMMs + 2 casts + 3 attention kernels + 8 elementwise = 17. MoE: 36 + 6 x 16 = 132 forward,
    27 + 13 x 16 = 235 backward: 143 and 252 launches at host_launch_us each."""
    model, hw, tr, plan = _setup(1)
    launch_s = hw.host_launch_us * 1e-6
    f, b = moe_host_s(model, hw, tr, plan)
    assert f == pytest.approx(143 * launch_s) and b == pytest.approx(252 * launch_s)
    # the router captured in a CUDA graph: its 23 forward and 15 backward kernels become one launch each
    model, hw, tr, plan = _setup(1, cuda_graph_modules=("moe_router",))
    g_f, g_b = moe_host_s(model, hw, tr, plan)
    assert (f - g_f, b - g_b) == pytest.approx((22 * launch_s, 14 * launch_s))


def test_floor_binds_at_small_micro_batch_only():
    for mbs, binds in ((1, True), (8, False)):
        model, hw, tr, plan = _setup(mbs)
        with_host = layer_time(model, hw, tr, plan, moe=True)
        without = layer_time(model, hw.model_copy(update={"host_launch_us": 0.0}), tr, plan, moe=True)
        host_f, _ = moe_host_s(model, hw, tr, plan)
        if binds:  # the forward then takes exactly the host's issue time
            assert with_host.fwd_compute > without.fwd_compute
            assert with_host.fwd_compute + with_host.ep_fwd == pytest.approx(host_f)
        else:
            assert with_host == without


def test_dense_layers_have_no_host_floor():
    """Without a per-layer host sync the CPU runs ahead of the GPU: a dense layer ignores host_launch_us."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=128, precision="bf16")
    plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=1)
    assert layer_time(model, hw, tr, plan) == layer_time(model, hw.model_copy(update={"host_launch_us": 1e4}), tr, plan)


def _plan3d(*args):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_cuda_graph_modules():
    job = ["estimate", "--model", "qwen3-30b-a3b", "--hardware", "b200-180gb", "--gpus", "8", "--global-batch", "512",
           "--seq-len", "4096", "--precision", "fp8", "--framework", "nemo", "--tp", "1", "--pp", "1", "--ep", "8", "--json"]
    plain, graphed = _plan3d(*job), _plan3d(*job, "--cuda-graph-modules", "attn,moe_router,moe_preprocess")
    assert plain.returncode == graphed.returncode == 0, plain.stderr + graphed.stderr
    step = [json.loads(p.stdout)["time"]["step_time_s"] for p in (plain, graphed)]
    assert step[1] < step[0]  # micro-batch 1: the host bounds the MoE layers, and the graphs shorten it
    for bad, says in (("bogus", "--cuda-graph-modules: 'bogus'"), ("moe_preprocess", "together with moe_router")):
        p = _plan3d(*job, "--cuda-graph-modules", bad)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1


def _deepseek_b200(**training):
    """DeepSeek-V3 on DGX-B200 as the Megatron-Bridge table runs it: TP1 EP8 (32 local experts), mbs 1, MXFP8."""
    model, hw = load_model("deepseek-v3"), load_hardware("b200-180gb")
    tr = TrainingSpec(num_gpus=256, global_batch_size=4096, seq_len=4096, precision="mxfp8", framework="nemo",
                      moe_token_dispatcher="deepep", **training)
    plan = Plan(tp=1, pp=16, dp=16, ep=8, micro_batch_size=1, zero_stage=1,
                layers_per_stage=(4,) * 15 + (1,))
    return model, hw, tr, plan


def test_host_after_sync_by_hand():
    """What the host issues after the dispatcher's sync, measured on core_v0.16.1's MoE layer: 6 operators plus 6
    per local expert (its two linears and the activation's). DeepSeek-V3 at EP8 has 256 / 8 = 32 local experts:
    6 + 6 x 32 = 198 launches; Qwen3-30B-A3B at EP8 128 / 8 = 16: 6 + 96 = 102."""
    from planner.cost import moe_host_after_sync_s

    model, hw, tr, plan = _deepseek_b200()
    assert moe_host_after_sync_s(model, hw, tr, plan) == pytest.approx(198 * hw.host_launch_us * 1e-6)
    model, hw, tr, plan = _setup(1)
    assert moe_host_after_sync_s(model, hw, tr, plan) == pytest.approx(102 * hw.host_launch_us * 1e-6)


def _forward_parts(model, hw, tr, plan):
    """(the layer with host time, the same without, the GPU forward, the sync chain: the host's issue after the
    sync plus the GPU's pre-dispatch work) of one MoE layer."""
    from planner.cost import moe_host_after_sync_s, moe_layer_extra

    with_host = layer_time(model, hw, tr, plan, moe=True)
    gpu = layer_time(model, hw.model_copy(update={"host_launch_us": 0.0}), tr, plan, moe=True)
    x = moe_layer_extra(model, hw, tr, plan, plan.micro_batch_size * tr.seq_len)
    gpu_f = gpu.fwd_compute + gpu.tp_fwd + gpu.cp_fwd + gpu.ep_fwd
    chain = moe_host_after_sync_s(model, hw, tr, plan) + gpu_f - x.fwd_compute - x.comm_fwd
    return with_host, gpu, gpu_f, chain


def test_sync_chain_sets_the_forward_where_experts_are_host_heavy():
    """From one sync to the next the host issues the experts and the combine, and only then the next layer's attention:
    the forward takes at least that host time plus the GPU time of the pre-dispatch work. DeepSeek-V3 EP8 on B200
    (32 local experts): this chain exceeds both the GPU's forward and the host's whole forward issue, so it sets the
    forward; the backward, which has no sync, keeps its own floor."""
    model, hw, tr, plan = _deepseek_b200()
    with_host, gpu, gpu_f, chain = _forward_parts(model, hw, tr, plan)
    host_f, host_b = moe_host_s(model, hw, tr, plan)
    assert chain > max(gpu_f, host_f)
    assert with_host.fwd_compute + with_host.ep_fwd == pytest.approx(chain)
    assert with_host.bwd_compute + with_host.ep_bwd + with_host.recompute == pytest.approx(
        max(host_b, gpu.bwd_compute + gpu.ep_bwd + gpu.recompute))


@pytest.mark.parametrize("why", ["a2a_overlap", "drop_and_pad"])
def test_no_sync_chain_without_the_sync(why):
    """Drop-and-pad routing needs no token counts on the host (no sync), and under the 1F1B all-to-all overlap
    another micro-batch's backward keeps the GPU busy: the forward is then the larger of the GPU's and the host's
    whole issue."""
    model, hw, tr, plan = _deepseek_b200(moe_a2a_overlap=why == "a2a_overlap")
    if why == "a2a_overlap":  # Megatron runs the overlap at pp > 1 only with virtual stages (a2a_overlap_active)
        plan = plan.model_copy(update={"vpp": 2})
    if why == "drop_and_pad":
        model = model.model_copy(update={"capacity_factor": 1.0})
    with_host = layer_time(model, hw, tr, plan, moe=True)
    gpu = layer_time(model, hw.model_copy(update={"host_launch_us": 0.0}), tr, plan, moe=True)
    host_f, _ = moe_host_s(model, hw, tr, plan)
    assert with_host.fwd_compute + with_host.ep_fwd == pytest.approx(max(host_f, gpu.fwd_compute + gpu.ep_fwd))


def test_torchtitan_operator_counts_are_torchtitans_own():
    """TORCHTITAN_MOE_HOST_OPS equals what benchmarks/torchtitan_host_ops.py measures on torchtitan's own MoE layer
    (grouped experts: nothing per local expert), with and without expert parallelism."""
    pytest.importorskip("torchtitan")
    from planner.cost import TORCHTITAN_MOE_HOST_OPS

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/torchtitan_host_ops.py"), "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(out.stdout)
    for path in ("ep", "local"):
        want = TORCHTITAN_MOE_HOST_OPS[path]
        assert (got[f"{path}_fwd_kernel_base"], got[f"{path}_fwd_kernel_per_expert"], got[f"{path}_bwd_kernel_base"],
                got[f"{path}_bwd_kernel_per_expert"]) == (want["fwd_base"], want["fwd_per_expert"], want["bwd_base"],
                                                          want["bwd_per_expert"])
    assert (got["ep_fwd_after_sync_kernel_base"], got["ep_fwd_after_sync_kernel_per_expert"]) == (
        TORCHTITAN_MOE_HOST_OPS["ep"]["fwd_after_sync_base"], TORCHTITAN_MOE_HOST_OPS["ep"]["fwd_after_sync_per_expert"])


def _torchtitan_qwen(ep: int, mbs: int = 1):
    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096, framework="torchtitan")
    return model, hw, tr, Plan(tp=1, pp=1, dp=8, ep=ep, micro_batch_size=mbs, zero_stage=3)


def test_torchtitan_host_time_by_hand():
    """torchtitan's Qwen3-30B-A3B layer at TP1, bf16: attention block 2 linears + 1 attention kernel + 6 elementwise
    = 9 forward, 2x2 GEMMs + 3 attention kernels + 8 elementwise = 15 backward, as under Megatron; its MoE layer
    57 forward and 52 backward operators with EP (whatever the local experts: 16 at EP 8, 128 at EP 1 would not
    change it), 32 and 45 without. Megatron's layer at EP 8 would issue 36 + 6 x 16 = 132 and 27 + 13 x 16 = 235."""
    for ep, (f_ops, b_ops) in ((8, (9 + 57, 15 + 52)), (1, (9 + 32, 15 + 45))):
        model, hw, tr, plan = _torchtitan_qwen(ep)
        f, b = moe_host_s(model, hw, tr, plan)
        launch_s = hw.host_launch_us * 1e-6
        assert (f, b) == pytest.approx((f_ops * launch_s, b_ops * launch_s))
    model, hw, tr, plan = _torchtitan_qwen(8)
    from planner.cost import moe_host_after_sync_s

    assert moe_host_after_sync_s(model, hw, tr, plan) == pytest.approx(35 * hw.host_launch_us * 1e-6)


def test_torchtitan_without_ep_has_no_sync_chain():
    """Without expert parallelism torchtitan's MoE layer copies nothing to the host, so no sync chain: the forward is
    the larger of the GPU's and the host's whole issue, as for a layer without a sync. With EP the chain applies."""
    model, hw, tr, plan = _torchtitan_qwen(1)
    with_host = layer_time(model, hw, tr, plan, moe=True)
    gpu = layer_time(model, hw.model_copy(update={"host_launch_us": 0.0}), tr, plan, moe=True)
    host_f, _ = moe_host_s(model, hw, tr, plan)
    assert with_host.fwd_compute + with_host.ep_fwd == pytest.approx(max(host_f, gpu.fwd_compute + gpu.ep_fwd))
    model, hw, tr, plan = _torchtitan_qwen(8)
    with_host, _, gpu_f, chain = _forward_parts(model, hw, tr, plan)
    host_f, _ = moe_host_s(model, hw, tr, plan)
    assert with_host.fwd_compute + with_host.ep_fwd == pytest.approx(max(host_f, gpu_f, chain))


def test_torchtitan_moe_layer_is_not_charged_megatrons_per_expert_launches():
    """The defect this fixes: at EP 1 (128 local experts) the layer was charged Megatron's 6 + 13 launches per expert,
    about 2,500 launches (36 + 6 x 128 forward, 27 + 13 x 128 backward, and the attention block), 50 ms at H100's
    host_launch_us, where torchtitan issues 101 operators in all."""
    model, hw, tr, plan = _torchtitan_qwen(1)
    f, b = moe_host_s(model, hw, tr, plan)
    assert (f + b) / (hw.host_launch_us * 1e-6) == pytest.approx(9 + 32 + 15 + 45)


def test_validates_miniature_keeps_megatrons_counts():
    """plan3d validate's MoE miniature (framework torch) loops over its experts and syncs every layer, as Megatron's
    SequentialMLP does: it keeps MOE_HOST_OPS though its memory profile derives from torchtitan's."""
    model, hw, _, plan = _torchtitan_qwen(8)
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096, framework="torch")
    f, b = moe_host_s(model, hw, tr, plan)
    launch_s = hw.host_launch_us * 1e-6
    assert (f, b) == pytest.approx(((9 + 36 + 6 * 16) * launch_s, (15 + 27 + 13 * 16) * launch_s))


def test_whole_moe_layer_graph_is_one_launch_each_way():
    """--cuda-graph-scope moe (drop-and-pad routing only): the MoE part of the layer, 132 forward and 235 backward
    launches in test_host_time_by_hand, becomes one graph launch each way; the attention block's 11 and 17 stay."""
    model, hw, tr, plan = _setup(1)
    model = model.model_copy(update={"capacity_factor": 1.0})
    launch_s = hw.host_launch_us * 1e-6
    f, b = moe_host_s(model, hw, tr.model_copy(update={"cuda_graph_modules": ("moe",)}), plan)
    assert (f, b) == pytest.approx(((11 + 1) * launch_s, (17 + 1) * launch_s))
