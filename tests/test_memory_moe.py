"""Memory of mixture-of-experts and MLA models per pipeline stage (docs/moe.md, Memory).

* parameters per GPU: MLA's replicated down projections and column/row-parallel up/out projections,
  the router and shared experts over TP, E/ep routed experts split over etp: hand-computed from
  Megatron-Core core_v0.16.1's module constructors;
* gradients and optimizer states: dense over dp x cp, experts over the expert-data-parallel group
  (Megatron's expert DDP buffers, torchtitan's efsdp);
* saved activations of a MoE layer measured with ``saved_tensors_hooks`` on the CPU, running
  Megatron-Core's own routing/permutation/SwiGLU functions (from ../shared) and torchtitan's own
  ``MoE`` module (installed package);
* the framework profiles' refusals; the search tables against ``memory.stage_memory``;
* acceptance: DeepSeek-V3's published layout and a NeMo-published Mixtral-8x7B layout fit on an
  80 GB GPU under the Megatron/NeMo profiles; DeepSeek-V3 on 64 GPUs does not.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from planner.frameworks import get as profile
from planner.memory import (attention_params_per_rank, estimate_memory, layer_activation_terms, layer_param_split,
                            moe_activation_terms, moe_tokens_per_rank, saved_bytes_per_layer, stage_memory,
                            stage_param_split, stage_params_per_rank, stage_state_bytes)
from planner.presets import load_hardware, load_model
from planner.specs import ModelSpec, Plan, TrainingSpec, plan_problems

DSV3, MIXTRAL, TINY = load_model("deepseek-v3"), load_model("mixtral-8x7b"), load_model("tiny-moe")
H100 = load_hardware("h100-sxm-80gb")


def _plan(**kw) -> Plan:
    return Plan(**({"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 1} | kw))


# --- parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral-8x7b", "qwen3-235b-a22b", "qwen3-30b-a3b", "tiny-moe"])
def test_one_gpu_holds_the_whole_model(name):
    model = load_model(name).model_copy(update={"mtp_num_layers": 0})
    plan = _plan()
    assert stage_params_per_rank(model, plan, 0, model.num_layers) == model.num_params


def test_one_gpu_holds_deepseek_v3_with_its_mtp_module():
    """DeepSeek-V3 with its MTP module on one GPU against the published checkpoint: 685B = 671B main model + 14B
    MTP module (deepseek-ai/DeepSeek-V3 model card; report arXiv:2412.19437 section 2.2). The checkpoint stores
    the module's own copies of the embedding and output head (V x h each), which the trained model shares with
    the main model on one stage; within 0.2 % (the card rounds to 1B)."""
    assert DSV3.mtp_num_layers == 1
    one_gpu = stage_params_per_rank(DSV3, _plan(), 0, DSV3.num_layers)
    assert one_gpu > DSV3.num_params  # the module is counted, not in num_params (671B)
    checkpoint = one_gpu + 2 * 129280 * 7168
    assert checkpoint == pytest.approx(685e9, rel=0.002)


def test_mla_attention_params_per_tp_rank_as_megatron_builds_them():
    """core_v0.16.1 MLASelfAttention with the TE spec: linear_q_down_proj (h x r_q) and linear_kv_down_proj
    (h x (r_kv + rope)) are TELinear(parallel_mode="duplicated"), replicated with the q/kv layernorm weights;
    linear_q_up_proj (r_q x a*192), linear_kv_up_proj (r_kv x a*(128 + 128)) column-parallel, linear_proj
    (a*128 x h) row-parallel. DeepSeek-V3: h 7168, a 128, r_q 1536, r_kv 512, rope 64."""
    h, a, t = 7168, 128, 8
    replicated = h * 1536 + 1536 + h * (512 + 64) + 512
    split = (1536 * a * 192 + 512 * a * (128 + 128) + a * 128 * h) / t
    assert attention_params_per_rank(DSV3, t) == replicated + split
    assert attention_params_per_rank(DSV3, 1) == DSV3.attention_params()


def test_moe_layer_split_router_shared_and_experts():
    """DeepSeek-V3 MoE layer at tp 2, ep 8, etp 1: router 256 x h replicated, the shared expert (3 h 2048)
    over tp, 256/8 = 32 experts of 3 h 2048 each, whole (etp 1)."""
    h = 7168
    dense, expert = layer_param_split(DSV3, 2, True, 8, 1)
    assert dense == attention_params_per_rank(DSV3, 2) + 2 * h + 256 * h + 3 * h * 2048 / 2
    assert expert == 32 * 3 * h * 2048
    # etp splits each expert; the first_k_dense layers have the 18432-wide MLP and no experts
    assert layer_param_split(DSV3, 2, True, 8, 2)[1] == expert / 2
    assert layer_param_split(DSV3, 2, False) == (attention_params_per_rank(DSV3, 2) + 2 * h + 3 * h * 18432 / 2, 0.0)


def test_stages_count_dense_first_and_moe_layers():
    """DeepSeek-V3 over 16 stages as 3 + 14 x 4 + 2: stage 0 holds the 3 dense-first layers and no
    expert; the experts of the whole model are split over the 16 stages and the 64 EP ranks exactly."""
    plan = _plan(pp=16, dp=128, ep=64, layers_per_stage=(3,) + (4,) * 14 + (2,))
    assert stage_param_split(DSV3, plan, 0, 3)[1] == 0
    experts = sum(stage_param_split(DSV3, plan, r, n)[1] for r, n in enumerate(plan.stage_layers(61)))
    # the MTP layer, a MoE layer like the last one, on the last stage
    assert experts * 64 == (DSV3.num_moe_layers + DSV3.mtp_num_layers) * DSV3.expert_params()


# --- gradients and optimizer states --------------------------------------------------------------

def test_megatron_shards_experts_over_expert_dp():
    """Mixtral-8x7B, tp 1 pp 4 dp 16 ep 8 (expert_dp 2), distributed optimizer: 12 B per dense parameter
    / 16 and per expert parameter / 2; weights 2 B and fp32 grads 4 B on every parameter."""
    plan = _plan(pp=4, dp=16, ep=8, zero_stage=1)
    tr = TrainingSpec(num_gpus=64, global_batch_size=256, seq_len=4096)
    dense, expert = stage_param_split(MIXTRAL, plan, 1, 8)
    assert expert == 8 * (8 / 8) * 3 * 4096 * 14336
    st = stage_state_bytes(MIXTRAL, tr, plan, 1, 8)
    assert st.optimizer_bytes == pytest.approx(12 * dense / 16 + 12 * expert / 2)
    assert st.weights_bytes == pytest.approx(2 * (dense + expert))
    assert st.grads_bytes == pytest.approx(4 * (dense + expert))


def test_torchtitan_shards_experts_over_efsdp():
    """torchtitan 0.3.0 (distributed/fsdp.py): experts over efsdp = dp_shard*cp*tp/ep, the rest over
    dp_shard*cp; fp32 shards of parameters, gradients (8 micro-batches: kept) and Adam's 8 B."""
    plan = _plan(tp=2, pp=1, dp=8, ep=4, etp=1, zero_stage=3, sequence_parallel=True)
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=1024, framework="torchtitan")
    assert plan.expert_dp == 4
    dense, expert = stage_param_split(TINY, plan, 0, 4)
    st = stage_state_bytes(TINY, tr, plan, 0, 4)
    shard = dense / 8 + expert / 4
    assert st.optimizer_bytes == pytest.approx(8 * shard)
    assert st.grads_bytes == pytest.approx(4 * shard)


# --- the framework profiles ---------------------------------------------------------------------

def test_profiles_refuse_what_they_cannot_run():
    tr = lambda fw: TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=1024, framework=fw)  # noqa: E731
    assert any(e.startswith("ep:") for e in plan_problems(TINY, H100, tr("deepspeed"), _plan(dp=16, ep=4)))
    # torchtitan: EP replaces expert TP (etp must be 1 with ep > 1), and it lives in the FSDP mesh
    tt = plan_problems(TINY, H100, tr("torchtitan"), _plan(tp=2, dp=8, ep=4, zero_stage=1, sequence_parallel=True))
    assert any(e.startswith("etp:") for e in tt)
    assert not plan_problems(TINY, H100, tr("torchtitan"),
                             _plan(tp=2, dp=8, ep=4, etp=1, zero_stage=1, sequence_parallel=True))
    assert any(e.startswith("zero_stage:") for e in plan_problems(TINY, H100, tr("torchtitan"),
                                                                  _plan(dp=16, ep=4, etp=1, zero_stage=0)))
    # Megatron's MoELayer.forward refuses tp > 1 without sequence parallelism in training
    mg = plan_problems(TINY, H100, tr("megatron"), _plan(tp=2, dp=8, ep=4))
    assert any(e.startswith("sequence_parallel:") for e in mg)
    assert not plan_problems(TINY, H100, tr("megatron"), _plan(tp=2, dp=8, ep=4, sequence_parallel=True))
    assert not plan_problems(load_model("llama3-8b"), H100, tr("megatron"), _plan(tp=2, dp=8))  # dense: no rule


# --- tokens and rows ------------------------------------------------------------------------------

def test_rows_per_gpu_dropless_and_capacity():
    """Megatron alltoall dispatcher: s b / t tokens routed per GPU (SP), k copies, all-gathered over etp;
    with a capacity factor at most cf times that (moe_utils.get_capacity on the local tokens)."""
    tr = TrainingSpec(num_gpus=32, global_batch_size=32, seq_len=4096)
    plan = _plan(tp=4, dp=8, ep=8, etp=2, sequence_parallel=True)
    tokens, rows = moe_tokens_per_rank(MIXTRAL, tr, plan)
    assert (tokens, rows) == (4096 / 4, 4096 / 4 * 2 * 2)
    capped = MIXTRAL.model_copy(update={"capacity_factor": 1.25})
    assert moe_tokens_per_rank(capped, tr, plan)[1] == rows * 1.25
    huge = MIXTRAL.model_copy(update={"capacity_factor": 100.0})  # bounded by all of the EP group's tokens
    assert moe_tokens_per_rank(huge, tr, plan)[1] == 8 * 1024 * 1 * 2
    # torchtitan: with ep the tokens are sharded over tp, experts whole; without, all tokens, experts over tp
    tt = tr.model_copy(update={"framework": "torchtitan"})
    assert moe_tokens_per_rank(MIXTRAL, tt, _plan(tp=4, dp=8, ep=8, etp=1))[1] == 4096 / 4 * 2
    assert moe_tokens_per_rank(MIXTRAL, tt, _plan(tp=4, dp=8))[1] == 4096 * 2


# --- saved activations against the real code, on the CPU ---------------------------------------

def _model(h, n_exp, k, f, shared=None) -> ModelSpec:
    return ModelSpec(name="moe-cpu", num_layers=2, hidden_size=h, num_attention_heads=4, ffn_hidden_size=4 * h,
                     vocab_size=512, activation="swiglu", norm="rmsnorm", num_experts=n_exp, top_k=k,
                     moe_ffn_hidden_size=f, shared_expert_ffn_hidden_size=shared)


def _saved_bytes(run, params) -> int:
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.float().sum().backward()
    return sum(seen.values())


@pytest.fixture(scope="module")
def megatron_moe(megatron_import):
    def load():
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
        from megatron.core.transformer.moe import moe_utils
        return moe_utils, weighted_bias_swiglu_impl

    moe_utils, weighted_bias_swiglu_impl = megatron_import(load)
    # Stand-in for Transformer Engine (absent here): RouterGatingLinearFunction tests ``te_general_gemm is not
    # None``, a name moe_utils binds only when TE imports; None selects Megatron's own torch.mm path.
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    yield moe_utils, weighted_bias_swiglu_impl


def test_megatron_moe_saved_bytes_match_megatron_code(megatron_moe):
    """A MoE layer (tp = ep = 1, sigmoid router as DeepSeek-V3) built from Megatron-Core's own
    ``router_gating_linear``, ``topk_routing_with_score_function``, ``permute``, ``weighted_bias_swiglu_impl``
    and ``unpermute`` (non-fused paths: what runs without Transformer Engine). Stand-in: TE's
    ``GroupedLinear`` is a grouped matmul that saves its input, as TE's does (no fp8). The estimator's
    MoE terms agree within 1 %."""
    import torch

    mu, swiglu = megatron_moe
    torch.manual_seed(0)
    h, n_exp, k, f, tokens = 256, 16, 4, 128, 256
    model = _model(h, n_exp, k, f)

    class Grouped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, counts):
            ctx.save_for_backward(x, w)
            ctx.counts = counts
            return torch.cat([xi @ wi.t() for xi, wi in zip(x.split(counts), w)])

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            gx = torch.cat([gi @ wi for gi, wi in zip(g.split(ctx.counts), w)])
            gw = torch.stack([gi.t() @ xi for gi, xi in zip(g.split(ctx.counts), x.split(ctx.counts))])
            return gx, gw, None

    bf = torch.bfloat16
    router = torch.nn.Parameter(torch.randn(n_exp, h, dtype=bf) * 0.05)
    w1 = torch.nn.Parameter(torch.randn(n_exp, 2 * f, h, dtype=bf) * 0.05)
    w2 = torch.nn.Parameter(torch.randn(n_exp, h, f, dtype=bf) * 0.05)
    x = torch.randn(tokens, h, dtype=bf, requires_grad=True)  # the pre-MLP norm output

    def run():
        logits = mu.router_gating_linear(x, router, None, torch.float32)
        probs, routing_map = mu.topk_routing_with_score_function(logits, k, score_function="sigmoid")
        permuted, permuted_probs, order = mu.permute(x, routing_map, probs=probs, num_out_tokens=tokens * k)
        counts = routing_map.sum(0).tolist()
        act = swiglu(Grouped.apply(permuted, w1, counts), None, permuted_probs.unsqueeze(-1))
        out = Grouped.apply(act, w2, counts)
        return mu.unpermute(out, order, restore_shape=x.shape, routing_map=routing_map)

    measured = _saved_bytes(run, [router, w1, w2])
    tr = TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=tokens)
    predicted = sum(t.bytes for t in moe_activation_terms(model, tr, _plan()))
    assert predicted / measured == pytest.approx(1, abs=0.01), (predicted, measured)


def test_torchtitan_moe_saved_bytes_match_torchtitan_module():
    """torchtitan 0.3.0's own ``MoE`` (sigmoid router with route_norm, LocalTokenDispatcher, GroupedExperts
    with ``torch._grouped_mm``), bf16, measured on the CPU. Where the CPU differs from a GPU: CPU
    autocast has no float32 target ("Disabling autocast"), so the gate keeps its bf16 input instead of
    an fp32 copy, no fp32 weight copy, and the scores stay bf16 (2 B instead of 4). The estimator's GPU
    terms with exactly those substitutions agree within 1 %."""
    torch = pytest.importorskip("torch")
    cu = pytest.importorskip("torchtitan.models.common.config_utils")
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

    h, n_exp, k, f, tokens = 256, 16, 4, 128, 256
    model = _model(h, n_exp, k, f)
    router = cu.make_router_config(dim=h, num_experts=n_exp, gate_param_init={}, top_k=k, score_func="sigmoid",
                                   route_norm=True)
    experts = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=h, hidden_dim=f, num_experts=n_exp),
        token_dispatcher=cu.make_token_dispatcher_config(num_experts=n_exp, top_k=k, comm_backend="standard"))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = cu.make_moe_config(num_experts=n_exp, router=router, routed_experts=experts).build()
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.05)
        moe = moe.to(torch.bfloat16)
        x = torch.randn(1, tokens, h, dtype=torch.bfloat16, requires_grad=True)
        measured = _saved_bytes(lambda: moe(x), list(moe.parameters()))
    tr = TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=tokens, framework="torchtitan")
    terms = {t.name: t.bytes for t in moe_activation_terms(model, tr, _plan())}
    cpu = dict(terms)
    cpu["router input, fp32 autocast copy"] = tokens * h * 2  # bf16 input kept by the gate
    cpu["router weight, fp32 autocast copy"] = 0  # the bf16 parameter itself
    for name in ("router scores (fp32)", "top-k scores and normaliser (fp32)", "routed scores, sorted (fp32)"):
        cpu[name] = terms[name] / 2  # bf16 on the CPU
    predicted = sum(cpu.values())
    assert predicted / measured == pytest.approx(1, abs=0.01), (predicted, measured)


# --- the search's tables ------------------------------------------------------------------------

def test_search_tables_equal_stage_memory_for_a_moe_model():
    """Every legal table entry of a MoE model (dense-first + MoE layers on different stages) is
    memory.stage_memory of its plan, stage kind by stage kind, in KiB."""
    from planner.candidates import SearchSpace
    from planner.search import _stage_rows, build_tables
    from tests.table_checks import assert_same_kib

    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=256)
    tables = build_tables(TINY, H100, tr, SearchSpace(max_micro_batch_size=2, max_cp=1))
    legal = np.flatnonzero(tables.legal.ravel())
    assert legal.size > 20
    for key in legal:
        plan = tables.plan(int(key))
        s, u, z = tables.unindex(int(key))
        m = tr.global_batch_size // (plan.micro_batch_size * plan.dp)
        split = tables.shapes[s][3]
        for kind, (r, n) in enumerate(_stage_rows(split)):
            expect = stage_memory(TINY, tr, plan, m, r, n, H100).total_bytes
            assert_same_kib(tables.mem_kib[s, u, z, kind], expect, (plan, r))


# --- acceptance ---------------------------------------------------------------------------------

def test_deepseek_v3_published_layout_fits_on_80gb():
    """DeepSeek-V3 technical report (arXiv:2412.19437) section 3.2: 2,048 H800 GPUs, 16-way PP, 64-way EP,
    ZeRO-1 DP, no TP; section 4.2: batch 15,360 sequences of 4,096 tokens. Stand-ins and assumptions:
    H100-SXM 80 GB for the H800 (same memory); micro-batch 1; Megatron's 1F1B (not DualPipe) with full
    recompute standing in for DeepSeek's recompute of the norms and MLA up-projections (section 3.2.3;
    Megatron's --recompute-modules are not modelled); bf16 (the report's FP8 caching is not modelled);
    stages 3 + 14 x 4 + 2: the first holds the embedding and the 3 dense layers, the last the output head
    and the MTP module (with its copy of the embedding: the peak stage, about 27.5 GiB). Without recompute,
    1F1B's 16 in-flight micro-batches do not fit: the layout needs what the report describes."""
    tr = TrainingSpec(num_gpus=2048, global_batch_size=15360, seq_len=4096, framework="megatron")
    plan = _plan(pp=16, dp=128, ep=64, zero_stage=1, recompute="full", layers_per_stage=(3,) + (4,) * 14 + (2,))
    assert plan_problems(DSV3, H100, tr, plan) == []
    est = estimate_memory(DSV3, H100, tr, plan)
    assert est.fits, est.to_dict()
    # hand check of a middle stage's states (4 MoE layers): per layer MLA 187.1M + norms 2h + router 256h +
    # shared expert 3h 2048 (dense, 12 B / 128) and 256/64 = 4 experts of 3h 2048 (12 B / expert_dp 2); 6 B each
    h = 7168
    mla = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h
    dense, experts = 4 * (mla + 2 * h + 256 * h + 3 * h * 2048), 4 * 4 * 3 * h * 2048
    st = stage_state_bytes(DSV3, tr, plan, 1, 4)
    assert st.weights_bytes + st.grads_bytes + st.optimizer_bytes == pytest.approx(
        6 * (dense + experts) + 12 * dense / 128 + 12 * experts / 2)
    assert est.peak_gib < 0.5 * est.usable_gib
    assert not estimate_memory(DSV3, H100, tr, plan.model_copy(update={"recompute": "none"})).fits


def test_deepseek_v3_on_64_gpus_does_not_fit():
    """671B parameters on 64 GPUs: ~10.5B per GPU at 16 B/param is far beyond 80 GB, whatever the recompute."""
    tr = TrainingSpec(num_gpus=64, global_batch_size=1024, seq_len=4096, framework="megatron")
    plan = _plan(pp=16, dp=4, ep=4, zero_stage=1, recompute="full", layers_per_stage=(3,) + (4,) * 14 + (2,))
    assert plan_problems(DSV3, H100, tr, plan) == []
    assert estimate_memory(DSV3, H100, tr, plan).peak_gib > 2 * H100.usable_memory_gib


def test_mixtral_8x7b_nemo_published_layout_fits():
    """NeMo-Framework-Launcher launcher_scripts/conf/training/mixtral/mixtral_8x7b.yaml (H100): 8 nodes x 8 GPUs,
    TP 1, PP 4, VPP 8, EP 8, micro-batch 1, global batch 256, seq 4096, mcore distributed optimizer with
    grad_sync_dtype bf16, moe_expert_capacity_factor 1.0 with pad-to-capacity, no activation checkpointing."""
    model = MIXTRAL.model_copy(update={"capacity_factor": 1.0})
    tr = TrainingSpec(num_gpus=64, global_batch_size=256, seq_len=4096, framework="nemo", grad_reduce_in_bf16=True)
    plan = _plan(pp=4, vpp=8, dp=16, ep=8, zero_stage=1)
    assert plan_problems(model, H100, tr, plan) == []
    est = estimate_memory(model, H100, tr, plan)
    assert est.fits, est.to_dict()
    # the same layout without EP (every GPU holding all 8 experts of its 8 layers) does not fit
    assert not estimate_memory(model, H100, tr, plan.model_copy(update={"ep": 1})).fits


def test_moe_layer_saves_more_than_its_dense_first_layer_in_deepseek_v3():
    """Per token, DeepSeek-V3's MoE layer saves its 8 routed copies (FC1 input 8 h, FC1 output 8 x 2 x 2048,
    FC2 input 8 x 2048, bf16) where a dense-first layer saves the 18432-wide MLP; hand-computed MLP parts."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=4096)
    plan = _plan(dp=8, ep=8)
    moe = {t.name: t.bytes for t in layer_activation_terms(DSV3, tr, plan, moe=True)}
    dense = {t.name: t.bytes for t in layer_activation_terms(DSV3, tr, plan, moe=False)}
    s, h = 4096, 7168
    assert moe["expert FC1 input (dispatched tokens)"] == s * 8 * h * 2
    assert moe["expert activation input (FC1 output)"] == s * 8 * 2 * 2048 * 2
    assert dense["activation input (FC1 output)"] == s * 2 * 18432 * 2
    assert saved_bytes_per_layer(list(layer_activation_terms(DSV3, tr, plan, moe=True)), "none") > \
        saved_bytes_per_layer(list(layer_activation_terms(DSV3, tr, plan, moe=False)), "none")
    assert profile("megatron").moe_needs_sp


def test_mla_saved_bytes_match_a_megatron_shaped_mla_on_the_cpu():
    """MLA as Megatron's MLASelfAttention runs it (tp 1): the norm output feeds the q and kv down projections
    (one saved tensor), RMSNorms (``planner.validate.kernels.RMSNormFn``: input + fp32 rstd, as TE's) on the
    q latent and on the kv latent split from the rope key, column up projections, K = cat(k_nope, the rope
    key expanded to every head), V made contiguous, attention, the output projection. Stand-in: the CPU has
    no FlashAttention for qk width 48 != v width 32 (torch falls back to the math path, which saves the
    s x s scores), so the core is an autograd Function that saves what FlashAttention-2 saves (q, k, v, the
    output, the fp32 log-sum-exp). No RoPE (the fused MLA RoPE saves nothing). Terms: exact."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from planner.validate.kernels import RMSNormFn

    class Flash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
            scores = scores + torch.full(scores.shape[-2:], float("-inf")).triu(1)
            lse = scores.logsumexp(-1)
            out = ((scores - lse[..., None]).exp() @ v.float()).to(q.dtype)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v, _, _ = ctx.saved_tensors
            with torch.enable_grad():
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                return torch.autograd.grad(out, (qq, kk, vv), g)

    torch.manual_seed(0)
    b, s, h, a, rq, rkv, nope, rope, vd = 2, 128, 256, 4, 64, 32, 32, 16, 32
    model = ModelSpec(name="mla-cpu", num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=512,
                      activation="swiglu", norm="rmsnorm", q_lora_rank=rq, kv_lora_rank=rkv, qk_rope_head_dim=rope,
                      qk_nope_head_dim=nope, v_head_dim=vd)
    bf = torch.bfloat16
    weights = [torch.nn.Parameter(torch.randn(*shape, dtype=bf) * 0.05) for shape in
               [(rq, h), (rq,), (a * (nope + rope), rq), (rkv + rope, h), (rkv,), (a * (nope + vd), rkv), (h, a * vd)]]
    wqd, qn, wqu, wkvd, kvn, wkvu, wo = weights
    x = torch.randn(b, s, h, dtype=bf, requires_grad=True)  # the input norm's output

    def run():
        q = F.linear(RMSNormFn.apply(F.linear(x, wqd), qn, 1e-6), wqu).view(b, s, a, nope + rope)
        kv_latent, k_rope = F.linear(x, wkvd).split([rkv, rope], -1)
        kv = F.linear(RMSNormFn.apply(kv_latent, kvn, 1e-6), wkvu).view(b, s, a, nope + vd)
        k_nope, v = kv.split([nope, vd], -1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, a, -1)], -1)
        out = Flash.apply(q.transpose(1, 2), k.transpose(1, 2), v.contiguous().transpose(1, 2))
        return F.linear(out.transpose(1, 2).reshape(b, s, a * vd), wo)

    measured = _saved_bytes(run, weights)
    tr = TrainingSpec(num_gpus=1, global_batch_size=b, seq_len=s)
    from planner.memory import mla_attention_terms

    terms = mla_attention_terms(model, tr, _plan(micro_batch_size=b))
    # the torch reference's out-projection input is a copy of the [b, a, s, v] attention output (TE's is a view
    # of its sbhd output): one more [tokens, a v] tensor on the CPU
    predicted = sum(t.bytes for t in terms) + b * s * a * vd * 2
    assert predicted == measured, (predicted, measured, [(t.name, t.bytes) for t in terms])


def test_search_proposes_no_moe_plan_megatron_cannot_train():
    """Megatron's MoE layer needs SP with tp > 1: no legal table entry of a MoE model has tp > 1 without SP,
    and every legal entry passes plan_problems (the rule `plan3d check` applies)."""
    from planner.candidates import SearchSpace
    from planner.search import build_tables

    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=256)
    tables = build_tables(TINY, H100, tr, SearchSpace(max_micro_batch_size=2, max_cp=1))
    plans = [tables.plan(int(k)) for k in np.flatnonzero(tables.legal.ravel())]
    assert any(p.tp > 1 for p in plans)
    assert all(p.sequence_parallel for p in plans if p.tp > 1)
    assert all(not plan_problems(TINY, H100, tr, p) for p in plans[:: max(1, len(plans) // 40)])


def test_deepspeed_shards_experts_like_any_parameter_without_ep():
    """DeepSpeed as plan3d emits it has no EP: a MoE model's experts are ordinary parameters, and ZeRO-1's
    fp32 master + Adam (12 B) and fp32 gradient partition (4 B) are divided by dp over all of them."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=256, framework="deepspeed")
    plan = _plan(dp=8, zero_stage=1)
    params = stage_params_per_rank(TINY, plan, 0, 4)
    st = stage_state_bytes(TINY, tr, plan, 0, 4)
    assert st.optimizer_bytes == pytest.approx(12 * params / 8)


@pytest.mark.parametrize("model_name,framework", [("deepseek-v3", "megatron"), ("mixtral-8x7b", "torchtitan"),
                                                  ("llama3-70b", "megatron"), ("gpt-oss-120b", "nemo")])
def test_memoised_activation_terms_are_the_uncached_ones(model_name, framework):
    """``layer_activation_terms`` is memoised on (tp, cp, micro-batch, SP, ep, etp): plans that differ in every
    other field (dp, pp, vpp, ZeRO, recompute, layers per stage) get exactly the terms the uncached function
    computes for each of them, so a plan field read without being in the key would fail here."""
    from planner import memory

    model = load_model(model_name)
    tr = TrainingSpec(num_gpus=512, global_batch_size=512, seq_len=4096, framework=framework,
                      recompute_modules=("core_attn", "moe_act") if framework != "torchtitan" else ("core_attn",))
    ep = 8 if model.is_moe else 1
    plans = [Plan(tp=tp, pp=pp, dp=512 // (tp * pp * cp), cp=cp, vpp=vpp, micro_batch_size=mbs,
                  sequence_parallel=tp > 1, zero_stage=z, recompute=rc, ep=ep, etp=1 if model.is_moe else None)
             for tp, pp, cp, vpp, mbs, z, rc in [(1, 4, 1, 1, 1, 1, "none"), (2, 8, 2, 2, 2, 3, "selective"),
                                                 (4, 2, 1, 1, 1, 0, "full"), (2, 4, 1, 1, 2, 1, "none")]]
    for plan in plans:
        for moe in (False, True):
            got = layer_activation_terms(model, tr, plan, moe=moe)
            assert got == memory._layer_activation_terms(model, tr, plan, moe and model.is_moe)
            assert got is not layer_activation_terms(model, tr, plan, moe=moe)  # a fresh list each call


def test_the_busiest_rank_holds_the_imbalanced_rows():
    """moe_load_imbalance (tokens on the busiest EP rank over the mean) scales the rows that rank saves, as the cost
    model charges that rank's GEMMs and dispatch; at most every copy of the group's tokens a rank can receive. Qwen3-
    30B-A3B, EP 8, 4,096 tokens, top-8: balanced 4,096 x 8 = 32,768 rows; x 1.25 = 40,960; the cap is
    8 x 4,096 x min(8, 128 / 8) = 262,144. A capacity factor bounds the rows whatever the imbalance."""
    qwen, plan = load_model("qwen3-30b-a3b"), Plan(tp=1, pp=2, dp=8, ep=8, zero_stage=1, micro_batch_size=1)
    tr = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096)
    assert moe_tokens_per_rank(qwen, tr, plan) == (4096, 32768)
    skewed = tr.model_copy(update={"moe_load_imbalance": 1.25})
    assert moe_tokens_per_rank(qwen, skewed, plan) == (4096, 40960)
    assert moe_tokens_per_rank(qwen, tr.model_copy(update={"moe_load_imbalance": 20.0}), plan) == (4096, 262144)
    capped = qwen.model_copy(update={"capacity_factor": 1.0})
    assert moe_tokens_per_rank(capped, skewed, plan) == moe_tokens_per_rank(capped, tr, plan) == (4096, 32768)
    hw = load_hardware("h100-sxm-80gb")
    assert estimate_memory(qwen, hw, skewed, plan).peak_gib > estimate_memory(qwen, hw, tr, plan).peak_gib


def test_search_tables_hold_the_imbalanced_rows():
    from planner.candidates import Pins, SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=512, moe_load_imbalance=1.5)
    hw = load_hardware("h100-sxm-80gb")
    tables = build_tables(TINY, hw, tr, SearchSpace(max_micro_batch_size=2, pins=Pins(tp=1)))
    keys = legal_keys(tables)
    checked = [assert_entry_is_estimate(TINY, hw, tr, tables, k) for k in keys[:: max(1, len(keys) // 15)]]
    assert any(p.ep > 1 for p in checked)
